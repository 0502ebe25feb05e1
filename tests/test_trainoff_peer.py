"""benchmarks/peer/speculators_trainoff.py's P-EAGLE side, run in speculators' own environment (`make speculators`)
on a tiny random target: it trains speculators' P-EAGLE a few steps and reads every drafted position, and its
held-out reading (every anchor at every depth in one forward) drafts what a round from one anchor alone drafts."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from tests.conftest import save_tiny_target

PEER = Path(__file__).resolve().parents[1] / "benchmarks" / "peer"
DEPTHS = 8  # speculators' P-EAGLE default


def side_env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(PEER),
            "TORCH_COMPILE_DISABLE": "1"}


def sequences(n: int, vocab: int, rng: random.Random) -> list[dict]:
    """Random token sequences: a prompt of 6 tokens, then an answer (the loss mask) of 10-30."""
    out = []
    for _ in range(n):
        answer = rng.randint(10, 30)
        ids = [rng.randrange(3, vocab) for _ in range(6 + answer)]
        out.append({"ids": ids, "mask": [False] * 6 + [True] * answer})
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory, speculators_env):
    root = tmp_path_factory.mktemp("trainoff_peer")
    target = save_tiny_target(root / "target", layers=8, seed=3, tie=False)
    rng = random.Random(0)
    examples = {"train": sequences(12, 300, rng), "heldout": sequences(3, 300, rng)}
    (root / "examples.json").write_text(json.dumps(examples))
    return speculators_env, target, root, examples


def test_peagle_trains_and_reads_each_of_its_positions(world, tmp_path):
    env, target, root, examples = world
    spec = {"target": str(target), "examples": str(root / "examples.json"), "out": str(tmp_path), "kind": "peagle",
            "name": "peagle", "minutes": 0.01, "tokens": 0, "cap_minutes": 1.0, "draft_vocab_size": 64,
            "total_seq_len": 128, "seed": 0, "dtype": "float32", "threads": 1, "norms": True, "evaluate": {}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run([str(env.python), str(PEER / "speculators_trainoff.py"), str(tmp_path / "spec.json")],
                          env=side_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "peagle_result.json").read_text())
    assert result["kind"] == "peagle" and result["train"]["saved"]["minutes"]["steps"] >= 1
    config = json.loads((tmp_path / "peagle-minutes" / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle"
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == DEPTHS
    h = result["heldout"]["minutes"]
    # position 1 drafts token i+2 at every entry i: one label per answer token from the third token on
    assert h["entries"] == sum(sum(s["mask"][2:]) for s in examples["heldout"])
    assert len(h["accepted"]) == len(h["given_previous"]) == len(h["tau_chain_at"]) == DEPTHS
    assert all(a >= b for a, b in zip(h["accepted"], h["accepted"][1:]))  # a chain only shortens
    assert h["tau_chain_at"] == pytest.approx([1 + sum(h["accepted"][:k]) for k in range(1, DEPTHS + 1)])


ANCHORS_ALONE = """
import json, sys, torch
import speculators_trainoff as t
spec = json.loads(open(sys.argv[1]).read())
examples = json.loads(open(spec["examples"]).read())
torch.manual_seed(0)
aux = [2, 4, 5]
states = t.target_states(spec["target"], examples["train"][:4], aux, torch.float32)
d2t, t2d = t.draft_vocabulary(states, 64, 300)
model = t.build_draft(spec["target"], d2t, t2d, 64, True, "peagle").eval()
with torch.no_grad():
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.05)  # not the initial weights: every depth drafts something of its own
b = t.shifted(states[0])
n, depths = b["input_ids"].numel(), 4
anchors = torch.arange(n - depths)
every = torch.cat([torch.arange(n)] + [anchors] * (depths - 1))
depth = torch.cat([torch.zeros(n, dtype=torch.long)] + [torch.full((anchors.numel(),), d) for d in range(1, depths)])
with torch.no_grad():
    together = t.parallel_logits(model, b, every, depth, torch.float32, depths)
    worst = 0.0
    for a in (0, 5, int(anchors[-1])):
        alone = t.parallel_logits(model, b, torch.cat([torch.arange(n), torch.full((depths - 1,), a)]),
                                  torch.cat([torch.zeros(n, dtype=torch.long), torch.arange(1, depths)]), torch.float32, depths)
        rows = [n + (d - 1) * anchors.numel() + a for d in range(1, depths)]
        worst = max(worst, float((together[rows] - alone[n:]).abs().max()), float((together[:n] - alone[:n]).abs().max()))
print(json.dumps({"worst": worst, "scale": float(together.abs().max())}))
"""


def test_every_anchor_at_once_drafts_what_one_anchor_alone_drafts(world, tmp_path):
    """The mask lets a mask position see its own round and the context before its anchor, nothing else: so
    reading all anchors in one forward is exact, not an approximation of drafting round by round."""
    env, target, root, _ = world
    spec = {"target": str(target), "examples": str(root / "examples.json")}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run([str(env.python), "-c", ANCHORS_ALONE, str(tmp_path / "spec.json")],
                          env=side_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["scale"] > 0.1 and out["worst"] < 1e-4 * out["scale"]
