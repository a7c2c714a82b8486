"""The static decode step that CUDA graphs capture (kvtrim.serve.decode_graphs, kvtrim.cache.static_decode), checked
on CPU: there is no GPU here, so the capture call itself is not run; everything a replay relies on is.

A captured graph replays the same kernels, with the same shapes and scalar arguments, on the same addresses. So the
graph-safety test records every aten op of the static forward with its tensors' shapes, strides and (for tensors
the step did not allocate itself) addresses, and every non-tensor argument, for many engine states that share a
bucket key, and requires the records to be identical and free of host reads, tensors built from Python data and
data-dependent shapes. The same recorder flags the un-split bucketed forward, which is why it cannot be captured.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_engine import _randomized, greedy_alone
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from conftest import byte_tokenizer, tiny_model
from kvtrim.cache.paged import PagedBatchCache
from kvtrim.cache.static_decode import StaticDecodeCache
from kvtrim.errors import InvalidParameterError
from kvtrim.serve.engine import Engine
from kvtrim.serve.types import SamplingParams

# Ops a graph cannot replay faithfully: host reads, tensors lifted from Python data, data-dependent output sizes.
FORBIDDEN = frozenset({
    "_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "nonzero_static", "masked_select", "unique",
    "_unique2", "unique_dim", "unique_consecutive", "lift_fresh", "lift_fresh_copy", "repeat_interleave",
    "bincount", "histc", "masked_scatter",
})  # fmt: skip
INDEXING = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})


class GraphTrace(TorchDispatchMode):
    """Records ``(op, described args, described kwargs)`` of every aten op and the ops a graph cannot replay.

    A tensor is described by shape, dtype, device, strides, offset and origin: ``"made"`` if an earlier op of the
    trace allocated its storage (its address is the allocator's business), else ``("read", address)``: the step
    reads memory that exists outside it, which a graph bakes in."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []
        self.violations: list[str] = []
        self._made: set[int] = set()

    def _describe(self, x):
        if isinstance(x, torch.Tensor):
            ptr = x.untyped_storage().data_ptr()
            origin = "made" if ptr in self._made else ("read", ptr)
            return ("tensor", tuple(x.shape), x.dtype, x.device.type, x.stride(), x.storage_offset(), origin)
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, tuple(self._describe(v) for v in x))
        if isinstance(x, dict):
            return tuple((k, self._describe(v)) for k, v in sorted(x.items()))
        return repr(x)  # ints, floats, bools, None, dtypes, devices: values a graph would bake in

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in FORBIDDEN:
            self.violations.append(str(func))
        if name in INDEXING:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
                self.violations.append(f"{func} with a boolean index (its size is data-dependent)")
        self.ops.append((str(func), self._describe(args), self._describe(kwargs)))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self._made.add(t.untyped_storage().data_ptr())  # new storage (views and in-place ops are not new)
        return out


class TracedModel:
    """Stands in for the engine's model: traces every decode forward (``[b, 1]`` input, a non-packed paged cache)."""

    def __init__(self, model, engine: Engine):
        self.model, self.engine = model, engine
        self.traces: list[tuple[tuple, dict, GraphTrace]] = []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, **kwargs):
        cache = kwargs.get("past_key_values")
        decode = isinstance(cache, PagedBatchCache) and cache.chunk_lengths is None
        if not decode or kwargs["input_ids"].shape[1] != 1:
            return self.model(**kwargs)
        if isinstance(cache, StaticDecodeCache):
            key = (cache.batch, cache.width, self.engine.runner.graphs.invalidations)
            state = {
                "rows": len(cache.sequences),
                "positions": cache.position_ids.flatten().tolist(),
                "slots": cache.row_slots.tolist(),
                "ids": cache.input_ids.flatten().tolist(),
            }
        else:
            key, state = (kwargs["input_ids"].shape[0],), {"rows": len(cache.sequences)}
        tracer = GraphTrace()
        with tracer:
            out = self.model(**kwargs)
        self.traces.append((key, state, tracer))
        return out


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_model("llama")


def _traced_engine(model, *, static: bool, cr: float) -> tuple[Engine, TracedModel]:
    engine = Engine(
        model, byte_tokenizer(), kv_blocks=600, block_size=4, compression_rate=cr, min_cache_tokens=8,
        protected_window=4, decode_buckets=True, static_decode=static,
    )  # fmt: skip
    traced = TracedModel(model, engine)
    engine.model = traced
    if static:
        engine.runner.graphs.model = traced
    rng = random.Random(5)
    for step in range(40):  # requests arrive over time: batches of 3 and 4 (bucket 4), 5..8 (bucket 8), ...
        if step % 3 == 0 and step < 24:
            prompt = [rng.randrange(3, 259) for _ in range(rng.randint(5, 30))]
            engine.submit(prompt, SamplingParams(max_tokens=rng.randint(10, 30), ignore_eos=True))
        engine.step()
    engine.run_until_idle()
    assert engine.pool.num_free == engine.pool.num_blocks
    return engine, traced


def _first_difference(a: GraphTrace, b: GraphTrace) -> str:
    for i, (x, y) in enumerate(zip(a.ops, b.ops, strict=False)):
        if x != y:
            return f"op {i}: {x} != {y}"
    return f"{len(a.ops)} ops != {len(b.ops)} ops"


@pytest.mark.parametrize("cr", [1.0, 4.0])  # 4: the continual metric (index_add_ into pool.metric) runs inside
def test_static_decode_step_is_graph_safe(model, cr):
    """Every static decode forward of one (batch bucket, width) key issues the same ops with the same shapes, scalar
    arguments and outside addresses, whatever the sequences, lengths, slots and positions; none reads the host."""
    engine, traced = _traced_engine(model, static=True, cr=cr)
    assert traced.traces and engine.stats.static_decode_steps == len(traced.traces)
    groups: dict[tuple, list] = {}
    for key, state, tracer in traced.traces:
        assert not tracer.violations, (key, tracer.violations)
        groups.setdefault(key, []).append((state, tracer))
    compared = 0
    for key, members in groups.items():
        first_state, first = members[0]
        for state, tracer in members[1:]:
            assert tracer.ops == first.ops, (key, _first_difference(first, tracer))
            compared += state != first_state
    # the traces compared really come from different engine states within one key (rows, positions, slots)
    assert compared >= 10
    assert any(len({s["rows"] for s, _ in m}) > 1 for m in groups.values())  # padding rows differ too
    if cr > 1:
        assert engine.stats.compressions > 0
        assert any("index_add" in op[0] for op in traced.traces[0][2].ops)


def test_unsplit_bucketed_forward_is_not_graph_safe(model, monkeypatch):
    """The same recorder on the eager bucketed forward with its host preparation left to layer 0 (allocation and
    checks inside the forward) flags what a graph could not replay: tensors built from Python lists at layer 0 and
    the positions check that reads the device."""
    monkeypatch.setattr(PagedBatchCache, "begin_forward", lambda self, n, q, **kw: None)
    _, traced = _traced_engine(model, static=False, cr=4.0)
    assert traced.traces
    for _, _, tracer in traced.traces:
        flagged = {v.split(".")[1] for v in tracer.violations}
        assert {"lift_fresh", "equal"} <= flagged, tracer.violations


def test_eager_forward_prepared_before_it_runs_has_no_host_work_inside(model):
    """The engine's eager decode step prepares the step (``PagedBatchCache.begin_forward``) before the forward, so
    the forward itself builds nothing from Python data and reads nothing back."""
    _, traced = _traced_engine(model, static=False, cr=4.0)
    assert traced.traces
    for key, _, tracer in traced.traces:
        assert not tracer.violations, (key, tracer.violations)


def _check_graph_safety(traced: TracedModel) -> None:
    groups: dict[tuple, list[GraphTrace]] = {}
    for key, _, tracer in traced.traces:
        assert not tracer.violations, (key, tracer.violations)
        groups.setdefault(key, []).append(tracer)
    for key, members in groups.items():
        for tracer in members[1:]:
            assert tracer.ops == members[0].ops, (key, _first_difference(members[0], tracer))


@pytest.mark.parametrize("broken", ["positions check", "fresh buffer", "per-step width"])
def test_graph_safety_check_catches_a_broken_static_step(model, monkeypatch, broken):
    """The recorder is not blind: put back the eager positions check, hand the forward a new lengths buffer each
    step, or let the last layer's width follow the batch, and the graph-safety check fails."""
    if broken == "positions check":
        monkeypatch.setattr(StaticDecodeCache, "_positions", PagedBatchCache._positions)
    else:
        load = StaticDecodeCache.load

        def broken_load(self, sequences, slots, tokens):
            load(self, sequences, slots, tokens)
            if broken == "fresh buffer":
                self._static_step["base"] = self.base.clone()
            else:
                widest = int(self.store.host_nblocks[slots].view(len(sequences), self.num_layers, -1)[:, -1].max())
                self._static_step["widths"] = [self.width] * (self.num_layers - 1) + [max(1, widest)]

        monkeypatch.setattr(StaticDecodeCache, "load", broken_load)
    _, traced = _traced_engine(model, static=True, cr=1.0)
    with pytest.raises(AssertionError):
        _check_graph_safety(traced)


# ------------------------------------------------------------------------------------------- outputs
def test_static_decode_matches_running_alone(model):
    """200 randomized requests through the static step (eager on CPU), with preemptions and cancellations: every
    output equals the request alone, no block leaks, the padding slot never gets a block."""
    engine, _ = _randomized(model, 200, seed=3, decode_buckets=True, static_decode=True)
    stats = engine.stats
    assert stats.static_decode_steps == stats.decode_steps > 0 and stats.graph_captures == stats.graph_replays == 0
    assert engine.runner.graphs.invalidations > 0  # the shared table grew during the run: graphs would be recaptured
    store = engine.pool.block_tables(engine.geometry.tables)
    pad = store.padding_slot(engine.pool.scratch_block)
    assert int(store.host_nblocks[pad].sum()) == 0 and int(store.length[pad].sum()) == 0


def test_static_decode_with_compression_equals_the_eager_step(model):
    """With continual compression (decode metric accumulated inside the step), the static step gives the same tokens,
    compressions and evictions as the eager bucketed step."""

    def run(static: bool):
        engine = Engine(
            model, byte_tokenizer(), kv_blocks=300, block_size=4, compression_rate=4.0, min_cache_tokens=8,
            protected_window=4, decode_buckets=True, static_decode=static,
        )  # fmt: skip
        rng = random.Random(11)
        handles = []
        for step in range(60):
            if step % 2 == 0 and step < 30:
                prompt = [rng.randrange(3, 259) for _ in range(rng.randint(5, 60))]
                handles.append(engine.submit(prompt, SamplingParams(max_tokens=rng.randint(5, 30), ignore_eos=True)))
                if step == 10:
                    engine.cancel(handles[-2].request_id)
            engine.step()
        engine.run_until_idle()
        assert engine.pool.num_free == engine.pool.num_blocks
        return [h.result(timeout=0).token_ids for h in handles], engine.stats

    (eager, s1), (static, s2) = run(False), run(True)
    assert static == eager
    assert s2.static_decode_steps == s2.decode_steps > 0
    assert (s2.compressions, s2.blocks_evicted) == (s1.compressions, s1.blocks_evicted) and s1.blocks_evicted > 0


def test_batches_above_the_max_run_eagerly(model):
    engine = Engine(model, byte_tokenizer(), kv_blocks=400, block_size=8, decode_buckets=True, static_decode=True,
                    cuda_graph_max_batch=2)  # fmt: skip
    rng = random.Random(1)
    specs = [([rng.randrange(3, 259) for _ in range(rng.randint(2, 20))], m) for m in (2, 4, 6, 14, 20)]
    handles = [engine.submit(p, SamplingParams(max_tokens=m)) for p, m in specs]
    engine.run_until_idle()
    for h, (p, m) in zip(handles, specs, strict=True):
        assert h.result(timeout=0).token_ids == greedy_alone(model, p, m)
    s = engine.stats
    assert 0 < s.static_decode_steps < s.decode_steps  # batches of 3..5 ran the eager bucketed forward
    assert engine.pool.num_free == engine.pool.num_blocks


def test_padding_only_step_touches_nothing_real(model):
    """Warm-up and capture run the step on padding rows only: no real block, length, position or metric changes."""
    engine = Engine(model, byte_tokenizer(), kv_blocks=200, block_size=4, compression_rate=4.0, min_cache_tokens=8,
                    protected_window=4, decode_buckets=True, static_decode=True)  # fmt: skip
    for i in range(3):
        engine.submit([3 + (5 * i + j) % 250 for j in range(20 + i)], SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(4):
        engine.step()
    runner, pool = engine.runner.graphs, engine.pool
    (entry,) = runner._entries.values()
    store = engine.pool.block_tables(engine.geometry.tables)
    real = slice(0, pool.num_blocks)
    before = [t[real].clone() for t in (pool.keys, pool.values, pool.positions, pool.metric)]
    lengths, seen = store.length.clone(), [r.paged.seen for r in engine.scheduler.decoding()]
    with torch.inference_mode():
        entry.cache.load_padding([r.paged for r in engine.scheduler.decoding()])
        entry.forward()
    after = [t[real] for t in (pool.keys, pool.values, pool.positions, pool.metric)]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert torch.equal(store.length, lengths) and seen == [r.paged.seen for r in engine.scheduler.decoding()]
    engine.run_until_idle()
    assert engine.pool.num_free == engine.pool.num_blocks


# ------------------------------------------------------------------------------------------- options
def test_graph_options_are_checked(model):
    tok = byte_tokenizer()
    with pytest.raises(InvalidParameterError, match="cuda_graphs=True needs decode_buckets=True"):
        Engine(model, tok, kv_blocks=10, cuda_graphs=True)
    with pytest.raises(InvalidParameterError, match="static_decode=True needs decode_buckets=True"):
        Engine(model, tok, kv_blocks=10, static_decode=True)
    with pytest.raises(InvalidParameterError, match="CUDA device, it is on cpu"):  # no silent fallback
        Engine(model, tok, kv_blocks=10, decode_buckets=True, cuda_graphs=True)
    with pytest.raises(InvalidParameterError, match="static_decode must be True or False"):
        Engine(model, tok, kv_blocks=10, decode_buckets=True, static_decode="yes")
    with pytest.raises(InvalidParameterError, match="cuda_graph_max_batch must be an integer >= 1"):
        Engine(model, tok, kv_blocks=10, decode_buckets=True, static_decode=True, cuda_graph_max_batch=0)
