"""`TextStream`: one request's tokens turned into text deltas, with stop strings applied.

Text is decoded from all output tokens each time (a byte-level or BPE token may complete a
character only together with the next one), and a trailing replacement character is held back
until the next token completes it. A stop string ends the request: the text before it is
returned, the tokens that produced the stop string are not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_INCOMPLETE = "\ufffd"


@dataclass(frozen=True)
class Delta:
    token_ids: tuple[int, ...]
    text: str
    stopped: bool = False


class TextStream:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._token_ids: list[int] = []
        self._num_sent_tokens = 0
        self._sent_text = ""

    @property
    def text(self) -> str:
        return self._sent_text

    @property
    def token_ids(self) -> list[int]:
        return self._token_ids[: self._num_sent_tokens]

    def feed(self, new_token_ids: Sequence[int], final: bool = False) -> Delta:
        """Add tokens; returns what may be sent now (``stopped`` once a stop string matched)."""
        if not self._stop:
            self._token_ids.extend(new_token_ids)
            return self._emit(len(self._token_ids), final)
        # One token at a time: the first token whose text completes a stop string ends it all.
        for token in new_token_ids:
            self._token_ids.append(token)
            text = self._tokenizer.decode(self._token_ids)
            cut = self._find_stop(text)
            if cut is not None:
                delta = text[len(self._sent_text) : cut] if cut > len(self._sent_text) else ""
                sent_tokens = tuple(self._token_ids[self._num_sent_tokens : -1])
                self._token_ids.pop()
                self._num_sent_tokens = len(self._token_ids)
                self._sent_text += delta
                return Delta(sent_tokens, delta, stopped=True)
        return self._emit(len(self._token_ids), final)

    def _emit(self, upto: int, final: bool) -> Delta:
        text = self._tokenizer.decode(self._token_ids[:upto])
        if not final:
            text = text.rstrip(_INCOMPLETE)
            if self._stop:
                # Hold back a tail that could still become a stop string.
                text = text[: max(len(self._sent_text), len(text) - self._longest_prefix(text))]
        delta = text[len(self._sent_text) :] if text.startswith(self._sent_text) else ""
        tokens = tuple(self._token_ids[self._num_sent_tokens : upto])
        self._num_sent_tokens = upto
        self._sent_text += delta
        return Delta(tokens, delta)

    def _find_stop(self, text: str) -> int | None:
        start = max(0, len(self._sent_text) - max(len(s) for s in self._stop))
        hits = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _longest_prefix(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some stop string."""
        best = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:size]):
                    best = size
                    break
        return best
