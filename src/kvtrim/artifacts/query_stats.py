"""Loading the ``expected_attention_stats`` artifact (per-layer query statistics for Expected Attention);
:mod:`kvtrim.calibration.query_stats` writes it.

Tensors: ``query_mean`` ``[layers, q_heads, head_dim]`` and ``query_cov`` ``[layers, q_heads, head_dim, head_dim]``
of the pre-RoPE queries.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import InvalidParameterError
from .kinds import EXPECTED_ATTENTION_STATS_KIND
from .store import load_artifact, model_identity

__all__ = ["EXPECTED_ATTENTION_STATS_KIND", "load_query_statistics"]


def load_query_statistics(model: torch.nn.Module, path: str | Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(query_mean, query_cov)`` of ``model``'s ``expected_attention_stats`` artifact (fp32).

    Raises :class:`~kvtrim.errors.MissingArtifactError` naming ``kvtrim calibrate expected_attention_stats`` when
    none exists.
    """
    artifact = load_artifact(EXPECTED_ATTENTION_STATS_KIND, model, path)
    identity = model_identity(model)
    mean, cov = artifact.tensors.get("query_mean"), artifact.tensors.get("query_cov")
    shape = (identity["num_layers"], identity["num_attention_heads"], identity["head_dim"])
    if mean is None or cov is None or tuple(mean.shape) != shape or tuple(cov.shape) != (*shape, shape[-1]):
        raise InvalidParameterError(
            f"{artifact.path}: expected query_mean {shape} and query_cov {(*shape, shape[-1])}"
        )
    return mean.float(), cov.float()
