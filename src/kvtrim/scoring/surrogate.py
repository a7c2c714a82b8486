"""Scores predicted from hidden states by a small learned surrogate of KVzip (KVzap's linear map or MLP, Fast KVzip's
gate), computed as each token arrives."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..artifacts.surrogates import SURROGATE_KIND, SURROGATE_TENSORS, load_surrogate
from ..errors import InvalidParameterError
from .base import LayerView, Scorer
from .observation import ObservationSpec, TokenScores


def surrogate_predict(
    tensors: dict[str, torch.Tensor], kind: str, layer_idx: int, hidden: torch.Tensor
) -> torch.Tensor:
    """The surrogate's ``[batch, kv_heads, q]`` scores of ``hidden`` ``[batch, q, hidden_size]`` at ``layer_idx``.

    ``linear``: ``h·Wᵀ + b``; ``mlp``: ``GELU(h·W1ᵀ + b1)·W2ᵀ + b2``; ``gate``: :func:`gate_scores` (the tensors of
    :mod:`kvtrim.artifacts.surrogates`, on ``hidden``'s device; computed in fp32).
    """
    x = hidden.float()
    if kind == "gate":
        return gate_scores(tensors, layer_idx, x)
    if kind == "linear":
        out = torch.nn.functional.linear(x, tensors["linear_weight"][layer_idx], tensors["linear_bias"][layer_idx])
    else:
        inner = torch.nn.functional.linear(x, tensors["mlp_w1"][layer_idx], tensors["mlp_b1"][layer_idx])
        out = torch.nn.functional.linear(
            torch.nn.functional.gelu(inner), tensors["mlp_w2"][layer_idx], tensors["mlp_b2"][layer_idx]
        )
    return out.transpose(1, 2)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight


def gate_scores(tensors: dict[str, torch.Tensor], layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
    """Fast KVzip's gate (Kim, Han & Yun, arXiv 2601.17668): ``[batch, kv_heads, q]`` scores in (0, 1).

    Each token gets, per KV head, one gate key ``k = RMSNorm(h·W_kᵀ)`` and ``G`` gate queries
    ``q_g = RMSNorm(h·W_qᵀ + b_q)`` (width ``d``); its logit ``q_g·k/√d + b_g`` competes in a softmax with the
    logits ``q_g·s_j/√d`` of ``S`` learned sink keys ``s_j``: ``σ(logit − logsumexp_j(q_g·s_j/√d))``, averaged over
    the ``G`` queries.
    """
    t = {name: value[layer_idx] for name, value in tensors.items()}
    b, n, _ = hidden.shape
    heads, groups = t["gate_bias"].shape
    width = t["gate_q_norm"].shape[-1]
    q = torch.nn.functional.linear(hidden, t["gate_q_weight"], t["gate_q_bias"]).view(b, n, heads, groups, width)
    k = torch.nn.functional.linear(hidden, t["gate_k_weight"]).view(b, n, heads, width)
    q, k = _rms_norm(q, t["gate_q_norm"]), _rms_norm(k, t["gate_k_norm"])
    scale = width**-0.5
    logit = torch.einsum("bnhgd,bnhd->bnhg", q, k) * scale + t["gate_bias"]
    sinks = torch.einsum("bnhgd,hsd->bnhgs", q, t["gate_sink_keys"]) * scale
    return torch.sigmoid(logit - torch.logsumexp(sinks, dim=-1)).mean(-1).transpose(1, 2)


class SurrogateTokenScores(TokenScores):
    """The surrogate applied to each new token's hidden state (:class:`~kvtrim.scoring.observation.TokenScores`);
    its weights load from the model's artifact (``kvzap`` or ``fastkvzip``) on first use (or at :meth:`load`)."""

    def __init__(self, kind: str, path: str | None = None, tensors: dict[str, torch.Tensor] | None = None):
        self.kind = kind
        self.path = path
        self.stat = f"surrogate_{kind}" + (f":{path}" if path else "") + (f":given{id(tensors)}" if tensors else "")
        self.tensors = tensors
        self.source: dict = {"given": True} if tensors is not None else {}
        self._placed: dict[tuple, dict[str, torch.Tensor]] = {}

    def load(self, model: torch.nn.Module) -> None:
        """Read the weights of ``model`` from its artifact (not when they were given directly)."""
        if self.source.get("given") or self.source.get("model") is model:
            return
        self.tensors, source = load_surrogate(model, self.kind, self.path)
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
    """KVzap's score (Jegou & Jeblick, arXiv 2601.07891): a per-layer surrogate (linear, or a 2-layer MLP) maps the
    hidden state entering a layer's attention to one predicted log-importance per KV head, ``[batch, kv_heads,
    seq]``; with ``model_type="gate"``, Fast KVzip's gate (:func:`gate_scores`, see :class:`GateScorer`).

    The surrogate runs as each token arrives (prefill chunks and decoding steps alike) and its output is kept with
    the entry as a per-slot statistic, so compressing reads it back and a decoding-time schedule scores new tokens
    without recomputing anything. The weights come from the model's ``kvzap`` artifact (``kvtrim calibrate
    kvzap``; ``fastkvzip`` for the gate), trained to predict KVzip's scores; ``tensors`` gives them directly instead.

    Args:
        model_type: ``"linear"``, ``"mlp"`` or ``"gate"``
        artifact: artifact file or directory (default: the kvtrim home, then the shipped artifacts)
        tensors: the surrogate's tensors (:mod:`kvtrim.artifacts.surrogates` layout) instead of an artifact
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = False
    question_aware = False  # each entry's score depends on its own hidden state only

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
        self.observation = ObservationSpec(token_scores=(self._tokens,))

    @property
    def artifact_kind(self) -> str:
        """The artifact kind the weights come from (capability read by the method registry)."""
        return SURROGATE_KIND[self.model_type]

    def bind(self, model: torch.nn.Module) -> None:
        """Load the surrogate of ``model`` now, so a missing artifact fails before any work."""
        self._tokens.load(model)

    def score(self, view: LayerView) -> torch.Tensor:
        return view.stats[self._tokens.stat]

    def describe_compression(self, shared: dict) -> dict:
        source = self._tokens.source
        return {"surrogate": self.model_type, "surrogate_artifact": source.get("artifact", "given")}


_PINNED = 1.0  # the gate's largest value: pinned entries rank with the best


@dataclass
class GateScorer(HiddenStateSurrogateScorer):
    """Fast KVzip's score (Kim, Han & Yun, arXiv 2601.17668): the gate's output (:func:`gate_scores`, in (0, 1)),
    with the first ``n_sink`` positions and a recent window pinned at 1: ``max(1, ⌊window_ratio·T⌋)`` positions
    of a ``T``-token context, or ``window`` once ``T`` reaches ``long_context``.
    """

    model_type: str = "gate"
    n_sink: int = 4
    window_ratio: float = 0.02
    window: int = 4096
    long_context: int = 32000

    def __post_init__(self) -> None:
        if self.model_type != "gate":
            raise InvalidParameterError(f"model_type must be 'gate' for Fast KVzip's scorer, got {self.model_type!r}")
        for name in ("n_sink", "window", "long_context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidParameterError(f"{name} must be an integer >= 0, got {value!r}")
        ratio = self.window_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
            raise InvalidParameterError(f"window_ratio must be in [0, 1), got {ratio!r}")
        super().__post_init__()

    def score(self, view: LayerView) -> torch.Tensor:
        scores = super().score(view)
        context = view.context_lengths.to(view.positions.device)
        short = (context.double() * self.window_ratio).floor().clamp(min=1).long()
        recent = torch.where(context < self.long_context, short, torch.full_like(short, self.window))
        pos = view.positions
        pinned = (pos >= 0) & ((pos < self.n_sink) | (pos >= (context - recent)[:, None, None]))
        return scores.masked_fill(pinned, _PINNED)
