"""`Tokenizer`: text <-> token ids, from a ``tokenizer.json`` or the built-in byte vocabulary.

The built-in vocabulary (used by every built-in preset) is the 256 UTF-8 byte values as ids
``0..255`` followed by three special tokens: ``<bos>`` = 256, ``<eos>`` = 257, ``<pad>`` = 258.
As with any ``tokenizer.json``, the literal text ``<eos>`` in a prompt encodes to id 257.
`byte_level_tokenizer_json` writes the same vocabulary as a real Hugging Face ``tokenizers``
file, so a model directory written by `write_builtin_model` tokenizes identically whichever
path loads it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tokenizers

BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
PAD_TOKEN = "<pad>"
BOS_TOKEN_ID = 256
EOS_TOKEN_ID = 257
PAD_TOKEN_ID = 258
BYTE_VOCAB_SIZE = 259
_SPECIALS = ((BOS_TOKEN, BOS_TOKEN_ID), (EOS_TOKEN, EOS_TOKEN_ID), (PAD_TOKEN, PAD_TOKEN_ID))


class Tokenizer:
    """A thin wrapper: ``backend`` is a ``tokenizers.Tokenizer``, or ``None`` for raw bytes.

    ``decode`` drops special tokens (ids the backend marks special; for bytes, ids >= 256) and
    replaces incomplete UTF-8 with U+FFFD, so decoding a prefix of a generation never raises.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer | None,
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"tokenizer vocab_size must be >= 1, got {vocab_size}")
        for token_id in (*eos_token_ids, bos_token_id, pad_token_id):
            if token_id is not None and not 0 <= token_id < vocab_size:
                raise ValueError(
                    f"special token id {token_id} is outside the vocabulary [0, {vocab_size})"
                )
        self._backend = backend
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.pad_token_id = pad_token_id

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id (checkpoints may list several; see ``eos_token_ids``)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @classmethod
    def byte_level(cls) -> Tokenizer:
        """The built-in byte tokenizer (pure Python, no ``tokenizers`` needed)."""
        return cls(
            None,
            vocab_size=BYTE_VOCAB_SIZE,
            eos_token_ids=(EOS_TOKEN_ID,),
            bos_token_id=BOS_TOKEN_ID,
            pad_token_id=PAD_TOKEN_ID,
        )

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        *,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        pad_token_id: int | None = None,
    ) -> Tokenizer:
        """Load a ``tokenizer.json``; special ids come from the model config (the file itself
        does not say which added token ends a sequence)."""
        import tokenizers

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        backend = tokenizers.Tokenizer.from_file(str(path))
        return cls(
            backend,
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            eos_token_ids=eos_token_ids,
            bos_token_id=bos_token_id,
            pad_token_id=pad_token_id,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the file's post-processor
        (e.g. a leading BOS). The byte tokenizer adds nothing."""
        if self._backend is None:
            ids: list[int] = []
            # Like a tokenizer.json's added tokens, special-token text maps to its id.
            for piece in _SPECIAL_SPLIT.split(text):
                special = _SPECIAL_IDS.get(piece)
                ids.extend((special,) if special is not None else piece.encode("utf-8"))
            return ids
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        for token_id in ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})"
                )
        if self._backend is None:
            # Non-skipped specials have no bytes of their own; spell them like the file does.
            parts: list[bytes] = []
            for token_id in ids:
                if token_id < 256:
                    parts.append(bytes((token_id,)))
                elif not skip_special_tokens:
                    parts.append(_SPECIAL_NAMES[token_id].encode())
            return b"".join(parts).decode("utf-8", errors="replace")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        kind = "bytes" if self._backend is None else "tokenizer.json"
        return f"Tokenizer({kind}, vocab_size={self.vocab_size}, eos={self.eos_token_ids})"


_SPECIAL_NAMES = {token_id: token for token, token_id in _SPECIALS}
_SPECIAL_IDS = dict(_SPECIALS)
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(token) for token, _ in _SPECIALS) + ")")


@lru_cache(maxsize=1)
def _byte_to_unicode() -> tuple[str, ...]:
    """GPT-2's printable stand-in for every byte, indexed by byte value.

    Byte-level ``tokenizers`` pipelines spell bytes with these characters; printable Latin-1
    bytes stand for themselves and the rest are shifted past U+0100 in byte order.
    """
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    chars: list[str] = []
    shifted = 0
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return tuple(chars)


def byte_level_tokenizer_json() -> str:
    """The built-in vocabulary as ``tokenizer.json`` text (a merge-free byte-level BPE)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {char: byte for byte, char in enumerate(_byte_to_unicode())}
    for token, token_id in _SPECIALS:
        vocab[token] = token_id
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split and no prefix space: every input byte becomes exactly one id.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True) for token, _ in _SPECIALS])
    text = backend.to_str(pretty=True)
    # Fail here rather than in a user's directory if the library ever renumbers the specials.
    ids = {token: backend.token_to_id(token) for token, _ in _SPECIALS}
    if ids != dict(_SPECIALS):
        raise RuntimeError(f"byte-level tokenizer specials got ids {ids}, want {dict(_SPECIALS)}")
    return text
