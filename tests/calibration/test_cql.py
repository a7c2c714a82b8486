"""The tabular horizon-1 CQL compiler."""

from __future__ import annotations

import torch

from kvtrim.calibration.cql import CQLSettings, cql_loss, fit_cql


def _bandit(states: int, actions: int, n: int, noise: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    best = torch.randint(0, actions, (states,), generator=g)
    # A balanced logging design (every action equally often per state, in random order), as the calibration
    # logs: CQL's conservative term then favours no action over another, and the optimum is identifiable.
    per = n // (states * actions)
    s = torch.arange(states).repeat_interleave(actions * per)
    a = torch.cat([torch.randperm(actions * per, generator=g) % actions for _ in range(states)])
    r = -2.0 * (a - best[s]).float().abs() / actions + noise * torch.randn(n, generator=g)  # ΔNLL-like scale
    return best, s, a, r


def test_compiler_finds_the_optimal_actions_of_a_synthetic_bandit():
    best, s, a, r = _bandit(states=12, actions=21, n=12 * 21 * 40, noise=0.05)
    result = fit_cql(s, a, r, 12, 21, CQLSettings(batch_size=1024))
    assert torch.equal(result.policy, best)
    assert result.losses[-1] < result.losses[0]


def test_unvisited_states_get_the_default_and_support_counts_records():
    s = torch.tensor([0, 0, 2, 2, 2])
    a = torch.tensor([1, 1, 0, 0, 0])
    r = torch.tensor([1.0, 1.0, 0.5, 0.5, 0.5])
    result = fit_cql(s, a, r, 4, 3, CQLSettings(epochs=100, batch_size=8), default_action=2)
    assert result.support.tolist() == [2, 0, 3, 0]
    assert result.policy.tolist() == [1, 2, 0, 2]


def test_conservative_term_prefers_logged_actions_over_unseen_ones():
    # One state, only action 0 logged, with a small negative reward: Q of unseen actions is pushed below it.
    s, a, r = torch.zeros(50, dtype=torch.long), torch.zeros(50, dtype=torch.long), torch.full((50,), -0.1)
    result = fit_cql(s, a, r, 1, 5, CQLSettings(epochs=300, batch_size=64))
    assert int(result.policy[0]) == 0
    assert float(result.q[0, 0]) > float(result.q[0, 1:].max())


def test_loss_matches_the_formula():
    q = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
    s, a, r = torch.tensor([0, 1]), torch.tensor([1, 0]), torch.tensor([0.5, 1.0])
    lse = torch.logsumexp(q, dim=1)
    expected = ((0.75 * (lse[0] - 1.0) + 0.5 * 0.25) + (0.75 * (lse[1] - 2.0) + 0.5 * 1.0)) / 2
    assert torch.isclose(cql_loss(q, s, a, r, 0.75), expected)
