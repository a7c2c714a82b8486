"""Scoring every new token from the hidden states entering each attention layer, for a
:class:`~kvtrim.integration.cache.KVTrimCache` whose method asks for it (``ObservationSpec.token_scores``: KVzap's
learned surrogate reads the hidden states, which the attention function never sees).

A forward pre-hook on every attention module (installed once per model by
:func:`~kvtrim.integration.attention.enable`) hands ``hidden_states`` to the cache, which scores them while it is
observing; the scores are stored as a per-slot statistic when the layer stores the tokens. It does nothing for any
other cache, or when the method needs no token scores.
"""

from __future__ import annotations

import weakref

import torch

_HOOKED = "_kvtrim_hidden_states_hook"


class RecordsHiddenStates:
    """A cache that scores the hidden states entering attention (:class:`~kvtrim.integration.cache.KVTrimCache`)."""

    def record_hidden_states(self, model: torch.nn.Module, layer_idx: int, hidden: torch.Tensor) -> None:
        """Take ``hidden`` ``[batch, q, hidden_size]``, the input of layer ``layer_idx``'s attention."""
        raise NotImplementedError


def _hook(model_ref: weakref.ref):
    def record(module, args, kwargs) -> None:
        cache = kwargs.get("past_key_values")
        if not isinstance(cache, RecordsHiddenStates):
            return
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        model = model_ref()
        if hidden is not None and model is not None:
            cache.record_hidden_states(model, int(module.layer_idx), hidden)

    return record


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules of ``model``'s decoder layers (those with a ``layer_idx`` and an ``o_proj``)."""
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "o_proj")]


def install(model: torch.nn.Module) -> None:
    """Add the recording pre-hook to every attention module of ``model`` (idempotent)."""
    if getattr(model, _HOOKED, False):
        return
    ref = weakref.ref(model)
    for module in attention_modules(model):
        module.register_forward_pre_hook(_hook(ref), with_kwargs=True)
    setattr(model, _HOOKED, True)
