"""The base of every part of a method (scorer, budget allocator, selector): its optional hooks, declared.

A part overrides only the hooks it needs; the others are no-ops, so the compressor calls every hook directly.
A subclass defining a method whose name is close to a hook's but not equal (``prepar``, ``describe_compresion``)
is rejected when the class is created: a misspelled hook would otherwise never run.
"""

from __future__ import annotations

import difflib
from typing import Any, ClassVar

__all__ = ["Part", "declared_hooks"]

_CLOSE = 0.8  # difflib ratio above which a method name is taken for a misspelled hook


class Part:
    """Optional hooks shared by scorers, budget allocators and selectors (all no-ops here).

    A class that sets ``_declares_interface = True`` in its body (this one, ``Scorer``, ``BudgetAllocator``,
    ``Selector``) declares hooks; every other subclass is an implementation and is checked for misspellings.
    """

    _declares_interface: ClassVar[bool] = True

    def bind(self, model: Any) -> None:
        """Load what depends on the model (offline artifacts); called when a method is resolved for a model."""

    def check(self, ratio: float | None, budget: int | None) -> None:
        """Raise :class:`~kvtrim.errors.InvalidParameterError` when this part cannot work with ``ratio``/``budget``."""

    def describe_compression(self, shared: dict) -> dict:
        """Extra entries for the compression report's metadata, from the compression's ``shared`` dict."""
        return {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if vars(cls).get("_declares_interface"):
            return
        hooks = declared_hooks(cls)
        for name, value in vars(cls).items():
            if name.startswith("_") or name in hooks or not callable(value):
                continue
            close = difflib.get_close_matches(name, hooks, n=1, cutoff=_CLOSE)
            if close:
                raise TypeError(
                    f"{cls.__qualname__}.{name} looks like the hook {close[0]!r} misspelled (declared hooks: "
                    f"{sorted(hooks)}); rename it, or give it a name further from the hook's"
                )


def declared_hooks(cls: type) -> set[str]:
    """The public methods declared by the part interfaces ``cls`` derives from."""
    return {
        name
        for base in cls.__mro__
        if vars(base).get("_declares_interface")
        for name, value in vars(base).items()
        if callable(value) and not name.startswith("_")
    }
