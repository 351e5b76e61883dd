"""The three grammar libraries behind one small interface, for scripts/bench_grammar.py.

Each engine is set up once for a tokenizer (a Hugging Face `tokenizer.json`), compiles a JSON
schema, makes matchers, fills a batch of next-token bitmasks (int32 words, bit i of word w =
token 32w+i, the layout all three libraries write) and advances a matcher by a token. Each
library is imported only when its engine is made, so the script runs with whichever are
installed.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import numpy as np

from runtime.model import bytes_to_unicode


class Engine(Protocol):
    name: str

    def compile(self, schema: dict[str, Any]) -> Any: ...

    def matcher(self, compiled: Any) -> Any: ...

    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None: ...

    def consume(self, matcher: Any, token: int) -> bool: ...

    def accepting(self, matcher: Any) -> bool: ...


# The same output style for every engine: no free whitespace (a model that emits noise would
# spend its tokens on it), ", " and ": " between items (xgrammar's fixed style).
LLG_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, eos: int) -> None:
        import llguidance
        import llguidance.numpy

        self._llg, self._np = llguidance, llguidance.numpy
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=eos)
        self._executor = llguidance.LLExecutor()

    def compile(self, schema: dict[str, Any]) -> Any:
        # Grammar text, checked against the tokenizer; the lexer is built lazily by the matcher.
        grammar = self._llg.LLMatcher.grammar_from_json_schema(schema, overrides=LLG_OPTIONS)
        error = self._llg.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, compiled: Any) -> Any:
        m = self._llg.LLMatcher(self.tokenizer, compiled, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        if len(matchers) == 1:
            self._np.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self._np.fill_next_token_bitmask_par(
                self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def consume(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_accepting())


class LlguidanceSerial(Llguidance):
    """llguidance filling a batch's rows one after another on the calling thread (no pool)."""

    name = "llguidance-serial"

    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        for i, m in enumerate(matchers):
            self._np.fill_next_token_bitmask(m, bitmask, i)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, eos: int) -> None:
        import xgrammar
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        self._xgr = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json))
        self.info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=hf.backend_tokenizer.get_vocab_size(), stop_token_ids=[eos])
        self._eos = eos
        self._batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict[str, Any]) -> Any:
        # A fresh compiler each time: its cache would make every compile after the first free.
        compiler = self._xgr.GrammarCompiler(self.info, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                            separators=(", ", ": "), strict_mode=True)

    def matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        import torch

        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(torch.from_numpy(bitmask), 0)
        else:
            self._batch.batch_fill_next_token_bitmask(matchers, torch.from_numpy(bitmask))

    def consume(self, matcher: Any, token: int) -> bool:
        if token == self._eos:
            return bool(matcher.accept_token(token)) and bool(matcher.is_terminated())
        return bool(matcher.accept_token(token))

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_completed()) if hasattr(matcher, "is_completed") else \
            bool(matcher.is_terminated())


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokenizer_json: str, eos: int) -> None:
        import outlines_core
        from tokenizers import Tokenizer

        self._oc = outlines_core
        tok = Tokenizer.from_str(tokenizer_json)
        vocab: dict[bytes, list[int]] = {}
        specials = {t.content for t in tok.get_added_tokens_decoder().values()}
        byte_of = {c: b for b, c in bytes_to_unicode().items()}
        for piece, token in tok.get_vocab().items():
            if piece in specials:
                continue
            vocab.setdefault(bytes(byte_of[c] for c in piece), []).append(token)
        self.vocabulary = outlines_core.Vocabulary(eos, vocab)
        self._eos = eos

    def compile(self, schema: dict[str, Any]) -> Any:
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(json.dumps(schema))
        return self._oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self._oc.Guide(compiled)

    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        words = bitmask.shape[1]
        base = bitmask.ctypes.data
        for i, g in enumerate(matchers):
            g.write_mask_into(base + i * words * 4, words, 4)

    def consume(self, matcher: Any, token: int) -> bool:
        if token == self._eos:
            return bool(matcher.is_finished())
        try:
            matcher.advance(token, return_tokens=False)
        except Exception:  # noqa: BLE001 - the library raises on a token the state refuses
            return False
        return True

    def accepting(self, matcher: Any) -> bool:
        return bool(matcher.is_finished())


ENGINES = {"llguidance": Llguidance, "llguidance-serial": LlguidanceSerial,
           "xgrammar": Xgrammar, "outlines-core": OutlinesCore}


def allowed(bitmask_row: np.ndarray, vocab_size: int) -> np.ndarray:
    """The token ids a bitmask row allows."""
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits)
