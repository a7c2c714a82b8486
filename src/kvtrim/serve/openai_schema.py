"""Validation of OpenAI-style request bodies (``/v1/completions``, ``/v1/chat/completions``).

Bodies are checked field by field so that every error names the offending parameter and what is allowed, and is
reported as an OpenAI error body (HTTP 400) by :mod:`kvtrim.serve.http`. Unknown fields are ignored; known
OpenAI parameters that kvtrim does not implement are accepted only with their neutral value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .request_error import RequestError
from .types import SamplingParams

if TYPE_CHECKING:
    from .limits import ServerLimits

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_SEED = 2**63 - 1
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Temperatures below this are greedy (as in vLLM): dividing logits by 1e-300 overflows to inf and NaN probabilities.
GREEDY_BELOW_TEMPERATURE = 1e-5
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Sampling:
    """Validated decoding parameters; ``max_tokens`` None means the endpoint's default."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def params(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=0.0 if self.temperature < GREEDY_BELOW_TEMPERATURE else self.temperature,
            top_p=self.top_p,
            stop=self.stop,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        )


@dataclass(frozen=True)
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]
    sampling: Sampling
    stream: bool
    include_usage: bool


@dataclass(frozen=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, str]]
    sampling: Sampling
    stream: bool
    include_usage: bool


# ------------------------------------------------------------------------------------------------ field checks
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _optional_int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    upper = f" and <= {hi}" if hi is not None else ""
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        raise RequestError(f"{name} must be an integer >= {lo}{upper}, got {value!r}", name)
    return value


def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    low_ok = _is_number(value) and (value > lo if lo_open else value >= lo)
    if not low_ok or value > hi:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise RequestError(f"{name} must be a number in {interval}, got {value!r}", name)
    return float(value)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a boolean, got {value!r}", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if (
        not isinstance(items, list)
        or not 1 <= len(items) <= MAX_STOP
        or any(not isinstance(s, str) or not s for s in items)
    ):
        raise RequestError(
            f"stop must be a non-empty string or a list of 1 to {MAX_STOP} non-empty strings, got {value!r}", "stop"
        )
    return tuple(items)


def _model(body: dict) -> str | None:
    value = body.get("model")
    if value is not None and not isinstance(value, str):
        raise RequestError(f"model must be a string, got {value!r}", "model")
    return value


def _include_usage(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None or not stream:
        return False
    if not isinstance(options, dict):
        raise RequestError(f"stream_options must be an object, got {options!r}", "stream_options")
    return _bool(options, "include_usage") if "include_usage" in options else False


def _reject_unsupported(body: dict, neutral: dict[str, tuple]) -> None:
    """Known OpenAI parameters kvtrim does not implement: accept only their neutral values."""
    for name, allowed in neutral.items():
        if name in body and body[name] not in allowed:
            shown = " or ".join(repr(a) for a in allowed if a is not None) or "null"
            raise RequestError(
                f"{name} is not supported by this server (only {shown} or omitted), got {body[name]!r}", name
            )


def _max_tokens(body: dict, name: str, limits: ServerLimits | None) -> int | None:
    value = _optional_int(body, name, 1)
    if value is not None and limits is not None and value > limits.max_tokens:
        raise RequestError(
            f"{name} is {value}, more than this server's limit of {limits.max_tokens} (--max-tokens)",
            name,
            code="max_tokens_exceeded",
        )
    return value


def _sampling(body: dict, max_tokens: int | None) -> Sampling:
    n = _optional_int(body, "n", 1)
    if n is not None and n != 1:
        raise RequestError(f"n must be 1 (one choice per prompt is supported), got {n}", "n")
    return Sampling(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        stop=_stop(body),
        seed=_optional_int(body, "seed", 0, MAX_SEED),
        ignore_eos=_bool(body, "ignore_eos"),
    )


_COMMON_NEUTRAL = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
}


# --------------------------------------------------------------------------------------------------- requests
def _prompts(value: Any, vocab_size: int | None, limits: ServerLimits | None) -> list[str | list[int]]:
    def ids(tokens: list) -> list[int]:
        if not tokens:
            raise RequestError("prompt must not be an empty list of token ids", "prompt")
        for t in tokens:
            if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
                limit = f", < {vocab_size}" if vocab_size is not None else ""
                raise RequestError(f"prompt token ids must be integers >= 0{limit}, got {t!r}", "prompt")
        return list(tokens)

    if isinstance(value, str):
        prompts: list = [value]
    elif isinstance(value, list) and value and all(_is_int(t) for t in value):
        prompts = [ids(value)]
    elif isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        prompts = [p if isinstance(p, str) else ids(p) for p in value]
    else:
        raise RequestError(
            "prompt must be a string, a list of token ids, or a non-empty list of strings or of token-id lists, "
            f"got {value!r:.80}",
            "prompt",
        )
    if any(isinstance(p, str) and not p for p in prompts):
        raise RequestError("prompt must not be empty", "prompt")
    if limits is not None:
        if len(prompts) > limits.max_prompts_per_request:
            raise RequestError(
                f"the request has {len(prompts)} prompts, more than this server's limit of "
                f"{limits.max_prompts_per_request} (--max-prompts-per-request)",
                "prompt",
                code="too_many_prompts",
            )
        longest = max(prompts, key=len)
        if len(longest) > limits.max_prompt_chars:
            unit = "characters" if isinstance(longest, str) else "token ids"
            raise RequestError(
                f"a prompt has {len(longest)} {unit}, more than this server's limit of {limits.max_prompt_chars} "
                "(--max-prompt-chars)",
                "prompt",
                code="prompt_too_long",
            )
    return prompts


def parse_completion(body: Any, vocab_size: int | None = None, limits: ServerLimits | None = None) -> CompletionRequest:
    """Validate a ``/v1/completions`` body (``limits``: the server's caps, None for none)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    if "prompt" not in body:
        raise RequestError("prompt is required", "prompt")
    _reject_unsupported(
        body,
        {**_COMMON_NEUTRAL, "echo": (None, False), "logprobs": (None,), "best_of": (None, 1), "suffix": (None, "")},
    )
    stream = _bool(body, "stream")
    return CompletionRequest(
        model=_model(body),
        prompts=_prompts(body["prompt"], vocab_size, limits),
        sampling=_sampling(body, _max_tokens(body, "max_tokens", limits)),
        stream=stream,
        include_usage=_include_usage(body, stream),
    )


def _message(index: int, message: Any) -> dict[str, str]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be an object with role and content, got {message!r:.80}", "messages")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise RequestError(f"{where}.role must be one of {list(CHAT_ROLES)}, got {role!r}", "messages")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text is supported
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.content parts must be {{'type': 'text', 'text': str}}", "messages")
            texts.append(part["text"])
        content = "".join(texts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string or a list of text parts, got {content!r:.80}", "messages")
    return {"role": "system" if role == "developer" else role, "content": content}


def parse_chat(body: Any, limits: ServerLimits | None = None) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body (``limits``: the server's caps, None for none)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
    _reject_unsupported(
        body,
        {
            **_COMMON_NEUTRAL,
            "logprobs": (None, False),
            "top_logprobs": (None, 0),
            "tools": (None, []),
            "functions": (None, []),
            "tool_choice": (None, "none"),
            "response_format": (None, {"type": "text"}),
        },
    )
    max_tokens = _max_tokens(body, "max_tokens", limits)
    max_completion = _max_tokens(body, "max_completion_tokens", limits)
    stream = _bool(body, "stream")
    parsed = [_message(i, m) for i, m in enumerate(messages)]
    chars = sum(len(m["content"]) for m in parsed)
    if limits is not None and chars > limits.max_prompt_chars:
        raise RequestError(
            f"the messages hold {chars} characters, more than this server's limit of {limits.max_prompt_chars} "
            "(--max-prompt-chars)",
            "messages",
            code="prompt_too_long",
        )
    return ChatRequest(
        model=_model(body),
        messages=parsed,
        sampling=_sampling(body, max_completion if max_completion is not None else max_tokens),
        stream=stream,
        include_usage=_include_usage(body, stream),
    )
