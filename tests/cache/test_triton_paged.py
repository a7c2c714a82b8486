"""kvtrim's split-K Triton paged decode kernel (kvtrim.cache.triton_paged), run on the CPU under Triton's
interpreter (``TRITON_INTERPRET=1``, Triton's debug mode, set by tests/conftest.py before triton is imported):
output, log-sum-exp and the fused continual metric equal a float64 PyTorch reference over dtypes, query groups,
head dims, block sizes, split counts, tiles and rows of 0 to 32k tokens; the split plan, the tile pruning, no host
reads, no logits stored without the metric; through ``PagedBatchCache(decode_kernel="triton")`` the outputs and
the metric equal the gather path's on uneven paged batches. Selection: "triton" is refused with a reason where it
cannot run; "auto" orders the kernels.

With a CUDA device (tests/conftest.py then leaves the interpreter off), the same tests run the compiled kernel on
CUDA (the ``tests`` stage of benchmarks/gpu_check.sh).
The interpreter runs each program in Python, so the batches are small.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

import paged_kernel_reference as ref
from kvtrim.cache import paged_kernels
from kvtrim.cache.paged import BlockPool, PagedBatchCache, PagedSequence
from kvtrim.errors import InvalidParameterError
from triton_paged_cases import (
    DEVICE,
    HOST_READS,
    INTERPRETED,
    Ops,
    assert_split_count_invariant,
    assert_triton_equals_gather,
    check,
    config,
    decode,
    fused_metric,
    reference,
    row_tables,
)

torch.set_num_threads(1)


def _dense(q, keys, values, scale):
    """``q [G, d]`` over ``keys/values [L, d]`` in float64: (out [G, d], lse [G])."""
    out, lse = ref._attend_one(q[None], keys[:, None], values[:, None], scale, causal=False)
    return out[0], lse[:, 0]


# ---------------------------------------------------------------------------------------------------- the kernel
@pytest.mark.parametrize(
    ("block_size", "head_dim", "dtype", "group"),
    [
        (16, 64, torch.float32, 3),
        (16, 24, torch.float32, 3),
        (12, 16, torch.float32, 3),
        (16, 64, torch.bfloat16, 3),
        (16, 32, torch.float16, 1),
    ],
)
def test_kernel_equals_dense_reference(block_size, head_dim, dtype, group):
    """G = 3 query heads per KV head (SmolLM2's 9/3) and G = 1 (no GQA), uneven lengths over several blocks, a
    non-power-of-two head_dim (24) and block size (12), half-precision pools."""
    from kvtrim.cache.triton_paged import paged_decode

    g = torch.Generator().manual_seed(block_size + head_dim)
    blocks = 14
    k_cache = torch.randn(blocks, block_size, 1, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(blocks, block_size, 1, head_dim, generator=g).to(dtype)
    lengths = [1, block_size, 3 * block_size + 5, 2 * block_size - 1, 7]
    table = torch.stack([torch.randperm(blocks, generator=g)[:4] for _ in lengths]).to(torch.int32)
    q = torch.randn(len(lengths), group, head_dim, generator=g).to(dtype)
    scale = head_dim**-0.5
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    out, lse = paged_decode(*(t.to(DEVICE) for t in (q, k_cache, v_cache, seqlens, table)), 0, scale)
    out, lse = out.cpu(), lse.cpu()
    assert out.dtype == dtype and out.shape == q.shape and lse.dtype == torch.float32 and lse.shape == (5, group)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for r, n in enumerate(lengths):
        keys = k_cache[table[r].long(), :, 0].flatten(0, 1)[:n]
        values = v_cache[table[r].long(), :, 0].flatten(0, 1)[:n]
        want_out, want_lse = _dense(q[r], keys, values, scale)
        torch.testing.assert_close(out[r].double(), want_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse[r].double(), want_lse, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------- split-K
def _paged_case(lengths, block_size, head_dim, group, dtype, *, seed=0, seqs_heads=1, buffer=0):
    """Random pool and disjoint per-row block tables (a slot belongs to one row, as in the pool), plus a random
    metric, positions and query positions: everything :func:`paged_decode` and its metric read."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lengths]
    blocks = sum(need) + 3
    k_cache = torch.randn(blocks, block_size, 1, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(blocks, block_size, 1, head_dim, generator=g).to(dtype)
    table, qpos, positions = row_tables(g, lengths, need, blocks, block_size, seqs_heads)
    return SimpleNamespace(
        q=torch.randn(len(lengths), group, head_dim, generator=g).to(dtype), k_cache=k_cache, v_cache=v_cache,
        table=table, seqlens=torch.tensor(lengths, dtype=torch.int32), lengths=lengths,
        metric=torch.rand(blocks, block_size, generator=g), positions=positions, qpos=qpos, heads=seqs_heads,
        buffer=buffer, scale=head_dim**-0.5,
    )  # fmt: skip


def _reference(case):
    """Plain PyTorch, row by row in float64: (out [B, G, d], lse [B, G], metric after the update)."""
    d = case.q.shape[-1]

    def entries(slots):
        return case.k_cache.reshape(-1, d)[slots].double(), case.v_cache.reshape(-1, d)[slots].double()

    return reference(case, case.k_cache.shape[1], entries)


def _run(case, *, metric: bool, **kwargs):
    from kvtrim.cache.triton_paged import paged_decode

    pool_metric, fused = fused_metric(case, metric)
    tensors = (case.q, case.k_cache, case.v_cache, case.seqlens, case.table)
    out, lse = paged_decode(*(t.to(DEVICE) for t in tensors), 0, case.scale, fused, **kwargs)
    return out.cpu(), lse.cpu(), pool_metric.cpu()


def _check(case, got, *, metric: bool):
    # lse for half-precision pools: the logits are exact products of the stored halves
    check(case, got, _reference(case), metric=metric, lse_tol=(1e-5, 1e-4), metric_tol=(1e-5, 1e-4))


# (dtype, G, head_dim, block_size, lengths, num_splits, block_n, metric, buffer)
SPLIT_CASES = [
    (torch.float32, 1, 64, 16, [1, 16, 53, 200, 0], 4, None, True, 0),  # an empty row: out 0, lse -inf
    (torch.float32, 6, 80, 64, [130, 640, 2], 3, 16, True, 5),  # odd G and head_dim, splits cut pages
    (torch.bfloat16, 4, 128, 16, [1500, 7, 300, 1], None, None, True, 3),  # llama-8b's group and head_dim
    (torch.bfloat16, 2, 96, 128, [300, 5, 129], 2, 128, False, 0),
    (torch.float16, 8, 256, 32, [700, 33], 3, 32, True, 0),  # the largest group and head_dim
    (torch.float16, 5, 64, 48, [400, 47, 48, 49], 7, 128, True, 2),  # a page size that is no power of two
    (torch.float16, 3, 64, 16, [2000, 1, 17], None, 64, False, 0),
    (torch.bfloat16, 8, 64, 128, [129, 1000], 5, 16, True, 0),
]


@pytest.mark.parametrize(
    ("dtype", "group", "head_dim", "block_size", "lengths", "num_splits", "block_n", "metric", "buffer"), SPLIT_CASES
)
def test_split_kernel_equals_plain_reference(dtype, group, head_dim, block_size, lengths, num_splits, block_n,
                                             metric, buffer):  # fmt: skip
    """Output, lse and the fused metric against a float64 reference, over dtypes, groups 1-8, head_dim 64-256,
    block sizes 16-128 (and 48), forced and heuristic splits, every tile width, uneven and empty rows, kernel rows
    of two sequences sharing a query position (``heads`` 1 or 2)."""
    heads = 2 if len(lengths) % 2 == 0 else 1
    case = _paged_case(lengths, block_size, head_dim, group, dtype, seed=group + head_dim, seqs_heads=heads,
                       buffer=buffer)  # fmt: skip
    _check(case, _run(case, metric=metric, num_splits=num_splits, block_n=block_n), metric=metric)


@pytest.mark.parametrize(("dtype", "length", "metric"), [(torch.bfloat16, 32768, True), (torch.float16, 8192, False)])
def test_long_rows(dtype, length, metric):
    """A 32k-token row (the heuristic's many splits) beside a short one, llama-8b's G = 4 and head_dim 128."""
    case = _paged_case([length, 77], 16, 128, 4, dtype, seed=length, buffer=4)
    _check(case, _run(case, metric=metric), metric=metric)


def test_split_count_does_not_change_the_result():
    """1, 3 and 16 splits: the same output, lse and metric (up to float32 summation order)."""
    assert_split_count_invariant(_run, _paged_case([700, 200, 64], 16, 64, 4, torch.float32, seed=3), (3, 16))


def test_split_plan():
    from kvtrim.cache.triton_paged import split_plan

    h100 = 132
    splits, chunk = split_plan(8, 32768, h100)  # batch 1 x 32k, 8 KV heads: the SMs filled
    assert 8 * splits >= h100 and chunk % 128 == 0 and (splits - 1) * chunk < 32768 <= splits * chunk
    splits, chunk = split_plan(256, 2048, h100)  # batch 32 x 2k: already 256 rows, at most two splits
    assert splits <= 2 and splits * chunk >= 2048
    assert split_plan(32, 8192, h100) == split_plan(32, 8192, h100)  # deterministic for a shape
    assert split_plan(4, 100, h100)[0] == 1  # too short to split
    assert split_plan(1, 10**6, h100)[0] <= 64
    assert split_plan(3, 53, h100, num_splits=4) == (4, 14)
    with pytest.raises(InvalidParameterError, match="num_splits must be a positive integer, got 0"):
        split_plan(3, 53, h100, num_splits=0)


def test_autotune_configs_pruned_per_shape(monkeypatch):
    """A compiled run tunes over the listed tiles minus the 128-token ones where they grow too large; the
    interpreter runs one tile."""
    import triton

    from kvtrim.cache import triton_paged as tp

    configs = [
        triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in (*tp.CONFIGS, tp.INTERPRETER_CONFIG)
    ]

    def kept(dtype, d_pad, g_pad):
        picked = tp._prune(configs, {"k_ptr": torch.empty(1, dtype=dtype)}, D_PAD=d_pad, G_PAD=g_pad)
        return {(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in picked}

    assert kept(torch.bfloat16, 128, 16) == ({tp.INTERPRETER_CONFIG} if INTERPRETED else set(tp.CONFIGS))
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read at each access (a setattr would pin it)
    assert kept(torch.bfloat16, 128, 16) == set(tp.CONFIGS)  # llama-8b: every listed tile
    small = {c for c in tp.CONFIGS if c[0] <= 64}
    assert kept(torch.bfloat16, 256, 16) == kept(torch.float32, 128, 16) == kept(torch.float16, 64, 32) == small


def test_launch_reads_nothing_on_the_host():
    """Graph capture: no op reads a device value on the host, and the buffers (so the grid) depend on the table's
    shape only, not on the lengths."""
    made = []
    for lengths in ([500, 20], [3, 511]):
        case = _paged_case(lengths, 16, 64, 4, torch.float32, seed=1)
        case.table = case.table[:, :33]  # the same width for both
        with Ops() as seen:
            _run(case, metric=True)
        assert not HOST_READS & set(seen.names)
        made.append(seen.numels)
    assert made[0] == made[1]


def test_metric_off_stores_no_logits():
    """Without the metric no scores buffer is allocated (the largest tensor made is the query-sized partials)."""
    case = _paged_case([500, 20], 16, 64, 4, torch.float32, seed=1)
    sizes = {}
    for metric in (False, True):
        with Ops() as seen:
            _run(case, metric=metric, num_splits=2)
        sizes[metric] = max(seen.numels)
    rows, group = case.q.shape[:2]
    assert sizes[True] == rows * group * case.table.shape[1] * 16  # the logits of every slot the tables address
    assert sizes[False] < sizes[True] // 4


def test_bad_tile_width_is_refused():
    case = _paged_case([20], 16, 64, 1, torch.float32)
    with pytest.raises(InvalidParameterError, match="block_n must be a power of two of at least 16, got 24"):
        _run(case, metric=False, block_n=24)


# ---------------------------------------------------------------------------------------------------- the backend
def _pool(cfg):
    """``(blocks, block_size) -> BlockPool`` of float32 entries for ``cfg``, with a scratch block for padding rows."""
    return lambda blocks, block_size: BlockPool(blocks, block_size, cfg.head_dim, torch.float32, DEVICE, scratch=True)


@pytest.mark.parametrize(
    ("head_dim", "accumulate", "buffer", "pad"),
    [(64, False, 0, 0), (64, True, 0, 0), (64, True, 3, 2), (24, True, 3, 0)],
)
def test_triton_decode_equals_gather_path(head_dim, accumulate, buffer, pad):
    """GQA 6/2 (G = 3); ``pad``: padding rows of a bucketed batch (they read and write the scratch block only)."""
    cfg = config(heads=6, kv_heads=2, head_dim=head_dim)
    lengths = (3 * 16 + 5, 16 + 9, 7)
    pool, gather_pool = assert_triton_equals_gather(cfg, lengths, _pool(cfg), kernel_name="triton", block_size=16,
                                                    accumulate=accumulate, buffer=buffer, pad=pad, atol=1e-5,
                                                    rtol=1e-5)  # fmt: skip
    real = slice(0, pool.num_blocks)  # padding rows share the scratch block; their writes race on a GPU
    torch.testing.assert_close(pool.keys[real], gather_pool.keys[real], atol=0, rtol=0)
    if accumulate:
        base = decode("gather", cfg, lengths, _pool(cfg), accumulate=False, buffer=0, pad=pad, block_size=16)[2]
        assert not torch.equal(pool.metric[real], base.metric[real])  # the metric did move


def test_fused_metric_skips_the_accumulate_from_lse_pass(monkeypatch):
    calls = []
    monkeypatch.setattr("kvtrim.cache.paged.accumulate_metric_from_lse", lambda *a, **k: calls.append(1))
    cfg = config(heads=6, kv_heads=2, head_dim=16, layers=1)
    decode("triton", cfg, (20, 9), _pool(cfg), accumulate=True, buffer=0, pad=0, block_size=16)
    assert not calls
    decode("gather", cfg, (20, 9), _pool(cfg), accumulate=True, buffer=0, pad=0, block_size=16)
    assert not calls  # the gather path computes the metric from its own softmax


# ---------------------------------------------------------------------------------------------------- selection
def test_triton_without_cuda_or_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    resolve = paged_kernels.resolve_decode_kernel
    with pytest.raises(InvalidParameterError, match=r"decode_kernel='triton' cannot be used: it needs a CUDA device"):
        resolve("triton", device="cpu", dtype=torch.float32, block_size=16, head_dim=64)
    cfg = config(heads=6, kv_heads=2, head_dim=16)
    pool = BlockPool(8, 16, 16, torch.float32)
    seq = PagedSequence(pool, cfg.num_hidden_layers, cfg.num_key_value_heads)
    with pytest.raises(InvalidParameterError, match="TRITON_INTERPRET=1"):
        PagedBatchCache(cfg, pool, [seq], decode_kernel="triton")
    assert pool.num_free == 8 and seq.entries() == 0
    monkeypatch.setattr(paged_kernels, "_load_triton", lambda: None)
    with pytest.raises(InvalidParameterError, match="triton package is not importable"):
        resolve("triton", device="cuda", dtype=torch.float16, block_size=16, head_dim=64)


def test_triton_names_each_unmet_condition():
    resolve = paged_kernels.resolve_decode_kernel
    assert resolve("triton", device=DEVICE, dtype=torch.float32, block_size=16, head_dim=64).name == "triton"
    assert resolve("triton", device=DEVICE, dtype=torch.bfloat16, block_size=5, head_dim=24).name == "triton"
    with pytest.raises(InvalidParameterError, match=r"float16, bfloat16 or float32 KV, the pool holds torch.float64"):
        resolve("triton", device=DEVICE, dtype=torch.float64, block_size=16, head_dim=64)
    with pytest.raises(InvalidParameterError, match="head_dim at most 256, got 320"):
        resolve("triton", device=DEVICE, dtype=torch.float16, block_size=16, head_dim=320)
    # "auto" never picks the interpreter: a CPU pool stays on the gather path
    assert resolve("auto", device="cpu", dtype=torch.float32, block_size=16, head_dim=64) is None


def test_auto_order_is_fork_then_triton_then_upstream(monkeypatch):
    resolve = paged_kernels.resolve_decode_kernel
    for name in ("_device_supported", "_dtype_supported", "_triton_on_cuda"):
        monkeypatch.setattr(paged_kernels, name, lambda *a: True)  # pretend the CPU pool is on CUDA
    # every test call passes: this test is about the order (a CPU pool's real Triton call needs the interpreter)
    monkeypatch.setattr(paged_kernels, "probe_kernel", lambda *a, **k: None)
    monkeypatch.setattr(paged_kernels, "_load_vllm_fork", lambda: ref.flash_attn_varlen_func)
    monkeypatch.setattr(paged_kernels, "_load_flash_attn", lambda: ref.flash_attn_with_kvcache)
    kw = dict(device="cpu", dtype=torch.float16, head_dim=64)
    assert resolve("auto", block_size=256, **kw).name == "vllm_flash_attn"
    assert resolve("auto", block_size=8, **kw).name == "triton"  # the fork needs multiples of 16
    monkeypatch.setattr(paged_kernels, "_load_vllm_fork", lambda: None)
    assert resolve("auto", block_size=256, **kw).name == "triton"  # before upstream flash-attn
    assert resolve("flash", block_size=256, **kw).name == "flash_attn"  # "flash" is flash-attention only
    monkeypatch.setattr(paged_kernels, "_load_triton", lambda: None)
    assert resolve("auto", block_size=256, **kw).name == "flash_attn"
    assert resolve("auto", block_size=16, **kw) is None
