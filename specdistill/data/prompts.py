"""What the target is asked: the prompt of a logged conversation and the token ids it is sent as.

One definition for every stage that replays traffic: the nightly window (train and eval prompts),
target-answer generation, the benchmark, the monitor's replay and the CLI.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import PurePath
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


class ChatTemplateError(ValueError):
    """A chat template that cannot be applied; the message names where it came from."""


def check_chat_template(tokenizer, where: object) -> None:
    """Render the tokenizer's chat template once on a one-turn conversation, so a template the Jinja
    sandbox blocks (attribute access to internals, unsafe calls) or one that does not render stops the
    command before any work, as one line naming `where` (the model's directory), not a traceback."""
    if not getattr(tokenizer, "chat_template", None):
        return
    # lazy: jinja2 is transformers' chat-template extra, no dependency of ours; a template brings it
    from jinja2.exceptions import SecurityError, TemplateError

    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                      tokenize=False)
    except SecurityError as exc:
        raise ChatTemplateError(f"{where}: its chat template is blocked by the Jinja sandbox "
                                f"({str(exc).splitlines()[0]}); nothing is run with it") from None
    except TemplateError as exc:
        raise ChatTemplateError(f"{where}: its chat template does not render ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0] if str(exc) else ''})") from None


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


@dataclass
class Prompt:
    """The one prompt type of benchmarks, replays and answer generation: `text` or raw `ids` for a
    benchmark, the chat turns for whatever applies the template itself."""

    text: str = ""
    slice: str = "default"
    ids: list[int] | None = None  # raw token ids: used as they are, no template
    messages: list[dict] | None = None  # the chat turns, ending before the answer to generate
    id: str = ""  # an answers file's record id; a logged prompt: the conversation's id in the log store


def prompts_from_logs(store, tokenizer, split: str, n: int, *, seed: int | None = None,
                      max_prompt_tokens: int = MAX_PROMPT_TOKENS, slice_of: Mapping[str, str] | None = None
                      ) -> list[Prompt]:
    """Up to `n` prompts of a log store's `split` ("train" or "eval"), drawn as the nightly window
    draws them (`pipeline.stages.window.select_window`): an even share from every source that has
    conversations in the split, each share read from at most max(4·share, share + 16) conversations,
    keeping those `usable_prompt` keeps (skipped, never cut). `seed` None: each source's newest
    conversations; else `LogStore.sample` with that seed (the nightly's seeded sample). The slice is
    `slice_of[source]`, else the source's file name."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    # the store's sources by its index (its per-source statistics were a scan of every conversation)
    sources = [s for s in store.sources() if store.count(source=s, split=split)]
    picked: list[Prompt] = []
    for i, source in enumerate(sources):
        share = (n - len(picked)) // (len(sources) - i)
        scan = max(4 * share, share + 16)
        rows = (store.window(source=source, split=split, limit=scan) if seed is None
                else store.sample(scan, seed=seed, source=source, split=split))
        name = (slice_of or {}).get(source) or PurePath(source).name or source
        kept = 0
        for row in rows:
            if kept >= share:
                break
            prompt = usable_prompt(row.messages, tokenizer, max_prompt_tokens)
            if prompt is not None:
                picked.append(Prompt(id=str(row.id), messages=prompt[0], ids=prompt[1], slice=name))
                kept += 1
    return picked
