"""CompilerKV's threshold gate with top-k budget correction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from kvtrim.artifacts.compilerkv import CompiledTables, TableSource
from kvtrim.errors import InvalidParameterError
from kvtrim.scoring.risk import RiskSignals
from kvtrim.selection.threshold import ThresholdGateSelector


@dataclass
class FakeView:
    """The parts of a LayerView the selector reads."""

    positions: torch.Tensor
    context_lengths: torch.Tensor
    layer_idx: int = 0
    shared: dict = field(default_factory=dict)

    @property
    def keys(self):
        return torch.zeros(self.positions.shape[0], self.positions.shape[1], 1, 1)

    @property
    def kv_heads(self):
        return self.positions.shape[1]


UTILITY = torch.tensor([0.1, 1.3, 0.5, 0.95, 2.0, 0.7, 0.85, 1.1])  # 4 tokens ≥ 0.9, 5 tokens ≥ 0.8


def _run(selector, budget: int, utility=UTILITY, risk=None):
    n = len(utility)
    view = FakeView(positions=torch.arange(n).expand(1, 2, n), context_lengths=torch.tensor([n]))
    view.shared["budget_index"] = torch.zeros(1, dtype=torch.long)
    view.shared["risk"] = risk or RiskSignals(torch.tensor([3.0]), torch.tensor([10.0]))
    sel = selector.select(view, utility.expand(1, 2, n), torch.full((1, 2), budget))
    kept = [sorted(sel.indices[0, h][sel.keep_mask[0, h]].tolist()) for h in range(2)]
    assert kept[0] == kept[1]  # one token set for every KV head of a layer
    return kept[0], selector.describe_compression(view.shared)


def _neutral(tau: float) -> TableSource:
    return TableSource(neutral=True, neutral_threshold=tau)


def test_over_budget_keeps_the_top_candidates():
    kept, meta = _run(ThresholdGateSelector(_neutral(0.9)), budget=3)
    assert kept == [1, 4, 7]  # the 3 best of the 4 candidates {1, 3, 4, 7}
    assert meta["compilerkv_candidates"] == [[4]] and meta["compilerkv_kept"] == [[3]]


def test_under_budget_pads_with_the_best_non_candidates():
    kept, _ = _run(ThresholdGateSelector(_neutral(0.9)), budget=6)
    assert kept == [1, 3, 4, 5, 6, 7]  # candidates {1,3,4,7} + the best others 0.85 (6) and 0.7 (5)


def test_elastic_keeps_only_candidates_under_budget_and_clamps_over_it():
    kept, meta = _run(ThresholdGateSelector(_neutral(0.9), mode="elastic"), budget=6)
    assert kept == [1, 3, 4, 7] and meta["compilerkv_kept"] == [[4]]
    kept, _ = _run(ThresholdGateSelector(_neutral(0.9), mode="elastic"), budget=2)
    assert kept == [1, 4]
    kept, _ = _run(ThresholdGateSelector(_neutral(5.0), mode="elastic"), budget=4)
    assert kept == [4]  # no candidate at all: the single best entry stays (never an empty head)


def test_padding_makes_the_threshold_irrelevant():
    for tau in (0.8, 0.9, 1.0, 3.0):
        kept, _ = _run(ThresholdGateSelector(_neutral(tau)), budget=5)
        assert kept == [1, 3, 4, 6, 7]


def test_max_normalization_and_kept_window():
    # û / max û = UTILITY / 2: only 2.0 (1.0) and 1.3 (0.65) pass 0.6
    kept, _ = _run(ThresholdGateSelector(_neutral(0.6), mode="elastic", normalize="max"), budget=8)
    assert kept == [1, 4]
    kept, _ = _run(ThresholdGateSelector(_neutral(0.9), mode="elastic", keep_window=2), budget=4)
    assert kept == [1, 4, 6, 7]  # window {6, 7} always; then the best candidates for the remaining 2 slots


def _tables() -> TableSource:
    thresholds = torch.tensor([[[[0.8, 0.9], [1.0, 1.2]]]])  # [budgets=1, layers=1, entropy bins=2, ppl bins=2]
    tables = CompiledTables([8], torch.ones(1, 1, 2), thresholds, torch.tensor([4.0]), torch.tensor([20.0]))
    return TableSource(tables=tables)


@pytest.mark.parametrize(
    ("entropy", "ppl", "tau"), [(3.0, 10.0, 0.8), (3.0, 30.0, 0.9), (5.0, 10.0, 1.0), (5.0, 30.0, 1.2)]
)
def test_threshold_comes_from_the_risk_table(entropy, ppl, tau):
    risk = RiskSignals(torch.tensor([entropy]), torch.tensor([ppl]))
    _, meta = _run(ThresholdGateSelector(_tables(), mode="elastic"), budget=8, risk=risk)
    assert math.isclose(meta["compilerkv_tau"][0][0], tau, rel_tol=1e-6)


def test_missing_logprobs_raise_in_elastic_mode_unless_median_bin():
    risk = RiskSignals(torch.tensor([3.0]), torch.tensor([float("nan")]))
    with pytest.raises(InvalidParameterError, match="log-probs"):
        _run(ThresholdGateSelector(_tables(), mode="elastic"), budget=8, risk=risk)
    _, meta = _run(ThresholdGateSelector(_tables(), mode="elastic", missing_logprobs="median_bin"), 8, risk=risk)
    assert meta["compilerkv_ppl_bin"] == [0]  # the median bin, (bins - 1) // 2
    _run(ThresholdGateSelector(_tables(), mode="pad"), budget=8, risk=risk)  # padding never needs them


def test_static_threshold_ignores_the_table():
    _, meta = _run(ThresholdGateSelector(_tables(), mode="elastic", static_threshold=0.95), budget=8)
    assert math.isclose(meta["compilerkv_tau"][0][0], 0.95, rel_tol=1e-6)


def test_bad_options():
    for bad in ({"mode": "x"}, {"normalize": "mean"}, {"missing_logprobs": "zero"}, {"keep_window": -1}):
        with pytest.raises(ValueError):
            ThresholdGateSelector(_neutral(0.8), **bad)
