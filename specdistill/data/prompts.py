"""What the target is asked: the prompt of a logged conversation and the token ids it is sent as.

One definition for every stage that replays traffic: the nightly window (train and eval prompts),
target-answer generation, the benchmark, the monitor's replay and the CLI.

    messages = prompt_messages(conversation.messages)    # None: nothing to replay
    ids = encode_chat(tokenizer, messages)                # chat template + assistant header
    usable_prompt(conversation.messages, tokenizer, 384)  # both, or None when too long
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# Longer prompts are skipped, never cut: a truncated prompt is not what production saw.
MAX_PROMPT_TOKENS = 384


def as_messages(messages: Iterable[Any]) -> list[dict]:
    """`{"role", "content"}` dicts from dicts or `formats.Message` objects."""
    out = []
    for m in messages:
        if isinstance(m, dict):
            out.append({"role": m["role"], "content": m["content"]})
        else:
            out.append({"role": m.role, "content": m.content})
    return out


def prompt_messages(messages: Iterable[Any]) -> list[dict] | None:
    """The turns before the first assistant answer, if they end with a user turn (else None):
    what the target answers when this conversation is replayed."""
    out = []
    for m in as_messages(messages):
        if m["role"] == "assistant":
            break
        out.append(m)
    return out if out and out[-1]["role"] == "user" else None


def encode_chat(tokenizer, messages: Iterable[Any]) -> list[int]:
    """The chat-templated prompt, ending with the assistant header the answer follows.

    A tokenizer without a chat template gets the turns' contents joined by newlines, tokenized
    as plain text (with the tokenizer's own special tokens, e.g. BOS).
    """
    messages = as_messages(messages)
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return list(tokenizer("\n".join(m["content"] for m in messages))["input_ids"])


def usable_prompt(messages: Iterable[Any], tokenizer, max_prompt_tokens: int = MAX_PROMPT_TOKENS
                  ) -> tuple[list[dict], list[int]] | None:
    """(prompt turns, ids) of a logged conversation, or None when it is not a prompt to replay:
    no user turn before the first answer, or more than `max_prompt_tokens` tokens."""
    prompt = prompt_messages(messages)
    if prompt is None:
        return None
    ids = encode_chat(tokenizer, prompt)
    if not ids or len(ids) > max_prompt_tokens:
        return None
    return prompt, ids
