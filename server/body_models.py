"""The request bodies of every endpoint that takes one, declared once as pydantic models.

`CompletionBody` (/v1/completions) and `ChatBody` (/v1/chat/completions) declare every field of
OpenAI's API and the vLLM extensions clients send, with the ranges of runtime/limits.py: the
models check shapes and ranges only (server/response_format.py and server/tool_request.py check
what the grammar fields mean together). Fields the engine does not do yet are declared like the
rest and refused afterwards by server/unimplemented.py; unknown fields are kept aside, ignored
and reported (ADR 0010). Token ids are checked against the vocabulary when validation is given
`context={"vocab_size": N}` (`VOCAB`). The JSON schema of each model (`model_json_schema()`)
drives the body fuzz (scripts/reliabilitylib/bodies.py).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, Tag, ValidationInfo, WithJsonSchema

from runtime import limits
from runtime.limits import Bound
from server.messages import Message, Strict, by_json_kind

VOCAB = "vocab_size"  # the validation-context key of the served model's vocabulary size


def _number(bound: Bound) -> Any:
    """A float or int field type carrying `bound`'s range."""
    return Annotated[int if bound.integer else float, Field(**bound.constraints())]


def _in_vocabulary(token: int, info: ValidationInfo) -> int:
    vocab_size = (info.context or {}).get(VOCAB)
    if token < 0 or (vocab_size is not None and token >= vocab_size):
        inside = f" [0, {vocab_size})" if vocab_size is not None else " (>= 0)"
        raise ValueError(f"must be a token id inside the vocabulary{inside}, got {token}")
    return token


def _token_id_key(key: str, info: ValidationInfo) -> str:
    # JSON object keys are strings: OpenAI writes token ids as decimal strings ("50256").
    vocab_size = (info.context or {}).get(VOCAB)
    if not (key.isascii() and key.isdigit() and len(key) <= 10) or (
            vocab_size is not None and int(key) >= vocab_size):
        inside = f" [0, {vocab_size})" if vocab_size is not None else ""
        raise ValueError(f"must be a token id inside the vocabulary{inside}, written in digits")
    return key


_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _openai_name(name: str) -> str:
    # OpenAI's rule for the names of schemas and functions.
    if not _NAME.fullmatch(name):
        shown = name if len(name) <= 70 else name[:67] + "..."
        raise ValueError(f"must be 1 to 64 letters, digits, '_' or '-', got {shown!r}")
    return name


TokenId = Annotated[int, AfterValidator(_in_vocabulary)]
Name = Annotated[str, AfterValidator(_openai_name),
                 WithJsonSchema({"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"})]
TokenIdKey = Annotated[str, AfterValidator(_token_id_key),
                       WithJsonSchema({"type": "string", "pattern": "^[0-9]{1,10}$"})]
Temperature = _number(limits.TEMPERATURE)
TopP = _number(limits.TOP_P)
TopK = _number(limits.TOP_K_REQUEST)
MinP = _number(limits.MIN_P)
Penalty = _number(limits.PENALTY)
RepetitionPenalty = _number(limits.REPETITION_PENALTY)
Seed = _number(limits.SEED)
MaxTokens = _number(limits.MAX_TOKENS)
MinTokens = _number(limits.MIN_TOKENS)
N = _number(limits.N)
StopText = Annotated[str, Field(min_length=1, max_length=limits.MAX_STOP_CHARS)]
Stop = Annotated[
    Annotated[StopText, Tag("string")]
    | Annotated[list[StopText], Field(max_length=limits.MAX_STOP_SEQUENCES), Tag("array")],
    by_json_kind("a string or a list of strings")]
LogitBiasValue = _number(limits.LOGIT_BIAS)
LogitBias = dict[TokenIdKey, LogitBiasValue]


class StreamOptions(Strict):
    include_usage: bool | None = None


class JsonSchemaFormat(Strict):
    name: Name
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")  # OpenAI's is optional; a grammar needs it
    strict: bool | None = None  # the schema is enforced whatever it says


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat,
                           Field(discriminator="type")]


class GenerationBody(Strict):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: N | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: LogitBias | None = None
    min_tokens: MinTokens | None = None
    ignore_eos: bool | None = None
    # llama.cpp's name: false opts the request out of the prefix cache (runtime/prefix_cache.py)
    cache_prompt: bool | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None  # a grammar: server/response_format.py


def _prompt_kind(value: Any) -> str | None:
    """The member of `Prompt` a value is meant as, read from its first item."""
    if not isinstance(value, list):
        return "string" if isinstance(value, str) else None
    first = value[0] if value else None
    if isinstance(first, str):
        return "strings"
    return "token_lists" if isinstance(first, list) else "tokens"


Tokens = Annotated[list[TokenId], Field(min_length=1)]
PromptText = Annotated[str, Field(min_length=1)]
Prompt = Annotated[
    Annotated[PromptText, Tag("string")]
    | Annotated[list[PromptText], Field(min_length=1, max_length=limits.MAX_PROMPTS),
                Tag("strings")]
    | Annotated[Tokens, Tag("tokens")]
    | Annotated[list[Tokens], Field(min_length=1, max_length=limits.MAX_PROMPTS),
                Tag("token_lists")],
    by_json_kind("a string, a list of strings, a list of token ids or a list of lists of "
                 "token ids", _prompt_kind)]
BestOf = _number(limits.BEST_OF)
CompletionLogprobs = _number(limits.COMPLETION_LOGPROBS)
TopLogprobs = _number(limits.CHAT_TOP_LOGPROBS)


class CompletionBody(GenerationBody):
    """POST /v1/completions."""

    prompt: Prompt
    best_of: BestOf | None = None
    echo: bool | None = None
    logprobs: CompletionLogprobs | None = None
    suffix: str | None = None


class FunctionDef(Strict):
    name: Name
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("string")]
    | Annotated[NamedToolChoice, Tag("object")],
    by_json_kind('"none", "auto", "required" or {"type": "function", "function": {"name"}}')]
FunctionChoice = Annotated[
    Annotated[Literal["none", "auto"], Tag("string")] | Annotated[FunctionName, Tag("object")],
    by_json_kind('"none", "auto" or {"name": ...}')]
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class ChatBody(GenerationBody):
    """POST /v1/chat/completions."""

    messages: Annotated[list[Message], Field(min_length=1, max_length=limits.MAX_MESSAGES)]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: Annotated[list[Tool], Field(max_length=limits.MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDef] | None = None  # OpenAI's deprecated `tools`
    function_call: FunctionChoice | None = None  # OpenAI's deprecated `tool_choice`
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
    store: bool | None = None


class TokenizeBody(Strict):
    """POST /tokenize, vLLM's shape: a completions `prompt` or chat `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[Message], Field(min_length=1,
                                             max_length=limits.MAX_MESSAGES)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None
    continue_final_message: bool | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class DetokenizeBody(Strict):
    """POST /detokenize, vLLM's shape."""

    model: str | None = None
    tokens: list[TokenId]
