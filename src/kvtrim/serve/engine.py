"""A continuous-batching engine over one paged, KV-Compress-compressed cache pool (arXiv 2410.00161).

The engine follows decision 6 (docs/decisions.md): real blocks, block-granular eviction, MoveCache.

Every :meth:`Engine.step` runs, in order: compression (forced after a completed prefill and under memory
pressure, otherwise every step unless ``compress_once``), preemption by recompute if the next decode step still
does not fit, **one batched decode forward over every decoding sequence**, then **chunked prefill**: the step's
token budget left by the decodes goes to prefill chunks (running prefills first, then newly admitted requests,
first come first served, admitted by their projected compressed size), all chunks of a step packed into one
forward whatever their lengths. With compression on, a sequence is compressed after each of its prefill chunks, so
a long prompt never needs its uncompressed size in the pool; every compression of a step is one batched eviction
over all the sequences due (:func:`~kvtrim.selection.block_eviction.compress_sequences`). Scheduling decisions
live in :mod:`kvtrim.serve.scheduler`; storage and eviction in :mod:`kvtrim.cache.paged` and
:mod:`kvtrim.selection.block_eviction`.

``submit`` and ``cancel`` are thread-safe and take no lock the engine loop holds while it works: ``submit``
tokenizes in the caller's thread with a tokenizer copy of that thread (fast tokenizers must not be shared across
threads), the engine thread detokenizes with its own copy. Results stream through
:class:`~kvtrim.serve.types.RequestHandle`.
Use it synchronously (``step`` / ``run_until_idle``) or with a background thread (``start`` / ``stop``).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..cache.paged import BlockPool, PagedBatchCache, PagedSequence
from ..cache.paged_kernels import choose_decode_kernel
from ..cache.static_decode import batch_bucket
from ..errors import InvalidParameterError
from ..integration.attention import enable
from ..methods.presets import KV_COMPRESS as PAGED_METHODS  # the KV-Compress presets, stated once
from ..runtime import eos_ids
from ..selection.block_eviction import compress_sequences, prefill_metric
from .decode_graphs import DecodeGraphRunner
from .scheduler import BlockGeometry, Scheduler, max_cache_tokens
from .types import RequestHandle, SamplingParams, TokenEvent


@dataclass
class EngineStats:
    """A snapshot of one engine's counters and gauges (``Engine.stats``; all public, for Prometheus exporters).

    Counters only grow over the engine's life; gauges (``requests_*``, ``pool_blocks_used/free``) are the state
    at the snapshot. ``*_s`` are wall seconds spent in each phase.

    Attributes:
        steps: engine iterations
        decode_steps: batched decode forwards
        prefills: completed (re)prefills (a preempted request is prefilled again)
        prefill_chunks: prefill chunks fed (a prompt longer than ``prefill_chunk`` takes several)
        prefill_tokens: tokens fed by prefill chunks, recomputes included
        tokens_generated: tokens emitted to requests (counter; tokens per second = its rate)
        decode_tokens: sequences fed by decode forwards summed over steps (mean batch = this / decode_steps)
        max_decode_batch: the largest decode batch so far
        preemptions: requests preempted by recompute (counter)
        compressions: sequence compressions that evicted at least one block (counter)
        blocks_evicted: blocks freed by compression (counter)
        requests_finished: requests finished for any reason (counter)
        requests_running: requests holding KV blocks now, prefilling or decoding (gauge)
        requests_prefilling: of those, requests with prefill chunks still to feed (gauge)
        requests_waiting: requests queued for admission, submitted ones not yet seen included (gauge)
        pool_blocks_total: blocks in the pool
        pool_blocks_used, pool_blocks_free: blocks held by requests / free now (gauges)
        peak_blocks_used: the most blocks ever held at the end of a step
        prefill_s, decode_s, compress_s: wall seconds in prefill forwards, decode forwards and compression
        decode_kernel: the decode attention that runs: ``"gather"`` (gather + SDPA) or the block-table kernel's
            name (``"vllm_flash_attn"``, ``"flash_attn"``, ``"triton"``)
        decode_kernel_refused: each block-table kernel looked at and not chosen -> why (not importable, a
            condition unmet, or its test call failed); empty for ``decode_kernel="gather"``
        graph_captures: CUDA graphs captured (``cuda_graphs=True``; recaptures after the block table grew included)
        graph_replays: decode steps replayed from a CUDA graph
        static_decode_steps: decode steps run eagerly through the static buffers (``static_decode=True``)
    """

    steps: int = 0
    decode_steps: int = 0
    prefills: int = 0
    prefill_chunks: int = 0
    prefill_tokens: int = 0
    tokens_generated: int = 0
    decode_tokens: int = 0
    max_decode_batch: int = 0
    preemptions: int = 0
    compressions: int = 0
    blocks_evicted: int = 0
    requests_finished: int = 0
    requests_running: int = 0
    requests_prefilling: int = 0
    requests_waiting: int = 0
    pool_blocks_total: int = 0
    pool_blocks_used: int = 0
    pool_blocks_free: int = 0
    peak_blocks_used: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    compress_s: float = 0.0
    decode_kernel: str = "gather"
    decode_kernel_refused: dict[str, str] = field(default_factory=dict)
    graph_captures: int = 0
    graph_replays: int = 0
    static_decode_steps: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def __call__(self) -> EngineStats:
        """``engine.stats()`` and ``engine.stats`` both give the snapshot."""
        return self


class _TextOutput:
    """Incremental detokenization; text that could still become a stop string is held back."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]):
        self._decode = decode  # ids -> text without special tokens
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""  # all decoded text
        self.emitted = 0  # characters of ``text`` handed out
        self._prefix = 0  # ids[_prefix:_read] decode to the tail of ``text`` (context for the next token)
        self._read = 0

    def add(self, token_id: int) -> tuple[str, bool]:
        """Append a token; returns ``(text to emit now, stopped)``. On a stop, the text ends before it."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        old_len = len(self.text)
        if len(after) > len(before) and not after.endswith("\ufffd"):  # "\ufffd": an incomplete character
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
        if not self.stop:
            return self._emit(len(self.text)), False
        hits = [
            i
            for s in self.stop
            if (i := self.text.find(s, max(0, old_len - len(s) + 1))) >= 0  # only matches touching new text
        ]
        if hits:
            return self._emit(min(hits)), True
        held = max(_partial_suffix(self.text, s) for s in self.stop)
        return self._emit(len(self.text) - held), False

    def flush(self) -> str:
        """Everything not yet emitted (at the end of a request that did not hit a stop string)."""
        tail = self._decode(self.ids[self._prefix :])[len(self._decode(self.ids[self._prefix : self._read])) :]
        self.text += tail
        self._prefix = self._read = len(self.ids)
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        out = self.text[self.emitted : upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return out


def _partial_suffix(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, greedy: int | None = None
) -> int:
    """One token from ``logits`` ``[vocab]``: argmax at temperature 0, else temperature + nucleus (top-p).

    ``greedy``: the argmax, when the caller computed it for a whole batch at once (one host read per step)."""
    if params.temperature == 0.0:
        return int(logits.argmax()) if greedy is None else greedy
    # Per-request generators live on the CPU (seeds reproduce across devices): sample where the generator is.
    probs = torch.softmax(logits.float().to(generator.device) / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < params.top_p  # always keeps the most likely token
        sorted_probs = sorted_probs * keep
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


class _BatchedCounts:
    """The scheduler's block counts of the engine's requests, read from the shared host copies of the block tables
    in one vectorized call for all of them (instead of a few tensor ops per request, several times a step)."""

    @staticmethod
    def _paged(seqs: list[_Request]) -> tuple[list[PagedSequence], torch.Tensor]:
        paged = [r.paged for r in seqs if r.paged is not None]
        return paged, torch.tensor([p.slot for p in paged], dtype=torch.long)

    def decode_need(self, seqs: list[_Request]) -> int:
        paged, slots = self._paged([r for r in seqs if not r.prefill_remaining()])
        return int(paged[0].store.blocks_needed(slots, 1).sum()) if paged else 0

    def committed(self, seqs: list[_Request]) -> int:
        paged, slots = self._paged(seqs)
        held = iter(paged[0].store.host_nblocks[slots].sum(1).tolist() if paged else [])
        return sum(max(0 if r.paged is None else next(held), r.projected_blocks()) for r in seqs)


@dataclass(eq=False)
class _Request:
    """One request inside the engine (implements :class:`~kvtrim.serve.scheduler.ScheduledSequence`)."""

    request_id: str
    arrival: int
    prompt_ids: list[int]
    params: SamplingParams
    handle: RequestHandle
    generator: torch.Generator
    text: _TextOutput
    generated: list[int] = field(default_factory=list)  # emitted tokens (the last one is not fed yet)
    paged: PagedSequence | None = None
    prefilled: int = 0  # tokens of the current (re)prefill already fed
    decoding: bool = False  # the current (re)prefill is complete
    engine: Engine | None = None
    steps_since_compression: int = 0
    compressed_since_prefill: bool = False
    preemptions: int = 0
    compressions: int = 0

    def prefill_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    def blocks_held(self) -> int:
        return 0 if self.paged is None else self.paged.blocks_held()

    def decode_blocks_needed(self) -> int:
        return 0 if self.paged is None or self.prefill_remaining() else self.paged.blocks_needed(1)

    def prefill_remaining(self) -> int:
        return 0 if self.decoding else self.prefill_tokens() - self.prefilled

    def chunk_blocks_needed(self, tokens: int, last: bool) -> int:
        new = tokens + int(last)
        if self.paged is None:
            return self.engine.geometry.blocks_for(new)
        return self.paged.blocks_needed(new)

    def projected_blocks(self) -> int:
        """What admission projects it to hold (see :meth:`Engine.projected_blocks`)."""
        return self.engine.projected_blocks(self.prefill_tokens(), len(self.prompt_ids) + self.params.max_tokens)

    def committed_blocks(self) -> int:
        return max(self.blocks_held(), self.projected_blocks())

    def kv_entries(self) -> int:
        return 0 if self.paged is None else self.paged.entries()

    def release(self) -> None:
        self.prefilled = 0
        self.decoding = False
        if self.paged is not None:
            self.paged.release()
            self.paged = None


class Engine:
    """Continuous batching with a fixed KV memory budget and KV-Compress eviction.

    Args:
        model, tokenizer: a supported transformers causal LM (kvtrim attention is installed on it) and its tokenizer
        kv_memory_bytes: key+value bytes of the block pool (exactly one of this and ``kv_blocks``)
        kv_blocks: blocks in the pool (one block = ``block_size`` tokens of one layer and KV head)
        block_size: tokens per block
        compression_rate: cr; 1 keeps everything, 8 keeps about 1/8 (M = max(min_cache_tokens,
            floor((T/cr − 1)/block_size)·block_size) per head on average for a sequence of T tokens)
        method: ``kvcompress`` (window 32), ``kvc_w8`` (window 8) or ``kvc_full`` (all prompt queries, v = 10)
        protected_window: the newest tokens of every head that are never evicted (None: the method's preset,
            32 for ``kvcompress`` and ``kvc_full``, 8 for ``kvc_w8``)
        min_cache_tokens: floor of M
        compress_once: compress a sequence only in the first compression after its prefill (default: continual
            compression with decode-time squared attention accumulated into the metric)
        max_batch: running sequences at most (None: memory decides)
        seed: seeds the per-request generators of requests submitted without a seed
        model_name: name reported to the HTTP layer (default: the model's ``name_or_path``)
        compression_interval: steps between compressions that neither a prefill nor memory pressure forces
            (the paper's default 1: every step)
        prefill_chunk: tokens per prefill chunk; a longer prompt is fed over several steps (compressed after each
            chunk when compression is on)
        max_num_batched_tokens: tokens one step feeds at most, decodes and prefill chunks together (vLLM's
            ``max_num_batched_tokens``; one chunk is always allowed)
        decode_buckets: static decode shapes, as vLLM pads them for CUDA graphs: the decode batch is padded to a
            bucket (1, 2, 4, 8, then multiples of 8; padding rows touch only a scratch block) and block-table
            widths are rounded up to powers of two. Outputs are unchanged. Without ``cuda_graphs`` or
            ``static_decode`` it runs eagerly, so on a CPU it only adds padding work.
        cuda_graphs: replay decode steps from CUDA graphs, one per (batch bucket, table width), captured on first
            use (needs ``decode_buckets=True`` and a model on a CUDA device; batches above ``cuda_graph_max_batch``
            run eagerly). See :mod:`kvtrim.serve.decode_graphs`.
        static_decode: run decode steps through the same static buffers and forward that ``cuda_graphs`` captures,
            eagerly, on any device (needs ``decode_buckets=True``): checks the graph path where there is no CUDA
        cuda_graph_max_batch: the largest decode batch bucket run through the static step (graphs or
            ``static_decode``); larger batches run the eager bucketed forward
        decode_kernel: decode attention: ``"gather"`` (default; gather + SDPA), ``"flash"`` (one block-table
            flash-attention call per layer, :mod:`kvtrim.cache.paged_kernels`), ``"triton"`` (kvtrim's Triton
            block-table kernel, any block size, continual metric fused, :mod:`kvtrim.cache.triton_paged`; CUDA),
            ``"auto"`` (vLLM's fork, else Triton, else upstream flash-attn, when one can run; else gather).
            ``"flash"``/``"triton"`` raise InvalidParameterError saying why when they cannot run.
            ``stats.decode_kernel`` and :attr:`decode_kernel` say which runs.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        kv_memory_bytes: int | None = None,
        kv_blocks: int | None = None,
        block_size: int = 16,
        compression_rate: float = 1.0,
        method: str = "kvcompress",
        protected_window: int | None = None,
        min_cache_tokens: int = 128,
        compress_once: bool = False,
        max_batch: int | None = None,
        seed: int = 0,
        model_name: str | None = None,
        compression_interval: int = 1,
        prefill_chunk: int = 512,
        max_num_batched_tokens: int = 2048,
        decode_buckets: bool = False,
        decode_kernel: str = "gather",
        cuda_graphs: bool = False,
        static_decode: bool = False,
        cuda_graph_max_batch: int = 64,
    ):
        _check_engine_args(kv_memory_bytes, kv_blocks, compression_rate, method, protected_window, min_cache_tokens)
        device = next(model.parameters()).device
        _check_graph_args(decode_buckets, cuda_graphs, static_decode, cuda_graph_max_batch, device)
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        dtype = next(model.parameters()).dtype
        choice = choose_decode_kernel(
            decode_kernel, device=device, dtype=dtype, block_size=block_size, head_dim=head_dim
        )  # before anything changes
        kernel = choice.kernel
        # The name of the decode attention that runs; the caches get the resolved kernel (no per-forward lookup).
        self.decode_kernel = "gather" if kernel is None else kernel.name
        self._attention_kernel = "gather" if kernel is None else kernel
        enable(model)  # raises UnsupportedModelError for unsupported architectures
        self.model, self.tokenizer = model, tokenizer
        self.model_name = model_name or getattr(model, "name_or_path", None) or cfg._name_or_path or "model"
        if not isinstance(decode_buckets, bool):
            raise InvalidParameterError(f"decode_buckets must be True or False, got {decode_buckets!r}")
        self.decode_buckets = decode_buckets
        if kv_blocks is not None:
            self.pool = BlockPool(kv_blocks, block_size, head_dim, dtype, device, scratch=decode_buckets)
        else:
            self.pool = BlockPool.for_bytes(kv_memory_bytes, block_size, head_dim, dtype, device, decode_buckets)
        self.geometry = BlockGeometry(cfg.num_hidden_layers, cfg.num_key_value_heads, block_size)
        self.compression_rate = float(compression_rate)
        self.compress = self.compression_rate > 1.0
        self.method = method
        preset = PAGED_METHODS[method]
        self.window, self.metric_buffer, self.kernel = preset.window, preset.buffer, preset.kernel
        self.protected_window = preset.protected_window if protected_window is None else protected_window
        self.min_cache_tokens = min_cache_tokens
        self.compress_once = compress_once
        self._graphs: DecodeGraphRunner | None = None
        if cuda_graphs or static_decode:
            self._graphs = DecodeGraphRunner(
                model, self.pool, accumulate_decode_metric=self.compress and not compress_once,
                buffer=self.metric_buffer, max_batch=cuda_graph_max_batch, capture=cuda_graphs,
                decode_kernel=self._attention_kernel,
            )  # fmt: skip
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        self.eos = eos_ids(model, tokenizer)
        self.scheduler = Scheduler(
            self.geometry, self.pool.num_blocks, compress=self.compress, compress_once=compress_once,
            compression_interval=compression_interval, max_batch=max_batch, prefill_chunk=prefill_chunk,
            max_num_batched_tokens=max_num_batched_tokens, counts=_BatchedCounts(),
        )  # fmt: skip
        self._stats = EngineStats(
            pool_blocks_total=self.pool.num_blocks, decode_kernel=self.decode_kernel,
            decode_kernel_refused=dict(choice.refused),
        )  # fmt: skip
        self._generator = torch.Generator().manual_seed(seed)
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._inbox: list[_Request] = []
        self._cancelled: list[str] = []
        self._active: dict[str, _Request] = {}  # submitted and not finished
        self._lock = threading.Lock()  # guards _inbox, _cancelled, _active and the seed generator (never held long)
        # Fast tokenizers are not safe for concurrent use: the engine thread detokenizes with its own copy and each
        # submitting thread tokenizes with a copy of its own, made once from a pristine copy nobody encodes with.
        self._pristine_tok = copy.deepcopy(tokenizer)
        self._detok = copy.deepcopy(tokenizer)
        self._copy_lock = threading.Lock()  # only held while copying a tokenizer; the engine never takes it
        self._thread_tok = threading.local()
        self._step_lock = threading.RLock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ------------------------------------------------------------------------------------ public API
    def submit(
        self,
        prompt: str | list[int] | list[dict],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        chat: bool = False,
    ) -> RequestHandle:
        """Queue a request (thread-safe). ``prompt``: text, token ids, or chat messages (``[{"role", "content"}]``;
        ``chat=True`` wraps a text as one user message). Raises :class:`InvalidParameterError` for bad input and
        for requests that could never fit in the pool or the model's positions."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidParameterError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise InvalidParameterError(f"request_id must be a non-empty string, got {request_id!r}")
        ids = self._encode(prompt, chat)
        self._check_fits(len(ids), params.max_tokens)
        with self._lock:
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self._active:
                raise InvalidParameterError(f"request_id {rid!r} is already in use by an unfinished request")
            seed = params.seed if params.seed is not None else int(torch.randint(2**62, (), generator=self._generator))
            handle = RequestHandle(rid, len(ids))
            req = _Request(
                engine=self,
                request_id=rid,
                arrival=next(self._arrivals),
                prompt_ids=ids,
                params=params,
                handle=handle,
                generator=torch.Generator().manual_seed(seed),
                text=_TextOutput(self._decode_text, params.stop),
            )
            self._active[rid] = req
            self._inbox.append(req)
        self._wake.set()
        return handle

    def encode(self, prompt: str | list[int] | list[dict], chat: bool = False) -> list[int]:
        """The prompt token ids ``submit`` would queue (thread-safe, in the caller's thread with its own tokenizer
        copy; takes no lock the engine loop needs). Raises :class:`InvalidParameterError` for bad prompts."""
        return self._encode(prompt, chat)

    def cancel(self, request_id: str) -> bool:
        """Cancel an unfinished request (thread-safe); False if it is unknown or already finished."""
        with self._lock:
            req = self._active.get(request_id)
            if req is None or req.handle.finished:
                return False
            self._cancelled.append(request_id)
        self._wake.set()
        return True

    def step(self) -> list[TokenEvent]:
        """One iteration: cancellations, compression, preemption, one batched decode, admissions and prefills.
        Returns the events of this step (they are also pushed to the request handles)."""
        # Sequences are created in inference mode, so every path that touches them runs in it too.
        with self._step_lock, torch.inference_mode():
            events: list[TokenEvent] = []
            self._ingest(events)
            self._compress_phase(events)
            self._preempt_phase(events)
            decoded = self._decode_phase(events)
            self._prefill_phase(events, decoded)
            self._stats.steps += 1
            self._stats.peak_blocks_used = max(self._stats.peak_blocks_used, self.pool.num_used)
            return events

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._cancelled or self.scheduler.has_work)

    def run_until_idle(self) -> None:
        """Step until every submitted request has finished (synchronous use)."""
        while self.has_work():
            self.step()

    def start(self) -> None:
        """Run :meth:`step` in a background thread whenever there is work."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kvtrim-engine", daemon=True)
        self._thread.start()

    def stop(self, cancel_pending: bool = True) -> None:
        """Stop the background thread; unfinished requests are cancelled unless ``cancel_pending`` is False."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if cancel_pending:
            with self._lock:
                pending = [rid for rid, r in self._active.items() if not r.handle.finished]
            for rid in pending:
                self.cancel(rid)
            with self._step_lock, torch.inference_mode():
                self._ingest([])

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def stats(self) -> EngineStats:
        s = dataclasses.replace(self._stats)
        s.pool_blocks_used, s.pool_blocks_free = self.pool.num_used, self.pool.num_free
        running, waiting = list(self.scheduler.running), len(self.scheduler.waiting)
        s.requests_running, s.requests_waiting = len(running), waiting
        s.requests_prefilling = sum(1 for r in running if r.prefill_remaining() > 0)
        with self._lock:
            s.requests_waiting += len(self._inbox)
        if self._graphs is not None:
            g = self._graphs
            s.graph_captures, s.graph_replays, s.static_decode_steps = g.captures, g.replays, g.eager_steps
        return s

    def _decode_text(self, ids: list[int]) -> str:
        """Detokenize (engine thread only: the engine's own tokenizer copy)."""
        return self._detok.decode(ids, skip_special_tokens=True)

    def _caller_tokenizer(self):
        """The calling thread's own tokenizer copy (made on first use)."""
        tok = getattr(self._thread_tok, "tok", None)
        if tok is None:
            with self._copy_lock:
                tok = copy.deepcopy(self._pristine_tok)
            self._thread_tok.tok = tok
        return tok

    def projected_blocks(self, prompt_tokens: int, final_tokens: int) -> int:
        """Blocks admission counts a request for (its ``committed_blocks`` is at least this).

        Without compression: its uncompressed prompt and first token, as vLLM admits (growth is left to preemption).
        With compression the growth is small and bounded, so it is reserved: the compressed budget at
        ``final_tokens`` (prompt + max_tokens) plus one partial block per table.
        """
        g = self.geometry
        if not self.compress:
            return g.blocks_for(prompt_tokens + 1)
        m = max_cache_tokens(final_tokens, self.compression_rate, self.min_cache_tokens, g.block_size)
        return min(g.blocks_for(final_tokens), g.budget_blocks(max(m, self.protected_window)) + g.tables)

    def held_blocks(self) -> int:
        """Blocks held by the running requests (equals the pool's used blocks: the engine leaks none)."""
        return sum(r.blocks_held() for r in self.scheduler.running)

    # ------------------------------------------------------------------------------------ validation
    def _encode(self, prompt, chat: bool) -> list[int]:
        tok = self._caller_tokenizer()
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidParameterError("prompt must be a non-empty string")
            if not chat:
                return list(tok(prompt)["input_ids"]) or _empty_prompt()
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, list) or not prompt:
            raise InvalidParameterError("prompt must be a non-empty string, list of token ids, or list of messages")
        if all(isinstance(m, dict) for m in prompt):
            return self._encode_chat(prompt)
        vocab = self.model.config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise InvalidParameterError(f"prompt token ids must be integers in [0, {vocab})")
        return list(prompt)

    def _encode_chat(self, messages: list[dict]) -> list[int]:
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidParameterError("each chat message needs a string 'role' and a string 'content'")
        tok = self._caller_tokenizer()
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:  # tokenizers without a template (the test models): a plain transcript
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return list(tok(text, add_special_tokens=False)["input_ids"]) or _empty_prompt()

    def _check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        if self.max_positions is not None and prompt_tokens + max_tokens > self.max_positions:
            raise InvalidParameterError(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds the model's maximum context "
                f"length (max_position_embeddings={self.max_positions})"
            )
        need = self.blocks_bound(prompt_tokens, max_tokens)
        if need > self.pool.num_blocks:
            raise InvalidParameterError(
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) needs up to {need} KV blocks at "
                f"compression_rate={self.compression_rate:g}, but the KV memory pool holds only "
                f"{self.pool.num_blocks} blocks ({self.pool.num_blocks * self.pool.block_nbytes()} bytes of "
                f"kv_memory); shorten the prompt, lower max_tokens or raise kv_memory_bytes/kv_blocks"
            )

    def blocks_bound(self, prompt_tokens: int, max_tokens: int) -> int:
        """Most blocks a request alone ever needs: its prefill, and its growth (compressed or not) while decoding.

        The last decode step feeds ``prompt_tokens + max_tokens − 1`` tokens. Compressed, a sequence is cut to its
        budget M at the start of each step; it may then still hold up to one more block per table (no head is cut
        below M entries, so block rounding can stay) and grows by at most one block per table before the next one.
        """
        g = self.geometry
        prefill = g.blocks_for(prompt_tokens + 1)  # admission also reserves the first decoded token's blocks
        full = g.blocks_for(prompt_tokens + max_tokens - 1)
        if not self.compress:
            return max(prefill, full)

        def budget(tokens: int) -> int:
            m = max_cache_tokens(tokens, self.compression_rate, self.min_cache_tokens, g.block_size)
            return g.budget_blocks(max(m, self.protected_window))

        if self.compress_once:
            grown = budget(prompt_tokens) + g.tables * (-(-(max_tokens - 1) // g.block_size) + 2)
        else:
            grown = budget(prompt_tokens + max_tokens - 1) + 2 * g.tables
        return max(prefill, min(full, grown))

    # ----------------------------------------------------------------------------------------- phases
    def _ingest(self, events: list[TokenEvent]) -> None:
        with self._lock:
            new, self._inbox = self._inbox, []
            cancelled, self._cancelled = self._cancelled, []
        for req in new:
            self.scheduler.add(req)
        for rid in cancelled:
            req = self._active.get(rid)
            if req is not None:
                self._finish(req, events, None, "cancelled")

    def _compress_phase(self, events: list[TokenEvent]) -> None:
        plan = self.scheduler.plan_compression(self.pool.num_free)
        if plan is None:
            return
        t0 = time.perf_counter()
        self._compress(list(plan.sequences), events)
        self._device_sync()
        self._stats.compress_s += time.perf_counter() - t0

    def _compress(self, reqs: list[_Request], events: list[TokenEvent], mark: bool = True) -> None:
        """Compress every sequence of ``reqs`` to its budget in one batched eviction (one ranking and one
        MoveCache for all of them); a failure fails exactly these requests."""
        if not reqs:
            return
        bs = self.pool.block_size
        budgets = [max_cache_tokens(r.paged.seen, self.compression_rate, self.min_cache_tokens, bs) for r in reqs]
        try:
            freed = compress_sequences(
                [r.paged for r in reqs], max_cache_tokens=budgets, protected_window=self.protected_window
            )
        except Exception as exc:
            self._fail(reqs, events, exc)
            return
        for req, n in zip(reqs, freed, strict=True):
            if n:
                self._stats.compressions += 1
                self._stats.blocks_evicted += n
                req.compressions += 1
            if mark:
                self.scheduler.mark_compressed(req)

    def _preempt_phase(self, events: list[TokenEvent]) -> None:
        victims = self.scheduler.preempt(self.pool.num_free)
        for req in victims:
            req.release()
            req.preemptions += 1
            self._stats.preemptions += 1
        if victims and not self.scheduler.running:
            # The oldest victim was preempted although it ran alone: it cannot fit even by itself.
            last = min(victims, key=lambda r: r.arrival)
            self._finish(last, events, None, "error", "out of KV memory: the request alone outgrew the pool")

    def _device_sync(self) -> None:
        """Wait for the accelerator's queued work, so each phase's seconds in the stats are its own (the decode
        phase ends with its token read instead). Nothing to wait for on a CPU."""
        if self.pool.device.type == "cuda":
            torch.cuda.synchronize(self.pool.device)

    def _decode_phase(self, events: list[TokenEvent]) -> int:
        """One batched decode forward over the decoding sequences; returns how many were fed."""
        batch = self.scheduler.decoding()
        if not batch:
            return 0
        t0 = time.perf_counter()
        logits = self._decode_forward(batch, events)
        # One host read for the whole batch, not one per request; inside the timing because on an accelerator it is
        # where the step's queued kernels finish (decode_s is the forward's device time, not its launch time).
        greedy = None if logits is None else logits.argmax(-1).tolist()
        self._stats.decode_s += time.perf_counter() - t0
        if logits is None:
            return len(batch)
        self._stats.decode_steps += 1
        self._stats.decode_tokens += len(batch)
        self._stats.max_decode_batch = max(self._stats.max_decode_batch, len(batch))
        for row, req in enumerate(batch):
            self._next_token(req, logits[row], events, greedy[row])
        self.scheduler.tick()
        return len(batch)

    def _decode_forward(self, batch: list[_Request], events: list[TokenEvent]) -> torch.Tensor | None:
        if self._graphs is not None and self._graphs.handles(len(batch)):
            try:  # host preparation into static buffers, then a graph replay (or the same forward, eagerly)
                return self._graphs.run([r.paged for r in batch], [r.generated[-1] for r in batch])
            except Exception as exc:
                self._fail(batch, events, exc)
                return None
        pad = batch_bucket(len(batch)) - len(batch) if self.decode_buckets else 0
        input_ids = torch.tensor([[r.generated[-1]] for r in batch] + [[0]] * pad, device=self.pool.device)
        positions = torch.tensor([[r.paged.seen] for r in batch] + [[0]] * pad, device=self.pool.device)
        try:
            cache = PagedBatchCache(
                self.model.config,
                self.pool,
                [r.paged for r in batch],
                accumulate_decode_metric=self.compress and not self.compress_once,
                buffer=self.metric_buffer,
                bucketed=self.decode_buckets,
                decode_kernel=self._attention_kernel,
            )
            out = self.model(
                input_ids=input_ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1
            )
        except Exception as exc:  # a failed batch forward (OutOfBlocks would be a scheduler bug) fails the batch
            self._fail(batch, events, exc)
            return None
        return out.logits[: len(batch), -1]

    def _prefill_phase(self, events: list[TokenEvent], decoded: int) -> None:
        plan = self.scheduler.schedule_prefill(self.pool.num_free, decoded)
        for req in plan.impossible:
            self._finish(req, events, None, "error", "out of KV memory: the request no longer fits in the pool")
        if not plan.chunks:
            if not decoded and self.scheduler.running:
                self._unstall(events)
            return
        # Every chunk of this step in ONE forward, packed back to back whatever their lengths (varlen prefill).
        reqs = [req for req, _ in plan.chunks]
        t0 = time.perf_counter()
        try:
            logits = self._prefill_chunks(plan.chunks)
            self._device_sync()
        except Exception as exc:
            self._fail(reqs, events, exc)
            return
        finally:
            self._stats.prefill_s += time.perf_counter() - t0
        partial = []
        for row, req in enumerate(reqs):
            if req.prefill_remaining() == 0:
                req.decoding = True
                self._stats.prefills += 1
                req.steps_since_compression = 0
                req.compressed_since_prefill = False
                self.scheduler.prefill_done()
                self._next_token(req, logits[row], events)
            else:
                partial.append(req)
        if self.compress and partial:  # compress as chunks arrive: the prompt never sits uncompressed
            t0 = time.perf_counter()
            self._compress(partial, events, mark=False)
            self._device_sync()
            self._stats.compress_s += time.perf_counter() - t0

    def _unstall(self, events: list[TokenEvent]) -> None:
        """Nothing could run this step (only prefilling sequences, none of whose chunks fit): preempt the newest
        so the older ones progress, or fail a lone sequence that cannot fit even by itself."""
        victim = self.scheduler.stalled_victim()
        if victim is not None:
            victim.release()
            victim.preemptions += 1
            self._stats.preemptions += 1
            return
        for req in list(self.scheduler.running):
            self._finish(req, events, None, "error", "out of KV memory: the request alone outgrew the pool")

    def _prefill_chunks(self, chunks: list[tuple[_Request, int]]) -> torch.Tensor:
        """Feed the next ``n`` prefill tokens of each ``(request, n)`` in one packed forward (chunks of any lengths
        back to back in one row); returns ``[len(chunks), vocab]`` logits of each chunk's last token. With
        compression, each chunk's metric is added to ``pool.metric``."""
        reqs, lengths = [r for r, _ in chunks], [n for _, n in chunks]
        tokens, positions = [], []
        for req, n in chunks:
            if req.paged is None:
                req.paged = PagedSequence(self.pool, self.geometry.layers, self.geometry.kv_heads)
            tokens.extend((req.prompt_ids + req.generated)[req.prefilled : req.prefilled + n])
            positions.extend(range(req.prefilled, req.prefilled + n))
        window = 0
        if self.compress:
            window = max(lengths) if self.window is None else min(self.window, max(lengths))
        cache = PagedBatchCache(
            self.model.config, self.pool, [r.paged for r in reqs], observe_window=window, chunk_lengths=lengths
        )
        device = self.pool.device
        ids = torch.tensor([tokens], device=device)
        pos = torch.tensor([positions], device=device)
        last = torch.tensor(lengths, device=device).cumsum(0) - 1
        out = self.model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=last)
        if self.compress:
            prefill_metric(cache, kernel=self.kernel, buffer=self.metric_buffer)
        for req, n in chunks:
            req.prefilled += n
        self._stats.prefill_chunks += len(chunks)
        self._stats.prefill_tokens += sum(lengths)
        return out.logits[0]

    # ------------------------------------------------------------------------------------ per request
    def _next_token(
        self, req: _Request, logits: torch.Tensor, events: list[TokenEvent], greedy: int | None = None
    ) -> None:
        """Sample, detokenize and check the stop conditions of one request (its errors stay its own)."""
        try:
            token = sample_token(logits, req.params, req.generator, greedy)
            if token in self.eos and not req.params.ignore_eos:
                self._finish(req, events, None, "stop", text=req.text.flush())
                return
            text, stopped = req.text.add(token)
            if stopped:
                self._finish(req, events, None, "stop", text=text)
                return
            req.generated.append(token)
            self._stats.tokens_generated += 1
            if len(req.generated) >= req.params.max_tokens:
                self._finish(req, events, token, "length", text=text + req.text.flush())
                return
            self._push(req, events, TokenEvent(req.request_id, token, text))
        except Exception as exc:
            self._finish(req, events, None, "error", _describe(exc))

    def _finish(
        self,
        req: _Request,
        events: list[TokenEvent],
        token: int | None,
        reason: str,
        error: str | None = None,
        text: str = "",
    ) -> None:
        self.scheduler.finish(req)
        req.release()
        req.handle.output.preemptions = req.preemptions
        req.handle.output.compressions = req.compressions
        self._push(req, events, TokenEvent(req.request_id, token, text, True, reason, error))
        with self._lock:
            self._active.pop(req.request_id, None)
        self._stats.requests_finished += 1

    def _fail(self, batch: list[_Request], events: list[TokenEvent], exc: BaseException) -> None:
        for req in batch:
            self._finish(req, events, None, "error", _describe(exc))

    @staticmethod
    def _push(req: _Request, events: list[TokenEvent], event: TokenEvent) -> None:
        req.handle.push(event)
        events.append(event)

    def _loop(self) -> None:
        while not self._stopping:
            self._wake.clear()
            if not self.has_work():
                self._wake.wait(0.1)
                continue
            try:
                self.step()
            except Exception as exc:  # keep serving: fail what was in flight, then go on
                traceback.print_exc()
                with self._step_lock, torch.inference_mode():
                    self._fail(list(self.scheduler.running), [], exc)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _empty_prompt() -> list[int]:
    raise InvalidParameterError("the prompt tokenizes to no tokens")


def _check_graph_args(decode_buckets, cuda_graphs, static_decode, max_batch, device) -> None:
    for name, value in (("cuda_graphs", cuda_graphs), ("static_decode", static_decode)):
        if not isinstance(value, bool):
            raise InvalidParameterError(f"{name} must be True or False, got {value!r}")
        if value and not decode_buckets:
            raise InvalidParameterError(f"{name}=True needs decode_buckets=True (a graph replays static shapes)")
    if cuda_graphs and torch.device(device).type != "cuda":
        raise InvalidParameterError(
            f"cuda_graphs=True needs the model on a CUDA device, it is on {device}; static_decode=True runs the "
            "same static decode step eagerly on any device"
        )
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise InvalidParameterError(f"cuda_graph_max_batch must be an integer >= 1, got {max_batch!r}")


def _check_engine_args(kv_memory_bytes, kv_blocks, compression_rate, method, protected_window, min_cache_tokens):
    if (kv_memory_bytes is None) == (kv_blocks is None):
        raise InvalidParameterError("give exactly one of kv_memory_bytes and kv_blocks")
    if kv_blocks is not None and (isinstance(kv_blocks, bool) or not isinstance(kv_blocks, int) or kv_blocks <= 0):
        raise InvalidParameterError(f"kv_blocks must be a positive integer, got {kv_blocks!r}")
    rate_ok = isinstance(compression_rate, (int, float)) and not isinstance(compression_rate, bool)
    if not rate_ok or not compression_rate >= 1:
        raise InvalidParameterError(f"compression_rate must be a number >= 1 (1 = keep all), got {compression_rate!r}")
    if method not in PAGED_METHODS:
        raise InvalidParameterError(f"method must be one of {sorted(PAGED_METHODS)}, got {method!r}")
    for name, value in (("protected_window", protected_window), ("min_cache_tokens", min_cache_tokens)):
        if value is None and name == "protected_window":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidParameterError(f"{name} must be an integer >= 0, got {value!r}")
