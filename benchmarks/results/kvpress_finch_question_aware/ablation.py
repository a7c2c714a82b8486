"""Which of FINCH's differences from kvtrim's SnapKV costs the passkey: pooling, the window or the normalization.

Question-aware, ratio 0.75, the 6 passkey prompts of the evaluation in this directory; prints passkey_match ×100
per configuration. Run from the repository root:
``OMP_NUM_THREADS=1 PYTHONPATH=src python <this directory>/ablation.py``.
"""

from __future__ import annotations

import kvtrim
from kvtrim.eval.metrics import score_sample
from kvtrim.eval.runner import _generate

CONFIGS = {
    "snapkv (w=8, max-pool 7)": ("snapkv", {}),
    "snapkv (w=8, no pooling)": ("snapkv", {"kernel": 1, "pooling": "none"}),
    "finch, not normalized": ("finch", {"normalize": False}),
    "finch": ("finch", {}),
}

model, tok = kvtrim.load_model("smollm2-135m")
samples = [s for _, s in _generate(tok, ["passkey"], 1024, [], 6, 42, None, {})]
scores = {name: [] for name in CONFIGS}
for sample in samples:
    session = kvtrim.Session(
        model, tok, sample.context, question=sample.question, methods=["snapkv", "finch"],
        answer_prefix=sample.answer_prefix or None, use_chat_template=bool(sample.meta.get("chat_template", True)),
    )  # fmt: skip
    for name, (method, params) in CONFIGS.items():
        res = session.run(method, ratio=0.75, max_new_tokens=sample.max_new_tokens, method_params=params)
        scores[name].append(score_sample(sample, res.answers[0]))
for name, values in scores.items():
    print(f"{name}: passkey {100 * sum(values) / len(values):.1f} ({values})")
