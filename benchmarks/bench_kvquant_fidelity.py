"""How far quantized entries move a model's predictions: continuation KL against the unquantized cache, per format.

For each prompt of the retrieval tasks, the context is prefilled into a :class:`~kvtrim.integration.cache.KVTrimCache`
holding its entries in the model's dtype and into one per ``--kv-quant`` spec (nothing evicted), and the question,
answer prefix and reference answer are then fed teacher-forced after it. Reported per spec: the mean over prompts
of ``KL(p_float || p_quantized)`` over the continuation's next-token distributions (nats per token), its median, and
the mean change of the reference answer's negative log-likelihood. The continuation attends over the stored,
quantized context (its own entries land in the store's full-precision window, as in decoding). A denser signal than
the retrieval scores, which move by whole prompts.

``--store pool`` measures the serving engine's paged block pool instead
(:func:`pool_continuation_logprobs`: the context prefilled in one chunk, the continuation fed one decode step at a
time over packed entries, against the same pool in the model's dtype; a pool reads a spec with no window and no
sink).

```bash
PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/bench_kvquant_fidelity.py --samples 4 --seed 42 \
    --kv-quant int8 int4:group_size=32,sink=0 int4:group_size=64,sink=0 int4 --name int4_settings
PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/bench_kvquant_fidelity.py --samples 4 --seed 42 --store pool \
    --kv-quant int8 int4:rotate=0 int4 --name pool_rotation
```

Writes ``benchmarks/results/bench_kvquant_fidelity/NAME.{json,md}`` and prints the table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import sys
from pathlib import Path

import torch

OUT_DIR = Path(__file__).resolve().parent / "results" / "bench_kvquant_fidelity"
TASKS = ("passkey", "niah_single_2", "niah_multikey_1", "vt", "fwe")


def continuation_logprobs(model, context: torch.Tensor, continuation: torch.Tensor, kv_quant) -> torch.Tensor:
    """``[len(continuation), vocab]`` log-probabilities of the continuation's next tokens (teacher-forced) after
    ``context`` held in a cache of ``kv_quant`` entries (None: the model's dtype). ``context``, ``continuation``:
    ``[1, n]`` token ids."""
    from kvtrim.integration.attention import kvtrim_attention_enabled
    from kvtrim.integration.cache import KVTrimCache

    cache = KVTrimCache(model.config.num_hidden_layers, kv_quant=kv_quant)
    with torch.no_grad(), kvtrim_attention_enabled(model):
        last = model(context, past_key_values=cache, use_cache=True).logits[:, -1:]
        rest = model(continuation[:, :-1], past_key_values=cache, use_cache=True).logits
    return torch.cat([last, rest], dim=1)[0].float().log_softmax(-1)


def pool_continuation_logprobs(model, context: torch.Tensor, continuation: torch.Tensor, kv_quant) -> torch.Tensor:
    """:func:`continuation_logprobs` through the serving engine's paged block pool
    (:class:`~kvtrim.serve.model_runner.ModelRunner`, 16-token blocks, ``kv_quant`` None: blocks in the model's
    dtype): the context prefilled in one chunk (its attention over its own full-precision entries, as the engine
    does), then the continuation fed one decode step at a time over the pool's packed entries, its own entries
    packed as they are written (a pool has no full-precision window)."""
    from kvtrim.serve.model_runner import ModelRunner, PrefillChunk

    cfg, block_size = model.config, 16
    per_row = -(-(context.shape[1] + continuation.shape[1]) // block_size) + 1
    runner = ModelRunner(model, kv_blocks=cfg.num_hidden_layers * cfg.num_key_value_heads * per_row,
                         block_size=block_size, kv_quant=kv_quant)  # fmt: skip
    seq = runner.new_sequence()
    logits = [runner.prefill([PrefillChunk(seq, context[0].tolist())]).float()]
    logits += [runner.decode([seq], [t]).float().clone() for t in continuation[0, :-1].tolist()]
    return torch.cat(logits).log_softmax(-1)


def compare(ref: torch.Tensor, other: torch.Tensor, answer: torch.Tensor) -> dict:
    """KL(ref || other) per position, averaged, and the answer tokens' NLL change (``answer`` ``[k]``: the last
    ``k`` continuation tokens)."""
    from kvtrim.eval.fidelity import kl_divergence

    kl = kl_divergence(ref, other)
    k = answer.numel()
    nll = lambda lp: -lp[-k:].gather(-1, answer[:, None]).sum().item()  # noqa: E731
    return {"kl": kl.mean().item(), "kl_max": kl.max().item(), "answer_nll_change": nll(other) - nll(ref)}


def prompt_arguments(ap: argparse.ArgumentParser, samples: int) -> None:
    """The arguments that pick the retrieval prompts, the model and where results go (shared with
    ``bench_kvquant_regroup.py``)."""
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--samples", type=int, default=samples, help="prompts per task")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--name", default="results")


def retrieval_prompts(tokenizer, args: argparse.Namespace):
    """Yield ``(sample, context [1, n], continuation [1, m], answer [k])`` token ids per prompt of ``args.tasks``:
    the context as it is (no chat template), then the question, answer prefix and reference answer."""
    from kvtrim.eval.tasks import generate_task

    for task in args.tasks.split(","):
        for sample in generate_task(task, tokenizer, args.length, args.samples, seed=args.seed):
            context = tokenizer(sample.context, return_tensors="pt").input_ids
            asked = tokenizer(sample.question + sample.answer_prefix, add_special_tokens=False).input_ids
            answer = tokenizer(" " + sample.answers[0], add_special_tokens=False).input_ids
            yield sample, context, torch.tensor([asked + answer]), torch.tensor(answer)


def write_result(
    args: argparse.Namespace, prompts: int, summary: list[dict], rows: list[dict], render, **extra
) -> dict:
    """Write ``OUT_DIR/NAME.{json,md}`` (settings, summary, per-prompt rows; the table ``render(summary, settings)``),
    print the table and return the result."""
    settings = {"model": args.model, **extra, "tasks": args.tasks, "samples": args.samples, "seed": args.seed,
                "length": args.length, "prompts": prompts, "threads": args.threads,
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "command": " ".join(sys.argv),
                "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}  # fmt: skip
    result = {"settings": settings, "summary": summary, "rows": rows}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    md = render(summary, settings)
    (args.out_dir / f"{args.name}.md").write_text(md, encoding="utf-8")
    print(md)
    return result


def summarize(rows: list[dict], specs: list[str]) -> list[dict]:
    out = []
    for spec in specs:
        kl = [r["formats"][spec]["kl"] for r in rows]
        dnll = [r["formats"][spec]["answer_nll_change"] for r in rows]
        out.append({"kv_quant": spec, "resolved": rows[0]["formats"][spec]["resolved"], "prompts": len(kl),
                    "kl_mean": statistics.fmean(kl), "kl_median": statistics.median(kl),
                    "answer_nll_change_mean": statistics.fmean(dnll)})  # fmt: skip
    return out


_STORES = {"dense": "kvtrim's dense cache", "pool": "the serving engine's paged block pool (16-token blocks)"}


def render(summary: list[dict], settings: dict) -> str:
    lines = [
        f"Continuation KL against the unquantized cache, {settings['prompts']} prompts ({settings['samples']} per "
        f"task, seed {settings['seed']}, ~{settings['length']} tokens), nothing evicted, "
        f"{_STORES[settings.get('store', 'dense')]}.",
        "",
        "| kv_quant | resolved | KL mean (nats/token) | KL median | answer NLL change (nats) |",
        "|---|---|---:|---:|---:|",
    ]
    for s in summary:
        lines.append(f"| `{s['kv_quant']}` | `{s['resolved']}` | {s['kl_mean']:.5f} | {s['kl_median']:.5f} | "
                     f"{s['answer_nll_change_mean']:+.4f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-quant", nargs="+", required=True, help="kv_quant specs to compare")
    ap.add_argument("--store", choices=("dense", "pool"), default="dense",
                    help="dense: kvtrim's dense cache (generate, eval); pool: the serving engine's paged block pool "
                    "(a pool reads a name with no window and no sink)")  # fmt: skip
    prompt_arguments(ap, samples=4)
    ap.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    import kvtrim
    from kvtrim.cache.quant import resolve_kv_quant
    from kvtrim.cache.quantized_block_pool import pool_kv_quant

    resolve = pool_kv_quant if args.store == "pool" else resolve_kv_quant  # a pool refuses a window or a sink
    formats = {spec: resolve(spec) for spec in args.kv_quant}  # bad specs fail before the model loads
    logprobs = pool_continuation_logprobs if args.store == "pool" else continuation_logprobs
    model, tokenizer = kvtrim.load_model(args.model, dtype="float32", device="cpu")
    rows = []
    for sample, context, continuation, answer in retrieval_prompts(tokenizer, args):
        ref = logprobs(model, context, continuation, None)
        row = {"task": sample.task, "index": sample.index, "context_tokens": context.shape[1], "formats": {}}
        for spec, fmt in formats.items():
            other = logprobs(model, context, continuation, fmt)
            row["formats"][spec] = {"resolved": fmt.spec, **compare(ref, other, answer)}
        rows.append(row)
        print(sample.task, sample.index, {s: round(v["kl"], 5) for s, v in row["formats"].items()}, flush=True)
    return write_result(args, len(rows), summarize(rows, list(formats)), rows, render, store=args.store)


if __name__ == "__main__":
    main()
