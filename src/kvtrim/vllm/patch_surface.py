"""The vLLM code kvtrim's plugin wraps or whose behaviour it relies on, for comparing vLLM releases.

Each entry names a file inside the ``vllm`` package and a qualified name in it (a function, a method or a whole
class). ``tools/vllm_patch_surface.py`` compares these definitions between two vLLM source trees or wheels
(syntax trees, so comments and formatting do not count) without installing either; a new vLLM release is added
to ``plugin.SUPPORTED_VLLM`` only after every entry is unchanged or its change was read and found harmless
(docs/vllm.md, "Which model runner"). Importing this module does not import vLLM.
"""

from __future__ import annotations

import ast
import copy
from typing import NamedTuple

_DEFS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


class SurfaceEntry(NamedTuple):
    """One definition: ``path`` relative to the ``vllm`` package, ``qualname`` inside it, ``why`` kvtrim needs it."""

    path: str
    qualname: str
    why: str


_RUNNER = "v1/worker/gpu_model_runner.py"
_SCHED = "v1/core/sched/scheduler.py"
_COORD = "v1/core/kv_cache_coordinator.py"
_CPU_ATTN = "v1/attention/backends/cpu_attn.py"

PATCH_SURFACE: tuple[SurfaceEntry, ...] = (
    # scheduler process (scheduler_patch.py)
    SurfaceEntry(_SCHED, "Scheduler.__init__", "wrapped: reads the configuration, checks requirements"),
    SurfaceEntry(_SCHED, "Scheduler._update_after_schedule", "wrapped: frees the evicted blocks"),
    SurfaceEntry("v1/core/sched/async_scheduler.py", "AsyncScheduler._update_after_schedule", "calls the wrapper"),
    SurfaceEntry(_SCHED, "Scheduler.add_request", "wrapped: refuses a request's invalid kvtrim settings"),
    SurfaceEntry(_SCHED, "Scheduler._reserve_prefill_lookahead", "wrapped: ends a chunk at a context's end"),
    SurfaceEntry(_SCHED, "Scheduler.schedule", "calls _reserve_prefill_lookahead last for every request"),
    SurfaceEntry("sampling_params.py", "SamplingParams", "extra_args carries a request's kvtrim settings"),
    SurfaceEntry("v1/engine/input_processor.py", "InputProcessor.process_inputs", "wrapped: checks the settings"),
    SurfaceEntry("v1/worker/gpu_input_batch.py", "CachedRequestState", "sampling_params read by the worker"),
    SurfaceEntry(_COORD, "KVCacheCoordinator.get_num_blocks_to_allocate", "wrapped: physical token counts"),
    SurfaceEntry(_COORD, "KVCacheCoordinator.allocate_new_blocks", "wrapped: physical token counts"),
    SurfaceEntry(_COORD, "KVCacheCoordinator.free", "wrapped: forgets the request"),
    SurfaceEntry(_COORD, "KVCacheCoordinator.pop_blocks_for_free", "wrapped: forgets the request"),
    SurfaceEntry("v1/core/single_type_kv_cache_manager.py", "FullAttentionManager", "req_to_blocks, block_size"),
    SurfaceEntry("v1/core/block_pool.py", "BlockPool.free_blocks", "returns the evicted blocks"),
    SurfaceEntry("v1/core/kv_cache_manager.py", "KVCacheManager.allocate_slots", "admission gate: apply_admission_cap"),
    SurfaceEntry("v1/engine/core.py", "EngineCore._initialize_kv_caches", "get_kv_cache_configs wrapped there"),
    # worker process (worker_patch.py)
    SurfaceEntry(_RUNNER, "GPUModelRunner._update_states", "wrapped"),
    SurfaceEntry(_RUNNER, "GPUModelRunner._prepare_inputs", "wrapped: physical seq_lens and slot mapping"),
    SurfaceEntry(_RUNNER, "GPUModelRunner.execute_model", "wrapped: records drops, cuts block tables"),
    SurfaceEntry(_RUNNER, "GPUModelRunner._get_slot_mappings", "wrapped: per-layer slot mappings"),
    SurfaceEntry(_RUNNER, "GPUModelRunner._build_attention_metadata", "wrapped: per-layer metadata"),
    SurfaceEntry("v1/worker/utils.py", "AttentionGroup", "build_metadata wrapped; layer_names read"),
    SurfaceEntry("v1/worker/block_table.py", "BlockTable", "block_table, slot_mapping, num_blocks_per_row"),
    SurfaceEntry("v1/worker/gpu_input_batch.py", "InputBatch", "num_computed_tokens_cpu, num_prompt_tokens"),
    SurfaceEntry("v1/worker/cpu_model_runner.py", "CPUModelRunner", "must not override a wrapped method"),
    SurfaceEntry("v1/attention/backends/cpu_attn.py", "CPUAttentionBackendImpl.forward", "wrapped: evicts"),
    SurfaceEntry("v1/attention/backends/cpu_attn.py", "CPUAttentionBackendImpl.do_kv_cache_update", "layout probe"),
    SurfaceEntry("v1/attention/backends/flash_attn.py", "FlashAttentionImpl.forward", "wrapped on CUDA: evicts"),
    SurfaceEntry("v1/attention/backends/flash_attn.py", "FlashAttentionImpl.do_kv_cache_update", "layout probe"),
    SurfaceEntry("model_executor/models/utils.py", "extract_layer_index", "layer index from a layer name"),
    SurfaceEntry("distributed/parallel_state.py", "get_tensor_model_parallel_rank", "which heads' counts a rank keeps"),
    # per-head budgets on a CPU (head_backend.py, folded_attention.py)
    SurfaceEntry(_CPU_ATTN, "CPUAttentionBackend", "subclassed: get_impl_cls; cache [blocks, H, bs, 2D]"),
    SurfaceEntry(_CPU_ATTN, "CPUAttentionBackendImpl.__init__", "num_kv_heads, scale, sinks, sliding_window read"),
    SurfaceEntry(_CPU_ATTN, "CPUAttentionMetadata", "query_start_loc, seq_lens, block_table read"),
    SurfaceEntry(_CPU_ATTN, "CPUAttentionMetadataBuilder._set_isa_to_layers", "layer.isa passed to the kernels"),
    SurfaceEntry("v1/attention/backends/registry.py", "register_backend", "CPU_ATTN resolved to kvtrim's subclass"),
    SurfaceEntry("v1/attention/backends/registry.py", "AttentionBackendEnum.get_path", "reads the override"),
    SurfaceEntry("platforms/cpu.py", "CpuPlatform.get_attn_backend_cls", "returns CPU_ATTN's path"),
    SurfaceEntry("_custom_ops.py", "cpu_attn_get_scheduler_metadata", "called with num_kv_heads=1"),
    SurfaceEntry("_custom_ops.py", "cpu_attn_reshape_and_cache", "one-head writes"),
    SurfaceEntry("_custom_ops.py", "cpu_attention_with_kv_cache", "folded attention"),
    SurfaceEntry("model_executor/layers/attention/attention.py", "unified_kv_cache_update", "calls the cache write"),
    SurfaceEntry("model_executor/layers/utils.py", "dispatch_cpu_unquantized_gemm", "o_proj weight read back"),
    # which model runner is live (runner_check.py)
    SurfaceEntry("config/vllm.py", "VllmConfig.use_v2_model_runner", "wrapped: V1 by default under kvtrim"),
    SurfaceEntry("v1/worker/worker_base.py", "WorkerWrapperBase.init_device", "wrapped: start-up check"),
    SurfaceEntry("v1/worker/worker_base.py", "WorkerWrapperBase.init_worker", "loads the plugin in each worker"),
    SurfaceEntry("v1/worker/cpu_worker.py", "CPUWorker.init_device", "makes the CPU model runner (V1 or V2)"),
    SurfaceEntry("v1/worker/gpu_worker.py", "Worker._make_model_runner", "makes the GPU model runner (V1 or V2)"),
)


def find_definition(tree: ast.Module, qualname: str) -> ast.AST | None:
    """The class or function ``qualname`` (``Class.method``, ``function``) at module level of ``tree``, or None."""
    node: ast.AST = tree
    for part in qualname.split("."):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _DEFS) and child.name == part:
                node = child
                break
        else:
            return None
    return node


def _without_docstrings(node: ast.AST) -> ast.AST:
    node = copy.deepcopy(node)
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if isinstance(n, _DEFS) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                n.body = body[1:] or [ast.Pass()]
    return node


def compare_definition(old_source: str | None, new_source: str | None, qualname: str) -> str:
    """``"same"``, ``"changed"`` or ``"missing"`` for ``qualname`` between two versions of one file.

    Syntax trees are compared without positions and docstrings, so comments, formatting and documentation
    changes count as the same; a file or definition absent from either side is ``"missing"``.
    """
    if old_source is None or new_source is None:
        return "missing"
    old = find_definition(ast.parse(old_source), qualname)
    new = find_definition(ast.parse(new_source), qualname)
    if old is None or new is None:
        return "missing"
    same = ast.dump(_without_docstrings(old)) == ast.dump(_without_docstrings(new))
    return "same" if same else "changed"


def definition_text(source: str, qualname: str) -> str:
    """The source text of ``qualname`` in ``source`` (for showing a change); empty when absent."""
    node = find_definition(ast.parse(source), qualname)
    return "" if node is None else ast.get_source_segment(source, node, padded=True) or ""
