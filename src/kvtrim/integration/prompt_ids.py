"""Recording the prompt's token ids into a :class:`~kvtrim.integration.cache.KVTrimCache` whose method asks for them
(``ObservationSpec.input_ids``: KVzip feeds the prompt to the model again at compression time).

The cache never sees token ids, so a forward pre-hook on the base model (installed once per model by
:func:`~kvtrim.integration.attention.enable`) reads ``input_ids`` and ``attention_mask`` from the call. It does
nothing for any other cache, or once the prompt is compressed (unless the method keeps observing).
"""

from __future__ import annotations

import torch

_HOOKED = "_kvtrim_prompt_ids_hook"


def _record(module, args, kwargs) -> None:
    from .cache import KVTrimCache

    cache = kwargs.get("past_key_values")
    ids = kwargs.get("input_ids")
    if not isinstance(cache, KVTrimCache) or ids is None or not cache.observation_spec.input_ids:
        return
    if not (cache.observing or cache.compressions == 0):
        return  # compressed and no longer observing: these tokens (a question, an answer) are not the prompt
    if cache.compression.prefilled_uncompressed and cache.auto_compress:
        return  # this forward compresses the prompt first: its tokens come after the prompt
    mask = kwargs.get("attention_mask")
    ids = ids.long()
    if mask is not None and mask.dim() == 2:
        ids = ids.masked_fill(~mask[:, -ids.shape[1] :].to(torch.bool), -1)
    cache.prompt_ids = ids if cache.prompt_ids is None else torch.cat([cache.prompt_ids, ids], dim=1)


def install(model: torch.nn.Module) -> None:
    """Add the recording pre-hook to ``model``'s base model (idempotent)."""
    base = getattr(model, "base_model", model)
    if not getattr(base, _HOOKED, False):
        base.register_forward_pre_hook(_record, with_kwargs=True)
        setattr(base, _HOOKED, True)
