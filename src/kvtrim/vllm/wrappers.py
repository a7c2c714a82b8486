"""Marking kvtrim's wrappers of vLLM methods, so start-up checks can tell whether a patch is live.

A method kvtrim wraps is live on a class when the class resolves the name to kvtrim's wrapper. A subclass that
overrides the method hides the wrapper unless its override calls the parent's: such overrides are accepted only
where vLLM's own code was read to call it (``SUPER_CALLING_OVERRIDES``, listed in ``patch_surface`` too).
"""

from __future__ import annotations

_MARK = "_kvtrim_wrapper"

# vLLM subclasses that override a wrapped method and call the parent's (read in 0.32 and 0.33).
SUPER_CALLING_OVERRIDES = frozenset({"vllm.v1.core.sched.async_scheduler.AsyncScheduler._update_after_schedule"})


class UnpatchedVLLMError(RuntimeError):
    """A vLLM component kvtrim must patch does not run kvtrim's wrapper; the engine must not start."""


def mark_wrapper(fn):
    """Mark ``fn`` as a kvtrim wrapper (what :func:`is_kvtrim_wrapper` looks for); returns ``fn``."""
    setattr(fn, _MARK, True)
    return fn


def is_kvtrim_wrapper(fn) -> bool:
    """Whether ``fn`` is a kvtrim wrapper (not vLLM's original or a subclass override)."""
    return getattr(fn, _MARK, False) is True


def wrap(cls: type, name: str, patch) -> None:
    """Replace ``cls.name`` by ``patch(cls.name)``, marked as a kvtrim wrapper."""
    setattr(cls, name, mark_wrapper(patch(getattr(cls, name))))


def bypassed(cls: type, names) -> list[str]:
    """The names among ``names`` on which ``cls`` does not reach kvtrim's wrapper.

    Walks ``cls``'s MRO to the first class defining each name: kvtrim's wrapper is live; an override listed in
    :data:`SUPER_CALLING_OVERRIDES` is followed to its parent; anything else bypasses the wrapper.
    """
    out = []
    for name in names:
        for klass in cls.__mro__:
            if name not in vars(klass):
                continue
            if is_kvtrim_wrapper(vars(klass)[name]):
                break
            if f"{klass.__module__}.{klass.__qualname__}.{name}" not in SUPER_CALLING_OVERRIDES:
                out.append(name)
                break
        else:
            out.append(name)
    return out
