"""Squared attention (the KV-Compress eviction metric, L2-sum aggregation).

KV-Compress (Rehg, arXiv 2410.00161) ranks each cached entry by the sum of its squared attention probabilities
over a set of queries: the last ``w`` prompt queries after prefill (KVC-w, max-pooled per query head with kernel 7),
or every prompt query with the ``v`` nearest keys of each query excluded (KVC-full, no pooling); during decoding
each new query adds its squared attention (no pooling). The query heads of a KV head's group are summed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache.attention import attention_probabilities
from ..errors import InvalidParameterError
from .base import LayerView, Scorer
from .observation import MAX_CHUNK_PROBABILITIES, ObservationSpec
from .reduce import pool_sequence

ALL_QUERIES = 1 << 30  # an observation window that records every prompt query
INITIALIZED = "squared_attention_initialized"  # LayerObservation.extra flag: the running metric holds the prefill one


def squared_attention(
    query: torch.Tensor,
    query_positions: torch.Tensor,
    keys: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float,
    *,
    buffer: int = 0,
    kernel: int = 7,
    chunk: int = 1024,
) -> torch.Tensor:
    """Squared attention summed over queries, max-pooled per query head, summed over each query group.

    Softmax sees every causally visible key; keys within ``buffer`` positions of a query (``t > j - buffer``) are
    left out of that query's sum. Pooling runs along the slot axis, which must be in position order (as after a
    prefill).

    Args:
        query: ``[batch, q_heads, w, head_dim]`` post-rotary queries
        query_positions: ``[batch, w]`` (``-1`` for padding)
        keys: ``[batch, kv_heads, seq, head_dim]``
        key_positions: ``[batch, kv_heads, seq]`` (``-1`` for empty slots)
        kernel: max-pool kernel (``<= 1`` for none), padding ``kernel // 2``
        chunk: queries per step (bounds memory to ``chunk × seq`` per query head); fewer on long prompts, so a
            step holds at most ``MAX_CHUNK_PROBABILITIES`` probabilities
    Returns:
        ``[batch, kv_heads, seq]`` float32
    """
    b, hq, w, _ = query.shape
    hkv, s = keys.shape[1], keys.shape[2]
    group = hq // hkv
    total = torch.zeros(b, hq, s, dtype=torch.float32, device=keys.device)
    valid = key_positions >= 0
    chunk = max(16, min(chunk, MAX_CHUNK_PROBABILITIES // max(1, b * hq * s)))  # bounded memory on long prompts
    for start in range(0, w, chunk):
        q = query[:, :, start : start + chunk]
        qpos = query_positions[:, start : start + chunk]  # [b, c]
        width = s
        if w > chunk:
            # Several query steps (every prompt query, KVC-full): a step's queries see no slot past the last one
            # holding a key at or before their last position, so those slots (the causally hidden half of a
            # prompt's keys, in slot order) are left out of its matmul and softmax: they would add exactly 0.
            # One host read per step, at compression time.
            reach = (valid & (key_positions <= qpos.amax())).flatten(0, 1).any(0)  # [s]
            width = int(torch.arange(1, s + 1, device=keys.device).masked_fill_(~reach, 0).amax()) if s else 0
            if width == 0:
                continue
        kp = key_positions[:, :, None, :width]
        qp = qpos[:, None, :, None]
        visible = valid[:, :, None, :width] & (kp <= qp) & (qp >= 0)  # [b, hkv, c, width]
        probs = attention_probabilities(q, keys[:, :, :width], visible, scaling)  # [b, hq, c, width]
        counted = (kp <= qp - buffer) if buffer > 0 else visible
        probs = probs.view(b, hkv, group, q.shape[2], width).square_()
        if buffer > 0:
            probs = probs.masked_fill_(~counted[:, :, None], 0.0)
        total[..., :width] += probs.sum(3).view(b, hq, width)
    if kernel > 1:
        total = pool_sequence(total, kernel, "max")
    return total.view(b, hkv, group, s).sum(2)


@dataclass
class SquaredAttentionScorer(Scorer):
    """KV-Compress's metric as a scorer: squared attention of the observed queries (see module docstring).

    Under a continuous schedule (``kvcompress@every:64``) the cache also accumulates each decoding query's squared
    attention (summed over the group) per slot, as the ``attn_sq_sum`` statistic. At the first compression this
    scorer replaces that statistic with the prefill metric, so from then on the statistic is the paper's running
    metric: prefill metric plus decode squared attention, moving with the entries it belongs to.

    Args:
        window: prompt queries observed (KVC-w: 32, the ``kvc_w8`` preset 8); None = every prompt query (KVC-full)
        kernel: max-pool kernel per query head (7; 1 = none, as KVC-full)
        buffer: keys within ``buffer`` positions of a query do not count for it (KVC-full: v = 10)
        chunk: queries per step when computing the metric; each step of an all-query metric reads only the slots
            up to its last query, so shorter steps compute less of the causally hidden half (docs/gpu.md,
            "Scoring and compression cost")
    """

    # capabilities (read by the method registry, kvtrim.methods.registry); see also question_aware
    uses_attention = True
    runs_in_vllm = True  # the prefill metric, and with every:N the decoded queries added at each round

    window: int | None = 32
    kernel: int = 7
    buffer: int = 0
    chunk: int = 256
    observation: ObservationSpec = field(init=False)

    @property
    def question_aware(self) -> bool:
        """Whether the last prompt queries alone drive the metric (KVC-w); KVC-full observes every query."""
        return self.window is not None

    def __post_init__(self) -> None:
        if self.window is not None and (isinstance(self.window, bool) or self.window <= 0):
            raise InvalidParameterError(f"window must be a positive integer or None (all queries), got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise InvalidParameterError(f"kernel must be an odd integer >= 1, got {self.kernel}")
        if self.buffer < 0:
            raise InvalidParameterError(f"buffer must be >= 0, got {self.buffer}")
        if self.chunk <= 0:
            raise InvalidParameterError(f"chunk must be positive, got {self.chunk}")
        self.observation = ObservationSpec(window=self.window or ALL_QUERIES)

    def prefill_metric(self, view: LayerView) -> torch.Tensor:
        """``[batch, kv_heads, seq]`` metric of the recorded prompt queries."""
        obs = view.observation
        if obs.queries is None:
            raise RuntimeError(f"layer {view.layer_idx}: the scorer needs observed queries but none were recorded")
        w = obs.window if self.window is None else min(self.window, obs.window)
        return squared_attention(
            obs.queries[:, :, -w:],
            obs.positions[:, -w:],
            view.keys,
            view.positions,
            view.scaling,
            buffer=self.buffer,
            kernel=self.kernel,
            chunk=self.chunk,
        )

    def score(self, view: LayerView) -> torch.Tensor:
        running = view.stats.get("attn_sq_sum")
        if running is None:
            return self.prefill_metric(view)
        if not view.observation.extra.get(INITIALIZED):
            # The cache summed every prompt query into the statistic; the method's prefill metric replaces it.
            running.copy_(self.prefill_metric(view))
            view.observation.extra[INITIALIZED] = True
        return running.clone()
