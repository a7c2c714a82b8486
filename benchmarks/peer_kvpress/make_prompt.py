"""Write the shared passkey prompts that both sides of the kvtrim/kvpress comparison read.

Runs in kvtrim's venv. The samples come from kvtrim's own task generator (``passkey``, 1024 tokens, seed 0).
Besides the raw fields (context, question, answer prefix, answer) the file records the exact token ids kvtrim
feeds the model in context-only mode (chat template, context part compressed, question part appended after
compression), so the kvpress side can check that its pipeline tokenizes the very same prompt.

kvtrim's template puts ``separator`` ("\\n\\n") between context and question inside the user turn; kvpress's
pipeline puts nothing there, so the question given to kvpress is ``separator + question``. The resulting token
ids are checked for equality on the kvpress side (``prompt_tokens_identical`` in its output).

Usage::

    .venv/bin/python benchmarks/peer_kvpress/make_prompt.py --out benchmarks/results/peer_kvpress/prompt.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import kvtrim
from kvtrim.eval.tasks import generate_task
from kvtrim.prompts import prompt_template


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    tok = kvtrim.load_tokenizer(args.model)
    template = prompt_template(tok)
    special = template.prefix == ""  # kvtrim adds special tokens only when there is no chat template
    samples = generate_task("passkey", tok, args.length, args.samples, seed=args.seed)
    rows = []
    for s in samples:
        context_text = template.context_part(s.context)
        question_text = template.question_part(s.question, s.answer_prefix)
        rows.append(
            {
                "index": s.index,
                "context": s.context,
                "question": s.question,
                "answer_prefix": s.answer_prefix,
                "answers": s.answers,
                "max_new_tokens": s.max_new_tokens,
                "depth_percent": s.meta["depth_percent"],
                # what kvtrim feeds the model (context part, then the question part after compression)
                "kvtrim_context_ids": tok(context_text, add_special_tokens=special)["input_ids"],
                "kvtrim_question_ids": tok(question_text, add_special_tokens=False)["input_ids"],
                # what to give kvpress's pipeline so that it builds the same prompt
                "kvpress_question": template.separator + s.question,
            }
        )
    out = {
        "task": "passkey",
        "length": args.length,
        "seed": args.seed,
        "model": args.model,
        "model_path": str(kvtrim.models.resolve_model_path(args.model)),
        "template": {"prefix": template.prefix, "separator": template.separator, "suffix": template.suffix},
        "samples": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    lengths = [len(r["kvtrim_context_ids"]) for r in rows]
    print(f"wrote {args.out}: {len(rows)} samples, context tokens {lengths}")


if __name__ == "__main__":
    main()
