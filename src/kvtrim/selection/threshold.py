"""Risk-adaptive threshold gating with top-k budget correction (CompilerKV, arXiv 2602.08686, eq. 15-16)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..artifacts.compilerkv import KIND, TableSource
from ..errors import InvalidParameterError
from .base import Selector
from .topk import Selection

MODES = ("pad", "elastic")
MISSING_LOGPROBS = ("error", "median_bin")


@dataclass
class ThresholdGateSelector(Selector):
    """Keep the tokens whose utility clears the layer's threshold τ, corrected to the budget.

    τ_l = T_gate[B, l, b_H, b_P] from the compiled risk table (entropy and local-perplexity bins of the prompt,
    from ``view.shared["risk"]``), or ``static_threshold`` for every layer and prompt. Candidates are
    ``{t : û_t ≥ τ}`` (``normalize="max"``: ``û / max û``, the v1 code's comparison). Over budget: the top-B
    candidates by û. Under budget: ``mode="pad"`` (default) fills the budget with the best non-candidates, so
    the kept set is always the top-B by û and τ changes nothing but the reported candidate counts; ``"elastic"``
    keeps only the candidates (memory below the budget; at least one entry). ``keep_window`` > 0 always keeps the
    last ``keep_window`` tokens inside the budget (v1). The token set is the same for every KV head of a layer.

    Args:
        missing_logprobs: without the prompt's log-probs (prefill outside :mod:`kvtrim.api`), ``"error"`` raises
            in elastic mode and ``"median_bin"`` uses the median perplexity bin (pad mode never needs them)
    """

    tables: TableSource
    mode: str = "pad"
    static_threshold: float | None = None
    normalize: str = "none"
    keep_window: int = 0
    missing_logprobs: str = "error"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.normalize not in ("none", "max"):
            raise ValueError(f"normalize must be 'none' or 'max', got {self.normalize!r}")
        if self.missing_logprobs not in MISSING_LOGPROBS:
            raise ValueError(f"missing_logprobs must be one of {MISSING_LOGPROBS}, got {self.missing_logprobs!r}")
        if self.keep_window < 0:
            raise ValueError(f"keep_window must be >= 0, got {self.keep_window}")

    @property
    def artifact_kind(self) -> str | None:
        """The calibration artifact it reads (none for the neutral tables); read by the method registry."""
        return None if self.tables.neutral else KIND

    def bind(self, model: torch.nn.Module) -> None:
        self.tables.bind(model)

    def thresholds(self, view) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``([batch] τ, [batch] entropy bin, [batch] PPL bin)`` for this layer (bins -1 when not used)."""
        shared = view.shared
        batch = view.keys.shape[0]
        device = view.keys.device
        none = torch.full((batch,), -1, dtype=torch.long, device=device)
        if self.static_threshold is not None:
            return torch.full((batch,), float(self.static_threshold), device=device), none, none
        if self.tables.neutral:
            return self.tables.thresholds(view.layer_idx, shared["budget_index"], none, none), none, none
        risk = shared["risk"]
        tables = self.tables.require()
        e_bin, p_bin = tables.risk_bins(risk.entropy, risk.perplexity.nan_to_num(nan=1.0))
        missing = torch.isnan(risk.perplexity)
        if bool(missing.any()):
            if self.mode == "elastic" and self.missing_logprobs == "error":
                raise InvalidParameterError(
                    "CompilerKV's elastic gate needs the prompt's log-probs for its perplexity bin; prefill through "
                    "kvtrim.generate / kvtrim.Session, or set missing_logprobs='median_bin'"
                )
            p_bin = torch.where(missing, torch.full_like(p_bin, (len(tables.ppl_edges)) // 2), p_bin)
        tau = self.tables.thresholds(view.layer_idx, shared["budget_index"], e_bin, p_bin)
        return tau, e_bin, p_bin

    def select(self, view, scores: torch.Tensor, budgets: torch.Tensor) -> Selection:
        """``scores`` ``[batch, kv_heads, seq]`` (û repeated per KV head), ``budgets`` ``[batch, kv_heads]``."""
        u = scores[:, 0].double()  # [b, seq]
        positions = view.positions[:, 0]
        valid = positions >= 0
        budget = budgets[:, 0]
        tau, e_bin, p_bin = self.thresholds(view)
        compare = u
        if self.normalize == "max":
            compare = u / u.masked_fill(~valid, float("-inf")).amax(-1, keepdim=True).clamp(min=1e-30)
        prot = valid & (positions >= (view.context_lengths - self.keep_window)[:, None]) if self.keep_window else (
            torch.zeros_like(valid)
        )
        cand = valid & ~prot & (compare >= tau[:, None].double())
        n_prot, n_cand = prot.sum(-1), cand.sum(-1)
        room = (budget - n_prot).clamp(min=0)
        take = torch.minimum(n_cand, room) if self.mode == "elastic" else room
        count = torch.minimum(n_prot + take, budget).clamp(min=1)
        # Lexicographic key (protected, candidate, û) with offsets wider than û's range, so û still orders
        # candidates (a constant like 1e30 would swallow û in float64).
        finite = u.masked_fill(~valid, 0.0)
        span = (finite.amax(-1, keepdim=True) - finite.amin(-1, keepdim=True)).abs() + 1.0
        key = u + span * (cand.double() + 2.0 * prot.double())
        key = key.masked_fill(~valid, float("-inf"))
        k = int(count.max().clamp(max=u.shape[-1]))
        top = key.topk(k, dim=-1)
        keep = (torch.arange(k, device=count.device)[None, :] < count[:, None]) & torch.isfinite(top.values)
        indices, order = top.indices.sort(dim=-1)
        keep = torch.gather(keep, -1, order)
        h = view.kv_heads
        view.shared.setdefault("compilerkv_gate", []).append(  # one record per layer, for the metadata
            {"layer": view.layer_idx, "tau": tau, "candidates": n_cand, "kept": keep.sum(-1), "budget": budget,
             "entropy_bin": e_bin, "ppl_bin": p_bin, "context": view.context_lengths}
        )
        return Selection(indices=indices[:, None].expand(-1, h, -1), keep_mask=keep[:, None].expand(-1, h, -1))

    def describe_compression(self, shared: dict) -> dict:
        """Per-compression metadata: thresholds, candidate counts, risk signals and the compiled budget used."""
        records = shared.get("compilerkv_gate")
        if not records:
            return {}
        risk = shared.get("risk")
        rows = range(len(records[0]["tau"]))
        out = {
            "compilerkv_mode": self.mode,
            "compilerkv_tau": [[float(r["tau"][b]) for r in records] for b in rows],
            "compilerkv_candidates": [[int(r["candidates"][b]) for r in records] for b in rows],
            "compilerkv_kept": [[int(r["kept"][b]) for r in records] for b in rows],
            "compilerkv_entropy_bin": records[0]["entropy_bin"].tolist(),
            "compilerkv_ppl_bin": records[0]["ppl_bin"].tolist(),
            "compilerkv_requested_budget": [int(b) for b in records[0]["budget"].tolist()],
            "compilerkv_compiled_budget": shared.get("compiled_budget"),
        }
        if risk is not None:
            out["compilerkv_entropy"] = risk.entropy.tolist()
            out["compilerkv_perplexity"] = risk.perplexity.tolist()
        return out
