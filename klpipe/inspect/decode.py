"""Token ids back into text, token by token, through the `tokenizers` library alone (no transformers, no torch).

Faithful to what the model saw: a token's text is what it adds to the text before it, the decode of a few
tokens of context with it minus the decode of that context without it. So a byte-level `Ġthe` is " the",
a SentencePiece `▁the` gets its space exactly where the decoder writes one (never dropped for being first
in the response: the prompt's last tokens are the context), special tokens are themselves (`<bos>`), and a
newline is a newline. A token holding only part of a multi-byte character adds no text of its own: it is
marked partial and shown as its vocabulary piece, and the character goes to the token that completes it.

A tokenizer named by a hub id is read from the local Hugging Face cache when HF_HUB_OFFLINE is set, as
huggingface_hub does; a local directory or file is read from disk and never sends a request.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from klpipe.errors import InputError, KlpipeError, first_line

# Tokens of context each token is decoded in: a UTF-8 character spans at most 4 byte tokens (3 before the
# one that completes it), and the decoders' other look-backs (a SentencePiece space, a WordPiece `##`) one.
CONTEXT = 4
TOKENIZER_FILE = "tokenizer.json"
REPLACEMENT = "\ufffd"  # what a decoder writes for the bytes of a character it has not seen whole


class MissingTokenizersError(KlpipeError):
    """The `tokenizers` library, which klpipe inspect decodes with, is not installed."""


@dataclass
class Tokens:
    """One sequence's tokens as the page shows them."""

    texts: list[str]  # (tokens,) the text each token adds; "" for a partial one
    partial: np.ndarray  # (tokens,) bool: part of a multi-byte character completed by a later token


class Decoder:
    """A `tokenizers.Tokenizer` and where it came from."""

    def __init__(self, tokenizer, source: str, fingerprint: str) -> None:
        self.tokenizer = tokenizer
        self.source = source  # the directory, file or hub id it was loaded from
        self.fingerprint = fingerprint  # sha256 of the tokenizer.json read
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
        self.byte_level = _is_byte_level(json.loads(tokenizer.to_str()).get("decoder"))

    def piece_bytes(self, token_id: int) -> str:
        """A byte-level piece's bytes in hex (`Ã` is "c3"), "" for other tokenizers: what a partial token holds."""
        piece = self.piece(token_id)
        if not self.byte_level or any(c not in _BYTE_OF for c in piece):
            return ""
        return " ".join(f"{_BYTE_OF[c]:02x}" for c in piece)

    @functools.lru_cache(maxsize=1 << 18)  # noqa: B019 - one decoder a run; a page asks for each id many times
    def piece(self, token_id: int) -> str:
        """The vocabulary's own string for a token (`Ġthe`, `▁the`, `<0x0A>`)."""
        return self.tokenizer.id_to_token(int(token_id))

    def check_covers(self, ids: np.ndarray, where: str) -> None:
        """Refuse ids the vocabulary does not have: the wrong tokenizer would decode into nonsense silently."""
        unique = np.unique(ids)
        bad = unique[(unique < 0) | (unique >= self.vocab_size)]
        if not len(bad):
            bad = [i for i in unique.tolist() if self.tokenizer.id_to_token(i) is None]
        if len(bad):
            raise InputError(f"{where}: token id {int(bad[0])} is not in the vocabulary of the tokenizer from "
                             f"{self.source} ({self.vocab_size} tokens); pass the tokenizer the rows were made "
                             "with (--tokenizer)")

    def decode(self, context: np.ndarray, ids: np.ndarray) -> Tokens:
        """The texts of `ids`, each decoded after the ones before it, the first after `context`'s last tokens."""
        lead = [int(i) for i in context[-CONTEXT:]]
        whole = lead + [int(i) for i in ids]
        first = len(lead)
        windows = [(max(0, i - CONTEXT), i) for i in range(first, len(whole))]
        decode = self.tokenizer.decode_batch
        with_token = decode([whole[start:i + 1] for start, i in windows], skip_special_tokens=False)
        without = decode([whole[start:i] for start, i in windows], skip_special_tokens=False)
        texts: list[str] = []
        partial = np.zeros(len(ids), dtype=bool)
        for k, (after, before) in enumerate(zip(with_token, without, strict=True)):
            # A character left incomplete before this token may be completed by it: compare without it.
            stem = before.rstrip(REPLACEMENT)
            if after.startswith(stem):
                text = after[len(stem):]
            else:  # a decoder that rewrites what came before (none known): the token's own decode
                text = self.tokenizer.decode([int(ids[k])], skip_special_tokens=False)
            if text.endswith(REPLACEMENT) and self.piece(ids[k]) != REPLACEMENT:
                # It starts a character a later token completes: that one shows it.
                text = text.rstrip(REPLACEMENT)
                partial[k] = not text
            texts.append(text)
        return Tokens(texts, partial)


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte, as the ByteLevel decoder reads it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_alphabet()


def _is_byte_level(decoder: dict | None) -> bool:
    if not decoder:
        return False
    return decoder.get("type") == "ByteLevel" or any(_is_byte_level(d) for d in decoder.get("decoders") or [])


def require_tokenizers() -> None:
    """Refuse to start without the tokenizers library (the light install has none), before reading anything."""
    import importlib.util

    if importlib.util.find_spec("tokenizers") is None:
        raise MissingTokenizersError("klpipe inspect decodes tokens with the tokenizers library: "
                                     "pip install 'klpipe[inspect]'")


def load_decoder(name: str, revision: str | None = None) -> Decoder:
    """The tokenizer of a directory (its tokenizer.json), a tokenizer.json file, or a hub id at `revision`."""
    require_tokenizers()
    from tokenizers import Tokenizer

    path = tokenizer_file(name, revision)
    try:
        raw = path.read_bytes()
        tokenizer = Tokenizer.from_str(raw.decode())
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exceptions for a file it cannot parse
        raise InputError(f"{path}: not a tokenizers file ({first_line(exc)})") from None
    return Decoder(tokenizer, name, hashlib.sha256(raw).hexdigest())


def looks_like_path(name: str) -> bool:
    """A name no hub id can be: absolute, relative to `.` or `~`, or with more than one `/`."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name


def tokenizer_file(name: str, revision: str | None = None) -> Path:
    """The tokenizer.json that `name` means: read from disk for a path, from the hub's cache for an id."""
    path = Path(name).expanduser()
    if path.is_dir():
        found = path / TOKENIZER_FILE
        if not found.is_file():
            raise InputError(f"{path}: no {TOKENIZER_FILE} (klpipe inspect reads fast tokenizers; transformers' "
                             "tokenizer.save_pretrained writes one)")
        return found
    if path.is_file():
        return path
    if looks_like_path(name):
        raise InputError(f"{name}: no such tokenizer directory or file; pass --tokenizer DIR")
    import os

    try:
        from huggingface_hub import hf_hub_download
    except ImportError:  # tokenizers brings it; a bare install of tokenizers alone may not
        raise MissingTokenizersError(f"{name}: a tokenizer from the hub needs huggingface_hub: "
                                     "pip install 'klpipe[inspect]'") from None
    try:
        return Path(hf_hub_download(name, TOKENIZER_FILE, revision=revision))
    except Exception as exc:  # noqa: BLE001 - huggingface_hub's errors have no one base class across versions
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "no")
        why = "not in the local Hugging Face cache, and HF_HUB_OFFLINE is set" if offline else first_line(exc)
        raise InputError(f"{name}: no such directory here, and no {TOKENIZER_FILE} for it from the hub ({why}); "
                         "pass --tokenizer DIR|ID") from None
