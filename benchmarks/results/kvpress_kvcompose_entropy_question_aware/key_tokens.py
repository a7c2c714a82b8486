"""How many of the passkey's digit tokens ChunkKV and entropy-gated ChunkKV keep in each layer (question-aware,
ratio 0.75, the second passkey prompt of the evaluation in this directory).

Run from the repository root: ``OMP_NUM_THREADS=1 PYTHONPATH=src python <this directory>/key_tokens.py``.
"""

from __future__ import annotations

import kvtrim
from kvtrim.compression.compressor import BudgetSpec
from kvtrim.eval.runner import _generate
from kvtrim.methods import get_method

model, tok = kvtrim.load_model("smollm2-135m")
_, sample = _generate(tok, ["passkey"], 1024, [], 6, 42, None, {})[1]
session = kvtrim.Session(
    model, tok, sample.context, question=sample.question, methods=["chunkkv", "entropy_chunkkv"],
    answer_prefix=sample.answer_prefix or None, use_chat_template=bool(sample.meta.get("chat_template", True)),
)  # fmt: skip
ids = session.ids[0].tolist()
key = tok(sample.answers[0], add_special_tokens=False)["input_ids"]
start = next(i for i in range(len(ids) - len(key)) if ids[i : i + len(key)] == key)
print(f"key {sample.answers[0]}: {len(key)} tokens at positions {start}..{start + len(key) - 1}")
for name in ("chunkkv", "entropy_chunkkv"):
    cache = session.prefill.cache.clone(get_method(name), BudgetSpec(ratio=0.75))
    cache.compress()
    kept = [
        sum(int((layer.store.positions[0, 0] == p).any()) for p in range(start, start + len(key)))
        for layer in cache.kv_layers
    ]
    print(f"{name}: key tokens kept per layer {kept}")
