"""Fidelity of a compressed KV cache: how far its predictions and attention outputs drift from the full cache.

Two families of signals, cheap enough to compute for every method, ratio and text:

* **Continuation fidelity** (:func:`continuation_fidelity`, :func:`continuation_nll`, :func:`text_fidelity`):
  the teacher-forced negative log-likelihood of a continuation given the compressed cache versus the full
  cache, and the KL divergence ``KL(p_full || p_compressed)`` between their next-token distributions.
* **Layer errors** (:func:`attention_output_error`): per layer, the distance between the attention output
  (after ``o_proj``) computed over the compressed cache and over the full cache, for the first decoding
  queries, with the *same* queries and new keys/values (taken from the full-cache run) so each layer's error
  is isolated from the errors of the layers below it. This is CompressKV's layer profile (relative Frobenius
  error), CriticalKV's output perturbation (L1) per layer and per head, and a reward signal for CompilerKV.

Everything is built on one prefill (:func:`prefill`), which records the observations the requested methods
need; many methods and ratios can then be evaluated against it without prefilling again, and the full-cache
reference (log-probabilities, captured queries) is computed once per continuation and reused.

Position conventions: the context occupies logical positions ``0..n-1`` (left padding allowed through a
mask); continuation token ``j`` sits at position ``n + j``. The distribution that predicts continuation token
``0`` is the prefill's last logit row. kvtrim compresses *after* prefill, so that first prediction never
depends on the compression: position 0 always has zero KL and equal log-probability under both caches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import runtime
from ..cache.attention import grouped_attention
from ..compression.compressor import BudgetSpec
from ..compression.pipeline import Pipeline
from ..errors import InvalidParameterError
from ..integration.attention import check_supported, kvtrim_attention_enabled
from ..integration.cache import KVTrimCache
from ..runtime import positions, resolve_method

__all__ = [
    "ContinuationFidelity",
    "LayerErrors",
    "Prefill",
    "QueryCapture",
    "attention_output_error",
    "capture_decoding_queries",
    "continuation_fidelity",
    "continuation_nll",
    "kl_divergence",
    "layer_errors",
    "prefill",
    "text_fidelity",
]

_EPS = 1e-5


# ---------------------------------------------------------------------------------------------------- inputs
def _as_ids(ids: Any, name: str, tokenizer=None, special: bool = False) -> torch.Tensor:
    """``[batch, n]`` long token ids from a tensor, a list of ints, a list of lists, or (with a tokenizer) a str."""
    if isinstance(ids, str):
        if tokenizer is None:
            raise InvalidParameterError(f"{name} is a string: pass a tokenizer to tokenize it")
        ids = tokenizer(ids, add_special_tokens=special)["input_ids"]
    if not isinstance(ids, torch.Tensor):
        try:
            ids = torch.tensor(ids, dtype=torch.long, device="cpu")
        except (TypeError, ValueError) as exc:
            raise InvalidParameterError(f"{name} must be token ids (tensor or list of ints): {exc}") from exc
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[1] == 0 or ids.dtype.is_floating_point:
        raise InvalidParameterError(
            f"{name} must be a non-empty [n] or [batch, n] tensor of ids, got {tuple(ids.shape)}"
        )
    return ids.long()


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _forward_all(model, cache: KVTrimCache, mask: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Feed ``input_ids`` ``[batch, q]`` (all real tokens) after what ``cache`` holds; logits ``[batch, q, vocab]``."""
    full_mask = torch.cat([mask, torch.ones_like(input_ids, dtype=mask.dtype)], dim=1)
    out = model(
        input_ids=input_ids,
        attention_mask=full_mask,
        position_ids=positions(full_mask, input_ids.shape[1]),
        past_key_values=cache,
        use_cache=True,
    )
    return out.logits


class _Quiet:
    """Run a forward over ``cache`` without observing or auto-compressing, then restore both flags."""

    def __init__(self, cache: KVTrimCache):
        self.cache = cache

    def __enter__(self) -> KVTrimCache:
        self.saved = (self.cache.observing, self.cache.auto_compress)
        self.cache.observing, self.cache.auto_compress = False, False
        return self.cache

    def __exit__(self, *exc) -> None:
        self.cache.observing, self.cache.auto_compress = self.saved


# ---------------------------------------------------------------------------------------------------- prefill
@dataclass
class Prefill(runtime.Prefill):
    """A context prefilled once (a :class:`kvtrim.runtime.Prefill`) that also memoizes the full-cache reference
    (log-probabilities, captured queries) of the continuations it is scored on.

    ``cache`` is the uncompressed cache with the observations of ``observation`` recorded (never modified);
    ``logits`` ``[batch, vocab]`` predict the first continuation token.
    """

    _reference: dict = field(default_factory=dict, repr=False)
    _captures: dict = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, obj: Any) -> Prefill:
        """A :class:`Prefill` from itself, a :class:`kvtrim.Session` (its prefill is shared, not copied), a
        :class:`kvtrim.runtime.Prefill`, or any object with ``cache``, ``mask`` and ``logits`` attributes. Keep
        the result to reuse its memoized full-cache reference across calls."""
        if isinstance(obj, Prefill):
            return obj
        pre = obj if isinstance(obj, runtime.Prefill) else getattr(obj, "prefill", obj)
        try:
            cache, mask, logits = pre.cache, pre.mask, pre.logits
        except AttributeError as exc:
            raise InvalidParameterError(
                "full= must be a kvtrim.eval.fidelity.Prefill, a kvtrim.Session prefilled in one pass "
                "(no prefill_chunk), or have cache/mask/logits"
            ) from exc
        observation = getattr(pre, "observation", None) or getattr(obj, "observation", None) or cache.observation_spec
        return cls(cache, mask, logits, observation)

    def full_cache(self) -> KVTrimCache:
        """An independent uncompressed copy."""
        return self.cache.clone(None, None)

    def compressed_cache(
        self,
        method: str | Pipeline | None,
        ratio: float | None = None,
        budget: int | None = None,
        method_params: dict | None = None,
    ) -> KVTrimCache:
        """An independent copy compressed with ``method`` (``None``/``"full"``: uncompressed copy)."""
        if isinstance(method, Pipeline):
            if method_params:
                raise InvalidParameterError("method_params apply to registry names, not to a built Pipeline")
            pipeline, spec = method, BudgetSpec(ratio=ratio, budget=budget)
        else:
            pipeline, spec = resolve_method(method, ratio, budget, method_params)
        return self.compressed(pipeline, spec).cache


@torch.inference_mode()
def prefill(model, context_ids: Any, methods: Sequence = (), context_mask: torch.Tensor | None = None) -> Prefill:
    """Prefill ``context_ids`` once, recording what every method in ``methods`` needs.

    Args:
        context_ids: ``[n]`` or ``[batch, n]`` token ids (a tensor or lists of ints)
        methods: method names or pipelines that will be applied to this prefill
        context_mask: ``[batch, n]`` 1 for real tokens, 0 for (left) padding; default all ones
    Returns:
        :class:`Prefill` with the uncompressed cache, the mask and the last-position logits ``[batch, vocab]``
    """
    check_supported(model)
    device = _device(model)
    ids = _as_ids(context_ids, "context_ids").to(device)
    mask = torch.ones_like(ids) if context_mask is None else torch.as_tensor(context_mask).to(device).long()
    if mask.shape != ids.shape:
        raise InvalidParameterError(f"context_mask has shape {tuple(mask.shape)}, context_ids {tuple(ids.shape)}")
    observation = runtime.observation_of(methods)
    with kvtrim_attention_enabled(model):
        pre = runtime.Prefill.plain(model, ids, mask, observation)
    return Prefill(pre.cache, pre.mask, pre.logits.float(), observation, pre.before, pre.seconds)


# ---------------------------------------------------------------------------------------------------- NLL / KL
@torch.inference_mode()
def continuation_nll(
    model, cache: KVTrimCache, mask: torch.Tensor, first_logits: torch.Tensor, continuation_ids: Any
) -> tuple[float, torch.Tensor]:
    """Teacher-forced NLL of ``continuation_ids`` given what ``cache`` holds (as it is: compress it first).

    One forward pass feeds continuation tokens ``0..m-2`` after the cache; the prediction of token ``0`` comes
    from ``first_logits`` (the prefill's last position). The appended entries are rolled back afterwards, so
    the cache's contents are unchanged (its tensors may keep some spare capacity) and one compressed cache can
    be scored on several continuations.

    Args:
        cache: a prefilled :class:`KVTrimCache` (compressed or not)
        mask: ``[batch, n]`` attention mask of the cached context (1 = real token)
        first_logits: ``[batch, vocab]`` logits that predict continuation token 0
        continuation_ids: ``[m]`` or ``[batch, m]`` ids (real tokens, no padding)
    Returns:
        ``(nll_mean, log_probs)``: the mean of ``-log p(token)`` over batch and the ``m`` positions, and the
        float32 log-distributions ``[batch, m, vocab]`` (row ``j`` predicts continuation token ``j``)
    """
    device = first_logits.device
    cont = _as_ids(continuation_ids, "continuation_ids").to(device)
    if cont.shape[0] != first_logits.shape[0]:
        if cont.shape[0] == 1:
            cont = cont.expand(first_logits.shape[0], -1)
        else:
            raise InvalidParameterError(
                f"continuation_ids has {cont.shape[0]} rows for a batch of {first_logits.shape[0]}"
            )
    rows = [first_logits.float().unsqueeze(1)]
    if cont.shape[1] > 1:
        mark = cache.mark()
        try:
            with kvtrim_attention_enabled(model), _Quiet(cache):
                rows.append(_forward_all(model, cache, mask.to(device), cont[:, :-1]).float())
        finally:
            cache.rollback(mark)
    log_probs = torch.log_softmax(torch.cat(rows, dim=1), dim=-1)
    token_lp = log_probs.gather(-1, cont.unsqueeze(-1)).squeeze(-1)
    return float(-token_lp.mean()), log_probs


@dataclass
class ContinuationFidelity:
    """Prediction fidelity of one compressed cache on one continuation (batch-averaged).

    ``nll_*`` are per-token means of ``-log p`` over the ``m`` continuation tokens (nats); ``kl_mean`` is the
    mean over those ``m`` positions of ``KL(p_full || p_compressed)``. Position 0 is predicted by the prefill
    (before compression), so its KL is always 0; ``kl_first`` is the KL at position 1, the first prediction
    made from the compressed cache (0.0 when ``m == 1``).

    Attributes:
        nll_per_position_*, kl_per_position: ``[m]`` per-position values (averaged over the batch)
        entries_*, kv_bytes_*: stored (token, layer, KV head) entries and key/value bytes of each cache
        layer_errors: per-layer attention-output errors when requested (``layer_queries > 0``)
    """

    method: str
    ratio: float | None
    budget: int | None
    context_tokens: int
    continuation_tokens: int
    nll_full: float
    nll_compressed: float
    kl_mean: float
    kl_first: float
    entries_full: int
    entries_compressed: int
    kv_bytes_full: int
    kv_bytes_compressed: int
    nll_per_position_full: torch.Tensor | None = None
    nll_per_position_compressed: torch.Tensor | None = None
    kl_per_position: torch.Tensor | None = None
    layer_errors: LayerErrors | None = None

    @property
    def delta_nll(self) -> float:
        return self.nll_compressed - self.nll_full

    @property
    def kept_fraction(self) -> float:
        return self.entries_compressed / self.entries_full if self.entries_full else float("nan")

    @property
    def ppl_ratio(self) -> float:
        """Perplexity of the compressed cache over that of the full cache (``exp(delta_nll)``)."""
        return math.exp(self.delta_nll)

    def as_dict(self, per_position: bool = False) -> dict:
        out = {
            "method": self.method,
            "ratio": self.ratio,
            "budget": self.budget,
            "context_tokens": self.context_tokens,
            "continuation_tokens": self.continuation_tokens,
            "nll_full": self.nll_full,
            "nll_compressed": self.nll_compressed,
            "delta_nll": self.delta_nll,
            "kl_mean": self.kl_mean,
            "kl_first": self.kl_first,
            "entries_full": self.entries_full,
            "entries_compressed": self.entries_compressed,
            "kept_fraction": self.kept_fraction,
            "kv_bytes_full": self.kv_bytes_full,
            "kv_bytes_compressed": self.kv_bytes_compressed,
        }
        if per_position:
            for name in ("nll_per_position_full", "nll_per_position_compressed", "kl_per_position"):
                value = getattr(self, name)
                out[name] = None if value is None else value.tolist()
        if self.layer_errors is not None:
            out["layer_errors"] = self.layer_errors.as_dict()
        return out


def kl_divergence(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """``KL(p || q)`` over the last axis from log-distributions ``[..., vocab]`` (``[...]``); clamped at 0 against
    rounding."""
    return (log_p.exp() * (log_p - log_q)).sum(-1).clamp(min=0.0)


def _reference(pre: Prefill, model, cont: torch.Tensor) -> tuple[float, torch.Tensor]:
    key = (tuple(cont.shape), tuple(cont.flatten().tolist()))
    if key not in pre._reference:
        pre._reference.clear()  # keep one continuation's distributions, not an unbounded memo
        pre._reference[key] = continuation_nll(model, pre.full_cache(), pre.mask, pre.logits, cont)
    return pre._reference[key]


def continuation_fidelity(
    model,
    tokenizer,
    context_ids: Any,
    continuation_ids: Any,
    method: str | Pipeline | None,
    ratio: float | None = None,
    budget: int | None = None,
    method_params: dict | None = None,
    full: Any = None,
    layer_queries: int = 0,
    per_position: bool = True,
) -> ContinuationFidelity:
    """NLL and KL of ``continuation_ids`` given the context's cache compressed by ``method``, versus the full cache.

    Args:
        tokenizer: only used when ``context_ids``/``continuation_ids`` are strings (may be None)
        context_ids: ``[n]``/``[batch, n]`` ids or a string; ignored (may be None) when ``full`` is given
        continuation_ids: ``[m]``/``[batch, m]`` ids or a string (tokenized without special tokens)
        method: registry name, a built pipeline, or ``None``/``"full"`` (then the "compressed" cache is full)
        ratio, budget: how much to keep (see :class:`kvtrim.BudgetSpec`); exactly one for a real method
        full: an existing prefill to reuse — a :class:`Prefill`, a :class:`kvtrim.Session` or anything with
            ``cache``/``mask``/``logits``; the full-cache reference is computed once per continuation on it
        layer_queries: also compute :func:`attention_output_error` for the first ``layer_queries`` decoding
            queries (continuation tokens ``0..layer_queries-1``) into ``.layer_errors``
        per_position: keep the ``[m]`` per-position arrays
    Returns:
        :class:`ContinuationFidelity`
    """
    if isinstance(method, Pipeline):
        if method_params:
            raise InvalidParameterError("method_params apply to registry names, not to a built Pipeline")
        pipeline = method.bind(model)
    else:
        pipeline, _ = resolve_method(method, ratio, budget, method_params, model)  # binds offline artifacts
    if full is None:
        ctx = _as_ids(context_ids, "context_ids", tokenizer, special=True)
        pre = prefill(model, ctx, [pipeline] if pipeline is not None else [])
    else:
        pre = Prefill.of(full)
    device = pre.logits.device
    cont = _as_ids(continuation_ids, "continuation_ids", tokenizer, special=False).to(device)
    batch = pre.logits.shape[0]
    if cont.shape[0] == 1 and batch > 1:
        cont = cont.expand(batch, -1)
    if not 0 <= layer_queries <= cont.shape[1]:
        raise InvalidParameterError(f"layer_queries must be in [0, {cont.shape[1]}], got {layer_queries}")
    with torch.inference_mode():
        compressed = pre.compressed_cache(pipeline, ratio, budget)  # params are already in the pipeline
        after = compressed.stats()
        before = pre.cache.stats()
        nll_full, lp_full = _reference(pre, model, cont)
        nll_comp, lp_comp = continuation_nll(model, compressed, pre.mask, pre.logits, cont)
        kl = kl_divergence(lp_full, lp_comp).mean(0)  # [m]
        tok = cont.unsqueeze(-1)
        nll_pos_full = -lp_full.gather(-1, tok).squeeze(-1).mean(0)
        nll_pos_comp = -lp_comp.gather(-1, tok).squeeze(-1).mean(0)
        errors = None
        if layer_queries > 0:
            capture = _capture_for(pre, model, cont[:, :layer_queries])
            errors = layer_errors(capture, compressed)
    return ContinuationFidelity(
        method="full" if pipeline is None else pipeline.name,
        ratio=ratio,
        budget=budget,
        context_tokens=int(pre.mask.sum(-1).max()),
        continuation_tokens=int(cont.shape[1]),
        nll_full=nll_full,
        nll_compressed=nll_comp,
        kl_mean=float(kl.mean()),
        kl_first=float(kl[1]) if kl.shape[0] > 1 else 0.0,
        entries_full=before.entries,
        entries_compressed=after.entries,
        kv_bytes_full=before.kv_bytes,
        kv_bytes_compressed=after.kv_bytes,
        nll_per_position_full=nll_pos_full.cpu() if per_position else None,
        nll_per_position_compressed=nll_pos_comp.cpu() if per_position else None,
        kl_per_position=kl.cpu() if per_position else None,
        layer_errors=errors,
    )


def text_fidelity(
    model,
    tokenizer,
    text: str,
    context_tokens: int,
    continuation_tokens: int,
    method: str | Pipeline | None,
    ratio: float | None = None,
    budget: int | None = None,
    method_params: dict | None = None,
    layer_queries: int = 0,
    add_special_tokens: bool = True,
) -> ContinuationFidelity:
    """:func:`continuation_fidelity` on one text: its first ``context_tokens`` tokens are the context, the next
    ``continuation_tokens`` the continuation.

    Raises:
        InvalidParameterError: when the text has fewer than ``context_tokens + continuation_tokens`` tokens
    """
    if context_tokens <= 0 or continuation_tokens <= 0:
        raise InvalidParameterError("context_tokens and continuation_tokens must be positive")
    need = context_tokens + continuation_tokens
    ids = _text_ids(tokenizer, text, need, add_special_tokens)
    return continuation_fidelity(
        model,
        None,
        ids[:context_tokens],
        ids[context_tokens:need],
        method,
        ratio,
        budget,
        method_params,
        layer_queries=layer_queries,
    )


def _text_ids(tokenizer, text: str, need: int, add_special_tokens: bool = True) -> torch.Tensor:
    """The first ``need`` token ids of ``text`` (tokenizing only a prefix of long texts)."""
    chars = max(4 * need, 64)
    while True:
        ids = tokenizer(text[:chars], add_special_tokens=add_special_tokens)["input_ids"]
        if len(ids) > need or chars >= len(text):
            break
        chars *= 2
    if len(ids) < need:
        raise InvalidParameterError(f"the text has {len(ids)} tokens, fewer than the {need} requested")
    return torch.tensor(ids[:need], dtype=torch.long, device="cpu")


# ---------------------------------------------------------------------------------------------------- layers
@dataclass
class _LayerCapture:
    """What one layer saw during the full-cache run over the decoding queries."""

    module: torch.nn.Module
    scaling: float
    query: torch.Tensor  # [batch, q_heads, n, head_dim] post-rotary
    positions: torch.Tensor  # [batch, n]
    keys: torch.Tensor  # [batch, kv_heads, n, head_dim] new entries
    values: torch.Tensor
    context_keys: torch.Tensor  # [batch, kv_heads, S, head_dim] full stored entries before the queries
    context_values: torch.Tensor
    context_positions: torch.Tensor  # [batch, kv_heads, S]
    output: torch.Tensor  # [batch, n, q_heads, head_dim] the attention output of the real run
    o_full: torch.Tensor | None = None  # [batch, n, hidden] after o_proj (filled on first use)


@dataclass
class QueryCapture:
    """Queries, new keys/values and full-cache context of every layer for ``n`` decoding queries.

    Produced by :func:`capture_decoding_queries` from one full-cache forward pass; :func:`layer_errors` reuses
    it against any number of compressed caches of the same prefill.
    """

    layers: list[_LayerCapture]
    query_ids: torch.Tensor  # [batch, n]

    @property
    def num_queries(self) -> int:
        return int(self.query_ids.shape[1])


@torch.inference_mode()
def capture_decoding_queries(
    model, cache_full: KVTrimCache, query_ids: Any, mask: torch.Tensor | None = None
) -> QueryCapture:
    """Feed ``query_ids`` teacher-forced after ``cache_full`` (on a private copy) and record, per layer, the
    post-rotary queries, the new keys/values and their positions.

    Args:
        cache_full: the uncompressed prefilled cache (not modified)
        query_ids: ``[n]`` or ``[batch, n]`` tokens fed as the first ``n`` decoding steps
        mask: ``[batch, S]`` attention mask of the cached context; default all ones over ``seen`` columns
    """
    layers = cache_full.kv_layers
    if not layers or len(layers) != len(cache_full.layers):
        raise InvalidParameterError("cache_full must be a prefilled KVTrimCache")
    store0 = layers[0].store
    device = store0.keys.device
    ids = _as_ids(query_ids, "query_ids").to(device)
    batch = store0.batch_size
    if ids.shape[0] == 1 and batch > 1:
        ids = ids.expand(batch, -1)
    if mask is None:
        mask = torch.ones(batch, cache_full.layers[0].seen, dtype=torch.long, device=device)
    work = cache_full.clone(None, None)
    context = [_padded_entries(layer.store) for layer in work.layers]
    seen: dict[int, _LayerCapture] = {}

    def wrap(layer):
        original = layer.attend

        def attend(module, query, position_ids, padding_mask, scaling):
            keys, values = layer.pending
            b, n = query.shape[0], query.shape[2]
            if position_ids is None:
                positions = torch.arange(layer.seen, layer.seen + n, device=query.device).expand(b, n)
            else:
                positions = position_ids.to(query.device).long().expand(b, n)
            out = original(module, query, position_ids, padding_mask, scaling)
            ck, cv, cp = context[layer.layer_idx]
            seen[layer.layer_idx] = _LayerCapture(
                module=module,
                scaling=float(scaling),
                query=query,
                positions=positions.clone(),
                keys=keys,
                values=values,
                context_keys=ck,
                context_values=cv,
                context_positions=cp,
                output=out,
            )
            return out

        return attend

    try:
        for layer in work.layers:
            layer.attend = wrap(layer)  # instance attribute: shadows the method on this private copy only
        with kvtrim_attention_enabled(model), _Quiet(work):
            full_mask = torch.cat([mask.to(device), torch.ones_like(ids, dtype=mask.dtype)], dim=1)
            model(
                input_ids=ids,
                attention_mask=full_mask,
                position_ids=positions(full_mask, ids.shape[1]),
                past_key_values=work,
                use_cache=True,
                logits_to_keep=1,
            )
    finally:
        for layer in work.layers:
            layer.__dict__.pop("attend", None)
    if len(seen) != len(work.layers):
        raise InvalidParameterError("kvtrim attention did not run for every layer; is the model supported?")
    return QueryCapture([seen[i] for i in range(len(work.layers))], ids)


def _capture_for(pre: Prefill, model, ids: torch.Tensor) -> QueryCapture:
    key = (tuple(ids.shape), tuple(ids.flatten().tolist()))
    if key not in pre._captures:
        pre._captures.clear()
        pre._captures[key] = capture_decoding_queries(model, pre.cache, ids, pre.mask)
    return pre._captures[key]


def _padded_entries(store) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(keys, values, positions)`` of a layer store as padded ``[batch, kv_heads, S, ...]`` tensors (empty slots
    at position -1), whatever its layout (dense, or ragged per head through ``to_dense``)."""
    if getattr(store, "layout", "dense") != "dense":
        store = store.to_dense()
    return store.keys, store.values, store.positions


def _attend(cap: _LayerCapture, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Attention of the captured queries over (stored entries + the new entries); ``[batch, n, q_heads, head_dim]``."""
    kv_heads = keys.shape[1]
    new_pos = cap.positions[:, None, :].expand(-1, kv_heads, -1)
    k = torch.cat([keys, cap.keys.to(keys.dtype)], dim=2)
    v = torch.cat([values, cap.values.to(values.dtype)], dim=2)
    kpos = torch.cat([positions, new_pos], dim=2)
    qpos = cap.positions
    mask = (kpos[:, :, None, :] >= 0) & (kpos[:, :, None, :] <= qpos[:, None, :, None])
    return grouped_attention(cap.query, k, v, mask, cap.scaling)


@dataclass
class LayerErrors:
    """Per-layer attention-output errors of a compressed cache versus the full cache.

    All values are averaged over the batch and the ``n`` decoding queries, in float32. With ``Δo`` the
    difference of the layer's attention output after ``o_proj`` (``[hidden]`` per query) and ``Δa_h`` that of
    query head ``h``'s output before ``o_proj`` (``[head_dim]``):

    Attributes:
        l1: ``[layers]`` mean per-query ``‖Δo‖₁`` (CriticalKV's output perturbation)
        rel_fro: ``[layers]`` ``‖Δo‖_F / (‖o_full‖_F + 1e-5)`` over the ``[n, hidden]`` block (CompressKV)
        l1_per_query: ``[layers, n]`` ``‖Δo‖₁`` for each decoding query
        head_l1: ``[layers, q_heads]`` mean per-query ``‖Δa_h · W_O[h]‖₁`` (``W_O[h]`` = head ``h``'s slice of
            ``o_proj``)
        kv_head_l1: ``[layers, kv_heads]`` the same for the summed contribution of each KV head's query group
        reference_mismatch: largest ``|a_full − a_run|`` between the recomputed full-cache attention and the
            one the model actually ran (a self-check; ~1e-6 in float32)
        rel_per_query: ``[layers, n]`` ``‖Δo‖₂ / (‖o_full‖₂ + 1e-5)`` of each decoding query (CompressKV's
            per-step error, summed over steps by its layer profile)
    """

    l1: torch.Tensor
    rel_fro: torch.Tensor
    l1_per_query: torch.Tensor
    head_l1: torch.Tensor
    kv_head_l1: torch.Tensor
    reference_mismatch: float
    rel_per_query: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return int(self.l1.shape[0])

    @property
    def mean_l1(self) -> float:
        return float(self.l1.mean())

    @property
    def mean_rel_fro(self) -> float:
        return float(self.rel_fro.mean())

    def as_dict(self) -> dict:
        return {
            "l1": self.l1.tolist(),
            "rel_fro": self.rel_fro.tolist(),
            "mean_l1": self.mean_l1,
            "mean_rel_fro": self.mean_rel_fro,
            "head_l1": self.head_l1.tolist(),
            "kv_head_l1": self.kv_head_l1.tolist(),
            "reference_mismatch": self.reference_mismatch,
        }


@torch.inference_mode()
def layer_errors(capture: QueryCapture, cache_compressed: KVTrimCache) -> LayerErrors:
    """Per-layer errors of ``cache_compressed`` against the full cache the ``capture`` was taken on.

    Each layer attends with the captured (full-run) queries over its compressed stored entries plus the
    captured new keys/values, so a layer's error does not include the drift of the layers below.
    """
    comp_layers = cache_compressed.layers
    if len(comp_layers) != len(capture.layers) or any(layer.store is None for layer in comp_layers):
        raise InvalidParameterError("cache_compressed must be a prefilled KVTrimCache of the same model")
    l1, rel, per_query, head_l1, kv_l1, rel_query = [], [], [], [], [], []
    mismatch = 0.0
    for cap, layer in zip(capture.layers, comp_layers, strict=True):
        a_full = _attend(cap, cap.context_keys, cap.context_values, cap.context_positions)
        mismatch = max(mismatch, float((a_full.float() - cap.output.float()).abs().max()))
        a_comp = _attend(cap, *_padded_entries(layer.store))
        b, n, hq, d = a_full.shape
        o_proj = cap.module.o_proj
        if cap.o_full is None:
            cap.o_full = o_proj(a_full.reshape(b, n, hq * d)).float()
        o_full = cap.o_full
        o_comp = o_proj(a_comp.reshape(b, n, hq * d)).float()
        diff = o_comp - o_full  # [b, n, hidden]
        q_l1 = diff.abs().sum(-1)  # [b, n]
        per_query.append(q_l1.mean(0))
        l1.append(q_l1.mean())
        rel.append((diff.flatten(1).norm(dim=1) / (o_full.flatten(1).norm(dim=1) + _EPS)).mean())
        rel_query.append((diff.norm(dim=-1) / (o_full.norm(dim=-1) + _EPS)).mean(0))
        weight = o_proj.weight.float().view(-1, hq, d)  # [hidden, q_heads, head_dim]
        contrib = torch.einsum("bnhd,ohd->bnho", (a_comp - a_full).float(), weight)  # [b, n, q_heads, hidden]
        head_l1.append(contrib.abs().sum(-1).mean((0, 1)))
        hkv = cap.context_keys.shape[1]
        grouped = contrib.view(b, n, hkv, hq // hkv, -1).sum(3)
        kv_l1.append(grouped.abs().sum(-1).mean((0, 1)))
    return LayerErrors(
        l1=torch.stack(l1).cpu(),
        rel_fro=torch.stack(rel).cpu(),
        l1_per_query=torch.stack(per_query).cpu(),
        head_l1=torch.stack(head_l1).cpu(),
        kv_head_l1=torch.stack(kv_l1).cpu(),
        reference_mismatch=mismatch,
        rel_per_query=torch.stack(rel_query).cpu(),
    )


def attention_output_error(
    model,
    cache_full: KVTrimCache,
    cache_compressed: KVTrimCache,
    query_ids: Any,
    mask: torch.Tensor | None = None,
) -> LayerErrors:
    """Per-layer attention-output error of ``cache_compressed`` vs ``cache_full`` for the decoding queries of
    ``query_ids`` (typically the first ``n`` continuation tokens, teacher-forced).

    Neither cache is modified. To compare many compressed caches of one prefill, call
    :func:`capture_decoding_queries` once and :func:`layer_errors` per cache.

    Args:
        cache_full: the uncompressed prefilled cache
        cache_compressed: a compressed copy of it (same context, same positions)
        query_ids: ``[n]`` or ``[batch, n]`` tokens fed as the first decoding steps
        mask: ``[batch, S]`` attention mask of the cached context; default all ones
    Returns:
        :class:`LayerErrors`
    """
    return layer_errors(capture_decoding_queries(model, cache_full, query_ids, mask), cache_compressed)
