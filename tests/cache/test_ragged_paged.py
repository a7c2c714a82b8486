"""A ragged store's decoding step through a block-table kernel (kvtrim.cache.ragged_paged), checked with kvtrim's
Triton kernel under Triton's interpreter against the gather path."""

from __future__ import annotations

import os

import pytest
import torch
from test_ragged import dense_store, random_selection

from conftest import byte_tokenizer, random_text, tiny_model
from kvtrim.cache import paged_kernels, ragged
from kvtrim.cache.ragged import RaggedStore
from kvtrim.cache.ragged_paged import BLOCK, block_table, decode_kernel_for

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
needs_kernel = pytest.mark.skipif(
    not INTERPRETED or paged_kernels.triton_kernel() is None, reason="needs triton under TRITON_INTERPRET=1"
)


def test_block_table_lists_each_rows_blocks_from_its_start():
    start = torch.tensor([0, 32, 48, 96])
    table = block_table(start, 3, num_blocks=8)
    assert table.dtype == torch.int32
    assert table.tolist() == [[0, 1, 2], [2, 3, 4], [3, 4, 5], [6, 7, 7]]  # clamped inside the pool


def test_no_kernel_is_chosen_off_cuda():
    assert decode_kernel_for(torch.zeros(1, 2, 1, 16), 16) is None


def _store(b, h, s, d, seed) -> RaggedStore:
    indices, keep = random_selection(b, h, s, seed)
    keep[0, 0] = False  # one empty row
    return RaggedStore.from_selection(dense_store(b, h, s, d, seed), indices, keep)


@needs_kernel
@pytest.mark.parametrize(("b", "h", "group", "s"), [(1, 2, 3, 40), (2, 3, 2, 70)])
def test_kernel_step_equals_the_gather_path_and_rows_stay_block_aligned(monkeypatch, b, h, group, s):
    d = 16
    gathered, paged = _store(b, h, s, d, seed=s), _store(b, h, s, d, seed=s)
    g = torch.Generator().manual_seed(1)
    kernel = paged_kernels.triton_kernel()
    for step in range(40):  # enough appends to grow rows (repacks) after the first alignment
        k, v = torch.randn(2, b, h, 1, d, generator=g)
        pos = torch.full((b, 1), s + step)
        query = torch.randn(b, h * group, 1, d, generator=g)
        gathered.append(k, v, pos)
        paged.append(k, v, pos)
        want = gathered.attend(query, pos, 0.25)
        with monkeypatch.context() as m:
            m.setattr(ragged, "decode_kernel_for", lambda query, head_dim: kernel)
            got = paged.attend(query, pos, 0.25)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
        assert paged._block == BLOCK and bool((paged.start % BLOCK == 0).all())
        assert paged._k.shape[0] % BLOCK == 0
    assert torch.equal(paged.length, gathered.length) and paged.entries() == gathered.entries()
    assert bool((paged.capacity > gathered.capacity).any())  # the alignment costs slack, never entries


@needs_kernel
def test_adakv_generation_through_the_kernel_equals_the_gather_path(monkeypatch):
    import kvtrim

    model, tok = tiny_model("llama", layers=2), byte_tokenizer()
    args = dict(method="adakv", ratio=0.5, max_new_tokens=5)
    want = kvtrim.generate(model, tok, random_text(200, seed=4), "q?", **args)
    calls = []
    kernel = paged_kernels.triton_kernel()

    def chosen(query, head_dim):
        calls.append(1)
        return kernel

    monkeypatch.setattr(ragged, "decode_kernel_for", chosen)
    got = kvtrim.generate(model, tok, random_text(200, seed=4), "q?", **args)
    assert calls and got.answers == want.answers
