"""Head masking: how much retrieval depends on the heads a calibration ranks highest (CompressKV, arXiv
2508.02401, masking ablation).

The attention output of a masked query head is zeroed before ``o_proj`` (a forward pre-hook on the layer's
``o_proj`` zeroes that head's ``head_dim`` slice of the input), so the head contributes nothing to the residual
stream. The top-``k`` heads over the whole model by SRH score, by TRH score, and ``k`` random heads are masked in
turn, and retrieval accuracy is measured with the full cache on harness tasks. Hooks are always removed.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidParameterError

__all__ = ["HeadMaskingReport", "head_masking_analysis", "mask_heads", "top_heads", "write_report"]


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise InvalidParameterError("head masking needs a decoder with model.layers[i].self_attn.o_proj")
    return [layer.self_attn for layer in layers]


@contextmanager
def mask_heads(model: torch.nn.Module, heads: Sequence[tuple[int, int]]) -> Iterator[list]:
    """Zero the attention output of query heads ``(layer, head)`` while the context is active.

    Yields the hook handles; every hook is removed on exit, also after an exception.
    """
    modules = _attention_modules(model)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    q_heads = int(config.num_attention_heads)
    by_layer: dict[int, list[int]] = {}
    for layer, head in heads:
        if not 0 <= layer < len(modules) or not 0 <= head < q_heads:
            raise InvalidParameterError(f"head ({layer}, {head}) is outside {len(modules)} layers x {q_heads} heads")
        by_layer.setdefault(int(layer), []).append(int(head))
    handles = []

    def hook_for(head_ids: list[int]):
        def zero_heads(module: torch.nn.Module, args: tuple) -> tuple:
            x = args[0]
            d = x.shape[-1] // q_heads
            x = x.clone()
            for h in head_ids:
                x[..., h * d : (h + 1) * d] = 0
            return (x, *args[1:])

        return zero_heads

    try:
        for layer, head_ids in by_layer.items():
            handles.append(modules[layer].o_proj.register_forward_pre_hook(hook_for(sorted(set(head_ids)))))
        yield handles
    finally:
        for handle in handles:
            handle.remove()


def top_heads(scores: torch.Tensor, k: int) -> list[tuple[int, int]]:
    """The ``k`` highest ``[layers, q_heads]`` scores over the whole model as ``(layer, head)`` pairs."""
    flat = scores.double().flatten()
    if not 0 <= k <= flat.numel():
        raise InvalidParameterError(f"k={k}: choose 0..{flat.numel()} heads")
    order = torch.argsort(flat, descending=True, stable=True)[:k].tolist()
    heads = scores.shape[1]
    return [(i // heads, i % heads) for i in order]


def random_heads(layers: int, heads: int, k: int, seed: int) -> list[tuple[int, int]]:
    """``k`` distinct random ``(layer, head)`` pairs."""
    picks = random.Random(seed).sample(range(layers * heads), k)
    return [(i // heads, i % heads) for i in picks]


@dataclass
class HeadMaskingReport:
    """Accuracy per task under each masking condition.

    Attributes:
        accuracy: ``{condition: {task: mean score}}``; conditions are ``none``, ``srh@k``, ``trh@k``, ``random@k``
        masked: ``{condition: [[layer, head], ...]}``
        predictions: ``{condition: {task: [prediction, ...]}}``
    """

    tasks: list[str]
    ks: list[int]
    length: int
    samples: int
    seed: int
    random_seed: int
    artifact: str
    accuracy: dict = field(default_factory=dict)
    masked: dict = field(default_factory=dict)
    predictions: dict = field(default_factory=dict)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def head_masking_analysis(
    model: torch.nn.Module,
    tokenizer: Any,
    ks: Sequence[int] = (5, 10, 20),
    tasks: Sequence[str] = ("passkey", "niah_single_2"),
    length: int = 1024,
    samples: int = 10,
    seed: int = 42,
    random_seed: int = 0,
    artifact: str | Path | None = None,
    haystack: str | None = None,
    progress: bool = True,
) -> HeadMaskingReport:
    """Mask the top-``k`` SRH, top-``k`` TRH and ``k`` random heads and score retrieval with the full cache.

    Args:
        ks: numbers of heads masked over the whole model
        tasks, length, samples, seed: :func:`kvtrim.eval.tasks.generate_task` arguments
        artifact: the ``compresskv`` artifact (default: the model's, searched as usual)
    """
    from tqdm.auto import tqdm

    from ..api import generate
    from ..artifacts.compresskv import load_compresskv
    from ..eval.metrics import score_sample
    from ..eval.tasks import generate_task

    art = load_compresskv(model, artifact)
    srh, trh = art.tensors["srh"], art.tensors["trh"]
    layers, heads = srh.shape
    started = time.perf_counter()
    report = HeadMaskingReport(list(tasks), [int(k) for k in ks], length, samples, seed, random_seed, str(art.path))
    conditions: list[tuple[str, list[tuple[int, int]]]] = [("none", [])]
    for k in report.ks:
        conditions += [
            (f"srh@{k}", top_heads(srh, k)),
            (f"trh@{k}", top_heads(trh, k)),
            (f"random@{k}", random_heads(layers, heads, k, random_seed + k)),
        ]
    prompts = {t: generate_task(t, tokenizer, length, samples, seed=seed, haystack=haystack) for t in tasks}
    total = len(conditions) * sum(len(v) for v in prompts.values())
    bar = tqdm(total=total, desc="head masking", unit="prompt", disable=not progress, dynamic_ncols=True)
    for name, masked in conditions:
        report.masked[name] = [list(h) for h in masked]
        report.accuracy[name], report.predictions[name] = {}, {}
        with mask_heads(model, masked):
            for task, task_samples in prompts.items():
                scores, preds = [], []
                for sample in task_samples:
                    result = generate(
                        model,
                        tokenizer,
                        sample.context,
                        sample.question,
                        method="full",
                        answer_prefix=sample.answer_prefix or None,
                        max_new_tokens=sample.max_new_tokens,
                    )
                    preds.append(result.answers[0])
                    scores.append(float(score_sample(sample, result.answers[0])))
                    bar.update(1)
                report.accuracy[name][task] = sum(scores) / len(scores) if scores else float("nan")
                report.predictions[name][task] = preds
    bar.close()
    report.seconds = round(time.perf_counter() - started, 1)
    return report


def write_report(report: HeadMaskingReport, out_dir: str | Path) -> list[Path]:
    """Write ``head_masking.json`` and ``head_masking.png`` (accuracy vs. masked heads per task) to ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "head_masking.json"]
    files[0].write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is in the eval extra
        return files
    fig, axes = plt.subplots(1, len(report.tasks), figsize=(4.5 * len(report.tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], report.tasks, strict=True):
        base = report.accuracy["none"][task]
        for kind, marker in (("srh", "o"), ("trh", "s"), ("random", "^")):
            ys = [report.accuracy[f"{kind}@{k}"][task] for k in report.ks]
            ax.plot([0, *report.ks], [base, *ys], marker=marker, label=kind.upper() if kind != "random" else kind)
        ax.set_title(task, fontsize=9)
        ax.set_xlabel("masked heads (whole model)")
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(out / "head_masking.png")
    fig.savefig(files[-1], dpi=120)
    plt.close(fig)
    return files
