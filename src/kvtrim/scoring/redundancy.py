"""Key redundancy: how much each stored key repeats the others (R-KV's redundancy term)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import LayerView, Scorer
from .observation import ObservationSpec
from .window_attention import WindowAttentionScorer

ROW_BLOCK = 1024  # similarity rows computed at once: memory [batch, kv_heads, ROW_BLOCK, seq]


def key_redundancy(
    keys: torch.Tensor, valid: torch.Tensor, threshold: float = 0.5, row_block: int = ROW_BLOCK
) -> torch.Tensor:
    """R-KV's redundancy of every stored key, a distribution over each head's entries.

    With ``s_ij`` the cosine similarity of keys ``i`` and ``j`` (``s_ii = 0``, empty slots 0): for every row ``i``,
    the latest ``j`` with ``s_ij > threshold`` is exempted (``s_ij := 0``), so the newest of a set of near-copies is
    not pushed out by the older ones; then key ``j``'s redundancy is the mean of column ``j`` over the real rows,
    softmaxed over the head's real entries. Rows are computed ``row_block`` at a time.

    Args:
        keys: ``[batch, kv_heads, seq, head_dim]``
        valid: ``[batch, kv_heads, seq]`` True where a slot holds a real token
    Returns:
        ``[batch, kv_heads, seq]`` fp32, summing to 1 over each head's real entries (0 on empty slots)
    """
    unit = torch.nn.functional.normalize(keys.float(), dim=-1, eps=1e-8) * valid[..., None]
    seq = keys.shape[2]
    column_sum = torch.zeros(valid.shape, dtype=torch.float32, device=keys.device)
    cols = torch.arange(seq, device=keys.device)
    for start in range(0, seq, row_block):
        rows = unit[:, :, start : start + row_block]  # [b, h, r, d]
        sim = rows @ unit.transpose(-1, -2)  # [b, h, r, seq]
        r = sim.shape[2]
        diag = (cols[None, :] == torch.arange(start, start + r, device=keys.device)[:, None])  # [r, seq]
        sim.masked_fill_(diag, 0.0)
        similar = sim > threshold
        latest = torch.where(similar, cols, -1).amax(-1, keepdim=True)  # [b, h, r, 1]; -1: no similar key
        sim.masked_fill_((cols == latest) & (latest >= 0), 0.0)
        column_sum += sim.sum(2)
    count = valid.sum(-1, keepdim=True).clamp(min=1)
    mean = (column_sum / count).masked_fill(~valid, float("-inf"))
    return torch.softmax(mean, dim=-1).nan_to_num(0.0)


@dataclass
class RedundancyAwareScorer(Scorer):
    """R-KV's score (Cai et al., 2025, "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models",
    arXiv 2505.24133): ``mix · importance − (1 − mix) · redundancy``.

    ``importance`` is the window attention of :class:`WindowAttentionScorer` (the last ``window`` queries, mean over
    them, max over the query heads of a KV head, max-pooled along the sequence); ``redundancy`` is
    :func:`key_redundancy`. Both come from softmaxes over the head's entries, so ``mix`` weighs comparable scales
    (R-KV: 0.07, redundancy dominates).
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = True
    question_aware = True

    window: int = 8
    kernel: int = 7
    mix: float = 0.07
    threshold: float = 0.5
    importance: WindowAttentionScorer = field(init=False)
    observation: ObservationSpec = field(init=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.mix <= 1.0:
            raise ValueError(f"mix must be in [0, 1], got {self.mix}")
        if not -1.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be a cosine similarity in [-1, 1], got {self.threshold}")
        self.importance = WindowAttentionScorer(
            window=self.window, kernel=self.kernel, pooling="max", aggregate="mean", group_reduce="max"
        )
        self.observation = self.importance.observation

    def score(self, view: LayerView) -> torch.Tensor:
        importance = self.importance.score(view)
        redundancy = key_redundancy(view.keys, view.valid, self.threshold)
        return self.mix * importance - (1.0 - self.mix) * redundancy
