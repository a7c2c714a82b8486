"""Fixtures for the evaluation-data tests: a small BPE tokenizer trained offline, and the jargon haystack."""

from __future__ import annotations

import random
import shutil
import string

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from kvtrim.eval.haystacks import _JARGON_INSTALLED, NOISE_BLOCK, HaystackUnavailableError, get_haystack

_ENGLISH = (
    "The quick brown fox jumps over the lazy dog. A special magic number is hidden within the following "
    "text. Make sure to memorize it. I will quiz you about the numbers afterwards. What are all the special "
    "magic words for the key mentioned in the provided text? Answer the question based on the given "
    "documents. Only give me the answer and do not output any other words. The following are given "
    "documents. Question: Find all variables that are assigned the value in the text above. Below is a "
    "numbered list of words. In these words, some appear more often than others. Memorize the ones that "
    "appear most often. Read the following coded text and track the frequency of each coded word. "
    "There is an important info hidden inside a lot of irrelevant text. The pass key is. Remember it. "
    "This is a very long story book. Based on the content of the book. The best thing to do in San "
    "Francisco is eat a sandwich and sit in Dolores Park on a sunny day. Hackers write programs and "
    "systems; the network and the computer were used by people at the university for years. "
)


def _training_corpus() -> list[str]:
    from wonderwords import random_word

    rng = random.Random(0)
    words: list[str] = []
    for kind in ("noun", "adjective", "verb"):
        words += random_word._get_words_from_text_file(f"{kind}list.txt")
    lines = [NOISE_BLOCK] * 50 + [_ENGLISH] * 50
    for _ in range(300):
        lines.append(" ".join(rng.sample(words, 30)))
        lines.append(" ".join(str(rng.randint(0, 10**7)) for _ in range(10)))
        lines.append(" ".join("".join(rng.choices(string.ascii_uppercase, k=5)) for _ in range(10)))
    return lines


def build_bpe_tokenizer(vocab_size: int = 3000) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained in about a second on templates, noise, wonderwords words and numbers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="session")
def bpe_tokenizer() -> PreTrainedTokenizerFast:
    return build_bpe_tokenizer()


def jargon_provisioning_possible() -> bool:
    """Provisioning needs either the installed package file or apt-get + dpkg-deb."""
    return _JARGON_INSTALLED.is_file() or (shutil.which("apt-get") is not None and shutil.which("dpkg-deb") is not None)


@pytest.fixture(scope="session")
def jargon_text() -> str:
    """The jargon haystack from the kvtrim home (provisioned on first use)."""
    if not jargon_provisioning_possible():
        pytest.skip("jargon haystack cannot be provisioned here: no apt-get/dpkg-deb and dict-jargon not installed")
    try:
        return get_haystack("jargon")
    except HaystackUnavailableError as exc:  # apt exists but failed: that is a real failure
        pytest.fail(f"jargon provisioning failed although apt-get is available: {exc}")
