"""Incremental detokenization of one sequence, with stop strings.

Text that could still be the start of a stop string is held back until the next tokens decide
it, so a client never receives part of a stop string.
"""

from __future__ import annotations

from typing import Any


class TextStream:
    """Turns one sequence's generated token ids into text segments ready to send."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self._detok = tokenizer.detokenizer  # mlx-lm gives each caller its own copy
        self._skip = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
        self._stop = tuple(s for s in stop if s)
        self._pending = ""
        self.stopped = False  # a stop string matched; nothing more is emitted

    def add(self, token: int) -> str:
        """Feed a token; return the text that can be sent now (may be empty)."""
        if self.stopped or token in self._skip:
            return ""
        self._detok.add_token(token)
        return self._emit(self._detok.last_segment, final=False)

    def finish(self) -> str:
        """Flush what is held back (call once, after the last token)."""
        if self.stopped:
            return ""
        self._detok.finalize()
        return self._emit(self._detok.last_segment, final=True)

    def _emit(self, segment: str, *, final: bool) -> str:
        text = self._pending + segment
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return text[: min(hits)]
        keep = 0 if final else self._held_back(text)
        self._pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def _held_back(self, text: str) -> int:
        # The longest tail of `text` that is a proper prefix of some stop string.
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
