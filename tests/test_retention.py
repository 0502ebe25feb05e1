"""Retention and forgetting: `logs prune` keeps what a registered draft names, `logs forget` leaves no trace of a user."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch

from specdistill.data.logstore import LogStore
from specdistill.distill.shards import write_shard
from specdistill.pipeline import retention
from specdistill.speculative.suffix_corpus import CorpusMeta, load_corpus, save_corpus

REPO = Path(__file__).resolve().parents[1]
PLANTED = "zebra-quokka-7781"  # user U's unique text


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("SPECDISTILL_LOG_DB", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path / "state"


def traffic(path: Path, when: datetime, n: int = 6, user_u: bool = True) -> None:
    lines = []
    for i in range(n):
        user = "user-U" if user_u and i % 3 == 0 else f"user-{i}"
        text = f"{PLANTED} question {i}" if user == "user-U" else f"ordinary question {i} {when:%j}"
        lines.append(json.dumps({"request": {"messages": [{"role": "user", "content": text}], "user": user},
                                 "response": {"created": int(when.timestamp()) + i, "choices": [
                                     {"message": {"role": "assistant", "content": f"answer to {text}"}}]}}))
    lines.append('{"request": {"user": "user-U", "messages": [{"content": "' + PLANTED + ' cut sho')  # malformed
    path.write_text("\n".join(lines) + "\n")


def night(home: Path, key: str, store: LogStore) -> Path:
    """A night's data directory as the answer stage leaves it: answers, held-out answers, a teacher shard, a corpus."""
    directory = home / "nightly" / "data" / f"{key}-fp-cfg-harness"
    (directory / "teacher_cache").mkdir(parents=True)
    rows = store.window(newest_first=False)
    train, evals = rows[: len(rows) - 2], rows[len(rows) - 2 :]
    for name, part in (("train_generated.jsonl", train), ("eval_generated.jsonl", evals)):
        (directory / name).write_text("".join(json.dumps({"id": str(r.id), "prompt": [m.__dict__ for m in r.messages[:1]],
                                                          "response": r.messages[1].content, "response_ids": [r.id, 7]})
                                              + "\n" for r in part))
    write_shard(directory / "teacher_cache" / "shard-00000.safetensors",
                {f"{r.id}/input_ids": torch.tensor([r.id, 7]) for r in train})
    corpus = directory / "suffix_corpus.safetensors"
    save_corpus(corpus, [[r.id, 7] for r in train], CorpusMeta("fp", "tok", sources=[str(directory / "train_generated.jsonl")]))
    corpus.with_name("suffix_corpus.sglang.jsonl").write_text("".join(json.dumps(r.messages[1].content) + "\n" for r in train))
    return directory


def files_holding(root: Path, needle: bytes) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


def test_forget_a_user_leaves_no_trace_under_the_state_directory_and_names_the_drafts(home, tmp_path, monkeypatch):
    from specdistill.data.ingest import ingest

    log = tmp_path / "gateway.jsonl"
    traffic(log, datetime(2026, 11, 20, tzinfo=timezone.utc), n=9)
    with LogStore() as store:
        ingest(log, "openai", store, progress=False)
        directory = night(home, "abc123", store)
        u_ids = [r.id for r in store.window() if r.messages[0].content.startswith(PLANTED)]
    monkeypatch.setattr(retention, "registered_windows", lambda: {"abc123": ["draft-demo v3"]})
    assert files_holding(home, PLANTED.encode())  # it was there
    report = retention.forget(user="user-U")
    assert report.removed["conversations"] == len(u_ids) == 3 and report.drafts == ["draft-demo v3"]
    assert files_holding(home, PLANTED.encode()) == []  # not in the database, its log, answers, corpora, exports
    sequences, _ = load_corpus(directory / "suffix_corpus.safetensors")
    assert {int(s[0]) for s in sequences}.isdisjoint(u_ids) and len(sequences) > 0  # rebuilt without them
    with LogStore() as store:
        assert store.count() == 6 and store.decisions(kind="forget")[0]["payload"]["removed"]["conversations"] == 3
        assert "user-U" not in json.dumps(store.decisions(kind="forget"), default=str)  # recorded without what was asked
    again = retention.forget(user="user-U")  # idempotent
    assert again.removed["conversations"] == 0 and again.removed["answer records"] == 0


def test_prune_removes_the_old_but_keeps_a_registered_draft_s_window_unless_forced(home, tmp_path, monkeypatch):
    from specdistill.data.ingest import ingest

    now = datetime.now(timezone.utc)
    old_log, new_log = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    traffic(old_log, now - timedelta(days=40), user_u=False)
    with LogStore() as store:
        ingest(old_log, "openai", store, progress=False)
        kept_dir = night(home, "champ1", store)  # the champion's window: 4 train + 2 held-out of the old traffic
        other = night(home, "stale2", store)
        old_time = (now - timedelta(days=35)).timestamp()
        for p in [other, *other.rglob("*")]:
            os.utime(p, (old_time, old_time))
    traffic(new_log, now - timedelta(days=2), user_u=False)
    with LogStore() as store:
        ingest(new_log, "openai", store, progress=False)
        assert store.count() == 12 and store.count_quarantined() == 2
    monkeypatch.setattr(retention, "registered_windows", lambda: {"champ1": ["draft-demo v1"]})
    report = retention.prune(timedelta(days=30))
    assert report.removed["conversations"] == 0 and report.removed["nights' data directories"] == 1
    assert "6 older ones" in report.kept["conversations"] and "draft-demo v1" in report.kept["nights' data"]
    assert kept_dir.is_dir() and not other.exists()
    for p in [kept_dir, *kept_dir.rglob("*")]:
        os.utime(p, (old_time, old_time))
    forced = retention.prune(timedelta(days=30), force=True, now=now + timedelta(hours=1))
    assert forced.removed["conversations"] == 6 and not kept_dir.exists()
    with LogStore() as store:
        assert store.count() == 6 and min(c.arrived_at for c in store.window()) > now - timedelta(days=3)
        assert store.decisions(kind="prune")[0]["payload"]["removed"]["conversations"] == 6


def test_logs_prune_and_forget_commands(home, tmp_path):
    log = tmp_path / "gateway.jsonl"
    traffic(log, datetime.now(timezone.utc) - timedelta(days=50))
    env = {**os.environ, "SPECDISTILL_HOME": str(home), "PYTHONPATH": str(REPO)}

    def cli(*args: str) -> dict:
        out = subprocess.run([sys.executable, "-m", "specdistill.cli", *args, "--json"], capture_output=True, text=True,
                             env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    cli("ingest", str(log), "--format", "openai", "--no-progress")
    assert cli("logs", "forget", "--user", "user-U")["removed"]["conversations"] == 2
    assert cli("logs", "prune", "--older-than", "30d")["removed"]["conversations"] == 4
    assert cli("logs", "stats")["conversations"] == 0


def test_logs_prune_loads_no_model_library(home, tmp_path):
    """Pruning a store reads no tensor: `logs prune` imports neither torch nor transformers (it peaked at 648 MB
    when it did), and prunes."""
    log = tmp_path / "gateway.jsonl"
    traffic(log, datetime.now(timezone.utc) - timedelta(days=50))
    code = ("import sys; from specdistill.cli import main\n"
            "code = main(['ingest', sys.argv[1], '--format', 'openai', '--no-progress'])\n"
            "code = code or main(['logs', 'prune', '--older-than', '30d'])\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules)); sys.exit(code)")
    env = {**os.environ, "SPECDISTILL_HOME": str(home), "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code, str(log)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "removed" in out.stdout and out.stdout.strip().splitlines()[-1] == "[]"
