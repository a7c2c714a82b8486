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
counts, and whether the two greedy answers are identical (both answers in ``parity.json``). Presses that need weights
from the Hub are not in the list. ThinKPress is compared by the key channels it prunes (read as the columns it
zeroes); DuoAttentionPress streams by kvtrim's shipped ``duo`` gates (``--duo-gates``), handed to the press instead of
the authors' downloaded pattern; FinchPress gets kvpress's delimiter token between the context and the question;
SimLayerKVPress and DMSPress run with the settings below on both sides. KeyRerotationPress is compared by the
original positions it keeps: on kvpress's side the indices its inner press hands to ``rerotate_keys`` (checked
against the cache: the values are the prefill's rows there, the keys those rows re-rotated), on kvtrim's the
selection ``key_rerotation`` records before the keys move (the store then holds the new positions). KVgradPress is
driven as KVzipPress (its compression runs on leaving the press, then masks); extra rows run kvtrim's ``kvzip`` and
``kvgrad`` with the chat template's opening unscored, then also out of the scoring softmax, as kvpress's chunk
does. ``--presses``
runs a subset on either half and keeps the other presses' results already in ``--out``.
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


SIMLAYERKV_RECENT = 128  # SimLayerKV's recent window on both sides (the settings below)
# the same press against kvtrim's own defaults where the mapping follows a kvpress choice (extra rows)
VARIANTS = {
    "NonCausalAttnPress": [("kvtrim's default, logits scaled by 1/√d", {"scaled": True})],
    "AdaKVPress": [("kvtrim's default rule", {"rule": "official"})],
    "CriticalAdaKVPress": [("kvtrim's default rule", {"rule": "official"})],
    # kvpress's lazy layer keeps n_recent − n_last recent tokens, kvtrim's n_recent: the same count
    "SimLayerKVPress": [("n_recent=127, kvpress's kept count", {"n_recent": SIMLAYERKV_RECENT - 1})],
}

# Presses run with settings of their own (docs/kvpress-parity.md). DuoAttention: both sides stream the heads of one
# pattern, kvtrim's shipped ``duo`` gates (kvpress can only download the authors' patterns), with kvtrim's sink and
# recent window. SimLayerKV: kvpress's defaults (threshold 1.0, 1024 recent) compress nothing at 512 tokens, so a
# threshold that makes some layers lazy and a shorter recent window. DMS: a threshold on Knorm's score (−‖k‖)
# near the median key norm of this context outside the window (16.7), so about half of those entries leave.
DUO_SINK, DUO_RECENT = 16, 48
SIMLAYERKV = {"lazy_threshold": 0.8, "n_recent": SIMLAYERKV_RECENT, "n_initial": 4, "n_last": 1}
DMS = {"threshold": -16.5, "sliding_window_size": 128}
# the kvtrim side of those settings: (ratio, method parameters over the mapping's) per press
KVTRIM_SETTINGS = {
    "SimLayerKVPress": (0.0, {"threshold": SIMLAYERKV["lazy_threshold"], "n_recent": SIMLAYERKV["n_recent"],
                              "n_initial": SIMLAYERKV["n_initial"], "n_last": SIMLAYERKV["n_last"]}),
    "DMSPress": (0.0, {"threshold": DMS["threshold"], "recent": DMS["sliding_window_size"]}),
    "DuoAttentionPress": (None, {"sink": DUO_SINK, "recent": DUO_RECENT}),
}
# the artifact whose gates both sides stream by (the embedded model's, shipped with kvtrim)
DUO_GATES = "src/kvtrim/data/artifacts/llama-30L-9H-3KV-89866c606db2/duo.safetensors"


# --------------------------------------------------------------------------------------------------- kvpress half
def _presses(ratio: float, context: int = CONTEXT_TOKENS, duo_gates: str | None = None) -> dict:
    """The presses that run without weights from the Hub, built with their defaults (or the settings above);
    DuoAttentionPress only with ``duo_gates`` (the pattern both sides stream by)."""
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
        # key channels, not tokens: the ratio is the fraction of channels pruned (kvtrim's think takes it so too)
        "ThinKPress": lambda: kp.ThinKPress(key_channel_compression_ratio=ratio, window_size=32),
        "KVzipPress": lambda: kp.KVzipPress(compression_ratio=ratio),
        # kvtrim's key_rerotation wraps snapkv by default: here SnapKV at kvpress's defaults on both sides
        "KeyRerotationPress": lambda: kp.KeyRerotationPress(press=snap()),
        "KVgradPress": lambda: kp.KVgradPress(compression_ratio=ratio),
        **({"DuoAttentionPress": lambda: _duo_press(ratio, context, duo_gates)} if duo_gates else {}),
        "SimLayerKVPress": lambda: kp.SimLayerKVPress(**SIMLAYERKV),
        # no re-rotation: the kept keys stay the prefill's rows (kvtrim keeps true positions)
        "FinchPress": lambda: kp.FinchPress(compression_ratio=ratio, rerotate_keys=False),
        "DMSPress": lambda: kp.DMSPress(press=kp.KnormPress(), **DMS),
    }


def duo_streaming_heads(heads: int, context: int, ratio: float, window: int) -> int:
    """How many of ``heads`` (layer, KV head) pairs kvtrim's ``duo_attention`` streams at ``ratio``
    (:mod:`kvtrim.budgets.duo_heads`): ``⌈N (T − B) / (T − W)⌉`` with ``B`` the keep per head, at most ``N``."""
    keep = max(1, min(context, int(round(context * (1.0 - ratio), 6))))
    span = max(context - min(window, context), 1)
    return min(heads, max(0, -(-heads * (context - keep) // span)))


def _duo_press(ratio: float, context: int, gates_file: str):
    """DuoAttentionPress streaming the heads of the gates in ``gates_file`` (a ``[layers, kv_heads]`` ``gates``
    tensor), as many as kvtrim's rule streams at ``ratio``. kvpress loads a pattern through the press's
    ``load_attention_pattern(model) -> (sink, recent, head scores)``, which downloads the authors' files; the
    press instance is given one that returns these gates instead."""
    import kvpress as kp
    from safetensors.torch import load_file

    gates = load_file(gates_file)["gates"].float()
    streaming = duo_streaming_heads(gates.numel(), context, ratio, DUO_SINK + DUO_RECENT)
    press = kp.DuoAttentionPress(head_compression_ratio=streaming / gates.numel())
    press.load_attention_pattern = lambda model: (DUO_SINK, DUO_RECENT, gates.numpy())
    press.parity_gates = gates.tolist()  # recorded with the results: the kvtrim half checks it streams by the same
    return press


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


def pruned_channels(full: torch.Tensor, pruned: torch.Tensor) -> list[list[int]]:
    """Per head, the key channels ThinKPress pruned: zeroed in ``pruned`` ``[heads, n, d]`` where the prefill's
    keys ``full`` ``[heads, n, d]`` are not (the press zeroes the pruned channels of every key, the others stay
    bitwise the prefill's)."""
    out = []
    for f, p in zip(full, pruned, strict=True):
        zeroed = (p == 0).all(0) & (f != 0).any(0)  # [d]
        if not bool((zeroed | (p == f).all(0)).all()):
            raise RuntimeError("a key channel is neither the prefill's nor zeroed")
        out.append(sorted(int(c) for c in zeroed.nonzero().flatten()))
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


def gathered_positions(full: torch.Tensor, kept: torch.Tensor, indices: torch.Tensor) -> list[list[int]]:
    """Per head, the positions ``indices`` ``[heads, k]``, after checking that ``kept`` ``[heads, k, d]`` holds
    bitwise the rows of ``full`` ``[heads, n, d]`` at them (in that order)."""
    expected = full.gather(1, indices[..., None].expand(-1, -1, full.shape[-1]))
    if kept.shape != expected.shape or not torch.equal(kept, expected):
        raise RuntimeError("the compressed rows are not the prefill's rows at the recorded positions")
    return [sorted(int(i) for i in head) for head in indices]


def _capture_rerotation(press) -> dict:
    """Record, layer by layer, the positions KeyRerotationPress keeps (its inner press's top-k) as it hands them
    to its ``rerotate_keys``: the kept keys are then rotated to ``0 … n−1`` and match no prefill key row."""
    captured: dict = {}
    rerotate = press.rerotate_keys

    def record_and_rerotate(module, indices, keys):
        captured[int(module.layer_idx)] = indices[0].clone()  # [kv heads, n kept], sorted by position
        return rerotate(module, indices, keys)

    press.rerotate_keys = record_and_rerotate
    return captured


def _rerotated_kept(press, module, indices: torch.Tensor, full, compressed) -> list[list[int]]:
    """The positions a KeyRerotationPress layer kept, checked against its cache: the values are bitwise the
    prefill's at ``indices`` (``[kv heads, n kept]``) and the keys bitwise the prefill's rows there re-rotated by
    the press's own ``rerotate_keys``."""
    kept = gathered_positions(full.values[0], compressed.values[0], indices)
    with torch.inference_mode():
        expected = type(press).rerotate_keys(module, indices[None], full.keys)
    if not torch.equal(expected, compressed.keys):
        raise RuntimeError("the compressed keys are not the prefill's keys at the recorded positions re-rotated")
    return kept


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
    out = Path(args.out)
    chosen = set(args.presses.split(",")) if args.presses else None
    earlier = out / "kvpress.json.gz"
    if chosen is not None and earlier.exists():  # a subset: the other presses' results stay
        with gzip.open(earlier, "rt") as fh:
            before = json.load(fh)
        same = ("ratio", "input_ids", "question_ids", "max_new_tokens")
        if any(before.get(k) != results[k] for k in same):
            raise SystemExit(f"{earlier} was run on another context, question or ratio: rerun every press")
        results["presses"] = {k: v for k, v in before["presses"].items() if k not in chosen}
    n = ids.shape[1]
    models, pipes = {}, {}

    def load(key: str):
        """The model (and pipeline) of ``key``: the attention implementation, or ``finch`` (its own copy, whose
        tokenizer and embeddings take kvpress's delimiter token)."""
        if key not in models:
            attn = "eager" if key == "eager" else "sdpa"
            models[key] = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32,
                                                               attn_implementation=attn).eval()  # fmt: skip
            tokenizer = AutoTokenizer.from_pretrained(args.model_dir) if key == "finch" else tok
            pipes[key] = pipeline("kv-press-text-generation", model=models[key], tokenizer=tokenizer, device="cpu")
        return models[key]

    def answer(key: str, cache, question: torch.Tensor = question_ids, start: int = n) -> tuple[str, bool]:
        """kvpress's own greedy decoding (its pipeline's ``generate_answer``): ``question`` after the cache, at
        positions start, start+1, ..., then argmax tokens until EOS or ``max_new_tokens``. Where the layers hold
        different counts (PyramidKV, KVCompose, SimLayerKV) transformers cannot build one mask for a many-token
        question, so the question is fed one token at a time (the flag returned)."""
        lengths = {layer.keys.shape[-2] for layer in cache.layers}
        if len(lengths) == 1:
            return pipes[key].generate_answer(question, cache, start, args.max_new_tokens), False
        model = models[key]
        for i in range(question.shape[1] - 1):
            model(input_ids=question[:, i : i + 1], past_key_values=cache, position_ids=torch.tensor([[start + i]]))
        last = question.shape[1] - 1
        said = pipes[key].generate_answer(question[:, last:], cache, start + last, args.max_new_tokens)
        return said, True

    presses = _presses(args.ratio, n, args.duo_gates)
    if chosen is not None and chosen - set(presses):
        raise SystemExit(f"--presses: unknown {sorted(chosen - set(presses))}; known: {', '.join(presses)}")
    for name, make in presses.items():
        if chosen is not None and name not in chosen:
            continue
        key = {"ObservedAttentionPress": "eager", "FinchPress": "finch"}.get(name, "sdpa")
        model = load(key)
        if "answer_full" not in results:  # the uncompressed cache's answer: both decoding loops agree on it
            with torch.inference_mode():
                cache = DynamicCache()
                model(ids, past_key_values=cache, use_cache=True)
                results["answer_full"] = answer(key, cache)[0]
            print(f"  full cache: {results['answer_full']!r}", flush=True)
        try:
            for layer in model.model.layers:
                layer.self_attn.masked_key_indices = None
            press = make()
            captured = _capture_kvcompose(press) if name == "KVComposePress" else None
            rerotated = _capture_rerotation(press) if name == "KeyRerotationPress" else None
            prompt, question, start, extra = ids, question_ids, n, {}
            fed = ids
            if name == "FinchPress":
                # kvpress's FINCH finds its window by a delimiter token between context and question: the tokenizer
                # and the embeddings take the token (update_model_and_tokenizer), the press removes it after the
                # embedding. The question but its last token is the window; the last token is fed after
                # compression and starts the answer.
                press.update_model_and_tokenizer(model, pipes[key].tokenizer)
                prompt = torch.cat([ids, question_ids[:, :-1]], dim=1)
                delimiter = torch.tensor([[press.delimiter_token_id]])
                fed = torch.cat([ids, delimiter, question_ids[:, :-1]], dim=1)
                question, start = question_ids[:, -1:], prompt.shape[1]
                extra = {"window": question_ids.shape[1] - 1}
            with torch.inference_mode():
                full = DynamicCache()
                model(prompt, past_key_values=full, use_cache=True)
                cache = DynamicCache()
                with press(model):
                    model(fed, past_key_values=cache, use_cache=True, output_attentions=key == "eager")
            if name == "FinchPress":
                extra["window_found"] = press.window_size
            if rerotated is not None:  # kvpress's pipeline decodes after the compressed length (keys at 0 … n−1)
                start = cache.get_seq_length()
                extra["question_start"] = start
            if name == "DuoAttentionPress":
                extra.update(gates=press.parity_gates, streaming_heads=int(press.streaming_mask.sum()))
            kept = []
            for layer, (fl, cl) in enumerate(zip(full.layers, cache.layers, strict=True)):
                module = model.model.layers[layer].self_attn
                masked = getattr(module, "masked_key_indices", None)
                if name == "ThinKPress":  # channels, not tokens
                    kept.append(pruned_channels(fl.keys[0], cl.keys[0]))
                elif rerotated is not None:
                    kept.append(_rerotated_kept(press, module, rerotated[layer], fl, cl))
                elif captured is not None:
                    kept.append(captured["kept"][layer])
                elif masked is not None:  # a masking press: every key stays in the cache, the masked are never seen
                    heads, length = fl.keys.shape[1], fl.keys.shape[2]
                    gone = [set() for _ in range(heads)]
                    for _, h, s in zip(*(t.tolist() for t in masked), strict=True):
                        gone[h].add(s)
                    kept.append([sorted(set(range(length)) - g) for g in gone])
                elif name in ("DMSPress", "DuoAttentionPress", "KVzipPress", "KVgradPress"):  # masks none here
                    kept.append([list(range(fl.keys.shape[2]))] * fl.keys.shape[1])
                else:
                    kept.append(kept_by_matching(fl.keys[0], cl.keys[0]))
            with torch.inference_mode():  # the masks stay set while decoding: kvpress's attention patch reads them
                said, stepwise = answer(key, cache, question, start)
            for layer in model.model.layers:
                layer.self_attn.masked_key_indices = None
            unit = {"unit": "pruned key channels"} if name == "ThinKPress" else {}
            results["presses"][name] = {"kept": kept, "answer": said, "question_token_by_token": stepwise, **unit,
                                        **extra}  # fmt: skip
            print(f"  {name}: {sum(len(h) for layer in kept for h in layer)} {unit.get('unit', 'entries kept')}; "
                  f"{said!r}", flush=True)  # fmt: skip
        except Exception as exc:  # recorded; the other presses still run
            results["presses"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(f"  {name}: error {results['presses'][name]['error']}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    with gzip.open(out / "kvpress.json.gz", "wt") as fh:
        json.dump(results, fh)
    return 0


# ---------------------------------------------------------------------------------------------------- kvtrim half
def _kvtrim_run(model, ids: torch.Tensor, method, params: dict | None, ratio: float, question_ids: torch.Tensor,
                max_new_tokens: int, token_by_token: bool = False,
                channels: bool = False) -> tuple[list[list[list[int]]], list[int]]:
    """Compress ``ids`` ``[1, n]`` with ``method`` (a registry name or a built pipeline), read each (layer, head)'s
    kept positions from the stores (``channels``: the key channels it pruned, for ``think``; a pipeline that
    re-rotates keys: the positions its selection kept, recorded before they move, see :func:`recording_rerotation`),
    then answer ``question_ids`` ``[1, q]`` from the compressed cache: the question fed after it at positions n,
    n+1, ... and greedy tokens until EOS or ``max_new_tokens`` (kvtrim's ``questions=`` path:
    :func:`kvtrim.runtime.feed` and :func:`kvtrim.runtime.greedy_decode`). Returns the kept positions and the
    answer's token ids (EOS left out)."""
    from kvtrim.integration.attention import kvtrim_attention_enabled
    from kvtrim.integration.cache import KVTrimCache
    from kvtrim.runtime import feed, greedy_decode, resolve_method

    pipeline, spec = resolve_method(method, ratio, None, params or None, model)
    moved = None
    if pipeline.rerotate is not None:
        pipeline, moved = recording_rerotation(pipeline)
    cache = KVTrimCache(model.config.num_hidden_layers, pipeline, spec, auto_compress=False)
    with torch.inference_mode(), kvtrim_attention_enabled(model):
        model(ids, past_key_values=cache, use_cache=True)
        cache.compress()
        kept = []
        for layer in cache.kv_layers:
            store = layer.store
            heads = []
            if channels:
                kept.append([pruned_of(store.channels[0, h].tolist(), store.head_dim) for h in range(store.kv_heads)])
                continue
            for h in range(store.kv_heads):
                pos = store.row(0, h)[2] if hasattr(store, "row") else store.positions[0, h]
                heads.append(sorted(int(p) for p in pos.tolist() if p >= 0))
            kept.append(heads)
        if moved is not None:
            kept = original_positions(moved, kept, ids.shape[1])
        answer = _greedy(model, cache, ids.shape[1], question_ids, max_new_tokens, feed, greedy_decode,
                         token_by_token)
    return kept, answer


def recording_rerotation(pipeline):
    """``(pipeline, record)``: ``pipeline`` whose key re-rotation first records, per layer, the positions its
    selection keeps (``record[layer]``: ``[kv head] -> sorted positions``), the positions the store no longer
    holds once the kept keys are moved to contiguous ones."""
    import dataclasses

    from kvtrim.selection.merge import kept_slots

    record: dict[int, list[list[int]]] = {}
    base = type(pipeline.rerotate)

    class RecordingRerotation(base):
        def rerotate(self, view, selection):
            kept = kept_slots(selection, view.keys.shape[2]) & view.valid
            record[view.layer_idx] = [sorted(int(p) for p in view.positions[0, h][kept[0, h]].tolist())
                                      for h in range(kept.shape[1])]  # fmt: skip
            return super().rerotate(view, selection)

    fields = {f.name: getattr(pipeline.rerotate, f.name) for f in dataclasses.fields(pipeline.rerotate)}
    return dataclasses.replace(pipeline, rerotate=RecordingRerotation(**fields)), record


def original_positions(record: dict[int, list[list[int]]], stored: list[list[list[int]]],
                       context: int) -> list[list[list[int]]]:
    """The recorded positions (:func:`recording_rerotation`) per ``[layer][head]``, after checking that the store of
    each holds as many entries, at the contiguous positions ``context − n … context − 1``."""
    kept = [record[layer] for layer in range(len(stored))]
    for layer, (before, after) in enumerate(zip(kept, stored, strict=True)):
        for h, (b, a) in enumerate(zip(before, after, strict=True)):
            if a != list(range(context - len(b), context)):
                raise RuntimeError(f"layer {layer} head {h}: the store's positions are not the kept ones packed")
    return kept


def opening_unscored(pipeline, start: int, stop: int):
    """``pipeline`` whose scores of the positions in ``[start, stop)`` are 0 (kvpress's KVzip and KVgrad leave the
    chat template's opening past the sinks unscored; their scores are ≥ 0, so these go first)."""
    score = pipeline.scorer.score

    def zeroed(view):
        s = score(view)
        return s.masked_fill((view.positions >= start) & (view.positions < stop), 0.0)

    pipeline.scorer.score = zeroed
    return pipeline


def opening_left_out(pipeline, start: int, stop: int):
    """``pipeline`` (``kvzip`` or ``kvgrad``) whose scoring attention leaves out the keys of the positions in
    ``[start, stop)``: they are out of each reconstruction query's softmax and score 0, as in kvpress's KVzip and
    KVgrad, whose attention runs over the sinks, the chunk re-read and the re-read's own keys only. The re-read
    pass itself (the model's attention) still sees them. ``kvgrad`` scores in ``attributed_attention``, ``kvzip``
    by the attention statistics its replay records (the cache's ``record``); either is replaced for the duration
    of the scorer's ``prepare``, the key positions in the span set to ``-1`` (no key)."""
    from kvtrim.integration import cache
    from kvtrim.scoring import gradient_attribution
    from kvtrim.scoring.reconstruction import ReconstructionScorer

    def outside(positions: torch.Tensor) -> torch.Tensor:
        return positions.masked_fill((positions >= start) & (positions < stop), -1)

    if isinstance(pipeline.scorer, gradient_attribution.GradientAttributionScorer):

        def attributed_without(attributed):
            def without_opening(queries, query_positions, keys, key_positions, *rest):
                return attributed(queries, query_positions, keys, outside(key_positions), *rest)

            return without_opening

        return during_prepare(pipeline, gradient_attribution, "attributed_attention", attributed_without)
    if isinstance(pipeline.scorer, ReconstructionScorer):

        def record_without(record):
            def without_opening(spec, obs, store, query, query_positions, scaling):
                return record(spec, obs, _WithPositions(store, outside(store.positions)), query, query_positions,
                              scaling)  # fmt: skip

            return without_opening

        return during_prepare(pipeline, cache, "record", record_without)
    raise TypeError(f"opening_left_out: {type(pipeline.scorer).__name__} is neither kvzip's nor kvgrad's scorer")


class _WithPositions:
    """``store`` seen with other key ``positions`` (everything else, its statistics included, is the store's)."""

    def __init__(self, store, positions: torch.Tensor) -> None:
        self._store, self.positions = store, positions

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def during_prepare(pipeline, module, name: str, wrap):
    """``pipeline`` whose scorer's ``prepare`` runs with ``module.name`` replaced by ``wrap(module.name)`` (put back
    afterwards). A ``prepare`` that never calls the replacement (e.g. scores reused from an earlier pass over the
    same prompt) is an error: the variant would silently be the plain method."""
    prepare = pipeline.scorer.prepare

    def wrapped_prepare(views):
        original = getattr(module, name)
        replacement = wrap(original)
        calls = []

        def counted(*args, **kwargs):
            calls.append(1)
            return replacement(*args, **kwargs)

        setattr(module, name, counted)
        try:
            prepare(views)
        finally:
            setattr(module, name, original)
        if not calls:
            raise RuntimeError(f"{module.__name__}.{name} was not called while scoring: the variant did not apply")

    pipeline.scorer.prepare = wrapped_prepare
    return pipeline


def pruned_of(kept: list[int], head_dim: int) -> list[int]:
    """The channels of ``range(head_dim)`` not in ``kept``."""
    return sorted(set(range(head_dim)) - set(kept))


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


def _zeroed_prefill_answer(model, ids: torch.Tensor, pruned: list[list[list[int]]], question_ids: torch.Tensor,
                           max_new_tokens: int) -> list[int]:
    """The greedy answer from a plain cache of ``ids`` whose prefill keys have the ``pruned`` channels
    (``[layer][head]``) zeroed and whose later keys (question, answer) stay whole: ThinKPress's cache, with kvtrim's
    choice of channels."""
    from transformers import DynamicCache

    from kvtrim.runtime import feed, greedy_decode

    cache = DynamicCache()
    with torch.inference_mode():
        model(ids, past_key_values=cache, use_cache=True)
        for layer, heads in zip(cache.layers, pruned, strict=True):
            for h, channels in enumerate(heads):
                layer.keys[0, h, :, channels] = 0.0
        return _greedy(model, cache, ids.shape[1], question_ids, max_new_tokens, feed, greedy_decode)


def lazy_layers(kept: list[list[list[int]]], context: int) -> list[int]:
    """The layers whose every head keeps fewer than ``context`` positions (SimLayerKV's lazy layers)."""
    return [i for i, layer in enumerate(kept) if all(len(h) < context for h in layer)]


def count_between(kept: list[list[list[int]]], start: int, stop: int) -> int:
    """How many kept positions fall in ``[start, stop)``, over every (layer, head)."""
    return sum(start <= p < stop for layer in kept for h in layer for p in h)


def positions_from(kept: list[list[list[int]]], start: int) -> list[list[list[int]]]:
    """``kept`` without the positions before ``start``."""
    return [[[p for p in h if p >= start] for h in layer] for layer in kept]


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


def rerotation_pipeline(model, base_params: dict, ratio: float):
    """kvtrim's ``key_rerotation`` around ``snapkv`` with ``base_params`` (e.g. kvpress's SnapKV settings, which
    the method's ``base`` name cannot carry): the registered method's re-rotation part, snapkv's other parts."""
    from kvtrim.methods.registry import parts
    from kvtrim.runtime import resolve_method

    base, _ = resolve_method("snapkv", ratio, None, base_params, model)
    wrapper, _ = resolve_method("key_rerotation", ratio, None, {"base": "snapkv"}, model)
    return parts(base.scorer, base.budget, base.selector, merge=base.merge, rerotate=wrapper.rerotate)


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


def merge_rows(before: list[dict], after: list[dict]) -> list[dict]:
    """``before``'s rows, those of every press ``after`` has rows for replaced by ``after``'s (where the press's
    first row was), the presses new to ``before`` appended."""
    fresh: dict[str, list[dict]] = {}
    for row in after:
        fresh.setdefault(row["press"], []).append(row)
    rows = []
    for row in before:
        if row["press"] not in fresh:
            rows.append(row)
        elif row is next(r for r in before if r["press"] == row["press"]):
            rows.extend(fresh[row["press"]])
    placed = {r["press"] for r in before}
    return rows + [r for r in after if r["press"] not in placed]


def kvtrim_half(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(ROOT / "src"))
    import kvtrim
    from kvtrim.methods.kvpress_map import MAPPINGS

    out = Path(args.out)
    with gzip.open(out / "kvpress.json.gz", "rt") as fh:
        theirs = json.load(fh)
    chosen = set(args.presses.split(",")) if args.presses else None
    if chosen is not None and chosen - set(theirs["presses"]):
        raise SystemExit(f"--presses: {sorted(chosen - set(theirs['presses']))} not in the kvpress half's results")
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

    def run(row: dict, result: dict, method, prompt: torch.Tensor = ids, question: torch.Tensor = question_ids,
            ratio: float = theirs["ratio"]) -> None:  # fmt: skip
        try:
            params = row["params"] if isinstance(method, str) else None
            mine, answer = _kvtrim_run(model, prompt, method, params, ratio, question, max_new,
                                       bool(result.get("question_token_by_token")), row["press"] == "ThinKPress")
            row.update(compare(result["kept"], mine), status="ok")
            row.update(compare_answers(result.get("answer"), said(answer)), answer_kvtrim_tokens=answer)
            row.update(_diagnostics(row["press"], result, mine, prompt.shape[1]))
        except Exception as exc:
            mine = None
            row["status"] = f"kvtrim error: {type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        print(f"  {row['press']:>24} -> {row['method']}: {row.get('identical_heads', '-')} "
              f"answer {row.get('answer_identical', '-')} {row['status']}", flush=True)  # fmt: skip
        return mine

    def template_opening() -> int:
        """The length of the chat template's opening, which KVzip's and KVgrad's re-read leave out."""
        from kvtrim.prompts import prompt_template

        return len(tok(prompt_template(tok).prefix, add_special_tokens=False).input_ids)

    def _diagnostics(press: str, result: dict, mine: list, context: int) -> dict:
        """What explains a difference: SimLayerKV's lazy layers on each side; for KVzip and KVgrad, the entries each
        side keeps in the chat template's opening (kvpress leaves its first tokens unscored, past the sinks) and the
        agreement on the positions after it."""
        if press == "SimLayerKVPress":
            return {"lazy_layers_kvpress": lazy_layers(result["kept"], context),
                    "lazy_layers_kvtrim": lazy_layers(mine, context)}  # fmt: skip
        if press in ("KVzipPress", "KVgradPress"):
            opening, sinks = template_opening(), mapping[press].params["n_sink"]
            return {"template_opening": opening,
                    "opening_kept_kvpress": count_between(result["kept"], sinks, opening),
                    "opening_kept_kvtrim": count_between(mine, sinks, opening),
                    "after_opening": compare(positions_from(result["kept"], opening), positions_from(mine, opening))}
        return {}

    for press, result in theirs["presses"].items():
        if chosen is not None and press not in chosen:
            continue
        m = mapping.get(press)
        row = {"press": press, "method": m.method if m else None, "params": m.params if m else {}}
        if "unit" in result:
            row["unit"] = result["unit"]
        if "error" in result:
            row["status"] = f"kvpress error: {result['error']}"
        elif m is None or m.method is None:
            row["status"] = "no kvtrim method"
        else:
            ratio, settings = KVTRIM_SETTINGS.get(press, (None, {}))
            row["params"] = {**m.params, **settings}
            if ratio is not None:
                row["ratio"] = ratio
            prompt, question = ids, question_ids
            if press == "FinchPress":  # the window kvpress found by its delimiter: the question but its last token
                prompt = torch.cat([ids, question_ids[:, :-1]], dim=1)
                question = question_ids[:, -1:]
                row["params"] = {**row["params"], "window": result["window"]}
            if press == "DuoAttentionPress":  # both sides stream by the same gates
                from kvtrim.artifacts.duo import load_duo_gates

                gates, _ = load_duo_gates(model)
                row["same_head_pattern"] = gates.tolist() == result["gates"]
                row["streaming_heads_kvpress"] = result["streaming_heads"]
            method = m.method
            if press == "KeyRerotationPress":  # the base at the settings of the press's inner SnapKVPress
                method = rerotation_pipeline(model, mapping["SnapKVPress"].params, theirs["ratio"])
                row["params"] = {**row["params"], "base_params": mapping["SnapKVPress"].params}
            mine = run(row, result, method, prompt, question, theirs["ratio"] if ratio is None else ratio)
            if press == "KeyRerotationPress":  # the method as registered: snapkv at kvtrim's own defaults
                run({"press": press, "method": m.method, "params": m.params,
                     "variant": "kvtrim's default base settings, snapkv w=8, max-pool 7"}, result, m.method)
            if press in ("KVzipPress", "KVgradPress"):  # kvpress's opening left unscored, then out of the softmax
                from kvtrim.runtime import resolve_method

                opening, sinks = template_opening(), m.params["n_sink"]
                span = f"positions {sinks}–{opening - 1}"
                for label, wrap in ((f"{span} unscored, as kvpress", opening_unscored),
                                    (f"{span} also out of the scoring softmax, as kvpress", opening_left_out)):
                    pipe, _ = resolve_method(m.method, theirs["ratio"], None, m.params, model)
                    # a copy of the ids: kvzip reuses the scores of a prompt it already scored (by its ids tensor),
                    # which would skip the replay whose softmax this variant changes
                    run({"press": press, "method": m.method, "params": m.params, "variant": label}, result,
                        wrap(pipe, sinks, opening), ids.clone())  # fmt: skip
            if press == "ThinKPress" and mine is not None:  # kvtrim's channels, the later keys left whole
                said_zeroed = said(_zeroed_prefill_answer(model, ids, mine, question_ids, max_new))
                rows.append({**{k: v for k, v in row.items() if not k.startswith("answer")},
                             "variant": "its channels zeroed in the prefill's keys only, as kvpress",
                             **compare_answers(result["answer"], said_zeroed)})  # fmt: skip
            for label, override in VARIANTS.get(press, ()):
                run({"press": press, "method": m.method, "params": {**row["params"], **override}, "variant": label},
                    result, m.method, prompt, question, theirs["ratio"] if ratio is None else ratio)  # fmt: skip
            if press == "PyramidKVPress":  # the same again at kvpress's own per-layer counts
                counts = [len(layer[0]) for layer in result["kept"]]
                pipe = pyramid_counts_pipeline(model, m.params, theirs["ratio"], counts, ids.shape[1])
                run({"press": press, "method": m.method, "params": m.params, "variant": "kvpress's layer counts"},
                    result, pipe)  # fmt: skip
            continue
        rows.append(row)
        print(f"  {press:>24} -> {row['method']}: {row['status']}", flush=True)
    if chosen is not None and (out / "parity.json").exists():  # a subset: the other presses' rows stay
        rows = merge_rows(json.loads((out / "parity.json").read_text())["rows"], rows)
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
        notes = "; ".join(r[k] for k in ("unit", "variant") if r.get(k))
        method = f"`{r['method']}`" + (f" ({notes})" if notes else "") if r["method"] else "-"
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
    ap.add_argument("--presses", help="a comma-separated subset of the presses (default: all); the other presses' "
                    "results already in --out stay")
    ap.add_argument("--duo-gates", default=str(ROOT / DUO_GATES),
                    help="kvpress half: the duo artifact whose gates DuoAttentionPress streams by ('' skips the press)")
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
