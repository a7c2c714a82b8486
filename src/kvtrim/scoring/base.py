"""The scorer interface and the per-layer view scorers read from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..cache.attention import attention_probabilities
from ..parts import Part
from .observation import LayerObservation, ObservationSpec


@dataclass
class LayerView:
    """What a scorer can see of one layer at compression time.

    Attributes:
        keys, values: ``[batch, kv_heads, seq, head_dim]`` stored entries (post-rotary keys)
        positions: ``[batch, kv_heads, seq]`` logical positions, ``-1`` for empty slots
        context_lengths: ``[batch]`` tokens seen per row (positions run from 0 to this minus one)
        observation: window queries recorded during prefill
        stats: per-slot statistics accumulated during prefill (``attn_sum`` …), each ``[batch, kv_heads, seq]``
        module: the layer's attention module (``o_proj``, ``head_dim``, ``scaling`` …)
        logits: the prompt's last-position logits when the caller passed them
        compressed_until: ``[batch]`` first position a recursive method has not compressed yet (None: never ran)
        prompt_logprobs: ``[batch, w]`` log p(x_j | x_<j) of the last prompt tokens (NaN: padding), when the
            method's observation asked for them and the prefill ran through :mod:`kvtrim.api`
        prompt_ids: ``[batch, n]`` the prompt's token ids (``-1``: padding), when the method's observation asked
            for ``input_ids``
        question_start: ``[batch]`` logical position where the prompt's question part begins, when the prompt was
            built from a context and a question (question-aware mode of :mod:`kvtrim.api`); None otherwise
        shared: one dict shared by the views of all layers in a compression, for cross-layer quantities
        replay: ``replay(model, views, input_ids, attention_mask, position_ids, observation) -> {layer: store}``
            feeds ``input_ids`` through ``model`` over a scratch copy of the views' entries, recording
            ``observation``, and returns each layer's scratch store (KVzip re-reads its context this way); given by
            the cache being compressed; keywords ``grad=True`` (record an autograd graph), ``observations={}``
            (filled with each layer's recorded observation) and ``inputs_embeds`` (fed instead of ``input_ids``)
    """

    layer_idx: int
    num_layers: int
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    context_lengths: torch.Tensor
    observation: LayerObservation
    stats: dict[str, torch.Tensor]
    module: torch.nn.Module | None
    scaling: float
    logits: torch.Tensor | None = None
    compressed_until: torch.Tensor | None = None
    prompt_logprobs: torch.Tensor | None = None
    prompt_ids: torch.Tensor | None = None
    question_start: torch.Tensor | None = None
    shared: dict = field(default_factory=dict)
    replay: Callable[..., dict] | None = None
    _cache: dict = field(default_factory=dict)

    def release_intermediates(self) -> None:
        """Free what scoring this layer cached (window attention and the like) before the next layer is scored."""
        self._cache.clear()

    @property
    def valid(self) -> torch.Tensor:
        """``[batch, kv_heads, seq]`` True where a slot holds a real token."""
        return self.positions >= 0

    @property
    def kv_heads(self) -> int:
        return self.keys.shape[1]

    def window_attention(self, window: int) -> torch.Tensor:
        """Attention of the last ``window`` recorded queries over the stored entries.

        Returns ``[batch, q_heads, min(window, recorded), seq]`` fp32 probabilities (causal by position;
        padding queries are all zero). Computed once per window size and reused.
        """
        obs = self.observation
        if obs.queries is None:
            raise RuntimeError(f"layer {self.layer_idx}: the scorer needs observed queries but none were recorded")
        window = min(window, obs.window)  # prompts shorter than the window use all their queries
        if window in self._cache:
            return self._cache[window]
        q = obs.queries[:, :, -window:]
        qpos = obs.positions[:, -window:]
        kpos = self.positions
        mask = (kpos[:, :, None, :] >= 0) & (kpos[:, :, None, :] <= qpos[:, None, :, None])
        mask = mask & (qpos >= 0)[:, None, :, None]
        probs = attention_probabilities(q, self.keys, mask, self.scaling)
        self._cache[window] = probs
        return probs


class Scorer(Part):
    """Scores how much each stored entry matters: ``score(view) -> [batch, kv_heads, seq]`` (higher = keep).

    A scorer that needs quantities across layers overrides :meth:`prepare`, called once per compression with every
    layer's view before any ``score`` call (results go in ``view.shared``); the other hooks are :class:`Part`'s.
    """

    _declares_interface = True
    observation: ObservationSpec

    def score(self, view: LayerView) -> torch.Tensor:
        """``[batch, kv_heads, seq]`` importance of every stored slot of ``view`` (higher = keep)."""
        raise NotImplementedError(f"{type(self).__name__} must define score(view)")

    def prepare(self, views: list[LayerView]) -> None:
        """Compute cross-layer quantities once per compression (into ``views[0].shared``); no-op by default."""
