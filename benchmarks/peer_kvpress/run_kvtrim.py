"""kvtrim side of the kvtrim/kvpress comparison: what the cache holds after kvtrim compresses a context.

Runs in kvtrim's venv. Reads the prompts written by ``make_prompt.py`` and, per prompt, prefills the context
once (:class:`kvtrim.Session`, context-only mode, the same path as :func:`kvtrim.generate`), then for every
(method, ratio) compresses a copy of that cache, appends the question and decodes greedily.

Two settings groups:

* ``kvtrim`` (defaults): ``snapkv``, ``critical_snapkv``, ``adakv``, ``critical_adakv`` with kvtrim's registry
  defaults (SnapKV scores with window 8, max-pool kernel 7; AdaKV official rule, α=0.2; CriticalKV α=0.5,
  ε=1e-4);
* ``kvtrim~kvpress`` (kvpress's scorer settings): the same methods with ``window=64, kernel=5,
  pooling="avg"`` (kvpress ``SnapKVPress`` defaults) and, for the AdaKV methods, ``rule="kvpress"`` (kvpress's
  per-head top-⌊αB⌋ safeguard). These make the entry counts and answers comparable with the kvpress rows;
  the selections are close to, not bit-identical with, kvpress's.

Sizes come from :class:`kvtrim.GenerationStats` (bytes of the key/value tensors actually held,
``untyped_storage().nbytes()``). ``index_bytes`` (positions and per-head bookkeeping of the ragged layout) is not
in those stats; it is read by repeating the compression on another copy of the session's prefilled cache
(``Session.prefill``) and calling ``KVTrimCache.stats()``, which also cross-checks entries and bytes.

Speeds are recorded but the machine is shared: do not read them as benchmarks.

Usage::

    .venv/bin/python benchmarks/peer_kvpress/run_kvtrim.py \\
        --prompt benchmarks/results/peer_kvpress/prompt.json --out benchmarks/results/peer_kvpress/kvtrim.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch
import transformers

import kvtrim
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.integration.attention import kvtrim_attention_enabled

METHODS = ("snapkv", "critical_snapkv", "adakv", "critical_adakv")
KVPRESS_SCORER = {"window": 64, "kernel": 5, "pooling": "avg"}


def settings_groups(methods: list[str]) -> dict[str, dict[str, dict]]:
    """group -> method -> method_params."""
    groups: dict[str, dict[str, dict]] = {"kvtrim": {m: {} for m in methods}, "kvtrim~kvpress": {}}
    for m in methods:
        params = dict(KVPRESS_SCORER)
        if m in ("adakv", "critical_adakv"):
            params["rule"] = "kvpress"
        groups["kvtrim~kvpress"][m] = params
    return groups


def index_accounting(session: kvtrim.Session, pipeline, ratio: float | None) -> dict:
    """Compress another copy of the session's prefilled cache and read its full stats (incl. index bytes).

    With ``pipeline=None`` the uncompressed prefilled cache is measured as it is."""
    pre = session.prefill  # the prefilled cache that Session.run clones
    with torch.inference_mode(), kvtrim_attention_enabled(session.model):
        if pipeline is None:
            cache = pre.cache
        else:
            cache = pre.cache.clone(pipeline, BudgetSpec(ratio=ratio))
            cache.compress(logits=pre.logits)
        st = cache.stats()
        per_head = cache.entries_per_layer_head()[0]
    return {
        "entries": st.entries,
        "kv_bytes": st.kv_bytes,
        "index_bytes": st.index_bytes,
        "entries_per_head_min": int(per_head.min()),
        "entries_per_head_max": int(per_head.max()),
    }


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
        return out.stdout.strip() + ("+dirty(src)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ratios", default="0.5,0.75,0.9")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--samples", type=int, default=None, help="use only the first N prompts")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-kvpress-settings", action="store_true", help="skip the kvtrim~kvpress group")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    spec = json.loads(args.prompt.read_text())
    samples = spec["samples"][: args.samples] if args.samples else spec["samples"]
    ratios = [float(r) for r in args.ratios.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    groups = settings_groups(methods)
    if args.no_kvpress_settings:
        del groups["kvtrim~kvpress"]

    model, tok = kvtrim.load_model(spec["model"])
    pipelines = {(g, m): kvtrim.get_method(m, **p) for g, ms in groups.items() for m, p in ms.items()}
    records = []
    for s in samples:
        session = kvtrim.Session(
            model, tok, s["context"], None, methods=list(pipelines.values()), answer_prefix=s["answer_prefix"]
        )
        configs = [("kvtrim", "full", None)] + [(g, m, r) for g, ms in groups.items() for m in ms for r in ratios]
        for group, method, ratio in configs:
            pipe = None if method == "full" else pipelines[(group, method)]
            res = session.run(pipe, ratio=ratio, questions=[s["question"]], max_new_tokens=s["max_new_tokens"])
            st = res.stats
            rec = {
                "library": group,
                "method": method,
                "ratio": ratio,
                "settings": {} if pipe is None else dict(pipe.params),
                "sample": s["index"],
                "answers": s["answers"],
                "answer": res.answers[0],
                "stats": st.as_dict(),
            }
            rec["stats"].pop("layer_budgets", None)
            acc = index_accounting(session, pipe, ratio)
            assert acc["entries"] == st.kv_entries_after and acc["kv_bytes"] == st.kv_bytes_after, (acc, st)
            rec["accounting"] = acc
            records.append(rec)
            print(
                f"{group:14s} {method:16s} ratio={ratio!s:5s} sample={s['index']} entries={st.kv_entries_after} "
                f"bytes={st.kv_bytes_after} answer={res.answers[0]!r}",
                flush=True,
            )

    out = {
        "library": "kvtrim",
        "versions": {
            "kvtrim": kvtrim.__version__,
            "kvtrim_commit": git_commit(),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "kvpress_installed_here": _installed("kvpress"),
        },
        "model": spec["model"],
        "model_dtype": str(model.dtype),
        "threads": args.threads,
        "records": records,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


def _installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
