"""When a cache compresses: once after prefill, or again and again while tokens keep arriving.

Every method compresses once after the prompt is prefilled. A *continuous* schedule also compresses during
decoding (and between chunks of a chunked prefill), so long generations stay within a memory budget:

* :class:`AfterPrefill` — the default: compress once, then the cache only grows;
* :class:`EveryNTokens` — re-compress to the budget each time ``n`` new tokens have been appended;
* :class:`OverBudget` — re-compress whenever a (layer, KV head) holds more than its budget plus ``slack``;
* :class:`TailFull` — LagKV's rule: compress whenever the uncompressed tail reaches two partitions.

Schedules are given per method with the ``name@schedule`` syntax (``"snapkv@every:64"``, ``"h2o@over:16"``,
``"streaming_llm@over:0"``), or by passing a schedule object to :class:`~kvtrim.compression.pipeline.Pipeline`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from ..errors import InvalidParameterError

if TYPE_CHECKING:
    from .target import CompressibleCache


class Schedule(Protocol):
    """``continuous``: compress again after the first compression; ``due(cache)``: compress now?"""

    continuous: bool

    def due(self, cache: CompressibleCache) -> bool: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class AfterPrefill:
    """Compress once, after the prompt (the default of every method)."""

    continuous: bool = False

    def due(self, cache: CompressibleCache) -> bool:
        return False

    def describe(self) -> str:
        return "prefill"


@dataclass(frozen=True)
class EveryNTokens:
    """Re-compress to the budget every ``n`` appended tokens (prefill chunks: after every chunk)."""

    n: int
    continuous: bool = True

    def __post_init__(self) -> None:
        _positive("every", self.n)

    def due(self, cache: CompressibleCache) -> bool:
        return cache.tokens_since_compression >= self.n

    def describe(self) -> str:
        return f"every:{self.n}"


@dataclass(frozen=True)
class OverBudget:
    """Re-compress whenever some (row, layer, KV head) holds more than its budget plus ``slack`` entries.

    With ``slack = 0`` every decoding step re-compresses once the budget is reached (a hard cap); a larger slack
    amortizes the scoring over ``slack`` steps at the price of ``slack`` extra entries per head.
    """

    slack: int = 0
    continuous: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.slack, bool) or not isinstance(self.slack, int) or self.slack < 0:
            raise InvalidParameterError(f"over: slack must be an integer >= 0, got {self.slack!r}")

    def due(self, cache: CompressibleCache) -> bool:
        if cache.budget is None:
            return False
        return _bounded_due(cache, "over", self.slack + 1, lambda: _excess(cache))

    def describe(self) -> str:
        return f"over:{self.slack}"


@dataclass(frozen=True)
class TailFull:
    """LagKV's trigger: compress when the uncompressed tail (tokens after the sink and the already compressed
    part) reaches ``2 · lag`` tokens in some row, i.e. once every ``lag`` new tokens."""

    lag: int
    sink: int
    continuous: bool = True

    def __post_init__(self) -> None:
        _positive("lag", self.lag)
        if self.sink < 0:
            raise InvalidParameterError(f"sink must be >= 0, got {self.sink}")

    def due(self, cache: CompressibleCache) -> bool:
        return _bounded_due(cache, "tail", 2 * self.lag, lambda: _tail(cache, self.sink))

    def describe(self) -> str:
        return f"tail:{self.lag}"


def _bounded_due(cache: CompressibleCache, key: str, threshold: int, exact) -> bool:
    """``exact() >= threshold``, read from the device only when it may be true.

    ``exact()`` (a host int, read with one sync) is a quantity that grows by at most one per token column the cache
    sees (compressions and rollbacks only lower it). The last exact value and the column count it was read at are
    kept on the cache, so while ``last + columns since < threshold`` the answer is known without reading the device:
    decoding steps stay free of host syncs until a compression may be due.
    """
    clock = cache.layers[0].seen
    bounds = cache.__dict__.setdefault("_schedule_bounds", {})
    last = bounds.get(key)
    if last is not None and clock >= last[0] and last[1] + (clock - last[0]) < threshold:
        return False
    value = exact()
    bounds[key] = (clock, value)
    return value >= threshold


def _excess(cache: CompressibleCache) -> int:
    """Largest ``held - keep`` over (row, layer, KV head), or a very negative number while empty."""
    context = cache.context_lengths()
    if context is None:
        return -(2**62)
    held = cache.entries_per_layer_head().amax(dim=(1, 2)).tolist()  # [batch] fullest head per row: one read
    keep = [cache.budget.keep_count(int(t)) for t in context.tolist()]  # host ints: nothing copied to the device
    return max(h - k for h, k in zip(held, keep, strict=True))


def _tail(cache: CompressibleCache, sink: int) -> int:
    """Largest uncompressed tail (context minus the first position not compressed yet) over rows and layers."""
    context = cache.context_lengths()
    if context is None:
        return -(2**62)
    tails = []
    for layer in cache.kv_layers:
        done = layer.compressed_until
        start = torch.full_like(context, sink) if done is None else done.to(context.device)
        tails.append((context - start).max())
    return int(torch.stack(tails).max())


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidParameterError(f"{name} must be a positive integer, got {value!r}")


def parse_schedule(text: str, sink: int = 0) -> Schedule:
    """Parse ``prefill``, ``every:N``, ``over:SLACK`` or ``tail:LAG`` (``sink`` is used by ``tail``)."""
    kind, _, arg = text.strip().partition(":")
    try:
        if kind == "prefill" and not arg:
            return AfterPrefill()
        if kind == "every":
            return EveryNTokens(int(arg))
        if kind == "over":
            return OverBudget(int(arg) if arg else 0)
        if kind == "tail":
            return TailFull(int(arg), sink)
    except ValueError:
        pass
    raise InvalidParameterError(
        f"schedule={text!r} is not understood; use 'prefill', 'every:N' (N > 0), 'over:SLACK' (>= 0) or 'tail:LAG'"
    )
