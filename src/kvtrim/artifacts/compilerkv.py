"""CompilerKV's compiled tables: the head reliability table and the risk threshold table, with their bin edges.

Stored as the ``compilerkv`` artifact of a model (``kvtrim calibrate compilerkv``):

* ``head_weights`` ``[budgets, layers, q_heads]`` reliability weight per query head, in [0.8, 1.5];
* ``thresholds`` ``[budgets, layers, entropy_bins, ppl_bins]`` risk-adaptive threshold τ, in [0.8, 1.0];
* ``entropy_edges`` / ``ppl_edges``: the inner quantile edges of the calibration risk signals;
* ``budgets``: the compiled budgets (entries per layer); ``head_support`` / ``gate_support``: records per state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InvalidParameterError
from .kinds import COMPILERKV_KIND as KIND
from .store import load_artifact

HEAD_ACTIONS = torch.linspace(0.8, 1.5, 29)
THRESHOLD_ACTIONS = torch.linspace(0.8, 1.0, 21)
NEUTRAL_WEIGHT = 1.0
UNVISITED_THRESHOLD = 0.8  # the lowest, most conservative threshold: decision 2 (docs/decisions.md)


def bin_index(values: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Bin of each value given ascending inner ``edges`` (``len(edges) + 1`` bins; ``searchsorted`` side=right)."""
    return torch.searchsorted(edges.to(values.device, values.dtype).contiguous(), values.contiguous(), right=True)


@dataclass
class CompiledTables:
    """The two tables and what indexes them."""

    budgets: list[int]
    head_weights: torch.Tensor
    thresholds: torch.Tensor
    entropy_edges: torch.Tensor
    ppl_edges: torch.Tensor
    head_support: torch.Tensor | None = None
    gate_support: torch.Tensor | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        nb = len(self.budgets)
        if self.head_weights.dim() != 3 or self.head_weights.shape[0] != nb:
            shape = tuple(self.head_weights.shape)
            raise ValueError(f"head_weights must be [budgets={nb}, layers, q_heads], got {shape}")
        expected = (nb, self.head_weights.shape[1], len(self.entropy_edges) + 1, len(self.ppl_edges) + 1)
        if tuple(self.thresholds.shape) != expected:
            raise ValueError(f"thresholds must be {expected}, got {tuple(self.thresholds.shape)}")

    @property
    def num_layers(self) -> int:
        return self.head_weights.shape[1]

    def budget_index(self, budget: int, exact: bool = False) -> int:
        """Index of the compiled budget nearest to ``budget`` (ties: the smaller); ``exact`` requires a match."""
        if budget in self.budgets:
            return self.budgets.index(budget)
        if exact:
            raise InvalidParameterError(
                f"budget {budget} was not compiled (compiled budgets: {self.budgets}); pass exact_budget=False to "
                "use the nearest one, or compile it with `kvtrim calibrate compilerkv --budgets ...`"
            )
        return min(range(len(self.budgets)), key=lambda i: (abs(self.budgets[i] - budget), self.budgets[i]))

    def risk_bins(self, entropy: torch.Tensor, perplexity: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``([batch], [batch])`` entropy and PPL bins with the stored edges."""
        return bin_index(entropy.float(), self.entropy_edges), bin_index(perplexity.float(), self.ppl_edges)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {
            "budgets": torch.tensor(self.budgets, dtype=torch.long),
            "head_weights": self.head_weights.float(),
            "thresholds": self.thresholds.float(),
            "entropy_edges": self.entropy_edges.float(),
            "ppl_edges": self.ppl_edges.float(),
        }
        if self.head_support is not None:
            out["head_support"] = self.head_support.long()
        if self.gate_support is not None:
            out["gate_support"] = self.gate_support.long()
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> CompiledTables:
        return cls(
            budgets=[int(b) for b in tensors["budgets"].tolist()],
            head_weights=tensors["head_weights"],
            thresholds=tensors["thresholds"],
            entropy_edges=tensors["entropy_edges"],
            ppl_edges=tensors["ppl_edges"],
            head_support=tensors.get("head_support"),
            gate_support=tensors.get("gate_support"),
            meta=dict(meta or {}),
        )


def load_compilerkv(model: torch.nn.Module, path: str | None = None) -> CompiledTables:
    """The model's compiled tables (raises :class:`~kvtrim.errors.MissingArtifactError` naming the command)."""
    artifact = load_artifact(KIND, model, path)
    tables = CompiledTables.from_tensors(artifact.tensors, artifact.meta)
    q_heads = int(model.config.num_attention_heads)
    layers = int(model.config.num_hidden_layers)
    if tables.head_weights.shape[1:] != (layers, q_heads):
        raise InvalidParameterError(
            f"compilerkv tables are for {tuple(tables.head_weights.shape[1:])} (layers, heads), the model has "
            f"({layers}, {q_heads}); run `kvtrim calibrate compilerkv` for this model"
        )
    return tables


@dataclass
class TableSource:
    """Where a CompilerKV operator gets its tables: the model's artifact, or the neutral ablation.

    One instance is shared by the scorer (head weights) and the selector (thresholds) of a method, so the artifact
    is loaded once when the method is bound to a model.

    Args:
        neutral: all head weights 1 and a fixed threshold (the ``compilerkv_neutral`` ablation; no artifact)
        neutral_threshold: the fixed threshold of the neutral variant
        path: an explicit artifact path (default: the model's artifact in the kvtrim home or the package)
        exact_budget: require the budget to be one of the compiled budgets (default: use the nearest)
    """

    neutral: bool = False
    neutral_threshold: float = UNVISITED_THRESHOLD
    path: str | None = None
    exact_budget: bool = False
    tables: CompiledTables | None = field(default=None, repr=False)

    def bind(self, model: torch.nn.Module) -> None:
        if not self.neutral and self.tables is None:
            self.tables = load_compilerkv(model, self.path)

    def use(self, tables: CompiledTables) -> None:
        """Serve ``tables`` (compiled in memory, e.g. by the calibration's rollouts) from now on, instead of the
        artifact; the scorer and the selector sharing this source both see them."""
        self.tables = tables

    def require(self) -> CompiledTables:
        """The tables in use; a clear error when neither an artifact nor :meth:`use` has supplied them."""
        if self.tables is None:
            raise InvalidParameterError(
                "CompilerKV needs the model's compiled tables: resolve the method through kvtrim.generate, "
                "kvtrim.Session or kvtrim.compressing, or call pipeline.bind(model) first"
            )
        return self.tables

    def budget_info(self, budgets: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """``([batch] table index, compiled budget used per row)`` for per-row budgets ``[batch]``."""
        if self.neutral:
            return torch.zeros_like(budgets), [int(b) for b in budgets.tolist()]
        tables = self.require()
        idx = [tables.budget_index(int(b), self.exact_budget) for b in budgets.tolist()]
        return torch.tensor(idx, dtype=torch.long, device=budgets.device), [tables.budgets[i] for i in idx]

    def head_weights(self, layer: int, budget_idx: torch.Tensor, q_heads: int) -> torch.Tensor:
        """``[batch, q_heads]`` head reliability weights of ``layer``."""
        if self.neutral:
            return torch.full((len(budget_idx), q_heads), NEUTRAL_WEIGHT, device=budget_idx.device)
        # the tables stay on the CPU (a few KB); the rows' entries move to the data's device
        return self.require().head_weights[budget_idx.cpu(), layer].float().to(budget_idx.device)

    def thresholds(
        self, layer: int, budget_idx: torch.Tensor, entropy_bin: torch.Tensor, ppl_bin: torch.Tensor
    ) -> torch.Tensor:
        """``[batch]`` threshold τ of ``layer`` for each row's risk bins."""
        if self.neutral:
            return torch.full((len(budget_idx),), float(self.neutral_threshold), device=budget_idx.device)
        table = self.require().thresholds
        return table[budget_idx.cpu(), layer, entropy_bin.cpu(), ppl_bin.cpu()].float().to(budget_idx.device)


def plot_compilerkv(tables: CompiledTables, target) -> None:
    """The policy visualizations: per compiled budget (rows), the head reliability table (layer × head) and the
    threshold table for each perplexity bin (layer × entropy bin); unvisited gate states are hatched grey."""
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    nb, n_p = len(tables.budgets), tables.thresholds.shape[-1]
    fig, axes = plt.subplots(nb, 1 + n_p, figsize=(3.2 * (1 + n_p), 3.6 * nb), squeeze=False)
    for bi, budget in enumerate(tables.budgets):
        ax = axes[bi, 0]
        image = ax.imshow(tables.head_weights[bi].numpy(), aspect="auto", cmap="viridis", vmin=0.8, vmax=1.5)
        ax.set_title(f"B={budget}: head weights", fontsize=9)
        ax.set_xlabel("query head")
        ax.set_ylabel("layer")
        fig.colorbar(image, ax=ax)
        for p in range(n_p):
            ax = axes[bi, 1 + p]
            values = tables.thresholds[bi, :, :, p].numpy().copy()
            if tables.gate_support is not None:
                values[tables.gate_support[bi, :, :, p].numpy() == 0] = float("nan")
            cmap = matplotlib.colormaps["magma"].with_extremes(bad="#cccccc")
            image = ax.imshow(values, aspect="auto", cmap=cmap, vmin=0.8, vmax=1.0)
            ax.set_title(f"B={budget}: threshold, PPL bin {p}", fontsize=9)
            ax.set_xlabel("entropy bin")
            fig.colorbar(image, ax=ax)
    fig.suptitle("CompilerKV compiled tables (grey: no calibration record, threshold 0.8)", fontsize=10)
    fig.tight_layout()
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, dpi=110)
    plt.close(fig)
