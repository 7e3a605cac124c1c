"""Tokenizers: an offline byte-level one and a wrapper over a Hugging Face `tokenizer.json`.

Both register GLM's special tokens (role markers, thinking and tool-call tags) at construction, so the
vocabulary size is fixed before a model is built. Plain `encode` never turns marker strings typed in
user text into special ids (`allow_special=True` opts in), so a message cannot inject a role marker.
"""

from __future__ import annotations

import os
import re
from typing import Protocol, Sequence, runtime_checkable

# The GLM-4.5 / GLM-5 special tokens of the chat format, in a fixed order: ByteTokenizer ids 256.. follow it.
GLM_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<tool_response>",
    "</tool_response>",
)
END_OF_TEXT = "<|endoftext|>"
# GLM has no end-of-turn token: generation stops at the end of text or at the next role marker.
STOP_TOKENS = (END_OF_TEXT, "<|user|>", "<|observation|>")

NUM_BYTES = 256


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipelines need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def eos_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]: ...

    def encode_with_offsets(
        self, text: str, *, allow_special: bool = False
    ) -> tuple[list[int], list[tuple[int, int]]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def special_token_id(self, name: str) -> int | None: ...

    def add_special_tokens(self, names: Sequence[str]) -> list[int]: ...


def _check_text(text: object) -> str:
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    return text


def _check_names(names: Sequence[str]) -> list[str]:
    if isinstance(names, str):
        raise ValueError(f"names must be a sequence of strings, got the single string {names!r}")
    names = list(names)
    for name in names:
        if not isinstance(name, str) or not name:
            raise ValueError(f"special token names must be non-empty strings, got {name!r}")
    return names


def _stop_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    return tuple(tokenizer.special_token_id(name) for name in STOP_TOKENS)


class _SpecialTokenLookup:
    """What both tokenizers share: lookups in their `_special_ids` map (name -> id), and `encode` as the ids
    of their own `encode_with_offsets`."""

    _special_ids: dict[str, int]

    @property
    def eos_id(self) -> int:
        return self._special_ids[END_OF_TEXT]

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return _stop_ids(self)

    def special_token_id(self, name: str) -> int | None:
        return self._special_ids.get(name)

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        return self.encode_with_offsets(text, allow_special=allow_special)[0]


class ByteTokenizer(_SpecialTokenLookup):
    """UTF-8 bytes as ids 0..255; special tokens get ids from 256 in registration order."""

    def __init__(self, extra_special_tokens: Sequence[str] = ()):
        self._special_ids: dict[str, int] = {}
        self._special_names: list[str] = []
        self.add_special_tokens(GLM_SPECIAL_TOKENS)
        self.add_special_tokens(extra_special_tokens)

    @property
    def vocab_size(self) -> int:
        return NUM_BYTES + len(self._special_names)

    def add_special_tokens(self, names: Sequence[str]) -> list[int]:
        """Registers names not yet known (new ids appended); returns the id of every name."""
        names = _check_names(names)
        for name in names:
            if name not in self._special_ids:
                self._special_ids[name] = NUM_BYTES + len(self._special_names)
                self._special_names.append(name)
        # Longest first, so a special that contains another one wins the match.
        alternatives = sorted(self._special_names, key=len, reverse=True)
        self._special_pattern = re.compile("|".join(re.escape(name) for name in alternatives))
        return [self._special_ids[name] for name in names]

    def encode_with_offsets(
        self, text: str, *, allow_special: bool = False
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids and, per id, the [start, end) character span of `text` it came from."""
        text = _check_text(text)
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []

        def add_plain(start: int, end: int) -> None:
            for position in range(start, end):
                for byte in text[position].encode("utf-8"):
                    ids.append(byte)
                    offsets.append((position, position + 1))

        cursor = 0
        if allow_special:
            for match in self._special_pattern.finditer(text):
                add_plain(cursor, match.start())
                ids.append(self._special_ids[match.group()])
                offsets.append((match.start(), match.end()))
                cursor = match.end()
        add_plain(cursor, len(text))
        return ids, offsets

    def decode(self, ids: Sequence[int]) -> str:
        pieces: list[str] = []
        pending = bytearray()
        for token in ids:
            token = int(token)
            if 0 <= token < NUM_BYTES:
                pending.append(token)
                continue
            if not NUM_BYTES <= token < self.vocab_size:
                raise ValueError(f"token id {token} is outside the vocabulary [0, {self.vocab_size})")
            pieces.append(pending.decode("utf-8", errors="replace"))
            pending = bytearray()
            pieces.append(self._special_names[token - NUM_BYTES])
        pieces.append(pending.decode("utf-8", errors="replace"))
        return "".join(pieces)


class HFTokenizer(_SpecialTokenLookup):
    """A Hugging Face `tokenizer.json` via the `tokenizers` package; GLM specials it lacks are added."""

    def __init__(self, path: str | os.PathLike, extra_special_tokens: Sequence[str] = ()):
        try:
            from tokenizers import Tokenizer as _RustTokenizer
        except ImportError as error:
            raise ImportError(
                "HFTokenizer needs the `tokenizers` package (pip install tokenizers); "
                "use load_tokenizer('byte') for the offline byte tokenizer"
            ) from error
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ValueError(f"tokenizer file {path!r} does not exist; pass a path to a tokenizer.json")
        self.path = path
        # Two copies with identical vocabularies: one splits out special tokens, one encodes them as text.
        self._with_specials = _RustTokenizer.from_file(path)
        self._plain = _RustTokenizer.from_file(path)
        self._plain.encode_special_tokens = True
        self._special_ids: dict[str, int] = {}
        self.add_special_tokens(GLM_SPECIAL_TOKENS)
        self.add_special_tokens(extra_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._with_specials.get_vocab_size(with_added_tokens=True)

    def add_special_tokens(self, names: Sequence[str]) -> list[int]:
        """Adds names that are not special tokens yet; existing ones keep the tokenizer's own ids."""
        names = _check_names(names)
        missing = [name for name in names if name not in self._special_ids]
        if missing:
            self._with_specials.add_special_tokens(missing)
            self._plain.add_special_tokens(missing)
            self._special_ids = {
                token.content: token_id
                for token_id, token in self._with_specials.get_added_tokens_decoder().items()
                if token.special
            }
        return [self._special_ids[name] for name in names]

    def encode_with_offsets(
        self, text: str, *, allow_special: bool = False
    ) -> tuple[list[int], list[tuple[int, int]]]:
        text = _check_text(text)
        backend = self._with_specials if allow_special else self._plain
        encoding = backend.encode(text, add_special_tokens=False)
        return list(encoding.ids), [tuple(span) for span in encoding.offsets]

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(token) for token in ids]
        for token in ids:
            if not 0 <= token < self.vocab_size:
                raise ValueError(f"token id {token} is outside the vocabulary [0, {self.vocab_size})")
        return self._with_specials.decode(ids, skip_special_tokens=False)


def load_tokenizer(spec: str | os.PathLike) -> ByteTokenizer | HFTokenizer:
    """`"byte"` for the offline byte tokenizer, or a path to a `tokenizer.json` (or a folder holding one)."""
    if spec == "byte":
        return ByteTokenizer()
    if not isinstance(spec, (str, os.PathLike)):
        raise ValueError(f"tokenizer spec must be 'byte' or a path to a tokenizer.json, got {spec!r}")
    path = os.fspath(spec)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"tokenizer {os.fspath(spec)!r}: no tokenizer.json at {path!r}; "
            "pass 'byte' or the path of an existing tokenizer.json"
        )
    return HFTokenizer(path)
