"""attend_padded with the output layout CUDA's SDPA kernels return."""

from __future__ import annotations

import pytest
import torch

from kvtrim.cache import packed_attention


def _cuda_layout_sdpa(real):
    """SDPA whose ``[b, h, q, d]`` result is a transposed view of a ``[b, q, h, d]`` buffer, as the flash and
    memory-efficient CUDA kernels return it (not viewable as ``[b, h * q, d]``)."""

    def call(*args, **kwargs):
        out = real(*args, **kwargs)
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    return call


@pytest.mark.parametrize("may_be_empty", [True, False])
@pytest.mark.parametrize("tq", [1, 4])  # a decoding step (one mask row for every query) and a prefill piece
def test_masked_grouped_attention_accepts_a_transposed_sdpa_result(monkeypatch, tq, may_be_empty):
    g = torch.Generator().manual_seed(0)
    b, hkv, group, width, d = 2, 2, 3, 9, 16
    query = torch.randn(b, hkv * group, tq, d, generator=g)
    keys, values = torch.randn(2, b, hkv, width, d, generator=g)
    mask = torch.rand(b, hkv, tq, width, generator=g) > 0.3
    mask[..., 0] = True  # every query sees a key
    want = packed_attention.attend_padded(query, keys, values, mask, 0.25, may_be_empty=may_be_empty)
    monkeypatch.setattr(packed_attention, "backend_sdpa", _cuda_layout_sdpa(packed_attention.backend_sdpa))
    got = packed_attention.attend_padded(query, keys, values, mask, 0.25, may_be_empty=may_be_empty)
    assert got.shape == (b, tq, hkv * group, d)
    torch.testing.assert_close(got, want)
