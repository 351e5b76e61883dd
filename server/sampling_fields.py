"""A generation body's sampling fields as the engine's `SamplingParams`: the body model
(server/body_models.py) has checked each field's shape and range (runtime/limits.py) and the
token ids against the vocabulary; what is left here is the fields' meaning. Leaving a field out
asks for nothing: greedy, no control, no log-probabilities. Imports no MLX.
"""

from __future__ import annotations

from runtime.sampling_params import SamplingParams
from server.body_models import ChatBody, CompletionBody
from server.errors import invalid


def sampling_params(body: CompletionBody | ChatBody, max_tokens: int,
                    vocab_size: int) -> SamplingParams:
    """The engine's parameters from the fields it implements (server/unimplemented.py refused
    the others), with the `max_tokens` the prompt's context leaves room for."""
    top_k = body.top_k or 0
    logprobs, prompt_logprobs = _logprobs(body)
    return SamplingParams(
        temperature=0.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if top_k == -1 else min(top_k, vocab_size),
        min_p=0.0 if body.min_p is None else body.min_p,
        presence_penalty=0.0 if body.presence_penalty is None else body.presence_penalty,
        frequency_penalty=0.0 if body.frequency_penalty is None else body.frequency_penalty,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias or {}),
        seed=body.seed,
        max_tokens=max_tokens,
        min_tokens=body.min_tokens or 0,
        stop=(body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ()),
        ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def _logit_bias(biases: dict[str, float]) -> tuple[tuple[int, float], ...]:
    """OpenAI's map (token id as digits -> bias; the model checked both) as (id, bias) pairs;
    a 400 when two keys name one token ("7" and "007")."""
    pairs: dict[int, tuple[str, float]] = {}
    for key, bias in biases.items():
        token = int(key)
        if token in pairs:
            raise invalid(f"`logit_bias` names token {token} twice (as {pairs[token][0]!r} and "
                          f"{key!r}); give each token id once", "logit_bias")
        pairs[token] = (key, float(bias))
    return tuple((token, bias) for token, (_, bias) in pairs.items())


def _logprobs(body: CompletionBody | ChatBody) -> tuple[int | None, int | None]:
    """(alternatives reported per generated token, per prompt token); None: no
    log-probabilities. Completions: `logprobs` N (0 to 5), the prompt's too with `echo`; chat:
    `logprobs: true` with `top_logprobs` N (0 to 20)."""
    if isinstance(body, CompletionBody):
        return body.logprobs, body.logprobs if body.echo else None
    return ((body.top_logprobs or 0) if body.logprobs else None), None
