"""Merge the kvtrim and kvpress runs into ``bytes.json`` and ``bytes.md``.

Runs in kvtrim's venv (answers are scored with kvtrim's ``passkey_match``: the first integer of the answer must
equal the pass key). One row per (library, method, ratio). Sizes are those of prompt 0 (the bytes of the other
prompts differ only through their token count); correctness is counted over all prompts.

Usage::

    .venv/bin/python benchmarks/peer_kvpress/report.py --dir benchmarks/results/peer_kvpress
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
from pathlib import Path

from kvtrim.eval.metrics import passkey_match

LIB_ORDER = {"kvtrim": 0, "kvtrim~kvpress": 1, "kvpress": 2}
METHOD_ORDER = {"full": 0, "snapkv": 1, "critical_snapkv": 2, "adakv": 3, "critical_adakv": 4}
KVPRESS_PRESS = {
    "full": "no press",
    "snapkv": "SnapKVPress",
    "critical_snapkv": "CriticalKVPress(SnapKVPress)",
    "adakv": "AdaKVPress(SnapKVPress)",
    "critical_adakv": "CriticalAdaKVPress(SnapKVPress)",
}
SETTINGS_NOTE = {
    "kvtrim": "SnapKV scores w=8, max-pool k=7 (kvtrim defaults); AdaKV official rule α=0.2; CriticalKV α=0.5",
    "kvtrim~kvpress": "kvtrim with kvpress's scorer settings: w=64, avg-pool k=5; AdaKV rule='kvpress' α=0.2",
    "kvpress": "kvpress defaults: SnapKVPress w=64, avg-pool k=5; alpha_safeguard=0.2; first_stage_ratio=0.5",
}


def normalise(lib_out: dict) -> list[dict]:
    """Common per-record fields from either side's raw output."""
    rows = []
    for r in lib_out["records"]:
        if lib_out["library"] == "kvpress":
            a = r["after"]
            row = {
                "entries_stored": a["kv_entries_stored"],
                "entries_effective": a["kv_entries_effective"],
                "kv_bytes": a["kv_bytes"],
                "index_bytes": a["index_bytes"],
                "per_head_min": a["effective_per_head_min"],
                "per_head_max": a["effective_per_head_max"],
                "context_tokens": r["context_length"],
                "decode_ms_per_token": None,
            }
        else:
            st, acc = r["stats"], r.get("accounting")
            row = {
                "entries_stored": st["kv_entries_after"],
                "entries_effective": st["kv_entries_after"],
                "kv_bytes": st["kv_bytes_after"],
                "index_bytes": acc["index_bytes"] if acc else None,
                "per_head_min": acc["entries_per_head_min"] if acc else st["context_tokens"],
                "per_head_max": acc["entries_per_head_max"] if acc else st["context_tokens"],
                "context_tokens": st["context_tokens"],
                "decode_ms_per_token": st["decode_ms_per_token"],
            }
        row.update(
            {
                "library": r["library"],
                "method": r["method"],
                "ratio": r["ratio"],
                "sample": r["sample"],
                "answer": r["answer"],
                "correct": passkey_match(r["answer"], r["answers"]),
                "pass_key": r["answers"][0],
                "settings": r["settings"],
            }
        )
        rows.append(row)
    return rows


def aggregate(records: list[dict]) -> list[dict]:
    full_bytes = {(r["library"].split("~")[0], r["sample"]): r["kv_bytes"] for r in records if r["method"] == "full"}
    kvpress_answers = {
        (r["method"], r["ratio"], r["sample"]): r["answer"].strip() for r in records if r["library"] == "kvpress"
    }
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["library"], r["method"], r["ratio"]), []).append(r)
    out = []
    for (lib, method, ratio), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["sample"])
        first = rs[0]
        full = full_bytes[(lib.split("~")[0], first["sample"])]
        speeds = [r["decode_ms_per_token"] for r in rs if r["decode_ms_per_token"] is not None]
        same = None
        if lib == "kvtrim~kvpress":  # same scorer settings as kvpress: does it give the same answer text?
            same = sum(kvpress_answers.get((method, ratio, r["sample"])) == r["answer"].strip() for r in rs)
        out.append(
            {
                "library": lib,
                "method": method,
                "kvpress_press": KVPRESS_PRESS[method] if lib == "kvpress" else None,
                "ratio": ratio,
                "context_tokens": first["context_tokens"],
                "kv_entries_stored": first["entries_stored"],
                "kv_entries_kept_effective": first["entries_effective"],
                "kv_entries_per_head_min": first["per_head_min"],
                "kv_entries_per_head_max": first["per_head_max"],
                "kv_bytes_held": first["kv_bytes"],
                "full_cache_bytes": full,
                "bytes_held_over_full": first["kv_bytes"] / full,
                "index_bytes": first["index_bytes"],
                "correct": sum(r["correct"] for r in rs),
                "prompts": len(rs),
                "answers": [r["answer"] for r in rs],
                "pass_keys": [r["pass_key"] for r in rs],
                "same_answer_as_kvpress": same,
                "settings": first["settings"],
                "decode_ms_per_token_median_NOT_A_BENCHMARK": statistics.median(speeds) if speeds else None,
            }
        )
    out.sort(key=lambda r: (r["ratio"] or 0, METHOD_ORDER.get(r["method"], 9), LIB_ORDER.get(r["library"], 9)))
    return out


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def markdown(rows: list[dict], meta: dict) -> str:
    v_t, v_p = meta["versions"]["kvtrim"], meta["versions"]["kvpress"]
    n_ctx = rows[0]["context_tokens"]
    lines = [
        "# kvtrim vs kvpress: KV-cache bytes actually held after compression",
        "",
        f"Model: SmolLM2-135M-Instruct (Llama, 30 layers, 3 KV heads, head_dim 64, fp32), CPU. Prompt: kvtrim's "
        f"`passkey` task, 1024-token target, seed 0, {rows[0]['prompts']} prompts; sizes are those of prompt 0 "
        f"({n_ctx} context tokens after the chat template), correctness counts all prompts. Context-only: the "
        "context is compressed, then the question is appended. Both sides feed the same token ids (checked).",
        "",
        "*stored* = (token, layer, KV head) entries in the cache tensors; *kept* = entries attention can still see "
        "(kvpress AdaKV/CriticalAdaKV mask the others); *bytes held* = Σ `untyped_storage().nbytes()` over all K "
        "and V tensors; *index* = extra bookkeeping (kvtrim: positions and per-head offsets of its layout; "
        "kvpress: `masked_key_indices`).",
        "",
        "| library | method | ratio | entries stored | entries kept | per-head kept (min–max) | KV bytes held "
        "| held / full | index bytes | passkey correct | answer (prompt 0) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        method = r["method"] if r["library"] != "kvpress" else f"{r['method']} ({r['kvpress_press']})"
        idx = "–" if r["index_bytes"] is None else f"{r['index_bytes']:,}"
        ratio = "–" if r["ratio"] is None else f"{r['ratio']:g}"
        answer = r["answers"][0].strip().replace("|", "\\|")
        lines.append(
            f"| {r['library']} | {method} | {ratio} | {r['kv_entries_stored']:,} | "
            f"{r['kv_entries_kept_effective']:,} | {r['kv_entries_per_head_min']}–{r['kv_entries_per_head_max']} | "
            f"{r['kv_bytes_held']:,} ({mib(r['kv_bytes_held'])}) | {r['bytes_held_over_full']:.3f} | {idx} | "
            f"{r['correct']:g}/{r['prompts']} | {answer} |"
        )
    matched = [r for r in rows if r["same_answer_as_kvpress"] is not None]
    if matched:
        same = sum(r["same_answer_as_kvpress"] for r in matched)
        total = sum(r["prompts"] for r in matched)
        lines += [
            "",
            f"With kvpress's scorer settings (`kvtrim~kvpress` rows), kvtrim produced the same answer text as kvpress "
            f"in {same}/{total} (method, ratio, prompt) runs, while holding the bytes in the column above.",
        ]
    lines += [
        "",
        "Settings (they differ between the libraries, so compare answers only within matched settings):",
        "",
    ]
    lines += [f"* `{lib}`: {note}" for lib, note in SETTINGS_NOTE.items()]
    lines += [
        "",
        f"Versions: kvtrim {v_t['kvtrim']} (commit {v_t['kvtrim_commit']}), transformers {v_t['transformers']}, "
        f"torch {v_t['torch']}; kvpress {v_p['kvpress']} with transformers {v_p['transformers']}, torch "
        f"{v_p['torch']} (separate venv); Python {v_t['python']}. kvpress installed in kvtrim's venv: "
        f"{v_t['kvpress_installed_here']}.",
        "",
        f"Prompt tokens identical on both sides: {meta['prompt_tokens_identical']}. Generated {meta['generated']}.",
        "Timings are in `bytes.json` only and are not benchmarks (shared 2-core machine).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="holds kvtrim.json and kvpress.json")
    args = parser.parse_args()
    kvt = json.loads((args.dir / "kvtrim.json").read_text())
    kvp = json.loads((args.dir / "kvpress.json").read_text())
    records = normalise(kvt) + normalise(kvp)
    rows = aggregate(records)
    meta = {
        "generated": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": {"kvtrim": kvt["versions"], "kvpress": kvp["versions"]},
        "prompt_tokens_identical": kvp["prompt_tokens_identical"],
        "kvpress_attn_implementation": kvp["attn_implementation"],
        "settings": SETTINGS_NOTE,
        "threads": {"kvtrim": kvt["threads"], "kvpress": kvp["threads"]},
        "note": "bytes and entries are exact; timings come from a shared 2-core machine and are not benchmarks",
    }
    (args.dir / "bytes.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    md = markdown(rows, meta)
    (args.dir / "bytes.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
