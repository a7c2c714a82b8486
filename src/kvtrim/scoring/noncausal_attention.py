"""Non-causal attention inside chunks of the prompt, and its blend with key leverage (Compactor)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..cache.attention import attention_probabilities
from ..errors import InvalidParameterError
from .base import LayerView, Scorer
from .expected_attention import ALL_QUERIES
from .leverage import leverage_scores, unrotate_keys
from .observation import ObservationSpec


def chunk_attention(
    queries: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float,
    chunk: int,
    scored: torch.Tensor,
    query_scored: torch.Tensor,
    start: int = 0,
) -> torch.Tensor:
    """Attention each key receives, summed over the queries of its chunk, each query seeing its whole chunk.

    Positions ``start, start+1, …`` are cut into chunks of ``chunk``; a query attends (softmax, no causal mask) to
    the keys of its own chunk only. Queries outside ``query_scored`` and keys outside ``scored`` take no part.

    Args:
        queries: ``[batch, q_heads, n, head_dim]`` at ``query_positions`` ``[batch, n]`` (``-1``: padding)
        keys: ``[batch, kv_heads, seq, head_dim]`` at ``key_positions`` ``[batch, kv_heads, seq]``
        scored: ``[batch, kv_heads, seq]`` keys that take part; query_scored: ``[batch, n]`` queries that take part
    Returns:
        ``[batch, q_heads, seq]`` fp32 column sums (0 outside ``scored``)
    """
    b, hq, n, _ = queries.shape
    hkv, s = keys.shape[1], keys.shape[2]
    key_chunk = torch.where(scored, (key_positions - start).div(chunk, rounding_mode="floor"), -2)
    query_chunk = torch.where(query_scored, (query_positions - start).div(chunk, rounding_mode="floor"), -1)
    total = torch.zeros(b, hq, s, dtype=torch.float32, device=keys.device)
    for begin in range(0, n, chunk):  # query blocks bound the [q_heads, block, keys] working set
        qc = query_chunk[:, begin : begin + chunk]  # [b, c]
        taking_part = qc >= 0
        if not bool(taking_part.any()):
            continue
        # only the key slots of the block's chunks can be seen: slice them out (one host read per block; this
        # runs at compression, not per decoded token) so the cost is ~chunk × chunk per block, not chunk × seq
        low, high = qc.masked_fill(~taking_part, 2**62).min(), qc.max()
        seen = ((key_chunk >= low) & (key_chunk <= high)).flatten(0, 1).any(0).nonzero()
        if seen.numel() == 0:
            continue
        lo, hi = int(seen[0]), int(seen[-1]) + 1
        mask = key_chunk[:, :, None, lo:hi] == qc[:, None, :, None]  # [b, hkv, c, hi-lo]; unscored keys are -2
        probs = attention_probabilities(queries[:, :, begin : begin + chunk], keys[:, :, lo:hi], mask, scaling)
        total[..., lo:hi] += probs.sum(2)
    return total.view(b, hkv * (hq // hkv), s)


def zscore(scores: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:
    """``(x − mean) / std`` over the scored entries of each row (all heads together); 0 elsewhere.

    Args:
        scores, scored: ``[batch, kv_heads, seq]``
    """
    weight = scored.to(torch.float32)
    count = weight.sum((1, 2), keepdim=True).clamp(min=1.0)
    mean = (scores * weight).sum((1, 2), keepdim=True) / count
    var = ((scores - mean).pow(2) * weight).sum((1, 2), keepdim=True) / (count - 1).clamp(min=1.0)
    return torch.where(scored, (scores - mean) / var.sqrt().clamp(min=1e-6), 0.0)


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidParameterError(f"{name} must be an integer >= {low}, got {value!r}")


def _attention_part(
    view: LayerView, chunk: int, start: int, end: int, scaled: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked non-causal attention over positions ``[start, context − end)``, averaged over the GQA group,
    × ``‖v‖``, smoothed over 3 neighbouring slots; returns it with the ``[batch, kv_heads, seq]`` scored mask.
    ``scaled=False`` leaves the logits ``q·k`` without the model's ``1/√d`` scale."""
    obs = view.observation
    if obs.queries is None:
        raise RuntimeError(f"layer {view.layer_idx}: chunked attention needs the prompt's recorded queries")
    device = view.keys.device
    context = view.context_lengths.to(device)
    scored = view.valid & (view.positions >= start) & (view.positions < context[:, None, None] - end)
    qpos = obs.positions.to(device)
    query_scored = (qpos >= start) & (qpos < context[:, None] - end)
    columns = chunk_attention(
        obs.queries.to(device), qpos, view.keys, view.positions, view.scaling if scaled else 1.0, chunk, scored,
        query_scored, start,
    )  # fmt: skip
    b, hkv, s = scored.shape
    columns = columns.view(b, hkv, -1, s).mean(2)
    scores = columns * view.values.float().norm(dim=-1) * scored
    smooth = F.avg_pool1d(scores.view(b * hkv, 1, s), kernel_size=3, stride=1, padding=1).view(b, hkv, s)
    return smooth * scored, scored


@dataclass
class ChunkAttentionScorer(Scorer):
    """Non-causal chunked attention (Chari & Van Durme, 2025, "Compactor: Calibrated Query-Agnostic KV Cache
    Compression with Approximate Leverage Scores", arXiv 2507.08143; kvpress's NonCausalAttnPress).

    The prompt is cut into chunks of ``chunk`` positions; inside a chunk every query attends to every key (no
    causal mask), and a key scores the attention its chunk's queries pay it (averaged over the GQA group) times
    ``‖v‖₂``, smoothed by a 3-wide average over neighbouring slots. Needs every prompt query (recorded during
    prefill, ``q_heads × n × head_dim`` values per layer); costs ``n × chunk`` attention weights per query head.
    Compactor calls it query-agnostic: a question only moves the scores of its own chunk.

    ``scaled`` (default True) divides the logits by ``√d`` as the model's own attention does; ``scaled=False``
    softmaxes the raw ``q·k`` as kvpress 0.5.5's NonCausalAttnPress does (a sharper distribution).
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = True
    question_aware = False

    chunk: int = 256
    scaled: bool = True
    observation: ObservationSpec = field(init=False)

    def __post_init__(self) -> None:
        _check_int("chunk", self.chunk, 1)
        if not isinstance(self.scaled, bool):
            raise InvalidParameterError(f"scaled must be True or False, got {self.scaled!r}")
        self.observation = ObservationSpec(window=ALL_QUERIES)

    def score(self, view: LayerView) -> torch.Tensor:
        return _attention_part(view, self.chunk, 0, 0, self.scaled)[0]


@dataclass
class LeverageAttentionScorer(Scorer):
    """Compactor's score (Chari & Van Durme, 2025, arXiv 2507.08143; kvpress's CompactorPress): ``blending ·
    z(leverage of the pre-RoPE keys) + z(chunked non-causal attention)``, both computed on the entries between the
    first ``sink_start`` and the last ``sink_end`` positions (the selector keeps those), ``z`` a z-score over all
    heads of a row. Chunks start at position ``sink_start``, as kvpress's do. The leverage is exact (see
    :class:`~kvtrim.scoring.leverage.KeyLeverageScorer`).
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = True
    question_aware = False

    blending: float = 0.35
    chunk: int = 256
    sink_start: int = 8
    sink_end: int = 4
    observation: ObservationSpec = field(init=False)

    def __post_init__(self) -> None:
        _check_int("chunk", self.chunk, 1)
        _check_int("sink_start", self.sink_start, 0)
        _check_int("sink_end", self.sink_end, 0)
        if isinstance(self.blending, bool) or not isinstance(self.blending, (int, float)) or not self.blending >= 0:
            raise InvalidParameterError(f"blending must be a number >= 0, got {self.blending!r}")
        self.observation = ObservationSpec(window=ALL_QUERIES)

    def score(self, view: LayerView) -> torch.Tensor:
        config = getattr(view.module, "config", None)
        if config is None:
            raise RuntimeError(f"layer {view.layer_idx}: leverage scores need the attention module's config")
        attention, scored = _attention_part(view, self.chunk, self.sink_start, self.sink_end)
        leverage = leverage_scores(unrotate_keys(view.keys, view.positions, config), scored)
        return self.blending * zscore(leverage, scored) + zscore(attention, scored)
