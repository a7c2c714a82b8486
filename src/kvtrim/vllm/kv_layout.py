"""Reading and writing whole blocks of a vLLM paged KV cache, whatever the backend packs inside a block.

vLLM's CPU backend stores keys transposed inside a block for its vector kernels, AMX packs them differently
again, and GPU backends use other layouts. Rather than re-implement each, :func:`probe_layout` writes index
patterns with the backend's own cache-update op into a two-block scratch cache once per layer geometry and
learns where every (slot, head, channel) of keys and values lands. Reads and writes are then one gather/scatter.
The probe checks itself on random data and refuses layouts that are not a plain permutation (e.g. fp8 caches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class BlockLayout:
    """Where a block's entries lie in the flat cache.

    Attributes:
        key_index, value_index: ``[block_size, kv_heads, head_dim]`` flat offsets inside block 0
        block_stride: flat distance between consecutive blocks (the cache is block-major)
    """

    key_index: torch.Tensor
    value_index: torch.Tensor
    block_stride: int

    @property
    def block_size(self) -> int:
        return self.key_index.shape[0]

    def _offsets(self, index: torch.Tensor, blocks: torch.Tensor, count: int) -> torch.Tensor:
        """``[count, kv_heads, head_dim]`` flat offsets of the first ``count`` slots of ``blocks``."""
        per_block = blocks.to(index.device, torch.long).view(-1, 1, 1, 1) * self.block_stride + index
        return per_block.reshape(-1, *index.shape[1:])[:count]

    def read(self, cache: torch.Tensor, blocks: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[count, kv_heads, head_dim]`` of slots ``0 … count-1`` of a request's ``blocks``."""
        flat = cache.view(-1)
        return flat[self._offsets(self.key_index, blocks, count)], flat[self._offsets(self.value_index, blocks, count)]

    def write(self, cache: torch.Tensor, blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``keys``/``values`` ``[n, kv_heads, head_dim]`` in slots ``0 … n-1`` of ``blocks``."""
        flat = cache.view(-1)
        n = keys.shape[0]
        flat[self._offsets(self.key_index, blocks, n)] = keys.to(flat.dtype)
        flat[self._offsets(self.value_index, blocks, n)] = values.to(flat.dtype)


def probe_layout(impl, layer, kv_cache: torch.Tensor) -> BlockLayout:
    """Learn the block layout of ``kv_cache`` (block-major, ``[num_blocks, …]``) from ``impl.do_kv_cache_update``.

    Args:
        impl: the layer's vLLM ``AttentionImpl`` (must provide ``do_kv_cache_update``)
        layer: the vLLM ``Attention`` layer (passed through to the op)
        kv_cache: the layer's real cache; only its per-block shape and dtype are used
    """
    # A backend that redirects its step's writes (kvtrim's folded CPU attention) exposes its plain write too.
    update = getattr(impl, "plain_kv_cache_update", None) or getattr(impl, "do_kv_cache_update", None)
    if update is None:
        raise UnsupportedModelError(
            f"attention backend {type(impl).__name__} has no do_kv_cache_update: kvtrim cannot locate its entries"
        )
    block_shape = tuple(kv_cache.shape[1:])
    kv_heads, head_dim = impl.num_kv_heads, impl.head_size
    per_block = kv_cache[0].numel()
    block_size = per_block // (2 * kv_heads * head_dim)
    if block_size * 2 * kv_heads * head_dim != per_block:
        raise UnsupportedModelError(f"cannot read a KV block of shape {block_shape} (expected 2·block·heads·dim)")
    device, dtype = kv_cache.device, kv_cache.dtype
    slots = torch.arange(block_size, device=device)
    locate = {}
    # Three passes (slot, head, channel), each with small integers that every float dtype holds exactly.
    coords = {
        "slot": torch.arange(block_size, device=device).view(-1, 1, 1).expand(block_size, kv_heads, head_dim),
        "head": torch.arange(kv_heads, device=device).view(1, -1, 1).expand(block_size, kv_heads, head_dim),
        "chan": torch.arange(head_dim, device=device).view(1, 1, -1).expand(block_size, kv_heads, head_dim),
    }
    for name, coord in coords.items():
        scratch = torch.full((2, *block_shape), float("nan"), dtype=dtype, device=device)
        # keys hold c >= 0, values -(c+1) < 0: integers up to 256, exact even in bfloat16
        update(layer, coord.to(dtype).contiguous(), (-(coord + 1)).to(dtype).contiguous(), scratch, slots)
        locate[name] = scratch[0].reshape(-1).float()
    slot, head, chan = locate["slot"], locate["head"], locate["chan"]
    is_key, is_value = slot >= 0, slot < 0  # NaN (never written) is neither
    key_index = torch.full((block_size, kv_heads, head_dim), -1, dtype=torch.long, device=device)
    value_index = torch.full_like(key_index, -1)
    where = torch.arange(slot.numel(), device=device)
    for mask, index, sign in ((is_key, key_index, 1), (is_value, value_index, -1)):
        s, h, c = ((sign * x[mask] - int(sign < 0)) for x in (slot, head, chan))
        bounds = ((s, block_size), (h, kv_heads), (c, head_dim))
        if any(bool(((x < 0) | (x >= n) | (x != x.round())).any()) for x, n in bounds):
            raise UnsupportedModelError(
                f"the {type(impl).__name__} cache layout is not a permutation of (slot, head, channel); "
                "kvtrim cannot compact it (quantized KV caches are not supported)"
            )
        index[s.long(), h.long(), c.long()] = where[mask]
    if bool((key_index < 0).any()) or bool((value_index < 0).any()):
        raise UnsupportedModelError(
            f"the {type(impl).__name__} cache layout is not a permutation of (slot, head, channel); "
            "kvtrim cannot compact it (quantized KV caches are not supported)"
        )
    layout = BlockLayout(key_index, value_index, block_stride=kv_cache[0].numel())
    _self_check(update, layer, layout, block_shape, block_size, kv_heads, head_dim, dtype, device)
    return layout


def _self_check(update, layer, layout, block_shape, block_size, kv_heads, head_dim, dtype, device) -> None:
    scratch = torch.zeros((3, *block_shape), dtype=dtype, device=device)
    n = block_size + block_size // 2
    key = torch.randn(n, kv_heads, head_dim, device=device).to(dtype)
    value = torch.randn(n, kv_heads, head_dim, device=device).to(dtype)
    update(layer, key, value, scratch, torch.arange(block_size, block_size + n, device=device))
    k, v = layout.read(scratch, torch.tensor([1, 2], device=device), n)
    if not (torch.equal(k, key) and torch.equal(v, value)):
        raise UnsupportedModelError(f"kvtrim's block-layout probe failed for {type(layer).__name__}: refusing to evict")
