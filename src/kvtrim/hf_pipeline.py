"""A transformers pipeline task, ``"kvtrim-text-generation"``: compress a context once, answer questions from it.

Importing this module registers the task with transformers' ``PIPELINE_REGISTRY`` (kept out of ``import kvtrim``,
which stays light)::

    import kvtrim.hf_pipeline  # registers "kvtrim-text-generation"
    from transformers import pipeline

    pipe = pipeline("kvtrim-text-generation", model=model, tokenizer=tokenizer)
    pipe(context, question="What is the pass key?", method="snapkv", ratio=0.5, question_aware=True)
    # -> {"answer": "..."}; questions=[...] -> {"answers": [...]}, all from one compressed context

It is called as kvpress's ``kv-press-text-generation`` pipeline is (``question``/``questions``,
``answer_prefix``, ``max_new_tokens``), with kvtrim's ``method=`` and ``ratio=``/``budget=`` in place of
``press=``, and lays prompts out as kvpress does unless ``prompt_format="kvtrim"``.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoModelForCausalLM
from transformers.pipelines import PIPELINE_REGISTRY, Pipeline

from .errors import InvalidParameterError

TASK = "kvtrim-text-generation"
_FORWARD = (
    "method",
    "ratio",
    "budget",
    "question_aware",
    "max_new_tokens",
    "method_params",
    "prompt_format",
    "separator",
    "use_chat_template",
    "prefill_chunk",
    "generation_config",
    "do_sample",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
)


class KVTrimTextGenerationPipeline(Pipeline):
    """Answer one or more questions about a long context from its compressed KV cache.

    Call arguments (besides the context): ``question`` or ``questions``; ``method`` (a kvtrim method name,
    default ``"snapkv"``; ``"full"`` keeps everything) with ``ratio`` or ``budget``; ``question_aware``
    (compress context and question together, default False: the context is compressed once and every
    question is answered from it); ``answer_prefix``; ``max_new_tokens`` (default 50, as kvpress);
    ``prompt_format`` (default ``"kvpress"``); sampling settings (``do_sample``, ``temperature``, ``top_p``,
    ``top_k``, ``seed``, ``stop``, ``generation_config``); ``return_stats`` adds kvtrim's
    :class:`~kvtrim.api.GenerationStats` as a dict.
    """

    def _sanitize_parameters(
        self,
        question: str | None = None,
        questions: list[str] | None = None,
        answer_prefix: str | None = None,
        return_stats: bool = False,
        **kwargs: Any,
    ):
        if question is not None and questions is not None:
            raise InvalidParameterError("give question or questions, not both")
        if "press" in kwargs:
            raise InvalidParameterError("kvtrim takes method= and ratio= (or budget=) instead of press=")
        unknown = sorted(set(kwargs) - set(_FORWARD))
        if unknown:
            raise InvalidParameterError(f"unknown argument(s) {unknown}; allowed: {sorted(_FORWARD)}")
        if questions is not None and (
            not isinstance(questions, (list, tuple)) or not questions or any(not isinstance(q, str) for q in questions)
        ):
            raise InvalidParameterError(f"questions must be a non-empty list of strings, got {questions!r}")
        preprocess = {
            "questions": list(questions) if questions is not None else [question or ""],
            "answer_prefix": answer_prefix,
        }
        forward = {k: v for k, v in kwargs.items() if k in _FORWARD}
        postprocess = {"single_question": questions is None, "return_stats": return_stats}
        return preprocess, forward, postprocess

    def preprocess(self, context: str, questions: list[str], answer_prefix: str | None = None) -> dict:
        # kvtrim tokenizes inside generate (context and questions apart in context-only mode)
        return {"context": context, "questions": questions, "answer_prefix": answer_prefix}

    def _forward(self, inputs: dict, **kwargs: Any) -> dict:
        from .api import generate

        kwargs.setdefault("method", "snapkv")
        kwargs.setdefault("max_new_tokens", 50)
        kwargs.setdefault("prompt_format", "kvpress")
        result = generate(
            self.model,
            self.tokenizer,
            inputs["context"],
            inputs["questions"],
            answer_prefix=inputs["answer_prefix"],
            **kwargs,
        )
        return {"answers": result.answers, "stats": result.stats}

    def postprocess(self, outputs: dict, single_question: bool = True, return_stats: bool = False) -> dict:
        out: dict[str, Any] = {"answer": outputs["answers"][0]} if single_question else {"answers": outputs["answers"]}
        if return_stats:
            out["stats"] = outputs["stats"].as_dict()
        return out


PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=KVTrimTextGenerationPipeline, pt_model=AutoModelForCausalLM)
