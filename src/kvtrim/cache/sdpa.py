"""The one scaled-dot-product-attention entry point of kvtrim, with the CUDA backend chosen on purpose.

On CUDA, PyTorch's SDPA may pick the cuDNN backend, which builds an execution plan for every new shape. kvtrim's
caches change length every decoding step and, with per-layer budgets (PyramidKV) or ragged stores, differ per
layer, so every call would re-plan (decision 10, docs/decisions.md). Here CUDA calls go to:

* ``flash-attn``'s ``flash_attn_func`` when that optional package is importable and the call allows it
  (fp16/bf16, head_dim a multiple of 8 and at most 256, no explicit mask, causal only when queries and keys have
  the same length, since flash-attn aligns the causal mask bottom-right and SDPA top-left);
* otherwise SDPA restricted to FLASH_ATTENTION, then EFFICIENT_ATTENTION, with MATH as the last resort (never
  cuDNN).

Other devices (CPU, MPS, ...) call :func:`torch.nn.functional.scaled_dot_product_attention` unchanged.

The choice can be overridden with :func:`set_attention_backend` or the ``KVTRIM_ATTENTION_BACKEND`` environment
variable (the function wins); both apply to CUDA tensors.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from ..errors import InvalidParameterError

ENV_VAR = "KVTRIM_ATTENTION_BACKEND"
BACKENDS = ("auto", "flash", "efficient", "math", "cudnn", "flash_attn")
# SDPA backends per choice, in priority order; "auto" and "flash_attn" (for calls flash-attn cannot take) never
# include cuDNN.
_SDPA_LISTS: dict[str, list[SDPBackend]] = {
    "auto": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "flash_attn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "math": [SDPBackend.MATH],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
}
_FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)

_override: str | None = None


def _validate(name: object, source: str) -> str:
    if not isinstance(name, str) or name not in BACKENDS:
        raise InvalidParameterError(f"{source} must be one of {', '.join(BACKENDS)}; got {name!r}")
    return name


@functools.lru_cache(maxsize=1)
def flash_attn_function() -> Callable | None:
    """``flash_attn.flash_attn_func`` when the optional ``flash-attn`` package is importable, else None."""
    try:
        from flash_attn import flash_attn_func
    except Exception:  # not installed, or built for another torch/CUDA: kvtrim uses SDPA then
        return None
    return flash_attn_func


def set_attention_backend(name: str | None) -> None:
    """Pick the attention backend kvtrim uses on CUDA: ``auto`` (default), ``flash``, ``efficient``, ``math``,
    ``cudnn`` (SDPA restricted to that one backend), or ``flash_attn`` (the flash-attn package, SDPA as in
    ``auto`` for the calls it cannot take). None clears the override (``KVTRIM_ATTENTION_BACKEND`` or ``auto``).

    Raises:
        InvalidParameterError: an unknown name, or ``flash_attn`` without the flash-attn package.
    """
    global _override
    if name is None:
        _override = None
        return
    name = _validate(name, "attention backend")
    if name == "flash_attn" and flash_attn_function() is None:
        raise InvalidParameterError(
            "attention backend 'flash_attn' needs the flash-attn package (pip install flash-attn); it is not importable"
        )
    _override = name


def get_attention_backend() -> str:
    """The backend in force: the :func:`set_attention_backend` override, else ``KVTRIM_ATTENTION_BACKEND``, else
    ``auto``."""
    if _override is not None:
        return _override
    env = os.environ.get(ENV_VAR)
    if env is None or env == "":
        return "auto"
    return _validate(env.strip().lower(), f"{ENV_VAR}")


def sdpa_backends(choice: str) -> list[SDPBackend]:
    """The SDPA backends (priority order) allowed on CUDA under ``choice``."""
    return list(_SDPA_LISTS[_validate(choice, "attention backend")])


def flash_attn_fits(query: torch.Tensor, key: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool) -> bool:
    """Whether flash-attn's dense kernel can compute this call exactly (see the module notes)."""
    d = query.shape[-1]
    return (
        attn_mask is None
        and query.dtype in _FLASH_ATTN_DTYPES
        and key.dtype == query.dtype
        and d % 8 == 0
        and d <= 256
        and (not is_causal or query.shape[-2] == key.shape[-2])
        and query.shape[1] % key.shape[1] == 0
    )


def plan(query: torch.Tensor, key: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool) -> str:
    """``"default"`` (torch's own dispatch: not CUDA), ``"flash_attn"``, or ``"sdpa"`` (restricted list)."""
    if query.device.type != "cuda":
        return "default"
    choice = get_attention_backend()
    usable = choice in ("auto", "flash_attn") and flash_attn_function() is not None
    if usable and flash_attn_fits(query, key, attn_mask, is_causal):
        return "flash_attn"
    return "sdpa"


def sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """:func:`torch.nn.functional.scaled_dot_product_attention` with kvtrim's backend choice.

    Args:
        query: ``[batch, q_heads, q, head_dim]``
        key, value: ``[batch, kv_heads, s, head_dim]`` (``kv_heads`` divides ``q_heads`` when ``enable_gqa``)
        attn_mask: boolean ``[..., q, s]`` (True = visible) or additive, broadcastable; None for none
    Returns:
        ``[batch, q_heads, q, head_dim]``
    """
    how = plan(query, key, attn_mask, is_causal)
    if how == "default":
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    if how == "flash_attn":
        fn = flash_attn_function()
        # flash-attn takes [batch, seq, heads, head_dim] and serves GQA natively
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        return fn(q, k, v, softmax_scale=scale, causal=is_causal).transpose(1, 2)
    with sdpa_kernel(sdpa_backends(get_attention_backend()), set_priority=True):
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )


def sdpa_lower_right_causal(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None, enable_gqa: bool = False
) -> torch.Tensor:
    """Causal attention aligned at the end: query ``i`` of ``q`` sees keys ``0 .. s - q + i`` (a prompt chunk
    continuing a cache). Through torch's lower-right causal bias, so on CUDA the flash or memory-efficient kernel
    takes the alignment itself and no ``[q, s]`` mask is made; the CUDA backends are kvtrim's choice, as in
    :func:`sdpa`. Shapes as :func:`sdpa`; needs ``q <= s``."""
    bias = causal_lower_right(query.shape[-2], key.shape[-2])
    backends = (
        sdpa_kernel(sdpa_backends(get_attention_backend()), set_priority=True)
        if query.device.type == "cuda"
        else contextlib.nullcontext()
    )
    with backends:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scale, enable_gqa=enable_gqa)
