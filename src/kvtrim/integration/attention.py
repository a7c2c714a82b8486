"""kvtrim's attention implementation for transformers (``attn_implementation="kvtrim"``).

When a :class:`~kvtrim.integration.cache.KVTrimCache` is in use, attention runs over its compacted storage with
masks built from logical positions. Otherwise it is ordinary causal attention with padding, so installing it
on a model changes nothing for other caches.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import AttentionInterface, AttentionMaskInterface

from ..cache.attention import grouped_attention
from ..cache.layer import take_current_layer
from ..errors import UnsupportedModelError
from . import hidden_states, prompt_ids

IMPLEMENTATION = "kvtrim"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def kvtrim_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention function with transformers' signature; returns ``([batch, q, q_heads, head_dim], None)``."""
    if scaling is None:
        scaling = module.head_dim**-0.5
    position_ids = kwargs.get("position_ids")
    layer = take_current_layer(module.layer_idx)
    if layer is not None:
        return layer.attend(module, query, position_ids, attention_mask, scaling), None
    # Any other cache (or none): keys are all tokens so far, in order; causal in slot space plus padding.
    q_len, kv_len = query.shape[2], key.shape[2]
    slots = torch.arange(kv_len, device=query.device)
    mask = slots[None, :] <= (slots[-q_len:] if q_len <= kv_len else slots)[:, None]  # [q, kv]
    mask = mask[None, None].expand(query.shape[0], key.shape[1], q_len, kv_len)
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, -kv_len:].to(torch.bool)
    return grouped_attention(query, key, value, mask, scaling), None


def kvtrim_mask(batch_size: int, q_length: int, kv_length: int, attention_mask=None, **kwargs):
    """Mask builder paired with :func:`kvtrim_attention`: pass the 2-D padding mask through unchanged.

    kvtrim builds per-layer masks from stored positions, so one shared 4-D mask (sized for the first layer)
    would be wrong for compressed layers of different lengths.
    """
    return attention_mask


_registered = False


def register() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    global _registered
    if not _registered:
        AttentionInterface.register(IMPLEMENTATION, kvtrim_attention)
        AttentionMaskInterface.register(IMPLEMENTATION, kvtrim_mask)
        _registered = True


def check_supported(model: torch.nn.Module) -> None:
    """Raise :class:`UnsupportedModelError` unless kvtrim can compress this model's cache."""
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError("model has no transformers config; pass a transformers causal LM")
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type={model_type!r} is not supported; supported architectures: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    layer_types = getattr(config, "layer_types", None) or []
    sliding = [t for t in layer_types if t != "full_attention"]
    if sliding or (getattr(config, "use_sliding_window", True) and getattr(config, "sliding_window", None)):
        raise UnsupportedModelError(
            f"{model_type} with sliding-window attention is not supported (sliding_window="
            f"{getattr(config, 'sliding_window', None)}, layer_types={sorted(set(layer_types))}); "
            "only full-attention layers can be compressed"
        )
    if not getattr(model, "_supports_attention_backend", False):
        raise UnsupportedModelError(
            f"{type(model).__name__} does not route attention through transformers' AttentionInterface"
        )


def enable(model: torch.nn.Module) -> str:
    """Install kvtrim attention on ``model``; returns the implementation it replaced."""
    check_supported(model)
    register()
    prompt_ids.install(model)
    hidden_states.install(model)
    previous = model.config._attn_implementation
    if previous != IMPLEMENTATION:
        model.set_attn_implementation(IMPLEMENTATION)
    return previous


def disable(model: torch.nn.Module, previous: str) -> None:
    """Restore the attention implementation that :func:`enable` replaced."""
    if previous and previous != IMPLEMENTATION:
        model.set_attn_implementation(previous)


@contextmanager
def kvtrim_attention_enabled(model: torch.nn.Module):
    """Context manager: kvtrim attention inside, the original implementation restored after."""
    previous = enable(model)
    try:
        yield model
    finally:
        disable(model, previous)
