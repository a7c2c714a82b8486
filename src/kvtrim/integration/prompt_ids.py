"""Recording the prompt's token ids into a :class:`~kvtrim.integration.cache.KVTrimCache` whose method asks for them
(``ObservationSpec.input_ids``: KVzip feeds the prompt to the model again at compression time).

The cache never sees token ids, so a forward pre-hook on the base model (installed once per model by
:func:`~kvtrim.integration.attention.enable`) reads ``input_ids`` and ``attention_mask`` from the call. It does
nothing for any other cache, or once the prompt is compressed (unless the method keeps observing).
"""

from __future__ import annotations

import torch

_HOOKED = "_kvtrim_prompt_ids_hook"


class RecordsPromptIds:
    """A cache that takes the prompt's token ids from the hook (:class:`~kvtrim.integration.cache.KVTrimCache`)."""

    def record_prompt_ids(self, ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Take ``ids`` ``[batch, q]`` of a forward call (``attention_mask`` ``[batch, >= q]`` or None)."""
        raise NotImplementedError


def _record(module, args, kwargs) -> None:
    cache = kwargs.get("past_key_values")
    ids = kwargs.get("input_ids")
    if isinstance(cache, RecordsPromptIds) and ids is not None:
        cache.record_prompt_ids(ids, kwargs.get("attention_mask"))


def install(model: torch.nn.Module) -> None:
    """Add the recording pre-hook to ``model``'s base model (idempotent)."""
    base = getattr(model, "base_model", model)
    if not getattr(base, _HOOKED, False):
        base.register_forward_pre_hook(_record, with_kwargs=True)
        setattr(base, _HOOKED, True)
