"""Splitting a chat prompt into a context part (compressed once) and a question part (asked afterwards).

Two layouts (``prompt_format``):

* ``"kvtrim"`` (default): context and question in one user turn, joined by ``separator`` (``"\\n\\n"``);
  without a chat template, plain concatenation with the tokenizer's special tokens.
* ``"kvpress"``: the layout of kvpress's ``kv-press-text-generation`` pipeline: the question follows the
  context directly inside the user turn (no separator); without a chat template the context starts with the
  BOS token and the question ends with ``"\\n"``. Use it to compare scores with kvpress.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidParameterError

_CONTEXT_MARK = "\u0000KVTRIM_CONTEXT\u0000"
_QUESTION_MARK = "\u0000KVTRIM_QUESTION\u0000"
PROMPT_FORMATS = ("kvtrim", "kvpress")
DEFAULT_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class PromptTemplate:
    """Text around the context and the question.

    The full prompt is ``prefix + context + separator + question + suffix + answer_prefix``; the context part
    is ``prefix + context`` and everything after it is the question part. ``add_special_tokens`` says whether
    the tokenizer should add its own special tokens to the context part (only when the template adds none).
    """

    prefix: str
    separator: str
    suffix: str
    add_special_tokens: bool = False
    format: str = "kvtrim"

    def context_part(self, context: str) -> str:
        return self.prefix + context

    def question_part(self, question: str, answer_prefix: str | None = None) -> str:
        return self.separator + question + self.suffix + (answer_prefix or "")

    def describe(self) -> dict:
        """What a result records about its prompt layout."""
        return {"prompt_format": self.format, "separator": self.separator}


def check_prompt_format(prompt_format: str) -> None:
    """Raise :class:`InvalidParameterError` unless ``prompt_format`` is a known layout."""
    if prompt_format not in PROMPT_FORMATS:
        raise InvalidParameterError(f"prompt_format must be one of {list(PROMPT_FORMATS)}, got {prompt_format!r}")


def prompt_template(
    tokenizer, use_chat_template: bool = True, separator: str | None = None, prompt_format: str = "kvtrim"
) -> PromptTemplate:
    """The template for ``tokenizer``: its chat template with context and question in one user turn, or plain
    concatenation when it has none (or ``use_chat_template`` is False).

    Args:
        separator: text between context and question (default ``"\\n\\n"`` for ``"kvtrim"``, ``""`` for
            ``"kvpress"``)
        prompt_format: ``"kvtrim"`` or ``"kvpress"`` (see the module docstring)
    """
    check_prompt_format(prompt_format)
    if separator is not None and not isinstance(separator, str):
        raise InvalidParameterError(f"separator must be a string, got {separator!r}")
    kvpress = prompt_format == "kvpress"
    if separator is None:
        separator = "" if kvpress else DEFAULT_SEPARATOR
    if not use_chat_template or not getattr(tokenizer, "chat_template", None):
        if kvpress:  # kvpress: BOS as text before the context, "\n" between question and answer
            bos = getattr(tokenizer, "bos_token", None) or ""
            return PromptTemplate(prefix=bos, separator=separator, suffix="\n", format=prompt_format)
        return PromptTemplate(prefix="", separator=separator, suffix="", add_special_tokens=True, format=prompt_format)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": _CONTEXT_MARK + separator + _QUESTION_MARK}],
        tokenize=False,
        add_generation_prompt=True,
        **({"enable_thinking": False} if kvpress else {}),
    )
    prefix, rest = rendered.split(_CONTEXT_MARK, 1)
    middle, suffix = rest.split(_QUESTION_MARK, 1)
    return PromptTemplate(prefix=prefix, separator=middle, suffix=suffix, format=prompt_format)
