"""Which entries kvpress's presses keep against kvtrim's methods: same model, same prompt, same ratio.

kvpress 0.5.5 needs transformers < 5.3 and kvtrim >= 5.16, so the check runs in two halves, one per environment:

    make peer-kvpress                                              # .venv-kvpress: kvpress 0.5.5, its transformers
    .venv-kvpress/bin/python tools/kvpress_parity.py kvpress --model-dir M --context-file T --out DIR
    .venv/bin/python tools/kvpress_parity.py kvtrim --out DIR      # reads DIR/kvpress.json.gz, writes DIR/parity.*

(``make kvpress-parity`` runs both.) The kvpress half imports nothing of kvtrim. Each half prefills the same
context token ids (the kvpress half writes them; the kvtrim half checks its tokenizer gives the same ids) in float32
on the CPU, compresses it with the press or with the method of ``kvtrim.methods.kvpress_map`` (the parameters that
follow the press's defaults), and lists every (layer, KV head)'s kept token positions. The kvpress half reads them
by matching each kept key row to the uncompressed prefill's keys (a press gathers rows; prefill attention does not
see the compression, so the rows are bitwise the same), or from ``masked_key_indices`` for the presses that mask
(AdaKV and CriticalAdaKV). The kvtrim half reads them from its stores.

Reported per press: the share of (layer, head) whose kept sets are identical, the mean Jaccard overlap, and the
kept counts. Presses that draw random numbers or need weights from the Hub are not in the list.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RATIO = 0.5
CONTEXT_TOKENS = 512


# --------------------------------------------------------------------------------------------------- kvpress half
def _presses(ratio: float) -> dict:
    """The deterministic presses that run without weights from the Hub, built with their defaults."""
    import kvpress as kp

    snap = lambda: kp.SnapKVPress(compression_ratio=ratio)  # noqa: E731 - the inner scorer of the wrapping presses
    return {
        "SnapKVPress": snap,
        "PyramidKVPress": lambda: kp.PyramidKVPress(compression_ratio=ratio),
        "StreamingLLMPress": lambda: kp.StreamingLLMPress(compression_ratio=ratio),
        "KnormPress": lambda: kp.KnormPress(compression_ratio=ratio),
        "TOVAPress": lambda: kp.TOVAPress(compression_ratio=ratio),
        "ExpectedAttentionPress": lambda: kp.ExpectedAttentionPress(compression_ratio=ratio),
        "KeyDiffPress": lambda: kp.KeyDiffPress(compression_ratio=ratio),
        "LagKVPress": lambda: kp.LagKVPress(compression_ratio=ratio),
        "ObservedAttentionPress": lambda: kp.ObservedAttentionPress(compression_ratio=ratio),
        "AdaKVPress": lambda: kp.AdaKVPress(press=snap()),
        "CriticalKVPress": lambda: kp.CriticalKVPress(press=snap()),
        "CriticalAdaKVPress": lambda: kp.CriticalAdaKVPress(press=snap()),
        # kvtrim's chunkkv scores with window attention (w=8, no pooling): SnapKV with an 8-token window, kernel 1
        "ChunkKVPress": lambda: kp.ChunkKVPress(press=kp.SnapKVPress(compression_ratio=ratio, window_size=8,
                                                                     kernel_size=1)),
        "CompactorPress": lambda: kp.CompactorPress(compression_ratio=ratio),
        "LeverageScorePress": lambda: kp.LeverageScorePress(compression_ratio=ratio),
        "CURPress": lambda: kp.CURPress(compression_ratio=ratio),
        "NonCausalAttnPress": lambda: kp.NonCausalAttnPress(compression_ratio=ratio),
        "CapPress": lambda: kp.CapPress(compression_ratio=ratio),
        "BlockPress": lambda: kp.BlockPress(press=kp.KeyDiffPress(compression_ratio=ratio), block_size=128),
        # kvtrim's kvcompose reduces the GQA group by max (kvpress's agg_group option)
        "KVComposePress": lambda: kp.KVComposePress(compression_ratio=ratio, agg_group="max"),
        "EntropyGatedChunkKVPress": lambda: kp.EntropyGatedChunkKVPress(
            press=kp.SnapKVPress(compression_ratio=ratio, window_size=8, kernel_size=1), chunk_length=10,
            low_entropy_chunk_length=4,
        ),
        "MergingPress": lambda: kp.MergingPress(press=kp.KnormPress(compression_ratio=ratio)),
    }


def kept_by_matching(full: torch.Tensor, kept: torch.Tensor) -> list[list[int]]:
    """Per head, the positions of ``full`` ``[heads, n, d]`` whose rows are ``kept`` ``[heads, k, d]``."""
    out = []
    for f, k in zip(full, kept, strict=True):
        eq = (k[:, None, :] == f[None, :, :]).all(-1)  # [k, n]
        found = eq.int().argmax(-1)
        if not bool(eq.any(-1).all()):
            raise RuntimeError("a kept key row matches no prefill key row")
        out.append(sorted(int(i) for i in found))
    return out


def kvpress_half(args: argparse.Namespace) -> int:
    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    text = Path(args.context_file).read_text(encoding="utf-8")
    ids = tok(text, return_tensors="pt").input_ids[:, : args.tokens]
    results = {"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
               "transformers": transformers.__version__, "torch": torch.__version__, "ratio": args.ratio,
               "input_ids": ids[0].tolist(), "presses": {}}  # fmt: skip
    n = ids.shape[1]
    models = {}
    for name, make in _presses(args.ratio).items():
        attn = "eager" if name == "ObservedAttentionPress" else "sdpa"
        if attn not in models:
            models[attn] = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32,
                                                                attn_implementation=attn).eval()  # fmt: skip
        model = models[attn]
        try:
            press = make()
            with torch.inference_mode():
                full = DynamicCache()
                model(ids, past_key_values=full, use_cache=True)
                cache = DynamicCache()
                with press(model):
                    model(ids, past_key_values=cache, use_cache=True, output_attentions=attn == "eager")
            kept = []
            for layer, (fl, cl) in enumerate(zip(full.layers, cache.layers, strict=True)):
                module = model.model.layers[layer].self_attn
                masked = getattr(module, "masked_key_indices", None)
                if masked is not None:  # a masking press: every key stays in the cache, the masked ones are never seen
                    heads = fl.keys.shape[1]
                    gone = [set() for _ in range(heads)]
                    for _, h, s in zip(*(t.tolist() for t in masked), strict=True):
                        gone[h].add(s)
                    kept.append([sorted(set(range(n)) - g) for g in gone])
                    module.masked_key_indices = None
                else:
                    kept.append(kept_by_matching(fl.keys[0], cl.keys[0]))
            results["presses"][name] = {"kept": kept}
            print(f"  {name}: {sum(len(h) for layer in kept for h in layer)} entries kept", flush=True)
        except Exception as exc:  # recorded; the other presses still run
            results["presses"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"  {name}: error {results['presses'][name]['error']}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with gzip.open(out / "kvpress.json.gz", "wt") as fh:
        json.dump(results, fh)
    return 0


# ---------------------------------------------------------------------------------------------------- kvtrim half
def _kvtrim_kept(model, ids: torch.Tensor, method: str, params: dict, ratio: float) -> list[list[list[int]]]:
    from kvtrim.integration.attention import kvtrim_attention_enabled
    from kvtrim.integration.cache import KVTrimCache
    from kvtrim.runtime import resolve_method

    pipeline, spec = resolve_method(method, ratio, None, params, model)
    cache = KVTrimCache(model.config.num_hidden_layers, pipeline, spec, auto_compress=False)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        model(ids, past_key_values=cache, use_cache=True)
        cache.compress()
    kept = []
    for layer in cache.kv_layers:
        store = layer.store
        heads = []
        for h in range(store.kv_heads):
            pos = store.row(0, h)[2] if hasattr(store, "row") else store.positions[0, h]
            heads.append(sorted(int(p) for p in pos.tolist() if p >= 0))
        kept.append(heads)
    return kept


def compare(a: list, b: list) -> dict:
    """Agreement of two ``[layer][head] -> kept positions`` lists: the share of (layer, head) with identical sets,
    their mean Jaccard overlap, the largest number of positions one (layer, head) keeps that the other does not,
    and each side's total."""
    same, jac, pairs, worst = 0, 0.0, 0, 0
    for la, lb in zip(a, b, strict=True):
        for ha, hb in zip(la, lb, strict=True):
            sa, sb = set(ha), set(hb)
            pairs += 1
            same += sa == sb
            jac += len(sa & sb) / max(len(sa | sb), 1)
            worst = max(worst, len(sa - sb), len(sb - sa))
    return {"identical_heads": same / pairs, "mean_jaccard": jac / pairs, "max_head_difference": worst,
            "kept_kvpress": sum(map(len, (h for layer in a for h in layer))),
            "kept_kvtrim": sum(map(len, (h for layer in b for h in layer)))}  # fmt: skip


def kvtrim_half(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT / "src"))
    import kvtrim
    from kvtrim.methods.kvpress_map import MAPPINGS

    out = Path(args.out)
    with gzip.open(out / "kvpress.json.gz", "rt") as fh:
        theirs = json.load(fh)
    model, tok = kvtrim.load_model(args.model, dtype="float32")
    model.eval()
    text = Path(args.context_file).read_text(encoding="utf-8") if args.context_file else None
    ids = torch.tensor([theirs["input_ids"]])
    if text is not None and tok(text, return_tensors="pt").input_ids[0, : ids.shape[1]].tolist() != theirs["input_ids"]:
        raise SystemExit("the two halves tokenized the context differently")
    mapping = {m.press: m for m in MAPPINGS}
    rows = []
    for press, result in theirs["presses"].items():
        m = mapping.get(press)
        row = {"press": press, "method": m.method if m else None, "params": m.params if m else {}}
        if "error" in result:
            row["status"] = f"kvpress error: {result['error']}"
        elif m is None or m.method is None:
            row["status"] = "no kvtrim method"
        else:
            try:
                mine = _kvtrim_kept(model, ids, m.method, m.params, theirs["ratio"])
                row.update(compare(result["kept"], mine), status="ok")
            except Exception as exc:
                row["status"] = f"kvtrim error: {type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        print(f"  {press:>24} -> {row['method']}: {row.get('identical_heads', '-')} {row['status']}", flush=True)
    report = {"ratio": theirs["ratio"], "tokens": ids.shape[1], "kvpress_side": {k: theirs[k] for k in
              ("kvpress", "transformers", "torch")}, "rows": rows}  # fmt: skip
    (out / "parity.json").write_text(json.dumps(report, indent=1))
    (out / "parity.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def markdown(report: dict) -> str:
    head = (f"Kept entries, kvpress {report['kvpress_side']['kvpress']} (transformers "
            f"{report['kvpress_side']['transformers']}) against kvtrim, SmolLM2-135M-Instruct in float32, "
            f"{report['tokens']}-token context, ratio {report['ratio']}.\n\n"
            "| press | kvtrim method | identical (layer, head) sets | mean Jaccard | most positions one head differs "
            "by | entries kvpress / kvtrim | status |\n|---|---|---:|---:|---:|---|---|\n")  # fmt: skip
    lines = []
    for r in report["rows"]:
        if r["status"] == "ok":
            lines.append(f"| {r['press']} | `{r['method']}` | {100 * r['identical_heads']:.1f} % | "
                         f"{r['mean_jaccard']:.3f} | {r['max_head_difference']} | {r['kept_kvpress']} / "
                         f"{r['kept_kvtrim']} | ok |")  # fmt: skip
        else:
            lines.append(f"| {r['press']} | {r['method'] or '-'} | | | | | {r['status']} |")
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("half", choices=("kvpress", "kvtrim"))
    ap.add_argument("--out", required=True, help="folder for kvpress.json.gz, parity.json and parity.md")
    ap.add_argument("--model-dir", help="kvpress half: the model's folder (config, tokenizer, safetensors)")
    ap.add_argument("--model", default="smollm2-135m", help="kvtrim half: the model (kvtrim's name or a path)")
    ap.add_argument("--context-file", help="the context text (its first --tokens tokens are used)")
    ap.add_argument("--tokens", type=int, default=CONTEXT_TOKENS)
    ap.add_argument("--ratio", type=float, default=RATIO)
    args = ap.parse_args(argv)
    if not 0 <= args.ratio < 1:
        ap.error(f"--ratio must be in [0, 1), got {args.ratio}")
    if args.half == "kvpress":
        if not args.model_dir or not args.context_file:
            ap.error("the kvpress half needs --model-dir and --context-file")
        return kvpress_half(args)
    return kvtrim_half(args)


if __name__ == "__main__":
    raise SystemExit(main())
