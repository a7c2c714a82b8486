"""The engine's state of one request: tokens fed and emitted, its paged sequence, its incremental text.

:class:`Request` is what the scheduler sees (:class:`~kvtrim.serve.scheduler.ScheduledSequence`); the engine owns
its lifecycle (admission, chunks fed, preemption, finish). :class:`BatchedCounts` answers the scheduler's block
counts for many requests in one vectorized call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..cache.paged import PagedSequence
from .admission import KVBudget
from .types import RequestHandle, SamplingParams


class TextOutput:
    """Incremental detokenization; text that could still become a stop string is held back."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]):
        self._decode = decode  # ids -> text without special tokens
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""  # all decoded text
        self.emitted = 0  # characters of ``text`` handed out
        self._prefix = 0  # ids[_prefix:_read] decode to the tail of ``text`` (context for the next token)
        self._read = 0

    def add(self, token_id: int) -> tuple[str, bool]:
        """Append a token; returns ``(text to emit now, stopped)``. On a stop, the text ends before it."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        old_len = len(self.text)
        if len(after) > len(before) and not after.endswith("\ufffd"):  # "\ufffd": an incomplete character
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
        if not self.stop:
            return self._emit(len(self.text)), False
        hits = [
            i
            for s in self.stop
            if (i := self.text.find(s, max(0, old_len - len(s) + 1))) >= 0  # only matches touching new text
        ]
        if hits:
            return self._emit(min(hits)), True
        held = max(_partial_suffix(self.text, s) for s in self.stop)
        return self._emit(len(self.text) - held), False

    def flush(self) -> str:
        """Everything not yet emitted (at the end of a request that did not hit a stop string)."""
        tail = self._decode(self.ids[self._prefix :])[len(self._decode(self.ids[self._prefix : self._read])) :]
        self.text += tail
        self._prefix = self._read = len(self.ids)
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        out = self.text[self.emitted : upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return out


def _partial_suffix(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


class BatchedCounts:
    """The scheduler's block counts of the engine's requests, read from the shared host copies of the block tables
    in one vectorized call for all of them (instead of a few tensor ops per request, several times a step)."""

    @staticmethod
    def _paged(seqs: list[Request]) -> tuple[list[PagedSequence], torch.Tensor]:
        paged = [r.paged for r in seqs if r.paged is not None]
        return paged, torch.tensor([p.slot for p in paged], dtype=torch.long)

    def decode_need(self, seqs: list[Request]) -> int:
        paged, slots = self._paged([r for r in seqs if not r.prefill_remaining()])
        return int(paged[0].store.blocks_needed(slots, 1).sum()) if paged else 0

    def committed(self, seqs: list[Request]) -> int:
        paged, slots = self._paged(seqs)
        held = iter(paged[0].store.host_nblocks[slots].sum(1).tolist() if paged else [])
        return sum(max(0 if r.paged is None else next(held), r.projected_blocks()) for r in seqs)


@dataclass(eq=False)
class Request:
    """One request inside the engine (implements :class:`~kvtrim.serve.scheduler.ScheduledSequence`)."""

    request_id: str
    arrival: int
    prompt_ids: list[int]
    params: SamplingParams
    handle: RequestHandle
    generator: torch.Generator
    text: TextOutput
    budget: KVBudget  # the engine's admission arithmetic
    generated: list[int] = field(default_factory=list)  # emitted tokens (the last one is not fed yet)
    paged: PagedSequence | None = None
    prefilled: int = 0  # tokens of the current (re)prefill already fed
    decoding: bool = False  # the current (re)prefill is complete
    steps_since_compression: int = 0
    compressed_since_prefill: bool = False
    preemptions: int = 0
    compressions: int = 0

    def prefill_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    def blocks_held(self) -> int:
        return 0 if self.paged is None else self.paged.blocks_held()

    def decode_blocks_needed(self) -> int:
        return 0 if self.paged is None or self.prefill_remaining() else self.paged.blocks_needed(1)

    def prefill_remaining(self) -> int:
        return 0 if self.decoding else self.prefill_tokens() - self.prefilled

    def next_prefill_tokens(self, n: int) -> list[int]:
        """The next ``n`` tokens its (re)prefill feeds: the prompt, then every token generated so far."""
        return (self.prompt_ids + self.generated)[self.prefilled : self.prefilled + n]

    def chunk_blocks_needed(self, tokens: int, last: bool) -> int:
        new = tokens + int(last)
        if self.paged is None:
            return self.budget.geometry.blocks_for(new)
        return self.paged.blocks_needed(new)

    def projected_blocks(self) -> int:
        """What admission projects it to hold (see :meth:`KVBudget.projected_blocks`)."""
        return self.budget.projected_blocks(self.prefill_tokens(), len(self.prompt_ids) + self.params.max_tokens)

    def committed_blocks(self) -> int:
        return max(self.blocks_held(), self.projected_blocks())

    def kv_entries(self) -> int:
        return 0 if self.paged is None else self.paged.entries()

    def release(self) -> None:
        self.prefilled = 0
        self.decoding = False
        if self.paged is not None:
            self.paged.release()
            self.paged = None

