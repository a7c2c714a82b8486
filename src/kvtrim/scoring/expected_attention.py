"""Expected attention of future queries, from the statistics of the prompt's queries (Expected Attention)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..artifacts.query_stats import EXPECTED_ATTENTION_STATS_KIND, load_query_statistics
from ..errors import InvalidParameterError
from .base import LayerView, Scorer
from .observation import ObservationSpec
from .rope import cos_sin, rope_frequencies, rotate_half, rotate_half_matrix

ALL_QUERIES = 1 << 30  # an observation window longer than any prompt: every prompt query is recorded


def unrotate(queries: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """Pre-RoPE queries from post-RoPE ones: ``q = R(t)ᵀ q_t / a``.

    Args:
        queries: ``[batch, heads, n, head_dim]`` rotated at ``positions`` ``[batch, n]`` (``-1``: padding, left as is)
    """
    cos, sin = cos_sin(positions.clamp(min=0), inv_freq)  # [b, n, d]
    cos, sin = cos[:, None], sin[:, None]
    q = queries.float()
    return (q * cos - rotate_half(q) * sin) / scaling


def query_statistics(
    queries: torch.Tensor, positions: torch.Tensor, n_sink: int, use_covariance: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean ``[batch, heads, d]`` and covariance ``[batch, heads, d, d]`` (population, ``/n``) of the
    pre-RoPE ``queries`` ``[batch, heads, n, d]`` whose position is ``>= n_sink`` (padding excluded).

    A row with no such query gets zero statistics (every key then has the same expected logit).
    """
    weight = (positions >= n_sink).to(torch.float32)[:, None, :, None]  # [b, 1, n, 1]
    count = weight.sum(2).clamp(min=1.0)  # [b, 1, 1]
    mean = (queries * weight).sum(2) / count
    if not use_covariance:
        return mean, None
    centred = (queries - mean[:, :, None]) * weight
    cov = centred.transpose(-1, -2) @ centred / count[..., None]
    return mean, cov


def future_rotation(
    context_lengths: torch.Tensor, n_future: int, inv_freq: torch.Tensor, scaling: float
) -> torch.Tensor:
    """``R̄`` ``[batch, d, d]``: the rotary rotation averaged over the next ``n_future`` positions of each row
    (``a · (diag(mean cos) + diag(mean sin) P)``)."""
    device = inv_freq.device
    future = context_lengths.to(device)[:, None] + torch.arange(n_future, device=device)  # [b, F]
    cos, sin = cos_sin(future, inv_freq)
    d = cos.shape[-1]
    p = rotate_half_matrix(d, device)
    return scaling * (torch.diag_embed(cos.mean(1)) + torch.diag_embed(sin.mean(1)) @ p)


def expected_logits(
    keys: torch.Tensor, mean: torch.Tensor, cov: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """``log E[exp(s·qᵀk)]`` for ``q ~ N(mean, cov)``: ``s·meanᵀk + ½ s²·kᵀ cov k``.

    Args:
        keys: ``[batch, kv_heads, seq, d]``; mean ``[batch, q_heads, d]``; cov ``[batch, q_heads, d, d]`` or None
    Returns:
        ``[batch, kv_heads, group, seq]``
    """
    b, hkv, _, d = keys.shape
    k = keys.float()
    mean = mean.view(b, hkv, -1, d)
    logits = scaling * torch.einsum("bhgd,bhsd->bhgs", mean, k)
    if cov is not None:
        cov = cov.view(b, hkv, -1, d, d)
        logits = logits + 0.5 * scaling**2 * torch.einsum("bhsd,bhgde,bhse->bhgs", k, cov, k)
    return logits


@dataclass
class ExpectedAttentionScorer(Scorer):
    """Expected Attention (Devoto et al., 2025, "Expected Attention: KV Cache Compression by Estimating
    Attention from Future Queries Distribution", arXiv 2510.00636; kvpress's ExpectedAttentionPress).

    Models the prompt's pre-RoPE queries of each query head as a Gaussian (mean, covariance; the first ``n_sink``
    positions left out), moves it to the next ``n_future`` positions with the averaged rotary rotation ``R̄``
    (``μ' = R̄μ``, ``Σ' = R̄ΣR̄ᵀ``), and scores each key by the softmax over keys of its expected logit
    ``s·μ'ᵀk + ½s²·kᵀΣ'k`` (the log of ``E[exp(s·qᵀk)]`` under that Gaussian), averaged over the GQA group and
    multiplied by ``(score + eps)·‖v‖₂`` when ``use_vnorm``. Sinks are left out of the softmax (the selector
    keeps them). It needs no attention matrix and no question.

    kvtrim records the post-RoPE queries of the whole prompt during prefill (an observation window as long as
    the prompt: ``q_heads × n × head_dim`` values per layer, held until compression) and un-rotates them with the
    model's rotary frequencies; kvpress recomputes them from the hidden states instead. Query statistics of
    q/k-normed models (Qwen3) are thus those of the normed queries.
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = False  # attention is estimated from query statistics
    question_aware = False

    n_future: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    eps: float = 0.0
    observation: ObservationSpec = field(init=False)

    def __post_init__(self) -> None:
        for name in ("n_future", "n_sink"):
            value = getattr(self, name)
            low = 1 if name == "n_future" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidParameterError(f"{name} must be an integer >= {low}, got {value!r}")
        if not self.eps >= 0.0:
            raise InvalidParameterError(f"eps must be >= 0, got {self.eps!r}")
        self.observation = ObservationSpec(window=ALL_QUERIES)

    def _rope(self, view: LayerView) -> tuple[torch.Tensor, float]:
        config = getattr(view.module, "config", None)
        if config is None:
            raise RuntimeError(f"layer {view.layer_idx}: expected attention needs the attention module's config")
        return rope_frequencies(config, view.keys.shape[-1], view.keys.device)

    def _statistics(
        self, view: LayerView, inv_freq: torch.Tensor, rope_scale: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Mean ``[batch, q_heads, d]`` and covariance (or None) of the pre-RoPE queries: the prompt's own."""
        obs = view.observation
        if obs.queries is None:
            raise RuntimeError(f"layer {view.layer_idx}: expected attention needs the prompt's recorded queries")
        device = view.keys.device
        queries = unrotate(obs.queries.to(device), obs.positions.to(device), inv_freq, rope_scale)
        return query_statistics(queries, obs.positions.to(device), self.n_sink, self.use_covariance)

    def score(self, view: LayerView) -> torch.Tensor:
        inv_freq, rope_scale = self._rope(view)
        mean, cov = self._statistics(view, inv_freq, rope_scale)
        rot = future_rotation(view.context_lengths, self.n_future, inv_freq, rope_scale)  # [b, d, d]
        mean = torch.einsum("bij,bhj->bhi", rot, mean)
        if cov is not None:
            cov = rot[:, None] @ cov @ rot[:, None].transpose(-1, -2)
        logits = expected_logits(view.keys, mean, cov, view.scaling)  # [b, hkv, g, s]
        scored = view.valid & (view.positions >= self.n_sink)
        logits = logits.masked_fill(~scored[:, :, None], float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0).mean(2)  # a row of sinks only: all zero
        if self.use_vnorm:
            probs = (probs + self.eps) * view.values.float().norm(dim=-1)
        return probs


@dataclass
class StoredStatsExpectedAttentionScorer(ExpectedAttentionScorer):
    """Expected Attention with query statistics computed offline (kvpress's ExpectedAttentionStatsPress; Devoto et
    al., arXiv 2510.00636): the mean ``[q_heads, d]`` and covariance ``[q_heads, d, d]`` of each layer's pre-RoPE
    queries over a calibration corpus (the ``expected_attention_stats`` artifact, ``kvtrim calibrate
    expected_attention_stats``) stand in for the prompt's own, so nothing is recorded during prefill; the rest is
    :class:`ExpectedAttentionScorer`'s.

    Args:
        artifact: artifact file or directory (default: the kvtrim home, then the shipped artifacts)
        mean, cov: ``[layers, q_heads, d]`` and ``[layers, q_heads, d, d]`` given directly instead of an artifact
    """

    artifact_kind = EXPECTED_ATTENTION_STATS_KIND

    artifact: str | None = None
    mean: torch.Tensor | None = field(default=None, repr=False)
    cov: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.observation = ObservationSpec()
        self._given = self.mean is not None
        if self._given and (self.mean.dim() != 3 or (self.cov is not None and self.cov.dim() != 4)):
            raise InvalidParameterError("mean must be [layers, q_heads, d] and cov [layers, q_heads, d, d]")
        self._model = None

    def bind(self, model: torch.nn.Module) -> None:
        """Load ``model``'s statistics (not when they were given directly)."""
        if self._given or self._model is model:
            return
        self.mean, self.cov = load_query_statistics(model, self.artifact)
        self._model = model

    def _statistics(
        self, view: LayerView, inv_freq: torch.Tensor, rope_scale: float
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.mean is None:
            raise RuntimeError("expected attention with stored statistics needs bind(model) or mean=/cov=")
        b, device = view.keys.shape[0], view.keys.device
        mean = self.mean[view.layer_idx].to(device, torch.float32).expand(b, -1, -1)
        if not self.use_covariance or self.cov is None:
            return mean, None
        return mean, self.cov[view.layer_idx].to(device, torch.float32).expand(b, -1, -1, -1)
