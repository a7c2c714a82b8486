"""Horizon-1 conservative Q-learning into a table: the compiler of CompilerKV (arXiv 2602.08686, eq. 4).

An offline contextual bandit: records ``(state, action, reward)``; a tabular ``Q[s, a]`` initialized at 0 minimizes

    E_(s,a,r)~D [ λ · (logsumexp_a' Q(s, a') − Q(s, a)) + ½ (Q(s, a) − r)² ]

(no bootstrap, no target network), with AdamW on minibatches, records weighted ∝ 1 / count(state). The
policy is ``argmax_a Q(s, ·)``; states without records get the caller's default action.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch


@dataclass(frozen=True)
class CQLSettings:
    """Compiler settings.

    The paper's run uses lr 3e-4 and 10 epochs over ~50K prompts; on the few thousand rollouts a 2-core calibration
    affords, that moves Q by less than 0.01, so kvtrim's defaults take larger steps and more epochs, and the
    compiler reports its loss curve to show convergence (same objective, λ, weight decay, batch and seed). The
    learning rate decays linearly to zero over the run.
    """

    conservative_weight: float = 0.75
    lr: float = 0.05
    weight_decay: float = 0.01
    batch_size: int = 4096
    epochs: int = 60
    balance_states: bool = True
    seed: int = 42

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class CQLResult:
    """A compiled table.

    Attributes:
        q: ``[states, actions]`` learned values
        policy: ``[states]`` greedy action index (``default_action`` where a state has no record)
        support: ``[states]`` records per state
        losses: mean loss per epoch
    """

    q: torch.Tensor
    policy: torch.Tensor
    support: torch.Tensor
    losses: list[float] = field(default_factory=list)


def cql_loss(
    q: torch.Tensor,
    states: torch.Tensor,
    actions: torch.Tensor,
    rewards: torch.Tensor,
    conservative_weight: float,
    record_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """CQL objective of the records ``states``, ``actions``, ``rewards`` (each ``[n]``) under table ``q``: the
    mean, or the ``record_weights``-weighted mean."""
    rows = q[states]  # [n, actions]
    taken = rows.gather(1, actions[:, None]).squeeze(1)
    per = conservative_weight * (torch.logsumexp(rows, dim=1) - taken) + 0.5 * (taken - rewards) ** 2
    if record_weights is None:
        return per.mean()
    return (per * record_weights).sum() / record_weights.sum()


def fit_cql(
    states: torch.Tensor,
    actions: torch.Tensor,
    rewards: torch.Tensor,
    num_states: int,
    num_actions: int,
    settings: CQLSettings | None = None,
    default_action: int = 0,
) -> CQLResult:
    """Compile records into a table. ``states``/``actions`` ``[n]`` long, ``rewards`` ``[n]`` float."""
    with torch.inference_mode(False), torch.enable_grad():  # callers may hold inference-mode tensors
        return _fit(states.clone(), actions.clone(), rewards.clone(), num_states, num_actions, settings, default_action)


def _fit(states, actions, rewards, num_states, num_actions, settings, default_action) -> CQLResult:
    settings = settings or CQLSettings()
    n = len(states)
    if not (len(actions) == len(rewards) == n):
        raise ValueError("states, actions and rewards must have the same length")
    if n and (int(states.max()) >= num_states or int(actions.max()) >= num_actions or int(states.min()) < 0):
        raise ValueError("state or action index out of range")
    support = torch.bincount(states, minlength=num_states)
    q = torch.zeros(num_states, num_actions, dtype=torch.float64, requires_grad=True)
    losses: list[float] = []
    if n:
        gen = torch.Generator().manual_seed(settings.seed)
        opt = torch.optim.AdamW([q], lr=settings.lr, weight_decay=settings.weight_decay)
        # Balancing weights each record by 1/count(state): the expectation of the paper's ∝ 1/count minibatch sampling,
        # without its resampling noise (which blurs the small Q gaps near a state's best action).
        weight = (1.0 / support[states].double()) if settings.balance_states else torch.ones(n, dtype=torch.float64)
        s, a, r = states.long(), actions.long(), rewards.double()
        steps = max(1, -(-n // settings.batch_size))
        total_steps = steps * settings.epochs
        # Linear decay to zero: the last steps barely move Q, so the table settles on the objective's minimum.
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: max(0.0, 1.0 - i / total_steps))
        for _ in range(settings.epochs):
            total = 0.0
            order = torch.randperm(n, generator=gen)
            for start in range(0, n, settings.batch_size):
                idx = order[start : start + settings.batch_size]
                loss = cql_loss(q, s[idx], a[idx], r[idx], settings.conservative_weight, weight[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                total += float(loss.detach())
            losses.append(total / steps)
    table = q.detach()
    policy = table.argmax(1)
    policy[support == 0] = default_action
    return CQLResult(q=table.float(), policy=policy, support=support, losses=losses)
