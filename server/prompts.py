"""Prompts and chat messages: their accepted shapes, and turning them into token ids.

A completion prompt is a string or a list of token ids, or a batch of either (each prompt its
own sequences in the engine). Chat messages become a prompt through the tokenizer's own chat
template when it has one, else through a simple role-tagged template (the built-in model has
none).
"""

from __future__ import annotations

from typing import Any

from server.errors import invalid
from server.fields import is_int, show

MAX_MESSAGES = 1024
MAX_PROMPTS = 64  # prompts in one completions batch
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def read_prompts(value: Any, vocab_size: int, encoder: Any) -> list[list[int]]:
    """The token ids of each prompt of a completions `prompt`: a string, a list of token ids, a
    list of strings or a list of lists of token ids (a batch: one choice per prompt, or `n`),
    at most MAX_PROMPTS of them; an error in a batch names its entry (`prompt[2]`)."""
    if is_batch(value):
        if not (all(isinstance(p, str) for p in value) or all(isinstance(p, list) for p in value)):
            raise invalid("`prompt` must be a string, a list of token ids, a list of strings or "
                          "a list of lists of token ids; a batch may not mix strings and token "
                          "lists", "prompt")
        if len(value) > MAX_PROMPTS:
            raise invalid(f"`prompt` is a batch of {len(value)} prompts; at most {MAX_PROMPTS} "
                          "are allowed in one request", "prompt")
        return [read_prompt(p, vocab_size, encoder, f"prompt[{i}]") for i, p in enumerate(value)]
    return [read_prompt(value, vocab_size, encoder)]


def is_batch(value: Any) -> bool:
    """Whether a completions `prompt` is a batch: a list of strings or of token lists."""
    return isinstance(value, list) and bool(value) and \
        all(isinstance(p, (str, list)) for p in value)


def read_prompt(value: Any, vocab_size: int, encoder: Any, param: str = "prompt") -> list[int]:
    """The token ids of one prompt: a string, or token ids checked against the vocabulary."""
    if isinstance(value, (str, list)) and not value:
        # Before tokenizing: a tokenizer that adds BOS would turn "" into one token.
        raise invalid(f"`{param}` must not be empty", param)
    if isinstance(value, str):
        tokens = list(encoder.encode_prompt(value))
    elif isinstance(value, list) and all(is_int(t) for t in value):
        for token in value:
            if not 0 <= token < vocab_size:
                raise invalid(f"`{param}` token id {token} is outside the vocabulary "
                              f"[0, {vocab_size})", param)
        tokens = list(value)
    elif value is None:
        raise invalid(f"`{param}` is required", param)
    else:
        raise invalid(f"`{param}` must be a string or a list of token ids, got {show(value)}",
                      param)
    if not tokens:
        raise invalid(f"`{param}` must not be empty", param)
    return tokens


def read_messages(value: Any) -> list[dict[str, str]]:
    """Chat `messages` as [{"role", "content"}] with text content; refuses anything else."""
    if value is None:
        raise invalid("`messages` is required", "messages")
    if not isinstance(value, list) or not value:
        raise invalid("`messages` must be a non-empty list of message objects", "messages")
    if len(value) > MAX_MESSAGES:
        raise invalid(f"`messages` has {len(value)} entries; at most {MAX_MESSAGES}", "messages")
    return [_read_message(message, index) for index, message in enumerate(value)]


def _read_message(message: Any, index: int) -> dict[str, str]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid(f"`{param}` must be an object with `role` and `content`", param)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:  # an object is unhashable: no `in` on it
        raise invalid(f"`{param}.role` must be one of {sorted(ROLES)}, got {show(role)}",
                      f"{param}.role")
    for name in ("name", "tool_call_id"):
        if message.get(name) is not None and not isinstance(message[name], str):
            raise invalid(f"`{param}.{name}` must be a string, got {show(message[name])}",
                          f"{param}.{name}")
    _check_tool_calls(message.get("tool_calls"), f"{param}.tool_calls")
    return {"role": "system" if role == "developer" else role,
            "content": _read_content(message.get("content"), f"{param}.content")}


def _check_tool_calls(calls: Any, param: str) -> None:
    """OpenAI's shape is a list of {"id", "type": "function", "function": {"name",
    "arguments"}}; this server takes no `tools`, so only an empty list (or null) is accepted."""
    if calls is None:
        return
    if not isinstance(calls, list):
        raise invalid(f"`{param}` must be a list of tool calls, got {show(calls)}", param)
    if calls:
        raise invalid(f"`{param}` is not supported by this server (it takes no `tools`); "
                      "send [] or leave it out", param, code="unsupported_parameter")


def _read_content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise invalid(f"`{param}` parts must be {{\"type\": \"text\", \"text\": ...}}; "
                              "other content types are not supported", param)
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"`{param}` must be a string or a list of text parts", param)


class TokenizerEncoder:
    """Prompt encoding with an mlx-lm TokenizerWrapper (or anything with `encode`)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "has_chat_template", False))

    def encode_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    add_special_tokens: bool | None = None) -> list[int]:
        """The chat prompt's token ids. `add_special_tokens=None` is what the chat endpoint
        runs: none added to a model's own template (it writes its BOS itself, as Hugging Face's
        `apply_chat_template` does), the tokenizer's usual ones around the fallback template."""
        if add_special_tokens is None:
            add_special_tokens = not self.has_chat_template
        text = self.render_chat(messages, add_generation_prompt)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """The chat prompt as text: the tokenizer's template, else `simple_chat_template`."""
        if self.has_chat_template:
            return str(self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False))
        return simple_chat_template(messages, add_generation_prompt)

    def decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens))

    def token_strs(self, tokens: list[int]) -> list[str]:
        """Each token id's vocabulary entry (its raw piece, e.g. `Ġthe`), as vLLM reports."""
        return [str(piece) for piece in self.tokenizer.convert_ids_to_tokens(tokens)]


def simple_chat_template(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """Role-tagged turns ending with an open assistant turn, for tokenizers without a template."""
    turns = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return turns + "<|assistant|>\n" if add_generation_prompt else turns
