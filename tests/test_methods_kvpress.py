"""ExpectedAttention, KeyDiff, ChunkKV, KVzip, CurDKV, leverage, chunk attention, Compactor, DMS, per-layer
ratios, block-wise compression, SimLayerKV, CapKV, FINCH, entropy-gated ChunkKV, KVCompose and merge on
evict, CaM, key re-rotation, KVgrad in the registry: papers, exactness, real compaction, both modes."""

from __future__ import annotations

import pytest
import torch

import kvtrim
from conftest import byte_tokenizer, random_text, tiny_model
from kvtrim.errors import InvalidParameterError
from kvtrim.methods import get_method, method_info

PAPERS = {
    "expected_attention": "2510.00636",
    "keydiff": "2504.15364",
    "chunkkv": "2502.00299",
    "chunkkv_reuse": "2502.00299",
    "kvzip": "2505.23416",
    "curdkv": "2509.15038",
    "leverage": "2507.08143",
    "noncausal_attention": "2507.08143",
    "compactor": "2507.08143",
    "dms": "2506.05345",
    "per_layer_ratio": "2404.14469",
    "block": "2504.15364",
    "simlayerkv": "2410.13846",
    "capkv": "2604.25975",
    "finch": "2408.00167",
    "entropy_chunkkv": "2502.00299",
    "kvcompose": "2509.05165",
    "merging": "2406.13035",
    "cam": "LCTmppB165",
    "key_rerotation": "2408.00167",
    "kvgrad": "cg1wTCJjjk",
}
NEEDS_QUESTION = {"finch"}  # selects with the question's attention: compresses question-aware prompts only
# kvpress wrappers whose cited paper is their default parts' or none
WRAPPERS = {"per_layer_ratio", "chunked", "merging", "cam", "key_rerotation"}
CTX = random_text(300, seed=3)


@pytest.fixture
def tok_dir(tmp_path):
    path = tmp_path / "tok"
    byte_tokenizer().save_pretrained(path)
    return str(path)


def _params(method, tok_dir):
    return {"tokenizer": tok_dir} if method in ("kvzip", "kvgrad") else {}


@pytest.mark.parametrize("method", sorted(PAPERS))
def test_registry_entries_cite_their_paper(method):
    info = method_info(method)
    assert PAPERS[method] in info.paper and PAPERS[method] in (info.factory.__doc__ or "")
    pipe = get_method(method)
    docs = [type(part).__doc__ or "" for part in (pipe.scorer, pipe.budget, pipe.selector)]
    if method not in WRAPPERS:  # a kvpress wrapper: its cited paper is its default parts'
        assert any(PAPERS[method] in doc for doc in docs)


@pytest.mark.parametrize("question_aware", [False, True])
@pytest.mark.parametrize("method", [*sorted(PAPERS), "chunked"])
def test_budget_at_context_answers_like_the_full_cache(method, question_aware, tokenizer, tok_dir):
    model = tiny_model("llama")
    full = kvtrim.generate(model, tokenizer, CTX, ["q?", "r?"] if not question_aware else "q?", method="full",
                           question_aware=question_aware, max_new_tokens=8)
    res = kvtrim.generate(model, tokenizer, CTX, ["q?", "r?"] if not question_aware else "q?", method=method,
                          budget=10_000, question_aware=question_aware, max_new_tokens=8,
                          method_params=_params(method, tok_dir))
    assert res.answers == full.answers
    assert res.stats.kv_entries_after == res.stats.kv_entries_before


@pytest.mark.parametrize(
    ("method", "question_aware"),
    [(m, qa) for m in [*sorted(PAPERS), "chunked"] for qa in (False, True) if qa or m not in NEEDS_QUESTION],
)
def test_compression_frees_bytes_of_the_evicted_entries(method, question_aware, tokenizer, tok_dir):
    model = tiny_model("qwen2", layers=3)
    res = kvtrim.generate(model, tokenizer, CTX, "q?", method=method, ratio=0.75, question_aware=question_aware,
                          max_new_tokens=4, method_params=_params(method, tok_dir))
    st = res.stats
    per_entry = st.kv_bytes_before / st.kv_entries_before  # K and V of one (token, layer, KV head)
    assert st.kv_bytes_after == st.kv_entries_after * per_entry
    budget_total = round(st.context_tokens * 0.25) * 3 * 2
    # per_layer_ratio without ratios keeps the request in every layer; chunked's one chunk of 1024 positions
    # holds the whole context, so its quota is the budget
    if method.startswith("chunkkv"):  # whole chunks: at most chunk - 1 entries under the budget per head
        assert budget_total - 9 * 3 * 2 <= st.kv_entries_after <= budget_total
    else:
        assert st.kv_entries_after == budget_total
    assert len(res.answers) == 1


def test_kvzip_rereads_the_prompt_after_the_instruction(tokenizer, tok_dir):
    model = tiny_model("llama")
    session = kvtrim.Session(model, tokenizer, CTX, methods=["kvzip"])
    a = session.run("kvzip", ratio=0.5, questions="q?", max_new_tokens=4, method_params={"tokenizer": tok_dir})
    meta = a.stats.compression_metadata
    n_instr = len(byte_tokenizer()("\n\nRepeat the previous context exactly.", add_special_tokens=False)["input_ids"])
    assert meta["kvzip_repeat_tokens"] == n_instr
    assert meta["kvzip_reread_tokens"] == a.stats.context_tokens and meta["kvzip_scores_reused"] is False
    b = session.run("kvzip", ratio=0.75, questions="q?", max_new_tokens=4, method_params={"tokenizer": tok_dir})
    assert b.stats.compression_metadata["kvzip_scores_reused"] is True  # one pass per prefill, any ratio
    fresh = kvtrim.Session(model, tokenizer, CTX, methods=["kvzip"])
    c = fresh.run("kvzip", ratio=0.75, questions="q?", max_new_tokens=4, method_params={"tokenizer": tok_dir})
    assert c.answers == b.answers and c.stats.kv_entries_after == b.stats.kv_entries_after
    with pytest.raises(InvalidParameterError, match="tokenizer"):
        session.run("kvzip", ratio=0.5, questions="q?", method_params={"tokenizer": "/nonexistent/tok"})


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_kvzip_scores_are_reused_only_within_one_entry_format(fmt, tokenizer, tok_dir):
    """A Session's quantized KVzip run re-reads through its own quantized entries: it does not take the scores a
    float run of the same prefill left behind, and answers and splits as a session that never ran in float."""
    model = tiny_model("llama")
    params = {"tokenizer": tok_dir}
    session = kvtrim.Session(model, tokenizer, CTX, methods=["kvzip"])
    session.run("kvzip", ratio=0.75, questions="q?", max_new_tokens=4, method_params=params)
    after_float = session.run("kvzip", ratio=0.75, questions="q?", max_new_tokens=4, method_params=params,
                              kv_quant=fmt)  # fmt: skip
    assert after_float.stats.compression_metadata["kvzip_scores_reused"] is False
    again = session.run("kvzip", ratio=0.5, questions="q?", max_new_tokens=4, method_params=params, kv_quant=fmt)
    assert again.stats.compression_metadata["kvzip_scores_reused"] is True  # same format: one pass per prefill
    alone = kvtrim.Session(model, tokenizer, CTX, methods=["kvzip"]).run(
        "kvzip", ratio=0.75, questions="q?", max_new_tokens=4, method_params=params, kv_quant=fmt
    )
    assert after_float.stats.layer_budgets == alone.stats.layer_budgets  # the same per-head split of the budget
    assert after_float.answers == alone.answers


def test_kvzip_without_a_tokenizer_warns_and_says_so(tokenizer):
    model = tiny_model("llama")
    with pytest.warns(UserWarning, match="without the repeat instruction"):
        res = kvtrim.generate(model, tokenizer, CTX, "q?", method="kvzip", ratio=0.5, max_new_tokens=2)
    assert res.stats.compression_metadata["kvzip_repeat_tokens"] == 0


def test_prompt_ids_are_recorded_for_the_prompt_only():
    model = tiny_model("llama")
    ids = torch.randint(3, 200, (2, 30), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with pytest.warns(UserWarning, match="kvzip"), kvtrim.compressing(model, "kvzip", ratio=0.5) as cache:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                       eos_token_id=None, past_key_values=cache)
    assert cache.compressions == 1 and cache.prompt_ids.shape == (2, 30)  # decoded tokens are not the prompt
    assert bool((cache.prompt_ids[0, :5] == -1).all()) and torch.equal(cache.prompt_ids[1], ids[1])
    with kvtrim.compressing(model, "snapkv", ratio=0.5) as other:
        model(input_ids=ids, past_key_values=other, use_cache=True)
    assert other.prompt_ids is None  # only methods that ask for the ids get them


def test_chunkkv_reuse_shares_positions_between_paired_layers():
    model = tiny_model("llama", layers=4)
    ids = torch.randint(3, 200, (1, 80), generator=torch.Generator().manual_seed(5))
    kept = {}
    for method in ("chunkkv", "chunkkv_reuse"):
        with kvtrim.compressing(model, method, budget=30) as cache:
            model(input_ids=ids, past_key_values=cache, use_cache=True)
            cache.compress()
        kept[method] = [layer.store.positions[0, 0].tolist() for layer in cache.layers]
    reuse = kept["chunkkv_reuse"]
    assert reuse[0] == reuse[1] and reuse[2] == reuse[3]
    assert kept["chunkkv"][0] == reuse[0] and kept["chunkkv"][2] == reuse[2]  # reference layers select alone
    assert kept["chunkkv"] != reuse  # random layers disagree without reuse


def test_dms_keeps_only_the_window_when_nothing_clears_the_threshold(tokenizer):
    model = tiny_model("qwen2", layers=3)
    res = kvtrim.generate(model, tokenizer, CTX, "q?", method="dms", ratio=0.0, max_new_tokens=4,
                          method_params={"threshold": float("inf"), "recent": 16})
    assert res.stats.kv_entries_after == 16 * 3 * 2  # the last 16 tokens of every (layer, KV head)
    res = kvtrim.generate(model, tokenizer, CTX, "q?", method="dms", ratio=0.0, max_new_tokens=4,
                          method_params={"threshold": float("-inf"), "recent": 16})
    assert res.stats.kv_entries_after == res.stats.kv_entries_before  # everything clears -inf


def test_dms_refuses_an_unknown_scorer():
    with pytest.raises(InvalidParameterError, match="scorer"):
        get_method("dms", scorer="nope")
    with pytest.raises(InvalidParameterError, match="scorer"):
        get_method("dms", scorer="dms")


def test_per_layer_ratio_keeps_each_layer_s_fraction(tokenizer):
    model = tiny_model("qwen2", layers=3)
    res = kvtrim.generate(model, tokenizer, CTX, "q?", method="per_layer_ratio", ratio=0.0, max_new_tokens=2,
                          method_params={"ratios": [0.0, 0.5, 0.75]})
    n = res.stats.context_tokens
    assert res.stats.kv_entries_after == (n + n // 2 + n // 4) * 2  # 2 KV heads; ratio=0 does not skip


def test_wrappers_refuse_methods_they_cannot_reuse():
    for params in ({"base": "nope"}, {"base": "per_layer_ratio"}, {"base": "think"}, {"base": "lagkv"}):
        with pytest.raises(InvalidParameterError, match="base"):
            get_method("per_layer_ratio", **params)
    with pytest.raises(InvalidParameterError, match="scorer"):
        get_method("dms", scorer="kvcompress")


def test_chunked_is_knorm_inside_each_chunk(tokenizer):
    model = tiny_model("qwen2", layers=2)
    res = kvtrim.generate(model, tokenizer, CTX, "q?", method="chunked", ratio=0.5, max_new_tokens=2,
                          method_params={"chunk": 100})
    n = res.stats.context_tokens
    quotas = [c * (n // 2) // n for c in (100, 100, n - 200)]  # 3 chunks of positions
    assert res.stats.kv_entries_after == sum(max(1, q) for q in quotas) * 2 * 2  # 2 layers, 2 KV heads
    info = method_info("chunked")
    assert "FINCH" in info.paper and "ChunkPress" in info.paper


@pytest.mark.parametrize("question_aware", [False, True])
def test_simlayerkv_lazy_layers_keep_their_ends_and_busy_layers_everything(question_aware, tokenizer):
    model = tiny_model("qwen2", layers=3)
    lazy = kvtrim.generate(model, tokenizer, CTX, "q?", method="simlayerkv", ratio=0.0, max_new_tokens=2,
                           question_aware=question_aware, method_params={"threshold": 0.0, "n_recent": 16})
    assert lazy.stats.kv_entries_after == (4 + 16) * 2 * 3  # every layer lazy: 4 + 16 tokens, 2 KV heads
    assert lazy.stats.kv_bytes_after == lazy.stats.kv_entries_after * (
        lazy.stats.kv_bytes_before // lazy.stats.kv_entries_before)
    busy = kvtrim.generate(model, tokenizer, CTX, "q?", method="simlayerkv", ratio=0.0, max_new_tokens=8,
                           question_aware=question_aware, method_params={"threshold": 1.0, "n_recent": 16})
    assert busy.stats.kv_entries_after == busy.stats.kv_entries_before  # no layer's mass exceeds 1
    full = kvtrim.generate(model, tokenizer, CTX, "q?", method="full", max_new_tokens=8,
                           question_aware=question_aware)
    assert busy.answers == full.answers


def test_simlayerkv_and_block_refuse_bad_parameters():
    for params in ({"n_last": 0}, {"threshold": 2.0}, {"n_recent": -1}):
        with pytest.raises(InvalidParameterError, match=next(iter(params))):
            get_method("simlayerkv", **params)
    for params in ({"base": "nope"}, {"base": "block"}, {"base": "kvzip"}, {"base": "think"}):
        with pytest.raises(InvalidParameterError, match="base"):
            get_method("block", **params)
    with pytest.raises(InvalidParameterError, match="block"):
        get_method("block", block=0)


def test_block_with_knorm_keeps_what_knorm_keeps(tokenizer):
    model = tiny_model("qwen2", layers=2)
    kw = {"ratio": 0.6, "max_new_tokens": 6}
    res = kvtrim.generate(model, tokenizer, CTX, "q?", method="block", method_params={"base": "knorm", "block": 32},
                          **kw)
    ref = kvtrim.generate(model, tokenizer, CTX, "q?", method="knorm", **kw)
    assert res.answers == ref.answers and res.stats.kv_entries_after == ref.stats.kv_entries_after


def test_cam_merges_while_decoding_under_a_schedule(tokenizer):
    model = tiny_model("llama", layers=2)
    res = kvtrim.generate(model, tokenizer, CTX, "q?", method="cam@every:4", budget=60, max_new_tokens=12)
    assert len(res.answers) == 1 and res.stats.compressions >= 3  # after prefill, then every 4 new tokens
