"""The prompt definition every stage shares: the turns the target answers and the ids it is sent as."""

from __future__ import annotations

import pytest

from specdistill.data.formats import Message
from specdistill.data.prompts import encode_chat, prompt_messages, usable_prompt
from tests.conftest import train_bpe


@pytest.fixture(scope="module")
def tok():
    return train_bpe(300)


@pytest.fixture(scope="module")
def plain_tok():
    t = train_bpe(300)
    t.chat_template = None
    return t


def test_encode_chat_applies_the_template_with_the_assistant_header(tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    ids = encode_chat(tok, messages)
    assert ids == list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert tok.decode(ids).startswith("<|im_start|>system\nbe brief<|im_end|>")
    assert encode_chat(tok, [Message("system", "be brief"), Message("user", "hello world")]) == ids  # Message objects too


def test_encode_chat_without_a_template_joins_the_turns_as_plain_text(plain_tok, tok):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    ids = encode_chat(plain_tok, messages)
    assert ids == plain_tok("be brief\nhello world")["input_ids"]
    assert "<|im_start|>" not in plain_tok.decode(ids)
    assert ids != encode_chat(tok, messages)


def test_prompt_messages_stop_before_the_first_answer_and_need_a_user_turn():
    m = [Message("system", "s"), Message("user", "u"), Message("assistant", "a"), Message("user", "u2")]
    assert prompt_messages(m) == [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert prompt_messages([{"role": "user", "content": "u"}]) == [{"role": "user", "content": "u"}]
    assert prompt_messages([Message("system", "s"), Message("assistant", "a"), Message("user", "late")]) is None
    assert prompt_messages([Message("system", "only a system turn")]) is None
    assert prompt_messages([]) is None


def test_usable_prompt_skips_long_prompts_instead_of_cutting_them(tok):
    conversation = [Message("user", "the quick brown fox jumps over the lazy dog"), Message("assistant", "ok")]
    messages, ids = usable_prompt(conversation, tok, 10_000)
    assert messages == [{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}]
    assert ids == encode_chat(tok, messages)
    assert usable_prompt(conversation, tok, len(ids)) == (messages, ids)  # the bound is inclusive
    assert usable_prompt(conversation, tok, len(ids) - 1) is None
    assert usable_prompt([Message("assistant", "hi"), Message("user", "q")], tok, 10_000) is None


def _log_store(tmp_path, eval_fraction: float):
    from specdistill.data.logstore import LogStore
    from specdistill.data.readers import Conversation

    store = LogStore(f"sqlite:///{tmp_path / 'logs.db'}", eval_fraction=eval_fraction)
    run = store.begin_run("x", "jsonl", 0)
    for source in ("/logs/chat.jsonl", "/logs/code.jsonl"):
        store.add_batch(run, [Conversation([Message("user", f"{source} question {i}"), Message("assistant", "ok")], source, f"{i}",
                                           timestamp=1_700_000_000 + i) for i in range(12)])
    store.add_batch(run, [Conversation([Message("assistant", "hi"), Message("user", "no prompt")], "/logs/chat.jsonl", "x",
                                       timestamp=1_800_000_000)])  # newest, but nothing to replay
    return store


def test_prompts_from_logs_draw_a_split_evenly_per_source_newest_or_seeded(tmp_path, tok):
    from specdistill.data.prompts import prompts_from_logs

    with _log_store(tmp_path, eval_fraction=1.0) as store:
        newest = prompts_from_logs(store, tok, "eval", 4)
        assert [p.slice for p in newest] == ["chat.jsonl", "chat.jsonl", "code.jsonl", "code.jsonl"]
        assert [p.messages[-1]["content"].split()[-1] for p in newest] == ["11", "10", "11", "10"]
        assert all(p.ids == encode_chat(tok, p.messages) for p in newest)
        seeded = prompts_from_logs(store, tok, "eval", 4, seed=3, slice_of={"/logs/code.jsonl": "code"})
        assert seeded == prompts_from_logs(store, tok, "eval", 4, seed=3, slice_of={"/logs/code.jsonl": "code"})
        assert {p.slice for p in seeded} == {"chat.jsonl", "code"}
        assert prompts_from_logs(store, tok, "train", 4) == []  # every conversation went to eval
        assert len(prompts_from_logs(store, tok, "eval", 4, max_prompt_tokens=3)) == 0  # too long: skipped, not cut
        with pytest.raises(ValueError, match="split must be"):
            prompts_from_logs(store, tok, "test", 4)
