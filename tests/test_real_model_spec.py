"""Speculation on the default model is lossless: prompt lookup and a draft vs plain decoding."""

from __future__ import annotations

import pytest

from jaxspec.engine.build import build_model, truncated_copy
from jaxspec.engine.engine import Engine
from jaxspec.menu import Menu
from jaxspec.speculation.proposers.draft_model import DraftModelProposer
from jaxspec.speculation.proposers.prompt_lookup import PromptLookupProposer
from tests.conftest import decode

pytestmark = pytest.mark.slow

CONFIG = Menu(num_slots=2, max_len=256, batch_buckets=(2,), k_menu=(0, 3), window_buckets=(256,),
                      prefill_buckets=(128,))
PROMPTS = [
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
    "Write a Python function that returns the sum of a list of numbers.",
]
N_NEW = 24


@pytest.fixture(scope="module")
def default_model():
    return build_model(None)


def test_prompt_lookup_and_draft_equal_plain_decoding(default_model):
    tok = default_model.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]
    draft = truncated_copy(default_model.model, 4)
    results = {}
    for name, proposer in (("ngram", PromptLookupProposer()), ("draft", DraftModelProposer(draft))):
        engine = Engine(default_model.model, proposer, CONFIG)
        engine.warmup(progress=False)
        results[name, 0] = decode(engine, prompts, 0, N_NEW)[0]
        results[name, 3] = decode(engine, prompts, 3, N_NEW)[0]
    plain = results["ngram", 0]
    for key, outputs in results.items():
        assert outputs == plain, key
