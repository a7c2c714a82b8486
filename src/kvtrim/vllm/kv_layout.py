"""Reading and writing whole blocks of a vLLM paged KV cache, whatever the backend packs inside a block.

vLLM's CPU backend stores keys transposed inside a block for its vector kernels, AMX packs them differently
again, and GPU backends use other layouts. Rather than re-implement each, :func:`probe_layout` writes index
patterns with the backend's own cache-update op into a two-block scratch cache once per layer geometry and
learns where every (slot, head, channel) of keys and values lands. Reads and writes are then one gather/scatter:
through a strided view of the cache when the map is affine inside a block (vLLM's layouts are), else through flat
offsets. The probe checks itself on random data and refuses layouts that are not a plain permutation.

Entries are held either in a float dtype (``kv_cache_dtype="auto"``, ``"float16"``, ``"bfloat16"``) or as fp8
(``"fp8"`` = ``"fp8_e4m3"``, ``"fp8_e5m2"``): one byte per element in a ``uint8`` cache, the bit pattern of the
float8 number ``x / scale`` with one scale per layer for keys (``k_scale``) and one for values (``v_scale``).
Both are one element per (slot, head, channel), so the same probe finds them (:class:`EntryFormat` reads the
probe's digits back). Compaction moves the stored elements unchanged (fp8 bytes are never re-encoded: vLLM's
CPU kernel rounds toward zero when it encodes, so decoding and encoding again could change a byte); scoring reads
them decoded, ``code · scale`` (:meth:`EntryFormat.decode`). Other vLLM cache formats (per-token-head scales,
packed 4-bit codes, MLA latent caches) are refused by :func:`entry_format`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..errors import InvalidParameterError, UnsupportedModelError

PLAIN_CACHE_DTYPES = ("auto", "float16", "bfloat16")
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
# Why each other vLLM 0.32 ``CacheDType`` cannot be compacted by moving one element per (slot, head, channel).
_REFUSED_CACHE_DTYPES = {
    "per_token_head": "its codes carry a scale per (token, head) held beside them, which compaction would have to "
    "move with every kept entry (not built)",
    "nvfp4": "it packs two 4-bit codes per byte with block scales, so an entry is not one element",
    "turboquant": "it packs sub-byte codes, so an entry is not one element",
    "ultraquant": "it packs sub-byte codes, so an entry is not one element",
    "ds_mla": "it is an MLA latent cache (one latent vector per token, no keys and values per KV head)",
    "fp8_inc": "it is Intel Gaudi's fp8 format, on a platform the plugin does not run on",
}


@dataclass(frozen=True)
class EntryFormat:
    """How the elements of a vLLM KV cache are held.

    Attributes:
        kv_cache_dtype: vLLM's ``--kv-cache-dtype``
        fp8: the float8 type whose bit patterns a ``uint8`` cache holds (scaled per layer), or None: elements in
            the cache's own float dtype
    """

    kv_cache_dtype: str = "auto"
    fp8: torch.dtype | None = None

    def decode(self, stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """Elements as attention sees them, in ``dtype``: ``stored`` itself when unquantized, ``code · scale`` for
        fp8 (``scale``: the layer's ``k_scale`` or ``v_scale``)."""
        if self.fp8 is None:
            return stored.to(dtype)
        return stored.view(self.fp8).to(dtype).mul_(scale)

    def fill_value(self) -> torch.Tensor:
        """A stored element that decodes to NaN (what the probe's scratch cache starts as)."""
        if self.fp8 is None:
            return torch.tensor(float("nan"))
        return torch.tensor(float("nan")).to(self.fp8).view(torch.uint8)


def _affine(index: torch.Tensor) -> tuple[int, tuple[int, int, int]] | None:
    """``(o, (a, b, d))`` when ``index`` ``[block_size, kv_heads, head_dim]`` is ``o + slot·a + head·b +
    channel·d`` everywhere (the block is a strided view, e.g. vLLM's CPU keys stored ``[head, channel, slot]``),
    else None."""
    o = int(index[0, 0, 0])
    strides = tuple(
        int(index.narrow(dim, 1, 1).flatten()[0]) - o if index.shape[dim] > 1 else 0 for dim in range(3)
    )
    grid = torch.tensor(o, dtype=index.dtype, device=index.device)
    for dim, stride in enumerate(strides):
        shape = [1, 1, 1]
        shape[dim] = index.shape[dim]
        grid = grid + torch.arange(index.shape[dim], dtype=index.dtype, device=index.device).view(shape) * stride
    if min(strides) < 0 or not torch.equal(grid, index):
        return None
    return o, strides


def entry_format(kv_cache_dtype: str, fnuz: bool = False) -> EntryFormat:
    """The :class:`EntryFormat` of vLLM's ``kv_cache_dtype`` (``fnuz``: the platform's fp8 is the ``fnuz``
    variant, as on ROCm); raises :class:`InvalidParameterError` for a format the plugin cannot compact."""
    if kv_cache_dtype in PLAIN_CACHE_DTYPES:
        return EntryFormat(kv_cache_dtype)
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return EntryFormat(kv_cache_dtype, torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn)
    if kv_cache_dtype == "fp8_e5m2":
        return EntryFormat(kv_cache_dtype, torch.float8_e5m2fnuz if fnuz else torch.float8_e5m2)
    why = next((why for key, why in _REFUSED_CACHE_DTYPES.items() if key in kv_cache_dtype), "it is not known")
    raise InvalidParameterError(
        f"kv_cache_dtype={kv_cache_dtype!r}: kvtrim's vLLM plugin compacts caches that hold one element per (slot, "
        f"head, channel), in the model's dtype or as fp8 with one scale per layer: kv_cache_dtype must be one of "
        f"{PLAIN_CACHE_DTYPES + FP8_CACHE_DTYPES}; {kv_cache_dtype!r} is refused because {why}"
    )


@dataclass(frozen=True)
class BlockLayout:
    """Where a block's entries lie in the flat cache.

    Attributes:
        key_index, value_index: ``[block_size, kv_heads, head_dim]`` flat offsets inside block 0
        block_stride: flat distance between consecutive blocks (the cache is block-major)
        entry: how each element is held (:meth:`read` and :meth:`write` move stored elements: fp8 bytes as
            bytes; :meth:`EntryFormat.decode` gives what attention sees)
    """

    key_index: torch.Tensor
    value_index: torch.Tensor
    block_stride: int
    entry: EntryFormat = EntryFormat()

    @property
    def block_size(self) -> int:
        return self.key_index.shape[0]

    @cached_property
    def _strides(self) -> tuple[tuple[int, tuple[int, int, int]] | None, tuple[int, tuple[int, int, int]] | None]:
        """Keys' and values' ``(offset, (slot, head, channel) strides)`` inside a block when each map is affine
        (:func:`_affine`: vLLM's CPU and GPU layouts are), else None for that map."""
        return _affine(self.key_index), _affine(self.value_index)

    def _views(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values as strided views ``[num_blocks, block_size, kv_heads, head_dim]`` of ``cache`` (no
        copy), or None when a map is not affine (reads and writes then gather flat offsets)."""
        key, value = self._strides
        if key is None or value is None:
            return None
        flat = cache.view(-1)
        num_blocks = flat.numel() // self.block_stride
        size = (num_blocks, *self.key_index.shape)
        return tuple(
            flat.as_strided(size, (self.block_stride, *strides), flat.storage_offset() + offset)
            for offset, strides in (key, value)
        )

    def _offsets(self, index: torch.Tensor, blocks: torch.Tensor, count: int) -> torch.Tensor:
        """``[count, kv_heads, head_dim]`` flat offsets of the first ``count`` slots of ``blocks``."""
        per_block = blocks.to(index.device, torch.long).view(-1, 1, 1, 1) * self.block_stride + index
        return per_block.reshape(-1, *index.shape[1:])[:count]

    def _first_slots(self, blocks: torch.Tensor, count: int) -> torch.Tensor:
        """Slots ``[count]`` (``block · block_size + offset``) of the first ``count`` entries of ``blocks``."""
        i = torch.arange(count, device=blocks.device)
        return blocks.to(torch.long)[i // self.block_size] * self.block_size + i % self.block_size

    def read(self, cache: torch.Tensor, blocks: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[count, kv_heads, head_dim]`` of slots ``0 … count-1`` of a request's ``blocks``, as
        stored (fp8: the ``uint8`` codes)."""
        views = self._views(cache)
        if views is not None:
            blocks = blocks.to(cache.device, torch.long)
            return tuple(v[blocks].reshape(-1, *v.shape[2:])[:count] for v in views)
        flat = cache.view(-1)
        return flat[self._offsets(self.key_index, blocks, count)], flat[self._offsets(self.value_index, blocks, count)]

    def _slot_offsets(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat offsets ``[n, kv_heads, head_dim]`` of the keys and of the values at ``slots`` ``[n]``."""
        slots = slots.to(self.key_index.device, torch.long)
        base = (slots // self.block_size).view(-1, 1, 1) * self.block_stride
        offset = slots % self.block_size
        return base + self.key_index[offset], base + self.value_index[offset]

    def read_slots(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[n, kv_heads, head_dim]`` at ``slots`` ``[n]`` (``block · block_size + offset``), as
        stored."""
        views = self._views(cache)
        if views is not None:
            slots = slots.to(cache.device, torch.long)
            block, offset = slots // self.block_size, slots % self.block_size
            return views[0][block, offset], views[1][block, offset]
        flat = cache.view(-1)
        key_at, value_at = self._slot_offsets(slots)
        return flat[key_at], flat[value_at]

    def write_slots(self, cache: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values`` ``[n, kv_heads, head_dim]`` (stored elements) at ``slots`` ``[n]``
        (``block · block_size + offset``)."""
        views = self._views(cache)
        if views is not None:
            slots = slots.to(cache.device, torch.long)
            block, offset = slots // self.block_size, slots % self.block_size
            views[0][block, offset] = keys.to(cache.dtype)
            views[1][block, offset] = values.to(cache.dtype)
            return
        flat = cache.view(-1)
        key_at, value_at = self._slot_offsets(slots)
        flat[key_at] = keys.to(flat.dtype)
        flat[value_at] = values.to(flat.dtype)

    def one_head(self) -> BlockLayout:
        """The layout of the cache's one-head sub-pages (head ``h`` of block ``b`` is sub-page ``b·H + h``,
        :mod:`kvtrim.vllm.folded_attention`): head 0's map, at ``block_stride / H``. Raises
        :class:`UnsupportedModelError` unless every head's slice of a block is laid out alike (head-major)."""
        cached = self.__dict__.get("_one_head")  # built once per layout (the scorers ask at every round)
        if cached is not None:
            return cached
        heads = self.key_index.shape[1]
        stride = self.block_stride // heads
        shift = torch.arange(heads, device=self.key_index.device).view(1, -1, 1) * stride
        for index in (self.key_index, self.value_index):
            local = index - shift
            if self.block_stride % heads or not torch.equal(local, local[:, :1].expand_as(local)):
                raise UnsupportedModelError("the cache's blocks are not head-major: no one-head sub-pages")
        key_index, value_index = self.key_index[:, :1].contiguous(), self.value_index[:, :1].contiguous()
        self.__dict__["_one_head"] = BlockLayout(key_index, value_index, stride, self.entry)
        return self.__dict__["_one_head"]

    def write(self, cache: torch.Tensor, blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values`` ``[n, kv_heads, head_dim]`` (as :meth:`read` returns them: stored elements) in
        slots ``0 … n-1`` of ``blocks``."""
        if self._views(cache) is not None:
            return self.write_slots(cache, self._first_slots(blocks.to(cache.device), keys.shape[0]), keys, values)
        flat = cache.view(-1)
        n = keys.shape[0]
        flat[self._offsets(self.key_index, blocks, n)] = keys.to(flat.dtype)
        flat[self._offsets(self.value_index, blocks, n)] = values.to(flat.dtype)


class _UnitScales:
    """The attention layer seen by the backend's cache write, with ``k_scale = v_scale = 1`` (the probe's integer
    digits are then stored exactly, whatever the layer's own scales)."""

    def __init__(self, layer, device):
        self._layer = layer
        self._k_scale_float = self._v_scale_float = 1.0
        self._k_scale = self._v_scale = torch.ones((), dtype=torch.float32, device=device)

    def __getattr__(self, name):
        return getattr(self._layer, name)


_BASE = 8  # digits 0 … 7 and -1 … -8: exact in every float dtype and in both fp8 formats


def _digits(n: int) -> int:
    """Base-8 digits needed for the integers ``0 … n-1``."""
    count = 1
    while _BASE**count < n:
        count += 1
    return count


def _refuse(impl) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"the {type(impl).__name__} cache layout is not a permutation of (slot, head, channel); kvtrim cannot "
        "compact it"
    )


def probe_layout(
    impl, layer, kv_cache: torch.Tensor, dtype: torch.dtype | None = None, fnuz: bool = False
) -> BlockLayout:
    """Learn the block layout of ``kv_cache`` (block-major, ``[num_blocks, …]``) from ``impl.do_kv_cache_update``.

    Args:
        impl: the layer's vLLM ``AttentionImpl`` (must provide ``do_kv_cache_update``; its ``kv_cache_dtype``, when
            it has one, says how elements are held, see :func:`entry_format`)
        layer: the vLLM ``Attention`` layer (passed through to the op, with unit scales)
        kv_cache: the layer's real cache; only its per-block shape and dtype are used
        dtype: the model's dtype (of the keys and values the op takes); None: the cache's own dtype
        fnuz: the platform's fp8 numbers are the ``fnuz`` variants (ROCm)
    """
    # A backend that redirects its step's writes (kvtrim's folded CPU attention) exposes its plain write too.
    update = getattr(impl, "plain_kv_cache_update", None) or getattr(impl, "do_kv_cache_update", None)
    if update is None:
        raise UnsupportedModelError(
            f"attention backend {type(impl).__name__} has no do_kv_cache_update: kvtrim cannot locate its entries"
        )
    entry = entry_format(getattr(impl, "kv_cache_dtype", "auto"), fnuz)
    dtype = kv_cache.dtype if dtype is None else dtype
    layer = _UnitScales(layer, kv_cache.device)
    block_shape = tuple(kv_cache.shape[1:])
    kv_heads, head_dim = impl.num_kv_heads, impl.head_size
    per_block = kv_cache[0].numel()
    block_size = per_block // (2 * kv_heads * head_dim)
    if block_size * 2 * kv_heads * head_dim != per_block:
        raise UnsupportedModelError(f"cannot read a KV block of shape {block_shape} (expected 2·block·heads·dim)")
    device = kv_cache.device
    slots = torch.arange(block_size, device=device)
    shape = (block_size, kv_heads, head_dim)
    coords = {  # (coordinate of every written element, its range)
        "slot": (torch.arange(block_size, device=device).view(-1, 1, 1).expand(shape), block_size),
        "head": (torch.arange(kv_heads, device=device).view(1, -1, 1).expand(shape), kv_heads),
        "chan": (torch.arange(head_dim, device=device).view(1, 1, -1).expand(shape), head_dim),
    }
    fill = entry.fill_value().to(device=device, dtype=kv_cache.dtype)
    is_key = None
    found = {}
    # One pass per base-8 digit of each coordinate: keys hold the digit d >= 0, values -(d + 1) < 0.
    for name, (coord, n) in coords.items():
        found[name] = torch.zeros(per_block, dtype=torch.long, device=device)
        for power in range(_digits(n)):
            digit = coord.div(_BASE**power, rounding_mode="floor") % _BASE
            scratch = fill.expand(2, *block_shape).clone()
            update(layer, digit.to(dtype).contiguous(), (-(digit + 1)).to(dtype).contiguous(), scratch, slots)
            read = entry.decode(scratch[0].reshape(-1), 1.0, torch.float32)
            key, value = read >= 0, read < 0  # NaN (never written) is neither
            if is_key is None:
                is_key, is_value = key, value
            if not (torch.equal(key, is_key) and torch.equal(value, is_value)):
                raise _refuse(impl)
            got = torch.where(is_key, read, -read - 1).nan_to_num(0.0)
            if bool(((got < 0) | (got >= _BASE) | (got != got.round())).any()):
                raise _refuse(impl)
            found[name] += got.long() * _BASE**power
    where = torch.arange(per_block, device=device)
    key_index = torch.full(shape, -1, dtype=torch.long, device=device)
    value_index = torch.full_like(key_index, -1)
    for mask, index in ((is_key, key_index), (is_value, value_index)):
        s, h, c = (found[name][mask] for name in coords)
        if bool(((s >= block_size) | (h >= kv_heads) | (c >= head_dim)).any()):
            raise _refuse(impl)
        index[s, h, c] = where[mask]
    if bool((key_index < 0).any()) or bool((value_index < 0).any()):
        raise _refuse(impl)
    layout = BlockLayout(key_index, value_index, block_stride=per_block, entry=entry)
    _self_check(update, layer, layout, block_shape, block_size, kv_heads, head_dim, dtype, kv_cache.dtype, device)
    return layout


def _exact_values(n: int, kv_heads: int, head_dim: int, device) -> torch.Tensor:
    """Random ``±(1 + m/4)·2^e`` (``m`` in 0 … 3, ``e`` in -3 … 3): exact in every float dtype and both fp8
    formats, so any encoder (whatever its rounding) stores them exactly."""
    shape = (n, kv_heads, head_dim)
    mantissa = 1 + torch.randint(0, 4, shape, device=device) / 4
    sign = torch.randint(0, 2, shape, device=device) * 2 - 1
    return sign * mantissa * torch.pow(2.0, torch.randint(-3, 4, shape, device=device).float())


def _self_check(update, layer, layout, block_shape, block_size, kv_heads, head_dim, dtype, cache_dtype, device):
    scratch = torch.zeros((3, *block_shape), dtype=cache_dtype, device=device)
    n = block_size + block_size // 2
    key = _exact_values(n, kv_heads, head_dim, device).to(dtype)
    value = _exact_values(n, kv_heads, head_dim, device).to(dtype)
    update(layer, key, value, scratch, torch.arange(block_size, block_size + n, device=device))
    k, v = layout.read(scratch, torch.tensor([1, 2], device=device), n)
    decode = layout.entry.decode
    if not (torch.equal(decode(k, 1.0, dtype), key) and torch.equal(decode(v, 1.0, dtype), value)):
        raise UnsupportedModelError(
            f"kvtrim's block-layout probe failed for {type(layer._layer).__name__}: refusing to evict"
        )
