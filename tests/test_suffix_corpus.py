"""The suffix corpus file: round trip, versioning by target and tokenizer, bad files named, the train split only."""

from __future__ import annotations

import json

import pytest
import torch

from specdistill.data.logstore import LogStore
from specdistill.data.readers import Conversation, Message
from specdistill.pipeline.stages.corpus import build_corpus, read_answers
from specdistill.speculative.suffix_corpus import (
    CorpusError,
    CorpusMeta,
    corpus_is_current,
    load_corpus,
    load_suffix_drafter,
    read_corpus_meta,
    save_corpus,
)

SEQS = [[1, 2, 3, 4], [5, 6], [1, 2, 3, 9, 9]]


def _meta(**kw) -> CorpusMeta:
    return CorpusMeta(**{"target_fingerprint": "fp-a", "tokenizer": "tok-a", **kw})


def test_round_trip_keeps_sequences_and_metadata(tmp_path):
    path = save_corpus(tmp_path / "c.safetensors", SEQS, _meta(sources=["x.jsonl"]))
    seqs, meta = load_corpus(path, "fp-a", "tok-a")
    assert [s.tolist() for s in seqs] == SEQS
    assert (meta.sequences, meta.tokens, meta.sources, meta.split) == (3, 11, ["x.jsonl"], "train")
    drafter = load_suffix_drafter(path, "fp-a", "tok-a")
    assert drafter.name == "suffix:c.safetensors" and drafter.note == ""
    assert drafter.draft(torch.tensor([0, 1, 2, 3]), 4).tokens == [4]


def test_another_target_or_tokenizer_is_refused_naming_the_file(tmp_path):
    path = save_corpus(tmp_path / "c.safetensors", SEQS, _meta())
    with pytest.raises(CorpusError, match=r"c\.safetensors.*target fp-a, not of this target \(fp-b\)"):
        load_corpus(path, "fp-b")
    with pytest.raises(CorpusError, match=r"c\.safetensors.*another tokenizer"):
        load_corpus(path, "fp-a", "tok-b")
    assert corpus_is_current(path, "fp-a") == (True, "")
    current, why = corpus_is_current(path, "fp-b")
    assert not current and "stale" in why and "fp-b" in why


def test_truncated_and_corrupt_files_fail_with_the_file_named(tmp_path):
    path = save_corpus(tmp_path / "c.safetensors", SEQS, _meta())
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) - 7])
    with pytest.raises(CorpusError, match=r"cut\.safetensors is truncated or corrupt"):
        load_corpus(cut)
    flipped = tmp_path / "flipped.safetensors"
    flipped.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # the last token's bytes
    with pytest.raises(CorpusError, match=r"flipped\.safetensors fails its checksum"):
        load_corpus(flipped)
    with pytest.raises(CorpusError, match=r"missing\.safetensors does not exist"):
        load_corpus(tmp_path / "missing.safetensors")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_text("not a corpus")
    with pytest.raises(CorpusError, match="garbage.safetensors"):
        read_corpus_meta(garbage)


def test_empty_corpus_drafts_from_the_request_and_says_so(tmp_path, caplog):
    path = save_corpus(tmp_path / "empty.safetensors", [], _meta())
    drafter = load_suffix_drafter(path)
    assert drafter.corpus is None and "empty" in drafter.note and "request's own context" in drafter.note
    assert "empty" in caplog.text
    assert drafter.draft(torch.tensor([1, 2, 1]), 4).tokens == [2]


def _store_with_answers(tmp_path):
    """A log store with train and eval prompts, and an answers file for each split (as the nightly writes)."""
    store = LogStore(f"sqlite:///{tmp_path / 'logs.db'}")
    run = store.begin_run("src", "jsonl", 0)
    store.add_batch(run, [Conversation([Message("user", f"prompt {i}"), Message("assistant", "a")], "src", f"f:{i}")
                          for i in range(200)])
    rows = store.window()
    store.close()
    files = {}
    for split in ("train", "eval"):
        chosen = [r for r in rows if r.split == split][:5]
        path = tmp_path / f"{split}_generated.jsonl"
        path.write_text("".join(json.dumps({"id": str(r.id), "response_ids": [r.id % 7, 1, 2, 3]}) + "\n" for r in chosen))
        files[split] = path
    return f"sqlite:///{tmp_path / 'logs.db'}", files


def test_corpus_from_train_answers_and_refused_from_held_out_ones(tmp_path):
    db, files = _store_with_answers(tmp_path)
    out = build_corpus([files["train"]], tmp_path / "corpus.safetensors", target_fingerprint="fp", tokenizer="tok", log_db=db)
    seqs, meta = load_corpus(out, "fp", "tok")
    assert len(seqs) == 5 and meta.sources == [str(files["train"])]
    with pytest.raises(CorpusError, match=r"eval_generated\.jsonl: 5 answers are to held-out \(eval\) prompts"):
        build_corpus([files["train"], files["eval"]], tmp_path / "leak.safetensors", target_fingerprint="fp",
                     tokenizer="tok", log_db=db)
    assert not (tmp_path / "leak.safetensors").exists()
    capped = build_corpus([files["train"]], tmp_path / "capped.safetensors", target_fingerprint="fp", tokenizer="tok",
                          log_db=db, max_tokens=9)
    assert read_corpus_meta(capped).sequences == 2  # the newest two answers of 4 tokens fit


def test_answers_file_errors_name_the_line_and_a_torn_tail_is_skipped(tmp_path):
    path = tmp_path / "train_generated.jsonl"
    path.write_text('{"id": "1", "response_ids": [1, 2]}\n{"id": "2", "response_ids": [3]}\n{"id": "3", "resp')
    assert [r["id"] for r in read_answers(path)] == ["1", "2"]
    path.write_text('{"id": "1", "response_ids": [1, 2]}\n{"id": "2"}\n{"id": "3", "response_ids": [3]}\n')
    with pytest.raises(CorpusError, match=r"train_generated\.jsonl:2: not an answer record"):
        read_answers(path)


def _corpus_with_edited_tokenizer(tmp_path):
    """A tiny target, and a corpus built for its fingerprint whose tokenizer digest was edited afterwards."""
    from specdistill.modeling.models import load_model
    from tests.conftest import save_tiny_target

    target_dir = save_tiny_target(tmp_path / "target")
    target = load_model(target_dir, dtype="float32")
    good = save_corpus(tmp_path / "good.safetensors", SEQS, _meta(target_fingerprint=target.fingerprint,
                                                                   tokenizer=target.tokenizer_digest))
    edited = save_corpus(tmp_path / "edited.safetensors", SEQS, _meta(target_fingerprint=target.fingerprint,
                                                                       tokenizer="0" * 64))
    return target_dir, target, good, edited


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_generate_and_bench_suffix_refuse_a_corpus_of_another_tokenizer(tmp_path, capsys, command):
    """`generate --suffix` and `bench --suffix` checked the target's fingerprint only: an edited tokenizer digest
    was used as it was."""
    from specdistill.cli import main

    target_dir, _, good, edited = _corpus_with_edited_tokenizer(tmp_path)
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["hello world"]}) + "\n")
    where = ["--prompt-ids", "1,2,3"] if command == "generate" else ["--prompts", str(prompts), "--repeats", "1"]
    argv = [command, "--target", str(target_dir), "--dtype", "float32", "--max-new-tokens", "4", "--threads", "1", *where]
    assert main([*argv, "--suffix", str(edited)]) == 2
    err = capsys.readouterr().err
    assert "edited.safetensors holds token ids of another tokenizer" in err and "Traceback" not in err
    assert main([*argv, "--suffix", str(good), "--json"]) == 0


def test_pipeline_and_monitor_paths_check_the_corpus_tokenizer(tmp_path):
    """The nightly's benchmark and the monitor build suffix drafters from specs with the target's identity."""
    from specdistill.speculative import drafter_from_spec

    _, target, good, edited = _corpus_with_edited_tokenizer(tmp_path)
    key = {"target_fingerprint": target.fingerprint, "target_tokenizer": target.tokenizer_digest}
    assert drafter_from_spec(target.model, f"suffix:{good}", **key).corpus is not None
    for spec in (f"suffix:{edited}", f"hybrid:{target.path},{edited}"):
        with pytest.raises(CorpusError, match="another tokenizer"):
            drafter_from_spec(target.model, spec, **key)
    assert corpus_is_current(good, target.fingerprint, target.tokenizer_digest) == (True, "")
    current, why = corpus_is_current(edited, target.fingerprint, target.tokenizer_digest)
    assert not current and "another tokenizer" in why


def test_a_corpus_with_ids_outside_the_targets_vocabulary_is_refused_naming_the_id(tmp_path, capsys):
    """A corpus whose checksum is valid but whose ids run past the target's vocabulary (or below 0) drafted
    them, and the target's embedding lookup raised an IndexError mid-generation."""
    from specdistill.cli import main

    target_dir, target, _, _ = _corpus_with_edited_tokenizer(tmp_path)
    vocab = target.model.config.vocab_size
    key = {"target_fingerprint": target.fingerprint, "tokenizer": target.tokenizer_digest}
    for name, bad in (("big", vocab + 5), ("negative", -3)):
        path = save_corpus(tmp_path / f"{name}.safetensors", [[1, 2, 3, bad, 4], [1, 2, 3, bad]],
                           _meta(target_fingerprint=target.fingerprint, tokenizer=target.tokenizer_digest))
        with pytest.raises(CorpusError, match=rf"{name}\.safetensors holds token id {bad} .*vocabulary of {vocab} ids is 0 to {vocab - 1}"):
            load_corpus(path, vocab_size=vocab, **key)
        argv = ["generate", "--target", str(target_dir), "--dtype", "float32", "--max-new-tokens", "8", "--threads", "1",
                "--prompt-ids", "1,2,3", "--suffix", str(path)]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{name}.safetensors holds token id {bad}" in err and "Traceback" not in err
