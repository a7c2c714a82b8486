"""The ``restorekv`` artifact: RestoreKV's learned restore-token embeddings and the low-rank adapter of the
attention projections used only while those tokens are encoded (:mod:`kvtrim.calibration.restorekv` writes it).

Tensors:

* ``restore_embeddings`` ``[K, hidden_size]``: the input embeddings of the ``K`` restore tokens;
* for each adapted projection ``P`` (listed in the metadata's ``settings.targets``, by default ``q``, ``k``, ``v``,
  ``o``): ``lora_P_a`` ``[layers, rank, in_features]`` and ``lora_P_b`` ``[layers, out_features, rank]``; the
  projection's output gains ``(x · Aᵀ) · Bᵀ`` (any LoRA scale is folded into ``B``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import InvalidParameterError
from .kinds import RESTOREKV_KIND
from .store import load_artifact, model_identity

__all__ = ["LORA_TARGETS", "RESTOREKV_KIND", "RestoreWeights", "load_restore_weights"]

LORA_TARGETS = ("q", "k", "v", "o")
"""Projections the adapter may change: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` of each attention layer."""


class RestoreWeights:
    """Restore embeddings ``[K, hidden]`` and the adapter ``{target: (A [layers, r, in], B [layers, out, r])}``."""

    def __init__(self, embeddings: torch.Tensor, lora: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        if embeddings.dim() != 2:
            raise InvalidParameterError(f"restore embeddings must be [tokens, hidden], got {tuple(embeddings.shape)}")
        for target, (a, b) in lora.items():
            if target not in LORA_TARGETS:
                raise InvalidParameterError(f"LoRA target {target!r}: choose from {LORA_TARGETS}")
            if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[1] != b.shape[2]:
                raise InvalidParameterError(
                    f"LoRA {target}: A {tuple(a.shape)} and B {tuple(b.shape)} are not [layers, r, in] and "
                    "[layers, out, r]"
                )
        self.embeddings = embeddings
        self.lora = lora

    @property
    def tokens(self) -> int:
        return int(self.embeddings.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The artifact's tensors (module docstring layout)."""
        out = {"restore_embeddings": self.embeddings}
        for target, (a, b) in self.lora.items():
            out[f"lora_{target}_a"], out[f"lora_{target}_b"] = a, b
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> RestoreWeights:
        if "restore_embeddings" not in tensors:
            raise InvalidParameterError("restore tensors need 'restore_embeddings'")
        lora = {}
        for target in LORA_TARGETS:
            a, b = tensors.get(f"lora_{target}_a"), tensors.get(f"lora_{target}_b")
            if (a is None) != (b is None):
                raise InvalidParameterError(f"LoRA {target}: give both lora_{target}_a and lora_{target}_b")
            if a is not None:
                lora[target] = (a, b)
        return cls(tensors["restore_embeddings"], lora)


def load_restore_weights(model: torch.nn.Module, path: str | Path | None = None) -> tuple[RestoreWeights, dict]:
    """``model``'s restore weights (float32, CPU) and a source dict (file, model key).

    Raises :class:`~kvtrim.errors.MissingArtifactError` naming ``kvtrim calibrate restorekv`` when none exists.
    """
    artifact = load_artifact(RESTOREKV_KIND, model, path)
    weights = RestoreWeights.from_tensors({n: t.float() for n, t in artifact.tensors.items()})
    identity = model_identity(model)
    if weights.embeddings.shape[1] != identity["hidden_size"]:
        raise InvalidParameterError(
            f"{artifact.path}: restore embeddings of width {weights.embeddings.shape[1]} do not fit hidden size "
            f"{identity['hidden_size']}"
        )
    for target, (a, _) in weights.lora.items():
        if a.shape[0] != identity["num_layers"]:
            raise InvalidParameterError(
                f"{artifact.path}: LoRA {target} has {a.shape[0]} layers, the model {identity['num_layers']}"
            )
    return weights, {"artifact": str(artifact.path), "model_key": artifact.meta.get("model_key")}
