"""Capacity-aware scores: query-weighted leverage of the values (CapKV)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import InvalidParameterError
from .base import LayerView, Scorer
from .expected_attention import ALL_QUERIES, future_rotation, query_statistics, unrotate
from .observation import ObservationSpec
from .rope import rope_frequencies


def capacity_scores(
    keys: torch.Tensor, values: torch.Tensor, anchor: torch.Tensor, scored: torch.Tensor, tau: float, eps: float
) -> torch.Tensor:
    """``s_i = w_i · v_iᵀ A⁻¹ v_i`` with ``A = I + Σ_j (w_j + eps) v_j v_jᵀ`` and ``w_i = exp(τ·cos(k_i, anchor))``
    (shifted so the largest weight of a head is 1), per query head, averaged over the GQA group.

    An entry scores high when the query anchor points at its key and its value adds a direction the other
    weighted values do not already cover (its leverage); copies of one value share the credit.

    Args:
        keys, values: ``[batch, kv_heads, seq, d]``
        anchor: ``[batch, q_heads, d]`` the expected direction of future queries
        scored: ``[batch, kv_heads, seq]`` True for the entries that take part (not sinks, not padding)
    Returns:
        ``[batch, kv_heads, seq]`` fp32, 0 where not ``scored``
    """
    b, hkv, _, d = keys.shape
    unit_k = torch.nn.functional.normalize(keys.float(), dim=-1)
    unit_q = torch.nn.functional.normalize(anchor.float(), dim=-1).view(b, hkv, -1, d)
    stat = torch.einsum("bhgd,bhsd->bhgs", unit_q, unit_k).clamp(-1.0, 1.0)
    logits = (tau * stat).masked_fill(~scored[:, :, None], float("-inf"))
    top = logits.amax(-1, keepdim=True).clamp(min=-tau)  # a head with nothing scored: every weight 0
    weights = torch.exp(logits - top)  # [b, hkv, g, s]
    v = values.float()
    mass = (weights + eps) * scored[:, :, None]
    eye = torch.eye(d, device=keys.device, dtype=torch.float32)
    capacity = eye + torch.einsum("bhgs,bhsd,bhse->bhgde", mass, v, v)  # [b, hkv, g, d, d]
    solved = torch.linalg.solve(capacity, v.transpose(-1, -2)[:, :, None])  # [b, hkv, g, d, s], broadcast over g
    leverage = (v.transpose(-1, -2)[:, :, None] * solved).sum(-2)  # [b, hkv, g, s]
    return (weights * leverage).mean(2) * scored


@dataclass
class CapacityScorer(Scorer):
    """CapKV ("Rethinking KV Cache Eviction via a Unified Information-Theoretic Objective", arXiv 2604.25975):
    keep the entries that preserve most of the retained cache's information capacity, approximated by leverage
    scores of the values weighted by how much a future query attends each key.

    The query anchor is the mean of the prompt's pre-RoPE queries (the first ``n_sink`` positions left out),
    moved to the next ``n_future`` positions with the averaged rotary rotation (Expected Attention's
    construction); ``w_i = exp(τ·cos(k_i, anchor))`` and the score is :func:`capacity_scores`. Following kvpress's
    CapPress, keys and anchor are unit-normalized and the weights max-shifted (the paper's unnormalized dot
    product overflows ``exp``), and the value stands for the output direction. Sinks are left out of the sums
    (the selector keeps them). Query-agnostic: every prompt query feeds the anchor.
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = False
    question_aware = False

    tau: float = 5.0
    n_future: int = 512
    n_sink: int = 4
    eps: float = 1e-6
    observation: ObservationSpec = field(init=False)

    def __post_init__(self) -> None:
        for name, low in (("n_future", 1), ("n_sink", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidParameterError(f"{name} must be an integer >= {low}, got {value!r}")
        for name in ("tau", "eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise InvalidParameterError(f"{name} must be a finite number >= 0, got {value!r}")
        self.observation = ObservationSpec(window=ALL_QUERIES)

    def anchor(self, view: LayerView) -> torch.Tensor:
        """``[batch, q_heads, d]`` the mean pre-RoPE prompt query moved ``n_future`` positions ahead."""
        obs = view.observation
        config = getattr(view.module, "config", None)
        if obs.queries is None or config is None:
            raise RuntimeError(f"layer {view.layer_idx}: CapKV needs the prompt's recorded queries and the config")
        device = view.keys.device
        inv_freq, rope_scale = rope_frequencies(config, view.keys.shape[-1], device)
        positions = obs.positions.to(device)
        queries = unrotate(obs.queries.to(device), positions, inv_freq, rope_scale)
        mean, _ = query_statistics(queries, positions, self.n_sink, use_covariance=False)
        rot = future_rotation(view.context_lengths, self.n_future, inv_freq, rope_scale)  # [b, d, d]
        return torch.einsum("bij,bhj->bhi", rot, mean)

    def score(self, view: LayerView) -> torch.Tensor:
        scored = view.valid & (view.positions >= self.n_sink)
        return capacity_scores(view.keys, view.values, self.anchor(view), scored, self.tau, self.eps)
