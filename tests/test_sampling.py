"""Sampling in kvtrim.generate / Session.run: seeds, GenerationConfig, the model's own config, stop strings."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

import kvtrim
from conftest import random_text
from kvtrim.errors import InvalidParameterError

CTX = random_text(80, seed=5)
Q = "What comes next?"


def _answer(model, tokenizer, **kwargs):
    kwargs.setdefault("max_new_tokens", 12)
    return kvtrim.generate(model, tokenizer, CTX, Q, **kwargs).answers[0]


def test_same_seed_same_tokens_and_seeds_differ(llama, tokenizer):
    a = _answer(llama, tokenizer, ratio=0.5, do_sample=True, seed=7)
    assert a == _answer(llama, tokenizer, ratio=0.5, do_sample=True, seed=7)
    others = {_answer(llama, tokenizer, ratio=0.5, do_sample=True, seed=s) for s in range(4)}
    assert len(others) > 1  # sampling really samples


def test_greedy_is_the_default(llama, tokenizer):
    assert llama.generation_config.do_sample in (None, False)
    assert _answer(llama, tokenizer, ratio=0.5) == _answer(llama, tokenizer, ratio=0.5, do_sample=False)


def _hf_sampled(model, tokenizer, seed, **kwargs):
    ids = tokenizer(CTX + "\n\n" + Q, return_tensors="pt")["input_ids"]
    torch.manual_seed(seed)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, **kwargs)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


@pytest.mark.parametrize("settings", [{"do_sample": True}, {"do_sample": True, "temperature": 0.7, "top_p": 0.9}])
def test_full_cache_sampling_equals_model_generate(llama, tokenizer, settings):
    ours = _answer(llama, tokenizer, method="full", question_aware=True, seed=11, **settings)
    assert ours == _hf_sampled(llama, tokenizer, 11, **settings)


def test_generation_config_and_the_models_config_are_honoured(llama, tokenizer, monkeypatch):
    config = GenerationConfig(do_sample=True, top_k=20, temperature=1.3)
    ours = _answer(llama, tokenizer, method="full", question_aware=True, generation_config=config, seed=3)
    assert ours == _hf_sampled(llama, tokenizer, 3, do_sample=True, top_k=20, temperature=1.3)
    # a model whose own generation config samples is sampled from, as model.generate does
    monkeypatch.setattr(llama, "generation_config", GenerationConfig(do_sample=True, top_k=20, temperature=1.3))
    assert _answer(llama, tokenizer, method="full", question_aware=True, seed=3) == ours


def test_max_new_tokens_from_generation_config(llama, tokenizer):
    config = GenerationConfig(max_new_tokens=3)
    result = kvtrim.generate(llama, tokenizer, CTX, Q, method="full", generation_config=config)
    assert result.stats.decode_tokens <= 2  # 3 tokens: the first comes from the prompt's logits


def test_stop_strings_cut_the_answer(llama, tokenizer):
    full = _answer(llama, tokenizer, ratio=0.5, max_new_tokens=16)
    assert len(full) > 4
    stop = full[2:4]
    cut = _answer(llama, tokenizer, ratio=0.5, max_new_tokens=16, stop=[stop, "\u2603never"])
    assert cut == full[: full.index(stop)].strip()


def test_session_run_takes_sampling(llama, tokenizer):
    session = kvtrim.Session(llama, tokenizer, CTX, methods=["snapkv"])
    a = session.run("snapkv", ratio=0.5, questions=Q, do_sample=True, seed=1, max_new_tokens=8)
    b = session.run("snapkv", ratio=0.5, questions=Q, do_sample=True, seed=1, max_new_tokens=8)
    assert a.answers == b.answers


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": 0}, r"temperature must be a number in \(0"),
        ({"top_p": 1.5}, r"top_p must be a number in \(0.0, 1.0\]"),
        ({"top_k": -1}, "top_k must be a non-negative integer"),
        ({"seed": -3}, "seed must be a non-negative integer"),
        ({"do_sample": "yes"}, "do_sample must be True or False"),
        ({"stop": [""]}, "stop must be a non-empty string"),
        ({"generation_config": {"do_sample": True}}, "generation_config must be a transformers.GenerationConfig"),
        ({"generation_config": GenerationConfig(num_beams=2)}, "num_beams=2 is not supported"),
        ({"max_new_tokens": 0}, "max_new_tokens must be a positive integer"),
    ],
)
def test_bad_sampling_settings_raise(llama, tokenizer, kwargs, match):
    with pytest.raises(InvalidParameterError, match=match):
        kvtrim.generate(llama, tokenizer, CTX, Q, ratio=0.5, **kwargs)


def test_a_resolved_sampling_is_used_once_per_generation(llama, tokenizer):
    """generate resolves the settings once; question-aware prompts each restart the seeded sampler."""
    from kvtrim.sampling import build_sampling

    settings = {"do_sample": True, "seed": 5, "max_new_tokens": 6}
    qa = kvtrim.generate(llama, tokenizer, CTX, ["one?", "one?"], ratio=0.5, question_aware=True, **settings)
    assert qa.answers[0] == qa.answers[1]  # same prompt, sampler restarted from the seed: same answer
    session = kvtrim.Session(llama, tokenizer, CTX, methods=["snapkv"])
    sampling = build_sampling(llama, tokenizer, **settings)
    via_object = session.run("snapkv", ratio=0.5, questions="one?", sampling=sampling.fresh())
    via_settings = session.run("snapkv", ratio=0.5, questions="one?", **settings)
    assert via_object.answers == via_settings.answers
    with pytest.raises(InvalidParameterError, match="either sampling= or the decoding settings"):
        session.run("snapkv", ratio=0.5, questions="one?", sampling=sampling, seed=5)
