"""How the next token is chosen while answering: greedy or sampled, as ``model.generate`` would choose it.

The model's own ``generation_config`` is the starting point (as in ``model.generate``); a ``GenerationConfig``
and the keyword settings (``do_sample``, ``temperature``, ``top_p``, ``top_k``) override it. The logits
processors are the ones transformers builds for that configuration, and sampling draws with
``torch.multinomial`` as transformers does, so with the same seed and an uncompressed cache the tokens equal
``model.generate``'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from .errors import InvalidParameterError

DEFAULT_MAX_NEW_TOKENS = 64
# GenerationConfig settings that change the search itself (not just the next-token distribution); kvtrim decodes
# one sequence per prompt, so these must stay at their defaults.
_UNSUPPORTED = {"num_beams": 1, "num_return_sequences": 1, "num_beam_groups": 1, "penalty_alpha": None}


@dataclass
class Sampling:
    """A resolved decoding strategy (build it with :func:`build_sampling`).

    ``processors`` maps ``(input_ids [batch, n], scores [batch, vocab])`` to new scores, in transformers'
    order; ``stop`` strings end an answer (the answer is cut before the stop string).
    """

    do_sample: bool
    processors: object  # transformers.LogitsProcessorList
    eos: tuple[int, ...]
    pad: int
    max_new_tokens: int
    seed: int | None = None
    stop: tuple[str, ...] = ()
    _generator: torch.Generator | None = field(default=None, repr=False)

    def eos_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.eos if self.eos else [-1], dtype=torch.long, device=device)

    def pick(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Next tokens ``[batch]`` from the last position's ``logits`` ``[batch, vocab]`` after ``input_ids``
        ``[batch, n]`` (prompt and answer so far)."""
        scores = logits.to(dtype=torch.float32)
        if len(self.processors):
            scores = self.processors(input_ids, scores.clone())
        if not self.do_sample:
            return scores.argmax(-1)
        if self.seed is not None and self._generator is None:
            self._generator = torch.Generator(device=scores.device).manual_seed(self.seed)
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1, generator=self._generator).squeeze(1)

    def fresh(self) -> Sampling:
        """The same strategy with its sampler restarted from the seed (for an independent generation)."""
        return replace(self, _generator=None)

    def cut(self, text: str) -> str:
        """``text`` up to the first stop string (all of it when none occurs)."""
        ends = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return text[: min(ends)] if ends else text

    def stopped(self, text: str) -> bool:
        return any(s in text for s in self.stop)


def eos_ids(model, tokenizer, generation_config=None) -> set[int]:
    """End-of-sequence token ids: those of ``generation_config`` (default: the model's) and the tokenizer's
    (chat models end their turns with the tokenizer's EOS)."""
    config = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    ids: set[int] = set()
    for source in (config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            ids.update([value] if isinstance(value, int) else list(value))
    return ids


def _check_number(name: str, value, low: float, high: float, low_open: bool, high_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        raise InvalidParameterError(f"{name} must be a number in {lo}{low}, {high}{hi}, got {value!r}")


def _stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or any(not isinstance(s, str) or not s for s in items):
        raise InvalidParameterError(f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}")
    return tuple(items)


def build_sampling(
    model,
    tokenizer,
    generation_config=None,
    *,
    max_new_tokens: int | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
) -> Sampling:
    """Resolve the decoding strategy as ``model.generate`` resolves it, and validate every setting.

    Args:
        generation_config: a ``transformers.GenerationConfig`` overriding the model's (None: the model's)
        max_new_tokens: tokens per answer (None: ``generation_config.max_new_tokens`` when given, else 64)
        do_sample, temperature, top_p, top_k: override the configuration (None leaves it as it is)
        seed: seeds the sampler's own generator (same seed, same tokens); None draws from torch's global RNG
        stop: a string or strings that end an answer (cut before the stop string)
    """
    from transformers import GenerationConfig

    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise InvalidParameterError(
            f"generation_config must be a transformers.GenerationConfig, got {type(generation_config).__name__}"
        )
    if max_new_tokens is None:
        max_new_tokens = getattr(generation_config, "max_new_tokens", None) or DEFAULT_MAX_NEW_TOKENS
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise InvalidParameterError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise InvalidParameterError(f"do_sample must be True or False, got {do_sample!r}")
    if temperature is not None:
        _check_number("temperature", temperature, 0.0, math.inf, low_open=True, high_open=True)
    if top_p is not None:
        _check_number("top_p", top_p, 0.0, 1.0, low_open=True)
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise InvalidParameterError(f"top_k must be a non-negative integer (0 disables it), got {top_k!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise InvalidParameterError(f"seed must be a non-negative integer, got {seed!r}")
    stops = _stop_strings(stop)
    overrides = {
        k: v
        for k, v in {"do_sample": do_sample, "temperature": temperature, "top_p": top_p, "top_k": top_k}.items()
        if v is not None
    }
    # transformers' own resolution: the model's generation config, then the given config, then the overrides
    config, _ = model._prepare_generation_config(generation_config, **overrides)
    for name, default in _UNSUPPORTED.items():
        if getattr(config, name, default) not in (default, None):
            raise InvalidParameterError(
                f"{name}={getattr(config, name)!r} is not supported: kvtrim decodes one sequence per prompt "
                f"(greedy or sampling); leave {name} at {default!r}"
            )
    device = next(model.parameters()).device
    processors = model._get_logits_processor(config, device=device, model_kwargs={})
    eos = eos_ids(model, tokenizer, config)
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = config.pad_token_id
    if pad is None:
        pad = min(eos) if eos else 0
    return Sampling(
        do_sample=bool(config.do_sample),
        processors=processors,
        eos=tuple(sorted(eos)),
        pad=int(pad),
        max_new_tokens=max_new_tokens,
        seed=seed,
        stop=stops,
    )
