"""Ragged per-head KV storage: every (sequence, KV head) row holds its own number of entries.

All rows of a layer share two flat buffers ``[slots, head_dim]`` (keys, values) plus a flat position vector;
row ``r = b * kv_heads + h`` owns ``capacity[r]`` consecutive slots starting at ``start[r]``, of which the first
``length[r]`` are filled. After compaction there is no slack at all; decoding appends into per-row slack that
grows geometrically (≥ 1/8 of the row, at least 16 slots), so a step writes only the new token unless a row is
full, and a regrowth copies the layer once. Only real tokens are stored (padding is skipped).
"""

from __future__ import annotations

import torch

from .dense import INVALID, DenseStore


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
        start, length, capacity: ``[batch * kv_heads]`` slot bookkeeping per row
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
        self._row_max: list[int] | None = None  # latest position per row, cached for the decoding fast path

    def row_max_positions(self) -> list[int]:
        """The largest stored position of every row (``-1`` for an empty row)."""
        if self._row_max is None:
            rows = torch.repeat_interleave(torch.arange(len(self.length), device=self._pos.device), self.length)
            out = torch.full((len(self.length),), -1, dtype=torch.long, device=self._pos.device)
            out.scatter_reduce_(0, rows, self._pos[_ranges(self.start, self.length)], reduce="amax")
            self._row_max = out.tolist()
        return self._row_max

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

    def mark(self) -> torch.Tensor:
        return self.length.clone()

    @property
    def is_empty(self) -> bool:
        return int(self.length.sum()) == 0

    # ------------------------------------------------------------------ growth and appends
    def _repack(self, row_order: torch.Tensor, new_capacity: torch.Tensor) -> None:
        """Move rows (in ``row_order``) into fresh buffers with ``new_capacity`` slots each."""
        lengths = self.length[row_order]
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
        self._row_max = None

    def append(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        """Append new tokens; padding (position ``-1``) is not stored.

        Args:
            keys, values: ``[batch, kv_heads, q, head_dim]``
            positions: ``[batch, q]``
        """
        b, h, q, _ = keys.shape
        valid = positions >= 0
        new_per_row = valid.sum(1).repeat_interleave(h)  # [b * h]
        need = self.length + new_per_row
        if bool((need > self.capacity).any()):
            grown = torch.maximum(need, self.capacity + torch.clamp(self.capacity // 8, min=16))
            self._repack(
                torch.arange(b * h, device=keys.device), torch.where(need > self.capacity, grown, self.capacity)
            )
        mask = valid[:, None, :].expand(b, h, q)
        rank = (valid.long().cumsum(1) - 1)[:, None, :].expand(b, h, q)
        dest = ((self.start + self.length).view(b, h, 1) + rank)[mask]
        self._k[dest] = keys[mask]
        self._v[dest] = values[mask]
        self._pos[dest] = positions[:, None, :].expand(b, h, q)[mask]
        for s in self._stats.values():
            s[dest] = 0
        self.length = need
        if self._row_max is not None:
            newest = positions.amax(1).repeat_interleave(h).tolist()
            self._row_max = [max(a, c) for a, c in zip(self._row_max, newest, strict=True)]

    def truncate_to(self, mark: torch.Tensor) -> None:
        """Drop entries appended after ``mark`` (from :meth:`mark`)."""
        if bool((mark > self.length).any()):
            raise ValueError("cannot truncate a ragged store to a longer mark")
        self.length = mark.clone()
        self._row_max = None

    def select_batch(self, index: torch.Tensor) -> None:
        """Reorder or select sequences (beam search, ``num_return_sequences``)."""
        h = self.kv_heads
        rows = (index.view(-1, 1) * h + torch.arange(h, device=index.device)).reshape(-1)
        self._repack(rows, self.length[rows].clone())
        self.batch_size = len(index)

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
        """Attention of ``query`` ``[batch, q_heads, q, head_dim]`` over each row's entries, row by row on views
        of the flat buffers (nothing is copied). Returns ``[batch, q, q_heads, head_dim]``."""
        b, hq, tq, d = query.shape
        group = hq // self.kv_heads
        dv = self._v.shape[-1]  # may differ from the query's head_dim (channel-pruned keys)
        out = query.new_zeros(b, hq, tq, dv)
        starts, lengths = self.start.tolist(), self.length.tolist()
        row_max = self.row_max_positions() if tq == 1 else None
        for bi in range(b):
            qpos = query_positions[bi]
            for h in range(self.kv_heads):
                r = bi * self.kv_heads + h
                s, n = starts[r], lengths[r]
                if n == 0:
                    continue
                k, v = self._k[s : s + n], self._v[s : s + n]
                q = query[bi, h * group : (h + 1) * group].reshape(group * tq, d)
                # Plain mm/softmax/mm: on these small per-row problems it is several times cheaper than an SDPA
                # call (measured on CPU), and it needs no copy of the row.
                logits = torch.mm(q, k.t()).mul_(scaling)
                if not (tq == 1 and int(qpos[0]) >= row_max[r]):  # decoding sees every (past) entry unmasked
                    vis = (self._pos[s : s + n][None, :] <= qpos[:, None]) & (qpos[:, None] >= 0)  # [tq, n]
                    vis = vis.repeat(group, 1)
                    logits = logits.masked_fill_(~vis, float("-inf"))
                weights = torch.softmax(logits, dim=-1, dtype=torch.float32).nan_to_num_(0.0).to(v.dtype)
                o = torch.mm(weights, v)
                out[bi, h * group : (h + 1) * group] = o.view(group, tq, dv)
        return out.transpose(1, 2)
