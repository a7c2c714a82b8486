"""Loading learned surrogates of KVzip: the ``kvzap`` artifact (KVzap's linear and MLP surrogates,
:mod:`kvtrim.calibration.kvzap`) and the ``fastkvzip`` artifact (Fast KVzip's gates,
:mod:`kvtrim.calibration.fastkvzip`).

Tensors, one slice per decoder layer ``L`` (``H`` the hidden size, ``D`` the MLP's hidden width, ``G`` query heads
per KV head, ``d`` the gate's width, ``S`` its learned sink keys):

* ``linear`` (``kvzap``): ``linear_weight`` ``[L, kv_heads, H]``, ``linear_bias`` ``[L, kv_heads]``;
* ``mlp`` (``kvzap``): ``mlp_w1`` ``[L, D, H]``, ``mlp_b1`` ``[L, D]``, ``mlp_w2`` ``[L, kv_heads, D]``,
  ``mlp_b2`` ``[L, kv_heads]``;
* ``gate`` (``fastkvzip``): ``gate_q_weight`` ``[L, kv_heads·G·d, H]``, ``gate_q_bias`` ``[L, kv_heads·G·d]``,
  ``gate_k_weight`` ``[L, kv_heads·d, H]``, ``gate_q_norm``, ``gate_k_norm`` ``[L, d]``, ``gate_bias``
  ``[L, kv_heads, G]``, ``gate_sink_keys`` ``[L, kv_heads, S, d]``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import InvalidParameterError
from .kinds import FASTKVZIP_KIND, KVZAP_KIND
from .store import load_artifact, model_identity

__all__ = ["FASTKVZIP_KIND", "KVZAP_KIND", "SURROGATE_KIND", "SURROGATE_TENSORS", "load_surrogate"]

SURROGATE_TENSORS = {
    "linear": ("linear_weight", "linear_bias"),
    "mlp": ("mlp_w1", "mlp_b1", "mlp_w2", "mlp_b2"),
    "gate": (
        "gate_q_weight",
        "gate_q_bias",
        "gate_k_weight",
        "gate_q_norm",
        "gate_k_norm",
        "gate_bias",
        "gate_sink_keys",
    ),
}
"""The tensors of each surrogate type."""

SURROGATE_KIND = {"linear": KVZAP_KIND, "mlp": KVZAP_KIND, "gate": FASTKVZIP_KIND}
"""The artifact kind each surrogate type is stored in."""


def load_surrogate(
    model: torch.nn.Module, model_type: str, path: str | Path | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """The ``model_type`` (``"linear"``, ``"mlp"`` or ``"gate"``) surrogate tensors of ``model``'s artifact and a
    source dict (file, model key).

    Raises :class:`~kvtrim.errors.MissingArtifactError` naming the ``kvtrim calibrate`` command when none exists.
    """
    if model_type not in SURROGATE_TENSORS:
        raise InvalidParameterError(f"model_type={model_type!r}: choose one of {sorted(SURROGATE_TENSORS)}")
    artifact = load_artifact(SURROGATE_KIND[model_type], model, path)
    identity = model_identity(model)
    tensors = {}
    for name in SURROGATE_TENSORS[model_type]:
        tensor = artifact.tensors.get(name)
        if tensor is None:
            raise InvalidParameterError(f"{artifact.path}: a {artifact.kind} artifact needs the tensor {name!r}")
        tensors[name] = tensor.float()
    first = tensors[SURROGATE_TENSORS[model_type][0]]
    if first.shape[0] != identity["num_layers"] or first.shape[-1] != identity["hidden_size"]:
        raise InvalidParameterError(
            f"{artifact.path}: {tuple(first.shape)} does not fit {identity['num_layers']} layers of hidden size "
            f"{identity['hidden_size']}"
        )
    return tensors, {"artifact": str(artifact.path), "model_key": artifact.meta.get("model_key")}
