"""The plugin's configuration, block-layout probe and per-layer eviction, without vLLM (fake paged caches)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from vllm_helpers import MODEL_DIR

from kvtrim.budgets.base import BudgetRequest
from kvtrim.budgets.pyramid import pyramid_layer_budgets
from kvtrim.errors import InvalidParameterError, UnsupportedModelError
from kvtrim.methods import get_method
from kvtrim.scoring.partitions import kept_length
from kvtrim.vllm import evictor
from kvtrim.vllm.config import (
    ACCEPTED_METHODS,
    ENV_VAR,
    EVEN_LAYER_METHODS,
    PER_HEAD_METHODS,
    SUPPORTED_METHODS,
    load_config,
    parse_config,
)
from kvtrim.vllm.evictor import PendingEviction, evict_layer
from kvtrim.vllm.kv_layout import entry_format, probe_layout


def test_keep_count_follows_budget_ratio_and_lag_partitions():
    assert parse_config({"method": "snapkv", "budget": 64}).keep_count(200) == 64
    assert parse_config({"method": "snapkv", "budget": 64}).keep_count(50) == 50
    assert parse_config({"method": "knorm", "ratio": 0.75}).keep_count(400) == 100
    assert parse_config({"method": "knorm", "ratio": 0.75, "min_prompt": 500}).keep_count(400) == 400
    lag = parse_config({"method": "lagkv", "ratio": 0.5, "params": {"sink": 4, "lag": 32}})
    assert lag.keep_count(300) == kept_length(300, 4, 32, 16) == 172


def test_pyramidkv_layer_counts_follow_kvtrims_schedule_and_blocks_follow_the_largest():
    config = parse_config({"method": "pyramidkv", "budget": 128})  # window 8, beta 20 (kvtrim's preset)
    keeps = config.layer_keeps(700, 4)
    assert keeps == pyramid_layer_budgets(128, 700, 4, 8, 20.0) == [242, 166, 90, 14]
    assert sum(keeps) == 4 * 128  # mean budget exactly 128, blocks sized by 242
    assert config.keep_count(700, 4) == 242
    assert config.layer_keeps(100, 4) == [100] * 4  # budget above the prompt: nothing compressed
    assert parse_config({"method": "snapkv", "budget": 64}).layer_keeps(200, 3) == [64] * 3
    with pytest.raises(InvalidParameterError, match="num_layers is required"):
        config.keep_count(700)
    with pytest.raises(InvalidParameterError, match="num_layers must be an integer >= 1"):
        config.layer_keeps(700, 0)


def test_per_head_methods_keep_budget_plus_one_block_minus_one_slots():
    config = parse_config({"method": "adakv", "budget": 128})
    assert config.per_head and not parse_config({"method": "snapkv", "budget": 128}).per_head
    assert config.head_budget(1024) == 128 and config.head_budget(100) == 100
    assert config.slot_count(1024, 30, 32) == 159  # B + block − 1: any split of kv_heads · B fits (subpages)
    assert config.slot_count(150, 30, 32) == 150  # the prompt's own blocks: nothing freed, heads still differ
    assert config.slot_count(100, 30, 32) == 100  # under the budget: nothing compressed
    assert parse_config({"method": "snapkv", "budget": 128}).slot_count(1024, 30, 32) == 128
    assert parse_config({"method": "adakv", "ratio": 0.75}).slot_count(1024, 30, 128) == 256 + 127


EVEN = {"even_layer_evict": True}


def test_kv_compress_runs_per_head_with_even_layer_evict_only():
    assert set(EVEN_LAYER_METHODS) == {"kvcompress", "kvc_w8", "kvc_full"}
    assert not set(EVEN_LAYER_METHODS) & set(SUPPORTED_METHODS)  # the defaults rank across layers
    assert set(ACCEPTED_METHODS) == set(SUPPORTED_METHODS) | set(EVEN_LAYER_METHODS)
    for method in EVEN_LAYER_METHODS:
        config = parse_config({"method": method, "budget": 64, "params": EVEN})
        assert config.per_head and not config.per_layer and config.capabilities.vllm
        assert config.head_counts(config.pipeline(), 700, 4, 3) is None  # the scores split each layer's blocks


def test_kv_compress_slots_follow_the_per_layer_block_bound():
    config = parse_config({"method": "kvcompress", "budget": 64, "params": EVEN})  # blocks of 16, protected 32
    assert config.layer_total(700, 3) == 192  # ⌈64·3/16⌉ = 12 blocks of 16
    assert config.slot_count(700, 4, 32, kv_heads=3) == 64 + 31  # as AdaKV at B = 64
    assert config.slot_count(80, 4, 32, kv_heads=3) == 80 and config.slot_count(60, 4, 32, kv_heads=3) == 60
    odd = parse_config({"method": "kvcompress", "budget": 50, "params": EVEN})
    assert odd.layer_total(700, 3) == 160 and odd.slot_count(700, 4, 32, kv_heads=3) == 54 + 31  # ⌈160/3⌉ = 54
    ratio = parse_config({"method": "kvc_w8", "ratio": 0.75, "params": EVEN})
    assert ratio.layer_total(1024, 3) == 768 and ratio.slot_count(1024, 30, 128, kv_heads=3) == 256 + 127
    with pytest.raises(InvalidParameterError, match="kv_heads is required"):
        config.slot_count(700, 4, 32)


def test_kv_compress_budget_below_the_protected_window_is_sized_by_the_window():
    """A head that evicts keeps at least its protected window in whole blocks: the bound (and the slots) follow."""
    config = parse_config({"method": "kvcompress", "budget": 8, "params": EVEN})  # protected 32: 2 blocks per head
    assert config.layer_total(700, 3) == 96 and config.slot_count(700, 4, 32, kv_heads=3) == 32 + 31
    w8 = parse_config({"method": "kvc_w8", "budget": 8, "params": EVEN})  # protected 8: one 16-entry block per head
    assert w8.layer_total(700, 3) == 48 and w8.slot_count(700, 4, 32, kv_heads=3) == 16 + 31


def test_kv_compress_with_vllms_block_size_keeps_whole_pages_without_slack():
    """params.block_size equal to vLLM's: the budget's own blocks (no block_size − 1 of slack)."""
    config = parse_config({"method": "kvcompress", "budget": 128, "params": {**EVEN, "block_size": 32}})
    assert config.slot_count(1024, 30, 32, kv_heads=3) == 128  # ⌈128·3/32⌉ = 12 pages: 4 blocks, as SnapKV
    assert config.round_slots(32, 3, 1024) == 128
    assert config.slot_count(1024, 30, 16, kv_heads=3) == 128 + 15  # other block sizes: the general bound
    odd = parse_config({"method": "kvcompress", "budget": 50, "params": {**EVEN, "block_size": 32}})
    assert odd.slot_count(700, 4, 32, kv_heads=3) == 64  # ⌈150/32⌉ = 5 pages (≥ 3·⌈50/32⌉ = 6): 2 blocks
    small = parse_config({"method": "kvcompress", "budget": 8, "params": {**EVEN, "block_size": 32}})
    assert small.slot_count(700, 4, 32, kv_heads=3) == 32  # the protected window: one page per head
    assert config.slot_count(100, 4, 32, kv_heads=3) == 100  # budget ≥ prompt: nothing freed


def _check_counts_fit_the_slots(counts: np.ndarray, slots: int, bs: int) -> None:
    """Per-head ``counts`` ``[heads]`` placed in the one-head sub-pages of ``slots // bs`` blocks fit them, and after
    ``t`` more tokens (one per head) the blocks vLLM allocates for ``slots + t``, as later rounds' ragged rows do."""
    from kvtrim.vllm.subpages import RequestSubPages

    blocks = iter(range(10_000))
    pages = RequestSubPages(1, len(counts), bs, [next(blocks) for _ in range(slots // bs)])
    pages.place(0, counts)
    for t in range(1, 2 * bs + 2):
        pages.add_blocks([next(blocks) for _ in range(-(-(slots + t) // bs) - len(pages.blocks))])
        pages.append(0, 1)
    pages.check()


@pytest.mark.parametrize("seed", range(30))
def test_kv_compress_whole_pages_fit_the_slots_and_every_later_token(seed):
    """Any scores: the ranking's per-head counts fit the blocks of page_slots, and after t more tokens (one per
    head) the blocks vLLM allocates for page_slots + t, as later rounds' ragged rows do."""
    from kvtrim.budgets.global_blocks import GlobalBlockBudget

    rng = np.random.default_rng(seed)
    heads, bs = int(rng.integers(1, 6)), int(rng.choice([4, 8, 16]))
    lengths = rng.integers(1, 12 * bs, heads)  # ragged rows (a later round) or equal ones (the first)
    if seed % 2:
        lengths[:] = lengths[0]
    keep = int(rng.integers(1, 6 * bs))
    window = int(rng.choice([0, 4, 8, 20]))
    budget = GlobalBlockBudget(block_size=bs, protected_window=window, even_layers=True)
    width, context = int(lengths.max()), int(lengths.max())
    positions = torch.full((heads, width), -1)
    for h, n in enumerate(lengths):
        positions[h, :n] = torch.arange(context - n, context)
    scores = torch.from_numpy(rng.random((heads, width))).float()
    counts = budget.head_counts(scores, positions, keep, context).numpy()
    config = parse_config({"method": "kvcompress", "budget": keep, "params": {**EVEN, "block_size": bs}})
    _check_counts_fit_the_slots(counts, config.page_slots(keep, width, bs), bs)


def test_adakv_in_whole_pages_keeps_the_uniform_slots():
    config = parse_config({"method": "adakv", "budget": 128, "params": {"page_size": 32}})
    assert config.page_size == 32 and config.slot_count(1024, 30, 32, kv_heads=3) == 128  # SnapKV's 4 blocks
    assert config.round_slots(32, 3, 1024) == 128 and config.layer_total(1024, 3) == 384
    assert config.slot_count(1024, 30, 128, kv_heads=3) == 128 + 127  # pages other than vLLM's blocks: the bound
    odd = parse_config({"method": "critical_adakv", "budget": 100, "params": {"page_size": 32}})
    assert odd.slot_count(1024, 30, 32, kv_heads=3) == 128 and odd.layer_total(1024, 3) == 320  # ⌈300/32⌉ = 10
    assert parse_config({"method": "adakv", "budget": 128}).page_size is None
    assert config.slot_count(1024, 30, 32) == 128  # no head count needed: ⌈⌈H·x⌉/H⌉ = ⌈x⌉


@pytest.mark.parametrize("seed", range(30))
def test_adakv_whole_pages_fit_the_slots_and_every_later_token(seed):
    """Any scores, first compression (equal rows) or a later round (ragged rows): AdaKV's counts in whole pages fit
    the blocks of page_slots, and after t more tokens the blocks vLLM allocates for page_slots + t."""
    from kvtrim.budgets.head_adaptive import HeadAdaptiveBudget

    rng = np.random.default_rng(seed)
    heads, bs = int(rng.integers(1, 6)), int(rng.choice([4, 8, 16]))
    lengths = rng.integers(1, 12 * bs, heads)
    if seed % 2:
        lengths[:] = lengths[0]
    keep = int(rng.integers(9, 6 * bs + 9))
    width = int(lengths.max())
    positions = torch.full((heads, width), -1)
    for h, n in enumerate(lengths):
        positions[h, :n] = torch.arange(width - n, width)
    scores = torch.from_numpy(rng.random((heads, width)) ** 4).float()
    counts = HeadAdaptiveBudget(page_size=bs).head_budgets(scores, positions, keep, width).numpy()
    config = parse_config({"method": "adakv", "budget": keep, "params": {"page_size": bs}})
    _check_counts_fit_the_slots(counts, config.page_slots(keep, width, bs), bs)


def test_kv_compress_evicts_within_the_layer_bound_into_sub_pages(monkeypatch):
    """The per-head eviction on a fake CPU cache: each layer keeps ⌈B·H/16⌉ blocks, heads differ, within the bound."""
    from kvtrim.vllm.evictor import evict_layer_heads
    from kvtrim.vllm.subpages import RequestSubPages

    h, d, bs, p, budget = 3, 8, 16, 200, 40
    impl = _TransposedImpl(h, d, bs)
    config = parse_config({"method": "kvcompress", "budget": budget, "params": EVEN})
    slots = config.slot_count(p, 1, bs, kv_heads=h)
    cache = torch.zeros(16, h, bs, 2 * d)
    layout = probe_layout(impl, None, cache)
    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(p, h, d, generator=g), torch.randn(p, h, d, generator=g)
    keys[:, 2] *= 3  # a sharper head
    blocks = torch.arange(1, 1 + -(-p // bs))
    impl.do_kv_cache_update(None, keys, values, cache, blocks.repeat_interleave(bs)[:p] * bs + torch.arange(p) % bs)
    query = torch.randn(p, 2 * h, d, generator=g)
    pages = RequestSubPages(1, h, bs, blocks[: -(-slots // bs)].tolist())
    pending = PendingEviction("r", 0, p, p, slots, blocks, None, budget, pages, None,
                              layer_total=config.layer_total(p, h))  # fmt: skip
    calls = []  # vLLM's cache-write op is not needed here: record the one write of every head's kept entries
    monkeypatch.setattr(evictor, "folded_cache_write", lambda k, v, cache_, slots_, isa: calls.append((k, slots_)))
    counts = evict_layer_heads(config.pipeline(), layout, cache, query, pending, 0, 1, d**-0.5, None, "vec")
    assert sum(-(-c // bs) for c in counts) == -(-budget * h // bs)  # ⌈40·3/16⌉ = 8 blocks of the ranking
    assert sum(counts) <= config.layer_total(p, h) and len(set(counts)) > 1 and len(calls) == 1
    written, slots_written = calls[0]
    assert written.shape == (sum(counts), 1, d)
    # head by head, each head's kept entries go to its own sub-pages, in entry order
    assert slots_written.view(-1).tolist() == [s for head in range(h) for s in pages.slots(0, head).tolist()]


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ({"method": "h2o", "budget": 8}, "not supported inside vLLM"),
        ({"method": "kvcompress", "budget": 64}, "only with params.even_layer_evict = true"),
        ({"method": "kvc_full", "budget": 64, "params": {"even_layer_evict": False}}, "params.even_layer_evict"),
        ({"method": "kvc_w8", "budget": 64, "params": {"even_layer_evict": 1}}, "(even_layers) must be True or False"),
        ({"method": "kvcompress@every:16", "ratio": 0.5, "params": {"even_layer_evict": True}}, "not 'ratio'"),
        ({"method": "kvcompress@over:0", "budget": 64, "params": {"even_layer_evict": True}}, "not 'over:SLACK'"),
        ({"method": "kvcompress", "ratio": 0.5, "params": {"even_layer_evict": True}, "between_chunks": True},
         "need 'budget', not 'ratio'"),
        ({"method": "nope", "budget": 8}, "not a kvtrim method"),
        ({"method": "snapkv"}, "exactly one of ratio"),
        ({"method": "snapkv", "ratio": 1.5}, "ratio must be in [0, 1)"),
        ({"method": "snapkv", "budget": 8, "colour": 1}, "unknown kvtrim vLLM configuration keys"),
        ({"method": "lagkv", "budget": 8}, "takes ratio"),
        ({"method": "lagkv", "ratio": 0.5, "params": {"skip_layers": [0]}}, "skip_layers"),
        ({"method": "snapkv", "budget": 8, "min_prompt": -1}, "min_prompt"),
        ({"method": "snapkv", "budget": 8, "between_chunks": 1}, "between_chunks must be true or false"),
        ({"method": "snapkv", "ratio": 0.5, "between_chunks": True}, "need 'budget', not 'ratio'"),
        ({"method": "snapkv", "budget": 8, "between_chunks": True, "decode_reserve": -1}, "decode_reserve must be"),
        ({"method": "snapkv", "budget": 8, "between_chunks": True, "decode_reserve": True}, "decode_reserve must be"),
        ({"method": "snapkv", "budget": 8, "between_chunks": True, "decode_reserve": 2.5}, "decode_reserve must be"),
        ({"method": "snapkv", "budget": 8, "decode_reserve": 16}, "decode_reserve needs between_chunks"),
        ({"method": "pyramidkv@every:8", "budget": 8}, "not 'pyramidkv'"),
        ({"method": "duo_attention", "budget": 8, "between_chunks": True}, "not 'duo_attention'"),
        ({"method": "adakv", "ratio": 0.5, "between_chunks": True}, "need 'budget', not 'ratio'"),
        ({"method": "adakv@over:8", "budget": 8}, "per-head methods compress while decoding with 'every:N'"),
        ({"method": "lagkv@every:8", "ratio": 0.5}, "compresses by its own recursion inside vLLM"),
        ({"method": "lagkv@tail:32", "ratio": 0.5}, "must equal the method's lag (128)"),
        ({"method": "snapkv@tail:32", "budget": 8}, "needs a lag-partition method"),
    ],
)
def test_bad_configurations_are_refused(raw, needle):
    with pytest.raises(InvalidParameterError, match=None) as err:
        parse_config(raw)
    assert needle in str(err.value)


def test_rounds_follow_token_counts_only():
    chunks = parse_config({"method": "snapkv", "budget": 64, "between_chunks": True})
    assert chunks.rounds and chunks.decode_schedule is None and chunks.held_bound(128) is None
    assert chunks.round_keep(700, 128, 128) == 64  # a chunk over the budget
    assert chunks.round_keep(700, 50, 50) is None  # under the budget
    assert chunks.round_keep(700, 700, 124) == 64  # the last chunk
    assert chunks.round_keep(700, 716, 80) is None  # no decoding schedule
    assert chunks.round_keep(700, 900, 300, 256) == 64  # a preempted request's recomputation, past the prompt
    every = parse_config({"method": "snapkv@every:16", "budget": 64, "between_chunks": True})
    assert every.round_keep(700, 716, 80) == 64 and every.round_keep(700, 717, 65) is None
    assert every.round_keep(40, 56, 56) is None  # every 16 tokens, but still under the budget
    assert every.held_bound(128) == 64 + 128 and every.held_bound(8) == 64 + 16
    over = parse_config({"method": "streaming_llm@over:3", "budget": 64})
    assert over.round_keep(700, 703, 67) is None and over.round_keep(700, 704, 68) == 64
    assert over.round_keep(700, 300, 300) is None  # no between_chunks: the prompt is compressed once, at its end
    assert not parse_config({"method": "snapkv", "budget": 64}).rounds


def test_per_head_rounds_keep_slots_for_any_split_of_the_budget():
    """AdaKV: a round keeps budget + block − 1 slots of the uniform list (one-head sub-pages hold any split of
    kv_heads · budget entries there); before its first round the threshold is the budget, after it those slots."""
    config = parse_config({"method": "adakv@every:16", "budget": 64, "between_chunks": True})
    assert config.rounds and config.round_slots(32) == 95 and config.round_slots(1) == 64
    assert config.round_keep(700, 128, 128, 128, 32) == 95  # a first chunk over the budget
    assert config.round_keep(700, 80, 80, 80, 32) == 80  # over the budget, under the slots: compressed, none freed
    assert config.round_keep(700, 50, 50, 50, 32) is None
    # after a round the slots hold budget + block − 1: a mean of budget entries per head
    assert config.round_keep(700, 256, 95 + 128, 128, 32, compressed=True) == 95
    assert config.round_keep(700, 700, 95, 0, 32, compressed=True) is None  # nothing new since
    assert config.round_keep(700, 716, 95 + 16, 1, 32, compressed=True) == 95  # 16 decoded tokens
    assert config.round_keep(700, 717, 95 + 1, 1, 32, compressed=True) is None
    assert config.admission_tokens(1000, 128, 32) == 95 + 128 and config.held_bound(128, 32) == 95 + 128
    # KV-Compress: each layer keeps ⌈64·3/16⌉ = 12 of its 16-entry blocks, 64 entries per head on average
    kvc = parse_config(
        {"method": "kvcompress", "budget": 60, "params": {"even_layer_evict": True}, "between_chunks": True}
    )
    assert kvc.round_slots(32, kv_heads=3, length=700) == 64 + 31  # ⌈60·3/16⌉ = 12 blocks of 16: 192 / 3 = 64
    assert kvc.round_keep(700, 128, 128, 128, 32, kv_heads=3) == 95 and kvc.held_bound(128, 32) is None
    assert kvc.admission_tokens(1000, 128, 32, kv_heads=3) == 95 + 128
    with pytest.raises(InvalidParameterError, match="kv_heads is required"):
        kvc.round_slots(32)
    # HeadKV: the artifact's counts at the request's length, the largest layer's mean per head
    head = parse_config({"method": "headkv@every:16", "budget": 64, "between_chunks": True})
    counts = np.array([[10, 200, 30], [64, 64, 64]])  # layer 0 keeps 240 entries: a mean of 80 per head
    assert head.head_counts_fixed and head.round_slots(32, head_counts=counts) == 80 + 31
    assert head.round_keep(700, 128, 128, 128, 32, counts_at=lambda n: counts) == 111
    assert head.held_bound(128, 32) is None
    asked = []  # a decoding step off the every:16 period asks for no counts (they cost an allocation)
    assert head.round_keep(700, 717, 112, 1, 32, True, counts_at=lambda n: asked.append(n) or counts) is None
    assert asked == [] and head.round_keep(700, 716, 112, 1, 32, True, counts_at=lambda n: asked.append(n) or counts)
    assert asked == [716]
    assert head.admission_tokens(1000, 128, 32, counts_at=lambda n: counts) == 111 + 128
    with pytest.raises(InvalidParameterError, match="head_counts are required"):
        head.round_slots(32)
    uniform = parse_config({"method": "snapkv@every:16", "budget": 64, "between_chunks": True})
    assert uniform.round_slots(32) == 64 and uniform.round_keep(700, 80, 80, 80, 32) == 64
    assert uniform.admission_tokens(1000, 128, 32) == 64 + 128


def test_lagkv_rounds_follow_its_recursion_from_token_counts_only():
    frame = {"ratio": 0.5, "params": {"sink": 4, "lag": 32}}  # 16 of every 32-token partition kept
    once = parse_config({"method": "lagkv@prefill", **frame})
    assert not once.rounds and once.keep_count(700) == kept_length(700, 4, 32, 16) == 380
    rec = parse_config({"method": "lagkv", **frame})  # LagKV's own schedule: tail:32
    assert rec.rounds and rec.decode_schedule is not None and rec.held_bound(128) is None
    assert parse_config({"method": "lagkv@tail:32", **frame}).rounds
    # after the prompt: the one-pass count (20 partitions compressed, compressed_until 4 + 20·32 = 644)
    assert rec.round_keep(700, 700, 700, 128) == 380 and rec.compressed_until(320) == 644
    assert rec.round_keep(700, 128, 128, 128) is None  # no between_chunks: prompt chunks are not compressed
    # decoding: the tail 700 − 644 = 56 reaches 2 partitions at 708; one partition (16 entries) goes each round
    assert rec.round_keep(700, 707, 387) is None and rec.round_keep(700, 708, 388) == 372
    assert rec.compressed_until(336) == 676 and rec.round_keep(700, 739, 403) is None
    assert rec.round_keep(700, 740, 404) == 388
    assert rec.lag_round(740, 336) == (16, 708)
    chunks = parse_config({"method": "localkv", "between_chunks": True, **frame})
    assert chunks.round_keep(700, 60, 60, 60) is None  # a chunk whose tail holds under 2 partitions
    assert chunks.round_keep(700, 128, 128, 128) == 96  # (128 − 4) // 32 = 3 partitions: 2 compressed
    assert chunks.round_keep(700, 256, 224, 128) == 160  # from compressed_until 68: 5 partitions, 4 compressed
    assert chunks.round_keep(700, 900, 900, 256) == 900 - 27 * 16  # a recomputation past the prompt
    assert parse_config({"method": "lagkv@prefill", "between_chunks": True, **frame}).round_keep(700, 708, 388) is None
    assert parse_config({"method": "lagkv", "ratio": 0.0, "params": {"sink": 4, "lag": 32}}).round_keep(
        700, 700, 700
    ) is None  # every entry of every partition kept: nothing to drop


@pytest.mark.parametrize("chunk", [1, 48, 128])
def test_lagkv_admission_bound_covers_every_step(chunk):
    config = parse_config(
        {"method": "lagkv", "ratio": 0.75, "params": {"sink": 4, "lag": 32}, "between_chunks": True}
    )
    for prompt in (50, 300, 1000):
        end, physical, steps = 0, 0, []
        while end < prompt + 200:
            n = min(chunk, prompt - end) if end < prompt else 1
            end, physical = end + n, physical + n
            steps.append((end, physical))  # held before the step's round
            keep = config.round_keep(prompt, end, physical, n)
            physical = physical if keep is None else keep
        assert all(held <= config.admission_tokens(t, chunk) for t, held in steps)
        assert max(held for _, held in steps) < prompt + 200
    assert parse_config({"method": "lagkv", "ratio": 0.5}).admission_tokens(1000, 64) is None


FIXED_COUNT_METHODS = ("headkv", "critical_headkv", "duo_attention")  # per-head counts from an artifact
SPLIT_BY_SCORE = [m for m in PER_HEAD_METHODS if m not in FIXED_COUNT_METHODS] + list(EVEN_LAYER_METHODS)


@pytest.mark.parametrize("method", SPLIT_BY_SCORE)
def test_per_head_methods_split_by_score_refuse_tensor_parallelism(method):
    params = EVEN if method in EVEN_LAYER_METHODS else {}
    config = parse_config({"method": method, "budget": 64, "params": params})
    config.check_tensor_parallel(1)
    with pytest.raises(InvalidParameterError, match=f"tensor_parallel_size=2 is not supported with {method}"):
        config.check_tensor_parallel(2)


@pytest.mark.parametrize("method", SPLIT_BY_SCORE)
def test_split_by_score_methods_split_within_each_ranks_head_groups(method):
    """params.head_groups a multiple of the ranks: each rank splits within its own groups (rank_config), and the
    scheduler, sizing one rank's heads with it, keeps the slots the same method keeps on one rank."""
    even = EVEN if method in EVEN_LAYER_METHODS else {}
    config = parse_config({"method": method, "budget": 64, "params": {**even, "head_groups": 4}})
    config.check_tensor_parallel(2, total_kv_heads=8)
    config.check_tensor_parallel(4, total_kv_heads=8)
    assert config.rank_config(1) is config and config.rank_config(2).head_groups == 2
    assert config.rank_config(4).head_groups == 1 and config.rank_config(4).params == {**even, "head_groups": 1}
    for tp in (1, 2, 4):
        rank = config.rank_config(tp)
        for prompt in (40, 700, 2000):
            assert rank.slot_count(prompt, 30, 32, kv_heads=8 // tp) == config.slot_count(prompt, 30, 32, kv_heads=8)
            assert rank.layer_total(prompt, 8 // tp) * tp == config.layer_total(prompt, 8)
    with pytest.raises(InvalidParameterError, match=r"tensor_parallel_size=8 .* params.head_groups=4.* multiple of 8"):
        config.check_tensor_parallel(8, total_kv_heads=8)
    with pytest.raises(InvalidParameterError, match=r"tensor_parallel_size=8 .* params.head_groups=4"):
        config.rank_config(8)
    with pytest.raises(InvalidParameterError, match="head_groups=4 must divide the model's 6 KV heads"):
        config.check_tensor_parallel(2, total_kv_heads=6)


@pytest.mark.parametrize("seed", range(12))
def test_grouped_whole_pages_fit_the_slots_of_the_ungrouped_method(seed):
    """AdaKV and KV-Compress in whole pages with head_groups: the groups' counts fit the blocks of page_slots (the
    ungrouped method's: ⌈P/H⌉ per group does not depend on the group's size), now and after every later token."""

    rng = np.random.default_rng(seed)
    groups, bs = int(rng.integers(2, 4)), int(rng.choice([4, 8, 16]))
    heads = groups * int(rng.integers(1, 3))
    width = int(rng.integers(2 * bs, 12 * bs))
    keep = int(rng.integers(9, width))
    positions = torch.arange(width).expand(heads, width)
    scores = torch.from_numpy(rng.random((heads, width)) ** 4).float()
    if seed % 2:
        params = {"page_size": bs, "head_groups": groups}
        config = parse_config({"method": "adakv", "budget": keep, "params": params})
        counts = config.pipeline().budget.head_budgets(scores, positions, keep, width).numpy()
    else:
        params = {**EVEN, "block_size": bs, "head_groups": groups, "protected_window": 8}
        config = parse_config({"method": "kvcompress", "budget": keep, "params": params})
        budget = config.pipeline().budget
        request = BudgetRequest(
            keep=torch.tensor([keep]), context_lengths=torch.tensor([width]), num_layers=1, kv_heads=heads,
            positions=[positions.unsqueeze(0)],
        )  # fmt: skip
        counts = budget.allocate(request, [scores.unsqueeze(0)])[0, 0].numpy()
    ungrouped = parse_config({"method": config.method, "budget": keep, "params": {**params, "head_groups": 1}})
    slots = config.page_slots(keep, width, bs)
    assert slots == ungrouped.page_slots(keep, width, bs)
    _check_counts_fit_the_slots(counts, slots, bs)


@pytest.mark.parametrize("method", FIXED_COUNT_METHODS)
def test_per_head_counts_from_an_artifact_split_by_tensor_parallel_rank(method):
    """HeadKV and DuoAttention under tensor parallelism: the counts are the whole model's (the artifact's), one row
    per (layer, rank) holding that rank's heads; the block list is sized by the largest row mean, never less than
    without tensor parallelism, and every rank's split fits it."""
    assert method in PER_HEAD_METHODS
    config = parse_config({"method": method, "budget": 128})
    config.check_tensor_parallel(3, total_kv_heads=3)
    with pytest.raises(InvalidParameterError, match=r"tensor_parallel_size=4 is not supported .* 2 KV heads do not"):
        config.check_tensor_parallel(4, total_kv_heads=2)  # vLLM would replicate each head on two ranks
    pipeline = config.bound_pipeline(str(MODEL_DIR))  # the embedded SmolLM2: 30 layers, 3 KV heads
    whole = config.head_counts(pipeline, 900, 30, 3)
    assert whole.shape == (30, 3) and len(set(whole.flatten().tolist())) > 1
    rows = config.head_counts(pipeline, 900, 30, 1, tp_size=3)  # one KV head per rank
    assert rows.shape == (90, 1) and np.array_equal(rows.reshape(30, 3), whole)
    for rank in range(3):
        assert np.array_equal(config.rank_rows(rows, 3, rank), whole[:, rank : rank + 1])
    single, split = config.slot_count(900, 30, 32, whole), config.slot_count(900, 30, 32, rows)
    assert split == min(int(whole.max()) + 31, 900) and split >= single
    assert config.head_counts_at(pipeline, 30, 1, 3)(900).shape == (90, 1)


def test_uniform_and_per_layer_methods_accept_tensor_parallelism():
    for method in ("snapkv", "critical_snapkv", "tova", "streaming_llm", "pyramidkv"):
        assert method in SUPPORTED_METHODS and method not in PER_HEAD_METHODS
        parse_config({"method": method, "budget": 64}).check_tensor_parallel(4)


def test_additional_config_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_VAR, json.dumps({"method": "knorm", "ratio": 0.5}))
    assert load_config(None).method == "knorm"
    assert load_config({"kvtrim": {"method": "tova", "budget": 9}}).method == "tova"
    monkeypatch.setenv(ENV_VAR, "{not json")
    with pytest.raises(InvalidParameterError, match=ENV_VAR):
        load_config(None)
    monkeypatch.delenv(ENV_VAR)
    assert load_config({"other": 1}) is None


class _TransposedImpl:
    """A fake backend storing per (block, head) the keys transposed ``[dim, slot]`` then values ``[slot, dim]``
    (the layout of vLLM's CPU ``vec`` kernels)."""

    def __init__(self, kv_heads: int, head_dim: int, block: int, broken: bool = False):
        self.num_kv_heads, self.head_size, self.block, self.broken = kv_heads, head_dim, block, broken

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        h, d, bs = self.num_kv_heads, self.head_size, self.block
        for t, slot in enumerate(slot_mapping.tolist()):
            b, s = divmod(slot, bs)
            area = kv_cache[b].view(h, 2 * bs * d)
            area[:, :bs * d].view(h, d, bs)[:, :, s] = key[t]
            area[:, bs * d :].view(h, bs, d)[:, s] = value[t] * (2 if self.broken else 1)


def test_probe_learns_a_transposed_layout_and_reads_writes_it():
    h, d, bs = 3, 8, 4
    impl = _TransposedImpl(h, d, bs)
    cache = torch.zeros(6, h, bs, 2 * d)
    layout = probe_layout(impl, None, cache)
    keys, values = torch.randn(10, h, d), torch.randn(10, h, d)
    blocks = torch.tensor([5, 2, 3])
    impl.do_kv_cache_update(None, keys, values, cache, (blocks.repeat_interleave(bs) * bs + torch.arange(12) % bs)[:10])
    k, v = layout.read(cache, blocks, 10)
    assert torch.equal(k, keys) and torch.equal(v, values)
    layout.write(cache, blocks, keys[:3].flip(0), values[:3].flip(0))
    k, v = layout.read(cache, blocks, 10)
    assert torch.equal(k[:3], keys[:3].flip(0)) and torch.equal(k[3:], keys[3:])


def test_probe_refuses_a_layout_it_cannot_reproduce():
    with pytest.raises(UnsupportedModelError):
        probe_layout(_TransposedImpl(2, 4, 4, broken=True), None, torch.zeros(3, 2, 4, 8))


def test_evict_layer_keeps_sinks_and_recent_entries_per_head_in_order():
    h, d, bs, p, keep = 2, 8, 4, 14, 6
    impl = _TransposedImpl(h, d, bs)
    cache = torch.zeros(8, h, bs, 2 * d)
    layout = probe_layout(impl, None, cache)
    keys, values = torch.randn(p, h, d), torch.randn(p, h, d)
    blocks = torch.tensor([7, 1, 4, 6])
    impl.do_kv_cache_update(None, keys, values, cache, (blocks.repeat_interleave(bs) * bs + torch.arange(16) % bs)[:p])
    pending = PendingEviction("r", 0, 3, p, keep, blocks)
    query = torch.randn(3, 2 * h, d)
    evict_layer(get_method("streaming_llm", sink=2), layout, cache, query, pending, 0, 1, d**-0.5, None)
    k, v = layout.read(cache, blocks, keep)
    want = torch.tensor([0, 1, 10, 11, 12, 13])
    assert torch.equal(k, keys[want]) and torch.equal(v, values[want])


def test_evict_layer_snapkv_matches_kvtrims_selector_on_the_same_entries():
    h, d, bs, p, keep = 2, 8, 4, 15, 7
    impl = _TransposedImpl(h, d, bs)
    cache = torch.zeros(8, h, bs, 2 * d)
    layout = probe_layout(impl, None, cache)
    torch.manual_seed(0)
    keys, values = torch.randn(p, h, d), torch.randn(p, h, d)
    blocks = torch.tensor([3, 0, 5, 2])
    impl.do_kv_cache_update(None, keys, values, cache, (blocks.repeat_interleave(bs) * bs + torch.arange(16) % bs)[:p])
    query = torch.randn(p, 2 * h, d)
    pipeline = get_method("snapkv", window=4, kernel=3)
    evict_layer(pipeline, layout, cache, query, PendingEviction("r", 0, p, p, keep, blocks), 0, 1, d**-0.5, None)
    k, _ = layout.read(cache, blocks, keep)
    # Reference: SnapKV's rule by hand — window queries' mean attention, mean over the GQA group, max-pool 3,
    # the last 4 positions protected, the rest by score; kept in position order.
    q = query[-4:].view(4, h, 2, d)
    att = torch.softmax(torch.einsum("whgd,phd->hgwp", q, keys) * d**-0.5 + _causal(p, 4), dim=-1)
    score = torch.nn.functional.max_pool1d(att.mean(2).mean(1).unsqueeze(1), 3, 1, 1).squeeze(1)  # [h, p]
    score[:, -4:] = float("inf")
    idx = score.topk(keep, dim=-1).indices.sort(dim=-1).values  # [h, keep]
    assert torch.equal(k, keys[idx.T, torch.arange(h)])


def _causal(p: int, w: int) -> torch.Tensor:
    qpos = torch.arange(p - w, p).view(-1, 1)
    return torch.where(torch.arange(p).view(1, -1) <= qpos, 0.0, float("-inf")).view(1, 1, w, p)


def test_evict_layer_lagkv_round_scores_only_past_compressed_until():
    h, d, bs = 2, 8, 4
    impl = _TransposedImpl(h, d, bs)
    cache = torch.zeros(12, h, bs, 2 * d)
    layout = probe_layout(impl, None, cache)
    torch.manual_seed(1)
    pipeline = get_method("lagkv", sink=2, lag=4)  # ratio 0.5: 2 of every 4-token partition kept
    keys, values = torch.randn(30, h, d), torch.randn(30, h, d)
    blocks = torch.arange(8)
    slots = torch.arange(32)
    impl.do_kv_cache_update(None, keys[:14], values[:14], cache, slots[:14])
    # round 1 at 14 tokens: 3 partitions after the 2 sinks, 2 compressed (8 → 4), compressed_until 2 + 8 = 10
    first = PendingEviction("r", 0, 14, 14, 10, blocks, logical_len=14, compressed_until=2)
    kept = evict_layer(pipeline, layout, cache, torch.randn(14, 2 * h, d), first, 0, 1, d**-0.5, 0.5)
    assert kept.shape == (h, 10) and bool((kept[:, :2] == torch.tensor([0, 1])).all())
    assert bool((kept[:, -4:] == torch.arange(10, 14)).all())  # the tail, untouched
    before, _ = layout.read(cache, blocks, 10)
    # 4 more tokens: at 18 the tail from 10 holds 2 partitions, the first one (10 … 13) is compressed
    impl.do_kv_cache_update(None, keys[14:18], values[14:18], cache, slots[10:14])
    second = PendingEviction(
        "r", 0, 1, 14, 12, blocks, logical_len=18, positions=kept.unsqueeze(0), compressed_until=10
    )
    again = evict_layer(pipeline, layout, cache, torch.randn(1, 2 * h, d), second, 0, 1, d**-0.5, 0.5)
    after, _ = layout.read(cache, blocks, 12)
    assert torch.equal(again[:, :6], kept[:, :6]) and torch.equal(after[:6], before[:6])  # never re-scored
    assert bool((again[:, -4:] == torch.arange(14, 18)).all())
    assert bool(((again[:, 6:8] >= 10) & (again[:, 6:8] < 14)).all())  # 2 of the compressed partition 10 … 13
    assert torch.equal(after[8:], keys[14:18])


def test_evict_layer_uses_the_layers_own_pyramid_count():
    h, d, bs, p = 2, 8, 4, 15
    impl = _TransposedImpl(h, d, bs)
    cache = torch.zeros(8, h, bs, 2 * d)
    layout = probe_layout(impl, None, cache)
    torch.manual_seed(1)
    keys, values = torch.randn(p, h, d), torch.randn(p, h, d)
    blocks = torch.tensor([3, 0, 5, 2])
    impl.do_kv_cache_update(None, keys, values, cache, (blocks.repeat_interleave(bs) * bs + torch.arange(16) % bs)[:p])
    query = torch.randn(p, 2 * h, d)
    pyramid = get_method("pyramidkv", window=4, kernel=3)
    pending = PendingEviction("r", 0, p, p, 9, blocks, layer_keep=(9, 5))
    evict_layer(pyramid, layout, cache, query, pending, 1, 2, d**-0.5, None)
    # Layer 1 keeps 5 entries per head: the same ones SnapKV (same scorer and selector) keeps at budget 5.
    got, _ = layout.read(cache, blocks, 5)
    cache2 = torch.zeros(8, h, bs, 2 * d)
    impl.do_kv_cache_update(None, keys, values, cache2, (blocks.repeat_interleave(bs) * bs + torch.arange(16) % bs)[:p])
    snap = get_method("snapkv", window=4, kernel=3)
    evict_layer(snap, layout, cache2, query, PendingEviction("r", 0, p, p, 5, blocks), 1, 2, d**-0.5, None)
    want, _ = layout.read(cache2, blocks, 5)
    assert torch.equal(got, want)
    assert not torch.equal(got, keys[:5])


# ------------------------------------------------------------------------------------------------ fp8 caches
class _Fp8TransposedImpl(_TransposedImpl):
    """The transposed layout of a ``uint8`` fp8 cache: each element is the byte of ``x / scale`` as a float8 number,
    rounded toward zero as vLLM's CPU kernel does (per-tensor ``k_scale`` / ``v_scale`` from the layer)."""

    def __init__(self, kv_heads, head_dim, block, kv_cache_dtype="fp8"):
        super().__init__(kv_heads, head_dim, block)
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8 = torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn

    def encode(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        x = (x.float() / scale).clamp(-448.0, 448.0)
        code = x.to(self.fp8).view(torch.uint8)
        over = code.view(self.fp8).float().abs() > x.abs()  # rounded away from zero: one step back
        return torch.where(over & ((code & 0x7F) > 0), code - 1, code)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        scales = (1.0, 1.0) if layer is None else (layer._k_scale_float, layer._v_scale_float)
        super().do_kv_cache_update(layer, self.encode(key, scales[0]), self.encode(value, scales[1]), kv_cache,
                                   slot_mapping)  # fmt: skip


class _Layer:
    def __init__(self, k_scale: float, v_scale: float):
        self._k_scale_float, self._v_scale_float = k_scale, v_scale


def _fp8_prompt(impl, cache, p, blocks, scales, seed=0):
    torch.manual_seed(seed)
    keys, values = torch.randn(p, impl.num_kv_heads, impl.head_size), torch.randn(p, impl.num_kv_heads, impl.head_size)
    slots = blocks.repeat_interleave(impl.block) * impl.block + torch.arange(len(blocks) * impl.block) % impl.block
    impl.do_kv_cache_update(_Layer(*scales), keys, values, cache, slots[:p])
    return keys, values


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_probe_learns_an_fp8_layout_whatever_the_layers_scales(kv_cache_dtype):
    h, d, bs = 3, 8, 16  # 16 slots: two base-8 digits
    impl = _Fp8TransposedImpl(h, d, bs, kv_cache_dtype)
    cache = torch.zeros(6, h, bs, 2 * d, dtype=torch.uint8)
    layout = probe_layout(impl, _Layer(0.37, 3.0), cache, torch.float32)  # the probe writes with unit scales
    assert layout.entry.fp8 == impl.fp8 and layout.entry.kv_cache_dtype == kv_cache_dtype
    blocks = torch.tensor([5, 2])
    keys, values = _fp8_prompt(impl, cache, 20, blocks, (0.37, 3.0))
    k, v = layout.read(cache, blocks, 20)
    assert k.dtype == torch.uint8
    assert torch.equal(k, impl.encode(keys, 0.37)) and torch.equal(v, impl.encode(values, 3.0))
    decoded = layout.entry.decode(k, 0.37, torch.float32)  # code · k_scale: within one fp8 step of the keys
    assert torch.equal(decoded, impl.encode(keys, 0.37).view(impl.fp8).float() * 0.37)
    assert bool(((decoded - keys).abs() <= 0.25 * keys.abs() + 1e-3).all())  # 2 mantissa bits at worst (e5m2)


def test_fp8_eviction_scores_decoded_keys_and_moves_the_bytes():
    h, d, bs, p, keep = 2, 8, 4, 15, 7
    impl, scales = _Fp8TransposedImpl(h, d, bs), (0.05, 0.2)
    cache = torch.zeros(8, h, bs, 2 * d, dtype=torch.uint8)
    layout = probe_layout(impl, _Layer(*scales), cache, torch.float32)
    blocks = torch.tensor([3, 0, 5, 2])
    _fp8_prompt(impl, cache, p, blocks, scales, seed=3)
    stored_k, stored_v = layout.read(cache, blocks, p)
    query = torch.randn(p, 2 * h, d, generator=torch.Generator().manual_seed(99))  # codes at scale 1 pick others
    pipeline = get_method("snapkv", window=4, kernel=3)
    evict_layer(pipeline, layout, cache, query, PendingEviction("r", 0, p, p, keep, blocks), 0, 1, d**-0.5, None,
                scales=scales)  # fmt: skip
    k, v = layout.read(cache, blocks, keep)
    # Reference: the same SnapKV rule as above, on the keys attention sees (code · k_scale).
    keys = layout.entry.decode(stored_k, scales[0], torch.float32)
    q = query[-4:].view(4, h, 2, d)
    att = torch.softmax(torch.einsum("whgd,phd->hgwp", q, keys) * d**-0.5 + _causal(p, 4), dim=-1)
    score = torch.nn.functional.max_pool1d(att.mean(2).mean(1).unsqueeze(1), 3, 1, 1).squeeze(1)
    score[:, -4:] = float("inf")
    idx = score.topk(keep, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(k, stored_k[idx.T, torch.arange(h)])  # the kept bytes, unchanged
    assert torch.equal(v, stored_v[idx.T, torch.arange(h)])


@pytest.mark.parametrize(
    ("dtype", "why"),
    [
        ("int8_per_token_head", "scale per \\(token, head\\)"),
        ("fp8_per_token_head", "scale per \\(token, head\\)"),
        ("nvfp4", "two 4-bit codes per byte"),
        ("turboquant_k8v4", "sub-byte codes"),
        ("fp8_ds_mla", "MLA latent cache"),
        ("fp8_inc", "Gaudi"),
    ],
)
def test_cache_formats_that_are_not_one_element_per_entry_are_refused(dtype, why):
    with pytest.raises(InvalidParameterError, match=rf"kv_cache_dtype='{dtype}'.*must be one of.*{why}"):
        entry_format(dtype)


def test_fp8_and_plain_formats_pass():
    assert entry_format("fp8_e5m2").fp8 == torch.float8_e5m2 and entry_format("fp8").fp8 == torch.float8_e4m3fn
    assert entry_format("auto").fp8 is None and entry_format("bfloat16").fp8 is None
    assert entry_format("fp8", fnuz=True).fp8 == torch.float8_e4m3fnuz


@pytest.mark.parametrize("impl_class", [_TransposedImpl, _Fp8TransposedImpl])
def test_one_head_sub_pages_of_a_head_major_layout(impl_class):
    h, d, bs = 3, 8, 4
    dtype = torch.uint8 if impl_class is _Fp8TransposedImpl else torch.float32
    layout = probe_layout(impl_class(h, d, bs), None, torch.zeros(4, h, bs, 2 * d, dtype=dtype), torch.float32)
    sub = layout.one_head()
    # the same map a probe of the one-head view learns (sub-page b·H + h is head h's slice of block b)
    direct = probe_layout(impl_class(1, d, bs), None, torch.zeros(12, 1, bs, 2 * d, dtype=dtype), torch.float32)
    assert torch.equal(sub.key_index, direct.key_index) and torch.equal(sub.value_index, direct.value_index)
    assert sub.block_stride == direct.block_stride == 2 * bs * d
    cache = torch.zeros(4, h, bs, 2 * d, dtype=dtype)
    keys = torch.randint(1, 100, (5, 1, d)).to(dtype)
    values = torch.randint(1, 100, (5, 1, d)).to(dtype)
    slots = torch.tensor([7 * bs + 1, 7 * bs + 2, 2 * bs, 11 * bs + 3, 0])  # sub-pages 7, 2, 11, 0
    sub.write_slots(cache, slots, keys, values)
    k, v = layout.read(cache, torch.tensor([2]), bs)  # block 2 = sub-pages 6, 7, 8: head 1 holds two of them
    assert torch.equal(k[1:3, 1], keys[:2, 0]) and torch.equal(v[1:3, 1], values[:2, 0])
    assert int((cache != 0).sum()) == 5 * 2 * d


def test_affine_layouts_read_and_write_through_strided_views_as_the_offsets_do():
    """vLLM's CPU layout (keys [head, channel, slot], values [head, slot, channel] per block) is a strided view:
    reads and writes use it and land on the probed offsets; a layout that is no strided view gathers offsets."""
    from kvtrim.vllm.kv_layout import BlockLayout

    h, d, bs = 3, 8, 4
    layout = probe_layout(_TransposedImpl(h, d, bs), None, torch.zeros(6, h, bs, 2 * d))
    assert layout._strides[0] == (0, (1, 2 * bs * d, bs)) and layout._strides[1] == (bs * d, (d, 2 * bs * d, 1))
    assert layout.one_head()._strides[0] == (0, (1, 0, bs)) and layout.one_head() is layout.one_head()
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(6, h, bs, 2 * d, generator=g)
    flat = cache.view(-1)
    slots = torch.tensor([21, 3, 8, 9, 0])
    k, v = layout.read_slots(cache, slots)
    key_at, value_at = layout._slot_offsets(slots)
    assert torch.equal(k, flat[key_at]) and torch.equal(v, flat[value_at])
    blocks = torch.tensor([5, 1])
    k, v = layout.read(cache, blocks, 6)
    assert torch.equal(k, flat[layout._offsets(layout.key_index, blocks, 6)])
    new_k, new_v = torch.randn(6, h, d, generator=g), torch.randn(6, h, d, generator=g)
    layout.write(cache, blocks, new_k, new_v)
    assert torch.equal(flat[layout._offsets(layout.key_index, blocks, 6)], new_k)
    assert torch.equal(flat[layout._offsets(layout.value_index, blocks, 6)], new_v)
    layout.write_slots(cache, slots, new_k[:5], new_v[:5])
    key_at, value_at = layout._slot_offsets(slots)
    assert torch.equal(flat[key_at], new_k[:5]) and torch.equal(flat[value_at], new_v[:5])
    # a scrambled block (no strided view): the flat offsets, and the same round trip
    perm = torch.randperm(bs * h * 2 * d, generator=g)
    scrambled = BlockLayout(perm[: bs * h * d].view(bs, h, d), perm[bs * h * d :].view(bs, h, d), bs * h * 2 * d)
    assert scrambled._strides == (None, None)
    scrambled.write_slots(cache, slots, new_k[:5], new_v[:5])
    k, v = scrambled.read_slots(cache, slots)
    assert torch.equal(k, new_k[:5]) and torch.equal(v, new_v[:5])


def test_the_page_hint_names_the_parameter_that_keeps_the_uniform_blocks():
    adakv = parse_config({"method": "adakv", "budget": 128})
    assert "params.page_size = 32" in adakv.page_hint(32) and "single entries" in adakv.page_hint(32)
    assert parse_config({"method": "adakv", "budget": 128, "params": {"page_size": 32}}).page_hint(32) is None
    assert "pages of 16" in parse_config({"method": "adakv", "budget": 128, "params": {"page_size": 16}}).page_hint(32)
    kvc = parse_config({"method": "kvcompress", "budget": 128, "params": EVEN})
    assert "params.block_size = 32" in kvc.page_hint(32) and "blocks of 16 entries" in kvc.page_hint(32)
    assert kvc.page_hint(16) is None
    assert parse_config({"method": "snapkv", "budget": 128}).page_hint(32) is None  # uniform: nothing to gain


def _request(rid, prompt, computed, outputs, max_tokens):
    from types import SimpleNamespace

    return SimpleNamespace(
        request_id=rid, num_prompt_tokens=prompt, num_computed_tokens=computed, num_output_tokens=outputs,
        num_tokens=prompt + outputs, max_tokens=max_tokens,
    )  # fmt: skip


def test_decode_reserve_admits_by_the_projected_peak_of_the_pool():
    """The admission count with ``decode_reserve``: every running request and the new one projected forward one
    decoded token per step until its reserve is decoded (blocks of 32, budget 64, chunk 128, reserve 96)."""
    import functools
    import weakref
    from types import SimpleNamespace

    from kvtrim.vllm.scheduler_patch import SchedulerState, _growth, _with_reserve

    config = parse_config({"method": "snapkv", "budget": 64, "between_chunks": True, "decode_reserve": 96})
    state = SchedulerState(config)
    running = [
        _request("a", 700, 700, 1, 200),  # 64 kept entries (2 blocks), 95 tokens to go: 159 entries (5 blocks)
        _request("b", 700, 779, 80, 96),  # 143 entries (5 blocks), 16 tokens to go: 159 entries (5 blocks)
    ]
    state.dropped.update(a=636, b=636, c=236)
    new = _request("n", 40, 0, 0, 500)  # a short prompt: 2 blocks now, 40 + 96 entries (5 blocks) at the end
    held = {"a": [0] * 2, "b": [0] * 5, "c": [0] * 2}
    manager = SimpleNamespace(block_size=32, req_to_blocks=held)

    class Scheduler(SimpleNamespace):  # weakly referable, as vLLM's
        pass

    scheduler = Scheduler(
        _kvtrim_state=state,
        running=running,
        requests={r.request_id: r for r in [*running, new, _request("c", 300, 300, 1, 96)]},
        kv_cache_manager=SimpleNamespace(coordinator=SimpleNamespace(single_type_managers=[manager])),
    )
    admission = functools.partial(config.admission_tokens, chunk=128, block_size=32)  # as the scheduler builds it
    assert admission(900, chunk=0) == 64 and admission(40, chunk=0) == 40 and admission(900) == 64 + 128
    grow = functools.partial(_growth, state, manager, admission, 128)
    assert grow(_request("p", 700, 256, 0, 40)) == (4, 6, 64, 40)  # 3.5 chunks to go, holding 64 + one chunk
    assert grow(running[0]) == (0, 2, 64, 95) and grow(running[1]) == (0, 5, 143, 16)
    assert grow(new) == (1, 2, 40, 96)
    # preempted after 50 decoded tokens: recomputes 749 tokens in 6 chunks, kept to 64, 46 more to decode
    assert grow(_request("q", 700, 0, 50, 96)) == (6, 6, 64, 46)
    reserve = functools.partial(_with_reserve, weakref.ref(scheduler), admission, 128)
    # in use at step 0: 2 + 5 + 2; at 16 (b's last): 3 + 5 + 2; at 95 (a's last): 5 + 5 (b done): peak 10, 7 held
    assert reserve("n", 2) == 3
    assert reserve("n", 8) == 8  # vLLM's own count when it is larger
    scheduler.running.append(scheduler.requests["c"])  # 64 entries, 95 to go: at 95, 5 + 5 + 5 of 9 held
    assert reserve("n", 2) == 15 - 9


def test_kv_compress_decoding_time_metric_rounds_every_n_tokens():
    """``kvcompress@every:N``: the running metric adds the N decoded queries since the last round, so the worker
    keeps at least N recent queries; rounds are due every N decoded tokens, as for AdaKV."""
    config = parse_config({"method": "kvcompress@every:16", "budget": 64, "params": EVEN})
    assert config.decode_metric == 16 and config.rounds and not config.between_chunks
    assert config.record_window(32) == 32 and config.record_window(8) == 16
    wide = parse_config({"method": "kvc_w8@every:64", "budget": 64, "params": EVEN})
    assert wide.decode_metric == 64 and wide.record_window(8) == 64
    for other in ({"method": "kvcompress", "budget": 64, "params": EVEN}, {"method": "adakv@every:16", "budget": 64}):
        assert parse_config(other).decode_metric == 0 and parse_config(other).record_window(8) == 8
    assert config.held_bound(128, 32, 3) is None  # without between_chunks: admitted by the whole prompt
    chunked = parse_config({"method": "kvcompress@every:16", "budget": 64, "params": EVEN, "between_chunks": True})
    assert chunked.held_bound(128, 32, 3) == chunked.round_slots(32, 3) + 128 == 64 + 31 + 128
    assert chunked.admission_tokens(1000, 128, 32, 3) == 64 + 31 + 128
    slots = config.round_slots(32, 3, 700)
    assert config.round_keep(700, 700, 700, 1, 32, False, 3) == slots  # after the prompt
    due = [t for t in range(1, 50) if config.round_keep(700, 700 + t, slots + t, 1, 32, True, 3) is not None]
    assert due == [16, 32, 48]
