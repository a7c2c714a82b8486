"""Scores from the model re-reading its own context (KVzip): an extra forward pass at compression time."""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..errors import InvalidParameterError
from .base import LayerView, Scorer
from .observation import ObservationSpec

_SCORES = "kvzip_scores"
_SINK_SCORE = 2.0  # above any attention probability: sinks are never evicted, whatever the budget allocator does
# Scores of an uncompressed prefill are a function of (model, prompt ids, instruction): kept per prompt-ids tensor
# (shared by every clone of one prefill, e.g. a Session's runs at several ratios) while that tensor lives.
_MEMO: dict[int, dict] = {}


def _remember(prompt_ids: torch.Tensor, key: tuple, scores: dict) -> None:
    ident = id(prompt_ids)
    if ident not in _MEMO:
        _MEMO[ident] = {}
        weakref.finalize(prompt_ids, _MEMO.pop, ident, None)
    _MEMO[ident][key] = scores


def reconstruction_feed(
    prompt_ids: torch.Tensor, repeat_ids: torch.Tensor, prefix_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reconstruction input per row: ``repeat_ids`` then the row's real prompt tokens after its first
    ``prefix_len`` (the chat template's opening), left-padded to one width.

    Args:
        prompt_ids: ``[batch, n]`` token ids, ``-1`` for padding
        repeat_ids: ``[r]`` the repeat instruction (may be empty)
    Returns:
        ``(ids [batch, w], mask [batch, w])`` with padding ids 0 and mask 0
    """
    valid = prompt_ids >= 0
    reread = valid & (valid.long().cumsum(-1) > prefix_len)
    b = prompt_ids.shape[0]
    full = torch.cat([repeat_ids.to(prompt_ids.device).expand(b, -1), prompt_ids.clamp(min=0)], dim=1)
    keep = torch.cat([torch.ones(b, repeat_ids.numel(), dtype=torch.bool, device=full.device), reread], dim=1)
    width = int(keep.sum(-1).max())
    # Stable sort by (kept, column): dropped columns first, then the kept ones in order; the last `width` columns
    # hold each row's feed right-aligned (left padding).
    column = torch.arange(full.shape[1], device=full.device)
    order = torch.where(keep, column, torch.full_like(column, -1)).argsort(dim=-1, stable=True)[:, -width:]
    mask = keep.gather(-1, order)
    return full.gather(-1, order).masked_fill(~mask, 0), mask.long()


def _load_tokenizer(source: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError):
        return None


@dataclass
class ReconstructionScorer(Scorer):
    """KVzip (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction",
    NeurIPS 2025, arXiv 2505.23416).

    At compression time the model is fed the repeat instruction (``prompt`` in the chat template's question
    slot, e.g. ``"…<|im_end|>\\n<|im_start|>assistant\\n"``) followed by the prompt's own tokens (without the
    template's opening), on top of the uncompressed cache; an entry scores the largest attention that any
    reconstruction query of its KV head's group pays it (softmax over the whole cache plus the re-read tokens so
    far). The first ``n_sink`` tokens always score highest. The appended tokens are dropped afterwards.

    Cost: one extra forward pass over the whole prompt (plus ~15 instruction tokens) attending to twice the prompt,
    with a per-slot running maximum — about the prefill's compute again, paid in ``compress_s``; peak memory
    holds the cache twice during that pass. The paper (and kvpress) re-read in 2K-token chunks, each with a
    shortened key set; kvtrim re-reads in one pass (queries are scored in chunks of ``chunk``).

    The scores of an uncompressed prefill depend only on the model, the prompt, the instruction and how the entries
    are held, so clones of one prefill in one entry format (a :class:`~kvtrim.Session` compressing it at several
    ratios) run the pass once; the metadata says ``kvzip_scores_reused``. A clone in another format
    (``kv_quant``) runs its own pass.

    Needs the prompt's token ids (recorded during prefill, ``ObservationSpec(input_ids=True)``) and the model
    (:meth:`bind`). The repeat instruction is tokenized with the model's tokenizer (``tokenizer`` path, default
    ``model.name_or_path``); when none can be loaded, the prompt is re-read without an instruction and the
    compression metadata says so (``kvzip_repeat_tokens = 0``), with a warning.
    """

    # capabilities (read by the method registry, kvtrim.methods.registry)
    uses_attention = True
    question_aware = False  # scores come from re-reading the context
    method_label: ClassVar[str] = "kvzip"  # the method named in warnings

    prompt: str = "Repeat the previous context exactly."
    n_sink: int = 4
    chunk: int = 256
    tokenizer: str | None = None
    observation: ObservationSpec = field(init=False)

    def __post_init__(self) -> None:
        for name, low in (("n_sink", 0), ("chunk", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidParameterError(f"{name} must be an integer >= {low}, got {value!r}")
        if not isinstance(self.prompt, str):
            raise InvalidParameterError(f"prompt must be a string, got {self.prompt!r}")
        self.observation = ObservationSpec(input_ids=True)
        self._model = None
        self._repeat_ids = torch.zeros(0, dtype=torch.long)
        self._prefix_len = 0

    def bind(self, model) -> None:
        """Keep the model for the reconstruction pass; tokenize the repeat instruction."""
        if self._model is model:
            return
        self._model = model
        source = self.tokenizer or getattr(model, "name_or_path", "") or ""
        tok = _load_tokenizer(source) if source else None
        if tok is None:
            if self.tokenizer is not None:
                raise InvalidParameterError(f"tokenizer={self.tokenizer!r}: no tokenizer could be loaded from there")
            warnings.warn(
                f"{self.method_label}: no tokenizer found for the model ({source!r}); the context is re-read without "
                "the repeat instruction (pass tokenizer=PATH)",
                stacklevel=2,
            )
            self._repeat_ids, self._prefix_len = torch.zeros(0, dtype=torch.long), 0
            return
        from ..prompts import prompt_template

        template = prompt_template(tok)
        text = template.question_part(self.prompt) if self.prompt else template.separator + template.suffix
        self._repeat_ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        self._prefix_len = len(tok(template.prefix, add_special_tokens=False)["input_ids"]) if template.prefix else 0

    def prepare(self, views: list[LayerView]) -> None:
        """Run the reconstruction pass once per compression; scores go to ``views[0].shared``."""
        if self._model is None:
            raise RuntimeError("kvzip needs the model: build the cache with kvtrim (generate, Session, make_cache)")
        first = views[0]
        if first.prompt_ids is None:
            raise RuntimeError(
                "kvzip needs the prompt's token ids, recorded during prefill when kvtrim attention is enabled "
                "(ObservationSpec(input_ids=True)); the prefill did not record them"
            )
        model = self._model
        device = first.keys.device
        # Uncompressed (every slot of the prompt still stored, nothing decoded yet): reuse the scores this prefill
        # already got from the same model and instruction, with its entries held the same way (a quantized clone
        # re-reads through its own dequantized keys and values, so its scores are its own).
        fresh = all(v.keys.shape[2] == first.prompt_ids.shape[1] for v in views)
        entry_format = first.shared.get("entry_format")
        key = (id(model), tuple(self._repeat_ids.tolist()), self._prefix_len, self.n_sink, entry_format)
        memo = _MEMO.get(id(first.prompt_ids), {}).get(key) if fresh else None
        if memo is not None:
            first.shared.update(memo, kvzip_scores_reused=True)
            return
        source_ids = first.prompt_ids
        prompt_ids = source_ids.to(device)
        ids, mask = reconstruction_feed(prompt_ids, self._repeat_ids.to(device), self._prefix_len)
        full_mask = torch.cat([(prompt_ids >= 0).long(), mask], dim=1)
        position_ids = (full_mask.cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
        if first.replay is None:
            raise RuntimeError("kvzip re-reads the context through the model: compress through a KVTrimCache")
        spec = ObservationSpec(accumulate=("attn_max",), chunk=self.chunk)
        stores = first.replay(model, views, ids, full_mask, position_ids, spec)
        lengths = {view.layer_idx: view.keys.shape[2] for view in views}
        scores = {}
        for view in views:
            s = stores[view.layer_idx].stat("attn_max")[..., : lengths[view.layer_idx]].clone()
            scores[view.layer_idx] = s.masked_fill(view.valid & (view.positions < self.n_sink), _SINK_SCORE)
        result = {
            _SCORES: scores,
            "kvzip_repeat_tokens": int(self._repeat_ids.numel()),
            "kvzip_reread_tokens": int(mask.sum(-1).max()) - int(self._repeat_ids.numel()),
        }
        first.shared.update(result, kvzip_scores_reused=False)
        if fresh:
            _remember(source_ids, key, result)

    def score(self, view: LayerView) -> torch.Tensor:
        return view.shared[_SCORES][view.layer_idx]

    def describe_compression(self, shared: dict) -> dict:
        names = ("kvzip_repeat_tokens", "kvzip_reread_tokens", "kvzip_scores_reused")
        return {k: shared[k] for k in names if k in shared}
