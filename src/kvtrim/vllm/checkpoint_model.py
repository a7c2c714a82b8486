"""A weightless stand-in for the transformers model of a checkpoint, so artifact methods bind inside vLLM.

Calibration artifacts (HeadKV's head scores) are found and checked by the model's identity
(``kvtrim.artifacts.store.model_identity``): its config and a fingerprint of a few weight tensors under their
transformers names (embedding rows 0–63, layer 0's ``q_proj``, the last layer's ``o_proj``, the final norm).
vLLM's processes hold no transformers model, and vLLM's own modules fuse and rename those weights, so
:func:`checkpoint_stand_in` reads exactly those tensors from the checkpoint's safetensors files into an
``nn.Module`` that carries them under their transformers names, plus the transformers config. Nothing else is
loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import UnsupportedModelError

_FINGERPRINT_ROWS = 64  # kvtrim.artifacts.store hashes this many embedding rows


class _StandIn(torch.nn.Module):
    def __init__(self, config, embed_name: str | None) -> None:
        super().__init__()
        self.config = config
        self._embed_name = embed_name

    def get_input_embeddings(self):
        if self._embed_name is None:
            return None
        return self.get_submodule(self._embed_name.rpartition(".")[0])


def _tensor_files(root: Path) -> dict[str, Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: root / file for name, file in weight_map.items()}
    single = root / "model.safetensors"
    if not single.is_file():
        raise UnsupportedModelError(f"no safetensors checkpoint in {root}: kvtrim cannot find its calibration artifact")
    from safetensors import safe_open

    with safe_open(str(single), "pt") as f:
        return dict.fromkeys(f.keys(), single)


def checkpoint_stand_in(model_path: str) -> torch.nn.Module:
    """The stand-in for the checkpoint at ``model_path`` (a local directory, as vLLM loads it)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    root = Path(model_path)
    config = AutoConfig.from_pretrained(str(root))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(text.num_hidden_layers)
    files = _tensor_files(root)
    wanted = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        f"model.layers.{layers - 1}.self_attn.o_proj.weight",
        "model.norm.weight",
    ]
    missing = [n for n in wanted if n not in files]
    if missing:
        raise UnsupportedModelError(
            f"the checkpoint in {root} lacks {missing}: kvtrim identifies a model's calibration artifact by "
            "these transformers weights"
        )
    stand_in = _StandIn(config, wanted[0])
    for name in wanted:
        with safe_open(str(files[name]), "pt") as f:
            tensor = f.get_slice(name)[:_FINGERPRINT_ROWS] if name == wanted[0] else f.get_tensor(name)
        parent = stand_in
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        parent.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return stand_in
