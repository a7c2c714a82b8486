"""Offline compilation of CompilerKV's tables from the model's own rollouts (arXiv 2602.08686, eq. 2-4 and 14).

The experience is an offline contextual bandit, compiled into the two tables by horizon-1 CQL
(:mod:`kvtrim.calibration.cql`). The authors sweep one head's weight at a time over its grid for every
(layer, head, budget) and prompt; on two CPU cores that is ~23k rollouts per prompt for the embedded model, so
kvtrim logs **random joint actions with per-head credit** instead:

* Each rollout compresses a prefilled calibration prompt with the *complete* CompilerKV operator (utility, head
  weights, gate, clamp) under a joint action: every head's weight (head phase) or every layer's threshold (gate
  phase) drawn from its grid, then measures the teacher-forced NLL of the document's next ``continuation_tokens``
  tokens with that cache. The reward ``−(NLL_comp − NLL_full)`` is credited to every state with the action it
  took there (a factorial design: one rollout yields a record for each of the 270 head states of a budget).
* Actions are logged in a balanced random order (every action equally often per state, up to one), so CQL's
  conservative term favours no action over another, and across states they are independent.
* One prefill per document serves every rollout of every budget and phase; rollouts differ only in the
  compression and the 128-token continuation pass.
* Phases alternate as the paper describes: head records under the current gate table (pad mode, the deployed
  default), then gate records under the just-compiled head table, in elastic mode (with padding the gate
  cannot change the kept set, so only elastic rollouts carry a gate signal); gate rewards subtract the budget
  penalty ``max(0, |I_cand| − B)/T``. Each record carries the round of the opposite table (``paired_policy``).
"""

from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..artifacts.compilerkv import (
    HEAD_ACTIONS,
    KIND,
    NEUTRAL_WEIGHT,
    THRESHOLD_ACTIONS,
    UNVISITED_THRESHOLD,
    CompiledTables,
)
from ..artifacts.store import save_artifact
from ..compression.compressor import BudgetSpec
from ..errors import InvalidParameterError
from ..integration.attention import kvtrim_attention_enabled
from ..runtime import Prefill
from ..scoring.risk import bin_index, quantile_edges
from .cql import CQLResult, CQLSettings, fit_cql


@dataclass(frozen=True)
class CompilerKVCalibration:
    """Settings of one compilation.

    Attributes:
        budgets: compiled budgets (entries per layer)
        documents: calibration prompts
        prompt_tokens, continuation_tokens: prompt length T and the continuation scored by the NLL
        head_rollouts, gate_rollouts: random joint actions per (document, budget) in each phase
        rounds: head/gate alternations (stops early when neither policy changes)
        corpus: ``"pydoc"`` (CPython's bundled language-reference prose, ``pydoc_data.topics``) or a directory of
            ``.txt``/``.md`` files; either way disjoint from kvtrim's evaluation haystacks
    """

    budgets: tuple[int, ...] = (64, 128, 256)
    documents: int = 32
    prompt_tokens: int = 1000
    continuation_tokens: int = 128
    head_rollouts: int = 10
    gate_rollouts: int = 6
    rounds: int = 1
    window: int = 64
    entropy_bins: int = 20
    ppl_bins: int = 4
    seed: int = 1234
    corpus: str = "pydoc"
    cql: CQLSettings = field(default_factory=CQLSettings)

    def __post_init__(self) -> None:
        checks = {
            "documents": self.documents,
            "prompt_tokens": self.prompt_tokens,
            "continuation_tokens": self.continuation_tokens,
            "head_rollouts": self.head_rollouts,
            "gate_rollouts": self.gate_rollouts,
            "rounds": self.rounds,
        }
        for name, value in checks.items():
            if not isinstance(value, int) or value <= 0:
                raise InvalidParameterError(f"{name} must be a positive integer, got {value!r}")
        if not self.budgets or any(not isinstance(b, int) or b <= 0 for b in self.budgets):
            raise InvalidParameterError(f"budgets must be positive integers, got {self.budgets!r}")
        if max(self.budgets) >= self.prompt_tokens:
            raise InvalidParameterError(
                f"every budget must be below prompt_tokens={self.prompt_tokens} (got {max(self.budgets)}): "
                "a budget at or above the prompt evicts nothing and teaches the tables nothing"
            )

    def as_dict(self) -> dict:
        out = asdict(self)
        out["budgets"] = list(self.budgets)
        return out


@dataclass
class CalibrationDocument:
    """A prompt and its continuation (token ids ``[T + C]``) with where it came from."""

    ids: torch.Tensor
    source: str


def corpus_documents(tokenizer, settings: CompilerKVCalibration) -> list[CalibrationDocument]:
    """Non-overlapping windows of ``prompt_tokens + continuation_tokens`` tokens from the corpus, shuffled by the
    seed; the first ``documents`` of them."""
    span = settings.prompt_tokens + settings.continuation_tokens
    if settings.corpus == "pydoc":
        from pydoc_data.topics import topics

        texts = [(f"pydoc:{key}", topics[key]) for key in sorted(topics)]
    else:
        root = Path(settings.corpus).expanduser()
        if not root.is_dir():
            raise InvalidParameterError(f"corpus={settings.corpus!r}: expected 'pydoc' or a directory of text files")
        files = sorted(p for p in root.rglob("*") if p.suffix in (".txt", ".md") and p.is_file())
        texts = [(str(p.relative_to(root)), p.read_text(errors="replace")) for p in files]
    windows = []
    for name, text in texts:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
        for start in range(0, len(ids) - span + 1, span):
            windows.append(CalibrationDocument(ids[start : start + span].clone(), f"{name}@{start}"))
    if len(windows) < settings.documents:
        raise InvalidParameterError(
            f"documents={settings.documents}: the corpus {settings.corpus!r} has only {len(windows)} windows of "
            f"{span} tokens"
        )
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(settings.seed)).tolist()
    return [windows[i] for i in order[: settings.documents]]


def _balanced_actions(states: int, length: int, actions: int, gen: torch.Generator) -> torch.Tensor:
    """``[states, length]`` action indices: per state, concatenated random permutations of the grid."""
    reps = -(-length // actions)
    perms = [torch.cat([torch.randperm(actions, generator=gen) for _ in range(reps)])[:length] for _ in range(states)]
    return torch.stack(perms)


@dataclass
class _Prefilled:
    prefill: Prefill
    first_logprob: float  # log p(first continuation token | prompt), identical for every cache of this prompt
    full_nll: float
    entropy: float = float("nan")
    perplexity: float = float("nan")


class _Rollouts:
    """Runs the CompilerKV operator on prefilled prompts and scores continuations."""

    def __init__(self, model, settings: CompilerKVCalibration):
        from ..methods import get_method

        self.model, self.settings = model, settings
        self.pipelines = {m: get_method("compilerkv", mode=m, window=settings.window) for m in ("pad", "elastic")}
        self.observation = self.pipelines["pad"].observation

    def prefill(self, doc: CalibrationDocument) -> _Prefilled:
        T = self.settings.prompt_tokens
        ids = doc.ids[None, :T]
        pre = Prefill.plain(self.model, ids, torch.ones_like(ids), self.observation)
        cont = doc.ids[T]
        first = float(torch.log_softmax(pre.logits.float(), -1)[0, cont])
        return _Prefilled(pre, first, self.nll(pre.compressed(None, None).cache, doc, first))

    def nll(self, cache, doc: CalibrationDocument, first_logprob: float) -> float:
        """Mean teacher-forced NLL of the continuation over ``cache`` (consumed); ``first_logprob`` scores its
        first token, which the prompt's last position predicts before any compression."""
        T, C = self.settings.prompt_tokens, self.settings.continuation_tokens
        cont = doc.ids[None, T : T + C]
        out = self.model(
            input_ids=cont[:, :-1],
            position_ids=torch.arange(T, T + C - 1, device=cont.device)[None],
            past_key_values=cache,
            use_cache=True,
        )
        logp = torch.log_softmax(out.logits.float(), -1)[0].gather(-1, cont[0, 1:, None]).squeeze(-1)
        return -(float(logp.sum()) + first_logprob) / C

    def run(self, pre: _Prefilled, doc, mode: str, budget: int, tables: CompiledTables) -> tuple[float, dict]:
        """Compress a copy of ``pre`` with ``tables`` in ``mode``; return (ΔNLL, compression metadata)."""
        pipeline = self.pipelines[mode]
        pipeline.scorer.tables.use(tables)  # the scorer's source is the selector's too
        compressed = pre.prefill.compressed(pipeline, BudgetSpec(budget=budget))
        return self.nll(compressed.cache, doc, pre.first_logprob) - pre.full_nll, compressed.report.metadata


def _tables(budget: int, weights: torch.Tensor, thresholds: torch.Tensor, edges: tuple) -> CompiledTables:
    return CompiledTables([budget], weights[None], thresholds[None], edges[0], edges[1])


def _progress(enabled: bool, message: str) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)


def calibrate_compilerkv(
    model,
    tokenizer,
    settings: CompilerKVCalibration | None = None,
    out_dir: str | Path | None = None,
    progress: bool = True,
) -> Path:
    """Collect experience, compile both tables with CQL and save the ``compilerkv`` artifact; returns its path."""
    settings = settings or CompilerKVCalibration()
    cfg = model.config
    L, H = int(cfg.num_hidden_layers), int(cfg.num_attention_heads)
    budgets, nb = list(settings.budgets), len(settings.budgets)
    T = settings.prompt_tokens
    start = time.perf_counter()
    cpu0 = time.process_time()
    gen = torch.Generator().manual_seed(settings.seed)
    docs = corpus_documents(tokenizer, settings)
    checksum = hashlib.sha256(b"".join(d.ids.numpy().astype("int64").tobytes() for d in docs)).hexdigest()
    runner = _Rollouts(model, settings)
    weights = torch.full((nb, L, H), NEUTRAL_WEIGHT)
    placeholder_edges = (torch.zeros(settings.entropy_bins - 1), torch.zeros(settings.ppl_bins - 1))
    thresholds = torch.full((nb, L, settings.entropy_bins, settings.ppl_bins), UNVISITED_THRESHOLD)
    history: list[dict] = []
    head_fit: CQLResult | None = None
    gate_fit: CQLResult | None = None
    edges = placeholder_edges
    rounds_run = 0
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        prefilled = []
        for i, doc in enumerate(docs):
            prefilled.append(runner.prefill(doc))
            _progress(progress, f"[compilerkv] prefill {i + 1}/{len(docs)} full NLL {prefilled[-1].full_nll:.3f}")
        default_head = int((HEAD_ACTIONS - NEUTRAL_WEIGHT).abs().argmin())
        for rnd in range(settings.rounds):
            rounds_run = rnd + 1
            # ---- head phase: joint random head weights, gate fixed at the current table (pad mode)
            n_head = len(docs) * settings.head_rollouts
            plan = _balanced_actions(nb * L * H, n_head, len(HEAD_ACTIONS), gen).view(nb, L, H, n_head)
            h_states, h_actions, h_rewards = [], [], []
            state_ids = torch.arange(nb * L * H).view(nb, L, H)
            for bi, budget in enumerate(budgets):
                for d, (doc, pre) in enumerate(zip(docs, prefilled, strict=True)):
                    for k in range(settings.head_rollouts):
                        col = d * settings.head_rollouts + k
                        action = plan[bi, :, :, col]
                        t = _tables(budget, HEAD_ACTIONS[action], thresholds[bi], edges)
                        delta, meta = runner.run(pre, doc, "pad", budget, t)
                        if rnd == 0 and bi == 0 and k == 0:
                            pre.entropy = meta["compilerkv_entropy"][0]
                            pre.perplexity = meta["compilerkv_perplexity"][0]
                        h_states.append(state_ids[bi].reshape(-1))
                        h_actions.append(action.reshape(-1))
                        h_rewards.append(torch.full((L * H,), -delta))
                    _progress(progress, f"[compilerkv] round {rnd + 1} heads B={budget} doc {d + 1}/{len(docs)}")
            if rnd == 0:
                entropy = torch.tensor([p.entropy for p in prefilled])
                ppl = torch.tensor([p.perplexity for p in prefilled])
                edges = (quantile_edges(entropy, settings.entropy_bins), quantile_edges(ppl, settings.ppl_bins))
            head_fit = fit_cql(
                torch.cat(h_states), torch.cat(h_actions), torch.cat(h_rewards), nb * L * H, len(HEAD_ACTIONS),
                settings.cql, default_action=default_head,
            )
            new_weights = HEAD_ACTIONS[head_fit.policy].view(nb, L, H)
            head_changed = not torch.equal(new_weights, weights)
            weights = new_weights
            # ---- gate phase: joint random thresholds per layer, head table fixed (elastic mode)
            n_gate = len(docs) * settings.gate_rollouts
            gplan = _balanced_actions(nb * L, n_gate, len(THRESHOLD_ACTIONS), gen).view(nb, L, n_gate)
            g_states, g_actions, g_rewards, deltas = [], [], [], []
            nE, nP = settings.entropy_bins, settings.ppl_bins
            for bi, budget in enumerate(budgets):
                for d, (doc, pre) in enumerate(zip(docs, prefilled, strict=True)):
                    e_bin = int(bin_index(torch.tensor([pre.entropy]), edges[0]))
                    p_bin = int(bin_index(torch.tensor([pre.perplexity]), edges[1]))
                    for k in range(settings.gate_rollouts):
                        action = gplan[bi, :, d * settings.gate_rollouts + k]  # [L]
                        gate = THRESHOLD_ACTIONS[action][:, None, None].expand(L, nE, nP).clone()
                        t = _tables(budget, weights[bi], gate, edges)
                        delta, meta = runner.run(pre, doc, "elastic", budget, t)
                        cand = torch.tensor(meta["compilerkv_candidates"][0], dtype=torch.float32)
                        penalty = (cand - budget).clamp(min=0) / T
                        states = ((bi * L + torch.arange(L)) * nE + e_bin) * nP + p_bin
                        g_states.append(states)
                        g_actions.append(action)
                        g_rewards.append(-delta - penalty)
                        deltas.append(delta)
                    _progress(progress, f"[compilerkv] round {rnd + 1} gate B={budget} doc {d + 1}/{len(docs)}")
            gate_fit = fit_cql(
                torch.cat(g_states), torch.cat(g_actions), torch.cat(g_rewards), nb * L * nE * nP,
                len(THRESHOLD_ACTIONS), settings.cql, default_action=0,
            )
            new_thresholds = THRESHOLD_ACTIONS[gate_fit.policy].view(nb, L, nE, nP)
            gate_changed = not torch.equal(new_thresholds, thresholds)
            thresholds = new_thresholds
            head_delta = -torch.stack([r[0] for r in h_rewards])
            history.append(
                {
                    "round": rnd + 1,
                    "head_records": int(sum(len(s) for s in h_states)),
                    "head_rollouts": len(h_rewards),
                    "head_paired_policy": f"gate round {rnd}",
                    "head_mean_delta_nll": float(head_delta.mean()),
                    "gate_records": int(sum(len(s) for s in g_states)),
                    "gate_rollouts": len(deltas),
                    "gate_paired_policy": f"head round {rnd + 1}",
                    "gate_mean_delta_nll": float(torch.tensor(deltas).mean()),
                    "head_changed": head_changed,
                    "gate_changed": gate_changed,
                    "head_cql_losses": head_fit.losses,
                    "gate_cql_losses": gate_fit.losses,
                }
            )
            _progress(progress, f"[compilerkv] round {rnd + 1}: head changed {head_changed}, gate {gate_changed}")
            if rnd > 0 and not head_changed and not gate_changed:
                break
    tables = CompiledTables(
        budgets=budgets,
        head_weights=weights,
        thresholds=thresholds,
        entropy_edges=edges[0],
        ppl_edges=edges[1],
        head_support=head_fit.support.view(nb, L, H),
        gate_support=gate_fit.support.view(nb, L, settings.entropy_bins, settings.ppl_bins),
    )
    full = torch.tensor([p.full_nll for p in prefilled])
    meta = {
        "settings": settings.as_dict(),
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu0,
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "corpus_checksum_sha256": checksum,
        "documents": [d.source for d in docs],
        "full_nll_mean": float(full.mean()),
        "risk_signals": {"entropy": [p.entropy for p in prefilled], "perplexity": [p.perplexity for p in prefilled]},
        "rounds_run": rounds_run,
        "history": history,
        "action_grids": {"head": HEAD_ACTIONS.tolist(), "threshold": THRESHOLD_ACTIONS.tolist()},
        "defaults": {"unvisited_head_weight": NEUTRAL_WEIGHT, "unvisited_threshold": UNVISITED_THRESHOLD},
        "summary": {
            "rollouts": int(sum(h["head_rollouts"] + h["gate_rollouts"] for h in history)),
            "head_states_visited": int((tables.head_support > 0).sum()),
            "gate_states_visited": int((tables.gate_support > 0).sum()),
            "gate_states": int(tables.gate_support.numel()),
            "head_weight_mean": float(weights.mean()),
            "threshold_mean_visited": float(thresholds[tables.gate_support > 0].mean())
            if bool((tables.gate_support > 0).any())
            else None,
        },
    }
    return save_artifact(KIND, model, tables.tensors(), meta, out_dir)
