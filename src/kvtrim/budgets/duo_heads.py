"""DuoAttention head budgets: retrieval heads keep the whole context, streaming heads keep sinks + recent tokens.

DuoAttention (Xiao et al., "DuoAttention: Efficient Long-Context LLM Inference with Retrieval and Streaming
Heads", ICLR 2025, arXiv 2410.10819) learns a gate ``α ∈ [0, 1]`` per (layer, KV head) offline; at deployment
the heads with the lowest gates become *streaming* heads (attention sinks plus a recent window) and the others
*retrieval* heads with the full cache. The gates come from the ``duo`` calibration artifact
(``kvtrim calibrate duo``).

**Ratio → head split.** kvtrim lets the requested size choose how many heads stream, so a ratio (or budget)
means the same memory as for every other method: with ``N = layers · kv_heads`` heads, context ``T``, streaming
window ``W = sink + recent`` and mean keep ``B`` per head, the ``n_s = ⌈N (T − B) / (T − W)⌉`` lowest-gate heads
stream (at most ``N``), so the kept total ``(N − n_s)·T + n_s·W`` is at most ``N·B``. When even ``n_s = N``
keeps more than ``N·B`` (``B < W``), every head streams with a window of ``B`` tokens (``min(sink, B)`` sinks).
The paper instead fixes the split (a 0.5 gate threshold or a sparsity quantile) and lets memory follow.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..artifacts.duo import DUO_KIND, load_duo_gates
from ..errors import InvalidParameterError
from .base import BudgetAllocator, BudgetRequest

__all__ = ["DUO_KIND", "DuoHeadBudget", "load_duo_gates", "streaming_head_order"]


def streaming_head_order(gates: torch.Tensor) -> torch.Tensor:
    """``[layers * kv_heads]`` rank of each head in streaming order (0 = lowest gate = first to stream); ties
    broken by (layer, head) order."""
    order = torch.sort(gates.flatten(), stable=True).indices
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))


@dataclass
class DuoHeadBudget(BudgetAllocator):
    """Per-(layer, KV head) budgets from DuoAttention gates (see the module notes for the ratio mapping).

    Args:
        sink, recent: a streaming head's attention sinks and recent window (tokens)
        path: artifact file or directory (default: search the kvtrim home, then the shipped artifacts)
        gates: ``[layers, kv_heads]`` gates given directly (tests, user patterns) instead of an artifact
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    varies_by = "head"
    artifact_kind = DUO_KIND
    runs_in_vllm = True  # counts fixed before scoring: one-head sub-pages sized by the largest layer (kvtrim.vllm)

    sink: int = 16
    recent: int = 48
    path: str | None = None
    gates: torch.Tensor | None = None
    source: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        for name in ("sink", "recent"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidParameterError(f"{name} must be a non-negative integer (tokens), got {value!r}")
        if self.sink + self.recent <= 0:
            raise InvalidParameterError("sink + recent must be positive: a streaming head must keep something")
        if self.gates is not None:
            gates = torch.as_tensor(self.gates).float()
            if gates.dim() != 2 or not bool(torch.isfinite(gates).all()):
                raise InvalidParameterError("gates must be a finite [layers, kv_heads] tensor")
            self.gates = gates
            self.source = {"given": True}

    def bind(self, model: torch.nn.Module) -> None:
        """Load the gates of ``model`` (not when they were given directly)."""
        if self.source.get("given"):
            return
        self.gates, self.source = load_duo_gates(model, self.path)

    def allocate(self, request: BudgetRequest, scores: list[torch.Tensor]) -> torch.Tensor:
        """``[batch, layers, kv_heads]``: the context for retrieval heads, ``sink + recent`` for streaming ones."""
        if self.gates is None:
            raise InvalidParameterError(
                "duo_attention needs the model's head gates: resolve the method through kvtrim.generate, "
                "kvtrim.Session or kvtrim.compressing, or call pipeline.bind(model) first"
            )
        layers, kv_heads = self.gates.shape
        if (layers, kv_heads) != (request.num_layers, request.kv_heads):
            raise InvalidParameterError(
                f"the duo gates cover {layers} layers x {kv_heads} KV heads but the cache has "
                f"{request.num_layers} x {request.kv_heads}; use the artifact calibrated for this model"
            )
        device = request.keep.device
        n = layers * kv_heads
        context = request.context_lengths.long()  # [batch]
        keep = torch.minimum(request.keep.long(), context)
        window = torch.clamp(context * 0 + (self.sink + self.recent), max=context)
        span = (context - window).clamp(min=1)
        n_stream = torch.clamp((n * (context - keep) + span - 1) // span, min=0, max=n)
        # B < W: even with every head streaming the windows exceed the budget, so every head keeps B tokens.
        window = torch.where((n_stream >= n) & (window > keep), keep, window)
        rank = streaming_head_order(self.gates.to(device))  # [n]
        streaming = rank[None, :] < n_stream[:, None]  # [batch, n]
        budgets = torch.where(streaming, window[:, None], context[:, None])
        return budgets.view(-1, layers, kv_heads)

    def streaming_mask(self, request: BudgetRequest) -> torch.Tensor:
        """``[batch, layers, kv_heads]`` True for the heads :meth:`allocate` makes streaming."""
        budgets = self.allocate(request, [])
        return budgets < request.context_lengths.view(-1, 1, 1)
