"""kvtrim's vLLM plugin on vLLM's fp8 KV cache (``kv_cache_dtype="fp8"``): the layout probe on the CPU backend's own
fp8 writes, scoring from ``code · k_scale``, compaction that moves the bytes, and generation through ``vllm.LLM``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import vllm_helpers  # noqa: F401  (sets vLLM environment variables before vLLM is imported)

pytest.importorskip("vllm.entrypoints")  # not "vllm": tests/vllm itself would satisfy that

from vllm.inputs import TokensPrompt
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, _get_attn_isa
from vllm_helpers import BLOCK, close, make_llm, scheduler, token_prompts, truncated_model, used_blocks

from kvtrim.methods import get_method
from kvtrim.vllm.config import parse_config
from kvtrim.vllm.evictor import PendingEviction, evict_layer, evict_layer_heads
from kvtrim.vllm.folded_attention import (
    default_subpage_slots,
    default_subpage_table,
    folded_attention,
    folded_cache_write,
)
from kvtrim.vllm.kv_layout import probe_layout
from kvtrim.vllm.runner_check import worker_stats
from kvtrim.vllm.subpages import RequestSubPages
from vllm import SamplingParams

# vLLM's CPU backend (cpu_attn._get_attn_isa) takes an fp8 cache only on x86 with AVX-512 or AMX.
pytestmark = pytest.mark.skipif(
    not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
    reason="vLLM's CPU backend runs an fp8 KV cache only on x86 with AVX-512 or AMX; this CPU has neither",
)

LENGTHS = [60, 300, 700]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
H, D, BS = 3, 64, 32  # SmolLM2's KV heads and head_dim; the CPU backend's blocks are multiples of 32
ISAS = ["vec"] + (["amx"] if torch.cpu._is_amx_tile_supported() else [])  # cache writes (the probe) take both
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


class _CpuImpl:
    """vLLM's own ``CPUAttentionBackendImpl.do_kv_cache_update`` (``cpu_attn_reshape_and_cache``) on a bare
    object: the real fp8 write, without an engine."""

    do_kv_cache_update = CPUAttentionBackendImpl.do_kv_cache_update

    def __init__(self, kv_cache_dtype: str):
        self.kv_cache_dtype, self.num_kv_heads, self.head_size = kv_cache_dtype, H, D
        self.attn_type = AttentionType.DECODER


def _layer(isa: str, k_scale: float, v_scale: float):
    return SimpleNamespace(isa=isa, _k_scale_float=k_scale, _v_scale_float=v_scale)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_probe_learns_the_cpu_backends_fp8_layout_and_eviction_moves_its_bytes(kv_cache_dtype, isa):
    impl, scales = _CpuImpl(kv_cache_dtype), (0.05, 0.2)
    layer = _layer(isa, *scales)
    cache = torch.zeros(6, H, BS, 2 * D, dtype=torch.uint8)
    layout = probe_layout(impl, layer, cache, torch.float32)
    assert layout.entry.fp8 == FP8[kv_cache_dtype]
    p, keep = 70, 20
    blocks = torch.tensor([4, 1, 5])
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(p, H, D, generator=g), torch.randn(p, H, D, generator=g)
    slots = (blocks.repeat_interleave(BS) * BS + torch.arange(3 * BS) % BS)[:p]
    impl.do_kv_cache_update(layer, keys, values, cache, slots)
    stored_k, stored_v = layout.read(cache, blocks, p)
    decoded = layout.entry.decode(stored_k, scales[0], torch.float32)
    # vLLM's CPU kernel rounds toward zero: within one step of 3 (e4m3) or 2 (e5m2) mantissa bits of each key
    step = 2.0 ** -(2 if kv_cache_dtype == "fp8_e5m2" else 3)
    assert bool(((decoded - keys).abs() <= step * keys.abs() + 1e-2 * scales[0]).all())
    assert bool((decoded.abs() <= keys.abs() + 1e-6).all())  # toward zero
    query = torch.randn(p, 3 * H, D, generator=g)
    pending = PendingEviction("r", 0, p, p, keep, blocks)
    evict_layer(get_method("snapkv", window=8), layout, cache, query, pending, 0, 1, D**-0.5, None, scales=scales)
    kept_k, kept_v = layout.read(cache, blocks, keep)
    # the same selection on the decoded keys (float caches of the decoded entries), then its bytes unchanged
    ref = torch.zeros(6, H, BS, 2 * D)
    plain = _CpuImpl("auto")
    plain_layout = probe_layout(plain, _layer(isa, 1.0, 1.0), ref)
    plain.do_kv_cache_update(
        _layer(isa, 1.0, 1.0), decoded, layout.entry.decode(stored_v, scales[1], torch.float32), ref, slots
    )
    evict_layer(get_method("snapkv", window=8), plain_layout, ref, query, pending, 0, 1, D**-0.5, None)
    want_k, want_v = plain_layout.read(ref, blocks, keep)
    assert torch.equal(layout.entry.decode(kept_k, scales[0], torch.float32), want_k)
    assert torch.equal(layout.entry.decode(kept_v, scales[1], torch.float32), want_v)
    index = [(decoded[:, h] == want_k[:, h, None]).all(-1).nonzero()[:, 1] for h in range(H)]
    for h in range(H):
        assert torch.equal(kept_k[:, h], stored_k[index[h], h]) and torch.equal(kept_v[:, h], stored_v[index[h], h])


def _generate(llm, prompts) -> list[list[int]]:
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return token_prompts(LENGTHS)


@pytest.fixture(scope="module")
def fp8_alone(prompts) -> list[list[int]]:
    llm = make_llm(kv_cache_dtype="fp8")
    try:
        return _generate(llm, prompts)
    finally:
        close(llm)


@pytest.mark.slow
def test_fp8_with_a_budget_above_the_prompt_is_fp8_alone(prompts, fp8_alone):
    llm = make_llm({"method": "snapkv", "budget": 2048}, kv_cache_dtype="fp8")
    try:
        assert _generate(llm, prompts) == fp8_alone
        assert scheduler(llm)._kvtrim_state.requests_compressed == 0
    finally:
        close(llm)


@pytest.mark.slow
def test_fp8_eviction_frees_blocks_and_compacts_every_layer(prompts, fp8_alone):
    config = {"method": "snapkv", "budget": 100}
    keep = [parse_config(config).keep_count(len(p)) for p in prompts]
    llm = make_llm(config, kv_cache_dtype="fp8")
    try:
        out = _generate(llm, prompts)
        state = scheduler(llm)._kvtrim_state
        (stats,) = llm.collective_rpc(worker_stats)
        assert [o[0] for o in out] == [v[0] for v in fp8_alone]  # the prefill logits come before eviction
        assert all(len(o) == GREEDY.max_tokens for o in out)
        freed = sum(_cdiv(len(p), BLOCK) - _cdiv(k, BLOCK) for k, p in zip(keep, prompts, strict=True))
        assert state.blocks_freed == freed == 7 and state.requests_compressed == 2
        assert stats["kv_cache_dtypes"] == ["fp8"] and stats["layer_evictions"] == 2 * stats["num_layers"] == 60
        assert state.dropped == {} and used_blocks(llm) == 0
    finally:
        close(llm)


# ------------------------------------------------------------------------------------------------ per-head budgets
def _vllm_fp8_attention(query, kv_cache, qsl, seq_lens, block_table, isa, scales, kv_cache_dtype):
    """vLLM's own CPU attention call over an fp8 cache (what ``CPUAttentionBackendImpl.forward`` does)."""
    from vllm import _custom_ops as ops
    from vllm import envs

    nb, h, bs, _ = kv_cache.shape
    k_cache, v_cache = kv_cache.view(nb, h, 2 * bs, D).chunk(2, dim=2)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=seq_lens.numel(), num_heads=query.shape[1], num_kv_heads=h, head_dim=D, seq_lens=seq_lens,
        dtype=query.dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    out = torch.empty_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=k_cache, value_cache=v_cache, output=out, query_start_loc=qsl, seq_lens=seq_lens,
        scale=D**-0.5, causal=True, alibi_slopes=None, sliding_window=-1, block_table=block_table, softcap=0.0,
        scheduler_metadata=meta, s_aux=None, k_scale=scales[0], v_scale=scales[1], kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
    return out


def test_folded_fp8_writes_and_attention_with_equal_heads_are_vllms_own():
    """One-head writes and folded attention on an fp8 cache, with vLLM's placement: vLLM's own bytes and result."""
    isa, scales = _get_attn_isa(torch.float32, BS, D, "fp8"), (0.05, 0.2)  # the ISA the engine picks here
    g = torch.Generator().manual_seed(4)
    seq_lens = torch.tensor([50, 90], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 41], dtype=torch.int32)  # a decoding step and a 40-token chunk
    table = torch.tensor([[3, 5, 0], [1, 4, 2]], dtype=torch.int32)
    slots = torch.cat([table[r, torch.arange(int(n)) // BS].long() * BS + torch.arange(int(n)) % BS
                       for r, n in enumerate(seq_lens)])  # fmt: skip
    keys, values = torch.randn(len(slots), H, D, generator=g), torch.randn(len(slots), H, D, generator=g)
    ours, theirs = (torch.zeros(6, H, BS, 2 * D, dtype=torch.uint8) for _ in range(2))
    _CpuImpl("fp8").do_kv_cache_update(_layer(isa, *scales), keys, values, theirs, slots)
    folded_cache_write(keys, values, ours, default_subpage_slots(slots, H, BS), isa, *scales, "fp8")
    assert torch.equal(ours, theirs)
    query = torch.randn(int(qsl[-1]), 3 * H, D, generator=g)
    expected = _vllm_fp8_attention(query, theirs, qsl, seq_lens, table, isa, scales, "fp8")
    got = torch.empty_like(query)
    sub_table = default_subpage_table(table, H)
    folded_attention(query, ours, got, qsl, seq_lens.repeat_interleave(H), sub_table, D**-0.5, isa, 0.0, *scales, "fp8")
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("isa", ISAS)
def test_fp8_per_head_eviction_moves_each_heads_bytes_into_its_sub_pages(isa):
    impl, scales = _CpuImpl("fp8"), (0.05, 0.2)  # cache writes only: amx too (vLLM picks it for bfloat16 models)
    layer = _layer(isa, *scales)
    cache = torch.zeros(8, H, BS, 2 * D, dtype=torch.uint8)
    layout = probe_layout(impl, layer, cache, torch.float32)
    p, budget = 150, 40
    blocks = torch.tensor([6, 2, 7, 1, 5])
    g = torch.Generator().manual_seed(5)
    keys, values = torch.randn(p, H, D, generator=g), torch.randn(p, H, D, generator=g)
    slots = (blocks.repeat_interleave(BS) * BS + torch.arange(5 * BS) % BS)[:p]
    impl.do_kv_cache_update(layer, keys, values, cache, slots)
    stored_k, stored_v = layout.read(cache, blocks, p)
    decoded_k = layout.entry.decode(stored_k, scales[0], torch.float32)
    decoded_v = layout.entry.decode(stored_v, scales[1], torch.float32)
    query = torch.randn(p, 3 * H, D, generator=g)
    keep = min(budget + BS - 1, p)
    used = blocks[: -(-keep // BS)].tolist()

    def evict(kv_cache, lay):
        pages = RequestSubPages(1, H, BS, used)
        pending = PendingEviction("r", 0, p, p, keep, blocks, head_budget=budget, pages=pages)
        counts = evict_layer_heads(get_method("adakv", window=8), lay, kv_cache, query, pending, 0, 1, D**-0.5,
                                   None, isa, scales=scales)  # fmt: skip
        return counts, pages

    counts, pages = evict(cache, layout)
    assert len(set(counts)) > 1 and sum(counts) == H * budget  # the heads split the layer's total
    # reference: the same method on a float cache holding the decoded entries
    ref = torch.zeros(8, H, BS, 2 * D)
    plain = _CpuImpl("auto")
    plain.do_kv_cache_update(_layer(isa, 1.0, 1.0), decoded_k, decoded_v, ref, slots)
    ref_counts, ref_pages = evict(ref, probe_layout(plain, _layer(isa, 1.0, 1.0), ref))
    assert ref_counts == counts
    sub, ref_sub = layout.one_head(), probe_layout(plain, _layer(isa, 1.0, 1.0), ref).one_head()
    for h in range(H):
        pages_h = torch.tensor(pages.table(0)[h])
        kept_k, kept_v = sub.read(cache, pages_h, counts[h])
        want_k, want_v = ref_sub.read(ref, torch.tensor(ref_pages.table(0)[h]), counts[h])
        assert torch.equal(layout.entry.decode(kept_k[:, 0], scales[0], torch.float32), want_k[:, 0])
        assert torch.equal(layout.entry.decode(kept_v[:, 0], scales[1], torch.float32), want_v[:, 0])
        index = (decoded_k[:, h] == want_k[:, 0, None]).all(-1).nonzero()[:, 1]
        assert torch.equal(kept_k[:, 0], stored_k[index, h]) and torch.equal(kept_v[:, 0], stored_v[index, h])


@pytest.mark.slow
def test_adakv_on_an_fp8_cache_keeps_per_head_counts_and_frees_blocks(tmp_path):
    model = truncated_model(tmp_path / "smollm2-4layers", layers=4)
    config = {"method": "adakv", "budget": 64}
    slots = [parse_config(config).slot_count(n, 4, 32) for n in LENGTHS]
    prompts = token_prompts(LENGTHS)
    llm = make_llm(config, model=str(model), block_size=32, kv_cache_dtype="fp8")
    try:
        out = _generate(llm, prompts)
        state = scheduler(llm)._kvtrim_state
        (stats,) = llm.collective_rpc(worker_stats)
        engine = llm.llm_engine.engine_core.engine_core
        worker = engine.model_executor.driver_worker.worker.model_runner._kvtrim_state
        assert all(len(o) == GREEDY.max_tokens for o in out)
        assert state.requests_compressed == 2 and stats["kv_cache_dtypes"] == ["fp8"]
        assert state.blocks_freed == sum(_cdiv(n, 32) - _cdiv(s, 32) for n, s in zip(LENGTHS, slots, strict=True))
        assert worker.ragged_layers == 2 * 4  # every layer of both requests split its heads unevenly
        assert used_blocks(llm) == 0 and state.dropped == {}
    finally:
        close(llm)
    llm = make_llm(model=str(model), block_size=32, kv_cache_dtype="fp8")
    try:
        assert [o[0] for o in out] == [v[0] for v in _generate(llm, prompts)]  # prefill logits before eviction
    finally:
        close(llm)
