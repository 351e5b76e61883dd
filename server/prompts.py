"""Turning prompts and chat messages into token ids with the served model's tokenizer.

Chat messages (server/messages.py `prompt_messages`, rendered for tools by server/tool_request.py
`chat_inputs`) become a prompt through the tokenizer's own chat template when it has one (given
the offered tools), else through a simple role-tagged template (the built-in model has none).

A message's text is text: the tokenizer parses its special tokens (`</s>`, `<|im_end|>`) out of
any string it encodes, so a client could end a turn or open another inside a message by writing
the marker. `encode_chat` puts a placeholder where a message (or a tool's definition) holds a
special token's text, renders, and encodes the placeholders' tokens as the plain characters
(`split_special_tokens`): the control tokens in a chat prompt are the template's alone. A prompt
of /v1/completions is the client's raw prompt and keeps them (as vLLM's and Hugging Face's).
"""

from __future__ import annotations

import functools
import re
import secrets
from typing import Any


class TokenizerEncoder:
    """Prompt encoding with an mlx-lm TokenizerWrapper (or anything with `encode`)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "has_chat_template", False))

    def encode_prompt(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's own chat template (None: the fallback renders chats)."""
        template = getattr(self.tokenizer, "chat_template", None)
        return template if self.has_chat_template and isinstance(template, str) else None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    add_special_tokens: bool | None = None,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The chat prompt's token ids. `add_special_tokens=None` is what the chat endpoint
        runs: none added to a model's own template (it writes its BOS itself, as Hugging Face's
        `apply_chat_template` does), the tokenizer's usual ones around the fallback template."""
        if add_special_tokens is None:
            add_special_tokens = not self.has_chat_template
        specials = self.special_texts
        mark = secrets.token_hex(8)
        found: list[str] = []

        def escape(value: Any) -> Any:  # each special token's text in a string, a placeholder
            if isinstance(value, str):
                return specials.sub(lambda m: _placeholder(mark, found, m.group()), value) \
                    if specials is not None else value
            if isinstance(value, dict):
                return {k: escape(v) for k, v in value.items()}
            if isinstance(value, list):
                return [escape(v) for v in value]
            return value

        text = self.render_chat(escape(messages), add_generation_prompt, escape(tools))
        if not found:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        ids: list[int] = []
        # split keeps the groups: template text, then a placeholder's index, alternately.
        for k, part in enumerate(re.split(rf"\[\[fairtick-{mark}-(\d+)\]\]", text)):
            ids += self.tokenizer.encode(found[int(part)], add_special_tokens=False,
                                         split_special_tokens=True) if k % 2 else \
                self.tokenizer.encode(part, add_special_tokens=False) if part else []
        if not add_special_tokens:
            return ids
        prefix, suffix = self._added_around
        return prefix + ids + suffix

    @functools.cached_property
    def special_texts(self) -> re.Pattern[str] | None:
        """What matches any special token's text (longest first); None if it has none."""
        inner = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
        added = getattr(inner, "added_tokens_decoder", None) or {}
        texts = {t.content for t in added.values() if getattr(t, "special", False)} | set(
            getattr(inner, "all_special_tokens", None) or [])
        texts = {t for t in texts if t}
        if not texts:
            return None
        return re.compile("|".join(map(re.escape, sorted(texts, key=len, reverse=True))))

    @functools.cached_property
    def _added_around(self) -> tuple[list[int], list[int]]:
        return added_around(self.tokenizer)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The chat prompt as text: the tokenizer's template (given `tools` when there are),
        else `simple_chat_template` (server/tool_request.py put the tools in the messages)."""
        if self.has_chat_template:
            extra = {"tools": tools} if tools else {}
            return str(self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra))
        return simple_chat_template(messages, add_generation_prompt)

    def decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens))

    def token_strs(self, tokens: list[int]) -> list[str]:
        """Each token id's vocabulary entry (its raw piece, e.g. `Ġthe`), as vLLM reports."""
        return [str(piece) for piece in self.tokenizer.convert_ids_to_tokens(tokens)]


def added_around(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The tokens `tokenizer.encode` adds before and after a text (BOS, EOS) by default."""
    bare = list(tokenizer.encode("a", add_special_tokens=False))
    full = list(tokenizer.encode("a", add_special_tokens=True))
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return full[:start], full[start + len(bare):]
    raise ValueError("the tokenizer's added special tokens do not surround its text")


def _placeholder(mark: str, found: list[str], special: str) -> str:
    # ASCII, so a template's `tojson` writes it unchanged; `mark` is fresh for each prompt.
    found.append(special)
    return f"[[fairtick-{mark}-{len(found) - 1}]]"


def simple_chat_template(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """Role-tagged turns ending with an open assistant turn, for tokenizers without a template."""
    turns = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return turns + "<|assistant|>\n" if add_generation_prompt else turns
