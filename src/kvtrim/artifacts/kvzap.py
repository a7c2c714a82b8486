"""Loading the ``kvzap`` artifact (KVzap's surrogate weights); :mod:`kvtrim.calibration.kvzap` writes it.

Tensors, one slice per decoder layer ``L`` (``H`` the hidden size, ``D`` the MLP's hidden width):

* ``linear_weight`` ``[L, kv_heads, H]``, ``linear_bias`` ``[L, kv_heads]``;
* ``mlp_w1`` ``[L, D, H]``, ``mlp_b1`` ``[L, D]``, ``mlp_w2`` ``[L, kv_heads, D]``, ``mlp_b2`` ``[L, kv_heads]``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import InvalidParameterError
from .kinds import KVZAP_KIND
from .store import load_artifact, model_identity

__all__ = ["KVZAP_KIND", "SURROGATE_TENSORS", "load_kvzap"]

SURROGATE_TENSORS = {
    "linear": ("linear_weight", "linear_bias"),
    "mlp": ("mlp_w1", "mlp_b1", "mlp_w2", "mlp_b2"),
}
"""The tensors of each surrogate kind."""


def load_kvzap(
    model: torch.nn.Module, kind: str, path: str | Path | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """The ``kind`` (``"linear"`` or ``"mlp"``) surrogate tensors of ``model``'s ``kvzap`` artifact and a source
    dict (file, model key).

    Raises :class:`~kvtrim.errors.MissingArtifactError` naming ``kvtrim calibrate kvzap`` when none exists.
    """
    if kind not in SURROGATE_TENSORS:
        raise InvalidParameterError(f"model_type={kind!r}: choose one of {sorted(SURROGATE_TENSORS)}")
    artifact = load_artifact(KVZAP_KIND, model, path)
    identity = model_identity(model)
    tensors = {}
    for name in SURROGATE_TENSORS[kind]:
        tensor = artifact.tensors.get(name)
        if tensor is None:
            raise InvalidParameterError(f"{artifact.path}: a kvzap artifact needs the tensor {name!r}")
        tensors[name] = tensor.float()
    first = tensors[SURROGATE_TENSORS[kind][0]]
    if first.shape[0] != identity["num_layers"] or first.shape[-1] != identity["hidden_size"]:
        raise InvalidParameterError(
            f"{artifact.path}: {tuple(first.shape)} does not fit {identity['num_layers']} layers of hidden size "
            f"{identity['hidden_size']}"
        )
    return tensors, {"artifact": str(artifact.path), "model_key": artifact.meta.get("model_key")}
