"""Ragged per-head KV storage: every (sequence, KV head) row holds its own number of entries.

All rows of a layer share two flat buffers ``[slots, head_dim]`` (keys, values) plus a flat position vector;
row ``r = b * kv_heads + h`` owns ``capacity[r]`` consecutive slots starting at ``start[r]``, of which the first
``length[r]`` are filled. After compaction there is no slack at all; decoding appends into per-row slack that
grows geometrically (≥ 1/8 of the row, at least 16 slots), so a step writes only the new token unless a row is
full, and a regrowth copies the layer once. Only real tokens are stored (padding is skipped).

Attention is one batched call per layer (:mod:`kvtrim.cache.packed_attention`), and appending or attending reads
nothing back from the device: the host keeps a lower bound on every row's free slots.
"""

from __future__ import annotations

import torch

from .dense import INVALID, DenseStore
from .packed_attention import (
    attend_padded,
    flash_varlen_attention,
    flash_varlen_available,
    gather_index,
    gather_rows,
    ragged_mask,
)
from .ragged_paged import BLOCK, decode_kernel_for, ragged_paged_attention


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenated ``arange(start, start + length)`` for every row (vectorized)."""
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=starts.device)
    row_of = torch.repeat_interleave(torch.arange(len(lengths), device=starts.device), lengths)
    offsets = torch.arange(total, device=starts.device) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    return starts[row_of] + offsets


class RaggedStore:
    """KV entries of one layer with a per-(sequence, KV head) length.

    Attributes:
        start, length, capacity: ``[batch * kv_heads]`` slot bookkeeping per row (on the device)

    Host-side bookkeeping, exact after construction and repacks and advanced without reading the device while
    decoding: ``_slack_min`` (a lower bound on the free slots of every row), ``_width`` (the largest row capacity)
    ``_max_len`` (an upper bound on the longest row) and ``_index`` (``[rows, _width]`` flat slot of every padded
    column, for the batched attention).
    """

    layout = "ragged"

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        start: torch.Tensor,
        length: torch.Tensor,
        capacity: torch.Tensor,
        batch: int,
        kv_heads: int,
    ):
        self._k, self._v, self._pos = keys, values, positions
        self.start, self.length, self.capacity = start, length, capacity
        self.batch_size, self.kv_heads = batch, kv_heads
        self._stats: dict[str, torch.Tensor] = {}
        self._block: int | None = None  # rows start on multiples of this (a block-table kernel reads them)
        self._sync_layout()

    def _sync_layout(self) -> None:
        """Refresh the host-side bookkeeping from the device (construction and repacks only)."""
        rows = len(self.capacity)
        self._slack_min = int((self.capacity - self.length).min()) if rows else 0
        self._width = int(self.capacity.max()) if rows else 0
        self._max_len = int(self.length.max()) if rows else 0  # an upper bound between repacks
        self._min_len = int(self.length.min()) if rows else 0  # a lower bound: appends only add, truncation resets
        self._index = gather_index(self.start, self._width, self._k.shape[0])

    def row_max_positions(self) -> torch.Tensor:
        """``[batch * kv_heads]`` the largest stored position of every row (``-1`` for an empty row)."""
        rows = torch.repeat_interleave(torch.arange(len(self.length), device=self._pos.device), self.length)
        out = torch.full((len(self.length),), -1, dtype=torch.long, device=self._pos.device)
        return out.scatter_reduce_(0, rows, self._pos[_ranges(self.start, self.length)], reduce="amax")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_selection(cls, dense: DenseStore, indices: torch.Tensor, keep_mask: torch.Tensor) -> RaggedStore:
        """Build from a dense store and a selection (``indices``/``keep_mask`` ``[batch, kv_heads, k]``)."""
        b, h, s, d = dense.keys.shape
        rows = torch.arange(b * h, device=indices.device).view(b, h, 1)
        src = (rows * s + indices)[keep_mask]  # row-major: rows consecutive, ascending slots within a row
        keys = dense.keys.reshape(b * h * s, d).index_select(0, src)
        values = dense.values.reshape(b * h * s, -1).index_select(0, src)
        positions = dense.positions.reshape(-1).index_select(0, src)
        length = keep_mask.sum(-1).reshape(-1)
        store = cls(keys, values, positions, length.cumsum(0) - length, length, length.clone(), b, h)
        for name, stat in dense._stats.items():
            store._stats[name] = stat[:, :, : dense.length].reshape(-1).index_select(0, src)
        return store

    def latest_positions(self) -> torch.Tensor:
        """``[batch]`` the largest stored position per sequence over its heads (``-1`` where nothing is stored)."""
        return self.row_max_positions().view(self.batch_size, self.kv_heads).amax(dim=1)

    def mark(self) -> torch.Tensor:
        return self.length.clone()

    def drop_last(self, n: int) -> None:
        self.truncate_to((self.mark() - n).clamp(min=0))

    @property
    def is_empty(self) -> bool:
        return int(self.length.sum()) == 0

    causal_prefill_ready = False  # rows of different lengths: attention always goes through the row masks
    rescorable = True

    # ------------------------------------------------------------------ growth and appends
    def _repack(self, row_order: torch.Tensor, new_capacity: torch.Tensor) -> None:
        """Move rows (in ``row_order``) into fresh buffers with ``new_capacity`` slots each."""
        lengths = self.length[row_order]
        if self._block is not None:  # keep every row on a block boundary
            new_capacity = (new_capacity + self._block - 1) // self._block * self._block
        new_start = new_capacity.cumsum(0) - new_capacity
        src = _ranges(self.start[row_order], lengths)
        dst = _ranges(new_start, lengths)
        total = int(new_capacity.sum())

        def move(t: torch.Tensor, fill=0) -> torch.Tensor:
            out = torch.full((total, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
            out[dst] = t[src]
            return out

        self._k = move(self._k)
        self._v = move(self._v)
        self._pos = move(self._pos, INVALID)
        self._stats = {n: move(s) for n, s in self._stats.items()}
        self.start, self.length, self.capacity = new_start, lengths.clone(), new_capacity.clone()
        self._sync_layout()

    def _align_rows(self) -> None:
        """Start every row on a multiple of :data:`~kvtrim.cache.ragged_paged.BLOCK` slots (one repack, the first
        time a block-table kernel reads this store; later repacks keep the alignment)."""
        if self._block is None:
            self._block = BLOCK
            self._repack(torch.arange(len(self.length), device=self.length.device), self.capacity)

    def _make_room(self, q: int) -> None:
        """Give every row at least ``q`` free slots: rows with less grow geometrically (≥ 1/8 of the row, at least
        16 slots), in one repack. Reads the device; runs once every ≥ 16 appends at most."""
        need = self.length + q
        grown = need + torch.clamp(need // 8, min=16)
        rows = torch.arange(len(self.length), device=self.length.device)
        # Rows left as they are keep ≥ 16 free slots, so the next repack is ≥ 16 appends away.
        self._repack(rows, torch.where(need + 16 > self.capacity, grown, self.capacity))

    def append(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, padded: bool | None = None
    ) -> None:
        """Append new tokens; padding (position ``-1``) is not stored.

        Args:
            keys, values: ``[batch, kv_heads, q, head_dim]``
            positions: ``[batch, q]``
            padded: accepted for symmetry with :meth:`DenseStore.append` (padding is handled on the device)
        """
        b, h, q, d = keys.shape
        if q > self._slack_min:
            self._make_room(q)
        self._slack_min -= q  # every row gets at most q entries; the bounds hold without reading the device
        self._max_len = min(self._max_len + q, self._width)
        valid = positions >= 0
        if q == 1:
            added = valid.view(b, 1).expand(b, h).reshape(-1)
            dest = self.start + self.length  # a padding token is written past the row's end and never counted
        else:
            # Real tokens go first, in order; padding tokens after them, past the new end (overwritten later).
            v = valid.long()
            count = v.sum(1, keepdim=True)
            rank = torch.where(valid, v.cumsum(1) - 1, count + (1 - v).cumsum(1) - 1)  # [b, q]
            added = count.expand(b, h).reshape(-1)
            dest = ((self.start + self.length).view(b, h, 1) + rank[:, None, :]).view(-1)
        self._k.index_copy_(0, dest, keys.reshape(-1, d))
        self._v.index_copy_(0, dest, values.reshape(-1, values.shape[-1]))  # values keep every channel (ThinK)
        self._pos.index_copy_(0, dest, positions[:, None, :].expand(b, h, q).reshape(-1))
        for s in self._stats.values():
            s.index_fill_(0, dest, 0)
        self.length = self.length + added

    def truncate_to(self, mark: torch.Tensor) -> None:
        """Drop entries appended after ``mark`` (from :meth:`mark`)."""
        if bool((mark > self.length).any()):
            raise ValueError("cannot truncate a ragged store to a longer mark")
        self.length = mark.clone()  # rows only gain free slots: the host-side slack bound still holds
        self._min_len = 0  # unknown without reading the device; only costs the empty-row guard in attention

    def select_batch(self, index: torch.Tensor) -> None:
        """Reorder or select sequences (beam search, ``num_return_sequences``)."""
        h = self.kv_heads
        rows = (index.view(-1, 1) * h + torch.arange(h, device=index.device)).reshape(-1)
        self.batch_size = len(index)
        self._repack(rows, self.length[rows].clone())

    def copy(self) -> RaggedStore:
        out = RaggedStore(
            self._k.clone(),
            self._v.clone(),
            self._pos.clone(),
            self.start.clone(),
            self.length.clone(),
            self.capacity.clone(),
            self.batch_size,
            self.kv_heads,
        )
        out._stats = {n: s.clone() for n, s in self._stats.items()}
        out._block = self._block
        return out

    # ------------------------------------------------------------------ views
    def row(self, b: int, h: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views ``(keys [n, d], values [n, d], positions [n])`` of one row (no copy)."""
        r = b * self.kv_heads + h
        s, n = int(self.start[r]), int(self.length[r])
        return self._k[s : s + n], self._v[s : s + n], self._pos[s : s + n]

    def to_dense(self) -> DenseStore:
        """A padded dense copy (empty slots at position -1), e.g. for scoring."""
        b, h, d = self.batch_size, self.kv_heads, self._k.shape[-1]
        width = int(self.length.max()) if len(self.length) else 0
        keys = self._k.new_zeros(b, h, width, d)
        values = self._v.new_zeros(b, h, width, self._v.shape[-1])
        pos = torch.full((b, h, width), INVALID, dtype=torch.long, device=self._pos.device)
        src = _ranges(self.start, self.length)
        rows = torch.repeat_interleave(torch.arange(b * h, device=src.device), self.length)
        slot = torch.arange(len(src), device=src.device) - torch.repeat_interleave(
            self.length.cumsum(0) - self.length, self.length
        )
        keys.view(b * h, width, d)[rows, slot] = self._k[src]
        values.view(b * h, width, -1)[rows, slot] = self._v[src]
        pos.view(b * h, width)[rows, slot] = self._pos[src]
        dense = DenseStore(keys, values, pos, width)
        for name, stat in self._stats.items():
            full = torch.zeros(b, h, width, dtype=stat.dtype, device=stat.device)
            full.view(b * h, width)[rows, slot] = stat[src]
            dense._stats[name] = full
        return dense

    # ------------------------------------------------------------------ accounting
    def entries(self) -> int:
        return int(self.length.sum())

    def entries_per_head(self) -> torch.Tensor:
        return self.length.view(self.batch_size, self.kv_heads).clone()

    def nbytes(self) -> int:
        """Bytes held by the key and value buffers (kept entries plus append slack)."""
        return self._k.untyped_storage().nbytes() + self._v.untyped_storage().nbytes()

    def index_nbytes(self) -> int:
        meta = sum(t.untyped_storage().nbytes() for t in (self._pos, self.start, self.length, self.capacity))
        return meta + sum(s.untyped_storage().nbytes() for s in self._stats.values())

    # ------------------------------------------------------------------ attention
    def attend(
        self, query: torch.Tensor, query_positions: torch.Tensor, scaling: float, fresh_causal: bool = False
    ) -> torch.Tensor:
        """Attention of ``query`` ``[batch, q_heads, q, head_dim]`` over each row's entries, in one batched call.

        A single decoding query (``q == 1``) is the newest token and sees every stored entry of its rows; a longer
        chunk sees the entries whose position is not after its own. Returns ``[batch, q, q_heads, head_dim]``.
        """
        b, h, tq = self.batch_size, self.kv_heads, query.shape[2]
        if tq == 1 and query.shape[-1] == self._v.shape[-1] == self._k.shape[-1]:
            if flash_varlen_available(query):
                return flash_varlen_attention(query, self._k, self._v, self.start, self.length, self._width, scaling)
            kernel = decode_kernel_for(query, query.shape[-1])
            if kernel is not None:
                self._align_rows()
                return ragged_paged_attention(kernel, query, self._k, self._v, self.start, self.length, self._width,
                                              scaling, may_be_empty=self._min_len == 0)  # fmt: skip
        width = self._max_len  # columns past every row's length are left out of the padded view
        index = self._index[:, :width]
        keys = gather_rows(self._k, index, b, h)
        values = gather_rows(self._v, index, b, h)
        if tq == 1:
            mask = ragged_mask(self.length, width, b, h)
            # Every row holds an entry (known on the host): no query can see nothing, skip the guard.
            return attend_padded(query, keys, values, mask, scaling, may_be_empty=self._min_len == 0)
        kpos = gather_rows(self._pos, index, b, h)
        mask = ragged_mask(self.length, width, b, h, kpos, query_positions)
        return attend_padded(query, keys, values, mask, scaling)
