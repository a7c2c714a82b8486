"""How the decode graphs are captured (kvtrim.serve.decode_graphs), checked on CPU with the CUDA calls recorded.

There is no GPU here, so ``torch.cuda``'s stream, graph and allocator calls are replaced by recorders and the
forward runs on CPU: what is checked is the sequence of calls a capture makes. The captures of one round share one
memory pool, a round whose graphs are all gone is followed by a new pool (the allocator asserts on a capture into a
pool no graph holds), and no capture empties the allocator's cache (``torch.cuda.graph`` does so on entry, and a
recapture would then give its memory back to the driver and allocate it again).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import tiny_model
from kvtrim.serve import decode_graphs
from kvtrim.serve.model_runner import ModelRunner, PrefillChunk
from kvtrim.serve.types import SamplingParams


class CudaCalls:
    """Stands in for the ``torch.cuda`` calls of a capture and records them."""

    def __init__(self):
        self.calls: list[tuple] = []
        calls = self.calls

        class Stream:
            def __init__(self, device=None):
                calls.append(("stream",))

            def wait_stream(self, other):
                calls.append(("wait_stream",))

            def synchronize(self):
                calls.append(("stream.synchronize",))

        class Graph:
            def capture_begin(self, *args, pool=None, **kwargs):
                calls.append(("capture_begin", args[0] if args else pool))

            def capture_end(self):
                calls.append(("capture_end",))

            def replay(self):
                calls.append(("replay",))

        self.Stream, self.CUDAGraph = Stream, Graph

    def current_stream(self, device=None):
        return self.Stream()

    @contextlib.contextmanager
    def stream(self, s):
        yield

    def synchronize(self, device=None):
        self.calls.append(("synchronize",))

    def empty_cache(self):
        self.calls.append(("empty_cache",))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


@pytest.fixture
def fake(monkeypatch) -> CudaCalls:
    """``torch.cuda``'s capture calls replaced by a recorder for the test."""
    calls = CudaCalls()
    for name in ("Stream", "CUDAGraph", "current_stream", "stream", "synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, getattr(calls, name))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.calls.append(("host_empty_cache",)), raising=False)
    return calls


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_model("llama")


def handles() -> decode_graphs.GraphMemPool:
    """A graph pool whose handles are ``(1, 0)``, ``(2, 0)``, ... (``torch.cuda.graph_pool_handle`` on CUDA)."""
    made = iter(range(1, 100))
    return decode_graphs.GraphMemPool(lambda: (next(made), 0))


def test_captures_of_a_round_share_a_pool_and_never_empty_the_cache(model, fake):
    """Two bucket keys captured, then both again after the graphs are dropped (as when the block table grows):
    four captures, the two of each round into that round's pool, none emptying the allocator's cache."""
    runner = ModelRunner(model, kv_blocks=200, block_size=4, decode_buckets=True, static_decode=True)
    seqs = [runner.new_sequence() for _ in range(3)]
    logits = runner.prefill([PrefillChunk(s, [3 + i + j for j in range(10 + i)]) for i, s in enumerate(seqs)])
    tokens = runner.sample(logits, [SamplingParams()] * 3, [torch.Generator()] * 3)
    runner.decode(seqs[:1], tokens[:1])  # bucket 1
    runner.decode(seqs, tokens)  # bucket 4
    graphs = runner.graphs
    entries = list(graphs._entries.values())
    assert len(entries) == 2

    graphs._mempool = handles()
    with torch.inference_mode():
        for _ in range(2):
            for entry in entries:
                graphs._capture(entry, seqs)
            graphs._drop_graphs()

    names = fake.names()
    assert graphs.captures == 4 and names.count("capture_begin") == names.count("capture_end") == 4
    assert graphs.capture_s > 0  # the wall time of the four captures, warm-ups included
    assert [c[1] for c in fake.calls if c[0] == "capture_begin"] == [(1, 0), (1, 0), (2, 0), (2, 0)]
    assert graphs._mempool.rounds == 2
    assert "empty_cache" not in names and "host_empty_cache" not in names
    for s in seqs:
        s.release()
    assert runner.pool.num_used == 0


def test_a_failing_capture_ends_the_capture_and_reports_the_forward_error(model, fake):
    runner = ModelRunner(model, kv_blocks=100, block_size=4, decode_buckets=True, static_decode=True)
    seq = runner.new_sequence()
    token = runner.sample(runner.prefill([PrefillChunk(seq, [5, 6, 7])]), [SamplingParams()], [torch.Generator()])
    runner.decode([seq], token)
    graphs = runner.graphs
    (entry,) = graphs._entries.values()
    forward, runs = entry.forward, []

    def failing_forward():
        runs.append(1)
        if len(runs) > decode_graphs.WARMUP_STEPS:  # the warm-up runs, the captured forward fails
            raise RuntimeError("operation not permitted when stream is capturing")
        return forward()

    entry.forward = failing_forward
    graphs._mempool = handles()
    with torch.inference_mode(), pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        graphs._capture(entry, [seq])
    assert fake.names()[-2:] == ["capture_begin", "capture_end"] and entry.graph is None and graphs.captures == 0
    # the failed graph was the only one captured into its pool: the next capture starts a new pool
    entry.forward = forward
    with torch.inference_mode():
        graphs._capture(entry, [seq])
    assert [c[1] for c in fake.calls if c[0] == "capture_begin"] == [(1, 0), (2, 0)] and graphs.captures == 1
    seq.release()
