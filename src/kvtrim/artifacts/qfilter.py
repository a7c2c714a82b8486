"""Loading the ``qfilter`` artifact (Q-Filters key-space directions); :mod:`kvtrim.calibration.qfilter` writes it."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import InvalidParameterError
from .kinds import QFILTER_KIND
from .store import load_artifact

__all__ = ["QFILTER_KIND", "load_qfilters"]


def load_qfilters(model: torch.nn.Module, path: str | Path | None = None) -> tuple[torch.Tensor, dict]:
    """The ``[layers, kv_heads, head_dim]`` unit filters of ``model``'s ``qfilter`` artifact and its metadata.

    Raises :class:`~kvtrim.errors.MissingArtifactError` naming ``kvtrim calibrate qfilter`` when none exists.
    """
    artifact = load_artifact(QFILTER_KIND, model, path)
    filters = artifact.tensors.get("filters")
    if filters is None or filters.dim() != 3:
        raise InvalidParameterError(
            f"{artifact.path}: a qfilter artifact needs a 3-D 'filters' tensor [layers, kv_heads, head_dim]"
        )
    return filters.float(), {"artifact": str(artifact.path), "model_key": artifact.meta.get("model_key")}
