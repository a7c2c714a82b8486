"""RULER synthetic tasks (NIAH family, vt, cwe, fwe), generated offline to a target length in tokens.

The templates, answer prefixes, generation lengths and metrics are RULER's (``scripts/data/synthetic``
and ``constants.py``). Documented differences:

* The ``essay`` haystack (Paul Graham essays) is replaced by a configurable prose haystack, ``"jargon"``
  by default (see :mod:`kvtrim.eval.haystacks`); sentences are split with a regex instead of NLTK punkt.
  If the prose is shorter than needed it is repeated (RULER caps the haystack instead).
* Length fitting searches the haystack size directly (see :func:`~kvtrim.eval.tasks.base.fit_units`)
  instead of growing it in fixed increments, so each sample lands just under the target: the prompt
  (``context + question + answer_prefix``, no special tokens, no chat template) plus ``max_new_tokens``
  is at most ``length``. RULER's fwe fits the prompt alone to ``max_seq_length``; here fwe also
  reserves its 50 generated tokens.
* Randomness is per sample (``random.Random`` keyed by task, seed and index), so sample ``i`` does not
  depend on how many samples are requested. "Shuffled with a fixed seed" steps use
  ``random.Random(seed)`` as in RULER.
* NIAH keys are ``adjective-noun`` pairs drawn uniformly (adjective and noun independently, from the
  deduplicated wonderwords lists) rather than by indexing the 6-million-entry sorted product list; keys
  and values within a sample, and distractor keys, are kept distinct. Empty sentence chunks next to a
  needle are not joined (RULER leaves a double space there).
"""

from __future__ import annotations

import bisect
import functools
import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtrim.errors import InvalidParameterError
from kvtrim.eval.haystacks import NOISE_BLOCK, SENTENCE_SPLITTER, get_haystack, split_sentences
from kvtrim.eval.tasks.base import (
    BuiltPrompt,
    Sample,
    TokenCounter,
    check_common_args,
    fit_units,
    fitted_samples,
    sample_rng,
    split_at_last,
)

__all__ = [
    "CWE_ANSWER_PREFIX",
    "CWE_TEMPLATE",
    "FWE_ANSWER_PREFIX",
    "FWE_TEMPLATE",
    "NIAH_ANSWER_PREFIX",
    "NIAH_CONFIGS",
    "NIAH_NEEDLE",
    "NIAH_TEMPLATE",
    "QUESTION_PATTERNS",
    "RULER_MAX_NEW_TOKENS",
    "VT_ANSWER_PREFIX",
    "VT_TEMPLATE",
    "NiahConfig",
    "generate_cwe",
    "generate_fwe",
    "generate_niah",
    "generate_vt",
]

# ---- RULER constants (templates are data and must match RULER exactly) ---------------------------

NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
    "{type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."

VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
    "assgined the value {query}, they are: "
)

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
    "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"

FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most "
    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
    "the dots '....'. What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

QUESTION_PATTERNS: dict[str, re.Pattern[str]] = {
    "niah": re.compile(r"What (?:is|are all) the special magic"),
    "vt": re.compile(r"Question: Find all variables that are assigned the value"),
    "cwe": re.compile(r"Question: What are the 10 most common words in the above list\?"),
    "fwe": re.compile(r"Question: Do not provide any explanation\."),
    "qa": re.compile(r"Answer the question based on the given documents\."),
}
"""kvpress's context/question split points; the prompt is cut at the LAST match."""

RULER_MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}

NIAH_DEPTHS = [round(100 * i / 39) for i in range(40)]  # round(linspace(0, 100, 40))


def ruler_samples(
    kind: str,
    task: str,
    tokenizer: Any,
    length: int,
    num_samples: int,
    seed: int,
    build: Callable[[int, int], BuiltPrompt],
    *,
    metric: str = "string_match_all",
    **fit: Any,
) -> list[Sample]:
    """:func:`~kvtrim.eval.tasks.base.fitted_samples` with RULER's generation length for ``kind`` (a key of
    :data:`RULER_MAX_NEW_TOKENS`); ``fit``: its ``low``, ``high``, ``unit``, ``haystack`` and ``extra_meta``."""
    return fitted_samples(
        task=task,
        tokenizer=tokenizer,
        length=length,
        num_samples=num_samples,
        seed=seed,
        metric=metric,
        max_new_tokens=RULER_MAX_NEW_TOKENS[kind],
        build=build,
        **fit,
    )


@dataclass(frozen=True)
class NiahConfig:
    """One NIAH variant: haystack kind, key/value types and the number of keys, values and queries."""

    haystack: str  # "repeat", "essay" or "needle"
    type_k: str  # "words", "numbers" or "uuids"
    type_v: str
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1


NIAH_CONFIGS: dict[str, NiahConfig] = {
    "niah_single_1": NiahConfig("repeat", "words", "numbers"),
    "niah_single_2": NiahConfig("essay", "words", "numbers"),
    "niah_single_3": NiahConfig("essay", "words", "uuids"),
    "niah_multikey_1": NiahConfig("essay", "words", "numbers", num_k=4),
    "niah_multikey_2": NiahConfig("needle", "words", "numbers"),
    "niah_multikey_3": NiahConfig("needle", "uuids", "uuids"),
    "niah_multivalue": NiahConfig("essay", "words", "numbers", num_v=4),
    "niah_multiquery": NiahConfig("essay", "words", "numbers", num_k=4, num_q=4),
}


# ---- word lists -----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _wonderwords() -> dict[str, list[str]]:
    try:
        from wonderwords import random_word
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("RULER tasks need the `wonderwords` package: pip install 'kvtrim[eval]'") from exc
    return {kind: random_word._get_words_from_text_file(f"{kind}list.txt") for kind in ("noun", "adjective", "verb")}


@functools.lru_cache(maxsize=1)
def _key_words() -> tuple[list[str], list[str]]:
    words = _wonderwords()
    return sorted(set(words["adjective"])), sorted(set(words["noun"]))


@functools.lru_cache(maxsize=8)
def _cwe_words(seed: int) -> list[str]:
    words = _wonderwords()
    vocabulary = sorted(set(words["noun"] + words["adjective"] + words["verb"]))
    _fixed(seed).shuffle(vocabulary)
    return vocabulary


def _fixed(seed: int) -> random.Random:
    """RULER's ``random.Random(args.random_seed)`` used for 'shuffled with a fixed seed' steps."""
    return random.Random(seed)


# ---- NIAH -------------------------------------------------------------------------------------------


def _random_value(kind: str, rng: Any) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        adjectives, nouns = _key_words()
        return f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise InvalidParameterError(f"needle type {kind!r}: expected 'numbers', 'words' or 'uuids'.")


def _distinct_values(kind: str, count: int, rng: Any, exclude: set[str] | None = None) -> list[str]:
    seen = set(exclude or ())
    values: list[str] = []
    while len(values) < count:
        value = _random_value(kind, rng)
        if value not in seen:
            seen.add(value)
            values.append(value)
    return values


class _ProseSentences:
    """Sentences of a prose haystack with cumulative word counts, to take 'the first n words' quickly."""

    def __init__(self, text: str) -> None:
        self.sentences = split_sentences(text)
        if not self.sentences:
            raise InvalidParameterError("haystack: the text contains no sentences.")
        self.cumulative = list(_accumulate(len(s.split()) for s in self.sentences))
        self.total_words = self.cumulative[-1]

    def first_words(self, n: int) -> list[str]:
        """Sentences covering the first ``n`` words (the last one cut), repeating the text if needed."""
        out: list[str] = []
        remaining = n
        while remaining >= self.total_words:
            out.extend(self.sentences)
            remaining -= self.total_words
        if remaining:
            k = bisect.bisect_right(self.cumulative, remaining)
            out.extend(self.sentences[:k])
            done = self.cumulative[k - 1] if k else 0
            if remaining > done:
                out.append(" ".join(self.sentences[k].split()[: remaining - done]))
        return out


def _accumulate(values: Any) -> Any:
    total = 0
    for value in values:
        total += value
        yield total


@functools.lru_cache(maxsize=4)
def _prose(haystack: str, text_hash: int) -> _ProseSentences:
    return _ProseSentences(get_haystack(haystack))


def _prose_for(haystack: str) -> _ProseSentences:
    text = get_haystack(haystack)
    return _prose(haystack, hash(text))


def _singular(template: str) -> str:
    return template.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")


def generate_niah(
    task: str,
    tokenizer: Any,
    length: int,
    num_samples: int,
    seed: int = 42,
    haystack: str | None = None,
) -> list[Sample]:
    """Generate a RULER NIAH task (``niah_single_1`` ... ``niah_multiquery``).

    ``haystack`` applies to the tasks that use RULER's ``essay`` haystack (default ``"jargon"``); the
    ``repeat`` and ``needle`` tasks ignore it and record their own haystack in ``meta``.
    """
    if task not in NIAH_CONFIGS:
        raise InvalidParameterError(f"task={task!r}: expected one of {sorted(NIAH_CONFIGS)}.")
    check_common_args(task, length, num_samples, seed)
    cfg = NIAH_CONFIGS[task]
    num_k = max(cfg.num_k, cfg.num_q)
    singular = cfg.num_q * cfg.num_v == 1
    template = _singular(NIAH_TEMPLATE) if singular else NIAH_TEMPLATE
    answer_prefix_t = _singular(NIAH_ANSWER_PREFIX) if singular else NIAH_ANSWER_PREFIX
    type_v_prompt = cfg.type_v[:-1] if singular else cfg.type_v

    if cfg.haystack == "essay":
        haystack_name = haystack or "jargon"
        prose = _prose_for(haystack_name)
        unit, low, high = "words", 1, max(prose.total_words, 1) * 64
    elif cfg.haystack == "repeat":
        haystack_name, prose, unit, low, high = "noise", None, "noise lines", num_k * cfg.num_v, 10**7
    else:
        haystack_name, prose, unit, low, high = "needles", None, "distractor needles", num_k * cfg.num_v, 10**7

    def build(index: int, n: int) -> BuiltPrompt:
        rng = sample_rng(task, seed, index)
        keys = _distinct_values(cfg.type_k, num_k, rng)
        values = [_distinct_values(cfg.type_v, cfg.num_v, rng) for _ in keys]
        needles = [
            NIAH_NEEDLE.format(type_needle_v=cfg.type_v, key=key, value=value)
            for key, vals in zip(keys, values, strict=True)
            for value in vals
        ]
        _fixed(seed).shuffle(needles)
        query_idx = rng.sample(range(num_k), cfg.num_q)
        queries = [keys[i] for i in query_idx]
        answers = [value for i in query_idx for value in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]

        meta: dict[str, Any] = {"keys": keys, "queries": queries}
        if cfg.haystack == "essay":
            assert prose is not None
            sentences = prose.first_words(n)
            depths = rng.sample(NIAH_DEPTHS, len(needles))
            cuts = [0, *sorted(int(len(sentences) * d / 100) for d in depths), len(sentences)]
            pieces: list[str] = []
            for i in range(1, len(cuts)):
                chunk = " ".join(sentences[cuts[i - 1] : cuts[i]])
                if chunk:
                    pieces.append(chunk)
                if i - 1 < len(needles):
                    pieces.append(needles[i - 1])
            body = " ".join(pieces)
            meta["needle_depths"] = sorted(depths)
        else:
            if cfg.haystack == "repeat":
                lines = [NOISE_BLOCK] * n
            else:
                distractor_keys = _distinct_values(cfg.type_k, n, rng, exclude=set(keys))
                lines = [
                    NIAH_NEEDLE.format(type_needle_v=cfg.type_v, key=key, value=_random_value(cfg.type_v, rng))
                    for key in distractor_keys
                ]
            positions = sorted(rng.sample(range(n), len(needles)), reverse=True)
            for position, needle in zip(positions, needles, strict=True):
                lines.insert(position, needle)
            body = "\n".join(lines)
            meta["needle_line_positions"] = sorted(positions)

        prompt = template.format(type_needle_v=type_v_prompt, context=body, query=query)
        context, question = split_at_last(prompt, QUESTION_PATTERNS["niah"])
        answer_prefix = answer_prefix_t.format(type_needle_v=type_v_prompt, query=query)
        return BuiltPrompt(context, question, answer_prefix, answers, meta, needles)

    extra = {"sentence_splitter": SENTENCE_SPLITTER} if cfg.haystack == "essay" else {}
    return ruler_samples("niah", task, tokenizer, length, num_samples, seed, build, low=low, high=high, unit=unit,
                         haystack=haystack_name, extra_meta=extra)  # fmt: skip


# ---- vt ---------------------------------------------------------------------------------------------

_VT_NOISE_LINE = NOISE_BLOCK + "\n"
_VT_NUM_HOPS = 4
_VT_NUM_CHAINS = 1
_VT_DEMO_LENGTH = 500


def _vt_chain(rng: Any, letters: int, exclude_value: int | None = None) -> tuple[list[str], list[str], str]:
    names: list[str] = []
    while len(names) < _VT_NUM_HOPS + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    value = rng.randrange(10000, 99999)
    while value == exclude_value:
        value = rng.randrange(10000, 99999)
    chain = [f"VAR {names[0]} = {value}"]
    chain += [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(_VT_NUM_HOPS)]
    return names, chain, str(value)


def _vt_body(rng: Any, chain: list[str], n: int) -> tuple[str, list[int]]:
    lines = [_VT_NOISE_LINE] * n
    positions = sorted(rng.sample(range(n), len(chain)))
    for j, (position, statement) in enumerate(zip(positions, chain, strict=True)):
        lines.insert(position + j, statement)
    return " ".join(lines).replace(". \n", ".\n"), positions


def _vt_demo(tokenizer: Any, seed: int) -> tuple[str, str, int]:
    """RULER's one-shot vt example: 3-letter names, fitted to 500 tokens, template whitespace-collapsed
    with its last word dropped (RULER's cut meant for a chat-template suffix), followed by its answers."""
    counter = TokenCounter(tokenizer)
    words = VT_TEMPLATE.split()[:-1]
    demo_template = " ".join(words) + VT_ANSWER_PREFIX

    def build(n: int) -> tuple[str, list[str], str]:
        rng = sample_rng("vt-demo", seed, 0)
        names, chain, value = _vt_chain(rng, letters=3)
        body, _ = _vt_body(rng, chain, n)
        return demo_template.format(context=body, query=value, num_v=_VT_NUM_HOPS + 1), names, value

    budget = _VT_DEMO_LENGTH - RULER_MAX_NEW_TOKENS["vt"]
    try:
        result = fit_units(build, lambda b: counter.count(b[0]), budget, _VT_NUM_HOPS + 1, 10**5, what="vt demo")
        demo_input, names, demo_value = result.value
    except InvalidParameterError:  # a tokenizer too verbose for 500 tokens: use the minimal demo
        demo_input, names, demo_value = build(_VT_NUM_HOPS + 1)
    example = demo_input + " " + " ".join(names) + "\n\n"
    return " " + example + "\n\n", demo_value, counter.count(example)


def generate_vt(
    task: str,
    tokenizer: Any,
    length: int,
    num_samples: int,
    seed: int = 42,
    haystack: str | None = None,
) -> list[Sample]:
    """Generate RULER variable tracking (``vt``): one chain of 4 hops hidden among noise lines."""
    check_common_args(task, length, num_samples, seed)
    demo_block, demo_value, demo_tokens = _vt_demo(tokenizer, seed)

    def build(index: int, n: int) -> BuiltPrompt:
        rng = sample_rng(task, seed, index)
        names, chain, value = _vt_chain(rng, letters=5, exclude_value=int(demo_value))
        body, positions = _vt_body(rng, chain, n)
        prompt = demo_block + VT_TEMPLATE.format(context=body, query=value)
        context, question = split_at_last(prompt, QUESTION_PATTERNS["vt"])
        answer_prefix = VT_ANSWER_PREFIX.format(num_v=_VT_NUM_HOPS + 1, query=value)
        return BuiltPrompt(
            context,
            question,
            answer_prefix,
            names,
            {"query_value": value, "chain_line_positions": positions},
            needles=[statement.strip() for statement in chain],
        )

    extra = {"demo_tokens": demo_tokens, "num_chains": _VT_NUM_CHAINS, "num_hops": _VT_NUM_HOPS}
    return ruler_samples("vt", task, tokenizer, length, num_samples, seed, build, low=_VT_NUM_HOPS + 1, high=10**7,
                         unit="noise lines", haystack="noise", extra_meta=extra)  # fmt: skip


# ---- cwe --------------------------------------------------------------------------------------------

_CWE_NUM_CW = 10


def _cwe_list(rng: Any, seed: int, num_words: int, common: int, uncommon: int) -> tuple[str, list[str]]:
    chosen = rng.sample(_cwe_words(seed), num_words)
    common_words, uncommon_words = chosen[:_CWE_NUM_CW], chosen[_CWE_NUM_CW:]
    word_list = common_words * common + uncommon_words * uncommon
    _fixed(seed).shuffle(word_list)
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(word_list)), common_words


def generate_cwe(
    task: str,
    tokenizer: Any,
    length: int,
    num_samples: int,
    seed: int = 42,
    haystack: str | None = None,
) -> list[Sample]:
    """Generate RULER common words extraction (``cwe``) with its in-context demo.

    For ``length < 4096`` RULER uses a 20-word demo (3x/1x) and 6x/1x repetitions; otherwise a 40-word
    demo (10x/3x) and 30x/3x.
    """
    check_common_args(task, length, num_samples, seed)
    small = length < 4096
    demo_args = (20, 3, 1) if small else (40, 10, 3)
    real_reps = (6, 1) if small else (30, 3)
    template = CWE_TEMPLATE + CWE_ANSWER_PREFIX

    def build(index: int, n: int) -> BuiltPrompt:
        rng = sample_rng(task, seed, index)
        demo_context, demo_answers = _cwe_list(rng, seed, *demo_args)
        context_list, answers = _cwe_list(rng, seed, n, *real_reps)
        demo = template.format(context=demo_context) + " ".join(
            f"{i + 1}. {word}" for i, word in enumerate(demo_answers)
        )
        prompt = demo + "\n" + CWE_TEMPLATE.format(context=context_list)
        context, question = split_at_last(prompt, QUESTION_PATTERNS["cwe"])
        return BuiltPrompt(context, question, CWE_ANSWER_PREFIX, answers, {"num_words": n})

    extra = {"freq_cw": real_reps[0], "freq_ucw": real_reps[1], "num_cw": _CWE_NUM_CW}
    return ruler_samples("cwe", task, tokenizer, length, num_samples, seed, build, low=_CWE_NUM_CW + 1,
                         high=len(_cwe_words(seed)), unit="distinct words", haystack="wonderwords",
                         extra_meta=extra)  # fmt: skip


# ---- fwe --------------------------------------------------------------------------------------------

_FWE_ALPHA = 2.0
_FWE_WORD_LEN = 6
_FWE_MIN_WORDS = 100  # below this the 3rd and 4th most frequent words can tie


def _zeta(s: float) -> float:
    """Riemann zeta for s > 1 (Euler-Maclaurin to the B4 term, relative error ~1e-16 for s >= 1.5);
    replaces ``scipy.special.zeta``."""
    n = 100
    head = sum(k**-s for k in range(1, n))
    tail = n ** (1 - s) / (s - 1) + 0.5 * n**-s + s * n ** (-s - 1) / 12
    return head + tail - s * (s + 1) * (s + 2) * n ** (-s - 3) / 720


def generate_fwe(
    task: str,
    tokenizer: Any,
    length: int,
    num_samples: int,
    seed: int = 42,
    haystack: str | None = None,
) -> list[Sample]:
    """Generate RULER frequent words extraction (``fwe``): Zipf(2) coded words, top-3 excluding '...'."""
    check_common_args(task, length, num_samples, seed)
    vocab_size = max(length // 50, 5)
    zeta = _zeta(_FWE_ALPHA)

    def build(index: int, n: int) -> BuiltPrompt:
        rng = sample_rng(task, seed, index)
        vocab_set: set[str] = set()
        while len(vocab_set) < vocab_size:
            vocab_set.add("".join(rng.choices(string.ascii_lowercase, k=_FWE_WORD_LEN)))
        vocab = sorted(vocab_set)
        _fixed(seed).shuffle(vocab)
        vocab[0] = "..."  # the top-ranked "word" is noise
        counts = [int(n * (k**-_FWE_ALPHA) / zeta) for k in range(1, len(vocab) + 1)]
        words = [word for word, c in zip(vocab, counts, strict=True) for _ in range(c)]
        _fixed(seed).shuffle(words)
        prompt = FWE_TEMPLATE.format(context=" ".join(words))
        context, question = split_at_last(prompt, QUESTION_PATTERNS["fwe"])
        return BuiltPrompt(context, question, FWE_ANSWER_PREFIX, vocab[1:4], {"num_words": n})

    return ruler_samples("fwe", task, tokenizer, length, num_samples, seed, build, low=_FWE_MIN_WORDS,
                         high=max(64 * length, _FWE_MIN_WORDS), unit="sampled words", haystack="coded words",
                         extra_meta={"alpha": _FWE_ALPHA, "vocab_size": vocab_size})  # fmt: skip
