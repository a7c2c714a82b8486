"""tools/kvpress_parity.py's pure parts: reading kept positions back from key rows, and the agreement figures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import kvpress_parity


def test_kept_positions_are_read_back_from_gathered_key_rows():
    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 10, 4, generator=g)  # [heads, n, d]
    keep = [[7, 1, 4], [0, 9, 3]]
    kept = torch.stack([full[h, idx] for h, idx in enumerate(keep)])
    assert kvpress_parity.kept_by_matching(full, kept) == [[1, 4, 7], [0, 3, 9]]


def test_a_row_that_is_not_a_prefill_key_is_an_error():
    full = torch.zeros(1, 3, 2)
    with pytest.raises(RuntimeError, match="matches no prefill key row"):
        kvpress_parity.kept_by_matching(full, torch.ones(1, 1, 2))


def test_agreement_figures():
    a = [[[0, 1, 2], [3, 4]], [[5], [6, 7]]]
    b = [[[0, 1, 2], [3, 9]], [[5], [6, 7, 8]]]
    got = kvpress_parity.compare(a, b)
    assert got["identical_heads"] == 0.5
    assert got["mean_jaccard"] == pytest.approx((1 + 1 / 3 + 1 + 2 / 3) / 4)
    assert got["max_head_difference"] == 1 and got["kept_kvpress"] == 8 and got["kept_kvtrim"] == 9


def test_report_names_the_methods_and_the_failures():
    report = {"ratio": 0.5, "tokens": 8, "kvpress_side": {"kvpress": "0.5.5", "transformers": "5.2.0"},
              "rows": [{"press": "KnormPress", "method": "knorm", "status": "ok", "identical_heads": 1.0,
                        "mean_jaccard": 1.0, "max_head_difference": 0, "kept_kvpress": 4, "kept_kvtrim": 4},
                       {"press": "RandomPress", "method": None, "status": "no kvtrim method"}]}  # fmt: skip
    text = kvpress_parity.markdown(report)
    assert "| KnormPress | `knorm` | 100.0 % | 1.000 | 0 | 4 / 4 | ok |" in text
    assert "| RandomPress | - |" in text and "no kvtrim method" in text


def test_ratio_outside_its_range_is_refused():
    with pytest.raises(SystemExit):
        kvpress_parity.main(["kvtrim", "--out", "x", "--ratio", "1.0"])
