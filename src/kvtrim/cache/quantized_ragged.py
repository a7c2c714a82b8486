"""A ragged (per-head) layer store whose entries are held quantized (int8 / int4, :mod:`kvtrim.cache.quant`).

Methods with per-head budgets (AdaKV, HeadKV, KVzip, DuoAttention, …) keep a different number of entries in every
(sequence, KV head) row. This store holds exactly those entries, quantized, in three parts:

* the **sink** (``sink > 0``): each row's oldest ``min(sink, n_r)`` kept entries in the model's dtype, ``[batch,
  kv_heads, s, head_dim]`` with ``s = min(sink, longest row)`` (a row with fewer has empty slots, position ``-1``),
  outside every key group (attention sinks, :class:`~kvtrim.cache.quant.KVQuant`);

* the **kept part**, from the compaction, ragged: row ``r = b * kv_heads + h`` owns ``capacity[r]`` consecutive
  slots from ``start[r]`` in flat buffers, of which the first ``length[r]`` are live:

  * keys: codes ``[slots, head_dim*bits/8]`` uint8; per-channel scale and zero point ``[groups, head_dim]`` float16,
    one per ``group_size`` consecutive entries of a row (row ``r``'s groups start at ``group_start[r]``; its last
    group may hold fewer entries, so a row of ``n`` entries carries ``ceil(n / group_size)`` key groups);
  * values: codes ``[slots, head_dim*bits/8]``, per-token scale and zero point ``[slots, head_dim/value_group]``;
  * positions ``[slots]``.

  Keys pruned to ``key_dim < head_dim`` channels (ThinK, :meth:`with_key_channels`) have ``key_dim`` in place of
  ``head_dim`` in the key shapes.

  It does not grow: no slack, no appends (truncation only shortens ``length``).
* the **tail**, everything appended after the compaction (decoding steps, a question chunk) and, with
  ``residual > 0``, each row's newest ``residual`` kept entries: a :class:`QuantizedDenseStore` (every row gains the
  same appended columns), i.e. a full-precision window whose oldest whole groups are quantized as it fills.

Bytes held (:meth:`nbytes`, from the tensors) are therefore, with ``n_r`` entries in row ``r``'s kept part::

    sum_r [ n_r * (2*head_dim*bits/8 + 4*head_dim/value_group) + ceil(n_r / group_size) * 4*head_dim ] + tail + sink

Attention dequantizes the kept part of the layer inside the call (one transient padded ``[batch, kv_heads, width,
head_dim]`` copy, ``width`` a multiple of ``group_size``, gathered with one ``index_select`` per tensor from an
index that changes only when the store is rebuilt), then the tail after it, and makes one batched call; nothing
dequantized is kept between steps and a step reads nothing back from the device.
"""

from __future__ import annotations

import dataclasses

import torch

from .dense import INVALID, DenseStore
from .packed_attention import attend_padded, gather_index, gather_rows, ragged_mask
from .quant import (
    KVQuant,
    dequantize_keys,
    dequantize_values,
    packed_width,
    quantize_keys,
    quantize_values,
    rotate,
    take_code_channels,
)
from .quantized_dense import QuantizedDenseStore
from .quantized_dense import key_format as keys_format_for
from .ragged import _ranges

__all__ = ["QuantizedRaggedStore"]


def _ceil_div(n: torch.Tensor, g: int) -> torch.Tensor:
    return (n + g - 1) // g


class QuantizedRaggedStore:
    """Quantized KV entries of one layer with a per-(sequence, KV head) count (module docstring).

    Attributes:
        kv_quant: the entry format
        dtype: the model's dtype (of the tail's window and of dequantized entries)
        start, length, capacity: ``[batch * kv_heads]`` slots of the kept part per row (on the device)
        group_start: ``[batch * kv_heads]`` first key group of every row
        tail: the entries appended since the compaction
    """

    layout = "ragged-quantized"
    rescorable = True
    causal_prefill_ready = False  # rows of different lengths: attention always goes through the row masks

    def __init__(
        self,
        kv_quant: KVQuant,
        dtype: torch.dtype,
        codes: tuple[torch.Tensor, ...],
        positions: torch.Tensor,
        start: torch.Tensor,
        length: torch.Tensor,
        capacity: torch.Tensor,
        group_start: torch.Tensor,
        tail: QuantizedDenseStore,
        sink: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ):
        """``codes`` = (key codes, key scales, key zeros, value codes, value scales, value zeros), flat; ``sink`` =
        (keys, values, positions) ``[batch, kv_heads, s, ·]`` of every row's oldest entries (None: no sink)."""
        self.kv_quant, self.dtype = kv_quant, dtype
        self._kc, self._ks, self._kz, self._vc, self._vs, self._vz = codes
        self._pos = positions
        self.start, self.length, self.capacity, self.group_start = start, length, capacity, group_start
        self.tail = tail
        if sink is None:
            b, h = tail.batch_size, tail.kv_heads
            sink = (
                tail._wk.new_empty(b, h, 0, tail.key_dim), tail._wv.new_empty(b, h, 0, tail.head_dim),
                positions.new_empty(b, h, 0),
            )  # fmt: skip
        self._sk, self._sv, self._spos = sink
        self._sync_layout()

    def _sync_layout(self) -> None:
        """Host-side bookkeeping from the device (construction and rebuilds only): the padded view's width (the
        longest row, rounded up to whole key groups) and its gather indices."""
        g, rows = self.kv_quant.group_size, len(self.capacity)
        longest = int(self.capacity.max()) if rows else 0
        self._groups = -(-longest // g)
        self._width = self._groups * g
        self._min_len = int(self.length.min()) if rows else 0  # a lower bound: truncation resets it to 0
        self._index = gather_index(self.start, self._width, self._kc.shape[0])
        self._group_index = gather_index(self.group_start, self._groups, self._ks.shape[0])

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_selection(
        cls, store: QuantizedDenseStore, indices: torch.Tensor, keep_mask: torch.Tensor
    ) -> QuantizedRaggedStore:
        """Keep, in every row, the slots ``indices[b, h][keep_mask[b, h]]`` (``[batch, kv_heads, k]``) of a
        quantized dense store (left unchanged), as :meth:`QuantizedDenseStore.keep` would but without padding.

        Kept values that were quantized keep their codes and scales; kept keys are regrouped in groups of
        ``group_size`` consecutive kept entries of their row, quantized from the float keys ``store`` was made from
        while it holds them (:attr:`QuantizedDenseStore.source_keys`), as the dense store does
        (docs/quantization.md)."""
        fmt, g = store.kv_quant, store.kv_quant.group_size
        b, h, _ = indices.shape
        rows = b * h
        # kept slots first, in their order: [b, h, k]
        order = torch.sort((~keep_mask).to(torch.int8), dim=-1, stable=True).indices
        idx, kept = indices.gather(-1, order), keep_mask.gather(-1, order)
        count = kept.sum(-1).reshape(-1)  # [rows]
        longest = int(count.max()) if rows else 0
        sink_w = min(fmt.sink, longest)
        n_sink = count.clamp(max=fmt.sink)  # each row's oldest kept entries: its sink
        tail_w = min(fmt.residual, longest - sink_w)
        n_kept = (count - n_sink - tail_w).clamp(min=0)  # entries held in the kept part; the rest start the tail
        width = -(-max(longest - sink_w - tail_w, 0) // g) * g
        need = max(sink_w + width, longest, 1)
        if idx.shape[-1] < need:
            idx = torch.cat([idx, idx.new_zeros(b, h, need - idx.shape[-1])], -1)
        keys, values = store.compaction_entries()  # kept keys quantized once from the float keys, where held
        positions_all = store.positions

        def take(x: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            return x.gather(2, j.unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))

        # kept part: columns [0, width) of every row, from the row's kept column n_sink + col, live where col < n_kept
        cols = torch.arange(width, device=indices.device)
        live = cols[None, :] < n_kept[:, None]  # [rows, width]
        qcol = (n_sink.view(b, h, 1) + cols).clamp(max=idx.shape[-1] - 1)
        qidx = idx.gather(-1, qcol)
        qpos = positions_all.gather(-1, qidx)
        qlive = live.view(b, h, width) & (qpos >= 0)
        kc, ks, kz = quantize_keys(take(keys, qidx), store.key_format, qlive)
        vc, vs, vz = quantize_values(take(values, qidx), fmt)
        old_ns, old_nq = store.sink_length, store.quantized_length
        if old_nq and width:
            rel = qidx - old_ns  # slots of the old quantized part
            moved = ((rel >= 0) & (rel < old_nq)).unsqueeze(-1)
            src = rel.clamp(0, old_nq - 1)

            def move(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
                return torch.where(moved, take(old, src), new)

            vc, vs, vz = move(store._vc, vc), move(store._vs, vs), move(store._vz, vz)
        flat_live = live.reshape(-1)
        glive = (cols[None, : width // g] * g < n_kept[:, None]).reshape(-1)

        def flat(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return t.reshape(-1, t.shape[-1])[mask]

        codes = (
            flat(kc, flat_live), flat(ks, glive), flat(kz, glive),
            flat(vc, flat_live), flat(vs, flat_live), flat(vz, flat_live),
        )  # fmt: skip
        positions = qpos.reshape(-1)[flat_live]
        groups = _ceil_div(n_kept, g)
        # tail: each row's newest ``tail_w`` kept entries, right-aligned (slots before a short row's first are empty);
        # it has no sink of its own
        tcol = count.view(b, h, 1) - tail_w + torch.arange(tail_w, device=indices.device)
        tvalid = tcol >= (n_sink + n_kept).view(b, h, 1)
        tidx = idx.gather(-1, tcol.clamp(min=0))
        tpos = positions_all.gather(-1, tidx).masked_fill(~tvalid, INVALID)
        tail_fmt = dataclasses.replace(fmt, sink=0)
        tail = QuantizedDenseStore.from_dense(
            DenseStore(take(keys, tidx), take(values, tidx), tpos, tail_w), tail_fmt
        )
        # sink: each row's oldest kept entries, left-aligned (a row with fewer leaves empty slots at the end)
        scol = torch.arange(sink_w, device=indices.device)
        sidx = idx[..., :sink_w]
        spos = positions_all.gather(-1, sidx).masked_fill(scol >= n_sink.view(b, h, 1), INVALID)
        sink = (take(keys, sidx), take(values, sidx), spos)
        return cls(
            fmt, store.dtype, codes, positions, n_kept.cumsum(0) - n_kept, n_kept,
            n_kept.clone(), groups.cumsum(0) - groups, tail, sink,
        )  # fmt: skip

    def with_key_channels(self, channels: torch.Tensor) -> QuantizedRaggedStore:
        """A new store whose keys hold only ``channels`` ``[batch, kv_heads, d_kept]`` of this store's key channels
        (ThinK), in the kept part and the tail; values, positions and row bookkeeping are shared with this store.
        Every slot and key group of row ``r = b * kv_heads + h`` keeps the channels of ``(b, h)`` with their codes,
        scales and zero points unchanged (as :meth:`QuantizedDenseStore.with_key_channels`); keys held rotated are
        quantized again on the kept channels of the model's keys, in the same groups of every row."""
        b, h, dk = channels.shape
        if self.key_format.rotate:
            kc, ks, kz = self._requantized_key_channels(channels)
        else:
            rows = torch.arange(b * h, device=channels.device)
            per_row = channels.reshape(b * h, dk)
            slot_row = torch.repeat_interleave(rows, self.capacity, output_size=self._kc.shape[0])
            groups = _ceil_div(self.capacity, self.kv_quant.group_size)
            group_row = torch.repeat_interleave(rows, groups, output_size=self._ks.shape[0])
            kc = take_code_channels(self._kc, per_row[slot_row], self.kv_quant.bits, self.key_dim)
            ks, kz = (t.gather(1, per_row[group_row]) for t in (self._ks, self._kz))
        sk = self._sk.gather(3, channels[:, :, None, :].expand(-1, -1, self._sk.shape[2], -1))
        return QuantizedRaggedStore(
            self.kv_quant, self.dtype, (kc, ks, kz, self._vc, self._vs, self._vz), self._pos, self.start,
            self.length, self.capacity, self.group_start, self.tail.with_key_channels(channels),
            (sk, self._sv, self._spos),
        )  # fmt: skip

    def _requantized_key_channels(self, channels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Flat key codes, scales and zero points of the kept part on ``channels`` ``[batch, kv_heads, d_kept]`` of
        the model's channels, dequantized and quantized again unrotated in every row's own key groups."""
        b, h, w, g = self.batch_size, self.kv_heads, self._width, self.kv_quant.group_size
        dk = channels.shape[-1]
        fmt = keys_format_for(self.kv_quant, dk, self.head_dim)  # the pruned keys' format: unrotated
        if not w:
            return (
                self._kc.new_empty(0, packed_width(dk, fmt.bits)),
                self._ks.new_empty(0, dk),
                self._kz.new_empty(0, dk),
            )
        kc = gather_rows(self._kc, self._index, b, h)
        ks, kz = gather_rows(self._ks, self._group_index, b, h), gather_rows(self._kz, self._group_index, b, h)
        keys = dequantize_keys(kc, ks, kz, self.key_format, self.dtype)  # [b, h, width, head_dim], model channels
        keys = keys.gather(3, channels[:, :, None, :].expand(-1, -1, w, -1))
        cols = torch.arange(w, device=channels.device)
        held = cols[None, :] < self.capacity[:, None]  # [rows, width]: the slots each row owns
        pos = gather_rows(self._pos, self._index, b, h)
        live = (cols[None, :] < self.length[:, None]).view(b, h, w) & (pos >= 0)
        kc, ks, kz = quantize_keys(keys, fmt, live)
        gheld = (cols[None, : w // g] * g < self.capacity[:, None]).reshape(-1)
        return (
            kc.reshape(-1, kc.shape[-1])[held.reshape(-1)],
            ks.reshape(-1, ks.shape[-1])[gheld],
            kz.reshape(-1, kz.shape[-1])[gheld],
        )

    @property
    def key_format(self) -> KVQuant:
        """How the kept part's and the tail's keys are quantized (:func:`~kvtrim.cache.quantized_dense.key_format`:
        pruned keys are never rotated)."""
        return self.tail.key_format

    # ------------------------------------------------------------------ views
    @property
    def batch_size(self) -> int:
        return self.tail.batch_size

    @property
    def kv_heads(self) -> int:
        return self.tail.kv_heads

    @property
    def head_dim(self) -> int:
        """Channels of a value (the model's head dimension)."""
        return self.tail.head_dim

    @property
    def key_dim(self) -> int:
        """Channels of a key (``head_dim`` unless key channels were pruned)."""
        return self.tail.key_dim

    @property
    def sink_width(self) -> int:
        """Columns of the sink (``min(sink, longest row)`` at the compaction)."""
        return self._sk.shape[2]

    @property
    def is_empty(self) -> bool:
        return int(self.length.sum()) == 0 and self.tail.is_empty and not bool((self._spos >= 0).any())

    def _filled(self) -> torch.Tensor:
        """``[batch, kv_heads, 1, width]`` live columns of the kept part's padded view."""
        return ragged_mask(self.length, self._width, self.batch_size, self.kv_heads)

    def padded_positions(self) -> torch.Tensor:
        """``[batch, kv_heads, sink + width + tail]`` positions of the padded view of :meth:`dequantized` (``-1`` for
        the sink's and the tail's empty slots and for the columns past a row's kept entries)."""
        kept = gather_rows(self._pos, self._index, self.batch_size, self.kv_heads)
        kept = kept.masked_fill(~self._filled()[:, :, 0], INVALID)
        return torch.cat([self._spos, kept, self.tail.positions], dim=-1)

    def dequantized(self, rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` of a padded view ``[batch, kv_heads, sink + width + tail, key_dim / head_dim]`` in the
        model's dtype: the sink, every row's kept part (the columns past its entries hold arbitrary finite values),
        then the tail. A transient copy of this layer. ``rotated``: every entry in the basis of
        ``kv_quant.rotate`` (what attention with a rotated query reads)."""
        b, h, w, fmt, s = self.batch_size, self.kv_heads, self._width, self.kv_quant, self.sink_width
        kfmt = self.key_format
        shape = (b, h, s + w + self.tail.length)
        keys = torch.empty(*shape, self.key_dim, dtype=self.dtype, device=self._pos.device)
        values = torch.empty(*shape, self.head_dim, dtype=self.dtype, device=self._pos.device)
        if s:
            keys[:, :, :s] = rotate(self._sk, kfmt if rotated else None)
            values[:, :, :s] = rotate(self._sv, fmt if rotated else None)
        if w:
            kc, vc = gather_rows(self._kc, self._index, b, h), gather_rows(self._vc, self._index, b, h)
            ks, kz = gather_rows(self._ks, self._group_index, b, h), gather_rows(self._kz, self._group_index, b, h)
            vs, vz = gather_rows(self._vs, self._index, b, h), gather_rows(self._vz, self._index, b, h)
            dequantize_keys(kc, ks, kz, kfmt, self.dtype, out=keys[:, :, s : s + w], rotated=rotated)
            dequantize_values(vc, vs, vz, fmt, self.dtype, out=values[:, :, s : s + w], rotated=rotated)
        self.tail.dequantize_into(keys[:, :, s + w :], values[:, :, s + w :], rotated)
        return keys, values

    def to_dense(self) -> QuantizedDenseStore:
        """A padded quantized dense copy (e.g. to score the entries again). Its keys are quantized again in groups
        of its padded columns; a row's kept part starts right after the sink's columns, so its groups are the same
        ones when every row fills the sink."""
        keys, values = self.dequantized()
        positions = self.padded_positions()
        return QuantizedDenseStore.from_dense(DenseStore(keys, values, positions, keys.shape[2]), self.kv_quant)

    # ------------------------------------------------------------------ appends and truncation
    def append(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, padded: bool | None = None
    ) -> None:
        """Append ``[batch, kv_heads, q, head_dim]`` entries at ``positions`` ``[batch, q]`` to the tail."""
        self.tail.append(keys, values, positions, padded)

    def latest_positions(self) -> torch.Tensor:
        """``[batch]`` the largest stored position per sequence (``-1`` where nothing is stored); no host sync."""
        both = self.padded_positions()
        if both.shape[-1] == 0:
            return torch.full((self.batch_size,), INVALID, dtype=torch.long, device=self._pos.device)
        return both.amax(dim=(1, 2))

    def mark(self) -> tuple[torch.Tensor, int]:
        return self.length.clone(), self.tail.mark()

    def truncate_to(self, mark: tuple[torch.Tensor, int]) -> None:
        """Drop entries appended after ``mark`` (from :meth:`mark`)."""
        length, tail = mark
        if bool((length > self.length).any()):
            raise ValueError("cannot truncate a quantized ragged store to a longer mark")
        self.tail.truncate_to(tail)
        self.length = length.clone()
        self._min_len = 0

    def drop_last(self, n: int) -> None:
        """Remove the last ``n`` token columns: the tail's first, then each row's newest kept entries, then its
        newest sink entries."""
        t = self.tail.length
        self.tail.truncate(max(t - n, 0))
        if n > t:
            over = (n - t) - self.length  # [rows] columns past each row's kept part
            self.length = (self.length - (n - t)).clamp(min=0)
            self._min_len = 0
            if self.sink_width:
                b, h = self.batch_size, self.kv_heads
                left = (self._spos >= 0).sum(-1) - over.clamp(min=0).view(b, h)
                cols = torch.arange(self.sink_width, device=self._spos.device)
                self._spos = self._spos.masked_fill(cols >= left[..., None], INVALID)

    # ------------------------------------------------------------------ copies
    def _flat(self) -> tuple[torch.Tensor, ...]:
        return self._kc, self._ks, self._kz, self._vc, self._vs, self._vz

    def copy(self) -> QuantizedRaggedStore:
        return QuantizedRaggedStore(
            self.kv_quant, self.dtype, tuple(t.clone() for t in self._flat()), self._pos.clone(), self.start.clone(),
            self.length.clone(), self.capacity.clone(), self.group_start.clone(), self.tail.copy(),
            (self._sk.clone(), self._sv.clone(), self._spos.clone()),
        )  # fmt: skip

    def select_batch(self, index: torch.Tensor) -> None:
        """Reorder or select sequences (beam search, ``num_return_sequences``): rows move with their codes."""
        h, g = self.kv_heads, self.kv_quant.group_size
        rows = (index.view(-1, 1) * h + torch.arange(h, device=index.device)).reshape(-1)
        cap, groups = self.capacity[rows], _ceil_div(self.capacity[rows], g)
        slots = _ranges(self.start[rows], cap)
        gslots = _ranges(self.group_start[rows], groups)
        self._kc, self._vc, self._vs, self._vz = (t[slots] for t in (self._kc, self._vc, self._vs, self._vz))
        self._ks, self._kz = self._ks[gslots], self._kz[gslots]
        self._pos = self._pos[slots]
        self.start, self.length, self.capacity = cap.cumsum(0) - cap, self.length[rows], cap
        self.group_start = groups.cumsum(0) - groups
        self._sk, self._sv, self._spos = self._sk[index], self._sv[index], self._spos[index]
        self.tail.select_batch(index)
        self._sync_layout()

    # ------------------------------------------------------------------ accounting
    def entries(self) -> int:
        return int(self.length.sum()) + self.tail.entries() + int((self._spos >= 0).sum())

    def entries_per_head(self) -> torch.Tensor:
        sink = (self._spos >= 0).sum(-1)
        return self.length.view(self.batch_size, self.kv_heads) + self.tail.entries_per_head() + sink

    def nbytes(self) -> int:
        """Bytes held by the packed codes, their scales and zero points, the sink and the tail (codes, scales,
        window)."""
        own = (*self._flat(), self._sk, self._sv)
        return sum(t.untyped_storage().nbytes() for t in own) + self.tail.nbytes()

    def index_nbytes(self) -> int:
        """Bytes of bookkeeping: positions, row offsets and the gather indices."""
        meta = (
            self._pos, self._spos, self.start, self.length, self.capacity, self.group_start, self._index,
            self._group_index,
        )  # fmt: skip
        return sum(t.untyped_storage().nbytes() for t in meta) + self.tail.index_nbytes()

    # ------------------------------------------------------------------ attention
    def attend(
        self, query: torch.Tensor, query_positions: torch.Tensor, scaling: float, fresh_causal: bool = False
    ) -> torch.Tensor:
        """Attention of ``query`` ``[batch, q_heads, q, head_dim]`` over every row's entries, dequantized here for
        this call only, in one batched call; returns ``[batch, q, q_heads, head_dim]``. A single decoding query sees
        every stored entry of its rows; a longer chunk sees the entries whose position is not after its own."""
        self.tail._fresh = None
        fmt = self.kv_quant
        # with rotate=1, attention reads the entries as they are held (rotated) and rotates the query and the output
        rotated = fmt.rotate
        keys, values = self.dequantized(rotated)
        q = rotate(query, self.key_format)  # pruned keys are held unrotated: the query stays in their channels
        if query.shape[2] == 1:
            mask = torch.cat(
                [(self._spos >= 0)[:, :, None, :], self._filled(), (self.tail.positions >= 0)[:, :, None, :]], dim=-1
            )
            empty_rows_possible = self._min_len == 0 and not (self.tail.length and self.tail.all_valid)
            out = attend_padded(q, keys, values, mask, scaling, may_be_empty=empty_rows_possible)
        else:
            kpos = self.padded_positions()[:, :, None, :]  # dead columns at -1
            qpos = query_positions[:, None, :, None]
            mask = (kpos >= 0) & (kpos <= qpos) & (qpos >= 0)
            out = attend_padded(q, keys, values, mask, scaling)
        return rotate(out, fmt, inverse=True) if rotated else out
