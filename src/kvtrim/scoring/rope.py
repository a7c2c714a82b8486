"""The rotary position embedding of a model, rebuilt from its config (for scorers that move queries in
position: un-rotating recorded queries, rotating them to future positions)."""

from __future__ import annotations

import torch

from ..errors import UnsupportedModelError


def rope_frequencies(config, head_dim: int, device: torch.device) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim // 2], attention_scaling)`` as transformers' rotary embedding computes them.

    Raises :class:`UnsupportedModelError` for dynamic RoPE (its frequencies depend on the sequence length) and for
    partial rotary embeddings.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type == "dynamic":
        raise UnsupportedModelError("rope_type='dynamic' is not supported: its frequencies change with the length")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        inv_freq, scaling = 1.0 / (float(base) ** exponents), 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, device)
        inv_freq = inv_freq.to(device=device, dtype=torch.float32)
    if 2 * inv_freq.numel() != head_dim:
        raise UnsupportedModelError(
            f"partial rotary embeddings are not supported (rotary dim {2 * inv_freq.numel()} != head_dim {head_dim})"
        )
    return inv_freq, float(scaling)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` ``[*positions.shape, head_dim]`` fp32 for integer ``positions`` (transformers' layout:
    the angles repeated over both halves)."""
    angles = positions.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last axis (the ``P`` of ``R = diag(cos) + diag(sin) P``)."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate_half_matrix(head_dim: int, device: torch.device) -> torch.Tensor:
    """``P`` ``[head_dim, head_dim]`` with ``P @ x == rotate_half(x)``."""
    half = head_dim // 2
    eye = torch.eye(half, device=device)
    p = torch.zeros(head_dim, head_dim, device=device)
    p[:half, half:] = -eye
    p[half:, :half] = eye
    return p
