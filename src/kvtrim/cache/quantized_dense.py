"""A dense layer store whose entries are held quantized (int8 / int4, :mod:`kvtrim.cache.quant`).

Every KV head holds the same number of slots, as in :class:`~kvtrim.cache.dense.DenseStore`. The slots are split
in three parts that together hold ``length`` entries, oldest first (``d`` is ``head_dim``; keys pruned to
``key_dim < head_dim`` channels, ThinK, have ``key_dim`` wherever a key shape below says ``d``):

* the sink: the oldest ``ns <= kv_quant.sink`` entries ``[batch, kv_heads, ns, d]`` in the model's dtype, outside
  every key group (attention sinks, :class:`~kvtrim.cache.quant.KVQuant`); it fills before anything is quantized;
* the quantized part: ``nq`` slots, key codes ``[batch, kv_heads, nq, d*bits/8]`` with per-channel scales and
  zero points ``[batch, kv_heads, groups, d]`` (one per key group: ``group_size`` consecutive slots, except at most
  one partial group that a compaction leaves, below), value codes of the same shape with per-token scales and zero
  points ``[batch, kv_heads, nq, d/value_group]``;
* the full-precision window: the newest ``length - nq`` entries ``[batch, kv_heads, w, d]`` in the model's dtype.
  Appends land in the window; whenever it holds at least ``residual + group_size`` entries, its oldest whole groups
  are quantized and move to the quantized part.

Attention dequantizes the layer inside the call (one transient ``[batch, kv_heads, length, d]`` copy per layer, not
kept between steps); a prefill into an empty store attends over the new full-precision entries, as KIVI does.
Scoring reads :attr:`keys` / :attr:`values`, the dequantized entries, i.e. what attention sees.

Compaction (:meth:`keep`) moves each kept value's codes and per-token scales unchanged. Keys cannot move with
their scales: a key scale is shared by ``group_size`` tokens, and after eviction the survivors of a group are too
few to amortise it (at 1/8 kept and groups of 64, about 8 per group: the scales would outweigh the int4 codes).
The kept keys are therefore regrouped: quantized again in groups of ``group_size`` consecutive kept entries. A
store made from an unquantized prefill (:meth:`from_dense` with ``keep_source=True``: what a clone of a prefilled
cache does) still holds a reference to the prefill's float keys until its first compaction, and the kept keys are
quantized from those, once. Otherwise (a store filled by appends, a second compaction) they are dequantized first
and the added error of a key is at most half a step of its new group, whose range lies within the range of the old
groups it came from (docs/quantization.md, "Compaction"). The oldest ``sink`` kept entries form the sink; every
other kept entry but the newest ``residual`` is quantized: when their count is not a multiple of ``group_size``,
the last ones form one partial key group with its own scales (as the ragged store's rows do), so a compaction
leaves exactly ``residual`` entries in the window and later appends quantize whole groups after the partial one.

With ``kv_quant.rotate`` the codes hold entries in a rotated basis (:func:`~kvtrim.cache.quant.rotate`); keys
pruned to some of the model's channels (:meth:`with_key_channels`) are held in those channels instead
(:attr:`key_format`, which does not rotate), while values stay rotated.
"""

from __future__ import annotations

import dataclasses

import torch

from .attention import grouped_attention
from .dense import INVALID, DenseStore, SlotBookkeeping
from .packed_attention import attend_padded
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

__all__ = ["QuantizedDenseStore", "key_format"]


def key_format(fmt: KVQuant, key_dim: int, head_dim: int) -> KVQuant:
    """How keys of ``key_dim`` channels are quantized in a store of ``fmt``: ``fmt`` itself, except that pruned keys
    (``key_dim < head_dim``, ThinK) are held in the model's channels they kept, never rotated (a rotation mixes
    every channel of a key, so rotated codes hold no single channel to keep)."""
    return fmt if key_dim == head_dim or not fmt.rotate else dataclasses.replace(fmt, rotate=False)


class QuantizedDenseStore(SlotBookkeeping):
    """KV entries of one layer held quantized, GQA-native; the dense store's interface (``keys``, ``values``,
    ``positions``, ``stat``, ``keep``) so that every compression method composes with it.

    Attributes:
        kv_quant: the entry format
        dtype: the model's dtype (of the window and of dequantized entries)
        length: filled slots (quantized part + window)
        head_dim, key_dim: channels of a value and of a key (``key_dim < head_dim`` once key channels are pruned,
            :class:`~kvtrim.cache.channel_pruned.ChannelPrunedStore`)
    """

    layout = "dense-quantized"
    rescorable = True

    def __init__(
        self,
        kv_quant: KVQuant,
        dtype: torch.dtype,
        batch: int,
        kv_heads: int,
        head_dim: int,
        device,
        key_dim: int | None = None,
    ):
        kv_quant.check_head_dim(head_dim)
        self.kv_quant = kv_quant
        self.dtype = dtype
        b, h, d = batch, kv_heads, head_dim
        dk = d if key_dim is None else key_dim
        self.key_format = key_format(kv_quant, dk, d)
        vgroups = d // kv_quant.value_group_for(d)

        def empty(*shape, dtype=torch.uint8):
            return torch.empty(*shape, dtype=dtype, device=device)

        self._kc = empty(b, h, 0, packed_width(dk, kv_quant.bits))
        self._vc = empty(b, h, 0, d // kv_quant.codes_per_byte)
        self._ks, self._kz = empty(b, h, 0, dk, dtype=torch.float16), empty(b, h, 0, dk, dtype=torch.float16)
        self._vs, self._vz = empty(b, h, 0, vgroups, dtype=torch.float16), empty(b, h, 0, vgroups, dtype=torch.float16)
        self._wk, self._wv = empty(b, h, 0, dk, dtype=dtype), empty(b, h, 0, d, dtype=dtype)
        self._sk, self._sv = empty(b, h, 0, dk, dtype=dtype), empty(b, h, 0, d, dtype=dtype)
        self._pos = empty(b, h, 0, dtype=torch.long)
        # (start, size) of the partial key group a compaction left in the quantized part; size 0: none
        self._partial = (0, 0)
        self.length = 0
        self._stats: dict[str, torch.Tensor] = {}
        self.all_valid = True
        self._fresh: tuple[torch.Tensor, torch.Tensor] | None = None  # a prefill chunk appended to an empty store
        # The float keys ``[batch, kv_heads, length, key_dim]`` the entries were quantized from (slot-aligned): a
        # reference to an unquantized prefill's keys, which their owner holds, kept until the first compaction so
        # that kept keys are quantized once (module docstring); None once anything changes the slots.
        self._source: torch.Tensor | None = None

    @classmethod
    def empty(
        cls,
        batch: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device,
        kv_quant: KVQuant,
        key_dim: int | None = None,
    ) -> QuantizedDenseStore:
        return cls(kv_quant, dtype, batch, kv_heads, head_dim, device, key_dim)

    @classmethod
    def from_dense(cls, dense: DenseStore, kv_quant: KVQuant, keep_source: bool = False) -> QuantizedDenseStore:
        """Quantize the entries of ``dense`` (left unchanged) in slot order, keeping its positions and statistics.

        ``keep_source``: hold a reference to ``dense``'s keys (no copy, not counted by :meth:`nbytes`: ``dense``'s
        owner holds them) until the first compaction, which then quantizes the kept keys from them instead of from
        their dequantized codes (:attr:`source_keys`). For a prefill that outlives the compression, as a
        :class:`~kvtrim.Session`'s does; the reference is dropped by any other change of the slots."""
        b, h, _, dk = dense.keys.shape
        store = cls(kv_quant, dense.keys.dtype, b, h, dense.values.shape[-1], dense.keys.device, dk)
        store._wk, store._wv = dense.keys.clone(), dense.values.clone()
        store._pos = dense.positions.clone()
        store.length = dense.length
        store._stats = {n: s[:, :, : dense.length].clone() for n, s in dense._stats.items()}
        store.all_valid = dense.all_valid
        store._flush()
        if keep_source:
            store._source = dense.keys
        return store

    # ------------------------------------------------------------------ views
    @property
    def source_keys(self) -> torch.Tensor | None:
        """``[batch, kv_heads, length, key_dim]`` the float keys the entries were quantized from, while this store
        still holds them (:meth:`from_dense` with ``keep_source``), else None. A compaction quantizes kept keys
        from these."""
        return self._source

    @property
    def sink_length(self) -> int:
        """Slots in the sink (the oldest entries, held in the model's dtype)."""
        return self._sk.shape[2]

    @property
    def quantized_length(self) -> int:
        """Slots in the quantized part (whole key groups, and at most one partial group left by a compaction)."""
        return self._kc.shape[2]

    @property
    def partial_group(self) -> tuple[int, int]:
        """``(start, size)``: the quantized part's partial key group, slots ``[start, start + size)``; ``size`` 0
        when every key group is whole."""
        return self._partial

    def _key_segments(self) -> list[tuple[int, int, int, int]]:
        """``(first slot, end slot, first group, end group)`` runs of the quantized part whose key groups all have
        the same size: the whole groups before the partial one, the partial group, the whole groups after it (slots
        counted from the quantized part's first, after the sink)."""
        g, nq = self.kv_quant.group_size, self.quantized_length
        start, size = self._partial
        if not size:
            return [(0, nq, 0, nq // g)] if nq else []
        before = start // g
        runs = [(0, start, 0, before), (start, start + size, before, before + 1)]
        runs.append((start + size, nq, before + 1, before + 1 + (nq - start - size) // g))
        return [r for r in runs if r[1] > r[0]]

    def _groups_before(self, slot: int) -> int:
        """Key groups wholly before ``slot``, a group boundary of the quantized part."""
        g = self.kv_quant.group_size
        start, size = self._partial
        if not size or slot <= start:
            return slot // g
        return start // g + 1 + (slot - start - size) // g

    @property
    def window_length(self) -> int:
        """Slots in the full-precision window."""
        return self._wk.shape[2]

    @property
    def batch_size(self) -> int:
        return self._wk.shape[0]

    @property
    def kv_heads(self) -> int:
        return self._wk.shape[1]

    @property
    def head_dim(self) -> int:
        """Channels of a value (the model's head dimension)."""
        return self._wv.shape[-1]

    @property
    def key_dim(self) -> int:
        """Channels of a key (``head_dim`` unless key channels were pruned)."""
        return self._wk.shape[-1]

    @property
    def keys(self) -> torch.Tensor:
        """``[batch, kv_heads, length, key_dim]`` the keys as attention sees them (a dequantized copy)."""
        return self.dequantized()[0]

    @property
    def values(self) -> torch.Tensor:
        """``[batch, kv_heads, length, head_dim]`` the values as attention sees them (a dequantized copy)."""
        return self.dequantized_values()

    def dequantized(self, rotated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` ``[batch, kv_heads, length, head_dim]`` in the model's dtype: the quantized part
        dequantized, followed by the window (a transient copy of this layer). ``rotated``: every entry in the basis
        of ``kv_quant.rotate`` (``x @ R``), what attention with a rotated query reads (keys in the basis of
        :attr:`key_format`: pruned keys stay in the model's channels); the model's channels otherwise."""
        fmt, kfmt, nq = self.kv_quant, self.key_format, self.quantized_length
        if nq == 0 and self.sink_length == 0:
            return rotate(self._wk, kfmt if rotated else None), rotate(self._wv, fmt if rotated else None)
        if self.window_length == 0 and not self._partial[1] and self.sink_length == 0:
            k = dequantize_keys(self._kc, self._ks, self._kz, kfmt, self.dtype, rotated=rotated)
            return k, dequantize_values(self._vc, self._vs, self._vz, fmt, self.dtype, rotated=rotated)
        # dequantize straight into the layer's buffer, the window after it (no concatenation copy)
        shape = (*self._wk.shape[:2], self.length)
        k = torch.empty(*shape, self.key_dim, dtype=self.dtype, device=self._wk.device)
        v = torch.empty(*shape, self.head_dim, dtype=self.dtype, device=self._wk.device)
        self.dequantize_into(k, v, rotated)
        return k, v

    def dequantized_values(self) -> torch.Tensor:
        """``[batch, kv_heads, length, head_dim]`` the values alone, as :meth:`dequantized` returns them (the keys
        are not dequantized)."""
        ns, nq = self.sink_length, self.quantized_length
        if nq == 0 and ns == 0:
            return self._wv
        if self.window_length == 0 and ns == 0:
            return dequantize_values(self._vc, self._vs, self._vz, self.kv_quant, self.dtype)
        v = torch.empty(*self._wv.shape[:2], self.length, self.head_dim, dtype=self.dtype, device=self._wv.device)
        self.dequantize_into(None, v)
        return v

    def compaction_entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` a compaction quantizes its kept entries from: the float keys while this store holds
        them (:attr:`source_keys`; the values dequantized alone), else :meth:`dequantized`."""
        if self._source is not None:
            return self._source, self.dequantized_values()
        return self.dequantized()

    def dequantize_into(self, keys: torch.Tensor | None, values: torch.Tensor, rotated: bool = False) -> None:
        """Write the entries, as attention sees them, into ``keys`` ``[batch, kv_heads, length, key_dim]`` (None:
        values only) and ``values`` ``[batch, kv_heads, length, head_dim]`` (views of a larger buffer allowed): the
        sink, the quantized part dequantized, then the window. ``rotated``: all of them in the basis of
        ``kv_quant.rotate`` (the sink and the window rotated, the quantized part left as it is held; keys in the
        basis of :attr:`key_format`)."""
        fmt, kfmt, ns, nq = self.kv_quant, self.key_format, self.sink_length, self.quantized_length

        def full(x: torch.Tensor) -> torch.Tensor:
            return rotate(x, fmt if rotated else None)

        def full_keys(x: torch.Tensor) -> torch.Tensor:
            return rotate(x, kfmt if rotated else None)

        if ns:
            values[:, :, :ns] = full(self._sv)
        if nq:
            dequantize_values(
                self._vc, self._vs, self._vz, fmt, self.dtype, out=values[:, :, ns : ns + nq], rotated=rotated
            )
        if self.window_length:
            values[:, :, ns + nq :] = full(self._wv)
        if keys is None:
            return
        if ns:
            keys[:, :, :ns] = full_keys(self._sk)
        self._dequantize_key_part(keys[:, :, ns : ns + nq], rotated)
        if self.window_length:
            keys[:, :, ns + nq :] = full_keys(self._wk)

    def _dequantize_key_part(self, out: torch.Tensor, rotated: bool = False) -> None:
        """Write the quantized part's keys into ``out`` ``[batch, kv_heads, nq, key_dim]``, group run by group run
        (``rotated``: left in the basis of :attr:`key_format`)."""
        for s0, s1, g0, g1 in self._key_segments():
            dequantize_keys(
                self._kc[:, :, s0:s1], self._ks[:, :, g0:g1], self._kz[:, :, g0:g1], self.key_format, self.dtype,
                out=out[:, :, s0:s1], rotated=rotated,
            )  # fmt: skip

    # ------------------------------------------------------------------ growth
    def _reserve_positions(self, extra: int) -> None:
        needed = self.length + extra
        cap = self._pos.shape[2]
        if needed <= cap:
            return
        new_cap = max(needed, cap + max(cap // 8, 16))
        b, h = self._pos.shape[:2]

        def grow(t: torch.Tensor, fill: int) -> torch.Tensor:
            out = torch.full((b, h, new_cap), fill, dtype=t.dtype, device=t.device)
            out[:, :, : self.length] = t[:, :, : self.length]
            return out

        self._pos = grow(self._pos, INVALID)
        self._stats = {n: grow(s, 0) for n, s in self._stats.items()}

    def _flush(self) -> None:
        """Fill the sink from the window's oldest entries (it is short only while nothing is quantized), then quantize
        the window's oldest whole groups while it holds ``residual + group_size`` entries or more."""
        fmt = self.kv_quant
        take = min(fmt.sink - self.sink_length, self.window_length)
        if take > 0:
            self._sk = torch.cat([self._sk, self._wk[:, :, :take]], dim=2)
            self._sv = torch.cat([self._sv, self._wv[:, :, :take]], dim=2)
            self._wk, self._wv = self._wk[:, :, take:].clone(), self._wv[:, :, take:].clone()
        n = (self.window_length - fmt.residual) // fmt.group_size * fmt.group_size
        if n <= 0:
            return
        start = self.sink_length + self.quantized_length
        kc, ks, kz = quantize_keys(self._wk[:, :, :n], self.key_format, self._pos[:, :, start : start + n] >= 0)
        vc, vs, vz = quantize_values(self._wv[:, :, :n], fmt)
        self._kc, self._ks, self._kz = (torch.cat(p, dim=2) for p in ((self._kc, kc), (self._ks, ks), (self._kz, kz)))
        self._vc, self._vs, self._vz = (torch.cat(p, dim=2) for p in ((self._vc, vc), (self._vs, vs), (self._vz, vz)))
        # fresh tensors: a slice would keep the flushed entries' storage alive (and counted)
        self._wk, self._wv = self._wk[:, :, n:].clone(), self._wv[:, :, n:].clone()

    def append(
        self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, padded: bool | None = None
    ) -> None:
        """Append ``q`` new tokens to every head (see :meth:`DenseStore.append`).

        Args:
            keys, values: ``[batch, kv_heads, q, key_dim]``, ``[batch, kv_heads, q, head_dim]``
            positions: ``[batch, q]`` logical positions, ``-1`` for padding tokens
        """
        q = keys.shape[2]
        self._fresh = (keys, values) if self.length == 0 else None
        self._source = None
        self._reserve_positions(q)
        end = self.length + q
        self._pos[:, :, self.length : end] = positions[:, None, :]
        for s in self._stats.values():
            s[:, :, self.length : end] = 0
        self.length = end
        self._wk = torch.cat([self._wk, keys.to(self.dtype)], dim=2)
        self._wv = torch.cat([self._wv, values.to(self.dtype)], dim=2)
        if padded is None:
            padded = self.all_valid and bool((positions < 0).any())
        if padded:
            self.all_valid = False
        self._flush()

    # ------------------------------------------------------------------ compaction
    def keep(self, indices: torch.Tensor, keep_mask: torch.Tensor | None = None) -> None:
        """Keep only the slots ``indices`` ``[batch, kv_heads, k]`` (see :meth:`DenseStore.keep`).

        Kept values that were quantized keep their codes and scales; kept keys are regrouped (module docstring).
        """
        fmt, old_ns, old_nq, k = self.kv_quant, self.sink_length, self.quantized_length, indices.shape[2]
        keys, values = self.compaction_entries()  # kept keys quantized once from the float keys (module docstring)
        self._source = None
        idx = indices.unsqueeze(-1)
        kept_k = torch.gather(keys, 2, idx.expand(-1, -1, -1, self.key_dim))
        kept_v = torch.gather(values, 2, idx.expand(-1, -1, -1, self.head_dim))
        del keys, values
        ns = min(fmt.sink, k)  # the oldest kept entries form the sink
        nq = max(k - ns - fmt.residual, 0)  # every other kept entry but the newest ``residual``
        whole = nq // fmt.group_size * fmt.group_size
        pos = torch.gather(self.positions, 2, indices)
        if keep_mask is not None:
            pos = pos.masked_fill(~keep_mask, INVALID)
        valid = pos >= 0
        kfmt = self.key_format
        kc, ks, kz = quantize_keys(kept_k[:, :, ns : ns + whole], kfmt, valid[:, :, ns : ns + whole])
        if nq > whole:  # the last kept entries form one partial group with its own scales
            q0, q1 = ns + whole, ns + nq
            parts = quantize_keys(kept_k[:, :, q0:q1], kfmt, valid[:, :, q0:q1], group_size=nq - whole)
            kc, ks, kz = (torch.cat([a, p], dim=2) for a, p in zip((kc, ks, kz), parts, strict=True))
        vc, vs, vz = quantize_values(kept_v[:, :, ns : ns + nq], fmt)  # first quantization of other entries
        if nq and old_nq:
            src = indices[:, :, ns : ns + nq] - old_ns  # slots of the old quantized part
            moved = ((src >= 0) & (src < old_nq)).unsqueeze(-1)
            qsrc = src.clamp(0, old_nq - 1).unsqueeze(-1)

            def move(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
                return torch.where(moved, torch.gather(old, 2, qsrc.expand(-1, -1, -1, old.shape[-1])), new)

            vc, vs, vz = move(self._vc, vc), move(self._vs, vs), move(self._vz, vz)
        self._kc, self._ks, self._kz, self._vc, self._vs, self._vz = kc, ks, kz, vc, vs, vz
        self._partial = (whole, nq - whole) if nq > whole else (0, 0)
        # clones, not views: an empty slice would keep (and count) the whole gathered layer
        self._sk, self._sv = kept_k[:, :, :ns].clone(), kept_v[:, :, :ns].clone()
        self._wk, self._wv = kept_k[:, :, ns + nq :].clone(), kept_v[:, :, ns + nq :].clone()
        self._pos = pos.contiguous()
        self._stats = {n: torch.gather(s[:, :, : self.length], 2, indices).contiguous() for n, s in self._stats.items()}
        self.length = k
        self.all_valid = bool((self._pos >= 0).all())
        self._fresh = None

    def with_key_channels(self, channels: torch.Tensor) -> QuantizedDenseStore:
        """A new store whose keys hold only ``channels`` ``[batch, kv_heads, d_kept]`` of this store's key channels
        (ThinK); values, positions and statistics are shared with this store.

        A key scale and zero point belong to one channel of one group, so the kept channels keep their codes, scales
        and zero points unchanged: the new store's keys, dequantized, are exactly this store's on those channels.
        Keys held rotated (``kv_quant.rotate``) hold no channel of the model's alone: the kept channels of the keys
        (the float keys while :attr:`source_keys` holds them, else the dequantized ones) are quantized again, in
        the same key groups, in the model's channels (:attr:`key_format`)."""
        b, h, dk = channels.shape
        out = QuantizedDenseStore(self.kv_quant, self.dtype, b, h, self.head_dim, self._pos.device, dk)

        def index(n: int) -> torch.Tensor:
            return channels[:, :, None, :].expand(-1, -1, n, -1)

        if self.key_format.rotate:
            out._kc, out._ks, out._kz = self._requantized_key_channels(channels, out.key_format)
        else:
            out._kc = take_code_channels(self._kc, index(self.quantized_length), self.kv_quant.bits, self.key_dim)
            out._ks, out._kz = (torch.gather(t, 3, index(t.shape[2])) for t in (self._ks, self._kz))
        out._wk = torch.gather(self._wk, 3, index(self.window_length))
        out._sk = torch.gather(self._sk, 3, index(self.sink_length))
        out._vc, out._vs, out._vz, out._wv, out._sv = self._vc, self._vs, self._vz, self._wv, self._sv
        out._pos, out.length, out.all_valid, out._partial = self._pos, self.length, self.all_valid, self._partial
        out._stats = dict(self._stats)
        return out

    def _requantized_key_channels(
        self, channels: torch.Tensor, fmt: KVQuant
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes, scales and zero points of the quantized part's keys on ``channels`` ``[batch, kv_heads, d_kept]``
        of the model's channels, quantized with ``fmt`` in this store's key groups (the partial one included)."""
        ns, nq = self.sink_length, self.quantized_length
        if self._source is not None:
            keys = self._source[:, :, ns : ns + nq]
        else:
            keys = torch.empty(*self._kc.shape[:3], self.key_dim, dtype=self.dtype, device=self._kc.device)
            self._dequantize_key_part(keys)
        keys = torch.gather(keys, 3, channels[:, :, None, :].expand(-1, -1, nq, -1))
        valid = self._pos[:, :, ns : ns + nq] >= 0
        parts = [
            quantize_keys(keys[:, :, s0:s1], fmt, valid[:, :, s0:s1], group_size=(s1 - s0) // (g1 - g0))
            for s0, s1, g0, g1 in self._key_segments()
        ]
        if not parts:
            dk = channels.shape[-1]
            empty = self._ks.new_empty(*self._ks.shape[:3], dk)
            return self._kc.new_empty(*self._kc.shape[:3], packed_width(dk, fmt.bits)), empty, empty.clone()
        return tuple(torch.cat(p, dim=2) for p in zip(*parts, strict=True))  # type: ignore[return-value]

    # ------------------------------------------------------------------ KVStore protocol
    def to_dense(self) -> QuantizedDenseStore:
        """Itself: it offers the dense views (dequantized) and :meth:`keep`."""
        return self

    def truncate(self, length: int) -> None:
        """Drop every slot at or after ``length``. Groups that straddle ``length`` return to the window as their
        dequantized entries (they are quantized again when a group fills)."""
        if length > self.length:
            raise ValueError(f"cannot truncate to {length} slots, store has {self.length}")
        fmt, ns, nq = self.kv_quant, self.sink_length, self.quantized_length
        if length <= ns:  # only sink entries remain
            self._sk, self._sv = self._sk[:, :, :length].clone(), self._sv[:, :, :length].clone()
            self._kc, self._vc, self._vs, self._vz, self._ks, self._kz, self._wk, self._wv = (
                t[:, :, :0].clone() for t in (self._kc, self._vc, self._vs, self._vz, self._ks, self._kz,
                                               self._wk, self._wv)
            )  # fmt: skip
            self._partial = (0, 0)
        elif length - ns < nq:
            # the last group boundary at or before ``length - residual`` (the partial group's ends are boundaries)
            limit, g = max(length - ns - fmt.residual, 0), fmt.group_size
            start, size = self._partial
            keep_q = limit // g * g
            if size and limit >= start:
                keep_q = start if limit < start + size else start + size + (limit - start - size) // g * g
            keys, values = self.dequantized()
            self._wk, self._wv = keys[:, :, ns + keep_q : length].clone(), values[:, :, ns + keep_q : length].clone()
            groups = self._groups_before(keep_q)
            if keep_q < start + size:
                self._partial = (0, 0)
            self._kc, self._vc = self._kc[:, :, :keep_q].clone(), self._vc[:, :, :keep_q].clone()
            self._vs, self._vz = self._vs[:, :, :keep_q].clone(), self._vz[:, :, :keep_q].clone()
            self._ks, self._kz = self._ks[:, :, :groups].clone(), self._kz[:, :, :groups].clone()
        else:
            w = length - ns - nq
            self._wk, self._wv = self._wk[:, :, :w].clone(), self._wv[:, :, :w].clone()
        self._pos[:, :, length : self.length] = INVALID
        self.length = length
        self.all_valid = bool((self.positions >= 0).all())
        self._fresh = self._source = None

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return self._kc, self._ks, self._kz, self._vc, self._vs, self._vz, self._wk, self._wv, self._sk, self._sv

    def copy(self) -> QuantizedDenseStore:
        """An independent copy holding exactly the filled slots."""
        out = QuantizedDenseStore(
            self.kv_quant, self.dtype, self.batch_size, self.kv_heads, self.head_dim, self._pos.device, self.key_dim
        )
        (out._kc, out._ks, out._kz, out._vc, out._vs, out._vz, out._wk, out._wv, out._sk, out._sv) = (
            t.clone() for t in self._tensors()
        )
        out._pos = self.positions.clone()
        out.length, out._partial = self.length, self._partial
        out._stats = {n: s[:, :, : self.length].clone() for n, s in self._stats.items()}
        out.all_valid = self.all_valid
        out._source = self._source  # a reference to keys this store does not own either
        return out

    def select_batch(self, index: torch.Tensor) -> None:
        """Reorder or select batch rows (beam search, ``num_return_sequences``)."""
        self._kc, self._ks, self._kz, self._vc, self._vs, self._vz, self._wk, self._wv, self._sk, self._sv = (
            t[index] for t in self._tensors()
        )
        self._pos = self._pos[index]
        self._stats = {n: s[index] for n, s in self._stats.items()}
        self._fresh = self._source = None

    # ------------------------------------------------------------------ accounting
    def nbytes(self) -> int:
        """Bytes held by the packed codes, their scales and zero points, the full-precision window and the sink."""
        return sum(t.untyped_storage().nbytes() for t in self._tensors())

    # ------------------------------------------------------------------ attention
    def attend(
        self, query: torch.Tensor, query_positions: torch.Tensor, scaling: float, fresh_causal: bool = False
    ) -> torch.Tensor:
        """Attention of ``query`` ``[batch, q_heads, q, head_dim]`` over the stored entries, dequantized here for
        this call only; returns ``[batch, q, q_heads, head_dim]`` (visibility as in :meth:`DenseStore.attend`)."""
        fresh, self._fresh = self._fresh, None
        if fresh_causal and fresh is not None:
            return grouped_attention(query, fresh[0], fresh[1], None, scaling, causal=True)
        rotated = self.kv_quant.rotate and self.quantized_length > 0
        keys, values = self.dequantized(rotated)
        kpos = self.positions
        if query.shape[2] == 1:
            mask = None if self.all_valid else (kpos >= 0)[:, :, None, :]
        else:
            mask = (kpos[:, :, None, :] >= 0) & (kpos[:, :, None, :] <= query_positions[:, None, :, None])
        if not rotated:
            return attend_padded(query, keys, values, mask, scaling)
        # entries in the rotated basis: (qR)·(kR) = q·k (keys of key_format only), and the output comes back by Rᵀ
        out = attend_padded(rotate(query, self.key_format), keys, values, mask, scaling)
        return rotate(out, self.kv_quant, inverse=True)
