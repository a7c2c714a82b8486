"""The largest attention an entry gets while the model re-reads the prompt, plus its layer's head mean
(KVCompose)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InvalidParameterError
from .base import LayerView
from .reconstruction import ReconstructionScorer


@dataclass
class RereadAttentionScorer(ReconstructionScorer):
    """KVCompose's token importance ("KVCompose: Efficient Structured KV Cache Compression with Composite Tokens",
    arXiv 2509.05165), as kvpress computes it without task prompts: the prompt's own tokens are fed again after
    the uncompressed cache (no instruction before them, unlike KVzip), and an entry scores the largest attention
    any of those queries of its KV head's group pays it (:class:`ReconstructionScorer`'s pass with an empty
    instruction, no sinks). With ``head_mean`` the mean score of the layer's KV heads at that slot is added, which
    steadies the per-head ranking (kvpress's ``add_mean_across_heads``).

    Cost: one extra forward pass over the prompt attending to twice the prompt, as KVzip's.
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = True
    question_aware = False  # scores come from re-reading the prompt

    prompt: str = ""
    n_sink: int = 0
    head_mean: bool = True

    def __post_init__(self) -> None:
        if self.prompt:
            raise InvalidParameterError(f"prompt must be empty: the prompt is re-read as it is, got {self.prompt!r}")
        if not isinstance(self.head_mean, bool):
            raise InvalidParameterError(f"head_mean must be True or False, got {self.head_mean!r}")
        super().__post_init__()

    def bind(self, model) -> None:
        """Keep the model for the re-reading pass (no instruction to tokenize: the prompt is fed as it is)."""
        self._model = model
        self._repeat_ids, self._prefix_len = torch.zeros(0, dtype=torch.long), 0

    def score(self, view: LayerView) -> torch.Tensor:
        scores = super().score(view)
        if not self.head_mean:
            return scores
        valid = view.valid
        mean = (scores * valid).sum(1, keepdim=True) / valid.sum(1, keepdim=True).clamp(min=1)
        return scores + mean * valid

    def describe_compression(self, shared: dict) -> dict:
        return {"reread_tokens": shared["kvzip_reread_tokens"]} if "kvzip_reread_tokens" in shared else {}
