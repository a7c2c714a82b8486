"""Loading the ``lukv`` artifact (LU-KV per-head budget curves); :mod:`kvtrim.calibration.lukv` writes it."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import InvalidParameterError
from .kinds import LUKV_KIND
from .store import load_artifact

__all__ = ["LUKV_KIND", "load_lukv_curves"]


def load_lukv_curves(model: torch.nn.Module, path: str | Path | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """``(ratios [R], keep_fractions [R, layers, kv_heads], metadata)`` of ``model``'s ``lukv`` artifact.

    ``keep_fractions[i, l, h]`` is the fraction of the context head ``(l, h)`` keeps when the whole cache keeps
    ``1 − ratios[i]``. Raises :class:`~kvtrim.errors.MissingArtifactError` naming ``kvtrim calibrate lukv`` when
    none exists.
    """
    artifact = load_artifact(LUKV_KIND, model, path)
    ratios = artifact.tensors.get("ratios")
    keep = artifact.tensors.get("keep_fractions")
    if ratios is None or keep is None or ratios.dim() != 1 or keep.dim() != 3 or keep.shape[0] != ratios.shape[0]:
        raise InvalidParameterError(
            f"{artifact.path}: an lukv artifact needs 'ratios' [R] and 'keep_fractions' [R, layers, kv_heads]"
        )
    meta = {"artifact": str(artifact.path), "model_key": artifact.meta.get("model_key"), "scorer": None}
    meta["scorer"] = artifact.meta.get("settings", {}).get("scorer")
    return ratios.double(), keep.double(), meta
