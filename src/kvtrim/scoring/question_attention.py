"""Attention the prompt's question pays to the context (FINCH)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InvalidParameterError
from .base import LayerView, Scorer
from .observation import ObservationSpec
from .reduce import reduce_group


def question_attention_scores(
    probs: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    question_start: torch.Tensor,
    normalize: bool,
) -> torch.Tensor:
    """Mean attention the question's queries pay each entry, each query's row weighted by the number of entries it
    sees when ``normalize``; entries of the question itself score above every context entry of their head.

    A causal query at position ``p`` spreads its attention over the ``p + 1`` entries it sees, so late queries give
    each entry less; weighting a row by that count puts every query's attention on the scale of a uniform 1.

    Args:
        probs: ``[batch, q_heads, w, seq]`` attention of the last ``w`` recorded queries (0 for padding queries)
        query_positions: ``[batch, w]`` their logical positions (``-1``: padding)
        key_positions: ``[batch, kv_heads, seq]`` logical positions of the entries (``-1``: empty)
        question_start: ``[batch]`` first position of the question
    Returns:
        ``[batch, kv_heads, seq]`` fp32
    """
    b, hq = probs.shape[:2]
    hkv = key_positions.shape[1]
    asks = (query_positions >= question_start[:, None]) & (query_positions >= 0)  # [b, w]
    weight = asks.float()[:, None, :].expand(b, hkv, -1)  # [b, hkv, w]
    if normalize:
        valid = key_positions >= 0
        seen = (valid[:, :, None, :] & (key_positions[:, :, None, :] <= query_positions[:, None, :, None])).sum(-1)
        weight = weight * seen.float()
    weight = weight.repeat_interleave(hq // hkv, dim=1)  # [b, hq, w]
    per_head = (probs * weight[..., None]).sum(2) / asks.sum(-1).clamp(min=1).view(b, 1, 1)
    scores = reduce_group(per_head, hkv, "mean")
    question = (key_positions >= question_start.view(b, 1, 1)) & (key_positions >= 0)
    context = scores.masked_fill(question | (key_positions < 0), float("-inf"))
    top = context.amax(-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
    return torch.where(question, top + 1.0, scores)


@dataclass
class QuestionAttentionScorer(Scorer):
    """FINCH (Corallo & Papotti, "FINCH: Prompt-guided Key-Value Cache Compression for Large Language Models",
    TACL 2024, doi 10.1162/tacl_a_00716, arXiv 2408.00167): the entries the question attends to are kept.

    The observation window is the prompt's question part: the queries from ``view.question_start`` on (set for a
    question-aware prompt built from a context and a question), or the last ``window`` prompt tokens when
    ``window`` is given (a caller's own ``model.generate``). Per query head the attention of those queries is
    averaged, each query's row weighted by the number of entries it sees (``normalize``, see
    :func:`question_attention_scores`), then averaged over the GQA group; the question's own entries score above
    the rest, so the selector keeps them first.

    Args:
        window: None for the question part; a positive integer for the last ``window`` prompt tokens
        max_question: prompt queries recorded at prefill; a longer question is refused
        normalize: weight each query's attention by the number of entries it sees
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = True
    question_aware = True

    window: int | None = None
    max_question: int = 1024
    normalize: bool = True
    observation: ObservationSpec = field(init=False)

    def __post_init__(self) -> None:
        if self.window is not None and (
            isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1
        ):
            raise InvalidParameterError(f"window must be None (the question) or an integer >= 1, got {self.window!r}")
        if isinstance(self.max_question, bool) or not isinstance(self.max_question, int) or self.max_question < 1:
            raise InvalidParameterError(f"max_question must be an integer >= 1, got {self.max_question!r}")
        if not isinstance(self.normalize, bool):
            raise InvalidParameterError(f"normalize must be True or False, got {self.normalize!r}")
        self.observation = ObservationSpec(window=self.window or self.max_question)

    def question_start(self, view: LayerView) -> torch.Tensor:
        """``[batch]`` first position of the observation window."""
        obs = view.observation
        if obs.queries is None:
            raise RuntimeError(f"layer {view.layer_idx}: FINCH needs the prompt's recorded queries")
        if self.window is not None:
            return (view.context_lengths - self.window).clamp(min=0).to(view.positions.device)
        if view.question_start is None:
            raise InvalidParameterError(
                "finch selects with the attention of the question, but this prompt holds no question: run it "
                "question-aware (kvtrim.generate(..., question_aware=True), kvtrim eval --question-aware) or give "
                "window=N (the last N prompt tokens)"
            )
        start = view.question_start.to(view.positions.device)
        asked = (obs.positions.to(start.device) >= start[:, None]).any(-1)
        if not bool(asked.all()):
            raise InvalidParameterError(
                "finch: the question has not been read yet at this compression (a chunked prefill compresses "
                "before the question arrives); prefill in one pass"
            )
        oldest = obs.positions.clamp(min=0).amin(-1).to(start.device)
        if obs.window >= self.max_question and bool((start < oldest).any()):
            raise InvalidParameterError(
                f"finch: the question is longer than max_question={self.max_question} tokens; raise max_question"
            )
        return start

    def score(self, view: LayerView) -> torch.Tensor:
        start = self.question_start(view)
        obs = view.observation
        asked = int((view.context_lengths.to(start.device) - start).max().clamp(min=1, max=obs.window))
        probs = view.window_attention(asked)  # only the question's queries: the last `asked` of every row
        query_positions = obs.positions[:, -asked:].to(start.device)
        return question_attention_scores(probs, query_positions, view.positions, start, self.normalize)
