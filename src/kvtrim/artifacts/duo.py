"""Loading the ``duo`` artifact (DuoAttention head gates); :mod:`kvtrim.calibration.duo` writes it."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import InvalidParameterError
from .kinds import DUO_KIND
from .store import load_artifact

__all__ = ["DUO_KIND", "load_duo_gates"]


def load_duo_gates(model: torch.nn.Module, path: str | Path | None = None) -> tuple[torch.Tensor, dict]:
    """The ``[layers, kv_heads]`` gates of ``model``'s ``duo`` artifact and its metadata.

    Raises :class:`~kvtrim.errors.MissingArtifactError` naming ``kvtrim calibrate duo`` when none exists.
    """
    artifact = load_artifact(DUO_KIND, model, path)
    gates = artifact.tensors.get("gates")
    if gates is None or gates.dim() != 2:
        raise InvalidParameterError(f"{artifact.path}: a duo artifact needs a 2-D 'gates' tensor [layers, kv_heads]")
    return gates.float(), {"artifact": str(artifact.path), "model_key": artifact.meta.get("model_key")}
