"""A block pool whose entries are held packed: int8 / int4 codes with their scales (:mod:`kvtrim.cache.quant`).

The same blocks, free list, block tables, positions and metrics as :class:`~kvtrim.cache.block_pool.BlockPool`;
only the key and value of each slot are held differently:

* key codes and value codes ``[blocks, block_size, head_dim * bits / 8]`` uint8 (int4: two codes per byte);
* key and value scales and zero points ``[blocks, block_size, head_dim / value_group]`` float16: **per token** for
  keys as well as values (:func:`~kvtrim.cache.quant.quantize_values` on both), one scale per ``value_group``
  channels (default: the whole ``head_dim``).

Keys are not in KIVI's per-channel layout here, unlike the dense and ragged stores: a paged sequence appends one
token at a time into shared partial blocks and KV-Compress's MoveCache moves single entries between blocks, so a
scale shared by the tokens of a block would be recomputed (and every key of the block quantized again) on every
append and every move; and with 16-token blocks a per-channel scale and zero point per block cost
``4 * head_dim / 16`` bytes per entry, four times the per-token ``4`` bytes (head_dim / value_group = 1). With one
scale per entry, an entry is quantized once, when written, and moves with its scales unchanged.

**Rotation** (``KVQuant.rotate``, int4's default here too): keys and values are quantized as ``x @ R``
(:func:`~kvtrim.cache.quant.rotation`, QuaRot), which spreads the few large key channels that otherwise set every
token's range. Reads (:meth:`read_keys`, :meth:`read_values`) return the model's channels; decode attention reads the
codes as held, with the query rotated before (``q . k = (q R) . (k R)``) and the output rotated back after. The
rotation is one ``[head_dim, head_dim]`` float32 matrix per device shared by every pool, not counted in
:meth:`nbytes`.

Bytes of one entry (key + value of one KV head): ``2 * head_dim * bits / 8 + 2 * 4 * head_dim / value_group``
(int8 at head_dim 64: 136 B; int4: 72 B; against 256 B in float16, 512 B in float32). :meth:`nbytes` sums the
storages of the codes, scales and zero points; :meth:`block_nbytes` is ``block_size`` entries.

Reads dequantize only the slots asked for, into a new tensor of the pool's dtype: prefill attention reads one
layer of the batch at a time (:class:`~kvtrim.cache.paged.PagedBatchCache`), never the whole pool. Decode
attention does not dequantize at all when a token has one scale (``value_group`` None, the default): with a key
``k = z + s * c`` and a value ``v = z' + s' * c'`` per slot, :meth:`key_logits` computes
``q . k = s * (q . c) + z * sum(q)`` and :meth:`weighted_values` ``sum p * v = (p * s') @ c' + p . z'`` from the
codes read as numbers (one pass, as a float pool's gather), the scales applied to ``[S]`` vectors, not ``[S, d]``.
"""

from __future__ import annotations

import torch

from ..errors import InvalidParameterError
from .block_pool import BlockPool, _positive_int, blocks_for_bytes, take
from .quant import (
    SCALE_DTYPE,
    KVQuant,
    dequantize_values,
    quantize_values,
    resolve_pool_kv_quant,
    rotate,
    rotation,
    unpack_codes_as,
)

__all__ = ["QuantizedBlockPool", "pool_kv_quant"]


def pool_kv_quant(kv_quant: str | KVQuant | None) -> KVQuant | None:
    """``kv_quant`` as a block pool holds it: ``None``, a format name or spec string, or a :class:`KVQuant` without
    full-precision entries (``residual`` and ``sink`` 0: every entry of a pool is packed when written).

    A name or spec string that sets no ``residual`` means ``residual=0`` here, whatever the format's default for
    the dense and ragged stores (``"int4"`` keeps a 32-entry window there, ``DEFAULT_RESIDUAL``); a window asked
    for (``"int4:residual=32"``, ``KVQuant("int4")`` whose residual is that default) is refused. The same holds for
    ``sink`` (full-precision oldest entries): a name means ``sink=0`` and a sink asked for is refused. ``rotate``
    keeps the format's default (int4 rotated, int8 and fp8 not; :func:`~kvtrim.cache.quant.resolve_pool_kv_quant`).
    """
    fmt = resolve_pool_kv_quant(kv_quant)
    if fmt is not None and fmt.full_precision:
        field, value = fmt.full_precision
        raise InvalidParameterError(
            f"a paged block pool packs every entry when it is written: KVQuant.{field} must be 0, got {value} "
            f"(pass {fmt.name!r} or KVQuant({fmt.name!r}, residual=0, sink=0))"
        )
    return fmt


class QuantizedBlockPool(BlockPool):
    """A :class:`~kvtrim.cache.block_pool.BlockPool` holding int8 / int4 entries with per-token scales.

    Args:
        num_blocks, block_size, head_dim, device, scratch: as :class:`BlockPool`
        dtype: the dtype entries are written from and read back in (the model's)
        kv_quant: ``"int8"``, ``"int4"``, ``"fp8"`` (a name means no window and no sink here, int4 rotated:
            :func:`pool_kv_quant`), a spec string such as ``"int4:rotate=0"``, or a
            :class:`~kvtrim.cache.quant.KVQuant` with ``residual=0`` and ``sink=0`` (``group_size`` is not used: keys
            have per-token scales, module docstring)

    Attributes:
        key_codes, value_codes: ``[blocks, block_size, head_dim * bits / 8]`` uint8
        key_scale, key_zero, value_scale, value_zero: ``[blocks, block_size, head_dim / value_group]`` float16
        quant: the :class:`KVQuant`
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_quant: str | KVQuant,
        device="cpu",
        scratch: bool = False,
    ):
        fmt = pool_kv_quant(kv_quant)
        if fmt is None:
            raise InvalidParameterError("QuantizedBlockPool needs kv_quant 'int8' or 'int4'; use BlockPool for None")
        _positive_int("head_dim", head_dim)
        fmt.check_head_dim(head_dim)
        self.quant = fmt
        super().__init__(num_blocks, block_size, head_dim, dtype, device, scratch)

    @classmethod
    def for_bytes(
        cls,
        kv_bytes: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_quant: str | KVQuant,
        device="cpu",
        scratch: bool = False,
    ) -> QuantizedBlockPool:
        """The largest pool whose packed keys, values, scales and zero points fit in ``kv_bytes``."""
        fmt = pool_kv_quant(kv_quant)
        if fmt is None:
            raise InvalidParameterError("QuantizedBlockPool needs kv_quant 'int8' or 'int4'; use BlockPool for None")
        _positive_int("block_size", block_size)
        _positive_int("head_dim", head_dim)
        fmt.check_head_dim(head_dim)
        per_block = block_size * packed_entry_bytes(fmt, head_dim)
        what = f"block_size={block_size}, head_dim={head_dim}, kv_quant={fmt.name!r}"
        return cls(blocks_for_bytes(kv_bytes, per_block, what), block_size, head_dim, dtype, fmt, device, scratch)

    def _make_entries(self, physical: int, dtype: torch.dtype, device) -> None:
        fmt, d, bs = self.quant, self.head_dim, self.block_size
        packed = d * fmt.bits // 8
        groups = d // fmt.value_group_for(d)
        self.key_codes = torch.zeros(physical, bs, packed, dtype=torch.uint8, device=device)
        self.value_codes = torch.zeros_like(self.key_codes)
        self.key_scale = torch.zeros(physical, bs, groups, dtype=SCALE_DTYPE, device=device)
        self.key_zero = torch.zeros_like(self.key_scale)
        self.value_scale = torch.zeros_like(self.key_scale)
        self.value_zero = torch.zeros_like(self.key_scale)
        if fmt.rotate:  # built now, on the pool's device: never inside a captured decode step
            rotation(d, self.key_codes.device)

    @property
    def keys(self) -> torch.Tensor:
        raise AttributeError(
            "a QuantizedBlockPool holds packed keys (key_codes, key_scale, key_zero): read them with read_keys(slots)"
        )

    @property
    def values(self) -> torch.Tensor:
        raise AttributeError(
            "a QuantizedBlockPool holds packed values (value_codes, value_scale, value_zero): read them with "
            "read_values(slots)"
        )

    # ------------------------------------------------------------------ entries
    def write(self, slot: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize ``keys``/``values`` ``[m, head_dim]`` (each entry alone) and store codes and scales at ``slot``."""
        for x, (codes, scale, zero) in ((keys, self._key_parts()), (values, self._value_parts())):
            c, s, z = quantize_values(x, self.quant)
            codes[slot], scale[slot], zero[slot] = c, s, z

    def read_keys(self, slot: torch.Tensor) -> torch.Tensor:
        codes, scale, zero = self._key_parts()
        return dequantize_values(take(codes, slot), take(scale, slot), take(zero, slot), self.quant, self.dtype)

    def read_values(self, slot: torch.Tensor) -> torch.Tensor:
        codes, scale, zero = self._value_parts()
        return dequantize_values(take(codes, slot), take(scale, slot), take(zero, slot), self.quant, self.dtype)

    @property
    def per_token_scale(self) -> bool:
        """One scale per entry (``value_group`` None): :meth:`key_logits` / :meth:`weighted_values` apply."""
        return self.key_scale.shape[-1] == 1

    def key_logits(self, query: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """``query @ keys^T`` over the keys at ``slot`` without dequantizing them (needs :attr:`per_token_scale`).

        Args:
            query: ``[..., M, head_dim]`` float32 (already scaled); slot: ``[..., S]`` flat slots
        Returns:
            ``[..., M, S]`` float32
        """
        codes, scale, zero = self._key_parts()
        query = rotate(query, self.quant)  # q . k = (q R) . (k R): the codes are of k R when the pool rotates
        c = unpack_codes_as(take(codes, slot), self.quant.bits, torch.float32, fp8=self.quant.is_float)  # [..., S, d]
        s, z = take(scale, slot)[..., 0].float(), take(zero, slot)[..., 0].float()  # [..., S]
        return (
            torch.matmul(query, c.transpose(-1, -2))
            .mul_(s[..., None, :])
            .add_(query.sum(-1, keepdim=True) * z[..., None, :])
        )

    def weighted_values(self, probs: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """``probs @ values`` over the values at ``slot`` without dequantizing them (needs :attr:`per_token_scale`).

        Args:
            probs: ``[..., M, S]`` float32; slot: ``[..., S]`` flat slots
        Returns:
            ``[..., M, head_dim]`` float32
        """
        codes, scale, zero = self._value_parts()
        c = unpack_codes_as(take(codes, slot), self.quant.bits, torch.float32, fp8=self.quant.is_float)  # [..., S, d]
        s, z = take(scale, slot).float(), take(zero, slot).float()  # [..., S, 1]
        out = torch.matmul(probs * s[..., 0][..., None, :], c).add_(torch.matmul(probs, z))
        return rotate(out, self.quant, inverse=True)  # p . (V R) R^T = p . V

    def _key_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Key codes, scales and zero points as ``[slots, ...]`` views."""
        return tuple(t.flatten(0, 1) for t in (self.key_codes, self.key_scale, self.key_zero))

    def _value_parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(t.flatten(0, 1) for t in (self.value_codes, self.value_scale, self.value_zero))

    def _entry_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.key_codes, self.value_codes, self.key_scale, self.key_zero, self.value_scale, self.value_zero)

    def _slot_tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self._key_parts(), *self._value_parts(), self.positions.view(-1), self.metric.view(-1))

    def entry_nbytes(self) -> int:
        return packed_entry_bytes(self.quant, self.head_dim)

    def __repr__(self) -> str:
        return (
            f"QuantizedBlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"head_dim={self.head_dim}, kv_quant={self.quant.name!r}, dtype={self.dtype}, free={self.num_free})"
        )


def packed_entry_bytes(fmt: KVQuant, head_dim: int) -> int:
    """Bytes of one pool entry (key + value of one KV head): codes plus per-token float16 scales and zero points."""
    groups = head_dim // fmt.value_group_for(head_dim)
    return 2 * head_dim * fmt.bits // 8 + 2 * 2 * groups * SCALE_DTYPE.itemsize
