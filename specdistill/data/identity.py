"""What makes two logged conversations one, and which side of the train/eval split a conversation falls on:
hashes of its normalized messages. Light on purpose (no database): the process that parses a big file
imports it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from specdistill.data.formats import Message

DEFAULT_EVAL_FRACTION = 0.05


def content_hash(messages: Sequence[Message]) -> str:
    """SHA-256 over each turn's role and length-prefixed UTF-8 content: equal iff the messages are."""
    digest = hashlib.sha256()
    for m in messages:
        data = m.content.encode("utf-8")
        digest.update(f"{m.role}:{len(data)}:".encode())
        digest.update(data)
    return digest.hexdigest()


def prompt_hash(messages: Sequence[Message]) -> str:
    """Hash of the opening prompt: system turns plus the first user turn."""
    first_user = next(i for i, m in enumerate(messages) if m.role == "user")
    return content_hash(messages[: first_user + 1])


def hashes(messages: Sequence[Message]) -> tuple[str, str]:
    """(content_hash, prompt_hash) in one pass over the messages: the prompt's digest is the content's
    digest read at the first user turn (a digest read goes on as before)."""
    digest = hashlib.sha256()
    prompt = None
    for m in messages:
        data = m.content.encode("utf-8")
        digest.update(f"{m.role}:{len(data)}:".encode())
        digest.update(data)
        if prompt is None and m.role == "user":
            prompt = digest.hexdigest()
    return digest.hexdigest(), prompt if prompt is not None else prompt_hash(messages)  # no user turn: its error


def split_of(prompt_digest: str, eval_fraction: float = DEFAULT_EVAL_FRACTION) -> str:
    return "eval" if int(prompt_digest[:8], 16) < eval_fraction * 0x1_0000_0000 else "train"
