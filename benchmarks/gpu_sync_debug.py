"""pytest plugin: CUDA's sync debug mode held around every decode-shaped model forward.

Loaded by the ``tests`` stage of ``benchmarks/gpu_check.py`` (``-p gpu_sync_debug`` with ``benchmarks/`` on the
path). While a Hugging Face model runs a forward whose input is one token per row on a CUDA device (a decode step:
the eager step, the static step, and the forward a CUDA graph captures), ``torch.cuda.set_sync_debug_mode`` is set
to ``KVTRIM_SYNC_DEBUG`` (``error`` by default, ``warn`` to list every sync instead of stopping at the first,
``off`` to disable). In ``error`` mode any host-device synchronisation inside the step (``.item()``, ``.tolist()``,
a Python number written into a device tensor, a blocking copy) raises, so the test that ran it fails. Prefill
forwards and the engine's token read after the forward are outside the scope on purpose: they synchronise by design.

The scope is the outermost ``PreTrainedModel.__call__``, so it needs nothing from the tests or the engine. With
``KVTRIM_SYNC_DEBUG_REPORT=path`` the plugin writes ``{"mode", "decode_forwards", "per_test"}`` there at the end
of the session: a stage that saw zero guarded forwards on a GPU guarded nothing.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

MODES = ("error", "warn", "off")


def decode_shaped(args: tuple, kwargs: dict, device_type: str = "cuda") -> bool:
    """Whether a model call feeds one token per row (``input_ids [batch, 1]`` or ``inputs_embeds
    [batch, 1, hidden]``) on a device of ``device_type``."""
    x = kwargs.get("input_ids")
    if x is None and args and isinstance(args[0], torch.Tensor):
        x = args[0]
    if x is None:
        x = kwargs.get("inputs_embeds")
    return isinstance(x, torch.Tensor) and x.device.type == device_type and x.dim() >= 2 and x.shape[1] == 1


class SyncDebugScope:
    """Patches ``PreTrainedModel.__call__`` so the outermost decode-shaped forward runs under ``mode``.

    ``setter``/``getter`` default to ``torch.cuda.set_sync_debug_mode``/``get_sync_debug_mode``; ``device_type``
    names the device whose forwards are guarded (``cuda``; tests pass ``cpu`` with a recording setter)."""

    def __init__(
        self,
        mode: str = "error",
        device_type: str = "cuda",
        setter: Callable[[str | int], None] | None = None,
        getter: Callable[[], int] | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"KVTRIM_SYNC_DEBUG must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.device_type = device_type
        self._set = setter or torch.cuda.set_sync_debug_mode
        self._get = getter or torch.cuda.get_sync_debug_mode
        self._depth = 0
        self._original: Callable | None = None
        self.current_test = "<outside tests>"
        self.per_test: Counter[str] = Counter()

    @property
    def decode_forwards(self) -> int:
        return sum(self.per_test.values())

    def install(self) -> None:
        from transformers import PreTrainedModel

        if self._original is not None or self.mode == "off":
            return
        self._original = PreTrainedModel.__call__
        original, scope = self._original, self

        def call(model, *args, **kwargs):
            if scope._depth or not decode_shaped(args, kwargs, scope.device_type):
                return original(model, *args, **kwargs)
            previous = scope._get()
            scope._set(scope.mode)
            scope._depth += 1
            scope.per_test[scope.current_test] += 1
            try:
                return original(model, *args, **kwargs)
            finally:
                scope._depth -= 1
                scope._set(previous)

        PreTrainedModel.__call__ = call

    def uninstall(self) -> None:
        from transformers import PreTrainedModel

        if self._original is not None:
            PreTrainedModel.__call__ = self._original
            self._original = None

    def report(self) -> dict:
        return {"mode": self.mode, "decode_forwards": self.decode_forwards, "per_test": dict(self.per_test)}


_scope: SyncDebugScope | None = None


def pytest_configure(config) -> None:
    global _scope
    _scope = SyncDebugScope(os.environ.get("KVTRIM_SYNC_DEBUG", "error"))
    _scope.install()


def pytest_runtest_setup(item) -> None:
    if _scope is not None:
        _scope.current_test = item.nodeid


def pytest_terminal_summary(terminalreporter) -> None:
    if _scope is not None:
        terminalreporter.write_line(
            f"sync debug mode {_scope.mode!r} held over {_scope.decode_forwards} decode-shaped CUDA forwards"
        )


def pytest_unconfigure(config) -> None:
    global _scope
    if _scope is None:
        return
    _scope.uninstall()
    path = os.environ.get("KVTRIM_SYNC_DEBUG_REPORT")
    if path:
        Path(path).write_text(json.dumps(_scope.report(), indent=1) + "\n")
    _scope = None
