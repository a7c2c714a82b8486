"""What scorers need to see while a prompt is prefilled, recorded from inside the attention call.

Recording happens per layer right after the layer's keys are stored, so scorers get post-rotary queries
without recomputing them, whatever attention kernel the model would otherwise use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache.attention import attention_probabilities

# At most this many fp32 attention probabilities per chunk (256 MiB): long prompts get fewer queries per chunk.
MAX_CHUNK_PROBABILITIES = 1 << 26


class TokenScores:
    """A score for every new token of a layer, computed from the attention layer's input hidden states when the
    token arrives (a learned surrogate, KVzap) and kept as the per-slot statistic :attr:`stat`, which follows
    compaction like the accumulated attention statistics.

    Two instances with the same :attr:`stat` compute the same scores (the name identifies the weights).
    """

    stat: str = "token_scores"

    def __call__(self, model: torch.nn.Module, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
        """``[batch, kv_heads, q]`` scores of the ``q`` new tokens from ``hidden`` ``[batch, q, hidden_size]``
        (the input of layer ``layer_idx``'s attention); ``model`` lets lazily loaded weights find their model."""
        raise NotImplementedError(f"{type(self).__name__} must define __call__(model, layer_idx, hidden)")


@dataclass(frozen=True)
class ObservationSpec:
    """What to record during prefill.

    Attributes:
        window: keep the last ``window`` queries of the prompt (observation window), 0 for none
        accumulate: per-slot attention statistics summed over all prompt queries, computed in query chunks:
            ``"attn_sum"`` (attention mass received), ``"attn_sq_sum"`` (squared attention),
            ``"attn_band_sum"`` (attention received from the queries at most ``band`` positions after the key) and/or
            ``"attn_max"`` (the largest attention any query of the KV head's group paid the slot)
        chunk: number of queries per chunk when accumulating (bounds memory to ``chunk × seq`` per head); long
            prompts use fewer, so a chunk holds at most ``MAX_CHUNK_PROBABILITIES`` probabilities
        token_logprobs: keep the teacher-forced log-probabilities of the last ``token_logprobs`` prompt tokens
            (from the prefill logits; recorded by :mod:`kvtrim.api`, which owns the LM head's output)
        input_ids: keep the prompt's token ids (``KVTrimCache.prompt_ids``), for methods that feed the prompt
            to the model again (KVzip); recorded by :mod:`kvtrim.integration.prompt_ids`
        token_scores: score every new token from its hidden state as it arrives (:class:`TokenScores`, one per
            statistic), each kept as the per-slot statistic ``.stat``; recorded by
            :mod:`kvtrim.integration.hidden_states`
    """

    window: int = 0
    accumulate: tuple[str, ...] = ()
    chunk: int = 256
    token_logprobs: int = 0
    band: int = 32
    input_ids: bool = False
    token_scores: tuple[TokenScores, ...] = ()

    @property
    def slot_stats(self) -> tuple[str, ...]:
        """Names of the per-slot statistics this spec fills: ``accumulate`` plus the token scores' statistics."""
        return self.accumulate + tuple(t.stat for t in self.token_scores)

    def covers(self, need: ObservationSpec) -> bool:
        """Whether a prefill recorded with this spec holds everything ``need`` asks for."""
        return (
            need.window <= self.window
            and set(need.accumulate) <= set(self.accumulate)
            and need.token_logprobs <= self.token_logprobs
            and ("attn_band_sum" not in need.accumulate or need.band <= self.band)
            and (self.input_ids or not need.input_ids)
            and {t.stat for t in need.token_scores} <= {t.stat for t in self.token_scores}
        )

    def merge(self, other: ObservationSpec) -> ObservationSpec:
        names = {t.stat for t in self.token_scores}
        return ObservationSpec(
            window=max(self.window, other.window),
            accumulate=tuple(sorted(set(self.accumulate) | set(other.accumulate))),
            chunk=min(self.chunk, other.chunk),
            token_logprobs=max(self.token_logprobs, other.token_logprobs),
            band=max(self.band, other.band),
            input_ids=self.input_ids or other.input_ids,
            token_scores=self.token_scores + tuple(t for t in other.token_scores if t.stat not in names),
        )


@dataclass
class LayerObservation:
    """Recorded window queries of one layer.

    Attributes:
        queries: ``[batch, q_heads, w, head_dim]`` post-rotary queries of the last ``w`` prompt tokens
        positions: ``[batch, w]`` their logical positions (``-1`` for padding)
    """

    queries: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    def copy(self) -> LayerObservation:
        return LayerObservation(
            queries=None if self.queries is None else self.queries.clone(),
            positions=None if self.positions is None else self.positions.clone(),
            extra=dict(self.extra),
        )

    @property
    def window(self) -> int:
        return 0 if self.queries is None else self.queries.shape[2]


def record(
    spec: ObservationSpec,
    obs: LayerObservation,
    store,
    query: torch.Tensor,
    query_positions: torch.Tensor,
    scaling: float,
) -> None:
    """Record what ``spec`` asks for from one attention call (a prefill chunk).

    Args:
        query: ``[batch, q_heads, q, head_dim]`` post-rotary queries of the new tokens
        query_positions: ``[batch, q]`` logical positions, ``-1`` for padding
    """
    if spec.window > 0:
        # Copies, not views: a view of the last ``window`` queries would keep the whole chunk's queries alive in
        # every layer until compression (a 4096-token chunk of an 8B model: 1 GiB per sequence).
        if obs.queries is None:
            queries, positions = query, query_positions
        else:
            queries, positions = torch.cat([obs.queries, query], dim=2), torch.cat([obs.positions, query_positions], 1)
        obs.queries = queries[:, :, -spec.window :].clone()
        obs.positions = positions[:, -spec.window :].clone()
    if not spec.accumulate:
        return
    kpos = store.positions
    hkv = store.kv_heads
    group = query.shape[1] // hkv
    sums = {name: store.stat(name) for name in spec.accumulate}
    # The queries are the store's last slots (appended just before this call, all rows in lockstep), so a chunk's
    # queries can only see slots up to its own last one: the causally hidden rest is skipped.
    first_query_slot = store.length - query.shape[2]
    per_query = query.shape[0] * query.shape[1] * store.length
    chunk = max(16, min(spec.chunk, MAX_CHUNK_PROBABILITIES // per_query))
    for start in range(0, query.shape[2], chunk):
        q = query[:, :, start : start + chunk]
        qpos = query_positions[:, start : start + chunk]
        limit = first_query_slot + start + q.shape[2]
        kp = kpos[..., :limit]
        mask = (kp[:, :, None, :] >= 0) & (kp[:, :, None, :] <= qpos[:, None, :, None])
        mask = mask & (qpos >= 0)[:, None, :, None]
        probs = attention_probabilities(q, store.keys[:, :, :limit], mask, scaling)  # [b, hq, c, limit]
        probs = probs.view(probs.shape[0], hkv, group, probs.shape[2], -1)
        if "attn_sum" in sums:
            sums["attn_sum"][..., :limit] += probs.sum(dim=(2, 3))
        if "attn_band_sum" in sums:
            near = (kp[:, :, None, :] >= (qpos[:, None, :, None] - spec.band))[:, :, None]  # [b, hkv, 1, c, limit]
            sums["attn_band_sum"][..., :limit] += (probs * near).sum(dim=(2, 3))
        if "attn_max" in sums:
            best = sums["attn_max"]
            best[..., :limit] = torch.maximum(best[..., :limit], probs.amax(dim=(2, 3)))
        if "attn_sq_sum" in sums:  # last: squares in place, no second chunk-sized buffer
            sums["attn_sq_sum"][..., :limit] += probs.square_().sum(dim=(2, 3))
