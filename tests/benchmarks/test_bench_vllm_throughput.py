"""The helpers of benchmarks/bench_vllm_throughput.py that need no vLLM: equal KV memory between vLLM's blocks and
kvtrim's engine, the engine's compression rate for a budget, and the modes the arguments give."""

from __future__ import annotations

import pytest

from conftest import byte_tokenizer, tiny_model
from kvtrim.errors import InvalidParameterError
from script_loader import load_script

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_vllm_throughput.py")


def test_vllm_block_holds_every_layer_and_kv_head(bench):
    # 128 tokens x 30 layers x (K, V) x 3 KV heads x 64 channels x 4 bytes (float32)
    assert bench.vllm_block_bytes(SMOLLM2) == 128 * 30 * 2 * 3 * 64 * 4 == 5_898_240
    assert bench.vllm_block_bytes({**SMOLLM2, "head_dim": 32}, block_size=32, dtype_bytes=2) == 32 * 30 * 2 * 3 * 32 * 2


def test_engine_pool_has_the_bytes_of_vllms_usable_blocks(bench):
    pool = bench.engine_pool(SMOLLM2, blocks=17, engine_block=16)
    assert pool["vllm_usable_blocks"] == 16  # one of the 17 is vLLM's null block
    assert pool["kv_bytes"] == 16 * 5_898_240 == 94_371_840
    assert pool["engine_block_bytes"] == 2 * 16 * 64 * 4
    assert pool["engine_blocks"] == 11_520 == 16 * 128 * 30 * 3 // 16  # the same token slots per layer and head
    assert pool["tokens_per_table"] == 2048
    with pytest.raises(InvalidParameterError, match="blocks must be > 1"):
        bench.engine_pool(SMOLLM2, blocks=1, engine_block=16)


def test_smaller_vllm_blocks_at_equal_memory_give_the_same_pool(bench):
    # 16 usable blocks of 128 tokens = 64 usable blocks of 32 tokens: the same bytes, the same engine pool
    big = bench.engine_pool(SMOLLM2, blocks=17, engine_block=16)
    small = bench.engine_pool(SMOLLM2, blocks=65, engine_block=16, block_size=32)
    assert small["vllm_block_size"] == 32 and small["vllm_usable_blocks"] == 64
    assert small["vllm_block_bytes"] == big["vllm_block_bytes"] // 4
    for key in ("kv_bytes", "engine_blocks", "tokens_per_table"):
        assert small[key] == big[key]
    for bad in (0, 16, 48, -32):
        with pytest.raises(InvalidParameterError, match="block_size must be a positive multiple of 32"):
            bench.engine_pool(SMOLLM2, blocks=65, engine_block=16, block_size=bad)


def test_the_engine_builds_a_pool_of_exactly_those_bytes(bench):
    model = tiny_model(layers=2, heads=4, kv_heads=2, hidden=64)
    pool = bench.engine_pool(model.config, blocks=3, engine_block=16)
    mode = bench.Mode("engine/kvcompress/64", "engine", "kvcompress", 64)
    engine = bench.make_engine(model, byte_tokenizer(), mode, pool, prompt_len=512, chunk=128)
    assert engine.pool.nbytes() == pool["kv_bytes"] == 2 * 128 * 2 * 2 * 2 * 16 * 4
    assert engine.pool.num_blocks == pool["engine_blocks"]
    assert engine.compression_rate == 8.0
    with pytest.raises(InvalidParameterError, match="method must be one of"):
        refused = bench.Mode("engine/snapkv/64", "engine", "snapkv", 64)
        bench.make_engine(model, byte_tokenizer(), refused, pool, prompt_len=512, chunk=128)


def test_budget_gives_the_engines_compression_rate(bench):
    assert bench.compression_rate(1024, 128) == 8.0
    assert bench.compression_rate(1024, 256) == 4.0
    for budget in (0, 1025):
        with pytest.raises(InvalidParameterError, match="budget must be in"):
            bench.compression_rate(1024, budget)


def test_modes_fall_back_to_after_prefill_where_the_plugin_refuses_rounds(bench):
    modes = bench.plan_modes(["snapkv", "adakv", "pyramidkv"], [256, 128], ["between"], ["kvcompress"],
                             engine_full=True)  # fmt: skip
    assert list(modes) == [
        "vanilla",
        "snapkv/256/between",
        "snapkv/128/between",
        "adakv/256/between",
        "adakv/128/between",
        "pyramidkv/256/after",
        "pyramidkv/128/after",
        "engine/full",
        "engine/snapkv/256",
        "engine/snapkv/128",
        "engine/adakv/256",
        "engine/adakv/128",
        "engine/pyramidkv/256",
        "engine/pyramidkv/128",
        "engine/kvcompress/256",
        "engine/kvcompress/128",
    ]
    assert modes["snapkv/128/between"].plugin_config() == {"method": "snapkv", "budget": 128, "between_chunks": True}
    assert modes["adakv/128/between"].refusal is None  # per-head rounds
    pyramid = modes["pyramidkv/128/after"]
    assert pyramid.plugin_config() == {"method": "pyramidkv", "budget": 128}
    assert "pyramidkv" in pyramid.refusal and pyramid.note.startswith("the plugin refuses between_chunks")
    assert modes["engine/kvcompress/128"].plugin_config() is None


def test_mode_selection_orders_and_takes_the_older_names(bench):
    modes = bench.plan_modes(["snapkv"], [128], ["after", "between"], [], engine_full=False)
    names = [m.name for m in bench.select_modes(modes, "between,kvtrim,vanilla")]
    assert names == ["snapkv/128/between", "snapkv/128/after", "vanilla"]
    assert [m.name for m in bench.select_modes(modes, None)] == list(modes)
    for order in ("vanilla,vanilla", "vanilla,nope"):
        with pytest.raises(InvalidParameterError, match="modes once each"):
            bench.select_modes(modes, order)
    several = bench.plan_modes(["snapkv"], [128, 256], ["between"], [], engine_full=False)
    with pytest.raises(InvalidParameterError, match="modes once each"):
        bench.select_modes(several, "between")  # the older names only name a single entry


def test_method_params_reach_the_plugin_configuration(bench):
    even = {"even_layer_evict": True}
    modes = bench.plan_modes(
        ["kvcompress"], [128], ["between"], [], engine_full=False, method_params={"kvcompress": even}
    )
    mode = modes["kvcompress/128/between"]  # per-head rounds between chunks
    assert mode.plugin_config() == {"method": "kvcompress", "budget": 128, "params": even, "between_chunks": True}
    assert mode.refusal is None
    assert "params.even_layer_evict" in bench.rounds_refusal("kvcompress", 128)  # without the flag: refused outright


def test_decode_reserves_add_modes_between_chunks_only(bench):
    modes = bench.plan_modes(["snapkv"], [128], ["after", "between"], [], engine_full=False, reserves=[0, 64])
    assert [m for m in modes if not m.startswith("engine/")] == [
        "vanilla", "snapkv/128/after", "snapkv/128/between", "snapkv/128/between/reserve:64",
    ]  # fmt: skip
    assert modes["snapkv/128/between/reserve:64"].plugin_config() == {
        "method": "snapkv", "budget": 128, "between_chunks": True, "decode_reserve": 64,
    }  # fmt: skip
    assert "decode_reserve" not in modes["snapkv/128/between"].plugin_config()
    assert "decode_reserve" not in modes["snapkv/128/after"].plugin_config()


def test_context_only_cases_split_the_prompt_where_the_context_ends(bench):
    import kvtrim
    from kvtrim.eval.tasks import generate_task

    tokenizer = kvtrim.load_tokenizer("smollm2-135m")
    sample = generate_task("passkey", tokenizer, 512, 1, seed=7)[0]
    ids, n = bench.case_ids(tokenizer, sample, context_only=True)
    plain, none = bench.case_ids(tokenizer, sample)
    assert none is None and 0 < n < len(ids)
    head, tail = tokenizer.decode(ids[:n]), tokenizer.decode(ids[n:])
    assert head.endswith(sample.context) and tail.startswith(sample.question)  # the boundary is the context's end
    assert sample.question not in head
    assert abs(len(ids) - len(plain)) <= 2  # tokenized apart, the prompt keeps (nearly) its length


def test_the_summary_reports_the_measured_machine_and_each_modes_load(bench):
    line = bench.machine_line()
    assert "CPUs, load average" in line and "at start" in line
    assert "shared" not in line  # the load is measured, not assumed
    row = {"mode": "vanilla", "kind": "vanilla", "output_tok_per_s": 10.0, "wall_s": 1.0, "most_running_at_once": 1}
    report = {
        "vllm": "0.32.0", "date": "2026-01-01T00:00:00+00:00", "machine": line, "command": "python bench",
        "args": {"requests": 2, "prompt_len": 8, "output_len": 4, "blocks": 17, "block_size": 128, "chunk": 256},
        "throughput": [dict(row, load_average=[0.5, 1.5]), dict(row, mode="old")], "quality": [],
    }  # fmt: skip
    lines = bench.render(report)
    assert lines[1] == line
    table = [x for x in lines if x.startswith("| vanilla") or x.startswith("| old")]
    assert "| 0.5 → 1.5 |" in table[0]
    assert "| – |" in table[1]  # a row written before loads were recorded
    header = next(x for x in lines if x.startswith("| mode |"))
    assert header.count("|") == table[0].count("|")
