"""Offline calibration: artifacts keyed by model identity, and the calibrations that produce them."""

from __future__ import annotations

from .artifacts import (
    Artifact,
    ArtifactMismatchError,
    describe_artifact,
    load_artifact,
    model_identity,
    model_key,
    register_artifact_kind,
    save_artifact,
)
from .headkv import HeadDetection, NeedleSpec, calibrate_headkv, detect_heads

__all__ = [
    "Artifact",
    "ArtifactMismatchError",
    "HeadDetection",
    "NeedleSpec",
    "calibrate_headkv",
    "describe_artifact",
    "detect_heads",
    "load_artifact",
    "model_identity",
    "model_key",
    "register_artifact_kind",
    "save_artifact",
]
