"""Decode steps replayed from CUDA graphs (one per ``(batch bucket, table width)`` key), eager elsewhere.

The step is :class:`~kvtrim.cache.static_decode.StaticDecodeCache`'s: host preparation before the forward writes
the inputs into static buffers, and the forward reads only them. On CUDA, the first step of a key warms the forward
up on a side stream and captures it into a ``torch.cuda.CUDAGraph``; all graphs share one memory pool (as vLLM
captures its decode graphs). Warm-up and capture run on padding rows only (the scratch block), so they change no
sequence and add nothing to any metric; the real step is then a replay. Elsewhere the same buffers and the same
forward run eagerly, which is what the CPU tests exercise.

A graph bakes in the addresses of what it reads. The pool and the weights never move; the shared block table is
reallocated when it grows (more sequences, wider tables), so every graph is dropped and recaptured then. The
recaptured graphs get a new memory pool (:class:`GraphMemPool`): the allocator keeps a graph pool only while a graph
captured into it lives.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from ..cache.block_pool import BlockPool
from ..cache.paged import PagedSequence
from ..cache.paged_kernels import PagedKernel
from ..cache.static_decode import StaticDecodeCache, batch_bucket, reserve_decode_step
from ..errors import InvalidParameterError

WARMUP_STEPS = 2  # eager runs on a side stream before a capture (lazy initialisation, allocator warm-up)


class GraphMemPool:
    """The memory pool the graphs of one capture round share.

    A pool handle is only an id: PyTorch's caching allocator keeps the pool behind it while at least one graph
    captured into it lives, and a capture into a handle whose graphs are all gone fails its internal check
    (``use_count > 0`` in ``CUDACachingAllocator``). So once every graph of a round is dropped (the block table grew,
    or the round's only capture failed), the next capture starts a new round with a new handle; the old pool's
    memory goes back to the allocator's cache.

    Args:
        new_handle: makes a handle (default :func:`torch.cuda.graph_pool_handle`)
    """

    def __init__(self, new_handle: Callable[[], tuple] | None = None):
        self._new_handle = new_handle or torch.cuda.graph_pool_handle
        self._handle: tuple | None = None
        self.rounds = 0

    def for_capture(self) -> tuple:
        """The handle the next capture allocates from (a new round's when the last round's graphs are gone)."""
        if self._handle is None:
            self._handle = self._new_handle()
            self.rounds += 1
        return self._handle

    def all_graphs_dropped(self) -> None:
        """No graph captured into the current handle lives any more: the next capture starts a new round."""
        self._handle = None


class _Entry:
    """One key's static cache, its forward and (on CUDA) its graph and output buffer."""

    def __init__(self, cache: StaticDecodeCache, forward: Callable[[], torch.Tensor]):
        self.cache, self.forward = cache, forward
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None


class DecodeGraphRunner:
    """Runs bucketed decode steps through static buffers: captured CUDA graphs (``capture=True``, CUDA only) or
    eagerly (``capture=False``, any device: the same step without the capture).

    Args:
        model: a causal LM with kvtrim attention installed
        pool: the engine's block pool (``scratch=True``)
        accumulate_decode_metric, buffer: the continual KV-Compress metric, as :class:`PagedBatchCache`
        max_batch: the largest decode batch run here; a larger batch is the caller's (eager, bucketed) business
        capture: capture CUDA graphs (needs a CUDA pool)
        decode_kernel: the decode attention of the static step, as :class:`PagedBatchCache` (a choice such as
            ``"gather"``, or a resolved :class:`~kvtrim.cache.paged_kernels.PagedKernel`)

    Attributes:
        captures: graphs captured; replays: steps replayed from a graph; eager_steps: static steps run eagerly;
        invalidations: times the shared block table moved (it grew), which drops every captured graph;
        capture_s: wall seconds spent in captures (their warm-up forwards included; each capture synchronizes)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pool: BlockPool,
        *,
        accumulate_decode_metric: bool,
        buffer: int,
        max_batch: int,
        capture: bool,
        decode_kernel: str | PagedKernel = "gather",
    ):
        if pool.scratch_block is None:
            raise InvalidParameterError("static decode steps need a BlockPool(scratch=True) for their padding rows")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise InvalidParameterError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if capture and pool.device.type != "cuda":
            raise InvalidParameterError(f"CUDA graphs need a CUDA device; the pool is on {pool.device}")
        self.model, self.pool = model, pool
        self.accumulate_decode_metric, self.buffer = accumulate_decode_metric, buffer
        self.max_batch, self.capture = max_batch, capture
        self.decode_kernel = decode_kernel
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._table: torch.Tensor | None = None  # the shared block table the graphs read
        self._mempool = GraphMemPool() if capture else None
        self.captures = self.replays = self.eager_steps = self.invalidations = 0
        self.capture_s = 0.0

    def handles(self, n: int) -> bool:
        """Whether a decode batch of ``n`` sequences runs here (its bucket is at most ``max_batch``)."""
        return batch_bucket(n) <= self.max_batch

    @torch.inference_mode()
    def run(self, sequences: list[PagedSequence], tokens: list[int]) -> torch.Tensor:
        """One decode step: ``sequences`` feed ``tokens`` (one each). Returns ``[n, vocab]`` logits, a view of a
        static buffer valid until the next step. Raises :class:`~kvtrim.cache.block_pool.OutOfBlocks` (nothing
        changed) if the new token's blocks do not fit."""
        n = len(sequences)
        if not self.handles(n):
            raise InvalidParameterError(f"a decode batch of {n} exceeds max_batch={self.max_batch}")
        slots, width = reserve_decode_step(sequences)
        store = sequences[0].store
        if self._table is not None and self._table is not store.table:  # the table grew: graphs read the old one
            self._drop_graphs()
        self._table = store.table
        key = (batch_bucket(n), width)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = self._new_entry(sequences, *key)
        if self.capture and entry.graph is None:
            try:
                self._capture(entry, sequences)
            finally:
                entry.cache.sequences = []
        entry.cache.load(sequences, slots, tokens)
        if store.table is not self._table:  # nothing between the check above and here may reallocate it
            raise RuntimeError("the shared block table moved while a decode step was being prepared")
        try:
            if entry.graph is not None:
                entry.graph.replay()
                self.replays += 1
                logits = entry.logits
            else:
                logits = entry.forward()
                self.eager_steps += 1
        finally:
            # Hold no sequence between steps: a finished sequence gives its table slot back when it is collected.
            entry.cache.sequences = []
        return logits[:n]

    def _new_entry(self, sequences: list[PagedSequence], batch: int, width: int) -> _Entry:
        cache = StaticDecodeCache(
            self.model.config, self.pool, sequences, batch=batch, width=width,
            accumulate_decode_metric=self.accumulate_decode_metric, buffer=self.buffer,
            decode_kernel=self.decode_kernel,
        )  # fmt: skip
        model = self.model

        def forward() -> torch.Tensor:
            """The static step: reads only ``cache``'s buffers, the pool, the shared table and the weights."""
            out = model(
                input_ids=cache.input_ids, position_ids=cache.position_ids, past_key_values=cache, use_cache=True,
                logits_to_keep=1,
            )  # fmt: skip
            return out.logits[:, -1]

        return _Entry(cache, forward)

    def _capture(self, entry: _Entry, sequences: list[PagedSequence]) -> None:
        """Warm up on a side stream, then capture on it, both on padding rows only (nothing real is written).

        The capture is begun and ended here rather than with ``torch.cuda.graph``, whose entry empties the caching
        allocator before every capture: each graph captured later (a new bucket key, or a recapture after the table
        grew) would hand its memory back to the driver and allocate it again, with a device-wide synchronization.
        Every graph here shares one memory pool, so there is nothing to free between captures."""
        t0 = time.perf_counter()
        entry.cache.load_padding(sequences)
        device = self.pool.device
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_STEPS):
                entry.forward()
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):  # a capture runs on a side stream, never the default one
            graph.capture_begin(pool=self._mempool.for_capture())
            try:
                logits = entry.forward()
            except BaseException:
                with contextlib.suppress(RuntimeError):  # end the broken capture; the forward's error is reported
                    graph.capture_end()
                del graph
                if not any(e.graph is not None for e in self._entries.values()):
                    self._mempool.all_graphs_dropped()  # the failed graph was the round's only user of the pool
                raise
            graph.capture_end()
        torch.cuda.synchronize(device)
        entry.graph, entry.logits = graph, logits
        self.captures += 1
        self.capture_s += time.perf_counter() - t0

    def _drop_graphs(self) -> None:
        self.invalidations += 1
        for entry in self._entries.values():
            entry.graph, entry.logits = None, None
        if self._mempool is not None:
            self._mempool.all_graphs_dropped()
