"""kvpress's presses → kvtrim's methods: the table of ``docs/kvpress.md``, generated from this module and the registry.

:data:`MAPPINGS` holds one :class:`PressMapping` per export of the kvpress release listed in
``kvtrim/data/kvpress_exports.json`` (written by ``tools/kvpress_exports.py`` from the wheel; kvpress itself is not
a dependency): the registry method that does the press's job with the parameters that follow the press's defaults,
or the reason there is none. :func:`markdown_table` renders the rows, reading each method's family and paper from
the registry, so a method that is renamed or removed breaks the table's generation (and its test) instead of
leaving a stale row. ``python -m kvtrim.methods.kvpress_map --write docs/kvpress.md`` rewrites the block between
:data:`START` and :data:`END`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from . import table
from .registry import get_method, method_info
from .table import cite

START = "<!-- kvpress-table:start -->"
END = "<!-- kvpress-table:end -->"

EXPORTS_FILE = "kvpress_exports.json"


@dataclass(frozen=True)
class PressMapping:
    """One kvpress export and what stands for it in kvtrim.

    Attributes:
        press: the kvpress name (``SnapKVPress``)
        method: the registry method (``"snapkv"``; ``"snapkv@every:512"`` with a schedule), or None when there is
            no kvtrim method yet; a wrapper press that takes any scorer names the method it is shown with
        params: method parameters that follow the press's defaults (``get_method(method, **params)`` builds it)
        spelling: how the press's own parameters are spelled in kvtrim (``compression_ratio`` → ``ratio`` …)
        note: what differs from the press, or why there is no method
    """

    press: str
    method: str | None
    note: str
    params: dict = field(default_factory=dict)
    spelling: str = "`compression_ratio` → `ratio`"


_SNAPKV_PRESS = {"window": 64, "kernel": 5, "pooling": "avg"}
_WRAPS = "wraps any ScorerPress; shown with"
_CALIBRATED = "needs weights trained for each model and published on the Hub; a `kvtrim calibrate` that trains them "
_NOT_YET = "not yet built"

MAPPINGS: tuple[PressMapping, ...] = (
    PressMapping(
        "AdaKVPress", "adakv",
        f"{_WRAPS} SnapKV's scorer; kvtrim's AdaKV is SnapKV + head-adaptive budgets; `rule='kvpress'` is kvpress's "
        "safeguard (each head's own top α·keep forced in before the layer-wide top-k; kvtrim's default is the "
        "paper's floor of α·B per head)",
        {**_SNAPKV_PRESS, "alpha": 0.2, "rule": "kvpress"},
        "`alpha_safeguard` → `alpha`; `press` → the scorer of the method",
    ),
    PressMapping(
        "BlockPress", "block",
        f"{_WRAPS} KeyDiff's scorer: one full prefill, then the kept entries and each next block are scored "
        "together and the best `int(n·(1−ratio))` stay (kvpress's simulation of block prompt processing); blocks "
        "follow each head's own budget and count stored entries; an attention scorer's window stays the prompt's "
        "last queries (kvpress: each step's last tokens). A real block-wise prefill is `prefill_chunk=128` with "
        "any method `@every:128` (its target grows with the tokens seen; `budget=` fixes it)",
        {"block": 128, "base": "keydiff"}, "`block_size` → `block`; `press` → `base`",
    ),
    PressMapping(
        "CAMPress", "cam@every:512",
        "a wrapper: `base=` names the registry method whose scorer, budget and selector run (default `h2o`; kvpress "
        "takes any ScorerPress); each (row, KV head) evicts and merges on its own (kvpress: one set per layer from "
        "the scores averaged over heads); every evicted entry is a merge candidate (kvpress: at most as many as "
        "tokens arrived since the last compression, the best scored); the attention sums run over the prompt and "
        "the decoded tokens (kvpress: the decoded tokens only); draws are seeded (`seed`); kvtrim also compresses "
        "once after prefill; quantized entries (`kv_quant`) are refused",
        {"base": "h2o", "window": 32},
        "`merge_budget` → `window`; `compression_interval` → `@every:N`; `target_size` → `budget`; `base_press` → "
        "`base`; `hidden_states_buffer_size` → none",
    ),
    PressMapping(
        "CURPress", "curdkv",
        "windows are windows of positions (kvpress: of slots, the same without padding or earlier eviction); the "
        "sinks are protected by the selector instead of scored 1; `use_random_leverage` (a random projection) is "
        "not offered",
        {"kind": "kv_product", "window": 16, "n_sink": 4},
        "`leverage_type` → `kind`; `local_window_size` → `window`; `num_sinks` → `n_sink`",
    ),
    PressMapping(
        "CapPress", "capkv",
        "the anchor's queries are the prompt's recorded post-RoPE queries un-rotated (kvpress recomputes them "
        "from the hidden states); the sinks are protected by the selector instead of scored max + 1 (as in kvpress "
        "they take no part in the weights or the capacity matrix); padded positions take no part either",
        {"tau": 5.0, "n_future": 512, "n_sink": 4, "eps": 1e-6},
        "`n_future_positions` → `n_future`; `epsilon` → `eps`; `tau`, `n_sink`",
    ),
    PressMapping(
        "ChunkKVPress", "chunkkv", f"{_WRAPS} window attention (`w=8`, no pooling)",
        {"chunk": 20}, "`chunk_length` → `chunk`; `press` → the scorer of the method",
    ),
    PressMapping(
        "ChunkPress", "chunked",
        "a wrapper: `base=` names the registry method whose scorer runs (default `knorm`); kvpress scores each "
        "chunk on its own (a window scorer then looks at the chunk's last tokens), kvtrim scores the whole cache "
        "once and takes each chunk's quota from it, identical for per-key scores such as `knorm`; chunks are "
        "chunks of positions",
        {"chunk": 1024, "base": "knorm"}, "`chunk_length` → `chunk`; `press` → `base`",
    ),
    PressMapping(
        "CompactorPress", "compactor",
        "exact leverage instead of a random sketch; kvpress's default blending is the compression ratio, kvtrim's "
        "parts do not see the ratio: pass `blending=RATIO` (0.35 is kvpress's value without one); z-scores per "
        "batch row (kvpress: over the whole batch); padded positions take no part in chunks",
        {"chunk": 256, "sink_start": 8, "sink_end": 4},
        "`sink_size_start` → `sink_start`; `sink_size_end` → `sink_end`; `chunk_size` → `chunk`; `blending`; "
        "`sketch_dimension` → none (exact)",
    ),
    PressMapping(
        "CompressionRatioDecodingPress", "snapkv@every:512",
        "any method `@every:N` with `ratio`: kvtrim re-compresses to `int(seen·(1−ratio))` every N tokens, which is "
        "this press's target; kvtrim also compresses once after prefill (kvpress's decoding presses do not)",
        spelling="`compression_interval` → `@every:N`; `target_compression_ratio` → `ratio`; `base_press` → the "
        "method",
    ),
    PressMapping(
        "CriticalAdaKVPress", "critical_adakv", f"{_WRAPS} SnapKV's scorer; `rule='kvpress'` as for AdaKVPress",
        {**_SNAPKV_PRESS, "alpha": 0.5, "eps": 1e-4, "safeguard": 0.2, "rule": "kvpress"},
        "`first_stage_ratio` → `alpha`; `epsilon` → `eps`; `alpha_safeguard` → `safeguard`",
    ),
    PressMapping(
        "CriticalKVPress", "critical_snapkv", f"{_WRAPS} SnapKV's scorer",
        {**_SNAPKV_PRESS, "alpha": 0.5, "eps": 1e-4}, "`first_stage_ratio` → `alpha`; `epsilon` → `eps`",
    ),
    PressMapping(
        "DMSPress", "dms",
        "a wrapper: `scorer=` names the registry method whose scorer is thresholded (`scorer='kvzap'`: KVzap's "
        "surrogate, as the paper); `ratio=0` for the threshold alone (a ratio or budget caps each head); kvpress "
        "scores a token once, when it arrives, kvtrim re-scores the cache at each compression (the same for per-key "
        "scores like `knorm`; `kvzap` keeps the score each token got when it arrived); "
        "kvpress masks evicted entries, kvtrim frees them (per-head counts, stored ragged)",
        {"recent": 128, "scorer": "knorm"},
        "`threshold`; `sliding_window_size` → `recent`; `decoding=True` → `dms@every:N`; `press` → `scorer`",
    ),
    PressMapping(
        "DecodingPress", "snapkv@every:512",
        "any method `@every:N` with `budget=target_size`: re-compresses to a fixed size every N new tokens; kvtrim "
        "also compresses once after prefill, a no-op when the prompt fits the budget",
        spelling="`compression_interval` → `@every:N`; `target_size` → `budget`; `base_press` → the method",
    ),
    PressMapping(
        "DuoAttentionPress", "duo_attention",
        "streaming heads keep sinks + recent, retrieval heads everything; kvtrim calibrates its own head patterns "
        "(`kvtrim calibrate duo`) instead of downloading the authors'",
        spelling="`head_compression_ratio` → none: kvtrim streams as many of the lowest-gate heads as `ratio` "
        "(entries removed) needs",
    ),
    PressMapping(
        "EntropyGatedChunkKVPress", "entropy_chunkkv",
        f"{_WRAPS} window attention (`w=8`, no pooling, as `chunkkv`); the window is kept first and the chunks "
        "share the rest of the budget (kvpress: the scorer's own window handling); chunks, medians and the top-up "
        "are computed per batch row (kvpress: from row 0 for the whole batch); chunks are chunks of positions",
        {"chunk": 10, "spiky_keep": 4},
        "`chunk_length` → `chunk`; `low_entropy_chunk_length` → `spiky_keep`; `press` → the scorer of the method",
    ),
    PressMapping(
        "ExpectedAttentionPress", "expected_attention", "same statistics from the recorded prompt queries",
        {"n_future": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True, "eps": 0.0},
        "`n_future_positions` → `n_future`; `epsilon` → `eps`",
    ),
    PressMapping(
        "ExpectedAttentionStatsPress", "expected_attention_stats",
        "the statistics come from `kvtrim calibrate expected_attention_stats` (the `expected_attention_stats` "
        "artifact; the embedded model's ships with kvtrim) instead of the Hub: kvtrim's calibration prompts (pydoc "
        "prose and synthetic tasks) instead of 100 BookSum chapters, population covariance (kvpress: sample), "
        "queries un-rotated from the recorded post-RoPE ones as `expected_attention` does",
        {"n_future": 512, "n_sink": 4, "use_covariance": True, "use_vnorm": True, "eps": 0.0},
        "`n_future_positions` → `n_future`; `epsilon` → `eps`; `dataset_name`, `num_samples`, `sample_seq_len` → "
        "the calibration's options",
    ),
    PressMapping(
        "FastKVzipPress", "fastkvzip",
        "the gates come from `kvtrim calibrate fastkvzip` (the `fastkvzip` artifact; the embedded model's ships with "
        "kvtrim) instead of the authors' Hub weights: trained on kvtrim's own KVzip scores of pydoc prose and "
        "synthetic-task prompts with AdamW for a few epochs (the authors: SGD, 5,000 steps); each token is scored "
        "when it arrives; evicted entries are freed (per-head counts, stored ragged; kvpress masks them)",
        {"layerwise": False, "n_sink": 4, "window_ratio": 0.02, "window": 4096},
        "`window_size` → `window`; `window_ratio`, `n_sink`, `layerwise`; `compression_ratio` → `ratio`",
    ),
    PressMapping(
        "FinchPress", "finch",
        "the window is the prompt's question part, found by kvtrim from the context and question it was given "
        "(question-aware mode) instead of a delimiter token added to the tokenizer and the embeddings; context-only "
        "mode has no question at compression and is refused (`window=N` takes the last N prompt tokens instead); "
        "each question query's row is weighted by the entries it sees, itself included (kvpress: its position, one "
        "less); the question's entries score above the rest of their head (kvpress: above the global max); no "
        "key re-rotation by default (`rerotate_keys=True` is `key_rerotation` with `base='finch'`)",
        {"normalize": True, "chunk": None},
        "`chunk_length` → `chunk`; `normalize_scores` → `normalize`; `rerotate_keys` → `key_rerotation`; "
        "`delimiter_token` → question-aware mode",
    ),
    PressMapping(
        "KVComposePress", "kvcompose",
        "kvpress without task prompts re-reads the context; kvtrim re-reads the prompt through its cache the same "
        "way (one pass, queries in chunks of `chunk`); the GQA group is reduced by max (kvpress: mean, its "
        "`agg_group` option `max` is kvtrim's); `structured=True` holds one count per layer in the dense store as "
        "kvpress, `structured=False` frees the entries of each head (stored ragged; kvpress masks them in its "
        "attention patch); `add_v_norm` and `keep_token_lower_bound` are not offered (the floor is 1 per layer)",
        {"structured": True, "head_mean": True},
        "`structured`; `add_mean_across_heads` → `head_mean`; `agg_task` → max, `agg_head` → mean (fixed)",
    ),
    PressMapping(
        "KVgradPress", "kvgrad",
        "one reconstruction pass and one backward pass over the whole cache instead of 512-token chunks (each chunk's "
        "entries scored by that chunk's pass); every cached entry is scored, the chat template's opening included "
        "(kvpress leaves the opening's tokens past the sinks at score 0, evicted first, and out of the scoring "
        "softmax); Φ sums the last decoder layer's output over the reconstruction tokens of every row (padding "
        "excluded); gradients with respect to the activations only, as kvpress",
        {"n_sink": 4, "layerwise": False}, "`chunk_size` → none (one pass); `compression_ratio` → `ratio`",
    ),
    PressMapping(
        "KVzapPress", "kvzap",
        "the surrogate's weights come from `kvtrim calibrate kvzap` (the `kvzap` artifact; the embedded model's "
        "ships with kvtrim) instead of the Hub's `nvidia/KVzap-*`: trained on kvtrim's own KVzip scores (kvpress: "
        "KVzip+ scores, which also weigh each attention by the query's hidden-state norm and ‖W_O v‖) of pydoc prose "
        "and synthetic-task prompts (kvpress: Nemotron pretraining text), MLP width 128 (kvpress: 512); each token "
        "is scored when it arrives and the score is kept with its entry; the paper's threshold rule (kvpress's "
        "`ThresholdPress`/`DMSPress` around `KVzapPress`) is `dms` with `scorer='kvzap'`",
        {"model_type": "mlp", "layerwise": True, "n_sink": 0},
        "`model_type`; `compression_ratio` → `ratio`",
    ),
    PressMapping(
        "KVzipPress", "kvzip",
        "one reconstruction pass over the whole cache instead of 2K-token chunks; every cached entry is scored by the "
        "re-read's attention, the chat template's opening included (kvpress leaves the opening's tokens past the "
        "sinks at score 0, evicted first, and out of the scoring softmax)",
        {"n_sink": 4, "layerwise": False}, "`chunk_size` → `chunk` (attention recomputation, not re-read chunks)",
    ),
    PressMapping(
        "KeyDiffPress", "keydiff", "one shot after prefill, as kvpress",
    ),
    PressMapping(
        "KeyRerotationPress", "key_rerotation",
        "a wrapper: `base=` names the registry method whose scorer, budget, selector and merge run (default "
        "`snapkv`, kvtrim's settings; kvpress takes any ScorerPress); an opt-in departure from kvtrim's logical "
        "positions: each head's kept keys are rotated to contiguous positions ending where the context ends "
        "(kvpress: `0 … n−1` with decoding continuing at `n`; rotary attention sees only differences of positions, "
        "so the two give the same attention and new tokens keep the positions the model gives them); per-head "
        "counts are allowed (kvpress: one count per layer); quantized entries (`kv_quant`) are refused",
        {"base": "snapkv"}, "`press` → `base`",
    ),
    PressMapping(
        "KnormPress", "knorm", "same score (lowest key norm kept)",
    ),
    PressMapping(
        "LUKVPress", "lukv",
        "kvtrim computes its own curves (`kvtrim calibrate lukv`: greedy marginal future utility over each head's "
        "concave hull, the future being the question and answer of kvtrim's synthetic tasks) instead of "
        "downloading the authors' Llama-3.1-8B file; the curve is interpolated between whole percents (kvpress: "
        "rounded to the nearest) and the counts are rounded so every row keeps exactly the requested total; the "
        "scorer is fixed to kvpress's default (expected attention, ε=0.02)",
        {"sink": 4, "window": 1, "eps": 0.02},
        "`press` → none (expected attention, the curves' scorer); `sink`, `window`; `compression_ratio` → `ratio`",
    ),
    PressMapping(
        "LagKVPress", "lagkv", "kvtrim follows the paper's defaults (16 sinks) and compresses recursively",
        {"sink": 4, "lag": 128}, "`n_sink` → `sink`; `lag_size` → `lag`",
    ),
    PressMapping(
        "LeverageScorePress", "leverage",
        "exact leverage of the centred pre-RoPE keys; kvpress approximates it with a random 48-column Gaussian "
        "sketch (so its kept set changes from run to run); the z-normalization kvpress applies does not change "
        "a per-head top-k",
        spelling="`sketch_dimension` → none (exact)",
    ),
    PressMapping(
        "MergingPress", "merging",
        "a wrapper: `base=` names the registry method whose scorer, budget and selector run (default `knorm`); the "
        "merged values are written into the kept entries before compaction and the evicted entries are freed "
        "(per-head budgets stored ragged); `merge_fraction` keeps the most similar `⌈fraction·n⌉` merges of a head "
        "(kvpress: a similarity quantile); quantized entries (`kv_quant`) are refused",
        {"base": "knorm", "threshold": 0.0, "fraction": 1.0},
        "`similarity_threshold` → `threshold`; `merge_fraction` → `fraction`; `press` → `base`",
    ),
    PressMapping(
        "NonCausalAttnPress", "noncausal_attention",
        "kvpress softmaxes the raw q·k (no 1/√d, unlike the model's own attention); `scaled=False` does the same "
        "(kvtrim's default scales); chunks are chunks of positions; kvpress's padded last chunk lets its zero "
        "padding queries and keys take part (its key mask adds −1e-9, not −∞), kvtrim's last chunk holds only real "
        "tokens",
        {"chunk": 256, "scaled": False}, "`chunk_size` → `chunk`",
    ),
    PressMapping(
        "ObservedAttentionPress", "h2o", "kvpress divides each entry's summed prompt attention by the number of "
        "queries that see it (a mean, which favours late entries); kvtrim's H2O keeps the sum (the paper's "
        "accumulated attention); no recent window, as kvpress",
        {"recent_fraction": 0.0},
    ),
    PressMapping(
        "PerLayerCompressionPress", "per_layer_ratio",
        "a wrapper: `base=` names the registry method whose scorer and selector run (default `snapkv`, kvtrim's "
        "settings); as in kvpress the request's own ratio is not used once `ratios` is given; kvpress needs flash "
        "attention for it, kvtrim stores the per-layer counts densely per layer",
        {"base": "snapkv"}, "`compression_ratios` → `ratios` (one per layer); `press` → `base`",
    ),
    PressMapping(
        "PrefillDecodingPress", "snapkv@every:512",
        "one method compresses after prefill and `@every:N` while decoding, under one budget; two different "
        "presses for the two phases are not supported",
        spelling="`prefilling_press`, `decoding_press` → one method and its schedule",
    ),
    PressMapping(
        "PyramidKVPress", "pyramidkv",
        "kvpress's SnapKV window and pooling; the layer budgets differ (same total): kvpress's pyramid spreads the "
        "whole keep with the window inside each layer's count, kvtrim's (KVCache-Factory's) spreads keep − window and "
        "adds the window to each layer",
        {**_SNAPKV_PRESS, "beta": 20.0}, "`window_size` → `window`; `kernel_size` → `kernel`",
    ),
    PressMapping(
        "QFilterPress", "qfilter",
        "kvtrim computes its own filters (`kvtrim calibrate qfilter`: top singular direction of each GQA group's "
        "post-RoPE queries on kvtrim's synthetic tasks) instead of downloading the authors' Hub files; the filter "
        "points where the queries do and the score is `⟨k, u⟩` (kvpress: `−⟨k, f⟩` with the opposite filter, the "
        "same order)",
    ),
    PressMapping(
        "RandomPress", "random", "kvtrim seeds by default (`seed=0`); kvpress draws unseeded by default",
    ),
    PressMapping(
        "RestoreKVPress", "restorekv",
        "the restore embeddings and the attention LoRA come from `kvtrim calibrate restorekv` (the `restorekv` "
        "artifact) instead of the authors' PEFT adapters on the Hub (published for Llama-3.1-8B-Instruct and "
        "Qwen3-8B only): a rank-8 adapter on q/k/v/o, written by hand (no PEFT), trained for minutes on the CPU by "
        "self-distillation on short prompts (docs/calibration.md lists every departure from the paper's recipe); "
        "the restore tokens enter at the last context position and the question keeps its positions (kvpress: "
        "after the context, the question shifted by 8); KVzip's eviction as `kvzip` (one reconstruction pass); "
        "evicted entries are freed (per-head counts, stored ragged; kvpress masks them)",
        {"n_sink": 4, "layerwise": False},
        "`compression_ratio` → `ratio`; the restore weights → `artifact`",
    ),
    PressMapping(
        "SimLayerKVPress", "simlayerkv",
        "kvpress's default `lazy_threshold=1.0` marks no layer lazy; kvtrim's default 0.9 is the paper's Llama-3 "
        "value; the layers decide the amount: use `ratio=0` (a ratio or budget caps every layer, lazy or not); "
        "decided per row (kvpress: once per batch, mean over the batch); a lazy layer keeps the last `n_recent` "
        "tokens (kvpress: `n_recent − n_last`) and the mass is measured on exactly those entries, the last query's "
        "own included (kvpress's window attention drops the last `n_last` keys and sums the `n_recent` before "
        "them); no warning below `n_initial + n_recent` tokens, the ends are then the whole context",
        {"threshold": 1.0, "n_initial": 4, "n_recent": 1024, "n_last": 1},
        "`lazy_threshold` → `threshold`; `n_initial`, `n_recent`, `n_last`; no `compression_ratio` (use `ratio=0`)",
    ),
    PressMapping(
        "SnapKVPress", "snapkv", "kvtrim's default is KVCache-Factory's `w=8`, max-pool 7; these are kvpress's",
        _SNAPKV_PRESS, "`window_size` → `window`; `kernel_size` → `kernel`",
    ),
    PressMapping(
        "StreamingLLMPress", "streaming_llm", "same rule", {"sink": 4}, "`n_sink` → `sink`",
    ),
    PressMapping(
        "TOVAPress", "tova", "same rule (last query, head-averaged)",
    ),
    PressMapping(
        "ThinKPress", "think",
        "prunes key channels, not tokens; keys stored later (question, answer) are pruned to the same channels "
        "(kvpress zeroes the channels of the prefill's keys only)",
        {"window": 32}, "`key_channel_compression_ratio` → `ratio`; `window_size` → `window`",
    ),
)

BASES: tuple[PressMapping, ...] = (
    PressMapping(
        "BasePress", None, "the part interfaces (`kvtrim.scoring.Scorer`, budget allocator, selector) and "
        "`Pipeline` play its role", spelling="—",
    ),
    PressMapping(
        "ComposedPress", None, "presses applied one after another; a kvtrim method is one pipeline (scorer, budget, "
        "selector, optional key-channel pruning as in `think_snapkv`), arbitrary chains are not built",
        spelling="—",
    ),
    PressMapping(
        "KVPressTextGenerationPipeline", None, "`kvtrim.hf_pipeline`'s `kvtrim-text-generation` pipeline "
        "(context + questions, one compression)", spelling="—",
    ),
    PressMapping(
        "ScorerPress", None, "any scorer with `UniformBudget` and `TopKSelector` (`kvtrim.methods.registry.parts`)",
        spelling="—",
    ),
)


def kvpress_exports() -> dict:
    """The checked-in export list: ``{"version", "presses", "bases", "other"}`` (names sorted)."""
    text = resources.files("kvtrim").joinpath("data", EXPORTS_FILE).read_text(encoding="utf-8")
    return json.loads(text)


def unmapped(rows: tuple[PressMapping, ...] | None = None) -> list[str]:
    """kvpress presses of the export list without a row in ``rows`` (default :data:`MAPPINGS`), sorted."""
    rows = MAPPINGS if rows is None else rows
    return sorted(set(kvpress_exports()["presses"]) - {row.press for row in rows})


def _method_cell(row: PressMapping) -> str:
    if row.method is None:
        return "—"
    info = method_info(row.method)  # an unknown method raises here
    get_method(row.method, **row.params)  # and so do parameters it does not take
    params = ", ".join(f"{k}={v!r}" for k, v in row.params.items())
    call = f"`{row.method}`" + (f" with `{params}`" if params else "")
    return f"{call} ({info.family}; {cite(info.paper)})"


def markdown_table() -> str:
    """The press table in Markdown (ends with a newline): presses first, then base classes and the pipeline."""
    lines = [
        "| kvpress export | kvtrim method | parameters | notes |",
        "|---|---|---|---|",
    ]
    for row in sorted(MAPPINGS, key=lambda r: r.press) + list(BASES):
        lines.append(f"| `{row.press}` | {_method_cell(row)} | {row.spelling} | {row.note} |")
    return "\n".join(lines) + "\n"


def read_block(text: str) -> str:
    """The text between this table's markers."""
    return table.read_block(text, START, END)


def write_doc(path: str | Path) -> bool:
    """Rewrite the table block of the file at ``path``; returns whether it changed."""
    return table.write_block(path, markdown_table(), START, END)


if __name__ == "__main__":  # python -m kvtrim.methods.kvpress_map --write docs/kvpress.md
    if len(sys.argv) == 3 and sys.argv[1] == "--write":
        print("changed" if write_doc(sys.argv[2]) else "unchanged")
    else:
        sys.stdout.write(markdown_table())
