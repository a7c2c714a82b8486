"""kvtrim inside vLLM: evict prompt KV entries after prefill and give whole blocks back to vLLM's scheduler.

Installed as a ``vllm.general_plugins`` entry point (``kvtrim.vllm.plugin:register``); see ``docs/vllm.md``.
Importing this package does not import vLLM.
"""

from .config import ENV_VAR, SUPPORTED_METHODS, VLLMEvictionConfig, load_config, parse_config

__all__ = ["ENV_VAR", "SUPPORTED_METHODS", "VLLMEvictionConfig", "load_config", "parse_config"]
