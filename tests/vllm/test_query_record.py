"""The worker's record of a request's recent queries in one layer (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch

from kvtrim.vllm.query_record import QueryRecord

ALL_QUERIES = 1 << 30  # KVC-full's window: every prompt query


def _rows(start: int, n: int) -> torch.Tensor:
    """``n`` rows ``[n, 2, 3]`` numbered from ``start`` (each row filled with its number)."""
    return torch.arange(start, start + n, dtype=torch.float32).view(-1, 1, 1).expand(-1, 2, 3).clone()


@pytest.mark.parametrize("window", [1, 3, 8, 64, 2000, ALL_QUERIES])
def test_the_record_holds_the_newest_window_rows_in_order(window):
    # random step sizes (the suite of tests/vllm runs where hypothesis is not installed: seeded draws instead)
    g = torch.Generator().manual_seed(window % 1000)
    for _ in range(10):
        record, seen = QueryRecord(window), 0
        sizes = torch.randint(0, 300, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g)
        sizes[torch.rand(len(sizes), generator=g) < 0.5] = 1  # decoding steps among the prefill chunks
        for k in sizes.tolist():
            record.append(_rows(seen, k))
            seen += k
            held = min(seen, window)
            assert len(record) == held
            assert torch.equal(record.rows, _rows(seen - held, held))  # the newest rows, oldest first


def test_appending_copies_the_rows_and_never_aliases_the_callers_buffer():
    record, step = QueryRecord(4), _rows(0, 3)
    record.append(step)
    step.fill_(-1.0)  # vLLM reuses its query buffer at the next step
    assert torch.equal(record.rows, _rows(0, 3))


def test_a_bounded_window_keeps_one_buffer_and_an_unbounded_one_doubles():
    bounded = QueryRecord(64)
    bounded.append(_rows(0, 5))
    buffer = bounded._buf
    for i in range(5, 1000):
        bounded.append(_rows(i, 1))
    assert bounded._buf is buffer and buffer.shape[0] == 128  # decoding rows moved to the front, never reallocated
    every = QueryRecord(ALL_QUERIES)
    sizes = set()
    for i in range(0, 4096, 256):  # a long prompt in 256-query chunks
        every.append(_rows(i, 256))
        sizes.add(every._buf.shape[0])
    assert len(every) == 4096 and sorted(sizes) == [512, 1024, 2048, 4096]


def test_an_empty_record_refuses_to_be_read():
    with pytest.raises(RuntimeError, match="no query recorded"):
        _ = QueryRecord(8).rows
    with pytest.raises(ValueError, match="window"):
        QueryRecord(0)
