"""LU-KV budgets: per-(layer, KV head) shares of the cache read from offline budget curves.

LU-KV (Tang et al., "Predicting Future Utility: Global Combinatorial Optimization for Task-Agnostic KV Cache
Eviction", arXiv 2602.08585) allocates the cache across heads by the marginal *future* utility of what each head
keeps under its scorer: offline, on calibration prompts, each head's retained-utility curve (utility of its top-b
entries by the scorer, for every b) is relaxed to its concave hull and a greedy solver hands out the global budget
by marginal utility; the resulting per-head keep fractions, averaged over prompts, are stored for a grid of
compression ratios (the ``lukv`` artifact, ``kvtrim calibrate lukv``).

At compression, a row keeping ``B`` of ``T`` entries per head on average (ratio ``r = 1 − B/T``) reads the
fractions at ``r`` (linear interpolation between the grid's ratios; kvpress rounds to the nearest percent), and
head ``(l, h)`` keeps about ``f_{l,h}(r)·T`` entries, rounded so the row's total is exactly ``layers·heads·B``
(each head between its protected window and ``T``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..artifacts.lukv import LUKV_KIND, load_lukv_curves
from ..errors import InvalidParameterError
from .base import BudgetAllocator, BudgetRequest
from .head_scores import exact_bounded_round

__all__ = ["LUKV_KIND", "UtilityCurveBudget", "keep_fractions_at"]


def keep_fractions_at(ratios: torch.Tensor, keep_fractions: torch.Tensor, ratio: float) -> torch.Tensor:
    """``[layers, kv_heads]`` keep fractions at ``ratio``: linear interpolation of ``keep_fractions``
    ``[R, layers, kv_heads]`` over the increasing ``ratios`` ``[R]``; ratio 0 keeps everything (fraction 1), ratios
    past the grid's last use its last fractions."""
    grid = torch.cat([ratios.new_zeros(1), ratios.double()])
    values = torch.cat([torch.ones_like(keep_fractions[:1]), keep_fractions.double()])
    if ratio >= float(grid[-1]):
        return values[-1]
    hi = sum(1 for g in grid.tolist() if g <= ratio)  # first grid point above the ratio
    lo = hi - 1
    t = (ratio - float(grid[lo])) / max(float(grid[hi] - grid[lo]), 1e-12)
    return values[lo] * (1 - t) + values[hi] * t


@dataclass
class UtilityCurveBudget(BudgetAllocator):
    """Per-(layer, KV head) budgets from LU-KV budget curves (see the module notes).

    Args:
        protected: entries every head keeps whatever its curve says (the selector's sinks + recent window)
        path: artifact file or directory (default: search the kvtrim home, then the shipped artifacts)
        ratios, keep_fractions: ``[R]`` and ``[R, layers, kv_heads]`` curves given directly instead of an artifact
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    varies_by = "head"
    artifact_kind = LUKV_KIND

    protected: int = 5
    path: str | None = None
    ratios: torch.Tensor | None = None
    keep_fractions: torch.Tensor | None = None
    source: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.protected, bool) or not isinstance(self.protected, int) or self.protected < 0:
            raise InvalidParameterError(f"protected must be a non-negative integer (tokens), got {self.protected!r}")
        if (self.ratios is None) != (self.keep_fractions is None):
            raise InvalidParameterError("give both ratios and keep_fractions, or neither (load the lukv artifact)")
        if self.ratios is not None:
            self.ratios, self.keep_fractions = _checked(self.ratios, self.keep_fractions)
            self.source = {"given": True}

    def bind(self, model: torch.nn.Module) -> None:
        """Load the curves of ``model`` (not when they were given directly)."""
        if self.source.get("given"):
            return
        ratios, keep, self.source = load_lukv_curves(model, self.path)
        self.ratios, self.keep_fractions = _checked(ratios, keep)

    def allocate(self, request: BudgetRequest, scores: list[torch.Tensor]) -> torch.Tensor:
        """``[batch, layers, kv_heads]`` entries kept, summing to ``layers · kv_heads · keep`` per row."""
        if self.keep_fractions is None:
            raise InvalidParameterError(
                "lukv needs the model's budget curves: resolve the method through kvtrim.generate, kvtrim.Session "
                "or kvtrim.compressing, or call pipeline.bind(model) first"
            )
        _, layers, kv_heads = self.keep_fractions.shape
        if (layers, kv_heads) != (request.num_layers, request.kv_heads):
            raise InvalidParameterError(
                f"the LU-KV curves cover {layers} layers x {kv_heads} KV heads but the cache has "
                f"{request.num_layers} x {request.kv_heads}; use the artifact calibrated for this model"
            )
        rows = []
        n = layers * kv_heads
        for keep, context in zip(request.keep.tolist(), request.context_lengths.tolist(), strict=True):
            keep, context = int(keep), int(context)
            if keep >= context:
                device = self.keep_fractions.device
                rows.append(torch.full((layers, kv_heads), context, dtype=torch.long, device=device))
                continue
            fractions = keep_fractions_at(self.ratios, self.keep_fractions, 1.0 - keep / max(context, 1))
            lo = min(self.protected, keep)
            rows.append(exact_bounded_round(fractions * context, keep * n, lo, context))
        return torch.stack(rows).to(request.keep.device)

    def describe_compression(self, shared: dict) -> dict:
        return {"lukv_artifact": self.source.get("artifact")} if self.source.get("artifact") else {}


def _checked(ratios: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ratios = torch.as_tensor(ratios).double()
    keep = torch.as_tensor(keep).double()
    if ratios.dim() != 1 or keep.dim() != 3 or keep.shape[0] != ratios.shape[0] or ratios.numel() == 0:
        raise InvalidParameterError("ratios must be [R] and keep_fractions [R, layers, kv_heads]")
    if not bool(((ratios > 0) & (ratios < 1)).all()) or not bool((ratios.diff() > 0).all()):
        raise InvalidParameterError("ratios must increase strictly inside (0, 1)")
    if not bool(torch.isfinite(keep).all()) or not bool(((keep >= 0) & (keep <= 1)).all()):
        raise InvalidParameterError("keep_fractions must be finite, in [0, 1]")
    return ratios, keep
