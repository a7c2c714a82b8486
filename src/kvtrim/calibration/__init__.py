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
from .compresskv import AnswerNeedle, HeadScores, LayerProfile, calibrate_compresskv, load_compresskv
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
