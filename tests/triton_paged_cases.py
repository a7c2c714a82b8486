"""What the tests of kvtrim's Triton paged decode kernels (tests/cache/test_triton_paged.py, the float pool;
tests/cache/test_triton_paged_quant.py, the quantized one) share: the device they run on, the random block tables,
metric and positions of a kernel case, the float64 reference, the result checks, the aten-op recorder, and the
decode step through ``PagedBatchCache`` with random evictions.

Importing it skips the importing test module where the kernels cannot run: Triton's interpreter off
(tests/conftest.py turns it on without a CUDA device) and no CUDA device.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvtrim.cache.paged import PagedBatchCache, PagedSequence
from kvtrim.cache.paged_kernels import FusedMetric
from kvtrim.selection.block_eviction import apply_evictions, schedule_evictions

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
DEVICE = "cpu" if INTERPRETED else "cuda"
if not INTERPRETED and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET is off and there is no CUDA device", allow_module_level=True)

HOST_READS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "tolist"}  # aten ops that read a device value


# ---------------------------------------------------------------------------------------------------- the kernel
def row_tables(g: torch.Generator, lengths, need: list[int], blocks: int, block_size: int, heads: int):
    """``(table [rows, width] int32, qpos [rows // heads], positions [blocks, block_size])``: disjoint per-row block
    tables of ``need[r]`` blocks each and one spare column (entries past a row's blocks are never read), query
    positions, and key positions of which some are within any buffer of the query."""
    order = torch.randperm(blocks, generator=g)
    table = torch.randint(0, blocks, (len(lengths), max(need) + 1), generator=g)
    used = 0
    for r, k in enumerate(need):
        table[r, :k] = order[used : used + k]
        used += k
    qpos = torch.randint(0, 4 * max(lengths) + 1, (len(lengths) // heads,), generator=g) + 8
    positions = torch.randint(0, int(qpos.min()) + 1, (blocks, block_size), generator=g)
    positions[::3] = qpos.max()
    return table.to(torch.int32), qpos, positions


def reference(case, block_size: int, entries: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]):
    """Plain PyTorch, row by row in float64: (out [B, G, d], lse [B, G], metric after the update); ``entries``:
    the keys and values at a row's slots, float64 on the CPU."""
    rows, group, d = case.q.shape
    out = torch.zeros(rows, group, d, dtype=torch.float64)
    lse = torch.full((rows, group), float("-inf"), dtype=torch.float64)
    metric = case.metric.double().reshape(-1).clone()
    for r, n in enumerate(case.lengths):
        if n == 0:
            continue
        slots = (case.table[r].long()[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:n]
        keys, values = entries(slots)
        logits = case.q[r].double() @ keys.T * case.scale  # [G, n]
        lse[r] = torch.logsumexp(logits, dim=-1)
        probs = torch.exp(logits - lse[r, :, None])
        out[r] = probs @ values
        counted = case.positions.reshape(-1)[slots] <= case.qpos[r // case.heads] - case.buffer
        metric.index_add_(0, slots, torch.where(counted, probs.square().sum(0), 0.0))
    return out, lse, metric.reshape(case.metric.shape)


def fused_metric(case, metric: bool) -> tuple[torch.Tensor, FusedMetric | None]:
    """A copy of the case's metric on the device, and the kernel's fused update of it (None without ``metric``)."""
    pool_metric = case.metric.clone().to(DEVICE)
    if not metric:
        return pool_metric, None
    return pool_metric, FusedMetric(pool_metric, case.positions.to(DEVICE), case.qpos.to(DEVICE), case.heads,
                                    case.buffer)  # fmt: skip


def check(case, got, want, *, metric: bool, lse_tol: tuple[float, float], metric_tol: tuple[float, float]) -> None:
    """The kernel's ``(out, lse, metric)`` against the reference's; ``lse_tol``: for float32 and for half-precision
    pools; ``metric_tol``: ``(atol, rtol)``; without ``metric`` the pool's metric untouched."""
    out, lse, pool_metric = got
    want_out, want_lse, want_metric = want
    dtype = case.q.dtype
    assert out.dtype == dtype and out.shape == case.q.shape and lse.dtype == torch.float32
    tol = 2e-5 if dtype == torch.float32 else 2e-2  # half precision: P rounded to it for P·V
    torch.testing.assert_close(out.double(), want_out, atol=tol, rtol=tol)
    tol = lse_tol[0] if dtype == torch.float32 else lse_tol[1]
    torch.testing.assert_close(lse.double(), want_lse, atol=tol, rtol=tol)
    if metric:
        torch.testing.assert_close(pool_metric.double(), want_metric, atol=metric_tol[0], rtol=metric_tol[1])
        assert not torch.equal(pool_metric, case.metric)
    else:
        assert torch.equal(pool_metric, case.metric)


def assert_split_count_invariant(run: Callable, case, splits: tuple[int, ...]) -> None:
    """One split and each count of ``splits``: the same output, lse and metric (up to float32 summation order)."""
    base = run(case, metric=True, num_splits=1)
    for n in splits:
        for a, b in zip(run(case, metric=True, num_splits=n), base, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


class Ops(TorchDispatchMode):
    """The aten ops dispatched while active, and the sizes of the tensors the ``empty*`` ops made."""

    def __init__(self):
        super().__init__()
        self.names, self.numels = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.names.append(func.overloadpacket.__name__)
        if self.names[-1].startswith("empty"):
            self.numels.append(out.numel())
        return out


# ---------------------------------------------------------------------------------------------------- the backend
def config(heads: int, kv_heads: int, head_dim: int, layers: int = 2):
    return SimpleNamespace(
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        hidden_size=heads * head_dim,
    )  # fmt: skip


def forward(cfg, cache: PagedBatchCache, rows: int, q_len: int, g: torch.Generator, positions=None):
    """One 'forward' through every layer with random q/k/v; returns the per-layer outputs."""
    outs = []
    for layer in cache.layers:
        q = torch.randn(rows, cfg.num_attention_heads, q_len, cfg.head_dim, generator=g).to(DEVICE)
        k = torch.randn(rows, cfg.num_key_value_heads, q_len, cfg.head_dim, generator=g).to(DEVICE)
        v = torch.randn(rows, cfg.num_key_value_heads, q_len, cfg.head_dim, generator=g).to(DEVICE)
        cache.update(k, v, layer.layer_idx)
        outs.append(layer.attend(None, q, positions, None, cfg.head_dim**-0.5))
    return outs


def decode(kernel: str, cfg, lengths, make_pool: Callable, *, accumulate: bool, buffer: int, pad: int,
           block_size: int):  # fmt: skip
    """Sequences prefilled on ``make_pool(blocks, block_size)`` with random evictions per (layer, head) and a random
    metric, then one decode step: ``(cache, per-layer outputs of the real rows, pool, row lengths)``."""
    g = torch.Generator().manual_seed(7)
    blocks = sum(2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (t // block_size + 2) for t in lengths)
    pool = make_pool(blocks, block_size)
    seqs = []
    for t in lengths:
        seq = PagedSequence(pool, cfg.num_hidden_layers, cfg.num_key_value_heads)
        forward(cfg, PagedBatchCache(cfg, pool, [seq]), 1, t, g)
        plan = schedule_evictions(seq, blocks_to_evict=0, protected_window=0)
        for r in range(seq.num_rows):
            n = int(seq.row_lengths()[r])
            k = int(torch.randint(0, n // 2, (1,), generator=g))
            plan.evicted[r] = torch.randperm(n - 1, generator=g)[:k].sort().values
        apply_evictions(seq, plan)
        seqs.append(seq)
    pool.metric.copy_(torch.rand(pool.metric.shape, generator=g))
    lens = torch.stack([s.lengths() for s in seqs])
    positions = torch.tensor([[s.seen] for s in seqs] + [[0]] * pad, device=DEVICE)
    cache = PagedBatchCache(
        cfg, pool, seqs, accumulate_decode_metric=accumulate, buffer=buffer, bucketed=pad > 0, decode_kernel=kernel
    )
    outs = forward(cfg, cache, len(seqs) + pad, 1, g, positions)
    return cache, [out[: len(seqs)] for out in outs], pool, lens


def assert_triton_equals_gather(cfg, lengths, make_pool: Callable, *, kernel_name: str, block_size: int,
                                accumulate: bool, buffer: int, pad: int, atol: float, rtol: float):  # fmt: skip
    """The Triton decode step and the gather path's on the same prefilled, evicted sequences: the same outputs, the
    same metric on every block but the scratch one (which all padding rows share: their updates may race on a
    GPU; nothing reads it); returns ``(pool, gather_pool)``."""
    kw = dict(accumulate=accumulate, buffer=buffer, pad=pad, block_size=block_size)
    gather_cache, want, gather_pool, lens = decode("gather", cfg, lengths, make_pool, **kw)
    cache, got, pool, _ = decode("triton", cfg, lengths, make_pool, **kw)
    assert gather_cache.decode_kernel_name == "gather" and cache.decode_kernel_name == kernel_name
    assert len(set(lens.flatten().tolist())) > 3  # heads and sequences really hold different counts
    assert int(lens.max()) > 2 * block_size  # some rows span three blocks
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
    real = slice(0, pool.num_blocks)
    torch.testing.assert_close(pool.metric[real], gather_pool.metric[real], atol=1e-6, rtol=1e-5)
    return pool, gather_pool
