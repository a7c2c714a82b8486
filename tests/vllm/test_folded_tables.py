"""The step-wide folded tables and rows of per-head attention (no vLLM needed)."""

from __future__ import annotations

import numpy as np
import torch

from kvtrim.vllm.folded_attention import default_subpage_table, folded_rows, per_head_tables
from kvtrim.vllm.subpages import RequestSubPages


def test_per_head_tables_give_each_layer_its_heads_pages_and_keep_vllms_rows_elsewhere():
    heads, bs, layers = 2, 4, 3
    block_table = torch.tensor([[5, 6, 0], [7, 8, 9], [3, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([6, 10, 2], dtype=torch.int32)
    pages = RequestSubPages(layers, heads, bs, [7, 8, 9])
    for layer, counts in enumerate([[9, 1], [0, 4], [12, 0]]):
        pages.place(layer, np.array(counts))
    table = default_subpage_table(block_table, heads)
    tables, lens = per_head_tables(table, seq_lens.repeat_interleave(heads), [(1, pages)], layers)
    assert tables.dtype == lens.dtype == torch.int32
    assert tables.shape == (layers, 3 * heads, 3) and lens.shape == (layers, 3 * heads)
    for layer in range(layers):
        # requests 0 and 2 keep vLLM's placement (head h of block b: b·H + h) and lengths
        for r in (0, 2):
            assert torch.equal(tables[layer, r * heads : (r + 1) * heads], table[r * heads : (r + 1) * heads])
            assert lens[layer, r * heads : (r + 1) * heads].tolist() == [int(seq_lens[r])] * heads
        for h, head_pages in enumerate(pages.table(layer)):
            row = tables[layer, heads + h].tolist()
            assert row[: len(head_pages)] == head_pages and not any(row[len(head_pages) :])
        assert lens[layer, heads : 2 * heads].tolist() == pages.lengths[layer].tolist()
    assert tables[0, heads].tolist() == [14, 15, 16]  # 9 entries: three sub-pages of blocks 7 and 8


def test_a_head_with_more_pages_than_the_block_table_widens_every_layers_table():
    pages = RequestSubPages(2, 2, 4, [1, 2, 3])
    pages.place(0, np.array([24, 0]))  # all six sub-pages of three blocks to head 0
    pages.place(1, np.array([4, 4]))
    table = default_subpage_table(torch.tensor([[1, 2]], dtype=torch.int32), 2)
    tables, lens = per_head_tables(table, torch.tensor([24, 24], dtype=torch.int32), [(0, pages)], 2)
    assert tables.shape == (2, 2, 6)
    assert tables[0, 0].tolist() == pages.table(0)[0] and lens[0].tolist() == [24, 0]
    assert tables[1].tolist() == [[2, 0, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0]] and lens[1].tolist() == [4, 4]


def test_folded_rows_order_request_then_head_then_token():
    token, head, qsl = folded_rows(torch.tensor([0, 2, 3], dtype=torch.int32), 2)
    assert token.tolist() == [0, 1, 0, 1, 2, 2] and head.tolist() == [0, 0, 1, 1, 0, 1]
    assert qsl.tolist() == [0, 2, 4, 5, 6]
