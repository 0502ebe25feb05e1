"""Benchmark prompt files: plain text, JSONL prompts, and Spec-Bench's question.jsonl."""

from __future__ import annotations

import json

import pytest

from specdistill.data.prompt_files import PromptFileError, read_prompt_file
from specdistill.data.prompts import Prompt
from specdistill.pipeline.stages.answers.answer_file import answer_record

SPEC_BENCH = [
    {"question_id": 81, "category": "writing", "turns": ["Compose a travel blog post.", "Rewrite it so every sentence starts with A."]},
    {"question_id": 1001, "category": "multilingual_translation_very_long_name", "turns": ["Translate: Guten Morgen"]},
]


def write(tmp_path, lines):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_spec_bench_first_turn_by_default_category_is_the_slice(tmp_path):
    records = read_prompt_file(write(tmp_path, SPEC_BENCH))
    assert [(r.turns, r.slice, r.id) for r in records] == [
        (["Compose a travel blog post."], "writing", "81"),
        (["Translate: Guten Morgen"], "multilingual_translation_very_long_name", "1001"),
    ]
    assert read_prompt_file(write(tmp_path, SPEC_BENCH), turns="all")[0].turns == SPEC_BENCH[0]["turns"]


def test_plain_text_and_prompt_jsonl_mix(tmp_path):
    records = read_prompt_file(write(tmp_path, ["hello there", {"prompt": "sum 2+2", "slice": "math"}, ""]))
    assert [(r.turns, r.slice) for r in records] == [(["hello there"], "default"), (["sum 2+2"], "math")]


@pytest.mark.parametrize("line, message", [
    ({"question": "x"}, "prompts.jsonl:2: expected"),
    ({"question_id": 1, "turns": []}, "prompts.jsonl:2: Spec-Bench layout: 'turns'"),
    ({"prompt": ""}, "prompts.jsonl:2: key 'prompt'"),
    ("{not json", "prompts.jsonl:2: not valid JSON"),
])
def test_a_line_in_neither_layout_names_the_line_and_what_was_expected(tmp_path, line, message):
    with pytest.raises(PromptFileError, match=message):
        read_prompt_file(write(tmp_path, ["fine", line]))


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(PromptFileError, match="not found"):
        read_prompt_file(tmp_path / "nope.jsonl")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(PromptFileError, match="no prompts"):
        read_prompt_file(tmp_path / "empty.txt")


def test_a_binary_file_or_a_directory_is_named_not_a_utf8_traceback(tmp_path):
    binary = tmp_path / "prompts.bin"
    binary.write_bytes(b"first prompt\n\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(PromptFileError, match=r"prompts.bin:2: not UTF-8 text \(byte 1 of the line is 0x89\)"):
        read_prompt_file(binary)
    with pytest.raises(PromptFileError, match="is a directory"):
        read_prompt_file(tmp_path)
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(b"one\r\ntwo\r\n")
    assert [r.turns for r in read_prompt_file(crlf)] == [["one"], ["two"]]


class _Decoder:  # what `answer_record` asks of a tokenizer
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_the_nightlys_own_answers_and_conversations_are_prompt_files(tmp_path):
    """The held-out answers file a nightly writes (`eval_generated.jsonl`, written here by the same
    `answer_record`) and a conversations file (`{"messages"}`): their user messages are the turns."""
    multi = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Correct it"},
             {"role": "assistant", "content": "Which one?"}, {"role": "user", "content": "The first"}]
    answers = [answer_record(Prompt(messages=[{"role": "user", "content": "Correct it and give me the good one"}],
                                    id="5759"), [1, 2, 3], [4, 5, 2], _Decoder(), "eos", 0.0),
               answer_record(Prompt(messages=multi, id="949"), [1, 2], [6, 2], _Decoder(), "length", 0.0)]
    heldout = write(tmp_path, answers)
    records = read_prompt_file(heldout)
    assert [(r.turns, r.slice, r.id) for r in records] == [(["Correct it and give me the good one"], "default", "5759"),
                                                           (["Correct it"], "default", "949")]
    assert read_prompt_file(heldout, turns="all")[1].turns == ["Correct it", "The first"]
    conversations = write(tmp_path, [{"id": "7", "messages": multi, "slice": "chat"}])
    assert [(r.turns, r.slice) for r in read_prompt_file(conversations, turns="all")] == [(["Correct it", "The first"], "chat")]


@pytest.mark.parametrize("line, message", [
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "needs at least one user message"),
    ({"prompt": [{"role": "user", "content": ""}]}, "needs at least one user message"),
    ({"messages": "hello"}, "must be a list of"),
])
def test_a_chat_record_without_a_user_turn_names_the_line(tmp_path, line, message):
    with pytest.raises(PromptFileError, match=f"prompts.jsonl:2: chat layout: .*{message}"):
        read_prompt_file(write(tmp_path, ["fine", line]))
