"""GGUF metadata read at the door: ``Metadata`` hands out a file's values only after checking the
type each is stored as and that it is a finite number, a string or a list of one element type; a
refusal is a ValueError naming the file, the key and the value. The loaders check ranges and
agreement with the tensors on top (``integrations.gguf``); ``check_tokenizer`` checks the
``tokenizer.*`` values transformers builds a tokenizer from, so that a malformed one is named here
rather than failing inside the conversion.

Stored types, as llama.cpp's reader wants them (it refuses a key of the wrong type): a count or a
token id is an integer (a float would be truncated), a real number a float (an integer is taken as
the number it is), a flag a bool, a name or a template a string, a list an array of one element type.

>>> # meta = Metadata(path, reader.fields)
>>> # layers = meta.integer("bitnet-b1.58.block_count", "the number of layers", least=1)
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np

# gguf.GGUFValueType's ids (the package is optional, and these are the file format's own numbers)
UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32, BOOL, STRING, ARRAY, UINT64, INT64, FLOAT64 = range(13)
INTEGERS = {UINT8, INT8, UINT16, INT16, UINT32, INT32, UINT64, INT64}
REALS = INTEGERS | {FLOAT32, FLOAT64}
TYPE_NAMES = {UINT8: "uint8", INT8: "int8", UINT16: "uint16", INT16: "int16", UINT32: "uint32", INT32: "int32",
              FLOAT32: "float32", BOOL: "bool", STRING: "string", ARRAY: "array", UINT64: "uint64", INT64: "int64",
              FLOAT64: "float64"}
TOKEN_TYPES = range(1, 7)  # gguf.TokenType: NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE
_MISSING = object()
_SPECIAL_ID = re.compile(r"^tokenizer\.ggml\.\w+_token_id$")
TOKENIZER_FLAGS = ("add_bos_token", "add_eos_token", "add_space_prefix")  # tokenizer.ggml.<flag>: bools


def shown(value: Any, limit: int = 60) -> str:
    """``value`` as a refusal shows it: its repr, a long one cut."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _type_name(types: list) -> str:
    """A stored type as messages name it: "float32", "an array of int32"."""
    names = [TYPE_NAMES.get(int(t), f"type {int(t)}") for t in types]
    return " of ".join(("an array" if name == "array" else name) for name in names)


class Metadata:
    """A GGUF file's metadata (``gguf``'s reader fields by key), read with checks. Every getter takes
    ``what`` (what the value is, for messages) and, where the key may be absent, a ``default``;
    without one a missing key is refused."""

    def __init__(self, path: str | Path, fields: dict[str, Any]) -> None:
        self.path, self.fields = Path(path), fields

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def keys(self) -> list[str]:
        return list(self.fields)

    def refuse(self, key: str, value: Any, why: str) -> ValueError:
        """The error for ``key``'s ``value``: the file, the key, the value and why it is refused."""
        return ValueError(f"{self.path}: {key} is {shown(value)}; {why}")

    def _field(self, key: str, what: str) -> Any:
        field = self.fields.get(key)
        if field is None:
            raise ValueError(f"{self.path} has no {key} ({what}) in its metadata: not a complete GGUF model file")
        return field

    def _contents(self, key: str, field: Any) -> Any:
        try:
            return field.contents()
        except UnicodeDecodeError:
            raise ValueError(f"{self.path}: {key} holds bytes that are not UTF-8 text") from None

    def _scalar(self, key: str, what: str, types: set, kind: str) -> Any:
        field = self._field(key, what)
        value = self._contents(key, field)
        if len(field.types) != 1 or int(field.types[0]) not in types:
            raise self.refuse(key, value, f"{what} must be stored as {kind}, not as {_type_name(field.types)}")
        return value

    def string(self, key: str, what: str, default: Any = _MISSING) -> str:
        if default is not _MISSING and key not in self.fields:
            return default
        return self._scalar(key, what, {STRING}, "a string")

    def boolean(self, key: str, what: str, default: Any = _MISSING) -> bool:
        if default is not _MISSING and key not in self.fields:
            return default
        return bool(self._scalar(key, what, {BOOL}, "a bool"))

    def integer(self, key: str, what: str, least: int | None = None, most: int | None = None,
                default: Any = _MISSING) -> int:
        """An integer stored as one, within [least, most] where given."""
        if default is not _MISSING and key not in self.fields:
            return default
        value = int(self._scalar(key, what, INTEGERS, "an integer"))
        if (least is not None and value < least) or (most is not None and value > most):
            bounds = (f"from {least} to {most}" if least is not None and most is not None
                      else f"at least {least}" if least is not None else f"at most {most}")
            raise self.refuse(key, value, f"{what} must be an integer {bounds}")
        return value

    def real(self, key: str, what: str, default: Any = _MISSING) -> float:
        """A finite real number (a float32 as the shortest decimal that is that float32: 1e-05, not
        9.99999975e-06)."""
        if default is not _MISSING and key not in self.fields:
            return default
        value = self._scalar(key, what, REALS, "a number")
        if int(self.fields[key].types[0]) == FLOAT32:
            value = float(str(np.float32(value)))
        value = float(value)
        if not math.isfinite(value):
            raise self.refuse(key, value, f"{what} must be a finite number")
        return value

    def array(self, key: str, what: str, types: set, kind: str) -> list:
        """An array whose elements are stored as one of ``types`` (an empty array: any)."""
        field = self._field(key, what)
        if int(field.types[0]) != ARRAY:
            raise self.refuse(key, self._contents(key, field), f"{what} must be stored as an array of {kind}, "
                                                               f"not as {_type_name(field.types)}")
        if len(field.types) > 2 or (len(field.types) == 2 and int(field.types[1]) not in types):
            raise ValueError(f"{self.path}: {key} ({what}) is stored as {_type_name(field.types)}; it must be an "
                             f"array of {kind}")
        return self._contents(key, field) if len(field.types) == 2 else []

    def length(self, key: str, what: str) -> int:
        """The number of elements of array ``key`` (without reading them)."""
        field = self._field(key, what)
        if int(field.types[0]) != ARRAY:
            raise self.refuse(key, self._contents(key, field), f"{what} must be stored as an array, not as "
                                                               f"{_type_name(field.types)}")
        return len(field.data)

    def token_id(self, key: str, vocab: int, what: str = "a token id") -> int | None:
        """A token id in [0, vocab), None where the key is absent."""
        if key not in self.fields:
            return None
        return self.integer(key, what, least=0, most=vocab - 1)


def check_tokenizer(meta: Metadata) -> None:
    """Refuse ``tokenizer.*`` metadata transformers cannot build a tokenizer from as it is meant: the
    kind and pre-tokenizer names, the tokens (strings), the scores (finite) and token types
    (``TOKEN_TYPES``) one a token, the merges ("a b", both parts and their join tokens), every
    special token id (``tokenizer.ggml.*_token_id``) a token, the flags bools, the chat templates
    strings."""
    T = "tokenizer.ggml."
    meta.string(f"{T}model", "the tokenizer's kind")
    meta.string(f"{T}pre", "the pre-tokenizer's name", None)
    tokens = meta.array(f"{T}tokens", "the vocabulary", {STRING}, "strings")
    if not tokens:
        raise meta.refuse(f"{T}tokens", tokens, "a vocabulary holds at least one token")
    count = len(tokens)
    if f"{T}scores" in meta:
        scores = np.asarray(meta.array(f"{T}scores", "the tokens' scores", REALS, "numbers"), np.float64)
        if len(scores) != count:
            raise ValueError(f"{meta.path}: {T}scores holds {len(scores)} scores for {count} tokens; one a token")
        if not np.isfinite(scores).all():
            bad = int(np.flatnonzero(~np.isfinite(scores))[0])
            raise ValueError(f"{meta.path}: {T}scores gives token {bad} the score {scores[bad]}, not a finite number")
    if f"{T}token_type" in meta:
        types = meta.array(f"{T}token_type", "the tokens' types", INTEGERS, "integers")
        if len(types) != count:
            raise ValueError(f"{meta.path}: {T}token_type holds {len(types)} types for {count} tokens; one a token")
        bad = next((i for i, t in enumerate(types) if t not in TOKEN_TYPES), None)
        if bad is not None:
            raise ValueError(f"{meta.path}: {T}token_type gives token {bad} the type {types[bad]}; the types are "
                             f"{TOKEN_TYPES.start} to {TOKEN_TYPES.stop - 1} (gguf.TokenType)")
    if f"{T}merges" in meta:
        vocabulary = set(tokens)
        for number, merge in enumerate(meta.array(f"{T}merges", "the BPE merges", {STRING}, "strings")):
            parts = merge.split(" ")
            if len(parts) != 2 or not all(parts):
                raise ValueError(f"{meta.path}: {T}merges[{number}] is {shown(merge)}; a merge is two tokens "
                                 "joined by one space")
            missing = next((t for t in (*parts, "".join(parts)) if t not in vocabulary), None)
            if missing is not None:
                raise ValueError(f"{meta.path}: {T}merges[{number}] is {shown(merge)}, but {shown(missing)} is not "
                                 f"one of {T}tokens")
    for key in meta.keys():
        if _SPECIAL_ID.match(key):
            meta.token_id(key, count, "a special token id")
    for flag in TOKENIZER_FLAGS:
        meta.boolean(f"{T}{flag}", "a flag", None)
    if f"{T}precompiled_charsmap" in meta:
        meta.array(f"{T}precompiled_charsmap", "sentencepiece's normaliser", {UINT8, INT8}, "bytes")
    for key in meta.keys():
        if key == "tokenizer.chat_template" or key.startswith("tokenizer.chat_template."):
            meta.string(key, "a chat template")
