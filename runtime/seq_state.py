"""One sequence as the executor holds it: its tokens, cache, sampler and grammar matcher, and
what a prefill slice of it computed (its first token, its prompt tokens' log-probabilities)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from runtime.fused import Segment
from runtime.grammar import GrammarMatcher, MatcherError, token_masks
from runtime.logprobs import LogprobArrays, Sampled, Token, TokenLogprob, prompt_logprob_arrays
from runtime.sampling import SequenceSampler


class SeqState:
    """A live sequence in the executor."""

    __slots__ = ("seq_id", "prompt", "tokens", "num_prefilled", "num_cached", "sampler", "cache",
                 "generated", "forks", "first_logits", "prompt_logprobs", "prompt_logprobs_sent",
                 "sent_logprob", "sent_prompt_logprobs", "matcher")

    def __init__(self, seq_id: int, prompt: list[int], sampler: SequenceSampler,
                 cache: list[Any]) -> None:
        self.seq_id = seq_id
        self.prompt = prompt
        self.tokens = prompt  # what prefill runs: the prompt, or after `evict` prompt + output
        self.num_prefilled = 0  # of `tokens`
        self.num_cached = 0  # tokens whose keys and values are in the cache
        self.sampler = sampler
        self.cache: list[Any] | None = cache  # None while its rows live in the decode batch
        self.generated: list[int] = []  # the latest is not in the cache yet
        self.forks = False  # keep the logits its prompt ends with, for `Executor.fork`
        self.first_logits: mx.array | None = None
        # Of prompt tokens 1, 2, ... when asked for; sent once, with the first generated token.
        self.prompt_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs_sent = False
        # What the latest committed tick gives the caller (Executor.take_logprobs).
        self.sent_logprob: TokenLogprob | None = None
        self.sent_prompt_logprobs: tuple[TokenLogprob, ...] | None = None
        # Where the output is in its grammar (None: unconstrained); each token advances it.
        self.matcher: GrammarMatcher | None = None

    @property
    def can_decode(self) -> bool:
        return self.num_prefilled == len(self.tokens)

    def slice_segment(self, num_tokens: int) -> Segment:
        """The forward's segment for its next `num_tokens` tokens to prefill. Only a slice that
        ends them needs logits (the last position's), or one that covers prompt positions whose
        next token's log-probability is asked for and not yet known (every position's); the
        others only fill the cache."""
        assert self.cache is not None
        end = self.num_prefilled + num_tokens
        every = self.sampler.params.prompt_logprobs is not None and \
            len(self.prompt_logprobs) < min(end, len(self.prompt) - 1)
        return Segment(mx.array(self.tokens[self.num_prefilled:end])[None], self.cache,
                       logits=every or end == len(self.tokens), all_logits=every)

    def slice_output(self, logits: mx.array, num_tokens: int, every: bool) -> SliceOutput:
        """What a slice of `num_tokens` computes from its logits (every position's if `every`,
        else the last one's): the first token if it ends the tokens to prefill (sampled now),
        the prompt tokens' log-probabilities if `every`."""
        first = None
        if self.num_prefilled + num_tokens == len(self.tokens):
            if self.forks and not self.generated:
                self.first_logits = logits[-1:]
            try:
                masks = token_masks(logits[-1:], [self.matcher])
            except MatcherError as exc:
                raise SequenceFault(self.seq_id, exc) from exc
            first = self.sampler.sample(logits[-1:], len(self.generated), masks)
        if not every:
            return SliceOutput(first)
        known = len(self.prompt_logprobs)
        arrays = prompt_logprob_arrays(logits, self.prompt, self.num_prefilled, known,
                                       self.sampler.params.prompt_logprobs or 0)
        return SliceOutput(first, arrays, known)

    def commit_decode(self, token: Token) -> None:
        """A decode step ran: its input is in the cache, `token` is the next one."""
        self.num_cached += 1
        self._append(token)

    def commit_slice(self, num_tokens: int, first: Token | None,
                     found: list[TokenLogprob]) -> None:
        """A prefill slice ran, with what it computed (SliceOutput.to_host); the prompt's
        log-probabilities go out once, with the first token. A forked sibling commits its first
        token as a slice of no tokens, with the prompt's log-probabilities its parent found."""
        self.num_prefilled += num_tokens
        self.num_cached += num_tokens
        self.prompt_logprobs += found
        if first is None:
            return
        self._append(first)
        if self.sampler.params.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            self.prompt_logprobs_sent = True
            self.sent_prompt_logprobs = tuple(self.prompt_logprobs)

    def _append(self, token: Token) -> None:
        # Its grammar's matcher, if any, has taken the token already (advance_grammars).
        self.generated.append(token[0])
        self.sent_logprob = token[1]


class SequenceFault(RuntimeError):
    """A tick failed because of one sequence alone (its grammar failed, or refused its token):
    the executor raises it with every sequence left as it was, so the caller may fail that
    sequence and run the others again."""

    def __init__(self, seq_id: int, cause: Exception) -> None:
        super().__init__(str(cause))
        self.seq_id = seq_id


def advance_grammars(tokens: list[tuple[SeqState, int]]) -> None:
    """Move each constrained sequence's matcher past its token, before a tick commits anything;
    where one fails, undo those moved and raise SequenceFault naming its sequence."""
    moved: list[GrammarMatcher] = []
    for seq, token in tokens:
        if seq.matcher is None:
            continue
        try:
            seq.matcher.consume(token)
        except RuntimeError as exc:
            for matcher in reversed(moved):
                matcher.rollback()
            raise SequenceFault(seq.seq_id, exc) from exc
        moved.append(seq.matcher)


@dataclass(frozen=True)
class SliceOutput:
    """Lazy results of one prefill slice: its first token (None: the prompt goes on), and the
    log-probabilities of prompt tokens `prompt_from` + 1, ... when asked for."""

    first: Sampled | None
    prompt: LogprobArrays | None = None
    prompt_from: int = 0

    def arrays(self) -> list[mx.array]:
        return [*(self.first.arrays() if self.first else ()),
                *(self.prompt.arrays() if self.prompt else ())]

    def to_host(self, seq: SeqState) -> tuple[Token | None, list[TokenLogprob]]:
        """The first token (with its log-probabilities) and the prompt tokens' records."""
        params = seq.sampler.params
        first = self.first.to_host([params.logprobs])[0] if self.first else None
        if self.prompt is None:
            return first, []
        start = self.prompt_from + 1
        tokens = seq.prompt[start: start + self.prompt.chosen.shape[0]]
        found = self.prompt.to_host(tokens, [params.prompt_logprobs] * len(tokens))
        return first, [lp for lp in found if lp is not None]
