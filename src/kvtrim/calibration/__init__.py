"""Offline calibration: artifacts keyed by model identity, and the calibrations that produce them."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> submodule; imported on first use so that `kvtrim --help` need not load torch
_EXPORTS = {
    **dict.fromkeys(
        (
            "Artifact",
            "ArtifactMismatchError",
            "describe_artifact",
            "load_artifact",
            "model_identity",
            "model_key",
            "register_artifact_kind",
            "save_artifact",
        ),
        "..artifacts.store",
    ),
    "load_compresskv": "..artifacts.compresskv",
    **dict.fromkeys(("AnswerNeedle", "HeadScores", "LayerProfile", "calibrate_compresskv"), ".compresskv"),
    **dict.fromkeys(("HeadDetection", "NeedleSpec", "calibrate_headkv", "detect_heads"), ".headkv"),
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from ..artifacts.compresskv import load_compresskv
    from ..artifacts.store import (
        Artifact,
        ArtifactMismatchError,
        describe_artifact,
        load_artifact,
        model_identity,
        model_key,
        register_artifact_kind,
        save_artifact,
    )
    from .compresskv import AnswerNeedle, HeadScores, LayerProfile, calibrate_compresskv
    from .headkv import HeadDetection, NeedleSpec, calibrate_headkv, detect_heads

__all__ = [
    "AnswerNeedle",
    "Artifact",
    "ArtifactMismatchError",
    "HeadDetection",
    "HeadScores",
    "LayerProfile",
    "NeedleSpec",
    "calibrate_compresskv",
    "calibrate_headkv",
    "describe_artifact",
    "detect_heads",
    "load_artifact",
    "load_compresskv",
    "model_identity",
    "model_key",
    "register_artifact_kind",
    "save_artifact",
]
