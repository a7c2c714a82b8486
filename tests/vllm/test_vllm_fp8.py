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
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
from vllm_helpers import BLOCK, close, make_llm, scheduler, token_prompts, used_blocks

from kvtrim.methods import get_method
from kvtrim.vllm.config import parse_config
from kvtrim.vllm.evictor import PendingEviction, evict_layer
from kvtrim.vllm.kv_layout import probe_layout
from kvtrim.vllm.runner_check import worker_stats
from vllm import SamplingParams

LENGTHS = [60, 300, 700]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
H, D, BS = 3, 64, 32  # SmolLM2's KV heads and head_dim; the CPU backend's blocks are multiples of 32
ISAS = ["vec"] + (["amx"] if torch.cpu._is_amx_tile_supported() else [])
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


@pytest.mark.slow
def test_per_head_budgets_on_an_fp8_cache_are_refused_at_start_up():
    with pytest.raises(Exception, match=r"kv_cache_dtype='fp8' with method 'adakv': per-head budgets"):
        make_llm({"method": "adakv", "budget": 64}, kv_cache_dtype="fp8")
