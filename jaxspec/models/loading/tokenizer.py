"""Text <-> token ids, chat templates and the exact bytes of each token (for streaming detokenisation).

`TextTokenizer` wraps a `tokenizers.Tokenizer`, built either from a Hugging Face tokenizer.json or
from the byte-level BPE vocabulary a GGUF file carries.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors

from jaxspec.models.loading.errors import ModelLoadError
from jaxspec.models.loading.gguf import GGUFSource, field_value, open_gguf, reader_path
from jaxspec.models.loading.layout import read_json_object
from jaxspec.models.loading.special_tokens import stop_token_ids

# Split patterns of llama.cpp's `tokenizer.ggml.pre` styles, applied before byte-level encoding.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


def _gguf_pre_tokenizer(style: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """(pre-tokenizer, ignore_merges) for a GGUF `tokenizer.ggml.pre` style."""
    if style in ("smollm", "starcoder"):
        # Every digit on its own, then GPT-2's split (as the model's own tokenizer.json does).
        steps = [pre_tokenizers.Digits(individual_digits=True),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        return pre_tokenizers.Sequence(steps), False
    if style == "gpt-2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False
    if style in ("qwen2", "llama-bpe", "llama3", "llama-v3"):
        split = _QWEN2_SPLIT if style == "qwen2" else _LLAMA3_SPLIT
        steps = [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        return pre_tokenizers.Sequence(steps), style != "qwen2"
    raise ModelLoadError(
        f"unsupported GGUF pre-tokenizer style {style!r} (supported: smollm, starcoder, gpt-2, qwen2, llama-bpe)"
    )


def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


# tokenizer_config.json key under which `save` keeps every stop id (transformers ignores it).
_STOP_IDS_KEY = "jaxspec_eos_token_ids"
_CHAR_TO_BYTE = {c: b for b, c in _byte_to_char().items()}
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _compile_chat_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class TextTokenizer:
    """A tokenizer with the extras serving needs: stop ids, chat template, per-token bytes."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
        source: str = "<tokenizer>",
    ) -> None:
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.source = source
        added = tokenizer.get_added_tokens_decoder()
        self._added = {i: t.content for i, t in added.items()}
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._decoder_kind = self._detect_decoder(source)
        self._token_bytes: list[bytes] | None = None
        try:
            self._template = _compile_chat_template(chat_template) if chat_template else None
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(f"{source}: chat template does not parse: {e}") from None

    # --- construction ----------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: GGUFSource) -> TextTokenizer:
        """Rebuild the byte-level BPE tokenizer stored in a GGUF file's metadata (path or open reader)."""
        reader = open_gguf(path)
        source = str(reader_path(reader))
        model = field_value(reader, "tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelLoadError(f"{source}: tokenizer model {model!r} is unsupported (only 'gpt2', byte BPE)")
        tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens") or []
        merges: list[str] = field_value(reader, "tokenizer.ggml.merges") or []
        types: list[int] = field_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        if not tokens or not merges:
            raise ModelLoadError(f"{source}: tokenizer vocabulary or merges missing from metadata")
        if len(types) != len(tokens):
            raise ModelLoadError(f"{source}: {len(types)} token types for {len(tokens)} tokens")
        try:
            pre, ignore_merges = _gguf_pre_tokenizer(str(field_value(reader, "tokenizer.ggml.pre")))
        except ModelLoadError as e:
            raise ModelLoadError(f"{source}: {e}") from None

        vocab: dict[str, int] = {}
        for i, token in enumerate(tokens):
            vocab.setdefault(token, i)  # duplicate spellings (padding entries) keep their first id
        pairs = []
        for merge in merges:
            left, sep, right = merge.partition(" ")
            if not sep:
                raise ModelLoadError(f"{source}: malformed merge {merge!r}")
            pairs.append((left, right))
        tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, pairs, ignore_merges=ignore_merges))
        tok.pre_tokenizer = pre
        tok.decoder = decoders.ByteLevel()
        # llama.cpp token types: 3 = control (special), 4 = user-defined (kept whole, not special).
        kinds = list(zip(tokens, types))
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in kinds if k == 3])
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in kinds if k == 4])

        bos = field_value(reader, "tokenizer.ggml.bos_token_id")
        eos = field_value(reader, "tokenizer.ggml.eos_token_id")
        add_bos = bool(field_value(reader, "tokenizer.ggml.add_bos_token")) and bos is not None
        add_eos = bool(field_value(reader, "tokenizer.ggml.add_eos_token")) and eos is not None
        if add_bos or add_eos:
            before, after = [bos] if add_bos else [], [eos] if add_eos else []
            single = " ".join([*(tokens[i] for i in before), "$A", *(tokens[i] for i in after)])
            specials = [(tokens[i], i) for i in dict.fromkeys(before + after)]
            tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
        template = field_value(reader, "tokenizer.chat_template")
        return cls(
            tok,
            bos_token_id=bos,
            eos_token_ids=stop_token_ids([eos], template, tok.token_to_id),
            chat_template=template,
            source=source,
        )

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str]) -> TextTokenizer:
        """tokenizer.json, with tokenizer_config.json, chat_template.jinja, generation_config.json if there."""
        d = Path(directory)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{d}: no tokenizer.json")
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the Rust binding raises a bare Exception for any bad file
            raise ModelLoadError(f"{path}: not a readable tokenizer.json ({e})") from None
        config = _read_json(d / "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")

        def token_id(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if value is None:
                return None
            i = tok.token_to_id(value)
            if i is None:
                raise ModelLoadError(f"{d}: {key} {value!r} is not in the vocabulary")
            return i

        generation = _read_json(d / "generation_config.json").get("eos_token_id")
        extra_eos = (generation if isinstance(generation, list) else [generation]) + config.get(_STOP_IDS_KEY, [])
        return cls(
            tok,
            bos_token_id=token_id("bos_token"),
            eos_token_ids=stop_token_ids([token_id("eos_token"), *extra_eos], template, tok.token_to_id),
            chat_template=template,
            source=str(d),
        )

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write tokenizer.json and tokenizer_config.json (readable by `from_dir` and transformers)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(d / "tokenizer.json"))
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        if self.bos_token_id is not None:
            config["bos_token"] = self._tok.id_to_token(self.bos_token_id)
        if self.eos_token_ids:
            config["eos_token"] = self._tok.id_to_token(self.eos_token_ids[0])
        if self.chat_template:
            config["chat_template"] = self.chat_template
        config[_STOP_IDS_KEY] = list(self.eos_token_ids)
        text = json.dumps(config, indent=2, ensure_ascii=False)
        (d / "tokenizer_config.json").write_text(text, encoding="utf-8")

    # --- text <-> ids ----------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows (the model's embedding may have more rows)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in it (e.g. <|im_start|>) map to their ids."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's jinja chat template (sandboxed)."""
        if self._template is None:
            raise ValueError(f"{self.source}: tokenizer has no chat template")
        bos = self._tok.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self._tok.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos,
                **kwargs,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template failed: {e}") from None

    # --- token bytes (for streaming detokenisation) ----------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes token `token_id` contributes to decoded text (may be part of a UTF-8 character)."""
        if self._token_bytes is None:
            self._token_bytes = [self._bytes_of(i) for i in range(self.vocab_size)]
        return self._token_bytes[token_id]

    def _detect_decoder(self, source: str) -> str:
        spec = json.loads(self._tok.decoder.__getstate__()) if self._tok.decoder is not None else {}
        kinds = [spec.get("type")] + [d.get("type") for d in spec.get("decoders", [])]
        if "ByteLevel" in kinds:
            return "byte_level"
        if "Metaspace" in kinds or ("Replace" in kinds and "ByteFallback" in kinds):
            return "metaspace"
        kind = spec.get("type")
        raise ModelLoadError(f"{source}: unsupported tokenizer decoder {kind!r} (need ByteLevel or Metaspace)")

    def _bytes_of(self, i: int) -> bytes:
        if i in self._added:
            return self._added[i].encode("utf-8")
        token = self._tok.id_to_token(i)
        if token is None:
            return b""
        if self._decoder_kind == "byte_level":
            if all(c in _CHAR_TO_BYTE for c in token):
                return bytes(_CHAR_TO_BYTE[c] for c in token)
            return token.encode("utf-8")  # what tokenizers' ByteLevel decoder does with such tokens
        match = _BYTE_PIECE.fullmatch(token)
        if match:
            return bytes([int(match.group(1), 16)])
        return token.replace("\u2581", " ").encode("utf-8")


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path) if path.is_file() else {}
