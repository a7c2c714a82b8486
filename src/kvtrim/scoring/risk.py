"""Risk signals of a prompt (CompilerKV): structural entropy of the window attention and local perplexity."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..artifacts.compilerkv import bin_index

__all__ = ["EPS", "RiskSignals", "bin_index", "local_perplexity", "quantile_edges", "structural_entropy"]

EPS = 1e-8


@dataclass(frozen=True)
class RiskSignals:
    """Per-row risk of compressing a prompt.

    Attributes:
        entropy: ``[batch]`` natural-log entropy of the normalized window attention mass over the stored tokens
        perplexity: ``[batch]`` exp of the mean negative log-prob of the last prompt tokens (NaN when unknown)
    """

    entropy: torch.Tensor
    perplexity: torch.Tensor


def structural_entropy(mass: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Entropy ``H = −Σ_t Ã_t log(Ã_t + ε)`` of ``mass`` ``[batch, seq]`` normalized over the ``valid`` slots."""
    mass = mass.double().masked_fill(~valid, 0.0).clamp(min=0.0)
    p = mass / mass.sum(-1, keepdim=True).clamp(min=EPS)
    return -(p * (p + EPS).log()).sum(-1).float()


def local_perplexity(
    logprobs: torch.Tensor | None, batch: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """``exp(−mean log p)`` over the finite entries of ``logprobs`` ``[batch, w]``; NaN for rows without any.

    ``device`` places the all-NaN result when ``logprobs`` is None (default: CPU).
    """
    if logprobs is None:
        return torch.full((batch,), float("nan"), device=device if device is not None else "cpu")
    finite = torch.isfinite(logprobs)
    count = finite.sum(-1)
    mean = torch.where(finite, logprobs, torch.zeros_like(logprobs)).sum(-1) / count.clamp(min=1)
    return torch.where(count > 0, (-mean).exp(), torch.full_like(mean, float("nan")))


def quantile_edges(values: torch.Tensor, bins: int) -> torch.Tensor:
    """The ``bins − 1`` inner equal-frequency edges of ``values`` (the calibration distribution)."""
    if bins < 2:
        raise ValueError(f"bins must be at least 2, got {bins}")
    q = torch.linspace(0, 1, bins + 1, dtype=torch.float64, device=values.device)[1:-1]
    return torch.quantile(values.double(), q).float()
