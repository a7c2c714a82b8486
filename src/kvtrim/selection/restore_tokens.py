"""Entries appended to a compressed cache that are not tokens of the prompt: RestoreKV's learned restore tokens."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..artifacts.restorekv import RESTOREKV_KIND, RestoreWeights, load_restore_weights
from ..errors import InvalidParameterError
from ..parts import Part
from ..scoring.base import LayerView
from ..scoring.observation import ObservationSpec
from .base import Selection

__all__ = ["AppendedEntries", "RestoreTokens", "keep_appended", "lora_adapted"]

_ENTRIES = "restore_entries"
_POSITIONS = "restore_positions"


class AppendedEntries(Part):
    """Entries a method adds to every layer after eviction (``Pipeline.append``); they take part of the budget.

    The compressor calls :meth:`reserve` once per compression, after the scorer's ``prepare`` and before any
    selection (the views still hold every entry), then :meth:`append_to` for each layer between its selection and
    its compaction, so the compacted store holds exactly the kept and the appended entries (no append slack).
    """

    _declares_interface = True

    def reserve(self, views: list[LayerView]) -> int:
        """Compute the entries (into ``views[0].shared``); return how many each (layer, KV head) will get."""
        return 0

    def append_to(self, view: LayerView, store, selection: Selection) -> Selection:
        """Append this layer's entries to its uncompacted dense ``store`` (whose first slots are ``view``'s); return
        ``selection`` extended to keep them."""
        return selection


def keep_appended(selection: Selection, start: int, count: int) -> Selection:
    """``selection`` ``[batch, kv_heads, k]`` plus the ``count`` slots from ``start`` on, kept in every head."""
    b, h, _ = selection.indices.shape
    device = selection.indices.device
    extra = torch.arange(start, start + count, device=device).expand(b, h, count)
    return Selection(
        torch.cat([selection.indices, extra], dim=-1),
        torch.cat([selection.keep_mask, torch.ones(b, h, count, dtype=torch.bool, device=device)], dim=-1),
        selection.compressed_until,
    )


def _lora_hook(a: torch.Tensor, b: torch.Tensor):
    def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        x = args[0]
        delta = (x.to(a.dtype) @ a.to(x.device).transpose(0, 1)) @ b.to(x.device).transpose(0, 1)
        return output + delta.to(output.dtype)

    return hook


@contextmanager
def lora_adapted(modules: dict[int, torch.nn.Module], lora: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Iterator:
    """While open, each attention module's ``P_proj`` (``P`` in ``lora``) of layer ``i`` adds
    ``(x · A[i]ᵀ) · B[i]ᵀ`` to its output (forward hooks, removed on exit).

    Args:
        modules: layer index -> attention module (with ``q_proj`` … ``o_proj``)
        lora: target -> ``(A [layers, r, in], B [layers, out, r])``
    """
    handles = []
    try:
        for layer, module in modules.items():
            for target, (a, b) in lora.items():
                proj = getattr(module, f"{target}_proj", None)
                if proj is None:
                    raise InvalidParameterError(
                        f"the attention module of layer {layer} ({type(module).__name__}) has no {target}_proj"
                    )
                handles.append(proj.register_forward_hook(_lora_hook(a[layer], b[layer])))
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class RestoreTokens(AppendedEntries):
    """RestoreKV's restore tokens (kvpress RestoreKVPress; RestoreKV, arXiv 2608.01247).

    Before eviction, ``K`` learned embeddings are fed through the model in one pass over the whole uncompressed
    cache (:meth:`LayerView.replay <kvtrim.scoring.base.LayerView>`), with a low-rank adapter added to the attention
    projections for that pass only (:func:`lora_adapted`); the keys and values they leave in every layer are the
    restore entries, appended to each KV head after eviction. The evictor keeps ``K`` fewer context entries per
    (layer, KV head) on average, so the cache holds the budget it was asked for.

    Positions: the restore tokens take the position of the row's last context token (``context - 1``) for their
    rotary embedding and as their stored position, so every later token sees them and the question keeps its
    positions (the cache's count of tokens seen does not change); among themselves they attend without a causal
    order. The paper places them after the context (positions ``context .. context + K - 1``) and shifts what
    follows by ``K``.

    Args:
        artifact: the ``restorekv`` artifact (file or directory; default: the kvtrim home, then the shipped ones)
        weights: the embeddings and adapter given directly instead (tests, calibration)
        train: record an autograd graph through the pass (calibration: gradients reach ``weights``)
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    artifact_kind: ClassVar[str] = RESTOREKV_KIND

    artifact: str | None = None
    weights: RestoreWeights | None = field(default=None, repr=False)
    train: bool = False

    def __post_init__(self) -> None:
        if self.artifact is not None and not isinstance(self.artifact, str):
            raise InvalidParameterError(f"artifact must be a path (str) or None, got {self.artifact!r}")
        if self.weights is not None and not isinstance(self.weights, RestoreWeights):
            raise InvalidParameterError(f"weights must be RestoreWeights or None, got {type(self.weights).__name__}")
        self._model = None
        self._source: dict = {"given": True} if self.weights is not None else {}
        self.observation = ObservationSpec()

    def bind(self, model: torch.nn.Module) -> None:
        """Keep the model for the restore pass; load its artifact (not when ``weights`` were given)."""
        if self._model is model and self.weights is not None:
            return
        self._model = model
        if not self._source.get("given"):
            self.weights, self._source = load_restore_weights(model, self.artifact)

    @property
    def tokens(self) -> int:
        """``K``, restore tokens (known once bound or given)."""
        return 0 if self.weights is None else self.weights.tokens

    def reserve(self, views: list[LayerView]) -> int:
        if self._model is None or self.weights is None:
            raise RuntimeError("restorekv needs the model: build the cache with kvtrim (generate, Session, make_cache)")
        count = self.weights.tokens
        first = views[0]
        first.shared[_ENTRIES] = {}
        if count == 0:
            return 0
        if first.replay is None:
            raise RuntimeError("restorekv encodes its restore tokens through the model: compress through a KVTrimCache")
        model, device = self._model, first.keys.device
        batch = first.keys.shape[0]
        embed = self.weights.embeddings.to(device, model.get_input_embeddings().weight.dtype)
        embeds = embed.unsqueeze(0).expand(batch, -1, -1)
        positions = (first.context_lengths.to(device) - 1).clamp(min=0).view(batch, 1).expand(batch, count)
        seen = max(view.keys.shape[2] for view in views)
        mask = torch.ones(batch, seen + count, dtype=torch.long, device=device)
        with lora_adapted({v.layer_idx: v.module for v in views}, self.weights.lora):
            stores = first.replay(model, views, None, mask, positions, ObservationSpec(), grad=self.train,
                                  inputs_embeds=embeds)
        for view in views:
            store, start = stores[view.layer_idx], view.keys.shape[2]
            keys, values = store.keys[:, :, start : start + count], store.values[:, :, start : start + count]
            first.shared[_ENTRIES][view.layer_idx] = (keys, values)
        first.shared[_POSITIONS] = positions
        first.shared["restore_tokens"] = count
        return count

    def append_to(self, view: LayerView, store, selection: Selection) -> Selection:
        entries = view.shared[_ENTRIES].get(view.layer_idx)
        if entries is None:
            return selection
        start = store.length
        store.append(entries[0], entries[1], view.shared[_POSITIONS], padded=False)
        return keep_appended(selection, start, entries[0].shape[2])

    def describe_compression(self, shared: dict) -> dict:
        out = {"restore_tokens": shared.get("restore_tokens", 0)}
        out["restore_artifact"] = self._source.get("artifact", "given")
        return out
