"""grouped_attention's causal path when the queries continue a cache (``q < s``)."""

from __future__ import annotations

import pytest
import torch

from kvtrim.cache.attention import grouped_attention
from kvtrim.cache.packed_attention import attend_padded


@pytest.mark.parametrize(("q", "s"), [(4, 4), (3, 11), (1, 5)])
def test_causal_continuation_equals_the_position_mask(q, s):
    g = torch.Generator().manual_seed(1)
    b, hkv, group, d = 2, 2, 3, 8
    query = torch.randn(b, hkv * group, q, d, generator=g)
    keys, values = torch.randn(2, b, hkv, s, d, generator=g)
    kpos = torch.arange(s)
    qpos = torch.arange(s - q, s)
    mask = (kpos[None, :] <= qpos[:, None]).expand(b, hkv, q, s)  # the queries are the last q of the s keys
    want = attend_padded(query, keys, values, mask, 0.3)
    torch.testing.assert_close(grouped_attention(query, keys, values, None, 0.3, causal=True), want)


def test_more_queries_than_keys_is_refused():
    query, keys = torch.zeros(1, 2, 5, 8), torch.zeros(1, 1, 3, 8)
    with pytest.raises(ValueError, match="at most as many queries as keys"):
        grouped_attention(query, keys, keys, None, 1.0, causal=True)
