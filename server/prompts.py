"""Turning prompts and chat messages into token ids with the served model's tokenizer.

Chat messages (server/messages.py `prompt_messages`, rendered for tools by server/tool_request.py
`chat_inputs`) become a prompt through the tokenizer's own chat template when it has one (given
the offered tools), else through a simple role-tagged template (the built-in model has none).
"""

from __future__ import annotations

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
        text = self.render_chat(messages, add_generation_prompt, tools)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

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


def simple_chat_template(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """Role-tagged turns ending with an open assistant turn, for tokenizers without a template."""
    turns = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return turns + "<|assistant|>\n" if add_generation_prompt else turns
