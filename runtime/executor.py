"""The MLX execution layer: KV caches, chunked prefill and batched decode. No scheduling here.

Each sequence prefills into its own mlx-lm `KVCache`, one chunk per `prefill` call. When it
first decodes, its cache is merged into the decode batch's `BatchKVCache` (left padded, with a
mask, as mlx-lm's `BatchGenerator` does); sequences that leave the batch are filtered out of
it, or extracted back into their own cache when they are alive but not stepped. Joining and
leaving therefore cost one copy of the batch cache; a decode step with an unchanged batch costs
none.

Decode is pipelined the way mlx-lm's generation loop is: while every live sequence is in the
batch, `decode` queues the next step (`mx.async_eval`) before it reads this step's tokens, so
the next graph's building and the caller's work between ticks overlap the model's compute. The
next call takes the queued tokens if it steps the same batch (less released sequences); any
other batch undoes the queued step (caches trimmed by one token, PRNG keys rewound).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from runtime.model import ModelBundle
from runtime.sampling import SamplingParams, SequenceSampler, sample_batch


class _Sequence:
    __slots__ = ("prompt", "num_prefilled", "sampler", "cache", "last_token", "num_generated")

    def __init__(self, prompt: list[int], sampler: SequenceSampler, cache: list[Any]) -> None:
        self.prompt = prompt
        self.num_prefilled = 0
        self.sampler = sampler
        self.cache: list[Any] | None = cache  # None while its rows live in the decode batch
        self.last_token: int | None = None  # the latest sampled token, not yet in the cache
        self.num_generated = 0


class Executor:
    """Owns the model's MLX state for every live sequence; runs what the scheduler decides.

    Not thread-safe: one engine thread calls it.
    """

    def __init__(self, bundle: ModelBundle) -> None:
        self.bundle = bundle
        self.model = bundle.model
        self._seqs: dict[int, _Sequence] = {}
        # Row i of every layer's BatchKVCache belongs to _batch_ids[i]; None marks a released
        # sequence whose row is dropped at the next decode.
        self._batch_ids: list[int | None] = []
        self._batch_cache: list[BatchKVCache] | None = None
        # Tokens of a step already queued on the batch (its rows, its caches advanced) that no
        # `decode` has returned yet; None when the batch is not ahead.
        self._ahead: mx.array | None = None

    def add(self, seq_id: int, prompt_tokens: Sequence[int], sampling: SamplingParams) -> None:
        """Register a sequence; its prompt runs through `prefill`."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} already exists")
        if len(prompt_tokens) == 0:
            raise ValueError("prompt_tokens must hold at least one token")
        if len(prompt_tokens) >= self.bundle.context_length:
            raise ValueError(
                f"prompt has {len(prompt_tokens)} tokens; the model's context length is "
                f"{self.bundle.context_length}"
            )
        sampler = SequenceSampler(sampling.validate(), self.bundle.eos_token_ids)
        cache = make_prompt_cache(self.model)
        self._seqs[seq_id] = _Sequence([int(t) for t in prompt_tokens], sampler, cache)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    def prompt_left(self, seq_id: int) -> int:
        """Prompt tokens not yet prefilled."""
        seq = self._get(seq_id)
        return len(seq.prompt) - seq.num_prefilled

    def num_tokens(self, seq_id: int) -> int:
        """Tokens in the sequence so far: prefilled prompt plus generated."""
        seq = self._get(seq_id)
        return seq.num_prefilled + seq.num_generated

    def prefill(self, seq_id: int, num_tokens: int) -> int | None:
        """Run the next `num_tokens` prompt tokens (fewer if fewer are left) into the sequence's
        cache; return its first generated token once the whole prompt has run, else None."""
        seq = self._get(seq_id)
        left = len(seq.prompt) - seq.num_prefilled
        if left == 0:
            raise ValueError(f"sequence {seq_id} has no prompt left to prefill")
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        assert seq.cache is not None
        start, end = seq.num_prefilled, seq.num_prefilled + min(num_tokens, left)
        logits = self.model(mx.array(seq.prompt[start:end])[None], cache=seq.cache)
        seq.num_prefilled = end
        if end < len(seq.prompt):
            # Only the caches are needed: MLX then skips the last layer's output and lm_head.
            mx.eval([c.state for c in seq.cache])
            return None
        token = seq.sampler.sample(logits[:, -1, :], 0)
        mx.eval(token, [c.state for c in seq.cache])
        seq.last_token = token.item()
        seq.num_generated = 1
        return seq.last_token

    def decode(self, seq_ids: Sequence[int]) -> dict[int, int]:
        """One batched forward step for the listed decoding sequences; their next tokens."""
        ids = list(seq_ids)
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate sequence ids in {ids}")
        for seq_id in ids:
            if self._get(seq_id).last_token is None:
                raise ValueError(f"sequence {seq_id} has not finished its prefill")
        if self._ahead is not None and set(ids) != {i for i in self._batch_ids if i is not None}:
            self._rewind()
        self._regroup(ids)
        if not ids:
            return {}
        seqs = [self._seqs[seq_id] for seq_id in self._batch_ids if seq_id is not None]
        tokens = self._ahead
        if tokens is None:
            tokens = self._step(seqs, mx.array([s.last_token for s in seqs]), ahead=0)
        self._ahead = None
        if self._can_run_ahead(seqs):
            self._ahead = self._step(seqs, tokens, ahead=1)
            mx.async_eval(self._ahead)
        out: dict[int, int] = {}
        for seq_id, seq, token in zip(self._batch_ids, seqs, tokens.tolist(), strict=True):
            assert seq_id is not None
            seq.last_token = token
            seq.num_generated += 1
            out[seq_id] = token
        return out

    def _step(self, seqs: list[_Sequence], inputs: mx.array, ahead: int) -> mx.array:
        # Lazy tokens of one forward over the batch; `ahead` steps past what was returned.
        assert self._batch_cache is not None
        logits = self.model(inputs[:, None], cache=self._batch_cache)[:, -1, :]
        steps = [s.num_generated + ahead for s in seqs]
        return sample_batch(logits, [s.sampler for s in seqs], steps)

    def _can_run_ahead(self, seqs: list[_Sequence]) -> bool:
        # Not while a sequence outside the batch may need the next tick (its work would queue
        # behind this step, or it joins and the step is undone), nor past every max_tokens.
        return len(seqs) == len(self._seqs) and any(
            s.num_generated + 1 < s.sampler.params.max_tokens for s in seqs
        )

    def _rewind(self) -> None:
        # Undo the queued step: its token leaves every row's cache, its PRNG split is undone.
        assert self._batch_cache is not None
        for c in self._batch_cache:
            c.trim(1)
        for seq_id in self._batch_ids:
            if seq_id is not None:
                self._seqs[seq_id].sampler.rewind()
        self._ahead = None

    def release(self, seq_id: int) -> None:
        """Free the sequence's cache (its batch row is dropped at the next decode)."""
        self._get(seq_id)
        del self._seqs[seq_id]
        if seq_id in self._batch_ids:
            self._batch_ids[self._batch_ids.index(seq_id)] = None
            if all(i is None for i in self._batch_ids):
                self._batch_ids, self._batch_cache, self._ahead = [], None, None
        if not self._seqs:
            mx.synchronize()  # a queued step's buffers must be freed before the cache is
            mx.clear_cache()

    def _get(self, seq_id: int) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence {seq_id}") from None

    def _regroup(self, ids: list[int]) -> None:
        # Make the batch hold exactly `ids`: drop released rows, park the others, merge newcomers.
        wanted = set(ids)
        keep = [i for i, seq_id in enumerate(self._batch_ids) if seq_id in wanted]
        if len(keep) < len(self._batch_ids):
            assert self._batch_cache is not None
            for i, seq_id in enumerate(self._batch_ids):
                if seq_id is not None and seq_id not in wanted:
                    self._seqs[seq_id].cache = [c.extract(i) for c in self._batch_cache]
            if keep:
                for c in self._batch_cache:
                    c.filter(keep)
                if self._ahead is not None:
                    self._ahead = self._ahead[mx.array(keep)]
            else:
                self._batch_cache = None
            self._batch_ids = [self._batch_ids[i] for i in keep]
        present = set(self._batch_ids)
        joining = [seq_id for seq_id in ids if seq_id not in present]
        if not joining:
            return
        caches = []
        for seq_id in joining:
            seq = self._seqs[seq_id]
            assert seq.cache is not None
            caches.append(seq.cache)
            seq.cache = None
        merged = [BatchKVCache.merge(list(layer)) for layer in zip(*caches, strict=True)]
        if self._batch_cache is None:
            self._batch_cache = merged
        else:
            for batch, new in zip(self._batch_cache, merged, strict=True):
                batch.extend(new)
        self._batch_ids.extend(joining)
