"""`text_offset` and a token's `bytes` for tokenizers the built-in model does not have: a
SentencePiece one with byte-fallback pieces, and one that normalizes the prompt it encodes.
(The built-in byte-level tokenizer is covered through the real server: tests/e2e/test_logprobs.py.)
"""

from __future__ import annotations

from runtime.api import TokenEvent, TokenLogprob
from server.logprobs_format import ChoiceLogprobs, TokenTexts


class PieceTokenizer:
    """Token i is `pieces[i]`; id 0 is BOS. A piece decodes to itself, `<0xNN>` to U+FFFD."""

    all_special_ids = (0,)

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int]) -> str:
        return "".join("\ufffd" if self.pieces[i].startswith("<0x") else self.pieces[i]
                       for i in ids)

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.pieces[token_id]


def offsets(pieces: list[str], echo: str, prompt: list[int], generated: list[int]) -> list[int]:
    """The text offsets of an echoed `prompt` (sent as text: its BOS the tokenizer's) and the
    `generated` tokens after it."""
    formatter = ChoiceLogprobs("completion", TokenTexts(PieceTokenizer(pieces)), 0, echo, prompt,
                               added=1)
    formatter.start(TokenEvent("r", None, "", prompt_logprobs=tuple(
        TokenLogprob(token, -1.0) for token in prompt[1:])))
    for token in generated:
        formatter.take(TokenEvent("r", token, "", logprob=TokenLogprob(token, -1.0)))
    columns = formatter.flush()
    assert columns is not None
    return list(columns["text_offset"])


def test_byte_fallback_pieces_hold_their_byte_and_share_their_characters_offset():
    pieces = ["<s>", "<0xC3>", "<0xA9>", "a", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    texts = TokenTexts(PieceTokenizer(pieces))
    assert [texts.get(i)[1] for i in (1, 2, 3)] == [[0xC3], [0xA9], [ord("a")]]
    # "éa" echoed, then "😀a" generated: é at 0, a at 1, 😀 at 2, a at 3.
    assert offsets(pieces, "éa", [0, 1, 2, 3], [4, 5, 6, 7, 3]) == [0, 0, 0, 1, 2, 2, 2, 2, 3]


def test_prompt_offsets_stay_within_the_echo_of_a_normalizing_tokenizer():
    # "ﬃ" (one character) encoded as f, f, i: the offsets never pass the echo, nor go back.
    got = offsets(["<s>", "f", "i", "x"], "ﬃ", [0, 1, 1, 2], [3, 3])
    assert got == [0, 0, 1, 1, 1, 2]
