"""The public API: compress a context, answer questions from the compressed cache, measure what it cost."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from .cache.quant import DEFAULT_RESIDUAL, KVQuant, resolve_kv_quant
from .compression.pipeline import Pipeline
from .errors import InvalidParameterError
from .integration.attention import check_supported, enable, kvtrim_attention_enabled
from .integration.cache import KVTrimCache
from .prompts import prompt_template
from .runtime import FULL, Decoded, Prefill, feed, greedy_decode, observation_of, resolve_method, tokenize
from .sampling import Sampling, build_sampling


@dataclass
class GenerationStats:
    """Sizes and timings of one :func:`generate` call (bytes measured from the cache tensors).

    ``kv_entries_*`` count stored (token, layer, KV head) entries over the batch; ``kv_bytes_*`` are the bytes
    of the key and value tensors. ``before`` is right after prefill, ``after`` right after compression.
    ``peak_kv_bytes`` is the largest K/V size held at any forward-pass boundary (prefill chunks and decoding
    included); ``compressions`` counts compressions of one answer (more than 1 with a decoding-time schedule).
    ``decode_s`` / ``compress_s`` are wall times, ``decode_cpu_s`` / ``compress_cpu_s`` the CPU time this process
    spent (steady on a shared CPU, where wall time also counts what other jobs took; host work only on an
    accelerator).
    """

    method: str
    ratio: float | None
    budget: int | None
    question_aware: bool
    context_tokens: int
    kv_entries_before: int
    kv_entries_after: int
    kv_bytes_before: int
    kv_bytes_after: int
    prefill_s: float
    compress_s: float
    question_prefill_s: float
    decode_s: float
    decode_tokens: int
    context_tokens_per_row: list[int] = field(default_factory=list)
    layer_budgets: list | None = None
    peak_kv_bytes: int = 0
    compressions: int = 0
    prefill_chunk: int | None = None
    compression_metadata: dict = field(default_factory=dict)
    prompt_format: str = "kvtrim"
    separator: str = "\n\n"
    decode_cpu_s: float = 0.0
    compress_cpu_s: float = 0.0

    @property
    def decode_ms_per_token(self) -> float:
        return 1000.0 * self.decode_s / self.decode_tokens if self.decode_tokens else float("nan")

    @property
    def decode_cpu_ms_per_token(self) -> float:
        """Process CPU milliseconds per decoding step (see :class:`kvtrim.runtime.Decoded`'s ``cpu_seconds``)."""
        return 1000.0 * self.decode_cpu_s / self.decode_tokens if self.decode_tokens else float("nan")

    @property
    def kept_fraction(self) -> float:
        return self.kv_entries_after / self.kv_entries_before if self.kv_entries_before else float("nan")

    def as_dict(self) -> dict:
        out = asdict(self)
        out["decode_ms_per_token"] = self.decode_ms_per_token
        out["decode_cpu_ms_per_token"] = self.decode_cpu_ms_per_token
        return out


@dataclass
class Result:
    """Answers and stats. ``answers`` is ``list[str]`` (one per question) for one context, and
    ``list[list[str]]`` (per context, per question) for a batch of contexts."""

    answers: list
    stats: GenerationStats


# ---------------------------------------------------------------------------------------------------- helpers
def _normalize_inputs(context, questions) -> tuple[list[str], list[list[str]], bool]:
    batched = isinstance(context, (list, tuple))
    contexts = list(context) if batched else [context]
    if not contexts or any(not isinstance(c, str) or not c.strip() for c in contexts):
        raise InvalidParameterError("context must be a non-empty string (or a list of non-empty strings)")
    if isinstance(questions, str):
        questions = [questions]
    if not isinstance(questions, (list, tuple)) or not questions:
        raise InvalidParameterError("questions must be a non-empty string or list of strings")
    if batched:
        if len(questions) != len(contexts):
            raise InvalidParameterError(
                f"with {len(contexts)} contexts, questions must hold one entry per context, got {len(questions)}"
            )
        rows = [[q] if isinstance(q, str) else list(q) for q in questions]
        if len({len(r) for r in rows}) != 1:
            raise InvalidParameterError("every context must have the same number of questions")
    else:
        rows = [list(questions)]
    if any(not isinstance(q, str) for r in rows for q in r):
        raise InvalidParameterError("questions must be strings")
    return contexts, rows, batched


class Session:
    """A prompt prefilled once; each :meth:`run` compresses a fresh copy of its cache and decodes from it.

    Context-only (``question=None``): the context is prefilled; ``run`` appends questions after compression.
    Question-aware (``question`` given): context and question are prefilled together and compressed together.

    Args:
        methods: every method name (or built pipeline) that :meth:`run` will be asked for, so the prefill records
            what all of them need (observation windows, accumulated attention)

    Attributes:
        ids, mask: ``[batch, n]`` the tokenized prompt (left-padded) and its attention mask
        prefill: the shared one-pass :class:`kvtrim.runtime.Prefill` (uncompressed, never modified); None with
            ``prefill_chunk``, where every method prefills on its own because it compresses between the chunks
    """

    def __init__(
        self,
        model,
        tokenizer,
        context: str | list[str],
        question: str | list[str] | None = None,
        methods: Sequence = (),
        answer_prefix: str | None = None,
        use_chat_template: bool = True,
        prefill_chunk: int | None = None,
        prompt_format: str = "kvtrim",
        separator: str | None = None,
    ):
        check_supported(model)
        if prefill_chunk is not None and (
            isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk <= 0
        ):
            raise InvalidParameterError(f"prefill_chunk must be a positive integer (tokens), got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        contexts = list(context) if isinstance(context, (list, tuple)) else [context]
        if not contexts or any(not isinstance(c, str) or not c.strip() for c in contexts):
            raise InvalidParameterError("context must be a non-empty string (or a list of non-empty strings)")
        self.model, self.tokenizer = model, tokenizer
        self.batched = isinstance(context, (list, tuple))
        self.template = prompt_template(tokenizer, use_chat_template, separator, prompt_format)
        self.special = self.template.add_special_tokens  # a chat template already carries its special tokens
        self.answer_prefix = answer_prefix
        self.question_aware = question is not None
        self.observation = observation_of(methods)
        texts = [self.template.context_part(c) for c in contexts]
        if question is not None:
            qs = [question] * len(contexts) if isinstance(question, str) else list(question)
            if len(qs) != len(contexts) or any(not isinstance(q, str) for q in qs):
                raise InvalidParameterError("question must be a string or one string per context")
            context_ids = tokenize(tokenizer, texts, self.special)
            texts = [t + self.template.question_part(q, answer_prefix) for t, q in zip(texts, qs, strict=True)]
        self.ids, self.mask = tokenize(tokenizer, texts, self.special)
        self.question_start = None if question is None else question_starts(self.ids, self.mask, *context_ids)
        check_length(model, self.ids.shape[1], "the prompt" if question is not None else "the context")
        self.prefill: Prefill | None = None
        if prefill_chunk is None:
            with torch.inference_mode(), kvtrim_attention_enabled(model):
                self.prefill = Prefill.plain(model, self.ids, self.mask, self.observation, self.question_start)

    def _prefilled(self, pipeline: Pipeline | None, spec, kv_quant: KVQuant | None = None) -> Prefill:
        """The prefill that ``pipeline`` compresses (the shared one, or a chunked prefill of its own)."""
        if self.prefill is not None:
            return self.prefill
        return Prefill.chunked(
            self.model, self.ids, self.mask, self.prefill_chunk, pipeline, spec, kv_quant, self.question_start
        )

    @property
    def context_tokens_per_row(self) -> list[int]:
        return [int(x) for x in self.mask.sum(-1).tolist()]

    @torch.inference_mode()
    def run(
        self,
        method: str | None,
        ratio: float | None = None,
        budget: int | None = None,
        questions: str | list[str] | list[list[str]] | None = None,
        max_new_tokens: int | None = None,
        method_params: dict | None = None,
        generation_config=None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        *,
        sampling: Sampling | None = None,
        kv_quant: str | KVQuant | None = None,
    ) -> Result:
        """Compress a copy of the prefilled cache with ``method`` and answer (see :func:`generate` for the
        decoding settings).

        Args:
            sampling: a decoding strategy already resolved by :func:`kvtrim.sampling.build_sampling`, instead of
                the settings (``max_new_tokens`` ... ``stop``), which must then be left out
            kv_quant: hold the copy's entries as ``"int8"`` / ``"int4"`` / ``"fp8"`` (None: the model's dtype)
        """
        quant = resolve_kv_quant(kv_quant)
        pipeline, spec = resolve_method(method, ratio, budget, method_params, self.model)
        settings = {
            "max_new_tokens": max_new_tokens,
            "do_sample": do_sample,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "seed": seed,
            "stop": stop,
        }
        if sampling is None:
            sampling = build_sampling(self.model, self.tokenizer, generation_config, **settings)
        elif generation_config is not None or any(v is not None for v in settings.values()):
            raise InvalidParameterError("give either sampling= or the decoding settings, not both")
        rows = self._question_rows(questions)
        if pipeline is not None and self.prefill is not None and not self.prefill.covers(pipeline):
            raise InvalidParameterError(
                f"method {pipeline.name!r} needs observations this session did not record; "
                "list it in Session(methods=...)"
            )
        with kvtrim_attention_enabled(self.model):
            pre = self._prefilled(pipeline, spec, quant)
            compressed = pre.compressed(pipeline, spec, quant)
            cache, report, compress_s = compressed.cache, compressed.report, compressed.seconds
            after = cache.stats()
            answers: list[list[str]] = [[] for _ in range(len(pre.mask))]
            timings = {"qprefill": 0.0, "decode": 0.0, "decode_cpu": 0.0, "steps": 0}
            peak, compressions = cache.peak_kv_bytes, cache.compressions
            if self.question_aware:
                outcome = greedy_decode(
                    self.model, cache, pre.mask, pre.logits,
                    sampling=sampling, prompt_ids=self.ids, tokenizer=self.tokenizer,
                )  # fmt: skip
                _collect(outcome, 0.0, self.tokenizer, answers, timings, sampling)
                peak, compressions = max(peak, cache.peak_kv_bytes, cache.kv_nbytes()), cache.compressions
            else:
                # A decoding-time schedule rewrites the cache while answering: answer from a copy, not a rollback.
                continuous = pipeline is not None and pipeline.schedule.continuous
                mark = None if continuous else cache.mark()
                for qi in range(len(rows[0])):
                    work = cache.clone(pipeline, spec) if continuous else cache
                    texts = [self.template.question_part(r[qi], self.answer_prefix) for r in rows]
                    q_ids, q_mask = tokenize(self.tokenizer, texts, False)
                    check_length(self.model, self.ids.shape[1] + q_ids.shape[1], "context and question")
                    fed = feed(self.model, work, pre.mask, q_ids, q_mask)
                    prompt = torch.cat([self.ids, q_ids], dim=1)
                    outcome = greedy_decode(
                        self.model, work, fed.mask, fed.logits,
                        sampling=sampling, prompt_ids=prompt, tokenizer=self.tokenizer,
                    )  # fmt: skip
                    peak = max(peak, work.peak_kv_bytes, work.kv_nbytes())
                    compressions = max(compressions, work.compressions)
                    if not continuous:
                        cache.rollback(mark)
                    _collect(outcome, fed.seconds, self.tokenizer, answers, timings, sampling)
        per_row = self.context_tokens_per_row
        stats = GenerationStats(
            method=FULL if pipeline is None else pipeline.name,
            ratio=ratio,
            budget=budget,
            question_aware=self.question_aware,
            context_tokens=int(sum(per_row)),
            kv_entries_before=pre.before.entries,
            kv_entries_after=after.entries,
            kv_bytes_before=pre.before.kv_bytes,
            kv_bytes_after=after.kv_bytes,
            prefill_s=pre.seconds,
            compress_s=compress_s,
            question_prefill_s=timings["qprefill"],
            decode_s=timings["decode"],
            decode_tokens=timings["steps"],
            context_tokens_per_row=per_row,
            layer_budgets=None if report is None or report.budgets is None else report.budgets[0].tolist(),
            peak_kv_bytes=int(peak),
            compressions=int(compressions),
            prefill_chunk=self.prefill_chunk,
            compression_metadata={} if report is None else dict(report.metadata),
            prompt_format=self.template.format,
            separator=self.template.separator,
            decode_cpu_s=timings["decode_cpu"],
            compress_cpu_s=compressed.cpu_seconds,
        )
        return Result(answers=answers if self.batched else answers[0], stats=stats)

    def _question_rows(self, questions) -> list[list[str]]:
        n = len(self.context_tokens_per_row)
        if self.question_aware:
            if questions is not None:
                raise InvalidParameterError("this session is question-aware: its question was given at prefill")
            return [[""] for _ in range(n)]
        if questions is None:
            raise InvalidParameterError("questions are required in context-only mode")
        contexts = ["x"] * n if self.batched else "x"
        return _normalize_inputs(contexts, questions)[1]


def question_starts(
    ids: torch.Tensor, mask: torch.Tensor, context_ids: torch.Tensor, context_mask: torch.Tensor
) -> torch.Tensor:
    """``[batch]`` logical position where each row's question part begins: the length of the longest common
    prefix of the prompt's real tokens (``ids``/``mask``) and those of its context part tokenized alone (a token
    the tokenizer merged across the boundary counts as the question's)."""
    starts = []
    for row, row_mask, ctx, ctx_mask in zip(ids, mask, context_ids, context_mask, strict=True):
        full, part = row[row_mask.bool()], ctx[ctx_mask.bool()]
        n = min(len(full), len(part))
        differ = (full[:n] != part[:n]).nonzero()
        starts.append(int(differ[0]) if len(differ) else n)
    return torch.tensor(starts, dtype=torch.long)


def generate(
    model,
    tokenizer,
    context: str | list[str],
    questions: str | list[str] | list[list[str]],
    method: str | None = "snapkv",
    ratio: float | None = None,
    budget: int | None = None,
    question_aware: bool = False,
    max_new_tokens: int | None = None,
    answer_prefix: str | None = None,
    method_params: dict | None = None,
    use_chat_template: bool = True,
    prefill_chunk: int | None = None,
    prompt_format: str = "kvtrim",
    separator: str | None = None,
    generation_config=None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    kv_quant: str | None = None,
) -> Result:
    """Compress the KV cache of ``context`` with ``method`` and answer ``questions`` from it.

    Context-only mode (default): the context is prefilled and compressed once; each question is appended after
    compression, answered, and removed again before the next one. Question-aware mode: for each question the
    whole prompt (context and question) is prefilled and compressed, as most papers evaluate.

    Decoding follows the model's ``generation_config`` as ``model.generate`` does (greedy unless it samples);
    ``generation_config`` or the keyword settings override it.

    Args:
        context: the long text, or a list of texts (a left-padded batch)
        questions: one question, a list of questions, or for a batch one entry (str or list) per context
        method: a registry name (see :func:`kvtrim.methods`), or ``"full"``/None for no compression
        ratio: fraction of entries removed, in [0, 1)
        budget: entries kept per layer and KV head (> 0); at or above the context length keeps everything
        max_new_tokens: tokens per answer (default: the given ``generation_config``'s, else 64)
        answer_prefix: text placed at the start of the assistant's answer (e.g. RULER answer prefixes)
        method_params: overrides of the method's defaults (e.g. ``{"window": 8}``)
        prefill_chunk: prefill the prompt this many tokens at a time, compressing between chunks (bounded memory)
        prompt_format: ``"kvtrim"`` (context and question joined by ``"\n\n"``) or ``"kvpress"`` (kvpress's
            pipeline layout: the question follows the context directly), see :mod:`kvtrim.prompts`
        separator: text between context and question, overriding the format's
        generation_config: a ``transformers.GenerationConfig`` (sampling settings, EOS, logits processors)
        do_sample, temperature, top_p, top_k: sampling settings overriding the configuration
        seed: seed of the sampler (same seed, same answers)
        stop: string(s) ending an answer; the answer is cut before the stop string
        kv_quant: hold the kept entries quantized: ``"int8"``, ``"int4"`` or ``"fp8"`` (KIVI's layout, see
            docs/quantization.md), a spec string (``"int4:group_size=32,rotate=0"``) or a ``KVQuant``; ``"int4"``
            means key groups of 64 tokens, its newest 32 to 63 entries and its first entry per head in the model's
            dtype and entries quantized in a rotated basis (``int4:group_size=64,residual=32,sink=1,rotate=1``;
            ``DEFAULT_*`` of :mod:`kvtrim.cache.quant`); None holds them all in the model's dtype
    Returns:
        :class:`Result` with ``answers`` and ``stats``. In question-aware mode with several questions, sizes
        are those of the first question's prompt and timings are summed.
    """
    check_supported(model)
    quant = resolve_kv_quant(kv_quant)
    pipeline, _ = resolve_method(method, ratio, budget, method_params, model)
    sampling = build_sampling(
        model, tokenizer, generation_config, max_new_tokens=max_new_tokens, do_sample=do_sample,
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop,
    )  # fmt: skip
    contexts, rows, batched = _normalize_inputs(context, questions)
    methods_ = [pipeline] if pipeline is not None else []
    layout = {"prompt_format": prompt_format, "separator": separator}
    if not question_aware:
        session = Session(
            model, tokenizer, context, None, methods_, answer_prefix, use_chat_template, prefill_chunk, **layout
        )
        return session.run(
            method, ratio, budget, questions, method_params=method_params, sampling=sampling, kv_quant=quant
        )
    results = []
    for qi in range(len(rows[0])):
        qs = [r[qi] for r in rows]
        question = qs if batched else qs[0]
        session = Session(
            model, tokenizer, context, question, methods_, answer_prefix, use_chat_template, prefill_chunk, **layout
        )
        # each question's prompt is decoded as a generate call of its own: the sampler restarts from the seed
        results.append(
            session.run(
                method, ratio, budget, None, method_params=method_params, sampling=sampling.fresh(), kv_quant=quant
            )
        )
    stats = results[0].stats
    for r in results[1:]:
        for name in (
            "prefill_s",
            "compress_s",
            "question_prefill_s",
            "decode_s",
            "decode_tokens",
            "decode_cpu_s",
            "compress_cpu_s",
        ):
            setattr(stats, name, getattr(stats, name) + getattr(r.stats, name))
    if batched:
        answers = [[r.answers[row][0] for r in results] for row in range(len(contexts))]
    else:
        answers = [r.answers[0] for r in results]
    return Result(answers=answers, stats=stats)


def check_length(model, tokens: int, what: str) -> None:
    """Raise :class:`InvalidParameterError` when ``tokens`` exceed the model's ``max_position_embeddings``."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and tokens > limit:
        raise InvalidParameterError(
            f"{what} is {tokens} tokens, longer than the model's max_position_embeddings={limit}; "
            f"shorten it to at most {limit} tokens"
        )


def _collect(
    outcome: Decoded, question_s: float, tokenizer, answers: list[list[str]], timings: dict, sampling: Sampling
) -> None:
    for row, toks in enumerate(outcome.tokens):
        answers[row].append(sampling.cut(tokenizer.decode(toks, skip_special_tokens=True)).strip())
    timings["qprefill"] += question_s
    timings["decode"] += outcome.seconds
    timings["decode_cpu"] += outcome.cpu_seconds
    timings["steps"] += outcome.steps


def make_cache(
    model,
    method: str = "snapkv",
    ratio: float | None = None,
    budget: int | None = None,
    kv_quant: str | None = None,
    **method_params,
) -> KVTrimCache:
    """A cache for ``model.generate(..., past_key_values=cache)`` that compresses the prompt after prefill
    (question-aware). Installs kvtrim attention on ``model`` (plain causal attention for other caches).
    One cache serves one ``generate`` call. ``kv_quant`` (``"int8"``/``"int4"``/``"fp8"``) holds its entries
    quantized."""
    quant = resolve_kv_quant(kv_quant)
    pipeline, spec = resolve_method(method, ratio, budget, method_params, model)
    enable(model)
    return KVTrimCache(model.config.num_hidden_layers, pipeline, spec, auto_compress=True, kv_quant=quant)


REUSED_CACHE = (
    "this KVTrimCache was already used by a generate call; a cache serves one generate call: make a new one "
    "(kvtrim.make_cache), or call model.generate without past_key_values inside kvtrim.compressing, which "
    "supplies a fresh cache to every call"
)


QUANTIZED_ELSEWHERE = (
    "kvtrim compresses its own cache, which holds quantized entries itself: pass kv_quant='int8', 'int4' or 'fp8' "
    "to kvtrim.compressing / kvtrim.generate (docs/quantization.md)"
)


def _refuse_other_cache_kinds(model, cache, kwargs: dict) -> None:
    """Inside :func:`compressing`, a transformers ``QuantizedCache`` (given, or asked for with
    ``cache_implementation``) would be used instead of kvtrim's cache and nothing would be compressed: refuse it,
    naming the supported way."""
    from transformers.cache_utils import QuantizedCache

    if isinstance(cache, QuantizedCache):
        layer = (getattr(cache, "layers", None) or [None])[0]
        settings = {name: getattr(layer, name, None) for name in ("nbits", "residual_length")}
        if type(layer).__name__.startswith("Fp8"):
            settings["backend"] = "fp8"
        raise InvalidParameterError(
            f"past_key_values is a transformers QuantizedCache; {QUANTIZED_ELSEWHERE}{_nearest_kv_quant(settings)}"
        )
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    asked = kwargs.get("cache_implementation")
    if asked is None and getattr(config, "cache_implementation", None) == "quantized":
        asked = "quantized"  # a model's own default (e.g. "hybrid") is replaced by kvtrim's cache as usual
    if asked is not None:
        cache_config = kwargs.get("cache_config") or getattr(config, "cache_config", None) or {}
        raise InvalidParameterError(
            f"cache_implementation={asked!r} asks transformers for its own cache instead of kvtrim's; "
            + (
                QUANTIZED_ELSEWHERE + _nearest_kv_quant(dict(cache_config))
                if asked == "quantized"
                else "leave it unset inside kvtrim.compressing"
            )
        )


def _nearest_kv_quant(settings: dict) -> str:
    """The ``kv_quant`` closest to a transformers quantized cache's settings (``backend``, ``nbits``,
    ``residual_length``), as a sentence to append to the refusal; empty when nothing is known.

    transformers' ``fp8`` backend scales each layer's tensor once, kvtrim's ``fp8`` per group; ``q_group_size``
    counts channels there and has no kvtrim counterpart (kvtrim's ``group_size`` counts tokens, KIVI's layout)."""
    if settings.get("backend") == "fp8":
        name = "fp8"
    elif settings.get("nbits") in (4, 8):
        name = f"int{settings['nbits']}"
    elif settings.get("nbits") is not None:
        return f"; kvtrim has no {settings['nbits']}-bit entries (int8, int4 or fp8)"
    else:
        return ""
    residual = settings.get("residual_length")
    known = isinstance(residual, int) and not isinstance(residual, bool) and residual >= 0
    spec = f"{name}:residual={residual}" if known and residual != DEFAULT_RESIDUAL[name] else name
    return f"; the nearest to this cache is kv_quant={spec!r}"


@contextmanager
def _supplying_cache(model, first: KVTrimCache, fresh) -> Iterator[None]:
    """Wrap ``model.generate`` (on the instance) so that a call without ``past_key_values`` gets a kvtrim cache:
    ``first`` for the first such call, then ``fresh()`` for every later one. The original is restored on exit."""
    own = model.__dict__.get("generate")  # an instance-level generate someone installed before us
    original = model.generate
    unused = [first]

    @functools.wraps(original)
    def generate(*args, **kwargs):
        cache = kwargs.get("past_key_values")
        _refuse_other_cache_kinds(model, cache, kwargs)
        if cache is None:
            kwargs["past_key_values"] = unused.pop() if unused else fresh()
        elif not isinstance(cache, KVTrimCache):
            raise InvalidParameterError(
                f"inside kvtrim.compressing, past_key_values must be None (kvtrim supplies a cache) or a "
                f"KVTrimCache; got a {type(cache).__name__}, which would not be compressed"
            )
        else:
            if cache.layers[0].seen:
                raise InvalidParameterError(REUSED_CACHE)
            if cache is first:
                unused.clear()
        return original(*args, **kwargs)

    model.generate = generate
    try:
        yield
    finally:
        if own is None:
            model.__dict__.pop("generate", None)
        else:
            model.generate = own


@contextmanager
def compressing(
    model,
    method: str = "snapkv",
    ratio: float | None = None,
    budget: int | None = None,
    kv_quant: str | None = None,
    **method_params,
) -> Iterator[KVTrimCache]:
    """Compress the prompt's KV cache in every ``model.generate`` call inside the block (question-aware).

    ``model.generate`` called without ``past_key_values`` gets a kvtrim cache: the yielded one for the first
    call, a fresh one for each later call (a cache serves one ``generate`` call). Passing the yielded cache
    explicitly works too. On exit the model's attention implementation and ``generate`` are restored.
    ``kv_quant`` (``"int8"``/``"int4"``/``"fp8"``) holds the caches' entries quantized (docs/quantization.md).

    Example::

        with kvtrim.compressing(model, "snapkv", ratio=0.5) as cache:
            out = model.generate(**inputs, max_new_tokens=32)
        print(cache.last_report)
    """
    quant = resolve_kv_quant(kv_quant)
    pipeline, spec = resolve_method(method, ratio, budget, method_params, model)
    layers = model.config.num_hidden_layers
    cache = KVTrimCache(layers, pipeline, spec, auto_compress=True, kv_quant=quant)
    fresh = lambda: KVTrimCache(layers, pipeline, spec, auto_compress=True, kv_quant=quant)  # noqa: E731
    with kvtrim_attention_enabled(model), _supplying_cache(model, cache, fresh):
        yield cache
