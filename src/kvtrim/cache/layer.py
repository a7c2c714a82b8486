"""The hand-over between a cache layer and kvtrim's attention function.

A cache layer's ``update`` only parks the new keys and values (:func:`hand_over`); kvtrim's attention function
(``integration.attention``) takes them (:func:`take_current_layer`), stores them with their logical positions and
padding, and attends over what is stored. This split exists because transformers passes positions and padding to
the attention function, not to the cache.
"""

from __future__ import annotations

import threading

import torch

from ..errors import UnsupportedModelError

_CURRENT = threading.local()


def take_current_layer(layer_idx: int):
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
