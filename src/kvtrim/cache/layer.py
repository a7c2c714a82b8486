"""A transformers cache layer whose entries can be evicted for real.

``update`` only hands the new keys and values over; kvtrim's attention function (``integration.attention``)
then stores them with their logical positions and padding, attends over what is stored, and records what
the compression method needs. This split exists because transformers passes positions and padding to the
attention function, not to the cache.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

from ..errors import UnsupportedModelError
from ..scoring.observation import LayerObservation, record
from .dense import INVALID, DenseStore
from .ragged import RaggedStore

if TYPE_CHECKING:
    from .kvcache import KVTrimCache

_CURRENT = threading.local()


def take_current_layer(layer_idx: int) -> CompressibleLayer | None:
    """The kvtrim layer whose ``update`` just ran for ``layer_idx`` in this thread, if any (consumed once)."""
    layer = getattr(_CURRENT, "layer", None)
    _CURRENT.layer = None
    if layer is None or layer.layer_idx != layer_idx or layer._pending is None:
        return None
    return layer


def raise_if_unconsumed(cache, fix: str) -> None:
    """Raise if the entries a layer of ``cache`` handed over were never taken by kvtrim's attention function (the
    model runs another attention implementation); ``fix`` says what to do instead."""
    if cache._unconsumed is not None:
        cache._unconsumed = None
        raise UnsupportedModelError(
            f"a {type(cache).__name__} was updated but kvtrim's attention function never consumed the entries: {fix}"
        )


def hand_over(layer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """Park a layer's new entries for kvtrim's attention function, which takes them with :func:`take_current_layer`
    and calls ``layer.attend``."""
    layer._pending = (key_states, value_states)
    layer.cache._unconsumed = layer.layer_idx
    _CURRENT.layer = layer


class CompressibleLayer(CacheLayerMixin):
    """One layer of a :class:`KVTrimCache`.

    ``seen`` counts token columns seen so far (including padding), which is what transformers uses to slice
    inputs and build default positions; the store holds only what was kept.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, cache: KVTrimCache, layer_idx: int):
        self.is_initialized = False
        self._cache = weakref.ref(cache)  # the cache owns its layers; a strong back-reference would form a cycle
        self.layer_idx = layer_idx
        self.store: DenseStore | RaggedStore | None = None
        self.seen = 0
        self.observation = LayerObservation()
        self.module: torch.nn.Module | None = None
        self.compressed_until: torch.Tensor | None = None  # [batch], set by recursive methods (LagKV)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def cache(self) -> KVTrimCache:
        return self._cache()

    @property
    def pending(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(keys, values)`` ``[batch, kv_heads, q, head_dim]`` handed over by ``update`` and not yet stored by
        :meth:`attend` (None between forward passes)."""
        return self._pending

    # transformers reads .keys/.values on some code paths (device, dtype); expose the stored entries.
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.store is None else self.store.keys

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.store is None else self.store.values

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.store = DenseStore.empty(b, h, d, key_states.dtype, key_states.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise_if_unconsumed(
            self.cache,
            "the model must run with attn_implementation='kvtrim': use kvtrim.compressing(model, ...) or "
            "kvtrim.make_cache(model, ...), which install it",
        )
        if self.layer_idx == 0:
            self.cache._before_forward(key_states.shape[2])
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        hand_over(self, key_states, value_states)
        return key_states, value_states

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        position_ids: torch.Tensor | None,
        padding_mask: torch.Tensor | None,
        scaling: float,
    ) -> torch.Tensor:
        """Store the pending tokens, attend over the store, record observations.

        Args:
            query: ``[batch, q_heads, q, head_dim]`` post-rotary
            position_ids: ``[1 or batch, q]`` or None (then positions continue from ``seen``)
            padding_mask: ``[batch, >= q]`` boolean, the last ``q`` columns flag real tokens; None = no padding
        Returns:
            ``[batch, q, q_heads, head_dim]``
        """
        keys, values = self._pending
        self._pending = None
        self.cache._unconsumed = None
        self.module = module
        b, _, q, _ = keys.shape
        if position_ids is None:
            positions = torch.arange(self.seen, self.seen + q, device=keys.device).expand(b, q)
        else:
            positions = position_ids.to(keys.device).expand(b, q)
        valid = None
        if padding_mask is not None:
            if padding_mask.shape[-1] < q:
                raise ValueError(f"attention_mask has {padding_mask.shape[-1]} columns for {q} new tokens")
            valid = padding_mask[:, -q:].to(torch.bool)
            # A prompt chunk is checked once (cheaper attention when nothing is padding); a decoding step is not
            # read back (no host sync): its token is masked on the device if the mask says it is padding.
            if q > 1 and bool(valid.all()):
                valid = None
        positions = positions.long() if valid is None else positions.long().masked_fill(~valid, INVALID)
        store = self.store
        fresh = (
            store.layout == "dense" and store.is_empty and valid is None and bool((positions.diff(dim=1) == 1).all())
        )
        store.append(keys, values, positions, padded=valid is not None)
        out = store.attend(query, positions, scaling, fresh_causal=fresh)
        self.seen += q
        if self.cache.observing:
            record(self.cache.observation_spec, self.observation, store, query, positions, scaling)
        return out

    # ------------------------------------------------------------------ transformers Cache protocol
    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store = None
        self.seen = 0
        self.is_initialized = False
        self.observation = LayerObservation()
        self.compressed_until = None
        self._pending = None

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` appended tokens (assisted decoding)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        n = -tokens_to_remove
        if n == 0 or self.store is None:
            return
        self.store.truncate_to(
            self.store.mark() - n if self.store.layout == "dense" else (self.store.mark() - n).clamp(min=0)
        )
        self.seen -= n

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.store is not None:
            self.store.select_batch(beam_idx.to(self.store.positions.device))
        if self.compressed_until is not None:
            self.compressed_until = self.compressed_until[beam_idx.to(self.compressed_until.device)]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store is not None:
            idx = torch.arange(self.store.batch_size, device=self.store.positions.device)
            self.store.select_batch(idx.repeat_interleave(repeats))
        if self.compressed_until is not None:
            self.compressed_until = self.compressed_until.repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.store is not None:
            self.store.select_batch(indices)
        if self.compressed_until is not None:
            self.compressed_until = self.compressed_until[indices]
