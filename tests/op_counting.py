"""Counting the aten ops a step dispatches: the CPU guard for accelerator rules (no per-row loops, no host syncs).

Shared by tests/cache/test_decode_op_count.py and tests/serve/test_engine_op_count.py.
"""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode

# Ops that only make a new view of existing memory (no kernel); their count may depend on shapes in model code.
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "expand", "slice", "select", "transpose", "t", "permute", "unsqueeze",
    "squeeze", "alias", "as_strided", "detach", "split", "unbind",
})  # fmt: skip
# Ops that copy a device value to the host (or need its value to size their output).
SYNC_OPS = frozenset(
    {"_local_scalar_dense", "item", "is_nonzero", "nonzero", "equal", "masked_select", "unique", "_unique2"}
)


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))
