"""Worker side: compact each request's prompt cache after prefill and keep its positions logical.

Patched methods of vLLM's V1 ``GPUModelRunner`` (the CPU runner inherits them):

- ``_update_states``: forget the eviction state of requests that finish or restart.
- ``_prepare_inputs``: (a) note the requests whose prompt completes in this step (:class:`PendingEviction`);
  (b) for already compressed requests, turn the logical positions vLLM computed (``num_computed_tokens`` +
  offset, used unchanged for rotary embeddings) into physical ones for ``seq_lens`` and the slot mapping:
  physical = logical − dropped.
- ``execute_model``: after the forward, check that every attention layer compressed the step's pending
  requests, record the dropped count and cut the request's block table row and block list to the kept blocks
  (the scheduler already returned the rest to its pool); ``WorkerState.evictions`` / ``layer_evictions``
  count what was compressed (``runner_check.worker_stats``).
- each attention impl's ``forward``: after attention for the step, score/select/compact the pending requests'
  entries in that layer's cache.

Rounds (``between_chunks``, ``method@every:N``, LagKV's recursion): the same compaction after any step that
:meth:`~kvtrim.vllm.config.VLLMEvictionConfig.round_keep` names (the scheduler applies the same rule), over the
request's physical entries; each layer's kept logical positions are kept per request for the next round, and the
last ``window`` queries of the request are recorded around a round (the observation window while decoding).
LagKV's ``compressed_until`` follows from the request's dropped count
(:meth:`~kvtrim.vllm.config.VLLMEvictionConfig.compressed_until`), so it is forgotten with it.

Only the V1 runner is patched: ``runner_check`` makes V1 the default under kvtrim and refuses any other runner.

Per-layer budgets (PyramidKV): the block list holds ``keep_max`` (largest layer) slots; layer ``l`` keeps
``keep_l`` entries in slots ``0 … keep_l−1`` and reads/writes with the extra offset ``e_l = keep_max − keep_l``.
vLLM shares one metadata object and one slot mapping among a KV cache group's layers only by reference (one
dict entry per layer name), so ``_get_slot_mappings`` and ``_build_attention_metadata`` are wrapped to put a
shifted slot mapping and metadata built from shifted ``seq_lens`` (``AttentionGroup.build_metadata``) under the
names of the layers whose offsets differ from 0: one build per distinct offset vector per step.

Per-head budgets (AdaKV): the block list holds ``min(B + block_size − 1, prompt)`` slots (enough for any split of
``kv_heads · B`` entries among a layer's heads, :mod:`kvtrim.vllm.subpages`; KV-Compress with ``even_layer_evict``:
its per-layer block bound, :meth:`~kvtrim.vllm.config.VLLMEvictionConfig.layer_total`); each (layer, KV head)
keeps its own count in its own one-head sub-pages of the request's blocks
(:class:`~kvtrim.vllm.subpages.RequestSubPages`).
``_prepare_inputs`` sizes every layer's sub-pages for the step's tokens (:class:`HeadStep`), and the CPU
attention backend kvtrim registers over ``CPU_ATTN`` (:mod:`kvtrim.vllm.head_backend`) writes and attends with
each (request, KV head) folded into the batch as a one-head sequence.
"""

from __future__ import annotations

import functools
from copy import copy
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch

from .config import VLLMEvictionConfig, load_config
from .evictor import PendingEviction, evict_layer, evict_layer_heads
from .kv_layout import BlockLayout, probe_layout
from .query_record import QueryRecord
from .request_args import request_context_end
from .scheduler_patch import model_num_layers
from .subpages import RequestSubPages
from .wrappers import UnpatchedVLLMError, wrap


@dataclass(frozen=True)
class HeadStep:
    """This step's requests whose heads hold their own sub-pages (per-head methods).

    Attributes:
        rows: ``(batch index, query start, query end, sub-pages, slots)`` per request, ``slots``
            ``[layers, n, kv_heads]`` the one-head slots of the request's ``n`` new tokens in every layer
        prepared: what the step's attention layers share, built by the first layer that needs it
            (:meth:`write_slots`, :meth:`attention_tables`, :meth:`rows_of`)
    """

    rows: list[tuple[int, int, int, RequestSubPages, np.ndarray]]
    prepared: dict = field(default_factory=dict, compare=False, repr=False)

    def write_slots(self, slot_mapping: torch.Tensor, kv_heads: int, block_size: int) -> torch.Tensor:
        """``[layers, N, kv_heads]`` one-head slots of the step's ``N`` tokens in every layer: vLLM's placement
        (:func:`~kvtrim.vllm.folded_attention.default_subpage_slots`) except the rows' own sub-pages."""
        slots = self.prepared.get("slots")
        if slots is None:
            from .folded_attention import default_subpage_slots

            base = default_subpage_slots(slot_mapping, kv_heads, block_size)  # [N, H]
            slots = base.unsqueeze(0).repeat(self.rows[0][3].num_layers, 1, 1)
            for _, qs, qe, _, new in self.rows:
                slots[:, qs:qe] = torch.from_numpy(new).to(slots.device)
            self.prepared["slots"] = slots
        return slots

    def attention_tables(self, block_table: torch.Tensor, seq_lens: torch.Tensor, kv_heads: int):
        """``([layers, R·H, W], [layers, R·H])`` int32 sub-page tables and lengths of every layer
        (:func:`~kvtrim.vllm.folded_attention.per_head_tables`) from vLLM's ``[R, P]`` block table and ``[R]``
        lengths."""
        tables = self.prepared.get("tables")
        if tables is None:
            from .folded_attention import default_subpage_table, per_head_tables

            table = default_subpage_table(block_table.to(torch.int32), kv_heads)
            lens = seq_lens.to(torch.int32).repeat_interleave(kv_heads)
            rows = [(i, pages) for i, _, _, pages, _ in self.rows]
            tables = self.prepared["tables"] = per_head_tables(table, lens, rows, self.rows[0][3].num_layers)
        return tables

    def rows_of(self, query_start_loc: torch.Tensor, kv_heads: int):
        """:func:`~kvtrim.vllm.folded_attention.folded_rows` of the step's query rows (the same in every layer)."""
        rows = self.prepared.get("rows")
        if rows is None:
            from .folded_attention import folded_rows

            rows = self.prepared["rows"] = folded_rows(query_start_loc, kv_heads)
        return rows


@dataclass
class WorkerState:
    """Per model runner: the configuration and each compressed request's dropped count."""

    config: VLLMEvictionConfig
    model_layers: int = 1  # the model's decoder layers (PyramidKV's schedule)
    dropped: dict[str, int] = field(default_factory=dict)
    # per-layer methods: request -> ``[model_layers]`` extra offsets keep_max − keep_l
    offsets: dict[str, np.ndarray] = field(default_factory=dict)
    pending: list[PendingEviction] = field(default_factory=list)
    # per-head methods: request -> its sub-pages; this step's folded rows (None: nothing folded this step)
    heads: dict[str, RequestSubPages] = field(default_factory=dict)
    head_step: HeadStep | None = None
    ragged_layers: int = 0  # (request, layer) pairs whose KV heads kept different counts
    # this step's per-layer variants: layer name -> offset key; key -> [(query rows, slots)], per-request deltas
    layer_variant: dict[str, tuple] = field(default_factory=dict)
    variant_rows: dict[tuple, list] = field(default_factory=dict)
    variant_delta: dict[tuple, np.ndarray] = field(default_factory=dict)
    variant_slots: dict[tuple, torch.Tensor] = field(default_factory=dict)
    variant_meta: dict[tuple, object] = field(default_factory=dict)
    layouts: dict = field(default_factory=dict)
    # attention layer name -> what scorers read of its attention module (CriticalKV: o_proj), built on first use
    modules: dict = field(default_factory=dict)
    num_layers: int = 0
    pipeline: object = None
    evictions: int = 0  # requests compressed by this worker
    layer_evictions: int = 0  # (request, layer) pairs compressed: ``evictions × num_layers`` when every layer ran
    step_layers: int = 0  # attention layers that compressed this step's pending requests
    # rounds (between_chunks, method@every:N): request -> kept entries' logical positions [layers, kv_heads, keep]
    positions: dict[str, torch.Tensor] = field(default_factory=dict)
    # per-head rounds: request -> [layer][head] the kept entries' logical positions (each head its own count)
    head_positions: dict[str, list[list[torch.Tensor]]] = field(default_factory=dict)
    # KV-Compress with its decoding-time metric: request -> [layer][head] running metric of the kept entries
    head_metrics: dict[str, list[list[torch.Tensor]]] = field(default_factory=dict)
    # request -> layer index -> its last ``window`` post-rotary queries (observation window; QueryRecord.rows)
    recent: dict[str, dict[int, QueryRecord]] = field(default_factory=dict)
    observe: list[tuple[str, int, int]] = field(default_factory=list)  # this step's recorded rows (req, qs, qe)
    kept_positions: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)  # this step's, per layer
    rounds: int = 0  # compressions (first ones and later rounds) this worker ran
    tp_size: int = 1  # tensor-parallel ranks; this worker holds rank ``tp_rank``'s KV heads
    tp_rank: int = 0
    # a scorer that averages over a layer's KV heads (TOVA), under tensor parallelism: the mean over the ranks
    score_reduce: object = None


_ACTIVE: WorkerState | None = None  # the state of the runner whose step is executing (one runner per process)


def active_head_step() -> HeadStep | None:
    """The executing step's folded rows (per-head methods), or None: attention runs as vLLM's own."""
    return None if _ACTIVE is None else _ACTIVE.head_step


_PATCHED_IMPLS: set[type] = set()


def _tensor_parallel_place(vllm_config) -> dict[str, int]:
    """``tp_size`` and this worker's ``tp_rank`` (its KV heads are the ``tp_rank``-th slice of the model's)."""
    size = int(vllm_config.parallel_config.tensor_parallel_size)
    if size == 1:
        return {"tp_size": 1, "tp_rank": 0}
    from vllm.distributed import get_tensor_model_parallel_rank

    return {"tp_size": size, "tp_rank": int(get_tensor_model_parallel_rank())}


def _rank_mean(scores: torch.Tensor, tp_size: int) -> torch.Tensor:
    """The mean over the ``tp_size`` tensor-parallel ranks of each rank's ``[1, kv_heads, p]`` scores: for a scorer
    that averages over a layer's KV heads, the mean of the ranks' means over equally many heads is the mean over all
    the layer's heads, the single-rank score. Every rank compresses the same requests in the same layers in the same
    order (decided from token counts alone), so the collective calls pair up."""
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(scores.contiguous()) / tp_size


def _state(runner) -> WorkerState | None:
    if not hasattr(runner, "_kvtrim_state"):
        config = load_config(runner.vllm_config.additional_config)
        state = None
        if config is not None:
            place = _tensor_parallel_place(runner.vllm_config)
            config = config.rank_config(place["tp_size"])  # this rank's heads split among themselves
            state = WorkerState(
                config,
                model_layers=model_num_layers(runner.vllm_config),
                pipeline=config.bound_pipeline(runner.vllm_config.model_config.model),
                **place,
            )
            if state.tp_size > 1 and getattr(state.pipeline.scorer, "head_mean", False):
                state.score_reduce = functools.partial(_rank_mean, tp_size=state.tp_size)
        runner._kvtrim_state = state
    return runner._kvtrim_state


def _group0(runner):
    groups = runner.kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise RuntimeError(
            f"kvtrim eviction needs one KV cache group (full attention only), this model has {len(groups)}"
        )
    return runner.input_batch.block_table[0]


def _patch_update_states(orig):
    @functools.wraps(orig)
    def _update_states(self, scheduler_output):
        state = _state(self)
        if state is not None:
            restarted = set(scheduler_output.finished_req_ids)
            restarted.update(r.req_id for r in scheduler_output.scheduled_new_reqs)
            restarted.update(scheduler_output.scheduled_cached_reqs.resumed_req_ids)
            for req_id in restarted:
                state.dropped.pop(req_id, None)
                state.offsets.pop(req_id, None)
                state.heads.pop(req_id, None)
                state.positions.pop(req_id, None)
                state.head_positions.pop(req_id, None)
                state.head_metrics.pop(req_id, None)
                state.recent.pop(req_id, None)
        return orig(self, scheduler_output)

    return _update_states


def _patch_prepare_inputs(orig):
    @functools.wraps(orig)
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        state = _state(self)
        if state is None:
            return orig(self, scheduler_output, num_scheduled_tokens)
        batch = self.input_batch
        num_reqs = batch.num_reqs
        computed = batch.num_computed_tokens_cpu[:num_reqs].copy()
        starts = np.concatenate([[0], np.cumsum(num_scheduled_tokens[:num_reqs])])
        result = orig(self, scheduler_output, num_scheduled_tokens)
        table = _group0(self)
        bs = table.block_size
        state.pending = []
        state.observe = []
        shifted = []  # per-layer methods: (batch index, query rows, physical positions, block row, offsets)
        head_rows = []  # per-head methods: HeadStep.rows
        for i, req_id in enumerate(batch.req_ids[:num_reqs]):
            qs, qe = int(starts[i]), int(starts[i + 1])
            if state.config.rounds:
                row = _plan_round(self, state, table, i, req_id, int(computed[i]), qs, qe)
                if row is not None:
                    head_rows.append(row)
                continue
            if req_id in state.dropped:
                state.recent.pop(req_id, None)  # the prompt's recorded queries served its compression
                d = state.dropped[req_id]
                # Physical slots: the request's entries are compacted, the rotary positions stay logical.
                phys = computed[i] - d + np.arange(qe - qs)
                row = table.block_table.np[i]
                slots = row[phys // bs].astype(np.int64) * bs + phys % bs
                table.slot_mapping.gpu[qs:qe].copy_(torch.from_numpy(slots), non_blocking=True)
                self.seq_lens[i] -= d
                self.optimistic_seq_lens_cpu[i] -= d
                if req_id in state.offsets:
                    shifted.append((i, qs, qe, phys, row, state.offsets[req_id]))
                if req_id in state.heads:
                    pages = state.heads[req_id]
                    pages.sync_blocks(list(self.requests[req_id].block_ids[0]))
                    n = qe - qs
                    head_rows.append((i, qs, qe, pages, pages.append_all(n)))
                continue
            req = self.requests[req_id]
            # the prompt, or the tokens the request names as its context (the question after it stays whole)
            prompt = request_context_end(req.sampling_params, int(batch.num_prompt_tokens[i]))
            if req.output_token_ids or not computed[i] < prompt:
                continue
            # A prompt prefilled in several steps: the observation window may reach past the last step's rows, so
            # every step records its rows (the last ``window`` per layer) and the compression scores with them.
            observed = state.pipeline.observation.window > 0 and qe - qs < prompt
            if computed[i] + (qe - qs) < prompt:
                if observed:
                    state.observe.append((req_id, qs, qe))
                continue
            compressing = len(state.pending)
            if state.config.per_head:
                budget = state.config.head_budget(prompt)
                if budget < prompt:
                    kv_heads = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec.num_kv_heads
                    counts = state.config.head_counts(
                        state.pipeline, prompt, state.model_layers, kv_heads, state.tp_size
                    )
                    keep = state.config.slot_count(prompt, state.model_layers, bs, counts, kv_heads)
                    blocks = list(req.block_ids[0])
                    pages = RequestSubPages(state.model_layers, kv_heads, bs, blocks[: -(-keep // bs)])
                    ids = torch.tensor(blocks, dtype=torch.long, device=self.device)
                    own = state.config.rank_rows(counts, state.tp_size, state.tp_rank)
                    pending = PendingEviction(
                        req_id, qs, qe, prompt, keep, ids, None, budget, pages, own,
                        observed=observed, layer_total=state.config.layer_total(prompt, kv_heads),
                    )
                    state.pending.append(pending)
                _observe_last_chunk(state, req_id, qs, qe, observed, len(state.pending) > compressing)
                continue
            layer_keep = state.config.layer_keeps(prompt, state.model_layers)
            if min(layer_keep) < prompt:
                blocks = torch.tensor(req.block_ids[0], dtype=torch.long, device=self.device)
                state.pending.append(
                    PendingEviction(
                        req_id, qs, qe, prompt, max(layer_keep), blocks, tuple(layer_keep), observed=observed
                    )
                )
            _observe_last_chunk(state, req_id, qs, qe, observed, len(state.pending) > compressing)
        _plan_layer_variants(self, state, shifted, num_reqs, bs)
        state.head_step = HeadStep(head_rows) if head_rows else None
        return result

    return _prepare_inputs


def _observe_last_chunk(state: WorkerState, req_id: str, qs: int, qe: int, observed: bool, compressed: bool) -> None:
    """The last prefill step of a prompt recorded over several steps: record its rows too when the prompt is
    compressed in this step (the eviction reads the record), else drop the record."""
    if observed and compressed:
        state.observe.append((req_id, qs, qe))
    elif observed:
        state.recent.pop(req_id, None)


def _physical_slots(runner, state: WorkerState, table, i: int, req_id: str, computed: int, qs: int, qe: int):
    """Rewrite a compressed request's slot mapping and ``seq_lens`` for physical slots (logical − dropped)."""
    d = state.dropped.get(req_id, 0)
    if not d:
        return
    bs = table.block_size
    phys = computed - d + np.arange(qe - qs)
    row = table.block_table.np[i]
    slots = row[phys // bs].astype(np.int64) * bs + phys % bs
    table.slot_mapping.gpu[qs:qe].copy_(torch.from_numpy(slots), non_blocking=True)
    runner.seq_lens[i] -= d
    runner.optimistic_seq_lens_cpu[i] -= d


def _plan_round(runner, state: WorkerState, table, i: int, req_id: str, computed: int, qs: int, qe: int):
    """Rounds (``between_chunks``, ``method@every:N``): physical slots, and a compression when one is due.

    The rule is :meth:`VLLMEvictionConfig.round_keep` on the counts the scheduler sees too, so both sides free
    and compact the same blocks in the same step. Returns the request's :class:`HeadStep` row when its heads
    hold their own sub-pages (a per-head method after its first round), else None.
    """
    _physical_slots(runner, state, table, i, req_id, computed, qs, qe)
    config = state.config
    prompt = int(runner.input_batch.num_prompt_tokens[i])
    end = computed + (qe - qs)
    physical = end - state.dropped.get(req_id, 0)
    bs = table.block_size
    kv_heads = runner.kv_cache_config.kv_cache_groups[0].kv_cache_spec.num_kv_heads
    # HeadKV: the artifact's per-head counts at this length (as the scheduler computes them), asked for only in a
    # step that may end in a round, and once
    counts_at = config.head_counts_at(state.pipeline, state.model_layers, kv_heads, state.tp_size)
    keep = config.round_keep(prompt, end, physical, qe - qs, bs, req_id in state.dropped, kv_heads, counts_at)
    window = state.pipeline.observation.window
    recorded = config.record_window(window)  # KV-Compress's decoding-time metric: every query since the last round
    if window > 0 and (keep is not None or _round_near(config, prompt, end, physical, recorded)):
        state.observe.append((req_id, qs, qe))
    block_ids = list(runner.requests[req_id].block_ids[0])
    row = None
    pages = state.heads.get(req_id)
    if pages is not None:  # this step's tokens go to every head's own sub-pages
        pages.sync_blocks(block_ids)
        row = (i, qs, qe, pages, pages.append_all(qe - qs))
    if keep is None:
        return row
    blocks = torch.tensor(block_ids, dtype=torch.long, device=runner.device)
    if config.per_head:
        budget = int(config.spec.budget)
        counts = config.rank_rows(counts_at(end), state.tp_size, state.tp_rank)
        # KV-Compress's decoding-time metric after its first round: a prefill chunk adds its own rows' squared
        # attention (the step's queries, not the record), a decoding round the recorded ones
        metrics = state.head_metrics.get(req_id)
        state.pending.append(
            PendingEviction(
                req_id, qs, qe, physical, keep, blocks, head_budget=budget,
                pages=pages or RequestSubPages(state.model_layers, kv_heads, bs, block_ids[: -(-keep // bs)]),
                logical_len=end, observed=window > 0 and not (metrics is not None and qe - qs > 1), head_counts=counts,
                layer_total=config.layer_total(physical, kv_heads) if counts is None else int(counts.sum(-1).max()),
                head_positions=state.head_positions.get(req_id), head_metrics=metrics,
                kept_metrics={} if config.decode_metric else None,
            )
        )  # fmt: skip
        return row
    # LagKV's family: only the partitions past what earlier rounds compressed are scored (derived from ``dropped``)
    done = None if config.lag is None else config.compressed_until(end - physical)
    state.pending.append(
        PendingEviction(
            req_id, qs, qe, physical, keep, blocks, logical_len=end, positions=state.positions.get(req_id),
            observed=window > 0, compressed_until=done,
        )
    )
    return row


def _round_near(config: VLLMEvictionConfig, prompt: int, end: int, physical: int, window: int) -> bool:
    """Whether a decoding round may fall within the next ``window`` tokens (record this step's queries)."""
    schedule = config.decode_schedule
    if end <= prompt or schedule is None:
        return False
    n = getattr(schedule, "n", None)
    if n is not None:
        return (end - prompt) % n > n - window
    return physical + window > int(config.spec.budget) + schedule.slack


def _plan_layer_variants(runner, state: WorkerState, shifted: list, num_reqs: int, bs: int) -> None:
    """Group the layers by their offset vector over this step's shifted requests; plan each group's slots."""
    state.layer_variant, state.variant_rows, state.variant_delta = {}, {}, {}
    state.variant_slots, state.variant_meta = {}, {}
    if not shifted:
        return
    for name in runner.kv_cache_config.kv_cache_groups[0].layer_names:
        idx = _layer_index(name)
        key = tuple(int(off[idx]) for *_, off in shifted)
        if not any(key):
            continue
        state.layer_variant[name] = key
        if key in state.variant_rows:
            continue
        rows, delta = [], np.zeros(num_reqs, dtype=np.int64)
        for (i, qs, qe, phys, row, _), e in zip(shifted, key, strict=True):
            p = phys - e  # layer l's new entries follow its own keep_l kept ones
            rows.append((qs, qe, row[p // bs].astype(np.int64) * bs + p % bs))
            delta[i] = e
        state.variant_rows[key] = rows
        state.variant_delta[key] = delta


def _patch_get_slot_mappings(orig):
    @functools.wraps(orig)
    def _get_slot_mappings(self, *args, **kwargs):
        by_gid, by_layer = orig(self, *args, **kwargs)
        state = _ACTIVE
        if state is None or not state.layer_variant:
            return by_gid, by_layer
        if not isinstance(by_layer, dict):
            raise RuntimeError("kvtrim: per-layer budgets (pyramidkv) do not support micro-batching (DBO)")
        base = by_gid[0]
        for key, rows in state.variant_rows.items():
            t = base.clone()
            for qs, qe, slots in rows:
                t[qs:qe] = torch.from_numpy(slots).to(device=t.device, dtype=t.dtype)
            state.variant_slots[key] = t
        for name, key in state.layer_variant.items():
            by_layer[name] = state.variant_slots[key]
        return by_gid, by_layer

    return _get_slot_mappings


def _patch_group_build_metadata(orig):
    @functools.wraps(orig)
    def build_metadata(self, common_attn_metadata, *args, **kwargs):
        out = orig(self, common_attn_metadata, *args, **kwargs)
        state = _ACTIVE
        if state is None or not state.variant_slots or not set(self.layer_names) & set(state.layer_variant):
            return out
        cm = common_attn_metadata
        for key, delta in state.variant_delta.items():
            shifted = copy(cm)
            d = torch.zeros(cm.seq_lens.shape[0], dtype=cm.seq_lens.dtype, device=cm.seq_lens.device)
            d[: delta.shape[0]] = torch.from_numpy(delta).to(device=d.device, dtype=d.dtype)
            shifted.seq_lens = cm.seq_lens - d
            if cm.seq_lens_cpu_upper_bound is not None:
                ub = cm.seq_lens_cpu_upper_bound
                shifted.seq_lens_cpu_upper_bound = ub - d.to(device=ub.device, dtype=ub.dtype)
            shifted.slot_mapping = state.variant_slots[key]
            state.variant_meta[key] = orig(self, shifted, *args, **kwargs)
        return out

    return build_metadata


def _patch_build_attention_metadata(orig):
    @functools.wraps(orig)
    def _build_attention_metadata(self, *args, **kwargs):
        attn_metadata, spec = orig(self, *args, **kwargs)
        state = _ACTIVE
        if state is None or not state.layer_variant or kwargs.get("for_cudagraph_capture"):
            return attn_metadata, spec
        if not isinstance(attn_metadata, dict):
            raise RuntimeError("kvtrim: per-layer budgets (pyramidkv) do not support micro-batching (DBO)")
        for name, key in state.layer_variant.items():
            attn_metadata[name] = state.variant_meta[key]
        return attn_metadata, spec

    return _build_attention_metadata


def _patch_execute_model(orig):
    @functools.wraps(orig)
    def execute_model(self, scheduler_output, *args, **kwargs):
        global _ACTIVE
        state = _state(self)
        if state is None:
            return orig(self, scheduler_output, *args, **kwargs)
        _install_impl_patches(self, state)
        state.pending = []
        state.observe = []
        state.kept_positions = {}
        state.step_layers = 0
        state.layer_variant = {}  # planned again by _prepare_inputs if this step runs the model
        state.head_step = None
        _ACTIVE = state
        try:
            out = orig(self, scheduler_output, *args, **kwargs)
        finally:
            _ACTIVE = None
        if state.pending:
            if state.step_layers != state.num_layers:
                # Some layers compacted, others did not: the cache no longer matches the block table.
                raise RuntimeError(
                    f"kvtrim: {len(state.pending)} request(s) finished prefill but only {state.step_layers} of "
                    f"{state.num_layers} attention layers compressed them (an attention forward kvtrim patched "
                    "did not run)"
                )
            table = _group0(self)
            for p in state.pending:
                if state.config.rounds:
                    kept = state.kept_positions.pop(p.req_id)
                    n = -(-p.keep // table.block_size)
                    if p.pages is not None:  # per-head: every layer re-placed its heads in the first n blocks
                        if not bool(p.pages.placed.all()):
                            raise RuntimeError(
                                f"kvtrim: layers {np.flatnonzero(~p.pages.placed).tolist()} kept no entries"
                            )
                        p.pages.truncate_blocks(n)
                        state.heads[p.req_id] = p.pages
                        state.head_positions[p.req_id] = [kept[layer] for layer in sorted(kept)]
                        if p.kept_metrics is not None:
                            state.head_metrics[p.req_id] = [p.kept_metrics[layer] for layer in sorted(p.kept_metrics)]
                            # the next round adds only the queries after this one: the record starts again
                            state.recent.pop(p.req_id, None)
                    else:
                        state.positions[p.req_id] = torch.stack([kept[layer] for layer in sorted(kept)])
                    state.rounds += 1
                    state.evictions += p.req_id not in state.dropped
                    state.dropped[p.req_id] = p.logical_len - p.keep
                    del self.requests[p.req_id].block_ids[0][n:]
                    table.num_blocks_per_row[self.input_batch.req_id_to_index[p.req_id]] = n
                    continue
                state.dropped[p.req_id] = p.prompt_len - p.keep
                if p.pages is not None:
                    if not bool(p.pages.placed.all()):
                        raise RuntimeError(f"kvtrim: layers {np.flatnonzero(~p.pages.placed).tolist()} kept no entries")
                    state.heads[p.req_id] = p.pages
                if state.config.per_layer:
                    state.offsets[p.req_id] = p.keep - np.asarray(p.layer_keep, dtype=np.int64)
                n = -(-p.keep // table.block_size)
                del self.requests[p.req_id].block_ids[0][n:]
                table.num_blocks_per_row[self.input_batch.req_id_to_index[p.req_id]] = n
                state.evictions += 1
            state.pending = []
        return out

    return execute_model


def _install_impl_patches(runner, state: WorkerState) -> None:
    if state.num_layers:
        return
    from vllm.model_executor.layers.attention import Attention

    layers = [m for m in runner.compilation_config.static_forward_context.values() if isinstance(m, Attention)]
    state.num_layers = len(layers)
    model = runner.get_model()
    for layer in layers:
        parent = layer.layer_name.rpartition(".")[0]
        state.modules[layer.layer_name] = functools.partial(_output_projection, model.get_submodule(parent))
    if state.config.per_head:
        from .head_backend import HeadFoldingCPUAttentionImpl

        other = sorted({type(layer.impl).__name__ for layer in layers} - {HeadFoldingCPUAttentionImpl.__name__})
        if other:
            raise UnpatchedVLLMError(
                f"kvtrim: {state.config.method} keeps a different count per KV head, which needs kvtrim's folded "
                f"CPU attention (HeadFoldingCPUAttentionImpl, registered over CPU_ATTN); this model runs {other}. "
                "Per-head methods run on vLLM's CPU backend only"
            )
    for layer in layers:
        cls = type(layer.impl)
        if cls not in _PATCHED_IMPLS:
            cls.forward = _patch_forward(cls.forward)
            _PATCHED_IMPLS.add(cls)


def _output_projection(attention) -> SimpleNamespace | None:
    """``attention``'s output projection as kvtrim's scorers read it: ``.o_proj.weight`` ``[hidden, q_heads·D]``.

    vLLM's CPU linear layers may pack their weight for oneDNN and leave ``weight`` empty; the matrix is then read
    back through the layer's own GEMM on an identity (exact: one product per entry).
    """
    o_proj = getattr(attention, "o_proj", None)
    if o_proj is None:
        return None
    weight = o_proj.weight
    if weight.numel() == 0:
        size = o_proj.input_size_per_partition
        eye = torch.eye(size, dtype=o_proj.params_dtype, device=weight.device)
        weight = o_proj.quant_method.apply(o_proj, eye, bias=None).t().contiguous()  # [hidden, q_heads·D]
    return SimpleNamespace(o_proj=SimpleNamespace(weight=weight))


def _module_view(state: WorkerState, name: str):
    entry = state.modules.get(name)
    if callable(entry):
        entry = state.modules[name] = entry()
    return entry


def _fp8_fnuz() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_fp8_fnuz())


@functools.cache
def _layer_index(name: str) -> int:
    """The decoder layer of an attention layer's name (parsed once per name: asked by every layer in every step)."""
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(name)


def _patch_forward(orig):
    @functools.wraps(orig)
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
        out = orig(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
        state = _ACTIVE
        if state is None or attn_metadata is None:
            return out
        if state.observe:
            _record_queries(state, _layer_index(layer.layer_name), query.view(query.shape[0], self.num_heads, -1))
        if not state.pending:
            return out
        cache_dtype = getattr(self, "kv_cache_dtype", "auto")
        layout_key = (type(self), tuple(kv_cache.shape[1:]), kv_cache.dtype, cache_dtype, query.dtype)
        layout: BlockLayout | None = state.layouts.get(layout_key)
        if layout is None:
            layout = state.layouts[layout_key] = probe_layout(self, layer, kv_cache, query.dtype, _fp8_fnuz())
        query = query.view(query.shape[0], self.num_heads, self.head_size)
        idx = _layer_index(layer.layer_name)
        ratio = state.config.spec.ratio
        with torch.no_grad():
            for pending in state.pending:
                module = _module_view(state, layer.layer_name)
                args = (layout, kv_cache, query, pending, idx, state.num_layers, self.scale, ratio)
                # an fp8 cache: scored as code · scale with the layer's per-tensor scales (1.0 when unquantized)
                scales = (float(layer._k_scale_float), float(layer._v_scale_float))
                if pending.observed:
                    args = (layout, kv_cache, state.recent[pending.req_id][idx].rows, *args[3:])
                if pending.pages is None:
                    kept = evict_layer(state.pipeline, *args, module, scales, state.score_reduce)
                    if state.config.rounds:
                        state.kept_positions.setdefault(pending.req_id, {})[idx] = kept.cpu()
                    continue
                kept_out = state.kept_positions.setdefault(pending.req_id, {}) if state.config.rounds else None
                counts = evict_layer_heads(
                    state.pipeline, *args, layer.isa, module, scales, kept_out, state.score_reduce
                )
                state.ragged_layers += len(set(counts)) > 1
        state.step_layers += 1
        state.layer_evictions += len(state.pending)
        return out

    return forward


def _record_queries(state: WorkerState, layer_idx: int, query: torch.Tensor) -> None:
    """Append this step's query rows of the observed requests to their recent-query windows in this layer."""
    window = state.config.record_window(state.pipeline.observation.window)
    for req_id, qs, qe in state.observe:
        layers = state.recent.setdefault(req_id, {})
        record = layers.get(layer_idx)
        if record is None:
            record = layers[layer_idx] = QueryRecord(window)
        record.append(query[max(qs, qe - window) : qe])


# The V1 runner methods kvtrim wraps; runner_check.check_runner refuses a runner on which any resolves elsewhere.
PATCHED_RUNNER_METHODS = (
    "_update_states",
    "_prepare_inputs",
    "execute_model",
    "_get_slot_mappings",
    "_build_attention_metadata",
)


def install() -> None:
    """Patch vLLM's V1 model runner (idempotent)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.utils import AttentionGroup

    if getattr(GPUModelRunner, "_kvtrim_patched", False):
        return
    wrap(GPUModelRunner, "_update_states", _patch_update_states)
    wrap(GPUModelRunner, "_prepare_inputs", _patch_prepare_inputs)
    wrap(GPUModelRunner, "execute_model", _patch_execute_model)
    wrap(GPUModelRunner, "_get_slot_mappings", _patch_get_slot_mappings)
    wrap(GPUModelRunner, "_build_attention_metadata", _patch_build_attention_metadata)
    wrap(AttentionGroup, "build_metadata", _patch_group_build_metadata)
    GPUModelRunner._kvtrim_patched = True
