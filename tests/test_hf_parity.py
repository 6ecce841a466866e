"""Parity with Hugging Face transformers on the same weights (an implementation nobody here wrote).

The default model's GGUF is loaded by both: logits for prompts of ≥ 64 tokens agree to
max|Δ| ≤ 1e-3 · max|logit|, and 32-token greedy continuations (through our engine) are identical.
A safetensors export of our params loads in transformers with the same logits.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxspec.engine.engine import Engine  # noqa: E402
from jaxspec.menu import Menu  # noqa: E402
from jaxspec.models.config import TINY_QWEN  # noqa: E402
from jaxspec.models.llama import random_model, serving_layers, to_hf_state_dict  # noqa: E402
from jaxspec.models.loading import resolve_model, write_safetensors_dir  # noqa: E402
from jaxspec.types import SamplingParams  # noqa: E402

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden press adapted from wine making. Within fifty years "
    "presses operated in more than two hundred cities across Europe, and the price of books fell sharply. "
    "Historians argue about the consequences of this change for religion, science and politics, but most "
    "agree that the spread of cheap printed pamphlets transformed public debate because",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number using an iterative loop.\"\"\"\n"
    "    if n < 0:\n        raise ValueError('n must be non-negative')\n    a, b = 0, 1\n"
    "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\ndef is_prime(n):\n"
    "    \"\"\"Return True when n is a prime number, checking divisors up to the square root.\"\"\"\n",
    "Photosynthesis is the process by which green plants, algae and some bacteria convert light energy into "
    "chemical energy. During the light-dependent reactions, water molecules are split, releasing oxygen, "
    "while the Calvin cycle fixes carbon dioxide into sugars that the plant uses for growth, repair and "
    "long-term storage in roots and seeds. "
    "In summary, the three main stages are",
]


@pytest.fixture(scope="module")
def pair():
    from jaxspec.engine.build import build_model
    path = resolve_model(None).path
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=torch.float32)
    return build_model(None), hf.eval()


@pytest.mark.slow
def test_logits_and_greedy_match_transformers(pair):
    ours, hf = pair
    tok = ours.tokenizer
    engine = Engine(ours.model, None, Menu(num_slots=1, max_len=256, batch_buckets=(1,), k_menu=(0,),
                                                   window_buckets=(256,), prefill_buckets=(128,)))
    engine.warmup(progress=False)
    graphdef, params = nnx.split(ours.model)  # the streamed model's serving layers run unrolled, jitted once
    forward = jax.jit(lambda p, layers, tokens: nnx.merge(graphdef, p)(tokens, layers=layers))
    layers = serving_layers(ours.model)
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        assert len(ids) >= 64
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].numpy()  # [T, V]
        mine = np.asarray(forward(params, layers, np.asarray([ids], np.int32))[0])  # [T, V]
        assert np.abs(mine - ref).max() <= 1e-3 * np.abs(ref).max()
        with torch.no_grad():
            hf_out = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32)
        expected = hf_out[0, len(ids):].tolist()
        out = [engine.prefill(0, ids, SamplingParams())]
        while len(out) < 32:
            out += engine.step([0], 0).row_tokens(0)
        assert out[:32] == expected


def test_safetensors_export_loads_in_transformers(tmp_path):
    model = random_model(TINY_QWEN, seed=2)
    write_safetensors_dir(tmp_path, TINY_QWEN, to_hf_state_dict(model))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.float32).eval()
    tokens = np.arange(20, dtype=np.int32)[None, :] % TINY_QWEN.vocab_size
    with torch.no_grad():
        ref = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    mine = np.asarray(model(tokens))
    assert np.abs(mine - ref).max() <= 1e-4 * np.abs(ref).max()
