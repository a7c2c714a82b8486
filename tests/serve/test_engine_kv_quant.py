"""The engine over a quantized block pool (``kv_quant``): logits and greedy tokens against the unquantized pool,
packed bytes in the pool and in admission, preemption under a tight pool, the static decode step, and the errors
for a bad format or a block-table kernel."""

from __future__ import annotations

import os

import pytest
import torch
from typer.testing import CliRunner

from conftest import byte_tokenizer, random_text, tiny_model
from kvtrim.cache.quant import KVQuant
from kvtrim.cache.quantized_block_pool import QuantizedBlockPool
from kvtrim.errors import InvalidParameterError
from kvtrim.serve.engine import Engine
from kvtrim.serve.model_runner import ModelRunner, PrefillChunk
from kvtrim.serve.types import SamplingParams


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_model("llama")  # float32, head_dim 16, 2 layers x 2 KV heads


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _run(model, tok, prompts, kv_quant, max_tokens=8, **kwargs):
    kwargs = {"kv_memory_bytes": 200_000, "block_size": 4, "min_cache_tokens": 16, "protected_window": 8} | kwargs
    engine = Engine(model, tok, kv_quant=kv_quant, **kwargs)
    handles = [engine.submit(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    while engine.has_work():
        engine.step()
        assert engine.pool.num_used == engine.held_blocks()
    assert engine.pool.num_free == engine.pool.num_blocks
    outs = [h.result(timeout=0) for h in handles]
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    return engine, [o.token_ids for o in outs]


@torch.inference_mode()
def _logits(model, tok, kv_quant) -> torch.Tensor:
    """A packed prefill of three prompts, then 12 batched decode steps fed the same random tokens."""
    runner = ModelRunner(model, kv_blocks=400, block_size=4, kv_quant=kv_quant)
    ids = [tok(random_text(40 + 9 * i, seed=i))["input_ids"] for i in range(3)]
    seqs = [runner.new_sequence() for _ in ids]
    out = [runner.prefill([PrefillChunk(s, x) for s, x in zip(seqs, ids, strict=True)]).clone()]
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        out.append(runner.decode(seqs, torch.randint(0, 200, (3,), generator=g).tolist()).clone())
    return torch.stack(out)


def test_logits_stay_close_to_the_unquantized_pool(model, tok):
    ref = _logits(model, tok, None)
    scale = ref.abs().max()
    # measured 0.18 % and 2.4 % of the largest logit; value groups: decode dequantizes instead of reading codes
    grouped = KVQuant("int4", residual=0, value_group=8, sink=0, rotate=False)
    for fmt, bound in (("int8", 0.005), ("int4", 0.05), (grouped, 0.05)):
        got = _logits(model, tok, fmt)
        assert float((got - ref).abs().max() / scale) < bound, fmt
        if fmt == "int8":  # int4 with value groups flips a near tie of the random model (within the bound)
            assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("rate", [1.0, 4.0])
def test_int8_greedy_tokens_equal_the_unquantized_engine(model, tok, rate):
    """Short generations (8 tokens): the same greedy tokens with and without compression. A random model's logits
    are flat, so over longer generations a near tie may flip (1 of 6 requests diverged at its 12th token at 16
    tokens); the logit bound above is the guarantee."""
    prompts = [random_text(60 + 7 * i, seed=i) for i in range(6)]
    _, want = _run(model, tok, prompts, None, compression_rate=rate)
    engine, got = _run(model, tok, prompts, "int8", compression_rate=rate)
    assert got == want
    assert isinstance(engine.pool, QuantizedBlockPool) and engine.kv_quant == "int8"
    assert engine.decode_kernel == "gather"
    if rate > 1:
        assert engine.stats.compressions > 0


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_pool_bytes_are_packed_and_admit_more_sequences(model, tok, fmt):
    """At equal kv_memory_bytes the quantized pool holds more blocks (bytes measured from its tensors) and the
    engine admits more sequences at once: admission counts blocks of packed bytes."""
    kv_bytes = 40_000
    prompts = [random_text(48, seed=i) for i in range(12)]
    kwargs = {"kv_memory_bytes": kv_bytes, "compression_rate": 4.0, "prefill_chunk": 16}
    base, _ = _run(model, tok, prompts, None, max_tokens=12, **kwargs)
    engine, _ = _run(model, tok, prompts, fmt, max_tokens=12, **kwargs)
    entry = 2 * 16 * engine.pool.quant.bits // 8 + 8  # codes + float16 (scale, zero) of K and of V
    assert engine.pool.nbytes() == engine.pool.num_blocks * 4 * entry <= kv_bytes
    assert base.pool.nbytes() == base.pool.num_blocks * 4 * 2 * 16 * 4 <= kv_bytes
    assert engine.pool.num_blocks == kv_bytes // (4 * entry)
    assert engine.stats.max_decode_batch > base.stats.max_decode_batch
    assert engine.stats.peak_blocks_used > base.pool.num_blocks  # more entries than the plain pool can hold


def test_tight_quantized_pool_preempts_and_finishes(model, tok):
    """60 blocks of 4 int8 entries (160 B each): prompts admitted at their prefill size outgrow the pool."""
    prompts = [random_text(5, seed=i) for i in range(6)]
    engine, _ = _run(model, tok, prompts, "int8", max_tokens=40, kv_memory_bytes=60 * 160)
    assert engine.pool.num_blocks == 60 and engine.stats.preemptions > 0


def test_static_decode_step_reads_the_quantized_pool(model, tok):
    prompts = [random_text(30 + 11 * i, seed=i) for i in range(3)]
    _, want = _run(model, tok, prompts, "int4")
    _, got = _run(model, tok, prompts, "int4", decode_buckets=True, static_decode=True)
    assert got == want


def test_fused_triton_kernel_gives_the_gather_paths_tokens(model, tok):
    """decode_kernel="triton" on a quantized pool runs the fused dequantizing kernel (here under Triton's
    interpreter, on the CPU model) through the static decode step (the one CUDA graphs capture) and generates the
    eager gather path's tokens, compression included."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"):
        pytest.skip("the tiny model is on the CPU: the fused kernel runs there only under Triton's interpreter")
    prompts = [random_text(30 + 11 * i, seed=i) for i in range(2)]
    kw = dict(max_tokens=3, compression_rate=4)
    _, want = _run(model, tok, prompts, "int4", **kw)
    engine, got = _run(model, tok, prompts, "int4", decode_kernel="triton", decode_buckets=True, static_decode=True,
                       **kw)  # fmt: skip
    assert engine.decode_kernel == "triton_quant" and got == want


def test_bad_kv_quant_and_kernels_are_refused(model, tok, monkeypatch):
    with pytest.raises(InvalidParameterError, match="kv_quant must be one of"):
        Engine(model, tok, kv_blocks=64, kv_quant="int3")
    with pytest.raises(InvalidParameterError, match="decode_kernel='flash' cannot be used with kv_quant='int4'"):
        Engine(model, tok, kv_blocks=64, kv_quant="int4", decode_kernel="flash")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a CPU pool: the fused Triton kernel needs CUDA
    with pytest.raises(InvalidParameterError, match="decode_kernel='triton' cannot be used with kv_quant='int4'"):
        Engine(model, tok, kv_blocks=64, kv_quant="int4", decode_kernel="triton")
    engine = Engine(model, tok, kv_blocks=64, kv_quant="int4", decode_kernel="auto")
    refused = engine.stats.decode_kernel_refused
    assert engine.decode_kernel == "gather" and all("kv_quant" in refused[n] for n in ("vllm_flash_attn", "flash_attn"))
    assert "CUDA device" in refused["triton_quant"]  # "auto" never picks Triton's interpreter


def test_serve_cli_rejects_a_bad_kv_quant_before_loading():
    from kvtrim.cli import app

    result = CliRunner().invoke(app, ["serve", "--model", "no-such-model", "--kv-quant", "int3"])
    assert result.exit_code != 0
    assert "kv_quant must be one of" in result.output
    # a pool has no full-precision window: one asked for is refused before loading too
    result = CliRunner().invoke(app, ["serve", "--model", "no-such-model", "--kv-quant", "int4:residual=32"])
    assert result.exit_code != 0 and "residual must be 0, got 32" in result.output


def test_serve_cli_builds_a_quantized_pool(tmp_path, monkeypatch):
    import gc

    import kvtrim.serve.http as http_module
    from kvtrim.cli import app

    tiny_model("llama").save_pretrained(tmp_path)
    byte_tokenizer().save_pretrained(tmp_path)
    seen = {}
    monkeypatch.setattr(http_module, "serve", lambda engine, **kw: seen.update(engine=engine))
    monkeypatch.setattr(gc, "freeze", lambda: None)
    args = ["serve", "--model", str(tmp_path), "--kv-memory", "1MiB", "--compression-rate", "8", "--kv-quant", "int4"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    pool = seen["engine"].pool
    assert isinstance(pool, QuantizedBlockPool)
    assert pool.quant == KVQuant("int4", residual=0, sink=0, rotate=True)  # no window and no sink in a pool
    assert pool.num_blocks == 2**20 // (16 * (2 * 8 + 8)) and pool.nbytes() <= 2**20  # head_dim 16: 24 B per entry
    assert "packed as int4:group_size=64,residual=0,sink=0,rotate=1" in result.output
