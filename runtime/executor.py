"""The MLX execution layer: KV caches and one forward pass per tick. No scheduling here.

`run(prefills, decode)` runs a whole tick as one forward over a ragged batch (runtime/fused.py):
one decode step for every listed decoding sequence and the next prompt slice of every listed
prefilling one. Each sequence prefills into its own mlx-lm `KVCache`; when it first decodes, its
cache joins the decode batch (runtime/decode_batch.py). `fork` makes sibling choices of a
prompt that just ended (`n` > 1) from copies of its cache and the logits it ended with.

Decode is pipelined the way mlx-lm's generation loop is: while every live sequence is in the
batch, a decode-only tick queues the next step (`mx.async_eval`) before it reads this step's
tokens. The next tick takes the queued tokens if it steps the same batch (less released
sequences), with or without prompt slices; any other batch undoes the queued step (caches
trimmed by one token, sampling states put back); a tick with no decode rows leaves it queued.
Beside a prefill lane (ADR 0016), whose prompt is a live sequence outside the batch,
`queue_step` queues the rows' next step after their tokens are read.

Sampling runs per row inside the batched step (runtime/row_sampling.py); log-probabilities,
when asked for, come with the tokens (`take_logprobs`), and a prompt whose tokens' own are asked
for (echo) has its slices' logits computed at every position in the same forward.

A sequence with a grammar (structured output, runtime/grammar.py) has its own matcher: each row
it samples gets the matcher's next-token mask, which the sampler applies after the other
controls and before the draw (`token_masks` handed to the sampler: the one place a grammar
touches sampling); the drawn token advances the matcher last, before the tick commits anything
(where a grammar fails, the matchers moved are rolled back and the tick fails naming that
sequence: `SequenceFault`). No step is queued ahead while a row is constrained: its next mask
needs this token.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from runtime import kernels
from runtime.cache_fork import fork_cache
from runtime.decode_batch import DecodeBatch, Queued
from runtime.fused import Segment, can_fuse, forward_apart, forward_fused
from runtime.grammar import Grammar, MatcherError, token_masks
from runtime.heap import give_back_free_memory
from runtime.limits import check_context
from runtime.logprobs import Sampled, Token, TokenLogprob
from runtime.model import ModelBundle
from runtime.prefix_cache import CachedPrefix, attach, can_cache
from runtime.rope_table import prepare as prepare_rope_tables
from runtime.sampling import SamplingParams, SequenceSampler, sample_batch
from runtime.seq_state import SeqState, SequenceFault, SliceOutput, advance_grammars

log = logging.getLogger("fairtick.executor")


class SliceWork(Protocol):
    """A prefill slice for `run`: the next `num_tokens` prompt tokens of `seq_id`. The
    scheduler's plan hands its own records (`PrefillWork`); `Slice` is one for other callers."""

    @property
    def seq_id(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


@dataclass(frozen=True)
class Slice:
    """A SliceWork made by hand."""

    seq_id: int
    num_tokens: int


class Executor:
    """Owns the model's MLX state for every live sequence; runs what the scheduler decides.

    With `fuse` (the default) a tick is one forward where the architecture allows it
    (`runtime.fused.can_fuse`), else one forward per prefill slice plus one for the decode
    batch; `fused` says which. One thread runs the ticks; another may at the same time run
    prefill-only ticks (`run(slices, [])`) of sequences outside the decode batch: such a run
    touches only those sequences' own state, never the decode batch or a step it has queued,
    and a sequence's arrays are evaluated when it becomes one to prefill (`add`, `evict`),
    since MLX cannot evaluate on one thread what was left lazy on another's stream. Adding,
    evicting, releasing and forking are the ticks' thread's.
    """

    def __init__(self, bundle: ModelBundle, fuse: bool = True) -> None:
        self.bundle = bundle
        self.model = bundle.model
        self.fused = fuse and can_fuse(self.model)
        self._forward = forward_fused if self.fused else forward_apart
        if self.fused:
            kernels.warm_up()
            prepare_rope_tables(self.model, bundle.context_length)
        log.info("executor: %s", "one forward per tick" if self.fused else
                 f"one forward per prefill slice and decode batch ({type(self.model).__module__}"
                 " is not fused)")
        self._seqs: dict[int, SeqState] = {}
        self._batch = DecodeBatch(self._seqs)

    def add(self, seq_id: int, prompt_tokens: Sequence[int], sampling: SamplingParams,
            prefix: CachedPrefix | None = None, forks: bool = False,
            grammar: Grammar | None = None) -> None:
        """Register a sequence; its prompt runs through `run`'s prefill slices, after the
        `prefix` of it found in the prefix cache (at most all its tokens but the last). With
        `forks`, the logits its prompt ends with are kept for `fork` (a request with `n` > 1).
        With a `grammar`, every token it samples is masked by it (runtime/grammar.py)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already exists")
        if len(prompt_tokens) == 0:
            raise ValueError("prompt_tokens must hold at least one token")
        check_context(len(prompt_tokens), sampling.validate().max_tokens,
                      self.bundle.context_length)
        sampler = self._sampler(sampling, prompt_tokens)
        cache = self._prompt_cache(len(prompt_tokens))
        seq = SeqState(seq_id, [int(t) for t in prompt_tokens], sampler, cache)
        seq.forks = forks
        seq.matcher = grammar.new_matcher() if grammar is not None else None
        if prefix is not None:
            self._start_from(seq, prefix)
        self._settle(seq)
        self._seqs[seq_id] = seq

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def prompt_left(self, seq_id: int) -> int:
        """Prompt tokens not yet prefilled (after `evict`: the tokens to prefill again)."""
        seq = self._get(seq_id)
        return len(seq.tokens) - seq.num_prefilled

    def num_cached(self, seq_id: int) -> int:
        """Tokens of the sequence in its KV cache: the context its next forward attends to."""
        return self._get(seq_id).num_cached

    def is_constrained(self, seq_id: int) -> bool:
        """Whether the sequence's tokens are masked by a grammar."""
        return self._get(seq_id).matcher is not None

    def num_constrained_decoding(self) -> int:
        """Sequences that have finished their prompt (may decode) and carry a grammar."""
        return sum(1 for s in self._seqs.values() if s.can_decode and s.matcher is not None)

    def decode_rows(self) -> list[tuple[int, int]]:
        """(seq_id, num_cached) of every sequence that has finished its prompt (may decode)."""
        return [(s.seq_id, s.num_cached) for s in self._seqs.values() if s.can_decode]

    def prefill(self, seq_id: int, num_tokens: int) -> int | None:
        """`run` with one prefill slice: the sequence's first token once its prompt is done."""
        return self.run([Slice(seq_id, num_tokens)], []).get(seq_id)

    def decode(self, seq_ids: Sequence[int]) -> dict[int, int]:
        """`run` with one decode step for `seq_ids` and no prefill."""
        return self.run([], seq_ids)

    def run(self, prefills: Sequence[SliceWork], decode: Sequence[int]) -> dict[int, int]:
        """One tick: the next `num_tokens` prompt tokens of each prefill (fewer if fewer are
        left) and one decode step for each sequence in `decode`, as one forward. Returns the
        next token of every decoded sequence and of every sequence whose prompt this tick
        finished. If it raises, every sequence is left as it was (caches, samplers), so the
        caller may run the pieces again apart to find the one that fails."""
        slices = self._check(prefills, decode)
        batch, ahead = self._batch_for(list(decode))
        segments = [] if ahead is not None or not batch else self._decode_segments(batch)
        segments += [seq.slice_segment(n) for seq, n in slices]
        touched = [s.cache for s in segments]
        if ahead is not None:
            touched += self._batch.caches  # they hold the queued step a failure keeps
        with self._undo_on_error(touched, [seq for seq, _ in slices], ahead, bool(batch)):
            rows, outputs = self._sample(batch, ahead, slices, segments)
            states = [seq.sampler.state for seq, _ in slices]
            if batch:
                assert self._batch.state is not None
                states.append(self._batch.state)  # evaluated, so no graph chain grows
            if rows is not None and not slices and self._can_run_ahead(batch, pending=1):
                self._queue_ahead(batch, rows)
            mx.eval([o.arrays() for o in outputs.values()], [s.arrays() for s in states],
                    [[c.state for c in seq.cache or ()] for seq, _ in slices],
                    [seq.first_logits for seq, _ in slices if seq.first_logits is not None])
            decoded = rows.to_host([s.sampler.params.logprobs for s in batch]) if rows else []
            found = {seq_id: o.to_host(self._seqs[seq_id]) for seq_id, o in outputs.items()}
            # Last: a grammar that fails or refuses its token fails the tick, which is undone
            # (SequenceFault names the sequence); nothing is committed before this.
            advance_grammars([(seq, token[0]) for seq, token in zip(batch, decoded, strict=True)]
                             + [(self._seqs[seq_id], first[0])
                                for seq_id, (first, _) in found.items() if first is not None])
        return self._commit(batch, decoded, slices, found)

    def queue_step(self, decode: Sequence[int]) -> None:
        """Queue the next decode step of `decode` for the next `run` that steps the same rows
        (a `run` that steps others undoes it), as a decode-only `run` queues its next step
        before it reads its own tokens, even while sequences outside the batch prefill: a lane
        tick (ADR 0016) publishes a step's tokens first and queues the next step after, so that
        the streams' gaps follow its pace, not the next step's dispatch. Nothing is queued
        where a decode-only `run` would queue nothing (a grammar; every max_tokens reached)."""
        batch, ahead = self._batch_for(list(decode))
        self._batch.ahead = ahead  # one queued already stays
        if ahead is None and batch and self._can_run_ahead(batch, pending=0, alone=False):
            with self._undo_on_error(self._batch.caches, [], None, True):
                self._queue_ahead(batch, None)

    def take_logprobs(self, seq_ids: Iterable[int] | None = None
                      ) -> tuple[dict[int, TokenLogprob], dict[int, tuple[TokenLogprob, ...]]]:
        """The log-probabilities that came with the tokens `run` and `fork` returned since the
        last call (sequences that asked for them): each token's, and each prompt's (with its
        first token: prompt tokens 1, 2, ...; the first has none). Of `seq_ids` only, if given
        (a prefill-only tick on another thread may be committing its own meanwhile)."""
        tokens, prompts = {}, {}
        seqs = self._seqs.values() if seq_ids is None else \
            [self._seqs[i] for i in seq_ids if i in self._seqs]
        for seq in seqs:
            if seq.sent_logprob is not None:
                tokens[seq.seq_id], seq.sent_logprob = seq.sent_logprob, None
            if seq.sent_prompt_logprobs is not None:
                prompts[seq.seq_id], seq.sent_prompt_logprobs = seq.sent_prompt_logprobs, None
        return tokens, prompts

    def fork(self, seq_id: int, children: Sequence[tuple[int, SamplingParams]]) -> dict[int, int]:
        """New sequences sharing the prompt of `seq_id` (added with `forks`), made right after
        the tick in which its prompt gave its first token: each starts on a copy of its KV
        cache (runtime/cache_fork.py: nothing is computed again) and draws its own first token,
        with its own sampler (its own PRNG key, no tokens counted yet), from the logits that
        prompt ended with (and its own grammar matcher, at the start of the output, if the
        prompt's sequence has one), and has the prompt's log-probabilities if it asked for them.
        Returns
        each child's first token (its log-probabilities: `take_logprobs`). The kept logits are
        dropped: call it once, with no children if none are wanted."""
        parent = self._get(seq_id)
        logits, parent.first_logits, parent.forks = parent.first_logits, None, False
        if not children:
            return {}
        if logits is None or parent.cache is None or len(parent.generated) != 1:
            raise ValueError(f"sequence {seq_id} has not just ended its prompt with `forks`")
        made: list[tuple[SeqState, Sampled]] = []
        for child_id, sampling in children:
            if child_id in self._seqs or any(child_id == c.seq_id for c, _ in made):
                raise ValueError(f"sequence {child_id} already exists")
            sampler = self._sampler(sampling.validate(), parent.prompt)
            child = SeqState(child_id, parent.prompt, sampler, fork_cache(parent.cache))
            child.num_prefilled, child.num_cached = len(child.tokens), parent.num_cached
            # Its own matcher, at the start of the output (the parent's took its first token).
            child.matcher = parent.matcher.grammar.new_matcher() if parent.matcher else None
            made.append((child, sampler.sample(logits, 0, token_masks(logits, [child.matcher]))))
        mx.eval([sampled.arrays() for _, sampled in made],
                [child.sampler.state.arrays() for child, _ in made])
        firsts = [sampled.to_host([child.sampler.params.logprobs])[0] for child, sampled in made]
        advance_grammars([(child, first[0]) for (child, _), first in zip(made, firsts,
                                                                          strict=True)])
        for (child, _), first in zip(made, firsts, strict=True):
            child.commit_slice(0, first, parent.prompt_logprobs)
            self._seqs[child.seq_id] = child
        return {child.seq_id: child.generated[0] for child, _ in made}

    def evict(self, seq_id: int) -> None:
        """Drop the sequence's KV cache: its tokens so far (prompt and generated) become the
        prompt that prefill runs again; its sampler carries on where it was."""
        seq = self._get(seq_id)
        if self._batch.ahead is not None:
            self._batch.rewind()
        self._batch.drop(seq_id)
        seq.tokens = seq.prompt + seq.generated
        seq.num_prefilled = seq.num_cached = 0
        seq.cache = self._prompt_cache(len(seq.tokens))
        self._settle(seq)  # its sampling state came out of the batch's, lazily

    def release(self, seq_id: int) -> None:
        """Free the sequence's cache (its batch row is dropped at the next decode)."""
        self._get(seq_id)
        del self._seqs[seq_id]
        self._batch.drop(seq_id)
        if not self._seqs:
            mx.synchronize()  # a queued step's buffers must be freed before the cache is
            mx.clear_cache()
            give_back_free_memory()  # and the C allocator's free pages (runtime/heap.py)

    # -- the prefix cache's side (runtime/prefix_cache.py) ---------------------------------
    @property
    def can_cache_prefixes(self) -> bool:
        """Whether the model's caches are plain KV that the prefix cache can keep and slice."""
        return can_cache(make_prompt_cache(self.model))

    def _start_from(self, seq: SeqState, prefix: CachedPrefix) -> None:
        if not 0 < prefix.num_tokens < len(seq.prompt):
            raise ValueError(f"a cached prefix of {prefix.num_tokens} tokens for a prompt of "
                             f"{len(seq.prompt)}: it must leave the last prompt token to run")
        if seq.sampler.params.prompt_logprobs is not None:
            raise ValueError("a prompt whose tokens' log-probabilities are asked for (echo) "
                             "runs every token: it cannot start from a cached prefix")
        assert seq.cache is not None
        attach(seq.cache, prefix)
        seq.num_prefilled = seq.num_cached = prefix.num_tokens

    def kv_of(self, seq_id: int) -> tuple[list[int], list[tuple[mx.array, mx.array]]]:
        """The tokens whose KV the sequence holds, and that KV per layer (keys, values), for the
        prefix cache to keep after the sequence is released: exactly those tokens, copied out
        of a larger buffer (the decode batch's, or one grown well past them), else slices of
        the sequence's own buffers."""
        seq = self._get(seq_id)
        n = seq.num_cached  # a step queued ahead in the batch is past it, and not kept
        tokens = (seq.prompt + seq.generated)[:n]
        if seq.cache is not None:  # its own buffers, one row
            cache, row, alone = seq.cache, 0, True
        else:
            group, row = self._batch.locate(seq_id)
            cache, alone = group.cache, len(group.ids) == 1
        pads = [int(c.left_padding[row].item()) if seq.cache is None else 0 for c in cache]
        layers = [(c.keys[row:row + 1, :, p:p + n], c.values[row:row + 1, :, p:p + n])
                  for c, p in zip(cache, pads, strict=True)]
        if alone and not any(pads) and all(c.keys.shape[2] - n < KVCache.step for c in cache):
            # Buffers of this sequence alone (its own, or a batch group of its row only), which
            # it is leaving, holding at most one cache step past its tokens: kept as they are.
            # A copy of a 10,000-token prompt's KV stalled every stream for the ~7-20 ms of its
            # last tick.
            mx.eval(layers)
            return tokens, layers
        # mx.array copies (mx.contiguous of a slice that is already contiguous would keep the
        # whole step-rounded buffer alive behind a few tokens).
        copies = [(mx.array(k), mx.array(v)) for k, v in layers]
        mx.eval(copies)
        return tokens, copies

    def _sampler(self, sampling: SamplingParams, prompt: Sequence[int]) -> SequenceSampler:
        vocab_size = self.bundle.vocab_size
        return SequenceSampler(sampling.check_vocabulary(vocab_size), self.bundle.eos_token_ids,
                               vocab_size, prompt)

    def _prompt_cache(self, num_tokens: int) -> list[Any]:
        # A cache that holds the whole prompt from its first slice on. mlx-lm's KVCache grows
        # 256 positions at a time by copying all it holds: a long prompt prefilled in small
        # slices would copy its whole KV every 256 tokens, a tick far over its target.
        cache = make_prompt_cache(self.model)
        for layer in cache:
            if isinstance(getattr(layer, "step", None), int):
                layer.step = max(layer.step, -(-num_tokens // layer.step) * layer.step)
        return cache

    @staticmethod
    def _settle(seq: SeqState) -> None:
        # Evaluate what the sequence holds that may be lazy (its sampling state; a cached
        # prefix's slices), so that any thread may run its prefill.
        held = [seq.sampler.state.arrays()]
        if seq.cache is not None and seq.num_cached:
            held.append([(c.keys, c.values) for c in seq.cache])
        mx.eval(held)

    def _get(self, seq_id: int) -> SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id}") from None

    # -- one tick ----------------------------------------------------------------------------
    def _check(self, prefills: Sequence[SliceWork],
               decode: Sequence[int]) -> list[tuple[SeqState, int]]:
        ids = [w.seq_id for w in prefills] + list(decode)
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate sequence ids in one tick: {ids}")
        for seq_id in decode:
            if not self._get(seq_id).can_decode:
                raise ValueError(f"sequence {seq_id} has not finished its prefill")
        slices = []
        for work in prefills:
            seq = self._get(work.seq_id)
            left = len(seq.tokens) - seq.num_prefilled
            if left == 0:
                raise ValueError(f"sequence {work.seq_id} has no prompt left to prefill")
            if work.num_tokens < 1:
                raise ValueError(f"num_tokens must be >= 1, got {work.num_tokens}")
            slices.append((seq, min(work.num_tokens, left)))
        return slices

    def _batch_for(self, ids: list[int]) -> tuple[list[SeqState], Queued | None]:
        # The batch made to hold `ids`, and the step it has queued for them. A tick with no
        # decode rows leaves the batch as it is, a queued step too (the next tick that steps
        # the same rows takes it; one that steps others undoes it).
        if not ids:
            return [], None
        if self._batch.ahead is not None and set(ids) != set(self._batch.live_ids):
            self._batch.rewind()
        self._batch.regroup(ids)
        ahead, self._batch.ahead = self._batch.ahead, None
        return [self._seqs[i] for i in self._batch.live_ids], ahead

    def _decode_segments(self, batch: list[SeqState],
                         inputs: mx.array | None = None) -> list[Segment]:
        assert self._batch.groups
        # The most tokens a row can still add: this step's and the rest of its max_tokens.
        self._batch.reserve(lambda: max(s.sampler.params.max_tokens - len(s.generated)
                                        for s in batch))
        if inputs is None:
            inputs = mx.array([s.generated[-1] for s in batch])
        return self._batch.segments(inputs)

    def _sample(self, batch: list[SeqState], ahead: Queued | None,
                slices: list[tuple[SeqState, int]],
                segments: list[Segment]) -> tuple[Sampled | None, dict[int, SliceOutput]]:
        # Lazy tokens of the decode rows (the queued ones, if any), and what each slice that
        # wants logits computed.
        logits = self._forward(self.model, segments) if segments else None
        rows, row = (ahead.sampled if ahead else None), 0
        if rows is None and batch:
            rows, row = self._sample_rows(batch, logits, ahead=0), len(batch)
        outputs = {}
        for (seq, num_tokens), segment in zip(slices, segments[len(segments) - len(slices):],
                                              strict=True):
            if segment.logits:
                assert logits is not None
                num_rows = num_tokens if segment.all_logits else 1
                outputs[seq.seq_id] = seq.slice_output(logits[row: row + num_rows], num_tokens,
                                                       segment.all_logits)
                row += num_rows
        return rows, outputs

    def _sample_rows(self, batch: list[SeqState], logits: mx.array | None,
                     ahead: int) -> Sampled:
        # The decode rows' tokens from the first len(batch) rows of `logits`; `ahead` steps past
        # what was returned. The rows' sampling state moves on.
        assert logits is not None and self._batch.state is not None
        steps = [len(s.generated) + ahead for s in batch]
        rows = logits[: len(batch)]
        try:
            masks = token_masks(rows, [s.matcher for s in batch])
        except MatcherError as exc:
            raise SequenceFault(batch[exc.row].seq_id, exc) from exc
        sampled, self._batch.state = sample_batch(
            rows, [s.sampler for s in batch], steps, self._batch.state, masks)
        return sampled

    def _queue_ahead(self, batch: list[SeqState], rows: Sampled | None) -> None:
        # The next step of the same batch: after `rows`, this step's tokens, queued before
        # they are read; else after the rows' committed tokens.
        inputs = rows.tokens if rows is not None else None
        logits = self._forward(self.model, self._decode_segments(batch, inputs))
        assert self._batch.state is not None
        before = self._batch.state
        queued = Queued(self._sample_rows(batch, logits, ahead=int(rows is not None)), before)
        self._batch.ahead = queued
        mx.async_eval(queued.sampled.arrays(), self._batch.state.arrays())

    def _can_run_ahead(self, batch: list[SeqState], pending: int, alone: bool = True) -> bool:
        # `alone`: not while a sequence outside the batch may need the next tick (its work
        # would queue behind this step). Nor past every max_tokens (the rows have `pending`
        # tokens not yet committed), nor with a grammar (its next mask needs this token).
        if any(s.matcher is not None for s in batch):
            return False
        return (not alone or len(batch) == len(self._seqs)) and any(
            len(s.generated) + pending < s.sampler.params.max_tokens for s in batch
        )

    @contextmanager
    def _undo_on_error(self, caches: list[list[Any]], seqs: list[SeqState],
                       ahead: Queued | None, batch: bool) -> Iterator[None]:
        # Cache states and sampling states as they were; a failed tick puts them back
        # (positions past a restored offset are garbage that the next update overwrites). The
        # decode batch's, only if the tick stepped it (a prefill-only tick leaves it alone: it
        # may be running on another thread than the one stepping the batch).
        cache_states = [[c.state for c in cache] for cache in caches]
        states = [s.sampler.state for s in seqs]
        batch_state = self._batch.state
        try:
            yield
        except BaseException:
            for cache, saved in zip(caches, cache_states, strict=True):
                for c, state in zip(cache, saved, strict=True):
                    c.state = state
            for seq, state in zip(seqs, states, strict=True):
                seq.sampler.state = state
            if batch:
                self._batch.state = batch_state
                self._batch.ahead = ahead  # still valid: the batch's caches hold its step again
            raise

    def _commit(self, batch: list[SeqState], decoded: list[Token],
                slices: list[tuple[SeqState, int]],
                found: dict[int, tuple[Token | None, list[TokenLogprob]]]) -> dict[int, int]:
        out: dict[int, int] = {}
        for seq, token in zip(batch, decoded, strict=True):
            seq.commit_decode(token)
            out[seq.seq_id] = token[0]
        for seq, num_tokens in slices:
            first, prompt = found.get(seq.seq_id, (None, []))
            seq.commit_slice(num_tokens, first, prompt)
            if first is not None:
                out[seq.seq_id] = first[0]
        return out
