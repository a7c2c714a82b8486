"""Splitting a chat prompt into a context part (compressed once) and a question part (asked afterwards)."""

from __future__ import annotations

from dataclasses import dataclass

_CONTEXT_MARK = "\u0000KVTRIM_CONTEXT\u0000"
_QUESTION_MARK = "\u0000KVTRIM_QUESTION\u0000"


@dataclass(frozen=True)
class PromptTemplate:
    """Text around the context and the question.

    The full prompt is ``prefix + context + separator + question + suffix + answer_prefix``; the context part
    is ``prefix + context`` and everything after it is the question part.
    """

    prefix: str
    separator: str
    suffix: str

    def context_part(self, context: str) -> str:
        return self.prefix + context

    def question_part(self, question: str, answer_prefix: str | None = None) -> str:
        return self.separator + question + self.suffix + (answer_prefix or "")


def prompt_template(tokenizer, use_chat_template: bool = True, separator: str = "\n\n") -> PromptTemplate:
    """The template for ``tokenizer``: its chat template with context and question in one user turn, or plain
    concatenation when it has none (or ``use_chat_template`` is False)."""
    if not use_chat_template or not getattr(tokenizer, "chat_template", None):
        return PromptTemplate(prefix="", separator=separator, suffix="")
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": _CONTEXT_MARK + separator + _QUESTION_MARK}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prefix, rest = rendered.split(_CONTEXT_MARK, 1)
    middle, suffix = rest.split(_QUESTION_MARK, 1)
    return PromptTemplate(prefix=prefix, separator=middle, suffix=suffix)
