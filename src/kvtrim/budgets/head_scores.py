"""Per-head budgets in proportion to offline head-importance scores (HeadKV).

HeadKV (``ReasonSnapKVCluster`` in FYYFU/HeadKV) turns retrieval–reasoning head scores ``s[l, h]`` into
per-head capacities. With ``b = keep − window`` selected entries per head on average:

1. ``p = s / Σ s`` over all (layer, head); ``p = p^temperature``; ``p /= Σ p``;
2. ``pool = (b // β) · L · H`` and ``base = b − b // β``;
3. ``cap[l, h] = p[l, h] · pool + base``; each head keeps ``cap`` scored entries plus the window.

**Direction of β.** ``b // β`` is the per-head share that goes into the score-proportional pool. β close to 1
(1.005, 1.01) puts almost the whole budget into the pool, so budgets follow the scores closely and are very
uneven (heads with near-zero scores keep little more than their window); a large β (5, 10) leaves a pool of
``b/β`` per head and gives nearly uniform budgets. (HeadKV's README states the opposite; its code does this.)

**GQA.** kvtrim's cache stores KV heads, so the query-head capacities of each group are averaged
(KVCache-Factory's ``kv_head`` mode) before rounding. The budgets are then made exact and bounded:
each (layer, KV head) keeps between ``min_keep`` and the context length (window included), the capacity
that clamping frees (or lacks) is spread evenly over the heads that are not at a bound, and largest-remainder
rounding makes ``Σ budgets = L · H_kv · keep`` exactly whenever the bounds allow it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtrim.errors import InvalidParameterError

from .base import BudgetAllocator, BudgetRequest

__all__ = ["DEFAULT_BETA", "DEFAULT_TEMPERATURE", "HeadScoreBudget", "exact_bounded_round", "head_score_capacities"]

DEFAULT_BETA = 1.5
"""Default β (also HeadKV's ``run_longbench.py`` default; decision 9 (docs/decisions.md)). Chosen by the sweep in
``benchmarks/results/bench_headkv_beta_sweep/headkv_beta_sweep.md`` on the embedded model (10 passkey +
10 niah_single_2 at ~1k tokens, context-only): best at ratio 0.75 (80 vs 70–75 for β ≤ 1.2, 50 for β = 2, 0 for
β = 5), tied at 0.5, and with a larger guaranteed base per head than β near 1."""
DEFAULT_TEMPERATURE = 1.0
"""``p^temperature``; 1 in all HeadKV scripts. The sweep at β = 1.5 found 0.5 much worse and 2 no better."""


def head_score_capacities(scores: torch.Tensor, selected: int, beta: float, temperature: float = 1.0) -> torch.Tensor:
    """Real-valued HeadKV capacities ``p · pool + base`` (window excluded), ``[layers, heads]`` float64.

    ``selected`` is ``b = keep − window``; the mean of the result is ``b`` (up to ``b // β`` being floored).
    All-zero scores give uniform capacities ``b``.
    """
    s = scores.double().clamp(min=0)
    total = s.sum()
    if not torch.isfinite(total) or total <= 0:
        return torch.full_like(s, float(selected))
    p = s / total
    p = p.pow(temperature)
    p = p / p.sum()
    share = float(selected // beta)  # HeadKV floors with a float beta: b // β
    n = s.numel()
    return p * (share * n) + (selected - share)


def _spread(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, total: float) -> torch.Tensor:
    """Clamp ``x`` to ``[lo, hi]`` and spread the difference to ``total`` evenly over heads not at a bound."""
    x = torch.minimum(torch.maximum(x, lo), hi)
    for _ in range(x.numel() + 1):
        diff = total - float(x.sum())
        if abs(diff) < 1e-9:
            break
        free = (x < hi - 1e-12) if diff > 0 else (x > lo + 1e-12)
        count = int(free.sum())
        if count == 0:
            break
        x = torch.where(free, x + diff / count, x)
        x = torch.minimum(torch.maximum(x, lo), hi)
    return x


def exact_bounded_round(x: torch.Tensor, total: int, lo: int, hi: int) -> torch.Tensor:
    """Integers in ``[lo, hi]`` close to ``x`` summing to ``total`` (clamped to what the bounds allow).

    Clamped mass is spread evenly over the unclamped entries, then largest-remainder rounding fixes the sum.
    """
    n = x.numel()
    total = max(lo * n, min(hi * n, int(total)))
    lo_t = torch.full_like(x, float(lo), dtype=torch.float64)
    hi_t = torch.full_like(x, float(hi), dtype=torch.float64)
    y = _spread(x.double(), lo_t, hi_t, float(total))
    base = y.floor().clamp(lo, hi)
    missing = total - int(base.sum())
    flat = base.flatten().clone()
    if missing > 0:
        room = flat < hi
        remainder = (y.flatten() - flat).masked_fill(~room, -1.0)
        order = torch.argsort(remainder, descending=True, stable=True)
        take = order[: min(missing, int(room.sum()))]
        flat[take] += 1
    elif missing < 0:
        room = flat > lo
        remainder = (y.flatten() - flat).masked_fill(~room, 2.0)
        order = torch.argsort(remainder, stable=True)
        take = order[: min(-missing, int(room.sum()))]
        flat[take] -= 1
    return flat.view_as(x).long()


@dataclass
class HeadScoreBudget(BudgetAllocator):
    """HeadKV's per-head allocation from offline head scores, at KV-head granularity.

    Args:
        head_scores: ``[layers, q_heads]`` non-negative importance (e.g. the ``retrieval_reasoning`` tensor
            of the ``headkv`` artifact); ``[layers, kv_heads]`` is accepted as is
        beta: pool parameter β > 1; smaller β → larger score-proportional pool → more uneven budgets
        temperature: exponent on the normalised scores (1 = HeadKV)
        window: the observation / recent window kept by every head on top of its selected entries
        min_keep: smallest budget of a (layer, KV head), window included (default: the window, at least 1)
    Returns from :meth:`allocate`: ``[batch, layers, kv_heads]`` budgets, window included, summing to
    ``layers · kv_heads · keep`` per row.
    """

    head_scores: torch.Tensor
    beta: float = DEFAULT_BETA
    temperature: float = DEFAULT_TEMPERATURE
    window: int = 8
    min_keep: int | None = None
    source: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        scores = torch.as_tensor(self.head_scores).detach().to("cpu", torch.float64)
        if scores.dim() != 2 or scores.numel() == 0:
            raise InvalidParameterError(f"head_scores must be [layers, heads], got shape {tuple(scores.shape)}")
        if not bool(torch.isfinite(scores).all()) or bool((scores < 0).any()):
            raise InvalidParameterError("head_scores must be finite and non-negative")
        if not isinstance(self.beta, (int, float)) or not self.beta > 1.0:
            raise InvalidParameterError(f"beta must be a number > 1 (HeadKV sweeps 1.005 ... 10), got {self.beta!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature > 0:
            raise InvalidParameterError(f"temperature must be > 0, got {self.temperature!r}")
        if not isinstance(self.window, int) or self.window < 0:
            raise InvalidParameterError(f"window must be a non-negative integer, got {self.window!r}")
        if self.min_keep is not None and (not isinstance(self.min_keep, int) or self.min_keep < 1):
            raise InvalidParameterError(f"min_keep must be a positive integer, got {self.min_keep!r}")
        self.head_scores = scores

    @classmethod
    def from_artifact(
        cls, model: torch.nn.Module, path: str | Path | None = None, scores: str = "retrieval_reasoning", **kwargs: Any
    ) -> HeadScoreBudget:
        """Build from ``model``'s ``headkv`` artifact (``scores``: ``retrieval_reasoning`` or ``retrieval``).

        Raises :class:`~kvtrim.errors.MissingArtifactError` naming ``kvtrim calibrate headkv`` when none exists.
        """
        from kvtrim.artifacts.kinds import HEADKV_KIND
        from kvtrim.artifacts.store import load_artifact

        artifact = load_artifact(HEADKV_KIND, model, path)
        if scores not in artifact.tensors:
            raise InvalidParameterError(f"scores={scores!r}: the artifact holds {sorted(artifact.tensors)}")
        source = {"artifact": str(artifact.path), "model_key": artifact.meta.get("model_key"), "scores": scores}
        return cls(artifact.tensors[scores], source=source, **kwargs)

    def kv_capacities(self, selected: int, kv_heads: int) -> torch.Tensor:
        """Real-valued capacities ``[layers, kv_heads]`` (window excluded): group means of the query-head ones."""
        caps = head_score_capacities(self.head_scores, selected, self.beta, self.temperature)
        layers, heads = caps.shape
        if heads % kv_heads:
            raise InvalidParameterError(f"head_scores has {heads} heads, not a multiple of kv_heads={kv_heads}")
        return caps.view(layers, kv_heads, heads // kv_heads).mean(-1)

    def allocate(self, request: BudgetRequest, scores: list[torch.Tensor]) -> torch.Tensor:
        """``[batch, layers, kv_heads]`` budgets (window included); see the module notes."""
        layers = self.head_scores.shape[0]
        if layers != request.num_layers:
            raise InvalidParameterError(
                f"head_scores cover {layers} layers but the cache has {request.num_layers}; "
                "use the scores calibrated for this model"
            )
        rows = []
        for keep, context in zip(request.keep.tolist(), request.context_lengths.tolist(), strict=True):
            keep, context = int(keep), int(context)
            selected = keep - self.window
            if selected <= 0 or keep >= context:
                rows.append(
                    torch.full((layers, request.kv_heads), min(keep, context), dtype=torch.long, device="cpu")
                )
                continue
            caps = self.kv_capacities(selected, request.kv_heads) + self.window
            lo = min(self.min_keep if self.min_keep is not None else max(self.window, 1), keep)
            rows.append(exact_bounded_round(caps, keep * caps.numel(), lo, context))
        return torch.stack(rows).to(request.keep.device)
