"""benchmarks/bench_kvquant_fidelity.py on the tiny random Llama: the teacher-forced log-probabilities are the
model's own over the whole sequence, and the KL it reports is zero only for the unquantized cache."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from script_loader import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/bench_kvquant_fidelity.py")


def _models_own(logprobs, n_context: int, n_continuation: int, seed: int):
    """Random context and continuation ids, the tiny Llama, and ``logprobs(model, context, continuation, None)``
    checked against one forward over the whole sequence: ``(model, context, continuation, ref)``."""
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(seed)
    context = torch.randint(5, 250, (1, n_context), generator=g)
    continuation = torch.randint(5, 250, (1, n_continuation), generator=g)
    ref = logprobs(model, context, continuation, None)
    with torch.no_grad():
        whole = model(torch.cat([context, continuation[:, :-1]], 1)).logits[0, n_context - 1 :]
    torch.testing.assert_close(ref, whole.float().log_softmax(-1), rtol=1e-4, atol=1e-4)
    return model, context, continuation, ref


def test_continuation_logprobs_are_the_models_own_and_quantization_moves_them(bench):
    model, context, continuation, ref = _models_own(bench.continuation_logprobs, 150, 9, seed=0)
    answer = continuation[0, -3:]
    same = bench.compare(ref, ref, answer)
    assert same["kl"] == 0 and same["answer_nll_change"] == 0
    int8_lp = bench.continuation_logprobs(model, context, continuation, "int8")
    assert not torch.equal(int8_lp, ref)  # the context was really held quantized
    int8 = bench.compare(ref, int8_lp, answer)
    int4 = bench.compare(ref, bench.continuation_logprobs(model, context, continuation, "int4:sink=0"), answer)
    assert abs(int8["kl"]) < int4["kl"] <= int4["kl_max"]


def test_pool_continuation_is_the_models_own_and_quantization_moves_it(bench):
    """``--store pool``: the engine's block pool in the model's dtype gives the model's own log-probabilities (a
    prefill, then one decode step a token), and a packed pool moves them."""
    model, context, continuation, ref = _models_own(bench.pool_continuation_logprobs, 70, 6, seed=1)
    answer = continuation[0, -2:]
    int8 = bench.compare(ref, bench.pool_continuation_logprobs(model, context, continuation, "int8"), answer)
    int4 = bench.compare(ref, bench.pool_continuation_logprobs(model, context, continuation, "int4"), answer)
    assert 0 < int8["kl"] < int4["kl"]


def test_summary_and_table(bench):
    spec = "int8:group_size=64,residual=0,sink=0"
    rows = [{"formats": {"int8": {"resolved": spec, "kl": k, "kl_max": k, "answer_nll_change": d}}}
            for k, d in ((0.1, 0.5), (0.3, -0.1), (0.2, 0.2))]  # fmt: skip
    (s,) = bench.summarize(rows, ["int8"])
    assert s["prompts"] == 3 and s["kl_mean"] == pytest.approx(0.2) and s["kl_median"] == 0.2
    assert s["answer_nll_change_mean"] == pytest.approx(0.2)
    md = bench.render([s], {"prompts": 3, "samples": 1, "seed": 0, "length": 100})
    assert "nothing evicted, kvtrim's dense cache." in md
    pool = bench.render([s], {"prompts": 3, "samples": 1, "seed": 0, "length": 100, "store": "pool"})
    assert "the serving engine's paged block pool" in pool
    assert "| `int8` | `int8:group_size=64,residual=0,sink=0` | 0.20000 | 0.20000 | +0.2000 |" in md
