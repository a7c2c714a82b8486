"""The plugin's configuration: which method, how much to keep, read the same way in every vLLM process.

Two sources, by vLLM's own means: ``--additional-config '{"kvtrim": {...}}'`` (``additional_config`` of
``vllm.LLM``), which wins, or the ``KVTRIM_VLLM_CONFIG`` environment variable holding the same JSON object.
Neither set: the plugin leaves vLLM unchanged.

Keys: ``method`` (a kvtrim registry name, see :data:`ACCEPTED_METHODS`), exactly one of ``ratio`` (fraction of
prompt entries removed, in [0, 1)) or ``budget`` (prompt entries kept per layer and KV head), optional
``params`` (the method's own parameters, e.g. ``{"window": 8}``), ``min_prompt`` (prompts shorter than this
are not compressed, default 0) and ``between_chunks`` (compress to the budget after every prefill chunk, and
admit a request by that compressed size; default false). ``method`` may carry a decoding schedule,
``"snapkv@every:64"`` (compress to the budget again every 64 decoded tokens) or ``"snapkv@over:SLACK"``.
AdaKV, HeadKV and their CriticalKV variants (per-head counts) take ``between_chunks`` and ``@every:N`` too.
LagKV's family (``lagkv``, ``localkv``, ``lag_knorm``) runs its own recursion (``tail:LAG``, its default) while
decoding and, with ``between_chunks``, between prefill chunks; ``"lagkv@prefill"`` compresses once.
KV-Compress (``kvcompress``, ``kvc_w8``, ``kvc_full``) runs with ``"params": {"even_layer_evict": true}`` only
(:data:`EVEN_LAYER_METHODS`), compressing after the prompt and, with ``between_chunks``, after every prefill chunk,
and with ``@every:N`` every ``N`` decoded tokens by its decoding-time metric (:attr:`VLLMEvictionConfig.decode_metric`).
Per-head methods that split by score take ``params.head_groups`` (a multiple of ``tensor_parallel_size`` under
tensor parallelism: :meth:`VLLMEvictionConfig.rank_config`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import numpy as np
import torch

from ..budgets.artifact_head_scores import ArtifactHeadScoreBudget
from ..budgets.base import BudgetRequest
from ..budgets.duo_heads import DuoHeadBudget
from ..budgets.global_blocks import GlobalBlockBudget
from ..budgets.head_adaptive import HeadAdaptiveBudget
from ..budgets.partition import PartitionBudget, keep_per_partition
from ..budgets.pyramid import PyramidBudget, pyramid_layer_budgets
from ..budgets.uniform import UniformBudget
from ..compression.compressor import BudgetSpec
from ..compression.pipeline import Pipeline
from ..compression.schedule import AfterPrefill, EveryNTokens, OverBudget, TailFull
from ..errors import InvalidParameterError
from ..methods import get_method, method_info, method_names
from ..methods.registry import BUDGET_KINDS, Capabilities, capabilities_of, split_schedule
from ..scoring.partitions import kept_length
from .subpages import slots_for_head_budget

ENV_VAR = "KVTRIM_VLLM_CONFIG"
ADDITIONAL_CONFIG_KEY = "kvtrim"

# Methods the plugin runs, from the parts' ``runs_in_vllm`` capability (docs/methods-registry.md): every layer and
# KV head keeps the same count, or (PyramidKV) each layer keeps a count that depends on the prompt length only, so
# the block list is sized by the largest layer and every layer gets its own seq_lens / slot mapping (worker_patch).
# Per-head methods whose layer total is fixed (AdaKV: Σ_h keep_h = kv_heads · B) keep their per-head counts in
# one-head sub-pages (kvtrim.vllm.subpages) and attend through folded attention (kvtrim.vllm.head_backend).
SUPPORTED_METHODS = tuple(name for name in method_names() if method_info(name).capabilities.vllm)
PER_LAYER_METHODS = tuple(
    name for name in SUPPORTED_METHODS if method_info(name).capabilities.budgets == BUDGET_KINDS["layer"]
)
PER_HEAD_METHODS = tuple(
    name for name in SUPPORTED_METHODS if method_info(name).capabilities.budgets == BUDGET_KINDS["head"]
)
# Methods that run inside vLLM with ``even_layer_evict`` (KV-Compress): the capability belongs to the configured
# pipeline (``GlobalBlockBudget.runs_in_vllm`` is true only when each layer's total is fixed), not to the defaults.
EVEN_LAYER_PARAM = "even_layer_evict"
EVEN_LAYER_METHODS = tuple(
    name
    for name in method_names()
    if name not in SUPPORTED_METHODS
    and EVEN_LAYER_PARAM in method_info(name).defaults()
    and capabilities_of(get_method(name, **{EVEN_LAYER_PARAM: True})).vllm
)
ACCEPTED_METHODS = SUPPORTED_METHODS + EVEN_LAYER_METHODS
# Methods that compress a request again and again inside vLLM (between prefill chunks, while decoding): every
# layer and KV head keeps ``budget`` entries, chosen without the question (no accumulated statistics).
UNIFORM_ROUND_METHODS = tuple(
    name
    for name in ("snapkv", "tova", "streaming_llm", "knorm", "random", "critical_snapkv")
    if name in SUPPORTED_METHODS
)
# LagKV's family: recursive rounds of their own (``tail:LAG``), compressing only the partitions past the part
# already compressed; the kept count follows from the token counts alone (:meth:`VLLMEvictionConfig.lag_round`).
LAG_ROUND_METHODS = tuple(name for name in ("lagkv", "localkv", "lag_knorm") if name in SUPPORTED_METHODS)
# Per-head methods whose layer totals are known before scoring (AdaKV: kv_heads · budget split by the scores; HeadKV:
# per-head counts from its artifact at the request's length): every round re-scores each head's entries (its kept
# ones and the tokens since) and re-places them in one-head sub-pages. DuoAttention's retrieval heads keep
# everything, so its requests cannot be bounded by rounds.
HEAD_ROUND_METHODS = tuple(
    name for name in ("adakv", "critical_adakv", "headkv", "critical_headkv") if name in PER_HEAD_METHODS
)


@dataclass(frozen=True)
class VLLMEvictionConfig:
    """A validated plugin configuration.

    Attributes:
        method: kvtrim method name (one of :data:`ACCEPTED_METHODS`)
        spec: the ratio or budget
        params: keyword arguments of the method's factory
        min_prompt: prompts shorter than this keep every entry
        between_chunks: compress to the budget after every prefill chunk (chunked prefill), not only after the
            last one; the scheduler then admits a request by its compressed size
        decode_reserve: with ``between_chunks``, admit a waiting request only when the pool holds the projected
            peak of every request growing one entry per decoded token until it has decoded this many tokens (at
            most its ``max_tokens``); 0: vLLM's admission, which reserves nothing for decoding, so admitted
            requests may outgrow the pool and be preempted
    """

    method: str
    spec: BudgetSpec
    params: dict = field(default_factory=dict)
    min_prompt: int = 0
    between_chunks: bool = False
    decode_reserve: int = 0

    def __post_init__(self) -> None:
        base, schedule = split_schedule(self.method)
        if base not in ACCEPTED_METHODS:
            known = "" if base in method_names() else " (not a kvtrim method)"
            raise InvalidParameterError(
                f"method {base!r}{known} is not supported inside vLLM; supported: {', '.join(ACCEPTED_METHODS)}"
            )
        if isinstance(self.min_prompt, bool) or not isinstance(self.min_prompt, int) or self.min_prompt < 0:
            raise InvalidParameterError(f"min_prompt must be an integer >= 0, got {self.min_prompt!r}")
        if not isinstance(self.between_chunks, bool):
            raise InvalidParameterError(f"between_chunks must be true or false, got {self.between_chunks!r}")
        if isinstance(self.decode_reserve, bool) or not isinstance(self.decode_reserve, int) or self.decode_reserve < 0:
            raise InvalidParameterError(f"decode_reserve must be an integer >= 0 (tokens), got {self.decode_reserve!r}")
        if self.decode_reserve and not self.between_chunks:
            raise InvalidParameterError(
                "decode_reserve needs between_chunks = true: without it vLLM admits a request by its whole prompt"
            )
        pipeline = self.pipeline()  # raises on bad params
        pipeline.check(self.spec.ratio, self.spec.budget)
        if isinstance(pipeline.budget, GlobalBlockBudget):
            self._check_even_layers(pipeline)
        if not capabilities_of(pipeline).vllm:
            raise InvalidParameterError(
                f"method {base!r} with params {self.params} does not run inside vLLM (a part of its pipeline does not "
                "declare runs_in_vllm)"
            )
        if isinstance(pipeline.budget, PartitionBudget) and pipeline.budget.skip_layers:
            raise InvalidParameterError(
                "params.skip_layers is not supported inside vLLM: every layer must keep the same number of entries"
            )
        if isinstance(pipeline.budget, PartitionBudget):
            self._check_lag_schedule(pipeline)
            return
        if schedule is not None and not isinstance(pipeline.schedule, (EveryNTokens, OverBudget)):
            raise InvalidParameterError(
                f"method {self.method!r}: inside vLLM a decoding schedule is 'every:N' or 'over:SLACK' "
                "('tail:LAG' is LagKV's own recursion: lagkv, localkv, lag_knorm)"
            )
        if self.rounds:
            if self.spec.budget is None:
                raise InvalidParameterError(
                    "between_chunks and decoding schedules (method@every:N) need 'budget', not 'ratio': the kept "
                    "count must not depend on a length the scheduler does not know yet"
                )
            if base not in UNIFORM_ROUND_METHODS + HEAD_ROUND_METHODS + EVEN_LAYER_METHODS:
                raise InvalidParameterError(
                    f"between_chunks and decoding schedules run for {', '.join(UNIFORM_ROUND_METHODS)}, the per-head "
                    f"{', '.join(HEAD_ROUND_METHODS)}, KV-Compress between chunks "
                    f"({', '.join(EVEN_LAYER_METHODS)}), and LagKV's recursion ({', '.join(LAG_ROUND_METHODS)}) "
                    f"inside vLLM, not {base!r} (per-layer counts and per-head counts fixed by an artifact are sized "
                    "once, after the prompt)"
                )
            if base in HEAD_ROUND_METHODS and isinstance(pipeline.schedule, OverBudget):
                raise InvalidParameterError(
                    f"method {self.method!r}: per-head methods compress while decoding with 'every:N' inside vLLM, "
                    "not 'over:SLACK'"
                )
            if pipeline.observation.accumulate and not self.decode_metric:
                raise InvalidParameterError(f"method {base!r} accumulates statistics over all queries")

    def _check_even_layers(self, pipeline: Pipeline) -> None:
        """KV-Compress runs with ``even_layer_evict``: after the prompt, between chunks (``between_chunks``) and every
        ``N`` decoded tokens with its decoding-time metric (``@every:N``)."""
        base = split_schedule(self.method)[0]
        if not pipeline.budget.even_layers:
            raise InvalidParameterError(
                f"method {base!r} runs inside vLLM only with params.{EVEN_LAYER_PARAM} = true (the authors' "
                "--even-layer-evict: every layer keeps ⌈budget·kv_heads/block_size⌉ blocks, which its heads split by "
                "score). Without it blocks are ranked across all layers, so each layer's total varies with the "
                "scores, while vLLM's scheduler sizes a request's block list before any score exists: the worker "
                "would have to report the counts back to the scheduler (not built)"
            )
        if pipeline.observation.accumulate and not isinstance(pipeline.schedule, EveryNTokens):
            raise InvalidParameterError(
                f"method {self.method!r}: inside vLLM KV-Compress compresses while decoding with 'every:N' (its "
                "decoding-time metric), not 'over:SLACK'"
            )

    def _check_lag_schedule(self, pipeline: Pipeline) -> None:
        """LagKV's family runs its own recursion (``tail:LAG``, the default) or compresses once (``@prefill``)."""
        schedule = pipeline.schedule
        lag = pipeline.budget.lag
        if isinstance(schedule, TailFull) and (schedule.lag, schedule.sink) != (lag, pipeline.budget.sink):
            raise InvalidParameterError(
                f"method {self.method!r}: inside vLLM the recursion's 'tail:LAG' must equal the method's lag ({lag})"
            )
        if not isinstance(schedule, (TailFull, AfterPrefill)):
            raise InvalidParameterError(
                f"method {self.method!r}: LagKV's family compresses by its own recursion inside vLLM "
                f"('{split_schedule(self.method)[0]}', i.e. 'tail:{lag}', or '@prefill' for once after the prompt); "
                "'every:N' and 'over:SLACK' need a fixed budget"
            )

    @cached_property
    def decode_metric(self) -> int:
        """KV-Compress with ``@every:N``: ``N``, the decoded queries whose squared attention a round adds to the
        kept entries' metric (each decoded query's, as the paper's running metric); 0 for other methods."""
        pipeline = self.pipeline()
        if isinstance(pipeline.budget, GlobalBlockBudget) and pipeline.observation.accumulate:
            return pipeline.schedule.n
        return 0

    def record_window(self, window: int) -> int:
        """Recent queries a worker keeps per request and layer: the scorer's observation ``window``, or the
        ``N`` decoded queries since the last round when more (:attr:`decode_metric`; the worker starts such a
        request's record again after each round)."""
        return max(window, self.decode_metric)

    @cached_property
    def lag(self) -> PartitionBudget | None:
        """LagKV's family: the partition frame (sink, lag), or None for other methods."""
        budget = self.pipeline().budget
        return budget if isinstance(budget, PartitionBudget) else None

    @property
    def rounds(self) -> bool:
        """Whether a request is compressed more than once (between prefill chunks or while decoding)."""
        return self.between_chunks or self.decode_schedule is not None

    @cached_property
    def decode_schedule(self) -> EveryNTokens | OverBudget | TailFull | None:
        """The decoding schedule: ``method@every:N`` / ``method@over:SLACK``, LagKV's own ``tail:LAG`` (its
        default), or None (compress once)."""
        if split_schedule(self.method)[1] is None and self.lag is None:
            return None
        schedule = get_method(self.method, **self.params).schedule
        return schedule if schedule.continuous else None

    def held_bound(self, chunk: int, block_size: int = 1, kv_heads: int | None = None) -> int | None:
        """Most entries a request ever holds with steps of at most ``chunk`` tokens, or None (unbounded): with
        ``between_chunks`` and a decoding schedule, the budget plus the larger of one chunk and one round.
        LagKV keeps a share of every partition, so its requests grow without bound (None). Per-head methods count
        slots (:meth:`round_slots`, which needs the ``block_size``, and KV-Compress the ``kv_heads``)."""
        schedule = self.decode_schedule
        if not self.between_chunks or schedule is None or isinstance(schedule, TailFull):
            return None
        period = schedule.n if isinstance(schedule, EveryNTokens) else schedule.slack + 1
        if self.per_head and self.head_counts_fixed:
            return None  # the artifact's counts depend on the length: vLLM's own start-up check
        return self.round_slots(block_size, kv_heads) + max(chunk, period)

    @cached_property
    def head_counts_fixed(self) -> bool:
        """Per-head counts fixed by a calibration artifact (HeadKV, DuoAttention), not split by the scores."""
        return isinstance(self.pipeline().budget, (ArtifactHeadScoreBudget, DuoHeadBudget))

    def round_slots(
        self,
        block_size: int,
        kv_heads: int | None = None,
        length: int | None = None,
        head_counts: np.ndarray | None = None,
    ) -> int:
        """Slots of vLLM's uniform block list a request keeps after a round: the budget; per-head methods
        ``M + block_size − 1``, enough one-head sub-pages for any split of a layer's ``kv_heads · M`` entries
        (:mod:`kvtrim.vllm.subpages`), with ``M`` the budget (AdaKV) or KV-Compress's per-layer block bound over
        ``kv_heads`` at ``length`` entries per head (:meth:`GlobalBlockBudget.layer_bound`; needs ``kv_heads``), or
        the largest layer's mean of ``head_counts`` ``[layers, kv_heads]`` (HeadKV's counts at the request's length,
        :meth:`head_counts`; required for it). A method whose pages are vLLM's blocks: :meth:`page_slots`."""
        budget = int(self.spec.budget)
        if not self.per_head:
            return budget
        if self.head_counts_fixed:
            if head_counts is None:
                raise InvalidParameterError(f"head_counts are required for {self.method!r} (counts per head)")
            budget = -(-int(head_counts.sum(-1).max()) // head_counts.shape[-1])
        elif self.page_size == block_size:
            return self.page_slots(budget, max(length or 0, budget + 1), block_size)
        elif self.block_budget is not None:
            if kv_heads is None:
                raise InvalidParameterError(f"kv_heads is required for {self.method!r} (blocks per layer)")
            length = max(length or 0, budget + 1)
            budget = -(-self.block_budget.layer_bound(budget, kv_heads, length) // kv_heads)
        return budget + block_size - 1

    @cached_property
    def page_budget(self) -> GlobalBlockBudget | HeadAdaptiveBudget | None:
        """The allocator of a per-head method that counts in whole pages (KV-Compress; AdaKV and CriticalKV-AdaKV
        with ``params.page_size`` above 1), built once: :meth:`page_slots` asks it in every step, or None."""
        budget = self.pipeline().budget
        if isinstance(budget, GlobalBlockBudget) or (isinstance(budget, HeadAdaptiveBudget) and budget.page_size > 1):
            return budget
        return None

    @property
    def page_size(self) -> int | None:
        """Entries per page of :attr:`page_budget` (KV-Compress: its ``block_size``; AdaKV: ``params.page_size``),
        or None. When it equals vLLM's block size the kept entries fill whole one-head sub-pages: :meth:`page_slots`."""
        budget = self.page_budget
        if budget is None:
            return None
        return budget.block_size if isinstance(budget, GlobalBlockBudget) else budget.page_size

    def page_hint(self, block_size: int) -> str | None:
        """What to pass so that a per-head method holds the uniform method's blocks with vLLM's ``block_size``
        (counts in whole pages of it, :meth:`page_slots`), or None: already so, or not a method that can."""
        if not self.per_head or self.page_size == block_size:
            return None
        budget = self.pipeline().budget
        if isinstance(budget, GlobalBlockBudget):
            key, unit = "block_size", f"blocks of {budget.block_size} entries"
        elif isinstance(budget, HeadAdaptiveBudget):
            key, unit = "page_size", "single entries" if self.page_size is None else f"pages of {self.page_size}"
        else:
            return None
        return (
            f"kvtrim: {self.method} counts its heads' entries in {unit} while vLLM's blocks hold {block_size}: a "
            f"request keeps up to {block_size - 1} slots more than the uniform method; params.{key} = {block_size} "
            "counts in whole pages of vLLM's blocks and keeps the uniform method's blocks"
        )

    def page_slots(self, budget: int, length: int, block_size: int) -> int:
        """A per-head method whose pages are vLLM's blocks (:attr:`page_size` equal to vLLM's block size): slots of
        the uniform block list that hold a layer's kept entries, ``block_size · ⌈P/H⌉`` with ``P`` the most pages
        one layer's ``H`` heads keep (``layer_pages`` of :class:`GlobalBlockBudget` / :class:`HeadAdaptiveBudget`),
        no slack: ``⌈B/block_size⌉`` blocks, the uniform method's, whenever the budget is above the protected
        window. ``P`` is a maximum of terms ``⌈H·x⌉`` and ``H·⌈x⌉`` (for each of ``head_groups`` groups), so
        ``⌈P/H⌉`` does not depend on ``H`` (computed with one head per group): the scheduler needs no head count.

        Every head keeps whole pages or its whole row, so after ``t`` more tokens the layer needs at most
        ``P + H·⌈t/block_size⌉`` one-head pages: the blocks vLLM allocates for ``slots + t`` tokens.
        """
        groups = self.head_groups
        return block_size * (self.page_budget.layer_pages(budget, groups, length) // groups)

    def round_keep(
        self,
        prompt_len: int,
        logical_end: int,
        physical_end: int,
        step_tokens: int = 1,
        block_size: int = 1,
        compressed: bool = False,
        kv_heads: int | None = None,
        counts_at: Callable[[int], np.ndarray | None] | None = None,
    ) -> int | None:
        """Entries a request keeps after a step of ``step_tokens`` tokens that ends at token ``logical_end``
        holding ``physical_end`` entries, or None: no compression in this step. A function of counts only, so the
        scheduler and every worker decide the same way.

        Prefill chunks (``between_chunks``): every chunk, once the entries exceed the budget (also the chunks of a
        preempted request's recomputation, which run past the prompt); the final chunk as without rounds.
        Decoding: ``every:N`` when ``N``, ``2N`` … tokens were decoded, ``over:SLACK`` when the entries exceed the
        budget by more than ``SLACK``.

        Per-head methods count slots of the uniform block list: a round keeps :meth:`round_slots` (``budget +
        block_size − 1``, or every slot when fewer), so the heads' mean count is the budget once ``compressed``
        (a round ran before) and the slots exceed the budget by ``block_size − 1``: the threshold is then
        :meth:`round_slots`, before the first round the budget. ``counts_at(length)``: HeadKV's counts at a length
        (:meth:`head_counts`), asked only in a step that may end in a round (not in every decoding step).
        """
        if prompt_len < max(self.min_prompt, 1):
            return None
        if self.lag is not None:
            return self._lag_keep(prompt_len, logical_end, physical_end, step_tokens)
        budget = int(self.spec.budget)
        if logical_end < prompt_len or (self.between_chunks and step_tokens > 1):
            if not self.between_chunks:
                return None
        elif logical_end > prompt_len:
            schedule = self.decode_schedule
            if isinstance(schedule, EveryNTokens):
                due = (logical_end - prompt_len) % schedule.n == 0
            elif isinstance(schedule, OverBudget):
                due = physical_end > budget + schedule.slack
            else:
                return None
            if not due:
                return None
        limit = keep = budget
        if self.per_head:
            counts = None if counts_at is None else counts_at(logical_end)
            slots = self.round_slots(block_size, kv_heads, physical_end, counts)
            limit, keep = (slots if compressed else budget), min(slots, physical_end)
        return keep if physical_end > limit else None

    def _lag_keep(self, prompt_len: int, logical_end: int, physical_end: int, step_tokens: int) -> int | None:
        """LagKV's rounds: a prefill chunk (``between_chunks``), the last prompt chunk, a recomputed chunk past
        the prompt (``between_chunks`` or the recursion) and every decoding step (the recursion: ``tail:LAG``)
        compress when the uncompressed tail holds two partitions; see :meth:`lag_round`."""
        if logical_end < prompt_len or (logical_end > prompt_len and step_tokens > 1):
            due = self.between_chunks or (logical_end > prompt_len and self.decode_schedule is not None)
        elif logical_end == prompt_len:
            due = True
        else:
            due = self.decode_schedule is not None
        if not due:
            return None
        removed = self.lag_round(logical_end, logical_end - physical_end)[0]
        return physical_end - removed if removed else None

    def lag_keep_per_partition(self) -> int:
        """LagKV's family: entries kept of each compressed partition, ``⌊(1 − ratio)·lag⌋``."""
        return keep_per_partition(float(self.spec.ratio), self.lag.lag)

    def lag_drop_per_partition(self) -> int:
        """LagKV's family: entries each compressed partition drops, ``lag − ⌊(1 − ratio)·lag⌋``."""
        return self.lag.lag - self.lag_keep_per_partition()

    def compressed_until(self, dropped: int) -> int:
        """LagKV's family: the first logical position a request has not compressed yet, from the entries its
        rounds dropped so far (each compressed partition drops ``lag − ⌊r·lag⌋``): ``S + lag · dropped /
        (lag − ⌊r·lag⌋)``, the sink size before the first round. Scheduler and workers derive it from the same
        count, so no per-request state besides ``dropped`` is kept (and it goes when ``dropped`` goes)."""
        frame, gone = self.lag, self.lag_drop_per_partition()
        return frame.sink + (frame.lag * dropped // gone if gone else 0)

    def lag_round(self, logical_end: int, dropped: int) -> tuple[int, int]:
        """LagKV's family, a request that has seen ``logical_end`` tokens and dropped ``dropped`` entries so far:
        ``(entries a round drops now, compressed_until after it)``. With ``n`` full partitions past
        ``compressed_until``, partitions ``0 … n−2`` keep ``⌊r·lag⌋`` entries each (kvtrim's
        ``PartitionBudget`` / ``TailFull`` on the transformers path); nothing when ``n < 2``."""
        frame, gone = self.lag, self.lag_drop_per_partition()
        start = self.compressed_until(dropped)
        parts = max((logical_end - start) // frame.lag - 1, 0) if gone else 0
        return parts * gone, start + parts * frame.lag

    def admission_tokens(
        self,
        num_tokens: int,
        chunk: int,
        block_size: int = 1,
        kv_heads: int | None = None,
        counts_at: Callable[[int], np.ndarray | None] | None = None,
    ) -> int | None:
        """With ``between_chunks``: most entries a request of ``num_tokens`` tokens holds at once, compressed after
        every step of at most ``chunk`` tokens (vLLM's full-sequence admission gate counts this), else None.

        Uniform methods: the budget plus one chunk (per-head methods: :meth:`round_slots` plus one chunk, which
        needs the ``block_size``, KV-Compress the ``kv_heads``, HeadKV ``counts_at``: its counts at a length).
        LagKV's family: before a round, the tail past ``compressed_until`` holds under ``2·lag + chunk`` tokens,
        so with ``c = S + 2·lag − 1 + chunk`` a request at ``T`` tokens holds at most ``c + k·⌈(T − c)/lag⌉``
        (``k = ⌊r·lag⌋`` per compressed partition), which grows with ``T``: the bound at ``num_tokens``.
        """
        if not self.between_chunks:
            return None
        if self.lag is None:
            counts = None if counts_at is None else counts_at(num_tokens)
            return min(num_tokens, self.round_slots(block_size, kv_heads, num_tokens, counts) + chunk)
        frame = self.lag
        c = frame.sink + 2 * frame.lag - 1 + chunk
        over = max(num_tokens - c, 0)
        return min(num_tokens, c + self.lag_keep_per_partition() * -(-over // frame.lag))

    @cached_property
    def capabilities(self) -> Capabilities:
        """What the configured pipeline (the method with ``params``) declares; see :func:`capabilities_of`."""
        return capabilities_of(self.pipeline())

    @cached_property
    def block_budget(self) -> GlobalBlockBudget | None:
        """KV-Compress with ``even_layer_evict``: its block budget (:meth:`GlobalBlockBudget.layer_bound` sizes the
        blocks), or None for other methods."""
        budget = self.pipeline().budget
        return budget if isinstance(budget, GlobalBlockBudget) else None

    @property
    def per_layer(self) -> bool:
        """Whether layers keep different counts (PyramidKV): the worker then gives each layer its own lengths."""
        return self.capabilities.budgets == BUDGET_KINDS["layer"]

    @property
    def per_head(self) -> bool:
        """Whether KV heads keep different counts (AdaKV, KV-Compress with ``even_layer_evict``): the worker then
        stores each head in its own sub-pages."""
        return self.capabilities.budgets == BUDGET_KINDS["head"]

    def check_tensor_parallel(self, tensor_parallel_size: int, total_kv_heads: int | None = None) -> None:
        """Refuse a tensor-parallel split that per-head methods cannot keep.

        Each tensor-parallel rank holds and scores only its own KV heads, in its own memory. Uniform and per-layer
        methods keep a count that follows from the prompt length alone, so every rank keeps the same slots and
        selects per head as one rank would. Methods whose per-head counts a calibration artifact fixes (HeadKV,
        CriticalKV-HeadKV, DuoAttention) compute the counts of every head of the model and each rank keeps its own
        heads' counts (:meth:`head_counts`), so they select as one rank would too. AdaKV, CriticalKV-AdaKV and
        KV-Compress split a share among heads by score: across ranks only when that split is made within groups
        of heads that a rank holds whole, ``params.head_groups`` a multiple of the rank count (each rank then
        splits within its own groups: :meth:`rank_config`); otherwise refused. ``total_kv_heads`` (the model's):
        ranks that replicate KV heads (more ranks than heads) are refused for every per-head method, whose counts
        are kept per rank's own slice of the heads, and ``head_groups`` must divide the heads.
        """
        groups = self.head_groups
        if self.per_head and not self.head_counts_fixed and groups % tensor_parallel_size:
            raise InvalidParameterError(
                f"tensor_parallel_size={tensor_parallel_size} is not supported with {self.method} and "
                f"params.head_groups={groups}: its per-head counts are split by score among the KV heads of a "
                "group, and each tensor-parallel rank holds only its own heads. Set params.head_groups to a "
                f"multiple of {tensor_parallel_size} (each rank then splits among its own heads; a different "
                "selection from the whole layer's split, the same at every rank count), or use a method whose "
                "per-head counts come from a calibration artifact (headkv, critical_headkv, duo_attention), or a "
                "uniform or per-layer method (e.g. snapkv, pyramidkv)"
            )
        if self.per_head and total_kv_heads is not None and total_kv_heads % tensor_parallel_size:
            raise InvalidParameterError(
                f"tensor_parallel_size={tensor_parallel_size} is not supported with {self.method}: the model's "
                f"{total_kv_heads} KV heads do not divide among the ranks (vLLM replicates them), and the per-head "
                "counts are kept per rank's own slice of the heads; use a tensor_parallel_size that divides "
                f"{total_kv_heads}"
            )
        if total_kv_heads is not None and total_kv_heads % groups:
            raise InvalidParameterError(
                f"params.head_groups={groups} must divide the model's {total_kv_heads} KV heads into equal groups"
            )

    @cached_property
    def head_groups(self) -> int:
        """``params.head_groups`` of a method that splits by score within groups of heads (AdaKV, CriticalKV-AdaKV,
        KV-Compress), else 1."""
        budget = self.pipeline().budget
        return budget.head_groups if isinstance(budget, (HeadAdaptiveBudget, GlobalBlockBudget)) else 1

    def rank_config(self, tensor_parallel_size: int, total_kv_heads: int | None = None) -> VLLMEvictionConfig:
        """The configuration each of ``tensor_parallel_size`` ranks runs, and the scheduler sizes blocks by: a
        method split by score within ``head_groups`` groups splits, on a rank, within the rank's ``head_groups /
        tensor_parallel_size`` (checked first: :meth:`check_tensor_parallel`, with the model's ``total_kv_heads``
        when given). Each rank holds a slice of whole groups, so the ranks together keep what one rank with
        ``head_groups`` keeps."""
        self.check_tensor_parallel(tensor_parallel_size, total_kv_heads)
        if tensor_parallel_size == 1 or self.head_groups == 1:
            return self
        params = {**self.params, "head_groups": self.head_groups // tensor_parallel_size}
        return dataclasses.replace(self, params=params)

    def pipeline(self) -> Pipeline:
        """A fresh kvtrim pipeline for this configuration."""
        pipeline = get_method(self.method, **self.params)  # ``name@schedule`` carries its schedule
        kinds = (
            UniformBudget,
            PartitionBudget,
            PyramidBudget,
            HeadAdaptiveBudget,
            ArtifactHeadScoreBudget,
            DuoHeadBudget,
            GlobalBlockBudget,
        )
        if not isinstance(pipeline.budget, kinds):
            raise InvalidParameterError(f"method {self.method!r} has budgets the vLLM plugin cannot size blocks for")
        return pipeline

    def head_budget(self, prompt_len: int) -> int:
        """Per-head methods: the mean entries per KV head ``B`` after a ``prompt_len``-token prefill."""
        if prompt_len < max(self.min_prompt, 1):
            return prompt_len
        return self.spec.keep_count(prompt_len)

    def bound_pipeline(self, model_path: str) -> Pipeline:
        """A fresh pipeline bound to the checkpoint at ``model_path`` when a part loads a calibration artifact
        (HeadKV's head scores; :mod:`kvtrim.vllm.checkpoint_model`), else unbound."""
        pipeline = self.pipeline()
        if method_info(self.method).capabilities.artifacts:
            from .checkpoint_model import checkpoint_stand_in

            pipeline.bind(checkpoint_stand_in(model_path))
        return pipeline

    def head_counts(
        self, pipeline: Pipeline, prompt_len: int, num_layers: int, kv_heads: int, tp_size: int = 1
    ) -> np.ndarray | None:
        """Per-head counts fixed before any score exists (HeadKV and DuoAttention: from the artifact's head scores
        or gates, the budget and the prompt length), or None (AdaKV: the scores split each layer's total).

        ``kv_heads`` is what one tensor-parallel rank holds; the counts are those of all ``kv_heads · tp_size``
        heads of the model (the artifact's), one row per (layer, rank): ``[num_layers · tp_size, kv_heads]``, row
        ``layer · tp_size + rank`` the rank's heads of that layer (``[num_layers, kv_heads]`` without tensor
        parallelism). Every sizing rule reads the largest row mean, so the scheduler and every rank size the
        request's blocks alike, enough for each rank's own split; a rank compacts with :meth:`rank_rows`."""
        if not isinstance(pipeline.budget, (ArtifactHeadScoreBudget, DuoHeadBudget)):
            return None
        request = BudgetRequest(
            keep=torch.tensor([self.head_budget(prompt_len)]),
            context_lengths=torch.tensor([prompt_len]),
            num_layers=num_layers,
            kv_heads=kv_heads * tp_size,
            ratio=self.spec.ratio,
        )
        counts = pipeline.budget.allocate(request, [])[0].cpu().numpy()  # [num_layers, kv_heads · tp_size]
        return counts.reshape(num_layers * tp_size, kv_heads)

    @staticmethod
    def rank_rows(counts: np.ndarray | None, tp_size: int, rank: int) -> np.ndarray | None:
        """``[num_layers, kv_heads]``: the rows of :meth:`head_counts` that hold tensor-parallel rank ``rank``'s
        heads (all of them when ``tp_size`` is 1); None when there are no fixed counts."""
        return None if counts is None else counts[rank::tp_size]

    def head_counts_at(
        self, pipeline: Pipeline, num_layers: int, kv_heads: int, tp_size: int = 1
    ) -> Callable[[int], np.ndarray | None]:
        """``length -> head_counts(pipeline, length, num_layers, kv_heads, tp_size)``, the last length's answer
        remembered (a round asks twice: whether it is due, then for the counts)."""
        return lru_cache(maxsize=1)(lambda length: self.head_counts(pipeline, length, num_layers, kv_heads, tp_size))

    def layer_total(self, prompt_len: int, kv_heads: int) -> int:
        """Per-head methods whose counts follow the scores: most entries one layer keeps over its ``kv_heads``
        heads after a ``prompt_len``-token prefill. AdaKV: ``kv_heads · B``; KV-Compress with ``even_layer_evict``:
        :meth:`GlobalBlockBudget.layer_bound` (``⌈B·kv_heads/16⌉`` blocks of its own block size, or what the
        protected window forces). The scheduler sizes the block list and the worker checks each layer by it."""
        budget = self.head_budget(prompt_len)
        if self.block_budget is not None:
            return self.block_budget.layer_bound(budget, kv_heads, prompt_len)
        if self.page_size is not None:  # AdaKV in whole pages: the layer's pages may hold a little more than H·B
            return min(self.page_budget.layer_pages(budget, kv_heads, prompt_len) * self.page_size,
                       kv_heads * prompt_len)  # fmt: skip
        return kv_heads * budget

    def slot_count(
        self,
        prompt_len: int,
        num_layers: int,
        block_size: int,
        head_counts: np.ndarray | None = None,
        kv_heads: int | None = None,
    ) -> int:
        """Slots of vLLM's (uniform) block list a request keeps after prefill; ``prompt_len``: nothing freed.

        Uniform and per-layer methods: :meth:`keep_count`. Per-head methods: ``min(M + block_size − 1, prompt)``
        (:func:`kvtrim.vllm.subpages.slots_for_head_budget`) with ``M`` the largest layer's mean count per head
        (``B`` when every layer keeps ``kv_heads · B``; ``⌈layer_total / kv_heads⌉`` for KV-Compress, whose
        ``kv_heads`` is then required; from ``head_counts`` ``[layers, kv_heads]`` when they are fixed in advance),
        enough one-head sub-pages for the layer's split, now and after every decoded token. A method whose pages are
        vLLM's blocks (:attr:`page_size`) keeps whole pages: :meth:`page_slots`, no slack.
        """
        if self.per_head:
            budget = self.head_budget(prompt_len)
            if budget >= prompt_len:
                return prompt_len
            if head_counts is not None:
                budget = -(-int(head_counts.sum(-1).max()) // head_counts.shape[-1])
            elif self.page_size == block_size:
                return min(self.page_slots(budget, prompt_len, block_size), prompt_len)
            elif self.block_budget is not None:
                if kv_heads is None:
                    raise InvalidParameterError(f"kv_heads is required for {self.method!r} (blocks per layer)")
                budget = -(-self.layer_total(prompt_len, kv_heads) // kv_heads)
            return slots_for_head_budget(budget, prompt_len, block_size)
        return self.keep_count(prompt_len, num_layers)

    def keep_count(self, prompt_len: int, num_layers: int | None = None) -> int:
        """Slots a request keeps after a ``prompt_len``-token prefill (``prompt_len``: keep all).

        For uniform methods every layer and KV head keeps this many entries; for per-layer methods (PyramidKV)
        it is the largest layer's count, which sizes the request's block list. The scheduler frees blocks from
        this number before the worker has scored anything, so it depends only on the prompt length, the
        configuration and the model's layer count.
        """
        return max(self.layer_keeps(prompt_len, num_layers))

    def layer_keeps(self, prompt_len: int, num_layers: int | None = None) -> list[int]:
        """Entries each layer keeps (per KV head) after a ``prompt_len``-token prefill, ``[num_layers]``.

        PyramidKV: kvtrim's own schedule (``pyramid_layer_budgets``, capped at the prompt length, as
        ``PyramidBudget.allocate`` does on the transformers path); other methods: the same count everywhere
        (``num_layers`` None: one entry).
        """
        if num_layers is None:
            if self.per_layer:
                raise InvalidParameterError(f"num_layers is required for the per-layer method {self.method!r}")
            num_layers = 1
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise InvalidParameterError(f"num_layers must be an integer >= 1, got {num_layers!r}")
        if prompt_len < max(self.min_prompt, 1):
            return [prompt_len] * num_layers
        pipeline = self.pipeline()
        b = pipeline.budget
        if isinstance(b, PartitionBudget):
            keep = kept_length(prompt_len, b.sink, b.lag, keep_per_partition(float(self.spec.ratio), b.lag))
            return [keep] * num_layers
        keep = self.spec.keep_count(prompt_len)
        if isinstance(b, PyramidBudget):
            per_layer = pyramid_layer_budgets(keep, prompt_len, num_layers, b.window, b.beta)
            return [min(k, prompt_len) for k in per_layer]
        return [keep] * num_layers

    def describe(self) -> dict:
        return {
            "method": self.method,
            **self.spec.describe(),
            "params": dict(self.params),
            "min_prompt": self.min_prompt,
            "between_chunks": self.between_chunks,
            "decode_reserve": self.decode_reserve,
        }


def parse_config(raw: dict) -> VLLMEvictionConfig:
    """Validate a configuration dict (the JSON object of either source)."""
    if not isinstance(raw, dict):
        raise InvalidParameterError(f"the kvtrim vLLM configuration must be a JSON object, got {type(raw).__name__}")
    unknown = set(raw) - {"method", "ratio", "budget", "params", "min_prompt", "between_chunks", "decode_reserve"}
    if unknown:
        raise InvalidParameterError(
            f"unknown kvtrim vLLM configuration keys {sorted(unknown)}; allowed: method, ratio, budget, params, "
            "min_prompt, between_chunks, decode_reserve"
        )
    if "method" not in raw:
        raise InvalidParameterError("the kvtrim vLLM configuration needs 'method'")
    params = raw.get("params", {})
    if not isinstance(params, dict):
        raise InvalidParameterError(f"params must be a JSON object, got {params!r}")
    spec = BudgetSpec(ratio=raw.get("ratio"), budget=raw.get("budget"))
    return VLLMEvictionConfig(
        str(raw["method"]),
        spec,
        dict(params),
        raw.get("min_prompt", 0),
        raw.get("between_chunks", False),
        raw.get("decode_reserve", 0),
    )


def load_config(additional_config: dict | None) -> VLLMEvictionConfig | None:
    """The active configuration: ``additional_config["kvtrim"]`` first, else ``$KVTRIM_VLLM_CONFIG``, else None."""
    if additional_config and ADDITIONAL_CONFIG_KEY in additional_config:
        return parse_config(additional_config[ADDITIONAL_CONFIG_KEY])
    text = os.environ.get(ENV_VAR, "").strip()
    if not text:
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidParameterError(f"{ENV_VAR} must hold a JSON object: {exc}") from exc
    return parse_config(raw)
