"""Global, block-granular budgets across all layers and KV heads, or within each layer (KV-Compress)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidParameterError
from ..selection.block_eviction import block_eviction_counts, budget_blocks, evicted_entries
from .base import BudgetAllocator, BudgetRequest
from .head_adaptive import check_head_groups, group_count


@dataclass
class GlobalBlockBudget(BudgetAllocator):
    """KV-Compress allocation (Rehg, arXiv 2410.00161: metric, chunk ranking, block counts) for kvtrim's pipeline.

    Per sequence, the requested mean ``M`` entries per (layer, KV head) — the protected window included — becomes a
    total of ``⌈M·L·H / block_size⌉`` blocks. Each head's entries are cut into chunks of ``block_size`` by ascending
    score and the lowest chunks of all layers and heads are evicted until that many blocks remain (the same ranking
    as the paged cache: :func:`~kvtrim.selection.block_eviction.block_eviction_counts`). Entries of the last
    ``protected_window`` positions are never evicted. A head keeps ``length − evicted`` entries, so rates vary freely
    per layer and head; with whole-block rounding the total kept may exceed ``M·L·H`` by less than one block.

    With ``even_layers`` (the authors' ``--even-layer-evict``) the chunks are ranked within each layer instead:
    every layer keeps at most ``⌈M·H / block_size⌉`` blocks (:meth:`layer_bound` entries), which its heads still
    split by score. A layer's total is then known before any score exists (what the vLLM plugin needs to size a
    request's blocks); the rate varies per head, not per layer.

    With ``head_groups = G > 1`` the KV heads form ``G`` equal groups of consecutive heads, each ranked on its own
    (within each layer with ``even_layers``, across the layers otherwise) down to the blocks of its ``H/G`` heads:
    the ranking a tensor-parallel deployment over ``G`` ranks (or a multiple of them) can make, each rank holding
    and scoring one slice of the heads in its own memory (the vLLM plugin, ``tensor_parallel_size``).

    Args:
        block_size: entries per block (16)
        protected_window: the most recent tokens that are never evicted (32)
        even_layers: rank the blocks of each layer separately (every layer evicts down to the same block count)
        head_groups: groups of consecutive KV heads ranked separately (1: all heads together, the paper's)
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    varies_by = "head"
    paged_engine = True  # kvtrim.serve runs this ranking on paged storage

    block_size: int = 16
    protected_window: int = 32
    even_layers: bool = False
    head_groups: int = 1

    @property
    def runs_in_vllm(self) -> bool:
        """The vLLM plugin sizes a request's block list before scoring: only a per-layer total fixed in advance."""
        return self.even_layers

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size <= 0:
            raise InvalidParameterError(f"block_size must be a positive integer, got {self.block_size!r}")
        if isinstance(self.protected_window, bool) or self.protected_window < 0:
            raise InvalidParameterError(f"protected_window must be an integer >= 0, got {self.protected_window!r}")
        if not isinstance(self.even_layers, bool):
            raise InvalidParameterError(
                f"even_layer_evict (even_layers) must be True or False, got {self.even_layers!r}"
            )
        check_head_groups(self.head_groups)

    def layer_bound(self, keep: int, kv_heads: int, length: int) -> int:
        """Most entries one layer's ``kv_heads`` heads keep together with ``even_layers``, at mean budget ``keep``
        over ``length`` entries per head.

        ``⌈keep·H / block_size⌉`` whole blocks of entries, or, when the protected window alone holds more, what it
        forces: a head keeps a multiple of ``block_size`` entries once it evicts, at least the protected window,
        so ``H · ⌈protected_window / block_size⌉`` blocks. Never more than ``H · length`` (nothing evicted). With
        ``head_groups`` the sum of each group's bound over its own heads.
        """
        groups = group_count(kv_heads, self.head_groups)
        return groups * self._group_bound(keep, kv_heads // groups, length)

    def _group_bound(self, keep: int, heads: int, length: int) -> int:
        """:meth:`layer_bound` of one group of ``heads`` heads."""
        if length <= keep:
            return heads * length
        floor = min(length, -(-self.protected_window // self.block_size) * self.block_size)
        bound = max(budget_blocks(keep, heads, self.block_size) * self.block_size, heads * floor)
        return min(bound, heads * length)

    def layer_pages(self, keep: int, kv_heads: int, length: int) -> int:
        """Most chunks of ``block_size`` entries one layer's ``kv_heads`` heads hold together after the
        ``even_layers`` ranking at mean budget ``keep`` over at most ``length`` entries per head.

        A head that evicts keeps whole chunks (the hanging one goes first), a head that does not keeps its entries
        in ``⌈n/block_size⌉`` chunks, so the layer holds at most ``⌈keep·H/block_size⌉`` chunks, or
        ``H·⌈protected_window/block_size⌉`` when the protected window forces more, or, with every head at or under
        ``keep``, ``H·⌈keep/block_size⌉``; ``H·⌈length/block_size⌉`` when no head is longer than ``keep``
        (``length``: every head's entries, the first compression). Where the chunks
        are the pages of a paged cache (the vLLM plugin with KV-Compress's block size equal to vLLM's), these are
        the pages the layer needs. With ``head_groups`` the sum of each group's chunks over its own heads.
        """
        groups = group_count(kv_heads, self.head_groups)
        return groups * self._group_pages(keep, kv_heads // groups, length)

    def _group_pages(self, keep: int, heads: int, length: int) -> int:
        """:meth:`layer_pages` of one group of ``heads`` heads."""
        bs = self.block_size
        if length <= keep:
            return heads * -(-length // bs)
        protected = -(-self.protected_window // bs)  # a head's chunks that hold its protected entries, at most
        return max(budget_blocks(keep, heads, bs), heads * protected, heads * -(-keep // bs))

    def head_counts(
        self, scores: torch.Tensor, positions: torch.Tensor, keep: int, context: int, groups: int = 1
    ) -> torch.Tensor:
        """Entries kept per row for one sequence.

        Args:
            scores, positions: ``[rows, seq]`` (rows = layers × KV heads; empty slots at position ``-1``)
            keep: mean entries per row ``M``
            context: tokens seen (positions run ``0..context-1``)
            groups: the rows form this many equal, consecutive groups (layers, with ``even_layers``), each ranked
                on its own down to ``⌈M·rows_per_group / block_size⌉`` blocks (one grouped ranking, no loop)
        Returns:
            ``[rows]`` entries kept
        """
        valid = positions >= 0
        lengths = valid.sum(-1)
        shielded = ~valid | (positions > context - 1 - self.protected_window)
        metric = scores.float().masked_fill(shielded, float("inf"))
        if int(lengths.max()) <= keep:
            return lengths  # every head is within the budget: block rounding alone never evicts
        per_group = lengths.view(groups, -1)
        held = (-(-per_group // self.block_size)).sum(-1)
        to_evict = (held - budget_blocks(keep, per_group.shape[1], self.block_size)).clamp(min=0)
        to_evict = to_evict.masked_fill(per_group.amax(-1) <= keep, 0)  # a group within the budget keeps all
        group = torch.arange(groups, device=lengths.device).repeat_interleave(per_group.shape[1])
        blocks = block_eviction_counts(metric.sort(dim=-1).values, lengths, self.block_size, to_evict, group)
        return lengths - evicted_entries(blocks, lengths, self.block_size)

    def allocate(self, request: BudgetRequest, scores: list[torch.Tensor]) -> torch.Tensor:
        if request.positions is None:
            raise ValueError("GlobalBlockBudget needs slot positions in the budget request")
        b, layers, heads = len(request.keep), request.num_layers, request.kv_heads
        width = max(s.shape[-1] for s in scores)
        out = torch.zeros(b, layers, heads, dtype=torch.long, device=request.keep.device)
        for row, (keep, context) in enumerate(
            zip(request.keep.tolist(), request.context_lengths.tolist(), strict=True)
        ):
            s = torch.full((layers, heads, width), float("-inf"), device=scores[0].device)
            p = torch.full((layers, heads, width), -1, dtype=torch.long, device=scores[0].device)
            for layer, (sc, pos) in enumerate(zip(scores, request.positions, strict=True)):
                s[layer, :, : sc.shape[-1]] = sc[row]
                p[layer, :, : pos.shape[-1]] = pos[row]
            g = group_count(heads, self.head_groups)
            if self.even_layers:  # each layer's heads (each group of them) share ⌈M·H/bs⌉ blocks
                rows = (layers * heads, width)
                out[row] = self.head_counts(s.view(rows), p.view(rows), keep, context, layers * g).view(layers, heads)
                continue
            # a group's heads of every layer, consecutive: [layers, heads] -> [g, layers, heads/g]
            order = (g, layers * heads // g, width)
            s, p = (t.view(layers, g, heads // g, width).transpose(0, 1).reshape(order) for t in (s, p))
            counts = self.head_counts(s.view(-1, width), p.view(-1, width), keep, context, g)
            out[row] = counts.view(g, layers, heads // g).transpose(0, 1).reshape(layers, heads)
        return out
