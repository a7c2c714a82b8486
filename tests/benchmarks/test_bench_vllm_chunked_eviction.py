"""The helpers of benchmarks/bench_vllm_chunked_eviction.py that need no vLLM: RoPE overrides, the block bound
and the pool's peak counter (on a stand-in pool)."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from kvtrim.scoring.rope import rope_frequencies
from script_loader import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_vllm_chunked_eviction.py")


def write_config(path: pathlib.Path, **config) -> pathlib.Path:
    (path / "config.json").write_text(json.dumps({"max_position_embeddings": 64, **config}))
    return path


def test_linear_overrides_keep_the_checkpoints_theta(bench, tmp_path):
    model = write_config(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    assert bench.rope_overrides(model, None, 64) == {}
    assert bench.rope_overrides(model, 4, 256) == {
        "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0}
    }


def test_older_configs_give_theta_at_the_top_level(bench, tmp_path):
    model = write_config(tmp_path, rope_theta=10000.0)
    assert bench.native_rope(model) == (64, 10000.0)


@pytest.mark.parametrize(
    ("factor", "max_model_len", "match"),
    [(None, 65, "give a rope factor"), (2, 129, r"64 \* rope factor 2"), (1, 64, "must be > 1")],
)
def test_overrides_refuse_lengths_past_the_scaled_context(bench, tmp_path, factor, max_model_len, match):
    model = write_config(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    with pytest.raises(ValueError, match=match):
        bench.rope_overrides(model, factor, max_model_len)


def test_transformers_and_kvtrim_read_the_same_overrides_as_interpolated_positions(bench, tmp_path):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    native = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = write_config(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    overrides = bench.rope_overrides(model, 4, 256)
    plain = LlamaRotaryEmbedding(LlamaConfig(**native, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}))
    scaled = LlamaRotaryEmbedding(LlamaConfig(**native, **overrides))
    x = torch.zeros(1, 1, 16)
    cos_scaled, sin_scaled = scaled(x, torch.tensor([[0, 4, 100, 255]]))
    cos_plain, sin_plain = plain(x, torch.tensor([[0.0, 1.0, 25.0, 63.75]]))
    torch.testing.assert_close(cos_scaled, cos_plain)
    torch.testing.assert_close(sin_scaled, sin_plain)
    # kvtrim's scorers that move queries in position rebuild the same frequencies from the config
    plain_freq, _ = rope_frequencies(plain.config, 16, torch.device("cpu"))
    scaled_freq, scale = rope_frequencies(scaled.config, 16, torch.device("cpu"))
    torch.testing.assert_close(scaled_freq, plain_freq / 4)
    assert scale == 1.0


def test_chunks_bound_rounds_up_to_blocks(bench):
    assert bench.chunks_bound(1024, 512) == 16
    assert bench.chunks_bound(1000, 512, chunks=1) == 12
    assert bench.chunks_bound(1024, 512, block=100) == 21


class StandInPool:
    """What track_peak reads of vLLM's BlockPool: num_gpu_blocks, get_num_free_blocks, get_new_blocks."""

    def __init__(self, blocks: int):
        self.num_gpu_blocks = blocks
        self.free = blocks - 1  # one null block

    def get_num_free_blocks(self) -> int:
        return self.free

    def get_new_blocks(self, n: int) -> list[int]:
        self.free -= n
        return list(range(n))


def test_track_peak_records_use_after_each_allocation(bench):
    pool = StandInPool(17)
    peaks = bench.track_peak(pool)
    assert pool.get_new_blocks(4) == [0, 1, 2, 3]
    pool.free += 3  # a round frees blocks between allocations
    pool.get_new_blocks(2)
    assert peaks == [4, 3] and max(peaks) == 4
