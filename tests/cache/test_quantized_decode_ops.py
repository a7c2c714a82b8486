"""Accelerator guard for the quantized dense and ragged stores, checked on CPU: no host sync while decoding
(flushes included), and the same ops per step whatever the batch size and the number of KV heads."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import tiny_model
from kvtrim.cache.quant import KVQuant
from kvtrim.cache.quantized_dense import QuantizedDenseStore
from kvtrim.cache.quantized_ragged import QuantizedRaggedStore
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.integration.attention import kvtrim_attention_enabled
from kvtrim.integration.cache import KVTrimCache
from kvtrim.methods import get_method
from op_counting import SYNC_OPS, VIEW_OPS, OpCounter

# SnapKV without padding keeps the same count in every row (a dense store); AdaKV on a left-padded batch keeps a
# count per (sequence, KV head) row (a ragged store).
CASES = {"dense": ("snapkv", 0, QuantizedDenseStore), "ragged": ("adakv", 5, QuantizedRaggedStore)}


def decode_ops(batch: int, kv_heads: int, steps: int, case: str = "dense", sink: int = 0) -> tuple[list, int]:
    """Prefill ``batch`` rows of 48 tokens (row 0 left-padded by ``pad``), compress with ``method`` at ratio 0.5
    into int4 entries in groups of 8 (with ``sink`` full-precision oldest entries), then count the ops of ``steps``
    decoding forwards. Returns them and the index of the step that flushes the window into a new group."""
    method, pad, kind = CASES[case]
    model = tiny_model("llama", layers=2, heads=2 * kv_heads, kv_heads=kv_heads)
    ids = torch.randint(3, 200, (batch, 48), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    fmt = KVQuant("int4", group_size=8, residual=0, sink=sink)
    cache = KVTrimCache(2, get_method(method), BudgetSpec(ratio=0.5), kv_quant=fmt)
    counts = []
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
        cache.compress()
        store = cache.layers[0].store
        assert type(store) is kind
        store = store if case == "dense" else store.tail  # appends land in the ragged store's dense tail
        nq, window = store.quantized_length, store.window_length
        assert dataclasses.replace(store.kv_quant, sink=sink) == fmt  # a ragged store's tail has no sink of its own
        assert (nq > 0 or case == "ragged") and 0 <= window < 8
        flush = 8 - window - 1
        token, last = out.logits[:, -1:].argmax(-1), positions[:, -1:]
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype)], dim=1)
            last = last + 1
            with OpCounter() as counter:
                out = model(input_ids=token, attention_mask=mask, position_ids=last, past_key_values=cache)
            token = out.logits[:, -1:].argmax(-1)
            counts.append(counter.ops)
        assert store.quantized_length == nq + 8 and store.window_length == window + steps - 8
    return counts, flush


@pytest.mark.parametrize("sink", [0, 1])
@pytest.mark.parametrize("case", sorted(CASES))
def test_quantized_decode_has_no_host_sync_even_when_a_group_is_flushed(case, sink):
    counts, flush = decode_ops(batch=2, kv_heads=2, steps=9, case=case, sink=sink)
    assert 0 <= flush < 9
    for ops in counts:
        assert not (set(ops) & SYNC_OPS), {op: ops[op] for op in set(ops) & SYNC_OPS}


@pytest.mark.parametrize("case", sorted(CASES))
def test_quantized_decode_op_count_is_flat_in_batch_and_heads(case):
    totals = set()
    # a ragged store needs rows of different counts: two sequences at least (one of them padded)
    shapes = ((1, 1), (4, 1), (1, 4), (3, 2)) if case == "dense" else ((2, 1), (4, 1), (2, 4), (3, 2))
    for batch, kv_heads in shapes:
        counts, flush = decode_ops(batch, kv_heads, 11, case)
        per_step = [sum(n for op, n in ops.items() if op not in VIEW_OPS) for ops in counts]
        # the ragged store's tail holds no quantized group before its first flush (fewer ops until then)
        plain = [n for i, n in enumerate(per_step) if i not in (0, flush) and (case == "dense" or i > flush)]
        assert len(set(plain)) == 1 and per_step[flush] > plain[0], per_step  # the flush adds the quantization
        totals.add((plain[0], per_step[flush]))
    assert len(totals) == 1, totals
