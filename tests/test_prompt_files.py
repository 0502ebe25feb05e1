"""Benchmark prompt files: plain text, JSONL prompts, and Spec-Bench's question.jsonl."""

from __future__ import annotations

import json

import pytest

from specdistill.data.prompt_files import PromptFileError, read_prompt_file

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
