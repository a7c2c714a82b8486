"""Loading the ``compresskv`` artifact (CompressKV head scores and layer error profile).

The calibration that writes it is :mod:`kvtrim.calibration.compresskv` (``kvtrim calibrate compresskv``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import InvalidParameterError
from .kinds import COMPRESSKV_KIND
from .store import Artifact, load_artifact

__all__ = ["COMPRESSKV_KIND", "REQUIRED_TENSORS", "load_compresskv"]

REQUIRED_TENSORS = ("srh", "trh", "layer_scores")


def load_compresskv(model: torch.nn.Module, path: str | Path | None = None) -> Artifact:
    """The ``compresskv`` artifact of ``model`` (checked to hold ``srh``, ``trh`` and ``layer_scores``).

    Raises:
        MissingArtifactError: none found; the message names ``kvtrim calibrate compresskv --model M``
        InvalidParameterError: the file lacks one of the tensors
    """
    artifact = load_artifact(COMPRESSKV_KIND, model, path)
    missing = [name for name in REQUIRED_TENSORS if name not in artifact.tensors]
    if missing:
        raise InvalidParameterError(f"{artifact.path} lacks tensors {missing}; re-run the compresskv calibration")
    return artifact
