"""The engine's decode_kernel option: the block-table kernel path (a pure-torch reference of vLLM's fork injected,
as in tests/cache/test_paged_kernels.py) gives the same tokens as the gather path, with compression and the
continual metric on; the choice is reported in the stats; "flash" on a CPU without a kernel is refused."""

from __future__ import annotations

import pytest
import torch

import paged_kernel_reference as ref
from compressed_engine_run import run_compressed
from conftest import byte_tokenizer, tiny_model
from kvtrim.cache import paged_kernels
from kvtrim.errors import InvalidParameterError
from kvtrim.serve.engine import Engine


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return tiny_model("llama")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _run(model, tok, decode_kernel: str, decode_buckets: bool, static: bool = False) -> tuple[list[list[int]], Engine]:
    return run_compressed(
        model, tok, requests=6, max_tokens=24, decode_buckets=decode_buckets, decode_kernel=decode_kernel,
        static_decode=static,
    )  # fmt: skip


@pytest.mark.parametrize(("decode_buckets", "static"), [(False, False), (True, False), (True, True)])
def test_engine_with_the_kernel_generates_the_gather_paths_tokens(monkeypatch, model, tok, decode_buckets, static):
    """``static``: the static decode step (what ``cuda_graphs`` captures) runs the kernel too."""
    want, gather = _run(model, tok, "gather", decode_buckets)
    calls = []
    monkeypatch.setattr(paged_kernels, "_load_vllm_fork", lambda: lambda *a, **k: calls.append(1) or
                        ref.flash_attn_varlen_func(*a, **k))  # fmt: skip
    monkeypatch.setattr(paged_kernels, "_load_flash_attn", lambda: None)
    monkeypatch.setattr(paged_kernels, "_device_supported", lambda device: True)
    monkeypatch.setattr(paged_kernels, "_dtype_supported", lambda dtype: True)
    got, flash = _run(model, tok, "flash", decode_buckets, static)
    assert got == want
    assert flash.stats.static_decode_steps == (flash.stats.decode_steps if static else 0)
    assert flash.stats.compressions > 0 and flash.stats.decode_steps > 0
    # one call per layer and step, and the one test call that chose the kernel
    assert len(calls) == flash.stats.decode_steps * model.config.num_hidden_layers + 1
    assert (gather.decode_kernel, gather.stats.decode_kernel) == ("gather", "gather")
    assert (flash.decode_kernel, flash.stats.decode_kernel) == ("vllm_flash_attn", "vllm_flash_attn")
    auto = Engine(model, tok, kv_blocks=8, block_size=16, decode_kernel="auto")
    assert auto.stats.decode_kernel == "vllm_flash_attn"


def test_engine_flash_on_cpu_is_refused_and_auto_gathers(model, tok):
    with pytest.raises(InvalidParameterError, match=r"decode_kernel='flash' cannot be used: it needs a CUDA device"):
        Engine(model, tok, kv_blocks=8, block_size=16, decode_kernel="flash")
    with pytest.raises(InvalidParameterError, match="decode_kernel must be one of"):
        Engine(model, tok, kv_blocks=8, block_size=16, decode_kernel="fast")
    assert Engine(model, tok, kv_blocks=8, block_size=16, decode_kernel="auto").stats.decode_kernel == "gather"
