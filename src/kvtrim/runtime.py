"""Running a model over a kvtrim cache: resolve a method, prefill (plain or chunked), feed tokens, decode.

The one place where kvtrim drives the model's forward pass. :mod:`kvtrim.api` (``Session``, ``generate``),
:mod:`kvtrim.eval.fidelity`, the calibrations and the analysis tools all prefill, clone-and-compress and decode
through these functions, so positions, masks, observation recording and stopping rules are written once.

* :func:`resolve_method` turns ``(method, ratio, budget, params)`` into a bound pipeline and budget, validating
  everything before any work.
* :func:`feed` appends tokens after what a cache holds (logical positions from the mask, so left padding and
  evicted entries do not shift them) and records the prompt's log-probabilities when the method asks for them.
* :class:`Prefill` prefills a prompt once (in one pass, or chunk by chunk with compression between chunks) and
  hands out compressed copies (:meth:`Prefill.compressed`).
* :func:`greedy_decode` decodes from the last prompt logits (greedy, or as a :class:`~kvtrim.sampling.Sampling`
  says) with an optional per-step callback.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from .cache.quant import KVQuant
from .compression.compressor import BudgetSpec, CompressionReport
from .compression.pipeline import Pipeline
from .errors import InvalidParameterError, KVTrimError
from .integration.cache import CacheStats, KVTrimCache
from .methods import get_method
from .sampling import Sampling, eos_ids
from .scoring.observation import ObservationSpec

__all__ = [
    "FULL",
    "Compressed",
    "Decoded",
    "Fed",
    "Prefill",
    "StepCallback",
    "eos_ids",
    "feed",
    "greedy_decode",
    "observation_of",
    "positions",
    "resolve_method",
    "tokenize",
]

FULL = "full"


# ---------------------------------------------------------------------------------------------------- methods
def resolve_method(
    method: str | Pipeline | None,
    ratio: float | None,
    budget: int | None,
    params: dict | None = None,
    model: torch.nn.Module | None = None,
) -> tuple[Pipeline | None, BudgetSpec | None]:
    """``(pipeline, budget spec)`` for a registry name or built pipeline; ``(None, None)`` for ``"full"``/None.

    Validates everything up front so bad input changes nothing; with ``model`` the pipeline is bound to it
    (offline artifacts are loaded, and a missing one raises before any work).

    Raises:
        InvalidParameterError: ratio/budget/params with ``"full"``, params with a built pipeline, an unknown
            method or a value one of its components rejects (the message names method and parameters)
    """
    if method is None or method == FULL:
        if ratio is not None or budget is not None:
            raise InvalidParameterError("method='full' keeps everything; do not pass ratio or budget with it")
        if params:
            raise InvalidParameterError("method='full' takes no method parameters")
        return None, None
    if isinstance(method, Pipeline):
        if params:
            raise InvalidParameterError("method_params apply to registry names, not to a built Pipeline")
        pipeline, spec = method, BudgetSpec(ratio=ratio, budget=budget)
    elif not isinstance(method, str):
        raise InvalidParameterError(f"method must be a registry name or a Pipeline, got {method!r}")
    else:
        spec = BudgetSpec(ratio=ratio, budget=budget)
        try:
            pipeline = get_method(method, **(params or {}))
        except KVTrimError:
            raise
        except (ValueError, TypeError) as exc:  # a component rejected a value: say which method and parameters
            raise InvalidParameterError(f"method_params {params!r} for method {method!r}: {exc}") from exc
    pipeline.check(spec.ratio, spec.budget)
    if model is not None:
        pipeline.bind(model)
    return pipeline, spec


def observation_of(methods: Iterable[str | Pipeline | None]) -> ObservationSpec:
    """The union of what ``methods`` (registry names or pipelines; None/``"full"`` skipped) need recorded at
    prefill."""
    spec = ObservationSpec()
    for m in methods:
        if m is None or m == FULL:
            continue
        spec = spec.merge((get_method(m) if isinstance(m, str) else m).observation)
    return spec


# ---------------------------------------------------------------------------------------------------- feeding
def tokenize(tokenizer, texts: Sequence[str], special: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``(input_ids [batch, n], attention_mask [batch, n])`` of ``texts`` (CPU tensors)."""
    enc = tokenizer(list(texts), return_tensors="pt", padding=True, padding_side="left", add_special_tokens=special)
    return enc["input_ids"], enc["attention_mask"]


def positions(mask: torch.Tensor, new: int) -> torch.Tensor:
    """Logical positions ``[batch, new]`` of the last ``new`` columns of a (possibly mid-padded) ``[batch, n]``
    mask: the number of real tokens before each column (padding columns get the position of the token before)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -new:]


@dataclass
class Fed:
    """What :func:`feed` returns.

    Attributes:
        logits: ``[batch, vocab]`` logits of the last fed position
        mask: ``[batch, seen + q]`` the attention mask extended by the fed tokens
        seconds: wall time of the forward pass
        attentions: per layer ``[batch, q_heads, q, keys]`` when asked for (eager attention only), else None
    """

    logits: torch.Tensor
    mask: torch.Tensor
    seconds: float
    attentions: tuple[torch.Tensor, ...] | None = None


def feed(
    model: torch.nn.Module,
    cache,
    mask: torch.Tensor,
    input_ids: torch.Tensor,
    input_mask: torch.Tensor | None = None,
    output_attentions: bool = False,
) -> Fed:
    """Feed ``input_ids`` ``[batch, q]`` after what ``cache`` holds (``mask`` ``[batch, seen]``, 1 = real token).

    ``input_mask`` ``[batch, q]`` marks padding among the fed tokens (default all real). Token ids and masks move
    to the device of the model's input embeddings (tokenizers return CPU tensors). When ``cache`` is a
    :class:`KVTrimCache` whose method asks for the prompt's log-probabilities, they are recorded in
    ``cache.prompt_logprobs``. Works with any transformers cache; kvtrim attention must be enabled for a
    :class:`KVTrimCache`.
    """
    device = model.get_input_embeddings().weight.device
    if input_mask is None:
        input_mask = torch.ones(input_ids.shape, dtype=mask.dtype, device=device)
    input_ids, input_mask = input_ids.to(device), input_mask.to(device)
    mask = torch.cat([mask.to(device), input_mask], dim=1)
    window = cache.observation_spec.token_logprobs if isinstance(cache, KVTrimCache) and cache.observing else 0
    extra = {"output_attentions": True} if output_attentions else {}
    t0 = time.perf_counter()
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions(mask, input_ids.shape[1]),
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=min(window + 1, input_ids.shape[1]) if window else 1,
        **extra,
    )
    if window:
        _record_prompt_logprobs(cache, out.logits, input_ids, input_mask, window)
    attentions = tuple(out.attentions) if output_attentions else None
    return Fed(out.logits[:, -1], mask, time.perf_counter() - t0, attentions)


def _record_prompt_logprobs(cache: KVTrimCache, logits, input_ids, input_mask, window: int) -> None:
    """Append log p(x_j | x_<j) of the fed tokens to ``cache.prompt_logprobs`` (last ``window`` kept, NaN where
    padding or where the predicting logits are not available). ``logits`` ``[batch, k, vocab]`` are the last ``k``
    positions of this feed; the first fed token is predicted by the previous feed's last position."""
    n, k = input_ids.shape[1], logits.shape[1]
    logp = torch.log_softmax(logits.float(), dim=-1)  # [b, k, V]
    got = logp[:, :-1].gather(-1, input_ids[:, n - k + 1 :, None]).squeeze(-1)  # tokens n-k+1 .. n-1
    if k == n:  # the feed's first token: the previous feed's last position predicted it, if there was one
        last = cache.last_logprobs
        first = last.gather(-1, input_ids[:, :1]) if last is not None else got.new_full((got.shape[0], 1), float("nan"))
        got = torch.cat([first, got], dim=1)
    got = got[:, -window:]
    got = got.masked_fill(~input_mask[:, -got.shape[1] :].to(torch.bool), float("nan"))
    prev = cache.prompt_logprobs
    cache.prompt_logprobs = (got if prev is None else torch.cat([prev, got], dim=1))[:, -window:]
    cache.last_logprobs = logp[:, -1]


# ---------------------------------------------------------------------------------------------------- prefill
@dataclass
class Compressed:
    """A compressed copy of a prefill: the cache, the method's report (None for ``"full"``) and the seconds the
    compression took (wall, and CPU time of this process as in :class:`Decoded`)."""

    cache: KVTrimCache
    report: CompressionReport | None
    seconds: float
    cpu_seconds: float = 0.0


@dataclass
class Prefill:
    """A prompt prefilled into a :class:`KVTrimCache` (build it with :meth:`plain` or :meth:`chunked`).

    Attributes:
        cache: the prefilled cache. Plain: uncompressed, never modified (:meth:`compressed` clones it).
            Chunked: built for one method, already compressed between chunks, compressed in place
        mask: ``[batch, n]`` attention mask of the prompt (1 = real token)
        logits: ``[batch, vocab]`` logits of the last prompt position (predict the first answer token)
        observation: what was recorded for the methods that will compress it
        before: sizes right after prefill
        seconds: wall time of the prefill (forward passes and, when chunked, the compressions between chunks)
        chunk: tokens per chunk (None: one pass)
    """

    cache: KVTrimCache
    mask: torch.Tensor
    logits: torch.Tensor
    observation: ObservationSpec
    before: CacheStats | None = None
    seconds: float = 0.0
    chunk: int | None = None

    @classmethod
    def plain(
        cls,
        model: torch.nn.Module,
        ids: torch.Tensor,
        mask: torch.Tensor,
        observation: ObservationSpec,
        question_start: torch.Tensor | None = None,
    ) -> Prefill:
        """Prefill ``ids`` ``[batch, n]`` (``mask`` 1 = real token) in one pass into a fresh uncompressed cache,
        recording what ``observation`` asks for; ``question_start`` ``[batch]`` is where the prompt's question
        part begins (logical positions), when it has one. Call under kvtrim attention."""
        cache = KVTrimCache(model.config.num_hidden_layers, auto_compress=False)
        cache.question_start = question_start
        cache.observing = bool(observation.window or observation.slot_stats)
        cache.observation_spec = observation
        fed = feed(model, cache, mask[:, :0], ids, mask)
        cache.observing = False
        return cls(cache, fed.mask, fed.logits, observation, cache.stats(), fed.seconds)

    @classmethod
    def chunked(
        cls,
        model: torch.nn.Module,
        ids: torch.Tensor,
        mask: torch.Tensor,
        chunk: int,
        pipeline: Pipeline | None = None,
        spec: BudgetSpec | None = None,
        kv_quant: str | KVQuant | None = None,
        question_start: torch.Tensor | None = None,
    ) -> Prefill:
        """Prefill ``ids`` ``[batch, n]`` ``chunk`` tokens at a time; each chunk attends to the cache as the
        previous chunks left it. With a ``pipeline``, the cache is compressed between chunks (every time for a
        one-shot method; when its schedule is due for a continuous one, e.g. LagKV's full tail), so the cache
        never holds much more than the budget plus one chunk. The final compression is :meth:`compressed`'s.
        ``kv_quant`` holds the entries quantized from the first chunk on; ``question_start`` as in :meth:`plain`.
        Call under kvtrim attention."""
        if pipeline is not None and pipeline.append is not None:
            raise InvalidParameterError(
                f"method {pipeline.name!r} appends its entries once, after the whole prompt: a chunked prefill would "
                "append them after every chunk; prefill in one pass (no prefill_chunk)"
            )
        cache = KVTrimCache(model.config.num_hidden_layers, pipeline, spec, auto_compress=False, kv_quant=kv_quant)
        cache.question_start = question_start
        cache.observing = pipeline is not None
        seen = mask[:, :0]
        logits, total = None, 0.0
        for start in range(0, ids.shape[1], chunk):
            if start and pipeline is not None and (not pipeline.schedule.continuous or pipeline.schedule.due(cache)):
                t0 = time.perf_counter()
                cache.compress(keep_observing=True)
                total += time.perf_counter() - t0
            fed = feed(model, cache, seen, ids[:, start : start + chunk], mask[:, start : start + chunk])
            logits, seen = fed.logits, fed.mask
            total += fed.seconds
        observation = pipeline.observation if pipeline is not None else ObservationSpec()
        return cls(cache, seen, logits, observation, cache.stats(), total, chunk)

    def covers(self, pipeline: Pipeline) -> bool:
        """Whether this prefill recorded what ``pipeline`` needs."""
        return self.observation.covers(pipeline.observation)

    def compressed(
        self, pipeline: Pipeline | None, spec: BudgetSpec | None, kv_quant: str | KVQuant | None = None
    ) -> Compressed:
        """A cache of this prefill compressed with ``pipeline`` (None: an uncompressed copy).

        Plain prefill: an independent clone is compressed (the prefill serves any number of methods); with
        ``kv_quant`` the clone's entries are quantized before scoring, so the method scores the keys attention will
        see, and the entries it keeps are quantized from the prefill's float keys (once, not from their codes).
        Chunked prefill: its own cache, built for this one method (and format), is compressed in place.

        Raises:
            InvalidParameterError: the prefill did not record the observations ``pipeline`` needs
        """
        if self.chunk is not None:
            cache = self.cache
        else:
            if pipeline is not None and not self.covers(pipeline):
                raise InvalidParameterError(
                    f"method {pipeline.name!r} needs observations {pipeline.observation} but this prefill did not "
                    f"record them (it recorded {self.observation}); list the method in the prefill's methods "
                    "(kvtrim.Session(methods=...), kvtrim.eval.fidelity.prefill(methods=...))"
                )
            # the prefill is never modified: a quantized clone quantizes its kept keys from the prefill's, once
            cache = self.cache.clone(pipeline, spec, kv_quant, share_source_keys=True)
        if pipeline is None:
            return Compressed(cache, None, 0.0)
        t0, c0 = time.perf_counter(), time.process_time()
        report = cache.compress(logits=self.logits)
        return Compressed(cache, report, time.perf_counter() - t0, time.process_time() - c0)


# ---------------------------------------------------------------------------------------------------- decoding
StepCallback = Callable[[int, torch.Tensor, "tuple[torch.Tensor, ...] | None"], "torch.Tensor | bool | None"]
"""``on_step(step, tokens [batch], attentions)``: called once per chosen token (EOS included) with the
attentions of the forward pass that chose it (None unless asked for); a True / ``[batch]`` bool return ends
those rows after this token."""


@dataclass
class Decoded:
    """What :func:`greedy_decode` returns.

    Attributes:
        tokens: per row, the answer's token ids (EOS excluded)
        seconds: wall time of decoding
        steps: decoding forward passes (tokens fed back into the cache)
        cpu_seconds: CPU time this process spent decoding (all its threads). On a CPU shared with other jobs it is
            the steady measure of the work, where wall time also counts the time others held the cores; on an
            accelerator it counts only the host's side
    """

    tokens: list[list[int]]
    seconds: float
    steps: int
    cpu_seconds: float = 0.0


def greedy_decode(
    model: torch.nn.Module,
    cache,
    mask: torch.Tensor,
    logits: torch.Tensor,
    max_new_tokens: int = 64,
    eos: Iterable[int] = (),
    pad: int = 0,
    *,
    sampling: Sampling | None = None,
    prompt_ids: torch.Tensor | None = None,
    tokenizer=None,
    on_step: StepCallback | None = None,
    attentions: tuple[torch.Tensor, ...] | None = None,
    output_attentions: bool = False,
) -> Decoded:
    """Decode from ``logits`` ``[batch, vocab]`` (the last prompt position) over ``cache`` (``mask``
    ``[batch, seen]``).

    Greedy with ``eos``/``pad`` and at most ``max_new_tokens``, unless ``sampling`` (from
    :func:`kvtrim.sampling.build_sampling`) says otherwise (it then supplies all four). A row ends at an EOS
    token, a stop string of ``sampling`` (decoded with ``tokenizer``), or when ``on_step`` says so; finished rows
    are fed ``pad``. ``prompt_ids`` ``[batch, n]`` are the prompt's tokens, which logits processors such as a
    repetition penalty read.

    Args:
        on_step: see :data:`StepCallback`
        attentions: the attentions of the pass that produced ``logits`` (handed to ``on_step`` at step 0)
        output_attentions: ask every decoding pass for its attentions (needs eager attention)
    """
    if sampling is None:
        sampling = Sampling(False, [], tuple(sorted(set(eos))), pad, max_new_tokens)
    batch, device = logits.shape[0], logits.device
    eos_ids_ = sampling.eos_tensor(device)
    seq = logits.new_zeros((batch, 0), dtype=torch.long) if prompt_ids is None else prompt_ids.to(device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    emitted: list[torch.Tensor] = []  # [batch] per step; -1 where the row emitted nothing
    next_token = sampling.pick(seq, logits)
    steps, t0, c0 = 0, time.perf_counter(), time.process_time()
    for step in range(sampling.max_new_tokens):
        is_eos = torch.isin(next_token, eos_ids_)
        emitted.append(next_token.masked_fill(done | is_eos, -1))
        done = done | is_eos
        if on_step is not None:
            stop = on_step(step, next_token, attentions)
            if stop is not None:
                done = done | torch.as_tensor(stop, dtype=torch.bool, device=device)
        if sampling.stop:  # only with stop strings: decode the answers so far on the host
            so_far = torch.stack(emitted, dim=1).tolist()
            texts = [tokenizer.decode([t for t in row if t >= 0], skip_special_tokens=True) for row in so_far]
            done = done | torch.tensor([sampling.stopped(t) for t in texts], dtype=torch.bool, device=device)
        if step == sampling.max_new_tokens - 1 or bool(done.all()):
            break
        token = next_token.masked_fill(done, sampling.pad).view(batch, 1)
        seq = torch.cat([seq, token], dim=1)
        fed = feed(model, cache, mask, token, output_attentions=output_attentions)
        mask, attentions = fed.mask, fed.attentions
        next_token = sampling.pick(seq, fed.logits)
        steps += 1
    rows = torch.stack(emitted, dim=1).tolist()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    return Decoded([[t for t in row if t >= 0] for row in rows], seconds, steps, cpu_seconds)
