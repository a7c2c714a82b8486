"""Scheduler side: return the blocks of evicted prompt entries to vLLM's pool and count kept slots only.

Patched (vLLM V1): ``Scheduler.__init__`` (read the configuration, refuse prefix caching, hybrid models, a KV
cache format the worker cannot compact, and a scheduler or coordinator class on which a wrapper below is
overridden),
``Scheduler._update_after_schedule`` (when a request's last prompt chunk is scheduled, free the blocks past
``keep`` right away: the worker compacts the kept entries into the first blocks in that same step, before any
later step can reuse the freed ones; with rounds, ``between_chunks`` and ``method@every:N``, the same after
every chunk and every ``N`` decoded tokens, or by LagKV's recursion,
:meth:`~kvtrim.vllm.config.VLLMEvictionConfig.round_keep`),
``KVCacheCoordinator.get_num_blocks_to_allocate`` / ``allocate_new_blocks`` (token counts of compressed
requests are physical: logical − dropped; with ``between_chunks`` vLLM's full-sequence admission gate counts
at most budget + one chunk, and with ``decode_reserve`` the pool's projected peak, :func:`_with_reserve`) and
``KVCacheCoordinator.free`` / ``pop_blocks_for_free`` (forget the request);
``Scheduler.add_request`` (refuse a request's invalid ``kvtrim_*`` settings in ``extra_args``; the input
processor refuses them first) and ``Scheduler._reserve_prefill_lookahead`` (vLLM's last cut of a step's tokens per
request: also end a prefill chunk at the request's ``kvtrim_context_tokens``, :mod:`kvtrim.vllm.request_args`).

The number kept depends only on the prompt length (or the request's ``kvtrim_context_tokens``) and the configuration,
so scheduler and workers agree without exchanging anything.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

from .config import VLLMEvictionConfig, load_config
from .kv_layout import entry_format
from .request_args import check_request, request_context_end
from .wrappers import UnpatchedVLLMError, bypassed, wrap

logger = logging.getLogger("vllm.kvtrim")

# besides __init__, which runs the check itself
PATCHED_SCHEDULER_METHODS = ("_update_after_schedule", "add_request", "_reserve_prefill_lookahead")
PATCHED_COORDINATOR_METHODS = ("get_num_blocks_to_allocate", "allocate_new_blocks", "free", "pop_blocks_for_free")


@dataclass
class SchedulerState:
    config: VLLMEvictionConfig
    num_layers: int = 1  # the model's decoder layers (PyramidKV's schedule depends on it)
    dropped: dict[str, int] = field(default_factory=dict)
    blocks_freed: int = 0
    requests_compressed: int = 0
    pipeline: object = None  # bound to the checkpoint when the method loads an artifact (HeadKV's counts)
    kv_heads: int = 0  # one tensor-parallel rank's KV heads
    tp_size: int = 1  # tensor-parallel ranks (per-head counts fixed in advance: one row per layer and rank)
    counts_at: object = None  # per-head methods: length -> HeadKV's counts (VLLMEvictionConfig.head_counts_at)
    rounds: int = 0  # compressions of any request (between chunks, after prefill, while decoding)
    # request -> most blocks its block list held at the end of a step's allocation (before that step's freeing);
    # finished requests move to ``finished_peaks`` (the last FINISHED_PEAKS of them)
    peak_blocks: dict[str, int] = field(default_factory=dict)
    finished_peaks: OrderedDict = field(default_factory=OrderedDict)


FINISHED_PEAKS = 4096


def model_num_layers(vllm_config) -> int:
    """The model's decoder layer count, read the same way by the scheduler and every worker."""
    return int(vllm_config.model_config.hf_text_config.num_hidden_layers)


def _check_supported(scheduler) -> None:
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

    entry_format(scheduler.cache_config.cache_dtype)  # refuses a cache format the worker cannot compact

    if scheduler.cache_config.enable_prefix_caching:
        raise ValueError(
            "kvtrim eviction rewrites prompt blocks in place, so prefix caching must be off: pass "
            "enable_prefix_caching=False (vllm serve --no-enable-prefix-caching)"
        )
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    if len(managers) != 1 or not isinstance(managers[0], FullAttentionManager):
        kinds = [type(m).__name__ for m in managers]
        raise ValueError(f"kvtrim eviction supports one full-attention KV cache group, this model has {kinds}")
    if scheduler.vllm_config.speculative_config is not None:
        raise ValueError("kvtrim eviction does not support speculative decoding")
    coordinator = scheduler.kv_cache_manager.coordinator
    missing = [f"{type(scheduler).__name__}.{m}" for m in bypassed(type(scheduler), PATCHED_SCHEDULER_METHODS)]
    missing += [f"{type(coordinator).__name__}.{m}" for m in bypassed(type(coordinator), PATCHED_COORDINATOR_METHODS)]
    if missing:
        raise UnpatchedVLLMError(
            f"kvtrim: these scheduler methods are not kvtrim's wrappers: {', '.join(missing)} (a subclass "
            "overrides them, e.g. a custom scheduler_cls); kvtrim would not free or count blocks right"
        )


def _patch_init(orig):
    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        config = load_config(self.vllm_config.additional_config)
        self._kvtrim_state = None
        if config is not None:
            _check_supported(self)
            tp_size = int(self.vllm_config.parallel_config.tensor_parallel_size)
            # refuses a split the method cannot keep; blocks are sized by what one rank keeps
            config = config.rank_config(tp_size, self.vllm_config.model_config.get_total_num_kv_heads())
            state = SchedulerState(config, num_layers=model_num_layers(self.vllm_config))
            if config.per_head:
                vc = self.vllm_config
                state.pipeline = config.bound_pipeline(vc.model_config.model)
                state.kv_heads = vc.model_config.get_num_kv_heads(vc.parallel_config)  # one rank's
                state.tp_size = tp_size
                state.counts_at = config.head_counts_at(state.pipeline, state.num_layers, state.kv_heads, state.tp_size)
                hint = config.page_hint(int(self.cache_config.block_size))
                if hint is not None:
                    logger.info(hint)
            self._kvtrim_state = state
            # The coordinator consults the same dropped counts.
            coordinator = self.kv_cache_manager.coordinator
            coordinator._kvtrim_dropped = state.dropped
            coordinator._kvtrim_state = state
            if config.between_chunks:
                # Admission by compressed size: a prompt never holds more than the budget plus one chunk (LagKV:
                # its bound at the request's length, VLLMEvictionConfig.admission_tokens).
                coordinator._kvtrim_admission_tokens = functools.partial(
                    config.admission_tokens,
                    chunk=int(self.scheduler_config.max_num_batched_tokens),
                    block_size=int(self.cache_config.block_size),
                    kv_heads=state.kv_heads,
                    counts_at=state.counts_at,
                )
                if config.decode_reserve:
                    coordinator._kvtrim_reserve = functools.partial(
                        _with_reserve,
                        weakref.ref(self),
                        coordinator._kvtrim_admission_tokens,
                        int(self.scheduler_config.max_num_batched_tokens),
                    )

    return __init__


def _with_reserve(scheduler_ref, admission, chunk: int, request_id: str, blocks: int) -> int:
    """Blocks the admission of ``request_id`` must find free with ``decode_reserve``: vLLM's count ``blocks`` (the
    request's prompt at its compressed size, plus one chunk), or more if the pool's projected peak needs it.

    Every running request and the new one are projected forward one token per engine step
    (:func:`_growth`): a request in prefill holds its prompt's kept slots plus one chunk until its remaining chunks
    are done, then its kept slots; from then on it gains one entry per decoded token until its reserve
    (``decode_reserve`` capped at its ``max_tokens``) is decoded, when it finishes and frees its blocks. The
    largest sum of blocks over that future, less what the running requests hold now, must be free.

    ``admission``: the gate's bound (:meth:`~kvtrim.vllm.config.VLLMEvictionConfig.admission_tokens` with vLLM's
    ``chunk``); with ``chunk=0`` it gives the slots a prompt keeps after its last round."""
    scheduler = scheduler_ref()
    state = scheduler._kvtrim_state
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    grow = functools.partial(_growth, state, manager, admission, chunk)
    others = [r for r in scheduler.running if r.request_id != request_id]
    plans = [grow(r) for r in [*others, scheduler.requests[request_id]]]
    held = sum(len(manager.req_to_blocks.get(r.request_id, ())) for r in others)
    bs = manager.block_size

    def in_use(t: int) -> int:
        total = 0
        for start, early, entries, decoded in plans:
            if t < start:
                total += early
            elif t <= start + decoded:
                total += -(-(entries + t - start) // bs)
        return total

    # sizes only grow while a request runs: the peak is at a request's last step, or before any has finished
    peak = max(in_use(t) for t in {0, *(start + decoded for start, _, _, decoded in plans)})
    return max(blocks, peak - held)


def _growth(state: SchedulerState, manager, admission, chunk: int, req) -> tuple[int, int, int, int]:
    """``(start, early, entries, decoded)``: ``req`` starts decoding in ``start`` engine steps holding ``entries``,
    holds ``early`` blocks until then (the admission gate's bound), and decodes ``decoded`` tokens more within its
    reserve."""
    held = len(manager.req_to_blocks.get(req.request_id, ()))
    decoded = max(0, min(state.config.decode_reserve, req.max_tokens) - req.num_output_tokens)
    end = max(req.num_prompt_tokens, req.num_tokens - 1)  # a preempted request recomputes its output too
    if req.num_computed_tokens < end:
        entries = admission(end, chunk=0)
        early = max(held, -(-admission(end) // manager.block_size))
        return -(-(end - req.num_computed_tokens) // chunk), early, entries, decoded
    entries = req.num_computed_tokens - state.dropped.get(req.request_id, 0)
    return 0, held, entries, decoded


def _due(state: SchedulerState, manager, req, n: int) -> tuple[int, int] | None:
    """``(physical entries after this step, entries kept)`` when ``req`` is compressed in this step, else None."""
    prompt = req.num_prompt_tokens
    if state.config.rounds:
        end = req.num_computed_tokens + n
        physical = end - state.dropped.get(req.request_id, 0)
        compressed = req.request_id in state.dropped
        keep = state.config.round_keep(
            prompt, end, physical, n, manager.block_size, compressed, state.kv_heads, state.counts_at
        )
        return None if keep is None else (physical, keep)
    end = request_context_end(req.sampling_params, prompt)  # the prompt, or the request's kvtrim_context_tokens
    if req.num_output_tokens == 0 and req.num_computed_tokens < end == req.num_computed_tokens + n:
        # per-head methods: M + block_size − 1 slots hold the layer's per-head split (kvtrim.vllm.subpages)
        counts = None
        if state.pipeline is not None:
            counts = state.config.head_counts(state.pipeline, end, state.num_layers, state.kv_heads, state.tp_size)
        keep = state.config.slot_count(end, state.num_layers, manager.block_size, counts, state.kv_heads)
        if keep < end:
            return end, keep
    return None


def _patch_add_request(orig):
    @functools.wraps(orig)
    def add_request(self, request):
        state = getattr(self, "_kvtrim_state", None)
        if state is not None and request.request_id not in self.requests:
            # a request that did not pass the input processor's check: refused before vLLM holds anything of it
            check_request(getattr(request.sampling_params, "extra_args", None), request.num_prompt_tokens,
                          state.config.rounds)  # fmt: skip
        return orig(self, request)

    return add_request


def _patch_reserve_prefill_lookahead(orig):
    @functools.wraps(orig)
    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens):
        """vLLM's last cut of a request's step; also ends a prefill chunk at the request's
        ``kvtrim_context_tokens``."""
        n = orig(self, request, num_computed_tokens, num_new_tokens)
        if getattr(self, "_kvtrim_state", None) is None or request.num_output_tokens:
            return n
        end = request_context_end(request.sampling_params, request.num_prompt_tokens)
        if num_computed_tokens < end < num_computed_tokens + n:
            return end - num_computed_tokens
        return n

    return _reserve_prefill_lookahead


def _patch_update_after_schedule(orig):
    @functools.wraps(orig)
    def _update_after_schedule(self, scheduler_output):
        state = getattr(self, "_kvtrim_state", None)
        if state is None:
            return orig(self, scheduler_output)
        due = []
        manager = self.kv_cache_manager.coordinator.single_type_managers[0]
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            req = self.requests[req_id]
            held = len(manager.req_to_blocks.get(req_id, ()))
            state.peak_blocks[req_id] = max(state.peak_blocks.get(req_id, 0), held)
            step = _due(state, manager, req, n)
            if step is not None:
                due.append((req_id, *step))
        orig(self, scheduler_output)
        for req_id, physical, keep in due:
            first = req_id not in state.dropped
            state.dropped[req_id] = state.dropped.get(req_id, 0) + physical - keep
            blocks = manager.req_to_blocks[req_id]
            n = -(-keep // manager.block_size)
            tail = blocks[n:]
            del blocks[n:]
            manager.block_pool.free_blocks(reversed(tail))
            state.blocks_freed += len(tail)
            state.requests_compressed += first
            state.rounds += 1

    return _update_after_schedule


def _patch_blocks_to_allocate(orig):
    @functools.wraps(orig)
    def get_num_blocks_to_allocate(
        self,
        request_id,
        num_tokens,
        new_computed_blocks,
        num_encoder_tokens,
        total_computed_tokens,
        num_local_computed_tokens,
        num_tokens_main_model,
        *args,
        **kwargs,
    ):
        d = getattr(self, "_kvtrim_dropped", {}).get(request_id, 0)
        if d and "prefill_end" in kwargs:
            kwargs["prefill_end"] = max(kwargs["prefill_end"] - d, 0)
        admission = getattr(self, "_kvtrim_admission_tokens", None)
        if admission is not None and kwargs.get("apply_admission_cap"):
            # vLLM's full-sequence admission gate (scheduler_reserve_full_isl): with compression between chunks
            # the request holds at most budget + one chunk (+ the computed tokens already kept) at once.
            cap = admission(num_tokens)
            num_tokens = min(num_tokens, max(cap + d, total_computed_tokens))
            num_tokens_main_model = min(num_tokens_main_model, num_tokens)
        blocks = orig(
            self,
            request_id,
            num_tokens - d,
            new_computed_blocks,
            num_encoder_tokens,
            total_computed_tokens - d,
            num_local_computed_tokens - d,
            num_tokens_main_model - d,
            *args,
            **kwargs,
        )
        reserve = getattr(self, "_kvtrim_reserve", None)
        if reserve is not None and kwargs.get("apply_admission_cap"):
            blocks = reserve(request_id, blocks)  # decode_reserve: room for decoded tokens, this and running requests'
        return blocks

    return get_num_blocks_to_allocate


def _patch_allocate_new_blocks(orig):
    @functools.wraps(orig)
    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model, *args, **kwargs):
        d = getattr(self, "_kvtrim_dropped", {}).get(request_id, 0)
        return orig(self, request_id, num_tokens - d, num_tokens_main_model - d, *args, **kwargs)

    return allocate_new_blocks


def _patch_free(orig):
    @functools.wraps(orig)
    def free(self, request_id):
        getattr(self, "_kvtrim_dropped", {}).pop(request_id, None)
        state = getattr(self, "_kvtrim_state", None)
        if state is not None and request_id in state.peak_blocks:
            state.finished_peaks[request_id] = state.peak_blocks.pop(request_id)
            while len(state.finished_peaks) > FINISHED_PEAKS:
                state.finished_peaks.popitem(last=False)
        return orig(self, request_id)

    return free  # also wraps pop_blocks_for_free (same signature)


def _patch_get_kv_cache_configs(orig):
    @functools.wraps(orig)
    def get_kv_cache_configs(vllm_config, *args, **kwargs):
        config = load_config(vllm_config.additional_config)
        bound = None
        if config is not None:
            parallel = vllm_config.parallel_config
            config = config.rank_config(int(parallel.tensor_parallel_size))  # what one rank holds
            bound = config.held_bound(
                int(vllm_config.scheduler_config.max_num_batched_tokens),
                int(vllm_config.cache_config.block_size),
                vllm_config.model_config.get_num_kv_heads(parallel),
            )
        model_config = vllm_config.model_config
        if bound is None or bound >= model_config.max_model_len or model_config.original_max_model_len == -1:
            return orig(vllm_config, *args, **kwargs)
        # vLLM's start-up check asks the pool to hold one request of max_model_len tokens; compressed between
        # chunks and every N decoded tokens, a request never holds more than ``bound``.
        original = model_config.max_model_len
        model_config.max_model_len = bound
        try:
            return orig(vllm_config, *args, **kwargs)
        finally:
            model_config.max_model_len = original

    return get_kv_cache_configs


def install() -> None:
    """Patch vLLM's V1 scheduler and KV cache coordinator (idempotent)."""
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import core

    if getattr(Scheduler, "_kvtrim_patched", False):
        return
    core.get_kv_cache_configs = _patch_get_kv_cache_configs(core.get_kv_cache_configs)
    wrap(Scheduler, "__init__", _patch_init)
    wrap(Scheduler, "_update_after_schedule", _patch_update_after_schedule)
    wrap(Scheduler, "add_request", _patch_add_request)
    wrap(Scheduler, "_reserve_prefill_lookahead", _patch_reserve_prefill_lookahead)
    wrap(KVCacheCoordinator, "get_num_blocks_to_allocate", _patch_blocks_to_allocate)
    wrap(KVCacheCoordinator, "allocate_new_blocks", _patch_allocate_new_blocks)
    wrap(KVCacheCoordinator, "free", _patch_free)
    wrap(KVCacheCoordinator, "pop_blocks_for_free", _patch_free)
    Scheduler._kvtrim_patched = True
