"""CompilerKV's stabilized token utility with head-weighted max-pooling (arXiv 2602.08686, eq. 6-10)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..artifacts.compilerkv import KIND, TableSource
from .base import LayerView, Scorer
from .observation import ObservationSpec
from .risk import EPS, RiskSignals, local_perplexity, structural_entropy

UTILITIES = ("stabilized", "raw")
ALPHAS = ("cross_layer", "window_cumulative")
RHOS = ("per_head", "head_mean")


def _position_scatter(values: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
    """Sum ``values`` ``[batch, seq]`` into a ``[batch, length]`` buffer indexed by ``positions`` (-1 dropped)."""
    out = torch.zeros(values.shape[0], length + 1, dtype=torch.float64, device=values.device)
    out.scatter_add_(1, positions.clamp(min=-1).add(1), values.double())  # slot 0 collects empty slots
    return out[:, 1:]


@dataclass
class StabilizedUtilityScorer(Scorer):
    """û_t = max_h W[l, h] · u_t^{(l,h)}, one score per token shared by every KV head of a layer.

    * ``utility="stabilized"`` (default, the v2 operator): u = α · ρ with α_t = (T/W) Σ_{j∈Ω} mean_{l,h} A_{j,t}
      (window attention averaged over all layers and heads; mean over tokens = 1) and ρ_t^{(l,g)} = ‖v_t‖₂ / mean ‖v‖₂
      per layer and KV head, repeated to the query heads of the group.
    * ``utility="raw"`` (ablation): u^{(l,h)} = (T/W) Σ_{j∈Ω} A^{(l,h)}_{j,t}, the layer's own window attention
      per query head, no value term.
    * ``alpha="window_cumulative"`` (v1 option): α_t = Σ_{j=t}^{t+32} Ā_{j,t}, the layer's head-mean attention
      from the next 32 queries (needs the full attention during prefill), scaled to mean 1.
    * ``rho="head_mean"`` (v1 option): ρ from the norm of the head-mean value, the same for every head.

    The head weights come from ``tables`` (the compiled head reliability table, or all ones for the neutral
    ablation). ``prepare`` also computes the prompt's risk signals (entropy of α/Σα and the local perplexity of
    the last ``window`` prompt tokens) for the threshold gate, in ``view.shared["risk"]``.
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = True
    question_aware = True

    tables: TableSource
    window: int = 64
    utility: str = "stabilized"
    alpha: str = "cross_layer"
    rho: str = "per_head"
    band: int = 32
    observation: ObservationSpec = field(init=False)

    def __post_init__(self) -> None:
        if self.window <= 0:
            raise ValueError(f"window must be positive, got {self.window}")
        for name, value, allowed in (("utility", self.utility, UTILITIES), ("alpha", self.alpha, ALPHAS)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if self.rho not in RHOS:
            raise ValueError(f"rho must be one of {RHOS}, got {self.rho!r}")
        accumulate = ("attn_band_sum",) if self.alpha == "window_cumulative" else ()
        self.observation = ObservationSpec(
            window=self.window, token_logprobs=self.window, accumulate=accumulate, band=self.band
        )

    @property
    def artifact_kind(self) -> str | None:
        """The calibration artifact it reads (none for the neutral tables)."""
        return None if self.tables.neutral else KIND

    def bind(self, model: torch.nn.Module) -> None:
        self.tables.bind(model)

    # ------------------------------------------------------------------ cross-layer quantities
    @staticmethod
    def _window_mass(view: LayerView, window: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``([batch, q_heads, seq] mass from the window queries, [batch] valid window queries)``."""
        probs = view.window_attention(window)  # [b, hq, w, seq]
        qpos = view.observation.positions[:, -probs.shape[2] :]
        return probs.sum(2), (qpos >= 0).sum(-1).clamp(min=1)

    def prepare(self, views: list[LayerView]) -> None:
        """Cross-layer α (position-indexed), risk signals, and the rows' compiled-budget indices."""
        first = views[0]
        context = first.context_lengths.clamp(min=1)
        length = int(context.max())
        total = torch.zeros(first.keys.shape[0], length, dtype=torch.float64, device=first.keys.device)
        for view in views:
            mass, n_queries = self._window_mass(view, self.window)
            head_mean = mass.mean(1)  # [b, seq] (every KV head holds the same slots in a prefill-only cache)
            total += _position_scatter(head_mean, view.positions[:, 0], length) / n_queries[:, None]
        alpha = total / len(views) * context[:, None].double()  # (T/W) Σ_j mean_{l,h} A: mean over tokens = 1
        valid = torch.arange(length, device=context.device)[None, :] < context[:, None]
        shared = first.shared
        shared["alpha"] = alpha.float()
        shared["risk"] = RiskSignals(
            entropy=structural_entropy(alpha, valid),
            perplexity=local_perplexity(first.prompt_logprobs, first.keys.shape[0], first.keys.device),
        )
        keep = shared.get("keep")
        budgets = keep if keep is not None else first.context_lengths
        shared["budget_index"], shared["compiled_budget"] = self.tables.budget_info(budgets)

    # ------------------------------------------------------------------ per layer
    def _alpha(self, view: LayerView) -> torch.Tensor:
        """``[batch, kv_heads, seq]`` attention term of every slot."""
        pos = view.positions
        if self.alpha == "window_cumulative":
            hq = view.observation.queries.shape[1]
            band = view.stats["attn_band_sum"].sum(1, keepdim=True) / hq  # head-mean attention from the band
            band = band.masked_fill(pos < 0, 0.0)
            mean = band.sum(-1, keepdim=True) / (pos >= 0).sum(-1, keepdim=True).clamp(min=1)
            return (band / mean.clamp(min=EPS)).expand_as(pos)
        alpha = view.shared["alpha"]
        return torch.gather(alpha[:, None, :].expand(-1, pos.shape[1], -1), 2, pos.clamp(min=0))

    def _rho(self, view: LayerView) -> torch.Tensor:
        """``[batch, kv_heads, seq]`` value norm relative to its mean over the valid slots."""
        valid = view.valid
        v = view.values.float()
        norms = v.mean(1, keepdim=True).norm(dim=-1) if self.rho == "head_mean" else v.norm(dim=-1)
        norms = norms.masked_fill(~valid[:, : norms.shape[1]], 0.0)
        mean = norms.sum(-1, keepdim=True) / valid[:, : norms.shape[1]].sum(-1, keepdim=True).clamp(min=1)
        return (norms / (mean + EPS)).expand_as(view.positions)

    def per_query_head(self, view: LayerView) -> torch.Tensor:
        """``[batch, q_heads, seq]`` utility u^{(l,h)} before the head weights."""
        hq = view.observation.queries.shape[1]
        group = hq // view.kv_heads
        if self.utility == "raw":
            mass, n_queries = self._window_mass(view, self.window)
            return mass * (view.context_lengths.clamp(min=1) / n_queries)[:, None, None]
        u = self._alpha(view) * self._rho(view)  # [b, kv, seq]
        return u.repeat_interleave(group, dim=1)

    def score(self, view: LayerView) -> torch.Tensor:
        u = self.per_query_head(view)  # [b, hq, seq]
        weights = self.tables.head_weights(view.layer_idx, view.shared["budget_index"], u.shape[1])  # [b, hq]
        utility = (weights[:, :, None] * u).amax(1, keepdim=True)  # weighted max over heads, never a mean
        return utility.masked_fill(~view.valid[:, :1], float("-inf")).expand(-1, view.kv_heads, -1)
