"""kvtrim's fused dequantizing Triton paged decode kernel (kvtrim.cache.triton_paged_quant), run on the CPU under
Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py before triton is imported): over a
``QuantizedBlockPool``'s own tensors, output, log-sum-exp and the fused continual metric equal attention over the
dequantized entries (dequantized in float32 and rounded to the pool's dtype, then float64 attention) for int8,
int4 and fp8, value groups, query groups, ragged lengths that are no multiple of the block size, several splits;
no host reads; through ``PagedBatchCache(decode_kernel="triton")`` the outputs and metric equal the gather path's
on a quantized pool. Selection: a quantized pool gets the fused kernel for "triton" (and "auto" on CUDA); "flash"
and unsupported formats are refused with the reason.

With a CUDA device (tests/conftest.py then leaves the interpreter off), the same tests run the compiled kernel.
The interpreter runs each program in Python, so every case is tiny.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

import triton
import triton.language as tl

from kvtrim.cache import paged_kernels
from kvtrim.cache.paged import PagedBatchCache, PagedSequence
from kvtrim.cache.paged_kernels import PackedKV
from kvtrim.cache.quant import KVQuant, dequantize_values, rotate, rotation
from kvtrim.cache.quantized_block_pool import QuantizedBlockPool
from kvtrim.errors import InvalidParameterError
from triton_paged_cases import (
    DEVICE,
    HOST_READS,
    Ops,
    assert_split_count_invariant,
    assert_triton_equals_gather,
    check,
    config,
    fused_metric,
    reference,
    row_tables,
)

torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------------- the kernel
def _case(fmt, lengths, block_size, head_dim, group, dtype, *, seed=0, heads=1, buffer=0):
    """A quantized pool filled with random entries, disjoint per-row block tables (one spare column), a random
    metric, positions and query positions."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lengths]
    blocks = sum(need) + 2
    pool = QuantizedBlockPool(blocks, block_size, head_dim, dtype, fmt, DEVICE)
    slots = torch.arange(blocks * block_size, device=DEVICE)
    keys = (torch.randn(len(slots), head_dim, generator=g) * 2 + torch.randn(head_dim, generator=g)).to(DEVICE)
    pool.write(slots, keys, torch.randn(len(slots), head_dim, generator=g).to(DEVICE))
    table, qpos, positions = row_tables(g, lengths, need, blocks, block_size, heads)
    return SimpleNamespace(
        pool=pool, q=torch.randn(len(lengths), group, head_dim, generator=g).to(dtype), table=table,
        seqlens=torch.tensor(lengths, dtype=torch.int32), lengths=lengths, heads=heads, buffer=buffer,
        metric=torch.rand(blocks, block_size, generator=g), positions=positions, qpos=qpos, scale=head_dim**-0.5,
    )  # fmt: skip


def _dequantized(pool, slots, side: str) -> torch.Tensor:
    """The entries at ``slots`` dequantized in float32. With value groups they are then rounded once to the pool's
    dtype (what that path feeds its dot products); with one scale per entry the kernel folds the scale and zero
    point out of its dots and computes with the exact dequantized values."""
    codes, scale, zero = (getattr(pool, f"{side}_{part}").flatten(0, 1)[slots] for part in ("codes", "scale", "zero"))
    exact = dequantize_values(codes, scale, zero, pool.quant, torch.float32)
    return exact if scale.shape[-1] == 1 else exact.to(pool.dtype)


def _reference(case):
    """Dequantize each row's entries, then attention in float64: out, lse, metric. A rotated pool's kernel reads the
    query rotated and rounded to the pool's dtype (``q R``, then the dtype's rounding): the reference attends with
    that query brought back to the model's channels, so a half-precision rounding of ``q R`` is not an error here."""

    def entries(slots):
        slots = slots.to(DEVICE)
        return tuple(_dequantized(case.pool, slots, side).cpu().double() for side in ("key", "value"))

    fmt = case.pool.quant
    if fmt.rotate:
        q = rotate(case.q, fmt).double() @ rotation(case.q.shape[-1]).double().T
        case = SimpleNamespace(**{**vars(case), "q": q})
    return reference(case, case.pool.block_size, entries)


def _packed(pool):
    return (PackedKV(pool.key_codes, pool.key_scale, pool.key_zero),
            PackedKV(pool.value_codes, pool.value_scale, pool.value_zero))  # fmt: skip


def _run(case, *, metric: bool, **kwargs):
    from kvtrim.cache.triton_paged_quant import paged_decode_quant

    pool_metric, fused = fused_metric(case, metric)
    keys, values = _packed(case.pool)
    out, lse = paged_decode_quant(
        case.q.to(DEVICE), keys, values, case.seqlens.to(DEVICE), case.table.to(DEVICE), 0, case.scale, fused,
        kv_quant=case.pool.quant, **kwargs,
    )  # fmt: skip
    return out.cpu(), lse.cpu(), pool_metric.cpu()


POOL_INT4 = KVQuant("int4", residual=0, value_group=8, sink=0, rotate=False)  # a pool's: no window, no rotation
# (kv_quant, dtype, G, head_dim, block_size, lengths, num_splits, metric, buffer)
CASES = [
    ("int8", torch.float32, 3, 32, 16, [1, 16, 53, 7], 3, True, 0),  # SmolLM2's G = 3, 53 = 3 blocks + 5
    ("int4", torch.float32, 4, 32, 8, [29, 3, 17, 40], 2, True, 2),  # two sequences of two KV heads; rotated
    ("int4:rotate=0", torch.float32, 4, 32, 8, [29, 3, 17, 40], 2, True, 2),  # in the model's channels
    ("int8:rotate=1", torch.bfloat16, 3, 32, 16, [1, 16, 53, 7], 3, True, 0),  # query and output rotated in bf16
    ("fp8", torch.float32, 2, 16, 4, [13, 6, 1], 4, True, 0),
    ("int4", torch.float16, 4, 24, 12, [25, 11], 3, False, 0),  # head_dim 24: halves of 12 (padded to 16)
    ("fp8", torch.float32, 3, 24, 12, [30, 7, 12], 2, True, 0),  # one-byte codes split into padded halves
    ("int8", torch.bfloat16, 4, 64, 16, [40, 9], None, True, 1),  # the split heuristic
    # 4 scales per entry; a pool's KVQuant has no window (residual=0, not int4's default)
    (POOL_INT4, torch.float32, 3, 32, 8, [19, 4, 33], 3, True, 0),
    (KVQuant("int8", value_group=16), torch.float16, 2, 32, 16, [21, 16], 2, False, 0),
]


@pytest.mark.parametrize(
    ("fmt", "dtype", "group", "head_dim", "block_size", "lengths", "num_splits", "metric", "buffer"), CASES
)
def test_fused_kernel_equals_dequantize_then_attention(fmt, dtype, group, head_dim, block_size, lengths, num_splits,
                                                       metric, buffer):  # fmt: skip
    heads = 2 if len(lengths) % 2 == 0 else 1
    case = _case(fmt, lengths, block_size, head_dim, group, dtype, seed=head_dim + group, heads=heads, buffer=buffer)
    got = _run(case, metric=metric, num_splits=num_splits)
    check(case, got, _reference(case), metric=metric, lse_tol=(2e-5, 1e-3), metric_tol=(1e-4, 1e-3))


_fp8_device = None  # one of the kernel's fp8 decoders, wrapped in the mode in force by the test below


def _fp8_table_kernel(src_ptr, dst_ptr):
    offs = tl.arange(0, 256)
    tl.store(dst_ptr + offs, _fp8_device(tl.load(src_ptr + offs)))


@pytest.mark.parametrize("decoder", ["_fp8_to_float", "_fp8_native"])
def test_every_fp8_code_decodes_exactly(decoder):
    """Both e4m3 decoders (integer operations for GPUs before sm_89; the hardware's conversion): every finite
    pattern (subnormals, zeros of both signs, ±448) equals torch's float8_e4m3fn value."""
    global _fp8_device
    from kvtrim.cache import triton_paged_quant

    if decoder == "_fp8_native" and not triton_paged_quant.native_fp8(torch.device(DEVICE)):
        pytest.skip("this GPU has no e4m3 conversion (before sm_89)")
    _fp8_device = triton.jit(getattr(triton_paged_quant, decoder))
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)
    got = torch.empty(256, dtype=torch.float32, device=DEVICE)
    triton.jit(_fp8_table_kernel)[(1,)](codes, got)
    want = codes.cpu().view(torch.float8_e4m3fn).float()
    finite = ~torch.isnan(want)
    assert int(finite.sum()) == 254 and torch.equal(got.cpu()[finite], want[finite])
    assert torch.equal(torch.signbit(got.cpu()[finite]), torch.signbit(want[finite]))


def test_both_fp8_decoders_give_the_same_attention(monkeypatch):
    """The kernel with the integer decoder (GPUs before sm_89) and with the hardware's conversion: equal outputs."""
    from kvtrim.cache import triton_paged_quant

    case = _case("fp8", [21, 9], 8, 16, 2, torch.float32, seed=5)
    native = _run(case, metric=True)
    monkeypatch.setattr(triton_paged_quant, "native_fp8", lambda device: False)
    integer = _run(case, metric=True)
    for a, b in zip(native, integer, strict=True):
        assert torch.equal(a, b)


def test_split_count_does_not_change_the_result():
    assert_split_count_invariant(_run, _case("int4", [70, 20, 9], 8, 32, 4, torch.float32, seed=3), (2, 5))


def test_launch_reads_nothing_on_the_host():
    case = _case("int8", [30, 5], 8, 16, 2, torch.float32, seed=1)
    with Ops() as seen:
        _run(case, metric=True)
    assert not HOST_READS & set(seen.names)


def test_bad_packed_tensors_are_refused():
    case = _case("int8", [5], 4, 16, 2, torch.float32)
    keys, values = _packed(case.pool)
    from kvtrim.cache.triton_paged_quant import paged_decode_quant

    args = (case.q, keys, values, case.seqlens, case.table, 0, 1.0)
    with pytest.raises(InvalidParameterError, match=r"keys: codes must be uint8 \[num_blocks, block_size, 8\]"):
        paged_decode_quant(*args, kv_quant="int4")  # int8 codes read as int4
    with pytest.raises(InvalidParameterError, match=r"reads no full-precision entries; KVQuant\.residual must be 0"):
        paged_decode_quant(*args, kv_quant=KVQuant("int8", residual=4))
    with pytest.raises(InvalidParameterError, match=r"reads no full-precision entries; KVQuant\.sink must be 0, got 1"):
        paged_decode_quant(*args, kv_quant=KVQuant("int4", residual=0, sink=1))
    with pytest.raises(InvalidParameterError, match="block_n must be a power of two"):
        paged_decode_quant(*args, kv_quant="int8", block_n=24)


# ---------------------------------------------------------------------------------------------------- the backend
@pytest.mark.parametrize(
    ("fmt", "accumulate", "buffer", "pad"),
    [
        ("int8", True, 0, 0),
        ("int4", True, 3, 2),  # rotated (int4's default)
        ("int4:rotate=0", True, 0, 1),
        ("fp8", False, 0, 0),
        (KVQuant("int4", residual=0, value_group=8, sink=0, rotate=False), True, 0, 0),
    ],
)
def test_triton_decode_on_a_quantized_pool_equals_the_gather_path(fmt, accumulate, buffer, pad):
    """GQA 6/2 (G = 3), rows of different lengths after evictions; ``pad``: padding rows of a bucketed batch."""
    cfg = config(heads=6, kv_heads=2, head_dim=16)

    def make_pool(blocks: int, block_size: int) -> QuantizedBlockPool:
        return QuantizedBlockPool(blocks, block_size, cfg.head_dim, torch.float32, fmt, DEVICE, scratch=True)

    pool, gather_pool = assert_triton_equals_gather(cfg, (3 * 8 + 5, 8 + 3, 6), make_pool, kernel_name="triton_quant",
                                                    block_size=8, accumulate=accumulate, buffer=buffer, pad=pad,
                                                    atol=2e-5, rtol=2e-5)  # fmt: skip
    real = slice(0, pool.num_blocks)  # padding rows share the scratch block; their writes race on a GPU
    assert torch.equal(pool.key_codes[real], gather_pool.key_codes[real])


def test_a_kernel_object_must_read_the_pool_format():
    cfg = config(heads=4, kv_heads=2, head_dim=16)
    qpool = QuantizedBlockPool(8, 8, 16, torch.float32, "int8", DEVICE)
    plain = paged_kernels.triton_kernel()
    with pytest.raises(InvalidParameterError, match="cannot read a pool with kv_quant='int8'"):
        PagedBatchCache(cfg, qpool, [PagedSequence(qpool, 2, 2)], decode_kernel=plain)
    from kvtrim.cache.block_pool import BlockPool

    pool = BlockPool(8, 8, 16, torch.float32, DEVICE)
    with pytest.raises(InvalidParameterError, match="reads quantized pools only"):
        PagedBatchCache(cfg, pool, [PagedSequence(pool, 2, 2)], decode_kernel=paged_kernels.triton_quant_kernel())


# ---------------------------------------------------------------------------------------------------- selection
KW = dict(dtype=torch.float32, block_size=8, head_dim=16)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_triton_on_a_quantized_pool_is_the_fused_kernel(fmt):
    choice = paged_kernels.choose_decode_kernel("triton", device=DEVICE, kv_quant=fmt, **KW)
    assert choice.kernel.name == "triton_quant" and fmt in choice.kernel.kv_quant and choice.kernel.fuses_metric


def test_flash_and_unsupported_formats_are_refused(monkeypatch):
    choose = paged_kernels.choose_decode_kernel
    with pytest.raises(InvalidParameterError, match="decode_kernel='flash' cannot be used with kv_quant='int4'"):
        choose("flash", device=DEVICE, kv_quant="int4", **KW)
    with pytest.raises(InvalidParameterError, match=r"no full-precision entries, got KVQuant\.residual=4"):
        choose("triton", device=DEVICE, kv_quant=KVQuant("int8", residual=4), **KW)
    with pytest.raises(InvalidParameterError, match=r"no full-precision entries, got KVQuant\.sink=2"):
        choose("triton", device=DEVICE, kv_quant=KVQuant("int8", sink=2), **KW)
    with pytest.raises(InvalidParameterError, match="float16, bfloat16 or float32 KV"):
        choose("triton", device=DEVICE, kv_quant="int8", **{**KW, "dtype": torch.float64})
    from kvtrim.cache import triton_paged_quant

    monkeypatch.setattr(triton_paged_quant, "QUANT_FORMATS", ("int8",))  # a format the kernel would not read
    with pytest.raises(InvalidParameterError, match=r"kv_quant='int4': it reads kv_quant int8 .*got 'int4'"):
        choose("triton", device=DEVICE, kv_quant="int4", **KW)
    monkeypatch.setattr(paged_kernels, "_triton_on_cuda", lambda *a: True)  # "auto" never picks the interpreter
    auto = choose("auto", device=DEVICE, kv_quant="int4", **KW)
    assert auto.kernel is None and "got 'int4'" in dict(auto.refused)["triton_quant"]


def test_without_cuda_or_interpreter_the_quantized_pool_gathers(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    choose = paged_kernels.choose_decode_kernel
    with pytest.raises(InvalidParameterError, match=r"kv_quant='int8': it needs a CUDA device.*TRITON_INTERPRET=1"):
        choose("triton", device="cpu", kv_quant="int8", **KW)
    auto = choose("auto", device="cpu", kv_quant="int8", **KW)
    refused = dict(auto.refused)
    assert auto.kernel is None and set(refused) == {"vllm_flash_attn", "flash_attn", "triton_quant"}
    assert "read unquantized blocks" in refused["flash_attn"] and "CUDA device" in refused["triton_quant"]
    monkeypatch.setattr(paged_kernels, "_load_triton_quant", lambda: None)
    with pytest.raises(InvalidParameterError, match="triton package is not importable"):
        choose("triton", device="cuda", kv_quant="int8", **KW)


def test_auto_picks_the_fused_kernel_on_cuda(monkeypatch):
    monkeypatch.setattr(paged_kernels, "_triton_on_cuda", lambda *a: True)  # pretend the CPU pool is on CUDA
    monkeypatch.setattr(paged_kernels, "probe_kernel", lambda *a, **k: None)
    choice = paged_kernels.choose_decode_kernel("auto", device="cpu", kv_quant="int4", **KW)
    assert choice.kernel.name == "triton_quant"
    assert {name for name, _ in choice.refused} == {"vllm_flash_attn", "flash_attn"}
    assert paged_kernels.choose_decode_kernel("gather", device="cpu", kv_quant="int4", **KW).kernel is None
