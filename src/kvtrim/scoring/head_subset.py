"""Window attention of a chosen subset of query heads per layer (semantic retrieval heads).

CompressKV (arXiv 2508.02401) scores the prompt of each layer with only a few query heads, picked offline by their
retrieval behaviour: per layer, each chosen head's attention from the last ``w`` prompt queries (against its own
KV group's keys, fp32 softmax) is summed over those queries, average-pooled along the tokens (kernel 5), and the
chosen heads are averaged. That one vector per layer is given to every KV head, so all KV heads of a layer keep
the same tokens.

Scores are built in *position* space (token positions ``0..T-1``) and gathered back to each KV head's slots, so
left padding and heads whose slots hold different tokens are handled; the window tokens' own scores are zeroed
before pooling (the reference pools the non-window part only), and the selector protects them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InvalidParameterError
from .base import LayerView, Scorer
from .observation import ObservationSpec
from .reduce import POOLINGS, pool_sequence

__all__ = ["ArtifactHeadSubsetScorer", "HeadSubsetScorer", "top_heads_per_layer"]


def top_heads_per_layer(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``[layers, k]`` indices of the ``k`` highest-scoring query heads of each layer (descending; ties by index).

    Args:
        scores: ``[layers, q_heads]`` head scores
    """
    if scores.dim() != 2:
        raise InvalidParameterError(f"head scores must be [layers, q_heads], got shape {tuple(scores.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= scores.shape[1]:
        raise InvalidParameterError(f"heads_per_layer must be an integer in [1, {scores.shape[1]}], got {k!r}")
    order = torch.argsort(scores.double(), dim=1, descending=True, stable=True)
    return order[:, :k].contiguous()


@dataclass
class HeadSubsetScorer(Scorer):
    """Per layer, the mean pooled window attention of a fixed set of query heads, shared by all KV heads.

    Args:
        heads: ``[layers, k]`` query-head indices per layer
        window: observation window ``w`` (queries summed, and tokens protected by the selector)
        kernel, pooling: sequence pooling (``avg`` kernel 5 in CompressKV)
        per_kv_head: give each KV head the mean over the chosen heads of *its* group instead (a KV head with no
            chosen head gets the layer mean); for head-adaptive budgets, which need scores that differ per head
    """

    heads: torch.Tensor
    window: int = 8
    kernel: int = 5
    pooling: str = "avg"
    per_kv_head: bool = False
    observation: ObservationSpec = field(init=False)

    def __post_init__(self) -> None:
        if self.window <= 0:
            raise InvalidParameterError(f"window must be positive, got {self.window}")
        if self.pooling not in POOLINGS:
            raise InvalidParameterError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        heads = torch.as_tensor(self.heads).long()
        if heads.dim() != 2 or heads.shape[1] == 0:
            raise InvalidParameterError(f"heads must be [layers, k] query-head indices, got {tuple(heads.shape)}")
        self.heads = heads
        self.observation = ObservationSpec(window=self.window)

    def position_scores(self, view: LayerView) -> torch.Tensor:
        """``[batch, k, T]`` pooled window attention of the layer's chosen heads over token positions."""
        if view.layer_idx >= self.heads.shape[0]:
            raise InvalidParameterError(
                f"head subset covers {self.heads.shape[0]} layers but the cache has layer {view.layer_idx}"
            )
        probs = view.window_attention(self.window)  # [b, hq, w, seq]
        b, hq, w, _ = probs.shape
        heads = self.heads[view.layer_idx].to(probs.device)
        if int(heads.max()) >= hq or int(heads.min()) < 0:
            raise InvalidParameterError(f"head indices {heads.tolist()} out of range for {hq} query heads")
        group = hq // view.kv_heads
        attn = probs.sum(2)[:, heads]  # [b, k, seq], summed over the window queries
        pos = view.positions[:, heads // group]  # [b, k, seq] positions of each chosen head's KV group
        valid = pos >= 0
        length = int(view.context_lengths.max())
        dense = torch.zeros(b, heads.numel(), max(length, 1), dtype=torch.float32, device=probs.device)
        dense.scatter_add_(-1, pos.clamp(min=0), attn.float() * valid)
        start = (view.context_lengths.to(probs.device) - w).view(b, 1, 1)  # the window is protected, not scored
        dense = dense.masked_fill(torch.arange(dense.shape[-1], device=probs.device) >= start, 0.0)
        return pool_sequence(dense, self.kernel, self.pooling)

    def score(self, view: LayerView) -> torch.Tensor:
        """``[batch, kv_heads, seq]``: the layer's score of the token each slot holds."""
        pooled = self.position_scores(view)  # [b, k, T]
        shared = pooled.mean(1)  # [b, T]
        kv = view.kv_heads
        if self.per_kv_head:
            heads = self.heads[view.layer_idx].tolist()
            group = view.observation.queries.shape[1] // kv  # query heads per KV head
            rows = []
            for g in range(kv):
                members = [i for i, h in enumerate(heads) if h // group == g]
                rows.append(pooled[:, members].mean(1) if members else shared)
            per_head = torch.stack(rows, 1)  # [b, kv, T]
        else:
            per_head = shared[:, None].expand(-1, kv, -1)
        index = view.positions.clamp(min=0).to(per_head.device)
        return torch.gather(per_head, -1, index)


@dataclass
class ArtifactHeadSubsetScorer(Scorer):
    """:class:`HeadSubsetScorer` whose heads are the top ``heads_per_layer`` of a ``compresskv`` artifact tensor.

    Binding happens when a method is resolved for a model (``kvtrim.generate``, ``Session``, ``compressing``…); a
    model with no artifact raises :class:`~kvtrim.errors.MissingArtifactError` naming
    ``kvtrim calibrate compresskv`` before anything runs.

    Args:
        ranking: the artifact's head scores to rank by: ``srh`` (semantic retrieval heads) or ``trh``
            (copy-paste retrieval heads)
        heads_per_layer: query heads used per layer (4 in CompressKV)
        path: an explicit artifact file or directory (default: search the kvtrim home, then the package)
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = True
    question_aware = True
    artifact_kind = "compresskv"

    ranking: str = "srh"
    heads_per_layer: int = 4
    window: int = 8
    kernel: int = 5
    pooling: str = "avg"
    per_kv_head: bool = False
    path: str | None = None
    observation: ObservationSpec = field(init=False)
    _inner: HeadSubsetScorer | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.window <= 0:
            raise InvalidParameterError(f"window must be positive, got {self.window}")
        if isinstance(self.heads_per_layer, bool) or not isinstance(self.heads_per_layer, int):
            raise InvalidParameterError(f"heads_per_layer must be a positive integer, got {self.heads_per_layer!r}")
        if self.heads_per_layer <= 0:
            raise InvalidParameterError(f"heads_per_layer must be a positive integer, got {self.heads_per_layer}")
        if self.pooling not in POOLINGS:
            raise InvalidParameterError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        self.observation = ObservationSpec(window=self.window)

    def bind(self, model: torch.nn.Module) -> None:
        from ..artifacts.compresskv import load_compresskv

        artifact = load_compresskv(model, self.path)
        if self.ranking not in artifact.tensors:
            raise InvalidParameterError(f"ranking={self.ranking!r}: the artifact holds {sorted(artifact.tensors)}")
        heads = top_heads_per_layer(artifact.tensors[self.ranking], self.heads_per_layer)
        self._inner = HeadSubsetScorer(heads, self.window, self.kernel, self.pooling, self.per_kv_head)

    @property
    def heads(self) -> torch.Tensor | None:
        """``[layers, k]`` chosen query heads once bound."""
        return None if self._inner is None else self._inner.heads

    def score(self, view: LayerView) -> torch.Tensor:
        if self._inner is None:
            raise InvalidParameterError(
                "head-subset scores need the model's compresskv artifact: resolve the method through "
                "kvtrim.generate, kvtrim.Session or kvtrim.compressing, or call pipeline.bind(model) first"
            )
        return self._inner.score(view)
