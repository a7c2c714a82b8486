"""TriAttention's score: the attention a key can expect from the query centre over future distances, written as a
trigonometric series over the rotary frequency bands, plus a norm term."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InvalidParameterError
from .base import LayerView, Scorer
from .expected_attention import unrotate
from .observation import ObservationSpec
from .rope import cos_sin, rope_frequencies


def geometric_offsets(longest: int, device=None) -> torch.Tensor:
    """``[1, 2, 4, …, 2^m]`` with ``2^m <= longest`` (fp32): the future distances a key is scored at."""
    count = max(1, int(longest).bit_length())
    return torch.pow(2.0, torch.arange(count, dtype=torch.float32, device=device))


def band_pairs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary bands of ``x`` ``[…, d]`` as (real, imaginary) ``[…, d/2]`` each: transformers' layout pairs
    channel ``f`` with channel ``f + d/2``."""
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def query_centres(queries: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean pre-RoPE query ``q̄`` ``[batch, heads, d]`` and the mean band magnitude ``E|q_f|``
    ``[batch, heads, d/2]`` over the ``valid`` ``[batch, n]`` queries of ``queries`` ``[batch, heads, n, d]``."""
    w = valid.to(torch.float32)[:, None, :, None]
    count = w.sum(2).clamp(min=1.0)
    q = queries.float()
    re, im = band_pairs(q)
    return (q * w).sum(2) / count, (torch.sqrt(re.square() + im.square()) * w).sum(2) / count


def trigonometric_scores(
    centre: torch.Tensor,
    magnitude: torch.Tensor,
    keys: torch.Tensor,
    distance: torch.Tensor,
    inv_freq: torch.Tensor,
    offsets: torch.Tensor,
    scale: float = 1.0,
) -> torch.Tensor:
    """TriAttention's score of every pre-RoPE key for every query head of its group.

    ``S = mean_o Σ_f |q̄_f| |k_f| cos((Δ + o) ω_f + φ_f) + Σ_f (E|q_f| − |q̄_f|) |k_f|``, times ``scale²``: the first
    term is the logit of the query centre ``q̄`` at distance ``Δ + o`` from the key (``φ_f`` the phase of
    ``q̄_f · conj(k_f)``), averaged over the future offsets ``o``; the second is what the query magnitude that the
    centre does not explain can add. The mean over offsets folds into one complex weight per band,
    ``W_f = mean_o exp(i ω_f o)``, so the first term is ``q̄ · u`` with ``u_f = k_f · conj(exp(i ω_f Δ) W_f)``.

    Args:
        centre: ``[batch, kv_heads, group, d]`` ``q̄`` per query head
        magnitude: ``[batch, kv_heads, group, d/2]`` ``E|q_f|`` per query head
        keys: ``[batch, kv_heads, seq, d]`` pre-RoPE keys
        distance: ``[batch, kv_heads, seq]`` ``Δ``: the current position minus the key's
        inv_freq: ``[d/2]`` ``ω``; offsets: ``[o]`` future offsets
        scale: the rotary embedding's attention scaling (applied to queries and keys alike)
    Returns:
        ``[batch, kv_heads, group, seq]`` fp32
    """
    angles = offsets[:, None] * inv_freq[None, :]  # [o, F]
    w_re, w_im = angles.cos().mean(0), angles.sin().mean(0)
    cos, sin = cos_sin(distance, inv_freq)  # [b, h, s, d], the angles repeated over both halves
    cos, sin = band_pairs(cos)[0], band_pairs(sin)[0]
    c = cos * w_re - sin * w_im  # Re(exp(iωΔ) W)
    e = sin * w_re + cos * w_im  # Im(exp(iωΔ) W)
    k_re, k_im = band_pairs(keys.float())
    u = torch.cat([k_re * c + k_im * e, k_im * c - k_re * e], dim=-1)  # k · conj(exp(iωΔ) W)
    series = torch.einsum("bhgd,bhsd->bhgs", centre.float(), u)
    c_re, c_im = band_pairs(centre.float())
    residual = magnitude.float() - torch.sqrt(c_re.square() + c_im.square())  # E|q_f| − |q̄_f|
    norm = torch.einsum("bhgf,bhsf->bhgs", residual, torch.sqrt(k_re.square() + k_im.square()))
    return (series + norm) * scale**2


@dataclass
class TrigonometricScorer(Scorer):
    """TriAttention (Mao et al., 2026, "TriAttention: Efficient Long Reasoning with Trigonometric KV Compression",
    arXiv 2604.04921): keys are scored from the pre-RoPE query centre, which barely moves along the sequence, so the
    attention it pays a key depends on their distance through a trigonometric series over the rotary bands
    (:func:`trigonometric_scores`). A KV head takes the max over its query heads.

    The paper calibrates ``q̄`` and ``E|q_f|`` per head offline on a dataset; here they come from the queries the
    cache recorded: the last ``stats_window`` (the prompt's, and while decoding under the schedule the generated
    tokens' too), un-rotated with the model's frequencies (``expected_attention``'s way).

    Args:
        offset_max: the largest future offset (offsets ``1, 2, 4, … <= offset_max``)
        stats_window: recorded queries the statistics are taken from
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = False  # no attention weight is computed: the queries' centre and the keys only
    question_aware = True  # the centre includes the last prompt queries

    offset_max: int = 65536
    stats_window: int = 1024
    observation: ObservationSpec = field(init=False)

    def __post_init__(self) -> None:
        for name in ("offset_max", "stats_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(f"{name} must be an integer >= 1, got {value!r}")
        self.observation = ObservationSpec(window=self.stats_window)

    def score(self, view: LayerView) -> torch.Tensor:
        obs = view.observation
        config = getattr(view.module, "config", None)
        if obs.queries is None or config is None:
            raise RuntimeError(f"layer {view.layer_idx}: TriAttention needs recorded queries and the model config")
        device = view.keys.device
        inv_freq, scale = rope_frequencies(config, view.keys.shape[-1], device)
        qpos = obs.positions.to(device)
        queries = unrotate(obs.queries.to(device), qpos, inv_freq, scale)  # [b, hq, w, d]
        centre, magnitude = query_centres(queries, qpos >= 0)
        b, hkv = view.keys.shape[:2]
        centre, magnitude = centre.view(b, hkv, -1, centre.shape[-1]), magnitude.view(b, hkv, -1, magnitude.shape[-1])
        keys = unrotate(view.keys.reshape(b * hkv, 1, -1, view.keys.shape[-1]),
                        view.positions.reshape(b * hkv, -1), inv_freq, scale).view_as(view.keys)  # fmt: skip
        distance = view.context_lengths.view(-1, 1, 1) - view.positions
        offsets = geometric_offsets(self.offset_max, device)
        scores = trigonometric_scores(centre, magnitude, keys, distance, inv_freq, offsets, scale)
        return scores.amax(dim=2)
