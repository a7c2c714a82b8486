"""Block-granular, variable-rate eviction across all layers and KV heads of a sequence (KV-Compress).

KV-Compress (Rehg, arXiv 2410.00161; decision 6 (docs/decisions.md)):

* per (layer, KV head), sort the entries by metric ascending and cut the sorted list into chunks of
  ``block_size``; the *block metric* of chunk ``k`` (0-based) is the metric of the ``(k·bs + hanging − 1)``-th
  smallest entry, ``hanging`` being the fill of the head's last, partial block. Evicting ``k + 1`` chunks of a head
  removes ``k·bs + hanging`` entries and frees exactly ``k + 1`` blocks;
* rank the chunks of every layer and head of the sequence together and evict the lowest ones, never a chunk whose
  block metric is +inf (protected window, empty slots);
* MoveCache: move surviving tail entries into the evicted slots (two pointers), so each head stays contiguous, and
  free the trailing blocks.

:func:`block_eviction_counts` is the one ranking implementation; the paged cache (:func:`schedule_evictions`) and
the pipeline budget (:class:`kvtrim.budgets.global_blocks.GlobalBlockBudget`) both call it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..cache.block_pool import EMPTY
from ..errors import InvalidParameterError
from ..scoring.squared_attention import squared_attention

if TYPE_CHECKING:
    from ..cache.paged import PagedBatchCache, PagedSequence


def _nonneg_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidParameterError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def hanging_entries(lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[rows]`` entries in each row's last block (``block_size`` when full, 0 for an empty row)."""
    return torch.where(lengths > 0, lengths - (-(-lengths // block_size) - 1) * block_size, 0)


def evicted_entries(blocks: torch.Tensor, lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[rows]`` entries removed when ``blocks`` chunks are evicted per row: ``(blocks − 1)·bs + hanging``."""
    hanging = hanging_entries(lengths, block_size)
    return torch.where(blocks > 0, (blocks - 1) * block_size + hanging, 0)


def block_eviction_counts(
    sorted_metric: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    blocks_to_evict: int | torch.Tensor,
    groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """How many blocks to evict from each row, ranking chunks of all rows of a group together.

    Args:
        sorted_metric: ``[rows, seq]`` each row's entry metrics sorted ascending (entries beyond the row's length
            and protected entries are +inf)
        lengths: ``[rows]`` entries per row
        blocks_to_evict: the number of lowest-ranked chunks to evict over all rows of each group (fewer if +inf is
            reached): an int for one group, or ``[groups]``
        groups: ``[rows]`` group (sequence) of each row, ``0..G-1`` (None: every row in group 0). Groups are
            ranked independently in the same few tensor ops, so a batch of sequences needs no Python loop.
    Returns:
        ``[rows]`` blocks evicted per row (a prefix of each row's chunks)
    """
    rows, seq = sorted_metric.shape
    device = sorted_metric.device
    lengths = lengths.to(device).long()
    counts = torch.zeros(rows, dtype=torch.long, device=device)
    budget = torch.as_tensor(blocks_to_evict, dtype=torch.long, device=device).reshape(-1)
    if rows == 0 or seq == 0 or not bool((budget > 0).any()):
        return counts
    if groups is None:
        groups = torch.zeros(rows, dtype=torch.long, device=device)
    groups = groups.to(device).long()
    nblocks = -(-lengths // block_size)
    hanging = hanging_entries(lengths, block_size)
    width = -(-seq // block_size)  # static: no host read of the widest row
    k = torch.arange(width, device=device)
    index = (k[None, :] * block_size + hanging[:, None] - 1).clamp(0, seq - 1)
    chunk = torch.gather(sorted_metric.float(), 1, index)
    chunk = chunk.masked_fill(k[None, :] >= nblocks[:, None], float("inf")).reshape(-1)
    group = groups.repeat_interleave(width)
    # Order by group, then block metric, then chunk number (so a head's evicted chunks are always a prefix of its
    # chunks): stable sorts from the least to the most significant key.
    order = torch.argsort(k.repeat(rows), stable=True)
    order = order[torch.argsort(chunk[order], stable=True)]
    order = order[torch.argsort(group[order], stable=True)]
    sorted_group = group[order]
    per_group = torch.bincount(group, minlength=budget.numel())
    first = torch.cumsum(per_group, 0) - per_group
    rank = torch.arange(order.numel(), device=device) - first[sorted_group]
    take = (rank < budget[sorted_group]) & torch.isfinite(chunk[order])
    counts.scatter_add_(0, order // width, take.long())
    return counts


@dataclass
class EvictionPlan:
    """What :func:`schedule_evictions` decided for one sequence.

    Attributes:
        evicted: per row (``layer * kv_heads + head``) the evicted logical slot indices, ascending
        blocks: ``[rows]`` blocks freed per row
    """

    evicted: list[torch.Tensor]
    blocks: torch.Tensor

    @property
    def total_blocks(self) -> int:
        return int(self.blocks.sum())

    @property
    def total_entries(self) -> int:
        return sum(len(e) for e in self.evicted)


def protected_metric(
    metric: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, seen: int, protected_window: int
) -> torch.Tensor:
    """``metric`` with the last ``protected_window`` positions (``> seen − 1 − window``) and empty slots at +inf."""
    shielded = ~valid | (positions > seen - 1 - protected_window)
    return metric.float().masked_fill(shielded, float("inf"))


def schedule_evictions(sequence: PagedSequence, *, blocks_to_evict: int, protected_window: int) -> EvictionPlan:
    """Choose the ``blocks_to_evict`` lowest-ranked blocks of ``sequence`` over all its layers and KV heads.

    Never evicts an entry of the protected window; fewer blocks are evicted if not enough are evictable.
    """
    _nonneg_int("blocks_to_evict", blocks_to_evict)
    _nonneg_int("protected_window", protected_window)
    pool = sequence.pool
    slot, valid = sequence.slots()
    lengths = sequence.row_lengths().to(slot.device)
    metric = protected_metric(
        pool.metric.view(-1)[slot], pool.positions.view(-1)[slot], valid, sequence.seen, protected_window
    )
    sorted_metric, order = metric.sort(dim=1, stable=True)
    blocks = block_eviction_counts(sorted_metric, lengths, pool.block_size, blocks_to_evict)
    n_evict = evicted_entries(blocks, lengths, pool.block_size)
    # The n lowest-ranked slots of each row, back in logical order: one scatter and one split, no per-row sort.
    ranked = torch.arange(order.shape[1], device=order.device)[None, :] < n_evict[:, None]
    gone = torch.zeros_like(ranked).scatter_(1, order, ranked)
    evicted = list(torch.nonzero(gone)[:, 1].split(n_evict.tolist()))
    return EvictionPlan(evicted=evicted, blocks=blocks.cpu())


def apply_evictions(sequence: PagedSequence, plan: EvictionPlan) -> int:
    """MoveCache: compact every row after evicting ``plan``'s entries; returns the number of blocks freed.

    Per row, surviving entries at the tail move into the evicted slots (the last survivor into the earliest hole),
    carrying key, value, position and metric; the row becomes contiguous and its now-empty trailing blocks are
    freed to the pool at once. Order inside a row is not preserved (rotary is already in the keys).
    """
    if len(plan.evicted) != sequence.num_rows:
        raise InvalidParameterError(f"the plan has {len(plan.evicted)} rows, the sequence {sequence.num_rows}")
    pool = sequence.pool
    slot, valid = sequence.slots()
    rows, width = slot.shape
    lengths = sequence.row_lengths().to(slot.device)
    counts = torch.tensor([len(g) for g in plan.evicted], dtype=torch.long, device=slot.device)
    gone = torch.zeros(rows, width, dtype=torch.bool, device=slot.device)
    if int(counts.sum()):
        flat = torch.cat([g.to(slot.device).long() for g in plan.evicted])
        row_of = torch.repeat_interleave(torch.arange(rows, device=slot.device), counts)
        if int(flat.min()) < 0 or bool((flat >= lengths[row_of]).any()):
            raise InvalidParameterError("evicted slots must lie in [0, row length) of their row")
        gone.view(-1).index_fill_(0, row_of * width + flat, True)
        if bool((gone.sum(1) != counts).any()):
            raise InvalidParameterError("evicted slots must be distinct within each row")
    new_lengths = move_cache(sequence.pool, slot, valid, lengths, gone)
    dropped = sequence.shrink_rows(new_lengths)  # one length update; only the tables' tails are read
    pool.free(dropped)
    return len(dropped)


def move_cache(
    pool, slot: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor, gone: torch.Tensor
) -> torch.Tensor:
    """MoveCache over any number of rows (of one or many sequences) at once; returns ``[rows]`` new lengths.

    Args:
        slot: ``[rows, width]`` flat pool slot of each logical slot; valid: ``[rows, width]`` within the length
        lengths: ``[rows]``; gone: ``[rows, width]`` evicted logical slots (within the lengths)
    Surviving entries beyond a row's new length move into its evicted slots below it (the last survivor into the
    earliest hole), carrying key, value, position and metric; vacated slots are emptied. Block tables are not
    touched (the caller shrinks them).
    """
    width = slot.shape[1]
    new_lengths = lengths - gone.sum(1)
    idx = torch.arange(width, device=slot.device)[None, :]
    holes = gone & (idx < new_lengths[:, None])  # evicted slots inside the new length, filled in ascending order
    movers = ~gone & valid & (idx >= new_lengths[:, None])  # survivors beyond it, moved last one first
    # Pair the k-th hole of a row with its k-th mover from the end (the two counts are equal per row).
    hole_rank = holes.long().cumsum(1) - 1
    mover_rank = movers.long().flip(1).cumsum(1).flip(1) - 1
    h_row, h_col = torch.nonzero(holes, as_tuple=True)
    m_row, m_col = torch.nonzero(movers, as_tuple=True)
    h_order = torch.argsort(h_row * width + hole_rank[h_row, h_col])
    m_order = torch.argsort(m_row * width + mover_rank[m_row, m_col])
    d = slot[h_row, h_col][h_order]
    s_ = slot[m_row, m_col][m_order]
    pool.move(d, s_)
    vacated = slot[valid & (idx >= new_lengths[:, None])]
    pool.positions.view(-1).index_fill_(0, vacated, EMPTY)  # no Python number through an index (host→device)
    pool.metric.view(-1).index_fill_(0, vacated, 0.0)
    return new_lengths


def budget_blocks(max_cache_tokens, num_rows: int, block_size: int):
    """Blocks a sequence may hold for a per-head average of ``max_cache_tokens``: ``⌈M·L·H / bs⌉``."""
    return -(-max_cache_tokens * num_rows // block_size)


def blocks_over_budget(sequence: PagedSequence, *, max_cache_tokens: int) -> int:
    """Blocks held beyond ``⌈M·L·H/bs⌉`` for a per-head average budget ``M = max_cache_tokens``.

    0 when within that, or when no head holds more than ``M`` entries (nothing to compress).
    """
    if isinstance(max_cache_tokens, bool) or not isinstance(max_cache_tokens, int) or max_cache_tokens <= 0:
        raise InvalidParameterError(f"max_cache_tokens must be a positive integer, got {max_cache_tokens!r}")
    if int(sequence.row_lengths().max()) <= max_cache_tokens:
        return 0  # every head is within the budget: block rounding alone never evicts
    allowed = budget_blocks(max_cache_tokens, sequence.num_rows, sequence.block_size)
    return max(0, sequence.blocks_held() - allowed)


def compress_sequence(sequence: PagedSequence, *, max_cache_tokens: int, protected_window: int) -> int:
    """Evict down to the budget (as far as the protected window allows); returns the blocks freed."""
    if isinstance(max_cache_tokens, bool) or not isinstance(max_cache_tokens, int) or max_cache_tokens <= 0:
        raise InvalidParameterError(f"max_cache_tokens must be a positive integer, got {max_cache_tokens!r}")
    return compress_sequences([sequence], max_cache_tokens=[max_cache_tokens], protected_window=protected_window)[0]


def sequences_over_budget(
    sequences: list[PagedSequence], max_cache_tokens: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host bookkeeping only (no device read, no device tensor): which of ``sequences`` (one store) hold blocks
    beyond their budget. Returns host long tensors ``(chosen [m] indices into sequences, slots [m], over [m] blocks
    beyond the budget, nblocks [m, rows] block counts, seen [m])``."""
    store, bs = sequences[0].store, sequences[0].pool.block_size
    slots = torch.tensor([s.slot for s in sequences], dtype=torch.long)
    budget = torch.tensor(max_cache_tokens, dtype=torch.long)
    host_len, host_nb = store.host_length[slots], store.host_nblocks[slots]
    over = (host_nb.sum(1) - budget_blocks(budget, store.rows, bs)).clamp(min=0)
    over = over.masked_fill(host_len.amax(1) <= budget, 0)  # every head within M: block rounding never evicts
    chosen = torch.nonzero(over > 0).flatten()
    seen = torch.tensor([sequences[i].seen for i in chosen.tolist()], dtype=torch.long)
    return chosen, slots[chosen], over[chosen], host_nb[chosen], seen


def upload_eviction_inputs(
    device: torch.device, slots: torch.Tensor, seen: torch.Tensor, over: torch.Tensor, nblocks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The host inputs of a batched eviction on ``device`` in one copy: ``slots``, ``seen``, ``over`` (``[m]`` host
    long each) and ``nblocks`` (``[m, rows]`` host long, the rows' block counts). Everything after this call works on
    the device copies (no other host→device copy in the eviction)."""
    m = slots.shape[0]
    flat = torch.cat([slots, seen, over, nblocks.reshape(-1)]).to(device)
    dev_slots, dev_seen, dev_over, dev_nb = flat.split([m, m, m, nblocks.numel()])
    return dev_slots, dev_seen, dev_over, dev_nb.view(nblocks.shape)


def compress_sequences(
    sequences: list[PagedSequence], *, max_cache_tokens: list[int], protected_window: int
) -> list[int]:
    """Evict every sequence down to its own budget in one batch; returns the blocks freed per sequence.

    The same result as :func:`compress_sequence` on each sequence, computed for all of them together: one gather
    of every (sequence, layer, KV head) row through the shared block tables, one sort, one grouped block ranking
    (each sequence ranks its own chunks, :func:`block_eviction_counts` with ``groups``), one MoveCache and one
    block-table shrink. No Python loop over sequences, rows or blocks.

    Args:
        sequences: paged sequences of one pool with the same number of rows
        max_cache_tokens: per sequence, its per-head average budget ``M`` (positive)
    """
    _nonneg_int("protected_window", protected_window)
    if len(max_cache_tokens) != len(sequences):
        raise InvalidParameterError(
            f"max_cache_tokens has {len(max_cache_tokens)} entries for {len(sequences)} sequences"
        )
    for m in max_cache_tokens:
        if isinstance(m, bool) or not isinstance(m, int) or m <= 0:
            raise InvalidParameterError(f"max_cache_tokens must hold positive integers, got {m!r}")
    if not sequences:
        return []
    store, pool = sequences[0].store, sequences[0].pool
    if any(s.store is not store for s in sequences):
        raise InvalidParameterError("sequences must share one pool and the same number of layers and KV heads")
    rows, bs = store.rows, pool.block_size
    freed = [0] * len(sequences)
    chosen, slots, over, host_nb, seen = sequences_over_budget(sequences, max_cache_tokens)
    if chosen.numel() == 0:
        return freed
    held = host_nb.sum(1)
    m, width = len(chosen), int(host_nb.max())
    dev_slots, seen, over, dev_nb = upload_eviction_inputs(pool.device, slots, seen, over, host_nb)
    table = store.table[dev_slots, :, :width]  # [m, rows, width]
    slot = (table[..., None] * bs + torch.arange(bs, device=pool.device)).reshape(m * rows, width * bs)
    lengths = store.length[dev_slots].reshape(-1)
    valid = torch.arange(width * bs, device=pool.device)[None, :] < lengths[:, None]
    positions = pool.positions.view(-1)[slot]
    shielded = ~valid | (positions > (seen - 1 - protected_window).repeat_interleave(rows)[:, None])
    metric = pool.metric.view(-1)[slot].float().masked_fill(shielded, float("inf"))
    sorted_metric, order = metric.sort(dim=1, stable=True)
    groups = torch.arange(m, device=pool.device).repeat_interleave(rows)
    blocks = block_eviction_counts(sorted_metric, lengths, bs, over, groups)
    n_evict = evicted_entries(blocks, lengths, bs)
    ranked = torch.arange(order.shape[1], device=pool.device)[None, :] < n_evict[:, None]
    gone = torch.zeros_like(ranked).scatter_(1, order, ranked)
    new_lengths = move_cache(pool, slot, valid, lengths, gone)
    dropped = store.shrink(slots, new_lengths.view(m, rows), device_slots=dev_slots, device_nblocks=dev_nb)
    pool.free(dropped)
    for i, n in zip(chosen.tolist(), (held - store.host_nblocks[slots].sum(1)).tolist(), strict=True):
        freed[i] = n
    return freed


def prefill_metric(
    cache: PagedBatchCache,
    *,
    window: int | None = None,
    kernel: int = 7,
    buffer: int = 0,
    chunk: int = 512,
) -> None:
    """Add to ``pool.metric`` of the sequences just prefilled through ``cache`` the metric of the recorded queries.

    KVC-w: squared attention of the last ``window`` prompt queries, max-pooled per query head (``kernel`` 7),
    summed over each query group. KVC-full: record every prompt query (``observe_window`` >= the prompt length),
    ``buffer=10`` (keys within 10 positions of a query excluded), ``kernel=1`` (no pooling).

    A whole prompt in one forward gets exactly the paper's prefill metric (fresh entries start at 0). A chunked
    prefill calls this after every chunk: each chunk's window adds its squared attention over every entry then
    stored, as decode queries do in the paper's continual metric. Pooling runs over each head's entries in position
    order (after MoveCache the slots are not in order).

    Args:
        cache: the cache of the prefill forward, built with ``observe_window > 0``
        window: queries to use (default: all recorded)
    """
    if cache.observe_window <= 0:
        raise InvalidParameterError("prefill_metric needs a PagedBatchCache built with observe_window > 0")
    if kernel < 1 or kernel % 2 == 0:
        raise InvalidParameterError(f"kernel must be an odd integer >= 1, got {kernel}")
    if window is not None and window <= 0:
        raise InvalidParameterError(f"window must be positive or None, got {window}")
    pool = cache.pool
    scaling = cache.scaling if cache.scaling is not None else cache.head_dim**-0.5
    flat_pos = pool.positions.view(-1)
    seqs = cache.sequences
    store, bs, device = seqs[0].store, pool.block_size, pool.device
    k, layers, heads = len(seqs), cache.num_layers, cache.kv_heads
    host_slots = torch.tensor([s.slot for s in seqs], dtype=torch.long)
    width = max(1, int(store.host_nblocks[host_slots].max()))
    dev_slots = host_slots.to(device)
    # Every (sequence, layer, head)'s entries through the shared tables, in position order (empty slots last):
    # one gather and one sort for the whole batch; the identity order for fresh, in-order sequences.
    table = store.table[dev_slots, :, :width]  # [k, rows, width]
    slot = (table[..., None] * bs + torch.arange(bs, device=device)).reshape(k, layers * heads, width * bs)
    valid = torch.arange(width * bs, device=device) < store.length[dev_slots][..., None]
    order = flat_pos[slot].masked_fill(~valid, torch.iinfo(torch.long).max).argsort(dim=2, stable=True)
    slot = slot.gather(2, order).view(k, layers, heads, -1)
    valid = valid.gather(2, order).view(k, layers, heads, -1)
    for layer in range(layers):  # one batched metric per layer, as the model runs its layers
        obs = cache.observations[layer]
        if obs is None:
            raise RuntimeError(f"layer {layer}: no prefill queries were recorded")
        queries, qpos = obs  # [k, q_heads, w, d], [k, w] (-1: a padding query of a packed prefill)
        w = queries.shape[2] if window is None else min(window, queries.shape[2])
        s, ok = slot[:, layer], valid[:, layer]  # [k, H, S]
        kpos = flat_pos[s].masked_fill(~ok, EMPTY)
        keys = pool.read_keys(s)  # what attention sees (dequantized from a quantized pool)
        metric = squared_attention(
            queries[:, :, -w:], qpos[:, -w:], keys, kpos, scaling, buffer=buffer, kernel=kernel, chunk=chunk
        )
        # Slots beyond a row's length add exactly 0 (no boolean indexing, so no host read of its size).
        pool.metric.view(-1).index_add_(0, s.reshape(-1), torch.where(ok, metric, 0.0).reshape(-1))
