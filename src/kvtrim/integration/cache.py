"""The transformers ``Cache`` adapter: ``KVTrimCache`` and its layers.

Thin by design: the entries live in the stores of :mod:`kvtrim.cache`, the compression policy in a
:class:`~kvtrim.compression.state.CompressionState`; this module speaks transformers' cache protocol, hands new
entries to kvtrim's attention function (:mod:`kvtrim.integration.attention`) and forwards the start of every
forward pass to the policy.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..cache.dense import INVALID, DenseStore
from ..cache.layer import hand_over, raise_if_unconsumed
from ..cache.quant import KVQuant, resolve_kv_quant
from ..cache.quantized_dense import QuantizedDenseStore
from ..cache.store import KVStore
from ..compression.compressor import BudgetSpec, CompressionReport
from ..compression.pipeline import Pipeline
from ..compression.state import CompressionState
from ..errors import InvalidParameterError
from ..scoring.observation import LayerObservation, ObservationSpec, record
from .attention import kvtrim_attention_enabled
from .hidden_states import RecordsHiddenStates
from .prompt_ids import RecordsPromptIds

__all__ = ["CacheStats", "CompressibleLayer", "KVTrimCache"]


def _policy(name: str, doc: str) -> property:
    """A cache attribute that reads and writes the same attribute of the cache's :class:`CompressionState`."""
    return property(
        lambda self: getattr(self.compression, name),
        lambda self, value: setattr(self.compression, name, value),
        doc=doc,
    )


def lower_right_causal_on(device: torch.device) -> bool:
    """Where a prompt chunk continuing an intact dense prefix runs as lower-right causal attention (CUDA: flash
    or memory-efficient, no mask made) rather than through a position mask (CPU: unchanged numerics)."""
    return device.type == "cuda"


@dataclass(frozen=True)
class CacheStats:
    """Entries and bytes held by a cache, measured from its tensors."""

    entries: int
    kv_bytes: int
    index_bytes: int
    seen_tokens: int

    def as_dict(self) -> dict:
        return {
            "entries": self.entries,
            "kv_bytes": self.kv_bytes,
            "index_bytes": self.index_bytes,
            "seen_tokens": self.seen_tokens,
        }


class KVTrimCache(Cache, RecordsPromptIds, RecordsHiddenStates):
    """A KV cache that a compression method can shrink after prefill.

    Used two ways:
      * by :func:`kvtrim.generate`, which prefills, calls :meth:`compress` and decodes;
      * inside a user's own ``model.generate(..., past_key_values=cache)``: the prompt is prefilled exactly, and
        the cache compresses itself at the start of the next forward pass (question-aware mode).

    Args:
        num_layers: number of decoder layers of the model
        pipeline: the compression method (from :func:`kvtrim.methods.get_method`), or None for no compression
        budget: how much to keep (a :class:`kvtrim.compression.compressor.BudgetSpec`); required with ``pipeline``
        auto_compress: compress automatically before the first forward pass that follows a prefill
        kv_quant: how entries are held: None (the model's dtype), ``"int8"``, ``"int4"`` or ``"fp8"`` (or a
            :class:`~kvtrim.cache.quant.KVQuant`), see docs/quantization.md
    """

    def __init__(
        self,
        num_layers: int,
        pipeline: Pipeline | None = None,
        budget: BudgetSpec | None = None,
        auto_compress: bool = True,
        kv_quant: str | KVQuant | None = None,
    ):
        if num_layers <= 0:
            raise InvalidParameterError(f"num_layers must be positive, got {num_layers}")
        self.kv_quant: KVQuant | None = resolve_kv_quant(kv_quant)
        self.compression = CompressionState(pipeline, budget, auto_compress)
        super().__init__(layers=[CompressibleLayer(self, i) for i in range(num_layers)])
        self.peak_kv_bytes = 0  # largest K/V bytes held at the start of a forward pass (or after a compression)
        self._unconsumed: int | None = None  # layer whose update was not yet consumed by kvtrim attention
        # [batch, w] log p(x_j | x_<j) of the last prompt tokens (NaN: padding or not recorded); set by kvtrim.api
        # when the method's observation asks for token_logprobs
        self.prompt_logprobs: torch.Tensor | None = None
        self.last_logprobs: torch.Tensor | None = None  # [batch, vocab] log-softmax of the last fed position
        # [batch, n] the prompt's token ids (-1: padding), when the method's observation asks for input_ids
        self.prompt_ids: torch.Tensor | None = None
        # [batch] logical position where the prompt's question part begins (None: the prompt holds no question);
        # set by kvtrim.api for question-aware prompts, read by methods that select with the question (FINCH)
        self.question_start: torch.Tensor | None = None

    # ------------------------------------------------------------------ the policy (CompressionState)
    pipeline: Pipeline | None = _policy("pipeline", "the compression method, or None")
    budget: BudgetSpec | None = _policy("budget", "how much to keep")
    auto_compress: bool = _policy("auto_compress", "compress before the first forward pass after a prefill")
    observing: bool = _policy("observing", "record what the method's scorer needs during attention")
    observation_spec: ObservationSpec = _policy("observation_spec", "what to record")
    last_report: CompressionReport | None = _policy("last_report", "the latest compression's report")
    reports: list[CompressionReport] = _policy("reports", "every compression, in order")
    compressions: int = _policy("compressions", "compressions so far")
    tokens_since_compression: int = _policy("tokens_since_compression", "token columns since the last one")

    @property
    def schedule(self):
        return self.compression.schedule

    def _before_forward(self, new_tokens: int) -> None:
        """Called at layer 0 of every forward pass, before anything is stored."""
        self.compression.before_forward(self, new_tokens)

    def compress(self, logits: torch.Tensor | None = None, keep_observing: bool = False) -> CompressionReport:
        """Apply the method to everything stored so far.

        Observation stops afterwards unless the method's schedule compresses again later (or ``keep_observing``,
        used between the chunks of a chunked prefill).
        """
        return self.compression.compress(self, logits, keep_observing)

    def track_peak(self) -> None:
        """Raise :attr:`peak_kv_bytes` to the bytes held now."""
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_nbytes())

    def kv_nbytes(self) -> int:
        """Bytes of the key and value tensors held right now (append slack included)."""
        return sum(layer.store.nbytes() for layer in self.kv_layers)

    def context_lengths(self) -> torch.Tensor | None:
        """``[batch]`` tokens seen per row (largest stored position + 1), or None while empty."""
        layers = self.kv_layers
        if not layers:
            return None
        return (layers[0].store.latest_positions() + 1).clamp(min=0)

    def clone(
        self,
        pipeline: Pipeline | None = None,
        budget: BudgetSpec | None = None,
        kv_quant: str | KVQuant | None = None,
        share_source_keys: bool = False,
    ) -> KVTrimCache:
        """An independent copy (tensors copied) that may carry another method and budget.

        Lets one prefill serve several methods: observations recorded for the union of their needs are copied
        with the entries. ``kv_quant`` quantizes the copy's entries (an unquantized source only; None keeps this
        cache's format). ``share_source_keys`` (with ``kv_quant``): the copy's stores keep a reference to this
        cache's float keys until their first compaction, which quantizes the kept keys from them once instead of
        from their codes (:meth:`QuantizedDenseStore.from_dense`); only for a source that is not modified before
        the copy is compressed (a :class:`~kvtrim.runtime.Prefill`'s cache).
        """
        quant = resolve_kv_quant(kv_quant)
        if quant is not None and self.kv_quant is not None and quant != self.kv_quant:
            raise InvalidParameterError(
                f"kv_quant={quant.spec!r}: this cache already holds {self.kv_quant.spec} entries; clone an "
                "unquantized cache instead"
            )
        other = KVTrimCache(
            len(self.layers), pipeline, budget, auto_compress=self.auto_compress, kv_quant=quant or self.kv_quant
        )
        other.compression = self.compression.copy_for(pipeline, budget)
        other.peak_kv_bytes = self.kv_nbytes()
        other.prompt_logprobs = None if self.prompt_logprobs is None else self.prompt_logprobs.clone()
        other.prompt_ids = self.prompt_ids  # never written in place: appends build a new tensor
        other.question_start = self.question_start  # never written in place
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            theirs.seen = mine.seen
            theirs.module = mine.module
            if pipeline is not None and pipeline is self.pipeline and mine.compressed_until is not None:
                theirs.compressed_until = mine.compressed_until.clone()
            if mine.store is not None and quant is not None and self.kv_quant is None:
                theirs.store = QuantizedDenseStore.from_dense(
                    mine.store.to_dense(), quant, keep_source=share_source_keys
                )
                theirs.is_initialized = True
                theirs.dtype, theirs.device = mine.dtype, mine.device
            elif mine.store is not None:
                theirs.store = mine.store.copy()
                theirs.is_initialized = True
                theirs.dtype, theirs.device = mine.dtype, mine.device
            theirs.observation = mine.observation.copy()
        return other

    def record_prompt_ids(self, ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Append a forward call's token ids to :attr:`prompt_ids` (``-1`` where ``attention_mask`` is 0) while
        they are part of the prompt and the method asks for them (``ObservationSpec.input_ids``)."""
        if not self.observation_spec.input_ids:
            return
        if not (self.observing or self.compressions == 0):
            return  # compressed and no longer observing: these tokens (a question, an answer) are not the prompt
        if self.compression.prefilled_uncompressed and self.auto_compress:
            return  # this forward compresses the prompt first: its tokens come after the prompt
        ids = ids.long()
        if attention_mask is not None and attention_mask.dim() == 2:
            ids = ids.masked_fill(~attention_mask[:, -ids.shape[1] :].to(torch.bool), -1)
        self.prompt_ids = ids if self.prompt_ids is None else torch.cat([self.prompt_ids, ids], dim=1)

    def record_hidden_states(self, model: torch.nn.Module, layer_idx: int, hidden: torch.Tensor) -> None:
        """Score the hidden states entering layer ``layer_idx``'s attention (``[batch, q, hidden_size]``) with the
        method's token scores (``ObservationSpec.token_scores``) while observing; the layer stores the scores
        with its new tokens."""
        scorers = self.observation_spec.token_scores
        if not scorers or not self.observing:
            return
        self.layers[layer_idx].pending_token_scores = {s.stat: s(model, layer_idx, hidden) for s in scorers}

    @staticmethod
    def replay(
        model: torch.nn.Module,
        views: list,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        observation: ObservationSpec,
        *,
        grad: bool = False,
        observations: dict | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> dict[int, DenseStore]:
        """Feed ``input_ids`` ``[batch, w]`` through ``model`` (kvtrim attention) over a scratch cache that starts
        with the entries of ``views`` (:class:`~kvtrim.scoring.base.LayerView`), recording ``observation``.

        ``attention_mask`` ``[batch, seen + w]`` covers the stored columns and the new ones. Returns each view's
        layer store after the pass (its first slots are the views' entries); the views' tensors are not written.
        ``grad``: the pass records an autograd graph (outside inference mode; the caller differentiates through
        hooks of its own); ``observations``: filled with each view's layer observation (recorded queries);
        ``inputs_embeds`` ``[batch, w, hidden]``: fed instead of ``input_ids`` (then None).
        """
        work = KVTrimCache(views[0].num_layers, auto_compress=False)
        fed = inputs_embeds if input_ids is None else input_ids
        seen = attention_mask.shape[1] - fed.shape[1]
        for view in views:
            layer = work.layers[view.layer_idx]
            layer.store = DenseStore(view.keys, view.values, view.positions, view.keys.shape[2])  # grows on append
            layer.seen, layer.module = seen, view.module
            layer.is_initialized, layer.dtype, layer.device = True, view.keys.dtype, view.keys.device
        work.observing = True
        work.observation_spec = observation
        with torch.enable_grad() if grad else torch.no_grad(), kvtrim_attention_enabled(model):
            model(
                input_ids=input_ids,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=work,
                use_cache=True,
                logits_to_keep=1,
            )
        if observations is not None:
            observations.update({view.layer_idx: work.layers[view.layer_idx].observation for view in views})
        return {view.layer_idx: work.layers[view.layer_idx].store for view in views}

    @property
    def kv_layers(self) -> list[CompressibleLayer]:
        return [layer for layer in self.layers if layer.store is not None]

    # ------------------------------------------------------------------ rollback
    def mark(self) -> list[tuple]:
        """Remember the current end of every layer, to remove later appends with :meth:`rollback`."""
        return [(layer.store.mark() if layer.store else None, layer.seen) for layer in self.layers]

    def rollback(self, mark: list[tuple]) -> None:
        """Remove every entry appended after ``mark`` (e.g. a question and its answer)."""
        for layer, (store_mark, seen) in zip(self.layers, mark, strict=True):
            if layer.store is not None:
                layer.store.truncate_to(store_mark)
            layer.seen = seen

    # ------------------------------------------------------------------ accounting
    def stats(self) -> CacheStats:
        """Entries and bytes held right now, measured from the tensors."""
        layers = self.kv_layers
        return CacheStats(
            entries=sum(layer.store.entries() for layer in layers),
            kv_bytes=self.kv_nbytes(),
            index_bytes=sum(layer.store.index_nbytes() for layer in layers),
            seen_tokens=self.layers[0].seen,
        )

    def entries_per_layer_head(self) -> torch.Tensor:
        """``[batch, layers, kv_heads]`` real tokens held per layer and KV head."""
        return torch.stack([layer.store.entries_per_head() for layer in self.kv_layers], dim=1)


class CompressibleLayer(CacheLayerMixin):
    """One layer of a :class:`KVTrimCache`.

    ``seen`` counts token columns seen so far (including padding), which is what transformers uses to slice
    inputs and build default positions; the store holds only what was kept.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, cache: KVTrimCache, layer_idx: int):
        self.is_initialized = False
        self._cache = weakref.ref(cache)  # the cache owns its layers; a strong back-reference would form a cycle
        self.layer_idx = layer_idx
        self.store: KVStore | None = None
        self.seen = 0
        self.observation = LayerObservation()
        self.module: torch.nn.Module | None = None
        self.compressed_until: torch.Tensor | None = None  # [batch], set by recursive methods (LagKV)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        # statistic -> [batch, kv_heads, q] token scores of the tokens the next attend stores (ObservationSpec)
        self.pending_token_scores: dict[str, torch.Tensor] | None = None

    @property
    def cache(self) -> KVTrimCache:
        return self._cache()

    @property
    def pending(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(keys, values)`` ``[batch, kv_heads, q, head_dim]`` handed over by ``update`` and not yet stored by
        :meth:`attend` (None between forward passes)."""
        return self._pending

    # transformers reads .keys/.values on some code paths (device, dtype); expose the stored entries.
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.store is None else self.store.keys

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.store is None else self.store.values

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        quant = self.cache.kv_quant
        if quant is None:
            self.store = DenseStore.empty(b, h, d, key_states.dtype, key_states.device)
        else:
            self.store = QuantizedDenseStore.empty(b, h, d, key_states.dtype, key_states.device, quant)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise_if_unconsumed(
            self.cache,
            "the model must run with attn_implementation='kvtrim': use kvtrim.compressing(model, ...) or "
            "kvtrim.make_cache(model, ...), which install it",
        )
        if self.layer_idx == 0:
            self.cache._before_forward(key_states.shape[2])
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        hand_over(self, key_states, value_states)
        return key_states, value_states

    def attend(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        position_ids: torch.Tensor | None,
        padding_mask: torch.Tensor | None,
        scaling: float,
    ) -> torch.Tensor:
        """Store the pending tokens, attend over the store, record observations.

        Args:
            query: ``[batch, q_heads, q, head_dim]`` post-rotary
            position_ids: ``[1 or batch, q]`` or None (then positions continue from ``seen``)
            padding_mask: ``[batch, >= q]`` boolean, the last ``q`` columns flag real tokens; None = no padding
        Returns:
            ``[batch, q, q_heads, head_dim]``
        """
        keys, values = self._pending
        self._pending = None
        self.cache._unconsumed = None
        self.module = module
        b, _, q, _ = keys.shape
        if position_ids is None:
            positions = torch.arange(self.seen, self.seen + q, device=keys.device).expand(b, q)
        else:
            positions = position_ids.to(keys.device).expand(b, q)
        valid = None
        if padding_mask is not None:
            if padding_mask.shape[-1] < q:
                raise ValueError(f"attention_mask has {padding_mask.shape[-1]} columns for {q} new tokens")
            valid = padding_mask[:, -q:].to(torch.bool)
            # A prompt chunk is checked once (cheaper attention when nothing is padding); a decoding step is not
            # read back (no host sync): its token is masked on the device if the mask says it is padding.
            if q > 1 and bool(valid.all()):
                valid = None
        positions = positions.long() if valid is None else positions.long().masked_fill(~valid, INVALID)
        store = self.store
        fresh = store.causal_prefill_ready and valid is None and bool((positions.diff(dim=1) == 1).all())
        if getattr(store, "prefix_intact", False):  # a dense store nothing was evicted from
            fresh = fresh or self._continues_prefix(store, positions, q, valid)
            store.prefix_intact = fresh
        store.append(keys, values, positions, padded=valid is not None)
        out = store.attend(query, positions, scaling, fresh_causal=fresh)
        self.seen += q
        token_scores, self.pending_token_scores = self.pending_token_scores, None
        if self.cache.observing:
            record(self.cache.observation_spec, self.observation, store, query, positions, scaling)
            for name, scores in (token_scores or {}).items():
                stat = store.stat(name)
                stat[..., stat.shape[-1] - q :].copy_(scores)
        return out

    def _continues_prefix(self, store, positions: torch.Tensor, q: int, valid: torch.Tensor | None) -> bool:
        """Whether this chunk of ``q > 1`` unpadded tokens continues an intact prefix on CUDA: the store holds
        exactly the ``seen`` earlier tokens in order and the chunk's positions are ``seen .. seen + q - 1`` (one
        host read, in a prefill only). A decoding step (``q == 1``) is not read back, so it ends the prefix."""
        if q == 1 or valid is not None or store.length != self.seen or not lower_right_causal_on(positions.device):
            return False
        expected = torch.arange(self.seen, self.seen + q, device=positions.device)
        return bool((positions == expected).all())

    # ------------------------------------------------------------------ transformers Cache protocol
    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.store = None
        self.pending_token_scores = None
        self.seen = 0
        self.is_initialized = False
        self.observation = LayerObservation()
        self.compressed_until = None
        self._pending = None

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` appended tokens (assisted decoding)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        n = -tokens_to_remove
        if n == 0 or self.store is None:
            return
        self.store.drop_last(n)
        self.seen -= n

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.store is not None:
            self.store.select_batch(beam_idx.to(self.store.positions.device))
        if self.compressed_until is not None:
            self.compressed_until = self.compressed_until[beam_idx.to(self.compressed_until.device)]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.store is not None:
            idx = torch.arange(self.store.batch_size, device=self.store.positions.device)
            self.store.select_batch(idx.repeat_interleave(repeats))
        if self.compressed_until is not None:
            self.compressed_until = self.compressed_until.repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.store is not None:
            self.store.select_batch(indices)
        if self.compressed_until is not None:
            self.compressed_until = self.compressed_until[indices]
