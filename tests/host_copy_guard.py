"""A CPU guard for the rule "no host→device copy inside a step" (docs: DESIGN "Accelerator rules").

On CUDA, ``x[index] = 0.0`` makes a 0-dim CPU tensor of the number and copies it to the device with a blocking copy
(``index_put_`` moves a CPU scalar value to the device; ``copy_`` does the same for ``x[i] = 0.0``); inside
``torch.cuda.graph`` that copy raises, and in eager decode it is one host wait per call. A tensor made from Python
data (``torch.tensor(list, device=...)``) is the same copy. On a CPU nothing is copied, so a test cannot see the copy
itself: this guard sees the ops that would make it.

:class:`HostCopyGuard`, a ``TorchDispatchMode``, rejects inside its region:

* ``lift_fresh`` / ``lift_fresh_copy``: a tensor made from Python data (a number or a list). This is what
  ``torch.tensor(...)``, ``torch.as_tensor(number)`` and ``x[...] = number`` dispatch;
* a write whose value is a lifted scalar (``scalar_tensor`` or a lift): ``index_put_`` / ``_index_put_impl_`` /
  ``copy_`` / ``fill_.Tensor`` / ``index_fill_.int_Tensor`` / ``masked_fill_.Tensor`` / ``index_copy_`` /
  ``_to_copy``: on CUDA the value is on the host, so the write copies it to the device;
* with ``reads=True``, an op handing a device value to the host (``.item()``, ``bool(tensor)``, ``torch.equal``,
  ``nonzero``): on CUDA it waits for the stream;
* any op reading a tensor registered as host data (:meth:`HostCopyGuard.host`, e.g. a static step's pinned staging
  buffer or the block tables' host block counts) together with other tensors (``copy_`` into a device tensor and
  indexing a device tensor with a host index included): on CUDA the host tensor would be copied to the device.

Not rejected: ``scalar_tensor`` feeding an elementwise op (``torch.where(mask, x, 0.0)``, ``x + 1``). PyTorch makes
that operand on the other operand's device (a fill kernel) or passes it to the kernel as an argument; nothing is
copied. Results of ops whose tensor inputs are all host data are host data too.

Blind spot: ``t.to(device)`` of a host tensor dispatches nothing on a CPU (the tensor is already there), so an upload
spelled that way is invisible here unless ``t`` is registered host data used afterwards with device tensors. GPU
runs close it with ``torch.cuda.set_sync_debug_mode("error")`` (a blocking upload synchronizes the stream).

The region's boundary: a step's host preparation (allocating blocks, writing block tables and step inputs from the
host, which happens before the forward a CUDA graph replays) is outside it. :meth:`HostCopyGuard.exempt` marks such a
function: while it runs the guard ignores its ops (so its results are not host data: they are the step's device
inputs).
"""

from __future__ import annotations

import functools
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

LIFTS = frozenset({"lift_fresh", "lift_fresh_copy"})
SCALARS = frozenset({"scalar_tensor"}) | LIFTS
# Ops that write a tensor value into (or copy it onto) their destination: a host value would be copied to the device.
WRITES = frozenset({
    "index_put_", "index_put", "_index_put_impl_", "copy_", "fill_", "index_fill_", "index_fill", "masked_fill_",
    "masked_fill", "index_copy_", "index_copy", "_to_copy", "scatter_", "scatter",
})  # fmt: skip
# Ops that hand a device value to the host (``.item()``, ``bool(t)``, ``torch.equal``, ``nonzero``'s size): on CUDA
# each waits for the stream. ``tolist()`` dispatches nothing and is covered on a GPU by the sync debug mode only.
READS = frozenset({"_local_scalar_dense", "equal", "is_nonzero", "nonzero"})


def _where() -> str:
    """``file:line`` of the innermost kvtrim frame that dispatched the op (else the innermost caller)."""
    frames = [f for f in traceback.extract_stack()[:-3] if "torch" not in f.filename.split("/")[-3:-1]]
    ours = [f for f in frames if "/kvtrim/" in f.filename] or frames
    f = ours[-1]
    return f"{f.filename.split('/src/')[-1]}:{f.lineno}"


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class HostCopyGuard(TorchDispatchMode):
    """Records every op of its region that would copy host data to the device on CUDA (see the module docstring).

    Attributes:
        violations: one line per rejected op (``"aten.op: why"``)
        ops: the number of ops seen outside exempted functions (a guard that saw nothing guards nothing)
    """

    def __init__(self, reads: bool = False):
        super().__init__()
        self.reads = reads  # also reject device→host reads (a decode forward's rule; an eviction reads on purpose)
        self.violations: list[str] = []
        self.ops = 0
        self._host: set[int] = set()  # storages of host data (lifted values, registered host tensors, results)
        self._lifted: set[int] = set()  # storages of lifted scalars
        self._paused = 0
        self._alive: list[torch.Tensor] = []

    def host(self, *tensors: torch.Tensor) -> HostCopyGuard:
        """Register tensors that live on the host on CUDA (distinct storages from any device tensor)."""
        self._remember(self._host, tensors)
        return self

    def exempt(self, monkeypatch, owner, name: str) -> None:
        """Run ``owner.name`` (a host-preparation function) with the guard only watching."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def exempted(*args, **kwargs):
            self._paused += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._paused -= 1

        monkeypatch.setattr(owner, name, exempted)

    def _remember(self, into: set[int], tensors) -> None:
        for t in tensors:
            ptr = _storage(t)
            if ptr:  # an empty tensor has no storage address
                into.add(ptr)
                self._alive.append(t)  # held, so no later allocation reuses the address

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._paused:
            return out
        self.ops += 1
        name = func.overloadpacket.__name__
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        stored = {_storage(t) for t in inputs}
        if name in LIFTS:
            shape = tuple(args[0].shape)
            what = "a Python number" if not shape else f"Python data of shape {list(shape)}"
            self.violations.append(
                f"{_where()} {func}: a tensor made from {what} inside the step (host→device on CUDA)"
            )
        host_inputs = [t for t in inputs if _storage(t) in self._host]
        if name in WRITES and any(_storage(t) in self._lifted for t in inputs[1:]):
            self.violations.append(
                f"{_where()} {func}: writes a value lifted from a Python number (x[...] = number), on CUDA a blocking "
                "host→device copy: use index_fill_ / masked_fill_ / a device-resident constant"
            )
        elif host_inputs and len(host_inputs) < len(inputs) and name not in SCALARS:
            self.violations.append(f"{_where()} {func}: reads host data together with device tensors (host→device)")
        if self.reads and name in READS and len(host_inputs) < len(inputs):
            self.violations.append(f"{_where()} {func}: reads a device value on the host (device→host, a stream wait)")
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if name in SCALARS:  # a lift returns the tensor it was given: its storage is the new data
            self._remember(self._lifted, outs)
            if name in LIFTS:
                self._remember(self._host, outs)
        elif inputs and len(host_inputs) == len(inputs):
            self._remember(self._host, [t for t in outs if _storage(t) not in stored])
        return out
