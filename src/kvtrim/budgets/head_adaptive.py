"""Head-adaptive budgets within a layer (AdaKV)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidParameterError
from .base import BudgetAllocator, BudgetRequest

RULES = ("official", "kvpress")


def largest_remainder(weights: torch.Tensor, total: int, floor: torch.Tensor | None = None) -> torch.Tensor:
    """Integers proportional to ``weights`` (``[n]``, non-negative) that sum exactly to ``total``.

    ``floor`` ``[n]`` is the minimum of each entry (its sum must not exceed ``total``).
    """
    base = torch.zeros_like(weights, dtype=torch.long) if floor is None else floor.clone()
    rest = total - int(base.sum())
    if rest <= 0:
        return base
    w = weights.double().clamp(min=0)
    share = w / w.sum() * rest if float(w.sum()) > 0 else torch.full_like(w, rest / len(w))
    whole = share.floor().long()
    left = rest - int(whole.sum())
    if left > 0:
        order = (share - whole).argsort(descending=True)
        whole[order[:left]] += 1
    return base + whole


def check_head_groups(head_groups: int) -> None:
    """``head_groups`` must be an integer >= 1."""
    if isinstance(head_groups, bool) or not isinstance(head_groups, int) or head_groups < 1:
        raise InvalidParameterError(f"head_groups must be an integer >= 1, got {head_groups!r}")


def group_count(kv_heads: int, head_groups: int) -> int:
    """``head_groups``, checked to divide the ``kv_heads`` heads of a layer into equal groups."""
    if kv_heads % head_groups:
        raise InvalidParameterError(
            f"head_groups={head_groups} must divide the layer's {kv_heads} KV heads into equal groups"
        )
    return head_groups


def cap_and_redistribute(budgets: torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
    """Clamp ``budgets`` ``[n]`` to ``caps`` and hand what that frees to entries with room, keeping the total."""
    out = torch.minimum(budgets, caps)
    spare = int(budgets.sum() - out.sum())
    while spare > 0:
        room = caps - out
        open_ = room > 0
        if not bool(open_.any()):
            break
        give = largest_remainder(open_.double(), spare)
        give = torch.minimum(give, room)
        if int(give.sum()) == 0:
            break
        out += give
        spare -= int(give.sum())
    return out


@dataclass
class HeadAdaptiveBudget(BudgetAllocator):
    """AdaKV allocation: the KV heads of a layer share the layer's budget by score.

    Per layer and sequence, with ``B' = keep - window`` selected entries per head on average: the top ``H·B'``
    non-window scores over all heads of the layer are pooled; head ``h`` wins ``c_h`` of them.

    * ``rule="official"`` (AdaKV repository, the default: decision 8 (docs/decisions.md)):
      ``b_h = c_h·(1 − α) + α·B'``, rounded so the layer total stays exactly ``H·B'`` (largest remainder) with
      every head at least ``⌊α·B'⌋``.
    * ``rule="kvpress"`` (kvpress AdaKVPress safeguard): each head's own top ``⌊α·keep⌋`` entries, window
      included, are forced into the pool before the global top is taken; ``b_h`` is the count that lands in
      head ``h``.

    Each head then keeps ``b_h`` entries plus the protected window (capped at what the head holds).

    With ``page_size = P > 1`` the counts come in whole pages of ``P`` entries (a paged cache whose pages hold one
    head, e.g. the vLLM plugin's one-head sub-pages): the layer keeps :meth:`layer_pages` pages, shared among its
    heads by largest remainder of ``b_h/P`` (each head at least the pages of its window, at most its row's), and a
    head keeps ``min(pages·P, its entries)``. The layer then holds as many pages as the uniform method's ``keep``
    entries per head would (``⌈H·keep/P⌉`` of them), so heads differ in count at no extra memory; each head's
    count moves by less than one page from ``b_h``.

    With ``head_groups = G > 1`` a layer's KV heads form ``G`` equal groups of consecutive heads, and each group
    shares its own ``(H/G)·keep`` entries (or pages) by score as above: the split a tensor-parallel deployment over
    ``G`` ranks (or a multiple of them) can make, since each rank holds and scores one slice of the heads and holds
    its own memory (the vLLM plugin, ``tensor_parallel_size``). ``G = H`` gives every head the uniform count.

    Args:
        alpha: safeguard fraction α (AdaKV uses 0.2)
        window: the observation window kept on top of the selected entries (scores there do not compete)
        page_size: entries per page (1: counts in entries, the paper's rule)
        head_groups: groups of consecutive KV heads that split their own share (1: the whole layer, the paper's)
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    varies_by = "head"
    runs_in_vllm = True  # layer total fixed (kv_heads · B): one-head sub-pages in vLLM (kvtrim.vllm.subpages)

    alpha: float = 0.2
    window: int = 8
    rule: str = "official"
    page_size: int = 1
    head_groups: int = 1

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) or self.page_size < 1:
            raise InvalidParameterError(f"page_size must be an integer >= 1, got {self.page_size!r}")
        check_head_groups(self.head_groups)

    def layer_pages(self, keep: int, kv_heads: int, length: int) -> int:
        """Most pages of ``page_size`` entries one layer's ``kv_heads`` heads hold together at mean budget ``keep``
        over at most ``length`` entries per head: ``max(⌈h·keep/P⌉, h·⌈window/P⌉)`` for each group of ``h =
        H/head_groups`` heads, ``H·⌈length/P⌉`` when no head is longer than ``keep`` (``length``: every head's
        entries, the first compression)."""
        groups = group_count(kv_heads, self.head_groups)
        return groups * self._pages(keep, kv_heads // groups, length)

    def _pages(self, keep: int, heads: int, length: int) -> int:
        """:meth:`layer_pages` of one group of ``heads`` heads."""
        p = self.page_size
        if length <= keep:
            return heads * -(-length // p)
        return max(-(-heads * keep // p), heads * -(-self.window // p))

    def _whole_pages(self, counts: torch.Tensor, lengths: torch.Tensor, keep: int, window: int) -> torch.Tensor:
        """``counts`` ``[heads]`` (window included) moved to whole pages: :meth:`layer_pages` pages shared by
        largest remainder of ``counts/P``, each head between its window's pages and its row's."""
        p, heads = self.page_size, counts.numel()
        cap = -(-lengths // p)
        floor = torch.minimum(torch.full_like(cap, -(-window // p)), cap)
        total = min(self._pages(keep, heads, int(lengths.max())), int(cap.sum()))
        want = counts.double() / p
        pages = torch.maximum(torch.minimum(want.floor().long(), cap), floor)
        while int(pages.sum()) > total:  # floors and caps overshot: take from the heads furthest above their want
            over = (pages - want).masked_fill(pages <= floor, float("-inf"))
            pages[int(over.argmax())] -= 1
        while int(pages.sum()) < total:  # then the pages left, largest remainder first
            short = (want - pages).masked_fill(pages >= cap, float("-inf"))
            pages[int(short.argmax())] += 1
        return torch.minimum(pages * p, lengths)

    def head_budgets(self, scores: torch.Tensor, positions: torch.Tensor, keep: int, context: int) -> torch.Tensor:
        """Budgets ``[kv_heads]`` (window included) for one layer of one sequence.

        Args:
            scores, positions: ``[kv_heads, seq]`` (empty slots at ``-inf`` / ``-1``)
        """
        groups = group_count(scores.shape[0], self.head_groups)
        if groups == 1:
            return self._group_budgets(scores, positions, keep, context)
        parts = zip(scores.chunk(groups), positions.chunk(groups), strict=True)
        return torch.cat([self._group_budgets(s, p, keep, context) for s, p in parts])

    def _group_budgets(self, scores: torch.Tensor, positions: torch.Tensor, keep: int, context: int) -> torch.Tensor:
        """:meth:`head_budgets` for one group of heads, ``[heads, seq]``, sharing ``heads · keep`` entries."""
        heads = scores.shape[0]
        window = min(self.window, context)
        per_head = keep - window
        if per_head <= 0:
            return torch.full((heads,), keep, dtype=torch.long, device=scores.device)
        candidate = (positions >= 0) & (positions < context - window)
        available = candidate.sum(-1)  # non-window entries each head holds
        cand = scores.masked_fill(~candidate, float("-inf"))
        floor_n = int(self.alpha * per_head)
        total = heads * per_head
        if self.rule == "kvpress":
            # kvpress forces each head's top ⌊α·keep⌋ entries counting the window (scored at the maximum), so
            # only what the window leaves of that safeguard protects selected entries.
            floor_n = max(0, int(self.alpha * keep) - window)
        if self.rule == "kvpress" and floor_n > 0:
            top_own = cand.topk(min(floor_n, cand.shape[-1]), dim=-1).indices
            cand = cand.scatter(-1, top_own, float("inf")).masked_fill(~candidate, float("-inf"))
        flat = cand.flatten()
        k = min(total, int(candidate.sum()))
        winners = flat.topk(k).indices // cand.shape[-1]
        counts = torch.bincount(winners, minlength=heads)
        if self.rule == "official":
            weights = counts.double() * (1 - self.alpha)
            floor = torch.full((heads,), floor_n, dtype=torch.long, device=scores.device)
            counts = largest_remainder(weights, total, torch.minimum(floor, available))
        counts = cap_and_redistribute(counts, available) + window
        if self.page_size > 1:
            counts = self._whole_pages(counts, (positions >= 0).sum(-1), keep, window)
        return counts

    def allocate(self, request: BudgetRequest, scores: list[torch.Tensor]) -> torch.Tensor:
        if request.positions is None:
            raise ValueError("HeadAdaptiveBudget needs slot positions in the budget request")
        out = torch.zeros(
            len(request.keep), request.num_layers, request.kv_heads, dtype=torch.long, device=request.keep.device
        )
        for layer, (s, pos) in enumerate(zip(scores, request.positions, strict=True)):
            for row, (keep, context) in enumerate(
                zip(request.keep.tolist(), request.context_lengths.tolist(), strict=True)
            ):
                out[row, layer] = self.head_budgets(s[row], pos[row], keep, context)
        return out
