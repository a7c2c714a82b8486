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
see the compression, so the rows are bitwise the same), from ``masked_key_indices`` for the presses that mask
(AdaKV and CriticalAdaKV), or from KVComposePress's own masks (its prefill runs in eager attention, so its rows are
not the sdpa prefill's). The kvtrim half reads them from its stores.

Then each side answers the same question from its compressed cache, context-only as kvpress's pipeline and kvtrim's
``questions=`` do: the question's token ids (written by the kvpress half) are fed after the cache at positions
n, n+1, ... (n the uncompressed context length), then greedy tokens until EOS or ``--max-new-tokens``. The kvpress
half decodes with its pipeline's own ``generate_answer``; the kvtrim half with ``kvtrim.runtime.feed`` and
``greedy_decode``. Both also answer from the uncompressed cache, which checks that the two decoding loops agree.

Reported per press: the share of (layer, head) whose kept sets are identical, the mean Jaccard overlap, the kept
counts, and whether the two greedy answers are identical (both answers in ``parity.json``). Presses that draw random
numbers or need weights from the Hub are not in the list.
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
# asked after compression (context-only, as kvpress's pipeline and kvtrim's ``questions=``); answered in the context
QUESTION = "\nQuestion: According to the text, what is /dev/null used as?\nAnswer:"
MAX_NEW_TOKENS = 24


# the same press against kvtrim's own defaults where the mapping follows a kvpress choice (extra rows)
VARIANTS = {
    "NonCausalAttnPress": [("kvtrim's default, logits scaled by 1/√d", {"scaled": True})],
    "AdaKVPress": [("kvtrim's default rule", {"rule": "official"})],
    "CriticalAdaKVPress": [("kvtrim's default rule", {"rule": "official"})],
}


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


def _kept_from_masks(masks: list[list[torch.Tensor]]) -> list[list[list[int]]]:
    """``[layer][kv head]`` boolean context masks (True: kept) as sorted kept positions."""
    return [[sorted(int(i) for i in m.nonzero().flatten()) for m in layer] for layer in masks]


def _capture_kvcompose(press) -> dict:
    """Record KVComposePress's kept masks when it compresses (its ``compress_cache`` runs on leaving the press,
    before it clears its state). Its prefill runs in eager attention, so its key rows are not bitwise the sdpa
    prefill's and cannot be matched; the masks are the press's own choice."""
    captured: dict = {}
    compress = press.compress_cache

    def compress_and_record(model):
        captured["kept"] = _kept_from_masks(press.important_mask_per_kv_head)
        compress(model)

    press.compress_cache = compress_and_record
    return captured


def kvpress_half(args: argparse.Namespace) -> int:
    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, pipeline

    tok = AutoTokenizer.from_pretrained(args.model_dir)
    text = Path(args.context_file).read_text(encoding="utf-8")
    ids = tok(text, return_tensors="pt").input_ids[:, : args.tokens]
    question_ids = tok(args.question, add_special_tokens=False, return_tensors="pt").input_ids
    results = {"kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5",
               "transformers": transformers.__version__, "torch": torch.__version__, "ratio": args.ratio,
               "input_ids": ids[0].tolist(), "question": args.question, "question_ids": question_ids[0].tolist(),
               "max_new_tokens": args.max_new_tokens, "presses": {}}  # fmt: skip
    n = ids.shape[1]
    models, pipes = {}, {}

    def answer(attn: str, cache) -> tuple[str, bool]:
        """kvpress's own greedy decoding (its pipeline's ``generate_answer``): the question after the cache, at
        positions n, n+1, ..., then argmax tokens until EOS or ``max_new_tokens``. Where the layers hold different
        counts (PyramidKV, KVCompose) transformers cannot build one mask for a many-token question, so the question
        is fed one token at a time (the flag returned)."""
        lengths = {layer.keys.shape[-2] for layer in cache.layers}
        if len(lengths) == 1:
            return pipes[attn].generate_answer(question_ids, cache, n, args.max_new_tokens), False
        model = models[attn]
        for i in range(question_ids.shape[1] - 1):
            model(input_ids=question_ids[:, i : i + 1], past_key_values=cache, position_ids=torch.tensor([[n + i]]))
        last = question_ids.shape[1] - 1
        said = pipes[attn].generate_answer(question_ids[:, last:], cache, n + last, args.max_new_tokens)
        return said, True

    chosen = set(args.presses.split(",")) if args.presses else None
    for name, make in _presses(args.ratio).items():
        if chosen is not None and name not in chosen:
            continue
        attn = "eager" if name == "ObservedAttentionPress" else "sdpa"
        if attn not in models:
            models[attn] = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32,
                                                                attn_implementation=attn).eval()  # fmt: skip
            pipes[attn] = pipeline("kv-press-text-generation", model=models[attn], tokenizer=tok, device="cpu")
        model = models[attn]
        if "answer_full" not in results:  # the uncompressed cache's answer: both decoding loops agree on it
            with torch.inference_mode():
                cache = DynamicCache()
                model(ids, past_key_values=cache, use_cache=True)
                results["answer_full"] = answer(attn, cache)[0]
            print(f"  full cache: {results['answer_full']!r}", flush=True)
        try:
            press = make()
            captured = _capture_kvcompose(press) if name == "KVComposePress" else None
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
                if captured is not None:
                    kept.append(captured["kept"][layer])
                elif masked is not None:  # a masking press: every key stays in the cache, the masked are never seen
                    heads = fl.keys.shape[1]
                    gone = [set() for _ in range(heads)]
                    for _, h, s in zip(*(t.tolist() for t in masked), strict=True):
                        gone[h].add(s)
                    kept.append([sorted(set(range(n)) - g) for g in gone])
                else:
                    kept.append(kept_by_matching(fl.keys[0], cl.keys[0]))
            with torch.inference_mode():  # the masks stay set while decoding: kvpress's attention patch reads them
                said, stepwise = answer(attn, cache)
            for layer in model.model.layers:
                layer.self_attn.masked_key_indices = None
            results["presses"][name] = {"kept": kept, "answer": said, "question_token_by_token": stepwise}
            print(f"  {name}: {sum(len(h) for layer in kept for h in layer)} entries kept; {said!r}", flush=True)
        except Exception as exc:  # recorded; the other presses still run
            results["presses"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"  {name}: error {results['presses'][name]['error']}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with gzip.open(out / "kvpress.json.gz", "wt") as fh:
        json.dump(results, fh)
    return 0


# ---------------------------------------------------------------------------------------------------- kvtrim half
def _kvtrim_run(model, ids: torch.Tensor, method, params: dict | None, ratio: float, question_ids: torch.Tensor,
                max_new_tokens: int, token_by_token: bool = False) -> tuple[list[list[list[int]]], list[int]]:
    """Compress ``ids`` ``[1, n]`` with ``method`` (a registry name or a built pipeline), read each (layer, head)'s
    kept positions from the stores, then answer ``question_ids`` ``[1, q]`` from the compressed cache: the question
    fed after it at positions n, n+1, ... and greedy tokens until EOS or ``max_new_tokens`` (kvtrim's
    ``questions=`` path: :func:`kvtrim.runtime.feed` and :func:`kvtrim.runtime.greedy_decode`). Returns the kept
    positions and the answer's token ids (EOS left out)."""
    from kvtrim.integration.attention import kvtrim_attention_enabled
    from kvtrim.integration.cache import KVTrimCache
    from kvtrim.runtime import feed, greedy_decode, resolve_method

    pipeline, spec = resolve_method(method, ratio, None, params or None, model)
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
        answer = _greedy(model, cache, ids.shape[1], question_ids, max_new_tokens, feed, greedy_decode,
                         token_by_token)
    return kept, answer


def _greedy(model, cache, n: int, question_ids: torch.Tensor, max_new_tokens: int, feed, greedy_decode,
            token_by_token: bool = False) -> list[int]:
    """Greedy answer token ids after ``n`` context tokens held by ``cache`` (EOS: the model's generation config);
    ``token_by_token`` feeds the question one token at a time, as the kvpress half does where its layers differ."""
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    mask = torch.ones(1, n, dtype=torch.long)
    step = 1 if token_by_token else question_ids.shape[1]
    for i in range(0, question_ids.shape[1], step):
        fed = feed(model, cache, mask, question_ids[:, i : i + step])
        mask = fed.mask
    return greedy_decode(model, cache, fed.mask, fed.logits, max_new_tokens, eos=eos).tokens[0]


def _kvtrim_full_answer(model, ids: torch.Tensor, question_ids: torch.Tensor, max_new_tokens: int) -> list[int]:
    """The uncompressed cache's greedy answer (a plain transformers cache, the same decoding loop)."""
    from transformers import DynamicCache

    from kvtrim.runtime import feed, greedy_decode

    cache = DynamicCache()
    with torch.inference_mode():
        model(ids, past_key_values=cache, use_cache=True)
        return _greedy(model, cache, ids.shape[1], question_ids, max_new_tokens, feed, greedy_decode)


def pyramid_counts_pipeline(model, params: dict, ratio: float, counts: list[int], context: int):
    """kvtrim's ``pyramidkv`` scorer and selector with a given number kept per layer (``counts``, e.g. kvpress's):
    separates the choice of entries from the layer budgets. Each count ``c`` becomes the removed fraction
    ``1 − (c + ½)/context`` of a :class:`~kvtrim.budgets.layer_ratios.LayerRatioBudget`, which keeps
    ``int(context · (1 − r)) = c``."""
    from kvtrim.budgets.layer_ratios import LayerRatioBudget
    from kvtrim.methods.registry import parts
    from kvtrim.runtime import resolve_method

    base, _ = resolve_method("pyramidkv", ratio, None, params, model)
    ratios = tuple(1.0 - (c + 0.5) / context for c in counts)
    return parts(base.scorer, LayerRatioBudget(ratios=ratios), base.selector)


def compare_answers(theirs: str | None, mine: str | None) -> dict:
    """The two greedy answers side by side: identical or not, and how many leading words they share."""
    if theirs is None or mine is None:
        return {"answer_kvpress": theirs, "answer_kvtrim": mine, "answer_identical": None, "answer_common_words": 0}
    common = 0
    for a, b in zip(theirs.split(), mine.split(), strict=False):
        if a != b:
            break
        common += 1
    return {"answer_kvpress": theirs, "answer_kvtrim": mine, "answer_identical": theirs == mine,
            "answer_common_words": common}  # fmt: skip


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
    question_ids = torch.tensor([theirs["question_ids"]])
    if tok(theirs["question"], add_special_tokens=False).input_ids != theirs["question_ids"]:
        raise SystemExit("the two halves tokenized the question differently")
    max_new = theirs["max_new_tokens"]

    def said(tokens: list[int]) -> str:
        return tok.decode(tokens, skip_special_tokens=True)

    full = compare_answers(theirs["answer_full"], said(_kvtrim_full_answer(model, ids, question_ids, max_new)))
    print(f"  full cache: {full}", flush=True)
    mapping = {m.press: m for m in MAPPINGS}
    rows = []

    def run(row: dict, result: dict, method) -> None:
        try:
            params = row["params"] if isinstance(method, str) else None
            mine, answer = _kvtrim_run(model, ids, method, params, theirs["ratio"], question_ids, max_new,
                                       bool(result.get("question_token_by_token")))
            row.update(compare(result["kept"], mine), status="ok")
            row.update(compare_answers(result.get("answer"), said(answer)))
        except Exception as exc:
            row["status"] = f"kvtrim error: {type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        print(f"  {row['press']:>24} -> {row['method']}: {row.get('identical_heads', '-')} "
              f"answer {row.get('answer_identical', '-')} {row['status']}", flush=True)  # fmt: skip

    for press, result in theirs["presses"].items():
        m = mapping.get(press)
        row = {"press": press, "method": m.method if m else None, "params": m.params if m else {}}
        if "error" in result:
            row["status"] = f"kvpress error: {result['error']}"
        elif m is None or m.method is None:
            row["status"] = "no kvtrim method"
        else:
            run(row, result, m.method)
            for label, override in VARIANTS.get(press, ()):
                run({"press": press, "method": m.method, "params": {**m.params, **override}, "variant": label},
                    result, m.method)  # fmt: skip
            if press == "PyramidKVPress":  # the same again at kvpress's own per-layer counts
                counts = [len(layer[0]) for layer in result["kept"]]
                pipe = pyramid_counts_pipeline(model, m.params, theirs["ratio"], counts, ids.shape[1])
                run({"press": press, "method": m.method, "params": m.params, "variant": "kvpress's layer counts"},
                    result, pipe)  # fmt: skip
            continue
        rows.append(row)
        print(f"  {press:>24} -> {row['method']}: {row['status']}", flush=True)
    report = {"ratio": theirs["ratio"], "tokens": ids.shape[1], "question": theirs["question"],
              "max_new_tokens": max_new, "full_cache": full,
              "kvpress_side": {k: theirs[k] for k in ("kvpress", "transformers", "torch")}, "rows": rows}  # fmt: skip
    (out / "parity.json").write_text(json.dumps(report, indent=1))
    (out / "parity.md").write_text(markdown(report))
    print(markdown(report))
    return 0


def answer_cell(row: dict) -> str:
    """The answer column: identical, or how far the two greedy answers agree."""
    if row.get("answer_identical") is None:
        return "-"
    if row["answer_identical"]:
        return "identical"
    return f"differ ({row['answer_common_words']} leading words shared)"


def markdown(report: dict) -> str:
    full = report.get("full_cache")
    head = (f"Kept entries and greedy answers, kvpress {report['kvpress_side']['kvpress']} (transformers "
            f"{report['kvpress_side']['transformers']}) against kvtrim, SmolLM2-135M-Instruct in float32, "
            f"{report['tokens']}-token context, ratio {report['ratio']}.\n\n")  # fmt: skip
    if full is not None:
        head += (f"Question after compression: {json.dumps(report['question'])}, greedy, at most "
                 f"{report['max_new_tokens']} new tokens. Uncompressed cache: {answer_cell(full)} "
                 f"(kvpress {json.dumps(full['answer_kvpress'])}, "
                 f"kvtrim {json.dumps(full['answer_kvtrim'])}).\n\n")  # fmt: skip
    head += ("| press | kvtrim method | identical (layer, head) sets | mean Jaccard | most positions one head "
             "differs by | entries kvpress / kvtrim | greedy answers | status |\n"
             "|---|---|---:|---:|---:|---|---|---|\n")  # fmt: skip
    lines = []
    for r in report["rows"]:
        method = f"`{r['method']}`" + (f" ({r['variant']})" if r.get("variant") else "") if r["method"] else "-"
        if r["status"] == "ok":
            lines.append(f"| {r['press']} | {method} | {100 * r['identical_heads']:.1f} % | "
                         f"{r['mean_jaccard']:.3f} | {r['max_head_difference']} | {r['kept_kvpress']} / "
                         f"{r['kept_kvtrim']} | {answer_cell(r)} | ok |")  # fmt: skip
        else:
            lines.append(f"| {r['press']} | {method} | | | | | | {r['status']} |")
    answers = [f"- {r['press']}{' (' + r['variant'] + ')' if r.get('variant') else ''}: kvpress "
               f"{json.dumps(r['answer_kvpress'])}, kvtrim {json.dumps(r['answer_kvtrim'])}"
               for r in report["rows"] if r.get("answer_identical") is False]  # fmt: skip
    tail = "\n\nThe answers that differ:\n\n" + "\n".join(answers) + "\n" if answers else "\n"
    return head + "\n".join(lines) + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("half", choices=("kvpress", "kvtrim"))
    ap.add_argument("--out", required=True, help="folder for kvpress.json.gz, parity.json and parity.md")
    ap.add_argument("--model-dir", help="kvpress half: the model's folder (config, tokenizer, safetensors)")
    ap.add_argument("--model", default="smollm2-135m", help="kvtrim half: the model (kvtrim's name or a path)")
    ap.add_argument("--context-file", help="the context text (its first --tokens tokens are used)")
    ap.add_argument("--tokens", type=int, default=CONTEXT_TOKENS)
    ap.add_argument("--ratio", type=float, default=RATIO)
    ap.add_argument("--question", default=QUESTION, help="kvpress half: asked after compression")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument("--presses", help="kvpress half: a comma-separated subset of the presses (default: all)")
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
