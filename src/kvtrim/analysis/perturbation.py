"""CriticalKV's perturbation analysis: attention-output L1 perturbation of attention-only selection vs. critical
selection, per layer and per head, at several budgets (Feng et al., arXiv 2502.03805)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..eval.fidelity import capture_decoding_queries, layer_errors, prefill
from ..eval.haystacks import get_haystack
from ..methods import get_method


@dataclass
class PerturbationReport:
    """Mean perturbations over prompts.

    Attributes:
        head_l1: ``{method: {budget: [layers, q_heads]}}`` mean ``‖Δa_h·W_O[h]‖₁`` per query head
        layer_l1: ``{method: {budget: [layers]}}`` mean ``‖Δo‖₁`` of the layer's attention output
        fraction_improved: ``{budget: float}`` share of query heads whose perturbation is lower with critical
            selection than with attention-only selection (head means over prompts)
    """

    baseline: str
    critical: str
    budgets: list[int]
    prompts: int
    context_tokens: int
    queries: int
    head_l1: dict = field(default_factory=dict)
    layer_l1: dict = field(default_factory=dict)
    fraction_improved: dict = field(default_factory=dict)
    layer_fraction_improved: dict = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        for key in ("head_l1", "layer_l1"):
            out[key] = {m: {str(b): t.tolist() for b, t in v.items()} for m, v in getattr(self, key).items()}
        out["fraction_improved"] = {str(b): v for b, v in self.fraction_improved.items()}
        out["layer_fraction_improved"] = {str(b): v for b, v in self.layer_fraction_improved.items()}
        return out


def text_windows(tokenizer, count: int, tokens: int, text: str | None = None) -> list[torch.Tensor]:
    """``count`` disjoint windows of ``tokens`` token ids from ``text`` (default: the Jargon File prose)."""
    ids = tokenizer(text if text is not None else get_haystack("jargon"), add_special_tokens=False)["input_ids"]
    if len(ids) < count * tokens:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {count} windows of {tokens}")
    stride = len(ids) // count
    return [torch.tensor(ids[i * stride : i * stride + tokens]) for i in range(count)]


@torch.inference_mode()
def perturbation_analysis(
    model,
    tokenizer,
    budgets: list[int],
    prompts: int = 4,
    context_tokens: int = 512,
    queries: int = 16,
    baseline: str = "snapkv",
    critical: str = "critical_snapkv",
    text: str | None = None,
) -> PerturbationReport:
    """Compare ``baseline`` (attention-only) and ``critical`` selection on the same prefills.

    Each prompt is a window of ``context_tokens + queries`` tokens; the first part is prefilled and compressed,
    and the next ``queries`` tokens are the decoding queries whose per-layer attention output is compared with
    the full cache (each layer isolated: same queries and new keys as the full run).
    """
    started = time.perf_counter()
    report = PerturbationReport(baseline, critical, list(budgets), prompts, context_tokens, queries)
    sums = {m: {b: None for b in budgets} for m in (baseline, critical)}
    layer_sums = {m: {b: None for b in budgets} for m in (baseline, critical)}
    pipes = [get_method(baseline), get_method(critical)]
    for window in tqdm(text_windows(tokenizer, prompts, context_tokens + queries, text), desc="prompts"):
        pre = prefill(model, window[:context_tokens], methods=pipes)
        capture = capture_decoding_queries(model, pre.full_cache(), window[context_tokens:])
        for budget in budgets:
            for method in (baseline, critical):
                errors = layer_errors(capture, pre.compressed_cache(method, budget=budget))
                for store, value in ((sums, errors.head_l1), (layer_sums, errors.l1)):
                    prev = store[method][budget]
                    store[method][budget] = value.clone() if prev is None else prev + value
    for method in (baseline, critical):
        report.head_l1[method] = {b: sums[method][b] / prompts for b in budgets}
        report.layer_l1[method] = {b: layer_sums[method][b] / prompts for b in budgets}
    for b in budgets:
        better = report.head_l1[critical][b] < report.head_l1[baseline][b]
        report.fraction_improved[b] = float(better.float().mean())
        better_layers = report.layer_l1[critical][b] < report.layer_l1[baseline][b]
        report.layer_fraction_improved[b] = float(better_layers.float().mean())
    report.seconds = time.perf_counter() - started
    return report


def write_report(report: PerturbationReport, out_dir: str | Path) -> list[Path]:
    """Write ``perturbation.json``, ``perturbation.md`` and plots into ``out_dir``; returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "perturbation.json", out / "perturbation.md"]
    files[0].write_text(json.dumps(report.as_dict(), indent=1))
    base, crit = report.baseline, report.critical
    lines = [
        f"# Output perturbation: {crit} vs {base}",
        "",
        f"{report.prompts} prompts of {report.context_tokens} context tokens (Jargon File prose), "
        f"{report.queries} decoding queries, per-layer isolated errors; {report.seconds:.0f} s.",
        "",
        "| budget | mean layer L1 (attention-only) | mean layer L1 (critical) | heads improved | layers improved |",
        "|---|---|---|---|---|",
    ]
    for b in report.budgets:
        lines.append(
            f"| {b} | {float(report.layer_l1[base][b].mean()):.2f} | {float(report.layer_l1[crit][b].mean()):.2f} "
            f"| {100 * report.fraction_improved[b]:.1f}% | {100 * report.layer_fraction_improved[b]:.1f}% |"
        )
    files[1].write_text("\n".join(lines) + "\n")

    fig, axes = plt.subplots(1, len(report.budgets), figsize=(4 * len(report.budgets), 3.2), squeeze=False)
    for ax, b in zip(axes[0], report.budgets, strict=True):
        ax.plot(report.layer_l1[base][b].numpy(), label=f"{base} (attention)")
        ax.plot(report.layer_l1[crit][b].numpy(), label=f"{crit}")
        ax.set_title(f"budget {b}")
        ax.set_xlabel("layer")
        ax.set_ylabel("attention-output L1")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    files.append(out / "perturbation_per_layer.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(report.budgets), figsize=(4 * len(report.budgets), 4), squeeze=False)
    for ax, b in zip(axes[0], report.budgets, strict=True):
        rel = (report.head_l1[crit][b] - report.head_l1[base][b]) / report.head_l1[base][b].clamp(min=1e-9)
        im = ax.imshow(rel.numpy(), aspect="auto", cmap="RdBu_r", vmin=-0.5, vmax=0.5)
        ax.set_title(f"budget {b}: {100 * report.fraction_improved[b]:.0f}% heads lower")
        ax.set_xlabel("query head")
        ax.set_ylabel("layer")
    fig.colorbar(im, ax=axes[0].tolist(), label="relative change of head L1 (critical vs attention)")
    files.append(out / "perturbation_per_head.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    return files
