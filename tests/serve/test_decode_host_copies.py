"""No host→device copy inside the engine's decode steps and evictions (tests/host_copy_guard.py), checked on CPU.

Guarded regions, per engine step:

* every decode forward (``[b, 1]`` input with a non-packed paged cache): the eager step (with and without decode
  buckets) and the static step that CUDA graphs capture, with each decode kernel reachable here (the gather path;
  kvtrim's Triton kernel under Triton's interpreter). Inside a forward a device value read on the host
  (``.item()``, ``bool(t)``, ``torch.equal``) is rejected too. The eager step's host preparation
  (:meth:`PagedBatchCache.begin_forward`: block allocation, block-table writes and the upload of the step's slots
  and positions) runs before the forward, outside the region; the static step's host preparation
  (``reserve_decode_step`` and ``StaticDecodeCache.load``) runs before the forward, so its forward is guarded
  whole, with the pinned staging buffer and the host block counts registered as host data;
* every batched eviction (:func:`compress_sequences`: ranking, MoveCache, the table shrink and the freeing of
  blocks), apart from its host bookkeeping and the one upload of its inputs (``sequences_over_budget``,
  ``upload_eviction_inputs``).

An eviction reads device values back on the host on purpose (its new lengths): the op-count tests bound those
reads, and on a GPU ``torch.cuda.set_sync_debug_mode`` guards the decode forwards.
"""

from __future__ import annotations

import os

import pytest
import torch

from compressed_engine_run import run_compressed
from conftest import byte_tokenizer, tiny_model
from host_copy_guard import HostCopyGuard
from kvtrim.cache.paged import PagedBatchCache
from kvtrim.cache.static_decode import StaticDecodeCache
from kvtrim.selection import block_eviction
from kvtrim.serve import model_runner as runner_module
from kvtrim.serve.engine import Engine

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_model("llama")  # 4 query heads over 2 KV heads


class GuardedModel:
    """Stands in for the engine's model: runs every decode forward inside ``guard``."""

    def __init__(self, model, guard: HostCopyGuard):
        self.model, self.guard, self.forwards = model, guard, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, **kwargs):
        cache = kwargs.get("past_key_values")
        decode = isinstance(cache, PagedBatchCache) and cache.chunk_lengths is None
        if not decode or kwargs["input_ids"].shape[1] != 1:
            return self.model(**kwargs)
        store = cache.sequences[0].store
        self.guard.host(store.host_nblocks, cache.pool._allocated)
        if isinstance(cache, StaticDecodeCache):
            self.guard.host(cache._host_buf)
        self.forwards += 1
        with self.guard:
            return self.model(**kwargs)


def guarded_run(monkeypatch, model, **options) -> tuple[HostCopyGuard, HostCopyGuard, GuardedModel, list, Engine]:
    """A compressing engine run (cr 4, continual metric on) with every decode forward and eviction guarded.
    Returns the forwards' guard, the evictions' guard (host bookkeeping is registered only with the first: the
    eviction reads host block counts on purpose), the guarded model, one entry per eviction and the engine."""
    forwards, evictions = HostCopyGuard(reads=True), HostCopyGuard()
    for guard in (forwards, evictions):
        guard.exempt(monkeypatch, block_eviction, "sequences_over_budget")
        guard.exempt(monkeypatch, block_eviction, "upload_eviction_inputs")
    calls = []
    compress = block_eviction.compress_sequences

    def guarded_compress(*args, **kwargs):
        calls.append(1)
        with evictions:
            return compress(*args, **kwargs)

    monkeypatch.setattr(runner_module, "compress_sequences", guarded_compress)
    guarded = GuardedModel(model, forwards)
    real_init = Engine.__init__

    def init(self, model, *args, **kwargs):  # the model runner (and its static-step runner) sees the guarded model
        real_init(self, model, *args, **kwargs)
        self.runner.model = guarded
        if self.runner.graphs is not None:
            self.runner.graphs.model = guarded

    monkeypatch.setattr(Engine, "__init__", init)
    _, engine = run_compressed(model, byte_tokenizer(), requests=3, max_tokens=12, kv_blocks=160, **options)
    return forwards, evictions, guarded, calls, engine


CASES = [
    pytest.param({}, id="eager"),
    pytest.param({"decode_buckets": True}, id="eager-buckets"),
    pytest.param({"decode_buckets": True, "static_decode": True}, id="static"),
    pytest.param({"kv_quant": "int8"}, id="eager-int8"),
    pytest.param({"decode_buckets": True, "static_decode": True, "kv_quant": "int4"}, id="static-int4"),
    pytest.param(
        {"decode_kernel": "triton"}, id="eager-triton",
        marks=pytest.mark.skipif(not INTERPRETED, reason="Triton's interpreter is off (CUDA runs the GPU check)"),
    ),
    pytest.param(
        {"decode_buckets": True, "static_decode": True, "decode_kernel": "triton"}, id="static-triton",
        marks=pytest.mark.skipif(not INTERPRETED, reason="Triton's interpreter is off (CUDA runs the GPU check)"),
    ),
]  # fmt: skip


@pytest.mark.parametrize("options", CASES)
def test_decode_steps_and_evictions_copy_nothing_from_the_host(monkeypatch, model, options):
    if "decode_kernel" in options:
        pytest.importorskip("triton")
    forwards, evictions, guarded, calls, engine = guarded_run(monkeypatch, model, **options)
    stats = engine.stats
    # the regions really ran: decode forwards of the asked kind, evictions that evicted, and ops inside them
    assert guarded.forwards == stats.decode_steps > 0 and stats.decode_kernel == options.get("decode_kernel", "gather")
    assert stats.static_decode_steps == (stats.decode_steps if options.get("static_decode") else 0)
    assert calls and stats.blocks_evicted > 0 and forwards.ops > 1000 and evictions.ops > 100
    assert not forwards.violations, sorted(set(forwards.violations))
    assert not evictions.violations, sorted(set(evictions.violations))


# ------------------------------------------------------------------------------------------- the guard itself
def _violations(fn, *host) -> list[str]:
    guard = HostCopyGuard().host(*host)
    with guard:
        fn()
    return guard.violations


def test_guard_rejects_python_numbers_written_through_an_index_and_tensors_from_lists():
    x, index = torch.zeros(3, 8), torch.arange(2)
    flat = x.view(-1)
    for write in (
        lambda: flat.__setitem__(index, 0.0),  # the ``pool.metric.view(-1)[slot] = 0.0`` pattern
        lambda: x.__setitem__((0, 1), -1.0),  # copy_ of a lifted number
        lambda: x.__setitem__((slice(None), slice(2, 4)), 0.0),  # fill_ of a lifted number
        lambda: x.fill_(torch.tensor(1.0)),
    ):
        found = _violations(write)
        assert any("lifted from a Python number" in v for v in found), found
    assert any("Python data of shape [2]" in v for v in _violations(lambda: torch.tensor([1, 2]) + index))
    host = torch.zeros(2, dtype=torch.long)
    assert any("reads host data" in v for v in _violations(lambda: flat[host], host))  # a host index on the device
    assert any("reads host data" in v for v in _violations(lambda: flat[(host + 1) * 2], host))  # derived host data


def test_guard_accepts_device_side_fills_and_scalar_operands():
    x, index, mask = torch.zeros(3, 8), torch.arange(2), torch.rand(3, 8) > 0.5
    flat = x.view(-1)
    for write in (
        lambda: flat.index_fill_(0, index, 0.0),
        lambda: x.masked_fill_(mask, -1.0),
        lambda: torch.where(mask, x, 0.0),  # scalar_tensor made on x's device for an elementwise op
        lambda: x.add_(1).mul_(2.0),
        lambda: x[0].zero_(),
        lambda: torch.arange(4, device=x.device) * 2,
    ):
        assert not _violations(write)
