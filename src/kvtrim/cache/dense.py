"""Dense per-layer KV storage: the same number of slots for every KV head of a layer.

Keys and values live in ``[batch, kv_heads, capacity, head_dim]`` tensors of which the first ``length`` slots are
filled. Every slot carries the logical (rotary) position of its token, or -1 when the slot holds nothing
(padding, or a head that kept fewer entries than the widest head). After compaction the tensors hold exactly
the kept slots; decoding appends into geometric slack so a step never copies the whole layer.
"""

from __future__ import annotations

import torch

from .attention import grouped_attention
from .packed_attention import attend_padded

INVALID = -1


class SlotBookkeeping:
    """The store protocol's bookkeeping shared by the stores that keep one ``[batch, kv_heads, capacity]`` slot
    layout: logical positions ``_pos`` (``-1`` for an empty slot), ``length`` filled slots, per-slot statistics
    ``_stats``. A subclass provides ``batch_size`` and ``truncate``."""

    _pos: torch.Tensor
    _stats: dict[str, torch.Tensor]
    length: int

    @property
    def positions(self) -> torch.Tensor:
        """``[batch, kv_heads, length]`` logical positions, ``-1`` for empty slots."""
        return self._pos[:, :, : self.length]

    def stat(self, name: str) -> torch.Tensor:
        """A per-slot statistic ``[batch, kv_heads, length]``, created as zeros on first use."""
        if name not in self._stats:
            self._stats[name] = torch.zeros(self._pos.shape, dtype=torch.float32, device=self._pos.device)
        return self._stats[name][:, :, : self.length]

    @property
    def is_empty(self) -> bool:
        return self.length == 0

    @property
    def causal_prefill_ready(self) -> bool:
        return self.length == 0

    def latest_positions(self) -> torch.Tensor:
        """``[batch]`` the largest stored position per row (``-1`` while nothing is stored)."""
        if self.length:
            return self.positions.amax(dim=(1, 2))
        return torch.full((self.batch_size,), -1, device=self._pos.device)

    def mark(self) -> int:
        return self.length

    def drop_last(self, n: int) -> None:
        self.truncate_to(self.mark() - n)

    def truncate_to(self, mark: int) -> None:
        self.truncate(mark)

    def entries(self) -> int:
        """Number of filled slots that hold a real token, over batch and heads."""
        return int((self.positions >= 0).sum())

    def entries_per_head(self) -> torch.Tensor:
        """``[batch, kv_heads]`` number of real tokens held per head."""
        return (self.positions >= 0).sum(-1)

    def index_nbytes(self) -> int:
        """Bytes of bookkeeping (positions and slot statistics)."""
        return self._pos.untyped_storage().nbytes() + sum(s.untyped_storage().nbytes() for s in self._stats.values())


class DenseStore(SlotBookkeeping):
    """KV entries of one layer, GQA-native (never repeats KV heads).

    Attributes (views of the filled part):
        keys, values: ``[batch, kv_heads, length, head_dim]``
        positions: ``[batch, kv_heads, length]`` logical positions, ``-1`` for empty slots
        slot_stats: per-slot statistics that follow compaction, each ``[batch, kv_heads, length]``
    """

    layout = "dense"

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, length: int):
        self._k = keys
        self._v = values
        self._pos = positions
        self.length = length
        self._stats: dict[str, torch.Tensor] = {}
        self.all_valid = bool((positions[..., :length] >= 0).all()) if length else True
        # Host flag: every slot holds the token of its own position, in order, with nothing evicted or padded.
        # ``keep`` and ``truncate`` clear it; the caller that appends (kvtrim.integration.cache) clears it for a
        # chunk it cannot verify. A prompt chunk is then the last queries of a plain causal attention over the slots.
        self.prefix_intact = length == 0

    @classmethod
    def empty(cls, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> DenseStore:
        k = torch.empty(batch, kv_heads, 0, head_dim, dtype=dtype, device=device)
        pos = torch.empty(batch, kv_heads, 0, dtype=torch.long, device=device)
        return cls(k, k.clone(), pos, 0)

    # ------------------------------------------------------------------ views
    @property
    def keys(self) -> torch.Tensor:
        return self._k[:, :, : self.length]

    @property
    def values(self) -> torch.Tensor:
        return self._v[:, :, : self.length]

    @property
    def capacity(self) -> int:
        return self._k.shape[2]

    @property
    def batch_size(self) -> int:
        return self._k.shape[0]

    @property
    def kv_heads(self) -> int:
        return self._k.shape[1]

    # ------------------------------------------------------------------ growth
    def _reserve(self, extra: int) -> None:
        needed = self.length + extra
        if needed <= self.capacity:
            return
        new_cap = max(needed, self.capacity + max(self.capacity // 8, 16))
        b, h = self._k.shape[:2]

        def grow(t: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
            # keys and values may differ in head_dim (channel-pruned keys): each keeps its own
            shape = (b, h, new_cap, t.shape[-1]) if t.dim() == 4 else (b, h, new_cap)
            out = torch.full(shape, fill, dtype=t.dtype, device=t.device) if fill else t.new_zeros(shape)
            out[:, :, : self.length] = t[:, :, : self.length]
            return out

        self._k, self._v = grow(self._k), grow(self._v)
        self._pos = grow(self._pos, INVALID)
        self._stats = {n: grow(s) for n, s in self._stats.items()}

    def append(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, padded: bool | None = None
    ) -> None:
        """Append ``q`` new tokens to every head.

        Args:
            keys, values: ``[batch, kv_heads, q, head_dim]``
            positions: ``[batch, q]`` logical positions, ``-1`` for padding tokens
            padded: whether some of the tokens may be padding, when the caller knows it without reading the
                device (False: none is; True: some may be, so attention masks empty slots from now on); None reads
                ``positions`` (a host sync)
        """
        q = keys.shape[2]
        self._reserve(q)
        end = self.length + q
        self._k[:, :, self.length : end] = keys
        self._v[:, :, self.length : end] = values
        self._pos[:, :, self.length : end] = positions[:, None, :]
        for s in self._stats.values():
            s[:, :, self.length : end].zero_()
        self.length = end
        if padded is None:
            padded = self.all_valid and bool((positions < 0).any())
        if padded:
            self.all_valid = False

    # ------------------------------------------------------------------ compaction
    def keep(self, indices: torch.Tensor, keep_mask: torch.Tensor | None = None) -> None:
        """Keep only the slots ``indices`` ``[batch, kv_heads, k]``; reallocate to exactly ``k`` slots.

        ``keep_mask`` ``[batch, kv_heads, k]`` marks selected slots that must nevertheless be emptied (a head
        whose budget is below ``k``); they keep occupying a slot but are never attended to.
        """
        idx = indices.unsqueeze(-1)  # keys and values may differ in head_dim (channel-pruned keys)
        self._k = torch.gather(self.keys, 2, idx.expand(-1, -1, -1, self._k.shape[-1])).contiguous()
        self._v = torch.gather(self.values, 2, idx.expand(-1, -1, -1, self._v.shape[-1])).contiguous()
        pos = torch.gather(self.positions, 2, indices)
        if keep_mask is not None:
            pos = pos.masked_fill(~keep_mask, INVALID)
        self._pos = pos.contiguous()
        self._stats = {n: torch.gather(s[:, :, : self.length], 2, indices).contiguous() for n, s in self._stats.items()}
        self.length = indices.shape[2]
        self.all_valid = bool((self._pos >= 0).all())
        self.prefix_intact = False

    def replace_values(self, values: torch.Tensor) -> None:
        """Overwrite the values of the filled slots with ``values`` ``[batch, kv_heads, length, d]`` (a merging
        method folds evicted values into the kept entries before compaction)."""
        if values.shape != self.values.shape:
            raise ValueError(f"values of shape {tuple(values.shape)} do not fit {tuple(self.values.shape)}")
        self._v[:, :, : self.length] = values

    def replace_keys(self, keys: torch.Tensor, positions: torch.Tensor) -> None:
        """Overwrite the keys and positions of the filled slots (``[batch, kv_heads, length, d]``,
        ``[batch, kv_heads, length]``): key re-rotation moves kept entries to new positions before compaction."""
        if keys.shape != self.keys.shape or positions.shape != self.positions.shape:
            raise ValueError(f"keys {tuple(keys.shape)} / positions {tuple(positions.shape)} do not fit the store")
        self._k[:, :, : self.length] = keys
        self._pos[:, :, : self.length] = positions
        self.prefix_intact = False

    rescorable = True

    def to_dense(self) -> DenseStore:
        return self

    def truncate(self, length: int) -> None:
        """Drop every slot at or after ``length`` (used to remove an answer before the next question)."""
        if length > self.length:
            raise ValueError(f"cannot truncate to {length} slots, store has {self.length}")
        self._pos[:, :, length : self.length].fill_(INVALID)
        self.length = length
        self.all_valid = bool((self.positions >= 0).all())
        self.prefix_intact = False

    def copy(self) -> DenseStore:
        """An independent copy holding exactly the filled slots."""
        out = DenseStore(self.keys.clone(), self.values.clone(), self.positions.clone(), self.length)
        out._stats = {n: s[:, :, : self.length].clone() for n, s in self._stats.items()}
        out.prefix_intact = self.prefix_intact
        return out

    def select_batch(self, index: torch.Tensor) -> None:
        """Reorder or select batch rows (beam search, ``num_return_sequences``)."""
        self._k, self._v, self._pos = self._k[index], self._v[index], self._pos[index]
        self._stats = {n: s[index] for n, s in self._stats.items()}

    # ------------------------------------------------------------------ accounting
    def nbytes(self) -> int:
        """Bytes held by the key and value tensors (including decode slack)."""
        return self._k.untyped_storage().nbytes() + self._v.untyped_storage().nbytes()

    # ------------------------------------------------------------------ attention
    def attend(
        self, query: torch.Tensor, query_positions: torch.Tensor, scaling: float, fresh_causal: bool
    ) -> torch.Tensor:
        """Attention of ``query`` ``[batch, q_heads, q, head_dim]`` over the stored entries.

        A slot is visible to a query when it holds a token whose position is not after the query's position.
        ``fresh_causal`` says a plain causal kernel gives the same result: the store held nothing before the
        current tokens, or it holds an intact prefix (``prefix_intact``) they continue; none is padding.
        Returns ``[batch, q, q_heads, head_dim]``.
        """
        if fresh_causal:  # bottom-right aligned: the queries are the last ``q`` of the stored tokens
            return grouped_attention(query, self.keys, self.values, None, scaling, causal=True)
        kpos = self.positions
        if query.shape[2] == 1:
            # One decoding query sees every stored (past) token: only empty slots are masked, when there are any.
            mask = None if self.all_valid else (kpos >= 0)[:, :, None, :]
        else:
            mask = (kpos[:, :, None, :] >= 0) & (kpos[:, :, None, :] <= query_positions[:, None, :, None])
        return attend_padded(query, self.keys, self.values, mask, scaling)
