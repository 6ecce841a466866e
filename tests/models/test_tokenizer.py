"""TextTokenizer: GGUF rebuild, HF parity, chat templates, streaming bytes."""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import AddedToken, decoders, pre_tokenizers

from jaxspec.models.loading import ModelLoadError, TextTokenizer
from jaxspec.models.loading.tokenizer import _byte_to_char
from jaxspec.scheduling.detokenizer import IncrementalDetokenizer
from tests.models.conftest import default_gguf_path

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\n\nnewlines  ",
    "I'm sure they'll say it's fine, don't you? We've seen it.",
    "Café naïve résumé 你好，世界！ Россия 한국어 مرحبا",
    "Emoji: 😀👍🏽🇺🇸 and ❤️",
    "def foo(x):\n    return x ** 2\n",
    "Numbers 12345 and 3.14159 and 1,000,000; x 2023-01-01",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "\u00a0nbsp\u200bzero width",
]


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.from_gguf(default_gguf_path())


def tiny_tokenizer(chat_template: str | None = None) -> TextTokenizer:
    """Byte-level BPE over the 256 byte symbols, no merges, two chat specials."""
    vocab = {c: i for i, c in enumerate(_byte_to_char().values())}
    t = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, []))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    return TextTokenizer(t, bos_token_id=None, eos_token_ids=(257,), chat_template=chat_template)


def test_default_tokenizer_properties(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (2,)  # <|im_end|>: both the GGUF eos and the chat end token
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("Hello") == tok.encode("Hello", add_special_tokens=False)  # add_bos_token is false
    assert 2 in tok.special_token_ids and 0 in tok.special_token_ids


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")


def test_digits_split_individually(tok):
    # The 'smollm' pre-tokenizer (SmolLM2's tokenizer.json and llama.cpp) isolates every digit before
    # GPT-2's split, so "a  1" keeps its two spaces together: a, ĠĠ, 1.
    assert [tok.id_to_token(i) for i in tok.encode("a  1")] == ["a", "ĠĠ", "1"]
    assert [tok.id_to_token(i) for i in tok.encode("x12")] == ["x", "1", "2"]


def test_chat_template(tok):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    prompt = tok.apply_chat_template(messages)
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")
    system = [{"role": "system", "content": "Be brief."}, *messages]
    assert tok.apply_chat_template(system).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def test_token_bytes_stream_matches_decode(tok):
    text = "Emoji: 😀👍🏽🇺🇸 and 你好 — done."
    ids = tok.encode("<|im_start|>" + text)
    stream = IncrementalDetokenizer(tok)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.finish() == text == tok.decode(ids)
    assert "" in pieces[1:]  # some tokens end inside a multi-byte character
    assert b"".join(tok.token_bytes(i) for i in ids[1:]) == text.encode("utf-8")
    assert tok.token_bytes(tok.token_to_id("Ġ")) == b" "


def test_save_and_from_dir(tok, tmp_path):
    tok.save(tmp_path)
    again = TextTokenizer.from_dir(tmp_path)
    assert again.vocab_size == tok.vocab_size
    assert (again.bos_token_id, again.eos_token_ids) == (tok.bos_token_id, tok.eos_token_ids)
    assert again.chat_template == tok.chat_template
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)


def test_matches_transformers_gguf_tokenizer(tok):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = default_gguf_path()
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        assert tok.encode(text) == reference.encode(text), text
    messages = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Bye"}]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == expected
    assert reference.eos_token_id in tok.eos_token_ids


def test_template_helpers_and_sandbox():
    t = tiny_tokenizer("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
                       "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                       "{% endfor %}"
                       "{{ messages | tojson }}")
    out = t.apply_chat_template([{"role": "user", "content": "héllo"}])
    assert out.startswith("<|im_start|>user\nhéllo<|im_end|>\n") and '"héllo"' in out
    with pytest.raises(ValueError, match="user first"):
        t.apply_chat_template([{"role": "assistant", "content": "x"}])
    unsafe = tiny_tokenizer("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="chat template failed"):
        unsafe.apply_chat_template([])
    with pytest.raises(ValueError, match="no chat template"):
        tiny_tokenizer().apply_chat_template([])


def test_token_bytes_stream_holds_partial_characters():
    t = tiny_tokenizer()
    ids = t.encode("é<|im_end|>")
    assert len(ids) == 3  # two byte tokens for é, then the special
    stream = IncrementalDetokenizer(t)
    assert [stream.push(i) for i in ids] == ["", "é", ""]
    keep = IncrementalDetokenizer(t, skip_special_tokens=False)
    assert "".join(keep.push(i) for i in ids) == "é<|im_end|>"
    cut = IncrementalDetokenizer(t)
    assert cut.push(ids[0]) == "" and cut.finish() == "\ufffd"


def test_tokenizer_load_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        TextTokenizer.from_gguf(tmp_path / "absent.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        TextTokenizer.from_gguf(tmp_path / "junk.gguf")
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        TextTokenizer.from_dir(tmp_path)
    with pytest.raises(ModelLoadError, match="chat template does not parse"):
        tiny_tokenizer("{% for m in messages %}")


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe", "gpt-2"])
def test_from_gguf_other_styles(tmp_path, pre):
    import gguf

    byte_tokens = list(_byte_to_char().values())
    tokens = [*byte_tokens, "he", "hel", "<|endoftext|>", "<|im_end|>", "<think>"]
    types = [1] * len(byte_tokens) + [1, 1, 3, 3, 4]
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["h e", "he l"])
    w.add_bos_token_id(256 + 2)
    w.add_eos_token_id(256 + 2)
    w.add_add_bos_token(True)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = TextTokenizer.from_gguf(tmp_path / "t.gguf")
    end, im_end, think = 258, 259, 260
    assert t.eos_token_ids == (end, im_end)
    ids = t.encode("help<think>")
    assert ids == [end, 257, byte_tokens.index("p"), think]  # bos, "hel", "p", user-defined token kept whole
    assert t.decode(ids) == "help<think>"  # <think> is not special, so it stays
    assert t.encode("help", add_special_tokens=False) == [257, byte_tokens.index("p")]


def test_split_patterns_match_transformers():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    try:  # private names of transformers 5.x
        from transformers.integrations.gguf.gguf_tokenizer_mapping import _LLAMA3_SPLIT
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
    except ImportError:
        pytest.skip("this transformers version keeps its split patterns elsewhere")

    from jaxspec.models.loading import tokenizer as module

    assert module._QWEN2_SPLIT == PRETOKENIZE_REGEX
    assert module._LLAMA3_SPLIT == _LLAMA3_SPLIT
