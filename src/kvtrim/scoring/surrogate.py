"""Scores predicted from hidden states by a small learned surrogate (KVzap), computed as each token arrives."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..artifacts.kvzap import KVZAP_KIND, SURROGATE_TENSORS, load_kvzap
from ..errors import InvalidParameterError
from .base import LayerView, Scorer
from .observation import ObservationSpec, TokenScores


def surrogate_predict(
    tensors: dict[str, torch.Tensor], kind: str, layer_idx: int, hidden: torch.Tensor
) -> torch.Tensor:
    """The surrogate's ``[batch, kv_heads, q]`` scores of ``hidden`` ``[batch, q, hidden_size]`` at ``layer_idx``.

    ``linear``: ``h·Wᵀ + b``; ``mlp``: ``GELU(h·W1ᵀ + b1)·W2ᵀ + b2`` (the tensors of :mod:`kvtrim.artifacts.kvzap`,
    on ``hidden``'s device; computed in fp32).
    """
    x = hidden.float()
    if kind == "linear":
        out = torch.nn.functional.linear(x, tensors["linear_weight"][layer_idx], tensors["linear_bias"][layer_idx])
    else:
        inner = torch.nn.functional.linear(x, tensors["mlp_w1"][layer_idx], tensors["mlp_b1"][layer_idx])
        out = torch.nn.functional.linear(
            torch.nn.functional.gelu(inner), tensors["mlp_w2"][layer_idx], tensors["mlp_b2"][layer_idx]
        )
    return out.transpose(1, 2)


class SurrogateTokenScores(TokenScores):
    """The surrogate applied to each new token's hidden state (:class:`~kvtrim.scoring.observation.TokenScores`);
    its weights load from the model's ``kvzap`` artifact on first use (or at :meth:`load`)."""

    def __init__(self, kind: str, path: str | None = None, tensors: dict[str, torch.Tensor] | None = None):
        self.kind = kind
        self.path = path
        self.stat = f"kvzap_{kind}" + (f":{path}" if path else "") + (f":given{id(tensors)}" if tensors else "")
        self.tensors = tensors
        self.source: dict = {"given": True} if tensors is not None else {}
        self._placed: dict[tuple, dict[str, torch.Tensor]] = {}

    def load(self, model: torch.nn.Module) -> None:
        """Read the weights of ``model`` from its artifact (not when they were given directly)."""
        if self.source.get("given") or self.source.get("model") is model:
            return
        self.tensors, source = load_kvzap(model, self.kind, self.path)
        self.source = {**source, "model": model}
        self._placed = {}

    def __call__(self, model: torch.nn.Module, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
        if self.tensors is None:
            self.load(model)
        key = (hidden.device,)
        if key not in self._placed:
            self._placed[key] = {n: t.to(hidden.device, torch.float32) for n, t in self.tensors.items()}
        return surrogate_predict(self._placed[key], self.kind, layer_idx, hidden)


@dataclass
class HiddenStateSurrogateScorer(Scorer):
    """KVzap's score (arXiv 2601.07891): a per-layer surrogate (linear, or a 2-layer MLP) maps the hidden state
    entering a layer's attention to one predicted log-importance per KV head, ``[batch, kv_heads, seq]``.

    The surrogate runs as each token arrives (prefill chunks and decoding steps alike) and its output is kept with
    the entry as a per-slot statistic, so compressing reads it back and a decoding-time schedule scores new tokens
    without recomputing anything. The weights come from the model's ``kvzap`` artifact
    (``kvtrim calibrate kvzap``), trained to predict KVzip's scores; ``tensors`` gives them directly instead.

    Args:
        model_type: ``"linear"`` or ``"mlp"``
        artifact: artifact file or directory (default: the kvtrim home, then the shipped artifacts)
        tensors: the surrogate's tensors (:mod:`kvtrim.artifacts.kvzap` layout) instead of an artifact
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = False
    question_aware = False  # each entry's score depends on its own hidden state only
    artifact_kind = KVZAP_KIND

    model_type: str = "mlp"
    artifact: str | None = None
    tensors: dict | None = field(default=None, repr=False)
    observation: ObservationSpec = field(init=False)

    def __post_init__(self) -> None:
        if self.model_type not in SURROGATE_TENSORS:
            raise InvalidParameterError(
                f"model_type must be one of {sorted(SURROGATE_TENSORS)}, got {self.model_type!r}"
            )
        if self.artifact is not None and not isinstance(self.artifact, str):
            raise InvalidParameterError(f"artifact must be a path (str) or None, got {self.artifact!r}")
        if self.tensors is not None:
            missing = [n for n in SURROGATE_TENSORS[self.model_type] if n not in self.tensors]
            if missing:
                raise InvalidParameterError(f"tensors lacks {missing} for model_type={self.model_type!r}")
        self._tokens = SurrogateTokenScores(self.model_type, self.artifact, self.tensors)
        self.observation = ObservationSpec(token_scores=self._tokens)

    def bind(self, model: torch.nn.Module) -> None:
        """Load the surrogate of ``model`` now, so a missing artifact fails before any work."""
        self._tokens.load(model)

    def score(self, view: LayerView) -> torch.Tensor:
        return view.stats[self._tokens.stat]

    def describe_compression(self, shared: dict) -> dict:
        source = self._tokens.source
        return {"kvzap_surrogate": self.model_type, "kvzap_artifact": source.get("artifact", "given")}
