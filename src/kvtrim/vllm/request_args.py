"""Per-request settings a client passes in ``SamplingParams.extra_args`` (the OpenAI server's ``vllm_xargs``).

``kvtrim_context_tokens``: the first ``N`` prompt tokens are the context; the plugin compresses them once they are
prefilled (vLLM's scheduler ends a prefill chunk at token ``N``), scoring the context alone, and keeps the rest of
the prompt (the question, the chat template's closing tokens) whole. This is the context-only (query-agnostic)
setting of kvpress and the CriticalKV paper, served: the same compressed context could answer any question. It is
taken by the methods that compress once after the prompt (uniform, PyramidKV and the per-head methods); with
rounds (``between_chunks``, ``method@every:N``, LagKV's recursion) a request giving it is refused. The keys are
flat (``kvtrim_`` prefix) because the server's ``vllm_xargs`` holds only numbers, strings and lists.

Scheduler and workers read the same request fields, so both sides put the compression at the same token. A
request's settings are checked where vLLM checks its sampling parameters (``InputProcessor.process_inputs``, in
the process that takes requests: the OpenAI server answers 400), and again when the scheduler adds the request.
"""

from __future__ import annotations

import functools
from typing import Any

from ..errors import InvalidParameterError

PREFIX = "kvtrim_"
CONTEXT_TOKENS = "kvtrim_context_tokens"
KNOWN = frozenset({CONTEXT_TOKENS})


def request_settings(extra_args: dict[str, Any] | None) -> dict[str, Any]:
    """The ``kvtrim_*`` entries of ``extra_args`` (``{}`` when none); raises on a ``kvtrim_`` key it does not
    know (a misspelt setting must not pass silently)."""
    if not extra_args:
        return {}
    settings = {k: v for k, v in extra_args.items() if isinstance(k, str) and k.startswith(PREFIX)}
    unknown = sorted(set(settings) - KNOWN)
    if unknown:
        raise InvalidParameterError(f"extra_args has unknown kvtrim settings {unknown}; known: {sorted(KNOWN)}")
    return settings


def context_end(extra_args: dict[str, Any] | None, prompt_len: int) -> int:
    """The token after which the plugin compresses a ``prompt_len``-token prompt: ``kvtrim_context_tokens`` when
    the request gives it, else ``prompt_len`` (the whole prompt)."""
    return _context_end(request_settings(extra_args), prompt_len)


def _context_end(settings: dict[str, Any], prompt_len: int) -> int:
    n = settings.get(CONTEXT_TOKENS)
    if n is None:
        return prompt_len
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= prompt_len:
        raise InvalidParameterError(
            f"extra_args[{CONTEXT_TOKENS!r}] must be an integer in [1, prompt tokens = {prompt_len}], got {n!r}"
        )
    return n


def check_request(extra_args: dict[str, Any] | None, prompt_len: int, rounds: bool) -> int:
    """Validate a request's settings when it arrives; returns its :func:`context_end`. ``rounds``: the
    configuration compresses more than once, which ``kvtrim_context_tokens`` does not take."""
    settings = request_settings(extra_args)
    end = _context_end(settings, prompt_len)
    if rounds and settings.get(CONTEXT_TOKENS) is not None:
        raise InvalidParameterError(
            f"extra_args[{CONTEXT_TOKENS!r}] needs a method that compresses once after the context; this "
            "configuration compresses in rounds (between_chunks, method@every:N or LagKV's recursion)"
        )
    return end


def request_context_end(sampling_params, prompt_len: int) -> int:
    """:func:`context_end` of a vLLM request's sampling parameters (None: a pooling request, the whole prompt)."""
    return context_end(getattr(sampling_params, "extra_args", None), prompt_len)


def _patch_process_inputs(orig):
    from vllm.exceptions import VLLMValidationError

    from .config import load_config

    @functools.wraps(orig)
    def process_inputs(self, *args, **kwargs):
        request = orig(self, *args, **kwargs)
        if not hasattr(self, "_kvtrim_config"):
            self._kvtrim_config = load_config(self.vllm_config.additional_config)
        params = request.sampling_params
        if self._kvtrim_config is not None and params is not None:
            try:
                check_request(params.extra_args, len(request.prompt_token_ids or ()), self._kvtrim_config.rounds)
            except InvalidParameterError as exc:
                raise VLLMValidationError(str(exc), parameter="extra_args") from exc
        return request

    return process_inputs


def install() -> None:
    """Check every request's kvtrim settings in vLLM's ``InputProcessor`` (idempotent)."""
    from vllm.v1.engine.input_processor import InputProcessor

    from .wrappers import wrap

    if getattr(InputProcessor, "_kvtrim_patched", False):
        return
    wrap(InputProcessor, "process_inputs", _patch_process_inputs)
    InputProcessor._kvtrim_patched = True
