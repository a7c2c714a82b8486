"""Structural guard for accelerators, checked on CPU: what one decoding step asks of the device.

On a GPU, eager decoding is bound by kernel launches and stalls on every host–device synchronisation. So a decode
step of any store must issue a number of aten ops that does not grow with the batch size or the number of KV heads
(no Python loop over rows, heads or segments), the ragged store must stay within 1.5× of the dense store, and no op
may read a device value back on the host.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from conftest import tiny_model
from host_copy_guard import HostCopyGuard
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache
from kvtrim.methods import get_method
from op_counting import SYNC_OPS, VIEW_OPS, OpCounter


def decode_ops(method: str, batch: int, kv_heads: int, layout: str, steps: int = 3) -> list[Counter]:
    """Prefill ``batch`` rows of 48 tokens (the first row left-padded by 5), compress at ratio 0.5, then count the
    ops of ``steps`` decoding forwards after a first step (which may grow the append slack)."""
    return [mode.ops for mode in decode_modes(method, batch, kv_heads, layout, steps, OpCounter)[1:]]


def decode_modes(method: str, batch: int, kv_heads: int, layout: str, steps: int, make) -> list:
    """:func:`decode_ops`'s run with a fresh dispatch mode ``make()`` around each of its ``steps + 1`` decoding
    forwards (the first included); returns the modes."""
    model = tiny_model("llama", layers=2, heads=2 * kv_heads, kv_heads=kv_heads)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (batch, 48), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    pipeline = get_method(method)
    pipeline.layout = layout  # the padded row keeps fewer entries: pin the store under test
    cache = KVTrimCache(len(model.model.layers), pipeline, BudgetSpec(ratio=0.5))
    counts = []
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
        cache.compress()
        assert {layer.store.layout for layer in cache.layers} == {layout}
        token = out.logits[:, -1:].argmax(-1)
        last = positions[:, -1:]
        for _ in range(steps + 1):
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype)], dim=1)
            last = last + 1
            mode = make()
            with mode:
                out = model(input_ids=token, attention_mask=mask, position_ids=last, past_key_values=cache)
            token = out.logits[:, -1:].argmax(-1)
            counts.append(mode)
    return counts


DECODE_CASES = [
    ("snapkv", "dense"),
    ("adakv", "ragged"),
    ("pyramidkv", "dense"),
    # Continuous schedules read the device only when a compression may be due (not within the counted steps).
    ("snapkv@over:64", "dense"),
    ("adakv@over:64", "ragged"),
    ("lagkv", "dense"),
]


@pytest.mark.parametrize(("method", "layout"), DECODE_CASES)
def test_decode_step_has_no_host_sync(method, layout):
    for ops in decode_ops(method, batch=2, kv_heads=2, layout=layout):
        assert not (set(ops) & SYNC_OPS), {op: ops[op] for op in set(ops) & SYNC_OPS}


@pytest.mark.parametrize(("method", "layout"), DECODE_CASES)
def test_decode_step_copies_nothing_from_the_host(method, layout):
    """Every decoding forward, the first one included (a continuous schedule checks whether a compression is due
    there), makes no tensor from Python data and writes no Python number into a device tensor
    (tests/host_copy_guard.py)."""
    for guard in decode_modes(method, 2, 2, layout, 3, HostCopyGuard):
        assert guard.ops > 100 and not guard.violations, sorted(set(guard.violations))


def test_ragged_op_count_is_flat_in_batch_and_heads_and_close_to_dense():
    totals = {}
    for method, layout in (("snapkv", "dense"), ("adakv", "ragged")):
        for batch, kv_heads in ((1, 1), (4, 1), (1, 4), (3, 2)):
            per_step = [
                sum(n for op, n in ops.items() if op not in VIEW_OPS)
                for ops in decode_ops(method, batch, kv_heads, layout)
            ]
            assert len(set(per_step)) == 1, (method, batch, kv_heads, per_step)  # every step the same work
            totals[method, batch, kv_heads] = per_step[0]
    for method in ("snapkv", "adakv"):
        counts = {totals[key] for key in totals if key[0] == method}
        assert len(counts) == 1, (method, totals)  # independent of batch size and KV heads
    assert totals["adakv", 1, 1] <= 1.5 * totals["snapkv", 1, 1], totals  # kernels launched, not views
