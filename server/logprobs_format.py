"""Log-probabilities and `echo` in OpenAI's shapes, for one choice, whole or chunk by chunk.

- chat (`logprobs: true`, `top_logprobs: N`): `choices[i].logprobs = {"content": [{"token",
  "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...N]}, ...]}`;
- completions (`logprobs: N`): `choices[i].logprobs = {"tokens", "token_logprobs",
  "top_logprobs": [{token: logprob}, ...], "text_offset"}`, each `top_logprobs` entry holding the
  N most likely tokens and the chosen one (up to N + 1, as OpenAI documents); with `echo`, the
  text starts with the prompt and these lists with the prompt's tokens, the first one's
  log-probability and alternatives null.

The values are the model's log-probabilities (log-softmax of the raw logits: runtime/logprobs.py),
before any sampling control. A token's text is its own decoding; its `bytes` are the UTF-8 of
that text, or for a piece that is not whole UTF-8, the piece's bytes (a byte-level, GPT-2
style piece, or a SentencePiece byte-fallback `<0xNN>`).

`text_offset` is where each token starts in the returned text, counted in characters: the bytes
of the tokens so far are decoded as the text is (UTF-8, an invalid byte one U+FFFD), and a token
that starts inside a multi-byte character gets the offset of that character's start, so a
character split over tokens gives them all one offset and the offsets never go back. Special
tokens, such as BOS and EOS, count none where the text does not hold them: generated ones, and
the BOS a tokenizer adds to a prompt sent as text. With echo the prompt's tokens count from 0
(a special token the echoed text does hold, `<s>` written in the prompt or decoded from its
ids, counts its characters) and the generated ones from the echoed text's length.
"""

from __future__ import annotations

import codecs
import math
import re
from collections.abc import Sequence
from typing import Any

from runtime.api import TokenEvent, TokenLogprob
from runtime.model import bytes_to_unicode
from server.prompts import added_around
from server.validation import ValidRequest

# What vLLM reports for a log-probability of -inf: JSON has no infinities.
LOGPROB_FLOOR = -9999.0
_BYTE_OF_CHAR = {char: byte for byte, char in bytes_to_unicode().items()}
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _finite(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


class TokenTexts:
    """Each token id's text and bytes, decoded once."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self.special = frozenset(getattr(tokenizer, "all_special_ids", None) or ())

    def get(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._cache:
            text = str(self._tokenizer.decode([token_id]))
            data = list(text.encode("utf-8"))
            if "\ufffd" in text:  # part of a character: the piece holds its bytes
                data = _piece_bytes(self._tokenizer.convert_ids_to_tokens(token_id)) or data
            self._cache[token_id] = (text, data)
        return self._cache[token_id]


class ChoiceLogprobs:
    """One choice's echo and log-probabilities. `start` and `take` each token event; `flush`
    gives the `logprobs` object of what was taken since the last flush (None when not asked
    for)."""

    def __init__(self, kind: str, texts: TokenTexts, num_top: int | None, echo: str | None,
                 prompt_tokens: Sequence[int], added: int = 0) -> None:
        self.kind, self._texts, self.num_top, self.echo = kind, texts, num_top, echo
        # The prompt's first `added` tokens are the tokenizer's (its BOS), not the echo's text.
        self._prompt_tokens, self._added = prompt_tokens, added
        self._started = False
        self._offset = 0  # characters decoded so far, the bytes of an unfinished one not counted
        self._utf8 = _utf8_decoder()
        self._content: list[dict[str, Any]] = []
        self._columns: dict[str, list[Any]] = _empty_columns()

    def start(self, event: TokenEvent) -> str | None:
        """At the first event, the echoed prompt's text (None without echo), its tokens'
        log-probabilities taken; None at the others."""
        if self._started or self.echo is None:
            self._started = True
            return None
        self._started = True
        if self.num_top is not None:
            self._push_prompt(event.prompt_logprobs or ())
            # A tokenizer that normalizes may make the prompt's tokens longer than the echo.
            offsets = self._columns["text_offset"]
            offsets[:] = [min(offset, len(self.echo)) for offset in offsets]
        # The generated text is decoded on its own, after the echoed text as it is returned.
        self._offset, self._utf8 = len(self.echo), _utf8_decoder()
        return self.echo

    def take(self, event: TokenEvent) -> None:
        """Take the event's token's log-probabilities."""
        if event.logprob is not None and self.num_top is not None:
            self._push(event.logprob.token_id, event.logprob)

    def flush(self) -> dict[str, Any] | None:
        """The `logprobs` object for the tokens taken since the last flush (None: none)."""
        if self.num_top is None or not (self._content or self._columns["tokens"]):
            return None
        if self.kind == "chat":
            content, self._content = self._content, []
            return {"content": content}
        columns, self._columns = self._columns, _empty_columns()
        return columns

    def _push_prompt(self, logprobs: Sequence[TokenLogprob]) -> None:
        # The first prompt token has no log-probability; the others come from the prefill.
        self._offset = 0
        self._push(self._prompt_tokens[0], None, in_text=self._added < 1)
        for k, lp in enumerate(logprobs, 1):
            self._push(lp.token_id, lp, in_text=k >= self._added)

    def _push(self, token_id: int, lp: TokenLogprob | None, in_text: bool = False) -> None:
        # `in_text`: a special token the returned text holds (an echoed prompt's).
        text, data = self._texts.get(token_id)
        num_top = self.num_top or 0
        if self.kind == "chat":
            assert lp is not None
            self._content.append({
                "token": text, "logprob": _finite(lp.logprob), "bytes": data,
                "top_logprobs": [self._chat_top(t, v) for t, v in lp.top[:num_top]]})
            return
        top = None
        if lp is not None:
            top: dict[str, float] = {}
            for t, v in (*lp.top[:num_top], (lp.token_id, lp.logprob)):
                top.setdefault(self._texts.get(t)[0], _finite(v))
        self._columns["tokens"].append(text)
        self._columns["token_logprobs"].append(None if lp is None else _finite(lp.logprob))
        self._columns["top_logprobs"].append(top)
        self._columns["text_offset"].append(self._offset)
        if in_text or token_id not in self._texts.special:  # else not in the returned text
            self._offset += len(self._utf8.decode(bytes(data)))

    def _chat_top(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, data = self._texts.get(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": data}


def _piece_bytes(piece: object) -> list[int] | None:
    # `<0xNN>` first: its characters are byte-level ones too.
    if not isinstance(piece, str) or not piece:
        return None
    if fallback := _BYTE_FALLBACK.fullmatch(piece):
        return [int(fallback.group(1), 16)]
    return [_BYTE_OF_CHAR[c] for c in piece] if all(c in _BYTE_OF_CHAR for c in piece) else None


def _utf8_decoder() -> codecs.IncrementalDecoder:
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


def _empty_columns() -> dict[str, list[Any]]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def choice_logprobs(valid: ValidRequest, tokenizer: Any) -> dict[int, ChoiceLogprobs]:
    """A formatter for each choice of a request that asked for log-probabilities or echo
    (choice i * n + j: prompt i), else none. An echoed prompt is its text as sent, or its
    tokens decoded when sent as ids."""
    num_top = valid.sampling.logprobs
    if num_top is None and not valid.echo:
        return {}
    texts = TokenTexts(tokenizer)
    out = {}
    for i, prompt in enumerate(valid.prompts):
        echo, added = None, 0
        if valid.echo:
            echo = prompt.text if prompt.text is not None else \
                str(tokenizer.decode(list(prompt.tokens)))
            if prompt.text is not None:  # encoded with the tokenizer's special tokens
                added = len(added_around(tokenizer)[0])
        for j in range(valid.n):
            out[i * valid.n + j] = ChoiceLogprobs(valid.kind, texts, num_top, echo,
                                                  prompt.tokens, added)
    return out

