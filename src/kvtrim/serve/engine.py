"""A continuous-batching engine over one paged, KV-Compress-compressed cache pool (arXiv 2410.00161).

The engine follows decision 6 (docs/decisions.md): real blocks, block-granular eviction, MoveCache.

Every :meth:`Engine.step` runs, in order: compression (forced after a completed prefill and under memory
pressure, otherwise every step unless ``compress_once``), preemption by recompute if the next decode step still
does not fit, **one batched decode forward over every decoding sequence**, then **chunked prefill**: the step's
token budget left by the decodes goes to prefill chunks (running prefills first, then newly admitted requests,
first come first served, admitted by their projected compressed size), all chunks of a step packed into one
forward whatever their lengths. With compression on, a sequence is compressed after each of its prefill chunks, so
a long prompt never needs its uncompressed size in the pool; every compression of a step is one batched eviction
over all the sequences due.

The engine only schedules: request lifecycle, admission (:mod:`kvtrim.serve.admission`), preemption, streaming and
stats, with the decisions taken by :mod:`kvtrim.serve.scheduler`. The device work of each decision (packed prefill,
the decode step with its kernel and CUDA graphs, eviction, the token read) is
:class:`~kvtrim.serve.model_runner.ModelRunner`'s, which owns the block pool and sees sequences, never requests.
Request state lives in :mod:`kvtrim.serve.requests`.

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
from dataclasses import dataclass, field

import torch

from ..errors import InvalidParameterError
from ..methods.presets import KV_COMPRESS as PAGED_METHODS  # the KV-Compress presets, stated once
from ..runtime import eos_ids
from .admission import KVBudget
from .model_runner import ModelRunner, PrefillChunk, check_pool_size, sample_token
from .requests import BatchedCounts, Request, TextOutput
from .scheduler import Scheduler
from .types import RequestHandle, SamplingParams, TokenEvent

__all__ = ["Engine", "EngineStats", "sample_token"]  # sample_token: re-exported from the runner


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
        prefill_s, decode_s, compress_s: wall seconds in prefill forwards, decode forwards (with the step's token
            read and sampling) and compression
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
        kv_quant: ``None`` (K/V blocks in the model's dtype), ``"int8"``, ``"int4"`` or ``"fp8"``: the pool holds
            every entry packed with its per-token scales
            (:class:`~kvtrim.cache.quantized_block_pool.QuantizedBlockPool`), so ``kv_memory_bytes`` holds about
            1.9x (int8, fp8) or 3.6x (int4) more entries than float16 blocks (3.8x and
            7.1x more than float32); admission, preemption and compression count blocks of packed bytes. Decode
            attention then runs the fused dequantizing Triton kernel (``decode_kernel="triton"``, or ``"auto"`` on
            CUDA; :mod:`kvtrim.cache.triton_paged_quant`) or the gather path (``"gather"``, and ``"auto"`` where
            the kernel cannot run); ``"flash"`` raises. The pool has no full-precision window or sink:
            ``"int4"`` here means ``residual=0,sink=0,rotate=1`` (int4's default window and sink are the
            dense and ragged stores'; ``"int4:rotate=0"`` holds the model's channels), and a spec asking for a
            window or a sink (``"int4:residual=32"``) is refused. See
            docs/quantization.md.
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
        kv_quant: str | None = None,
    ):
        _check_engine_args(kv_memory_bytes, kv_blocks, compression_rate, method, protected_window, min_cache_tokens)
        preset = PAGED_METHODS[method]
        if protected_window is not None:
            preset = dataclasses.replace(preset, protected_window=protected_window)
        compress = float(compression_rate) > 1.0
        self.runner = ModelRunner(
            model, kv_memory_bytes=kv_memory_bytes, kv_blocks=kv_blocks, block_size=block_size,
            eviction=preset if compress else None, continual_metric=compress and not compress_once,
            decode_buckets=decode_buckets, decode_kernel=decode_kernel, cuda_graphs=cuda_graphs,
            static_decode=static_decode, cuda_graph_max_batch=cuda_graph_max_batch, kv_quant=kv_quant,
        )  # fmt: skip
        self.kv_quant = self.runner.kv_quant
        cfg = model.config
        self.tokenizer = tokenizer
        self.model_name = model_name or getattr(model, "name_or_path", None) or cfg._name_or_path or "model"
        # The runner owns the device side; these name what it runs (the pool is the same object, never replaced).
        self.decode_kernel, self.decode_buckets = self.runner.decode_kernel, decode_buckets
        self.pool, self.geometry = self.runner.pool, self.runner.geometry
        self.compression_rate = float(compression_rate)
        self.compress = compress
        self.method = method
        self.window, self.metric_buffer, self.kernel = preset.window, preset.buffer, preset.kernel
        self.protected_window = preset.protected_window
        self.min_cache_tokens = min_cache_tokens
        self.compress_once = compress_once
        self.budget = KVBudget(
            self.geometry, self.compression_rate, min_cache_tokens, self.protected_window, compress_once
        )
        self.max_positions = getattr(cfg, "max_position_embeddings", None)
        self.eos = eos_ids(model, tokenizer)
        self.scheduler = Scheduler(
            self.geometry, self.pool.num_blocks, compress=self.compress, compress_once=compress_once,
            compression_interval=compression_interval, max_batch=max_batch, prefill_chunk=prefill_chunk,
            max_num_batched_tokens=max_num_batched_tokens, counts=BatchedCounts(),
        )  # fmt: skip
        self._stats = EngineStats(
            pool_blocks_total=self.pool.num_blocks, decode_kernel=self.decode_kernel,
            decode_kernel_refused=dict(self.runner.decode_kernel_refused),
        )  # fmt: skip
        self._generator = torch.Generator().manual_seed(seed)
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._inbox: list[Request] = []
        self._cancelled: list[str] = []
        self._active: dict[str, Request] = {}  # submitted and not finished
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
            req = Request(
                request_id=rid,
                arrival=next(self._arrivals),
                prompt_ids=ids,
                params=params,
                handle=handle,
                generator=torch.Generator().manual_seed(seed),
                text=TextOutput(self._decode_text, params.stop),
                budget=self.budget,
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
        s.graph_captures, s.graph_replays, s.static_decode_steps = self.runner.graph_counts()
        return s

    @property
    def model(self) -> torch.nn.Module:
        """The model the runner runs (setting it swaps the runner's)."""
        return self.runner.model

    @model.setter
    def model(self, model: torch.nn.Module) -> None:
        self.runner.model = model

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
        """Blocks admission counts a request for (:meth:`KVBudget.projected_blocks
        <kvtrim.serve.admission.KVBudget.projected_blocks>`)."""
        return self.budget.projected_blocks(prompt_tokens, final_tokens)

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
        """Most blocks a request alone ever needs (:meth:`KVBudget.blocks_bound
        <kvtrim.serve.admission.KVBudget.blocks_bound>`)."""
        return self.budget.blocks_bound(prompt_tokens, max_tokens)

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
        self.runner.synchronize()
        self._stats.compress_s += time.perf_counter() - t0

    def _compress(self, reqs: list[Request], events: list[TokenEvent], mark: bool = True) -> None:
        """Compress every sequence of ``reqs`` to its budget in one batched eviction (one ranking and one
        MoveCache for all of them); a failure fails exactly these requests."""
        if not reqs:
            return
        budgets = [self.budget.max_cache_tokens(r.paged.seen) for r in reqs]
        try:
            freed = self.runner.compress([r.paged for r in reqs], budgets)
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

    def _decode_phase(self, events: list[TokenEvent]) -> int:
        """One batched decode forward over the decoding sequences; returns how many were fed."""
        batch = self.scheduler.decoding()
        if not batch:
            return 0
        t0 = time.perf_counter()
        tokens = self._decode_forward(batch, events)
        self._stats.decode_s += time.perf_counter() - t0
        if tokens is None:
            return len(batch)
        self._stats.decode_steps += 1
        self._stats.decode_tokens += len(batch)
        self._stats.max_decode_batch = max(self._stats.max_decode_batch, len(batch))
        for req, token in zip(batch, tokens, strict=True):
            self._next_token(req, token, events)
        self.scheduler.tick()
        return len(batch)

    def _decode_forward(self, batch: list[Request], events: list[TokenEvent]) -> list[int | Exception] | None:
        """The batch's decode step on the runner and its tokens; None when the forward failed (the batch failed)."""
        try:
            logits = self.runner.decode([r.paged for r in batch], [r.generated[-1] for r in batch])
        except Exception as exc:  # a failed batch forward (OutOfBlocks would be a scheduler bug) fails the batch
            self._fail(batch, events, exc)
            return None
        # One host read for the whole batch, not one per request; inside the timing because on an accelerator it is
        # where the step's queued kernels finish (decode_s is the forward's device time, not its launch time).
        return self.runner.sample(logits, [r.params for r in batch], [r.generator for r in batch])

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
            self.runner.synchronize()
        except Exception as exc:
            self._fail(reqs, events, exc)
            return
        finally:
            self._stats.prefill_s += time.perf_counter() - t0
        rows = [row for row, req in enumerate(reqs) if req.prefill_remaining() == 0]
        done = [reqs[row] for row in rows]
        partial = [req for req in reqs if req.prefill_remaining() > 0]
        tokens = self.runner.sample(logits, [r.params for r in done], [r.generator for r in done], rows) if rows else []
        for req, token in zip(done, tokens, strict=True):
            req.decoding = True
            self._stats.prefills += 1
            req.steps_since_compression = 0
            req.compressed_since_prefill = False
            self.scheduler.prefill_done()
            self._next_token(req, token, events)
        if self.compress and partial:  # compress as chunks arrive: the prompt never sits uncompressed
            t0 = time.perf_counter()
            self._compress(partial, events, mark=False)
            self.runner.synchronize()
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

    def _prefill_chunks(self, chunks: list[tuple[Request, int]]) -> torch.Tensor:
        """Feed the next ``n`` prefill tokens of each ``(request, n)`` in one packed forward on the runner; returns
        ``[len(chunks), vocab]`` logits of each chunk's last token."""
        for req, _ in chunks:
            if req.paged is None:
                req.paged = self.runner.new_sequence()
        logits = self.runner.prefill([PrefillChunk(req.paged, req.next_prefill_tokens(n)) for req, n in chunks])
        for req, n in chunks:
            req.prefilled += n
        self._stats.prefill_chunks += len(chunks)
        self._stats.prefill_tokens += sum(n for _, n in chunks)
        return logits

    # ------------------------------------------------------------------------------------ per request
    def _next_token(self, req: Request, token: int | Exception, events: list[TokenEvent]) -> None:
        """Emit the token sampled for one request (or fail it with its sampling error), detokenize and check its
        stop conditions (its errors stay its own)."""
        if isinstance(token, Exception):
            self._finish(req, events, None, "error", _describe(token))
            return
        try:
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
        req: Request,
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

    def _fail(self, batch: list[Request], events: list[TokenEvent], exc: BaseException) -> None:
        for req in batch:
            self._finish(req, events, None, "error", _describe(exc))

    @staticmethod
    def _push(req: Request, events: list[TokenEvent], event: TokenEvent) -> None:
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


def _check_engine_args(kv_memory_bytes, kv_blocks, compression_rate, method, protected_window, min_cache_tokens):
    check_pool_size(kv_memory_bytes, kv_blocks)
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
