"""Stage: the night's answers join their target version's answer pool (`distill.pool`), and the night
trains on the pool's view instead of its window alone.

Before the view is made, the pool's disk cap evicts the oldest nights; after a target update (the
monitor sets `pool.reanswer_from` to the old fingerprint) the new pool starts with the old pool's most
recent prompts answered by the new target (by the answer stage, which the nightly hands in as `answer`:
stages do not import each other); pools of retired target versions are dropped.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Protocol

from specdistill.data.prompts import Prompt
from specdistill.distill.examples import read_done
from specdistill.distill.pool import POOL_MANIFEST, AnswerPool, retire_pools
from specdistill.pipeline.layout import features_dir
from specdistill.pipeline.nightly_recipe import NightlyConfig, run_root
from specdistill.pipeline.outputs import GeneratedData, PooledData, PoolSummary, Window

REANSWERED = "reanswer-"  # key prefix of the night made of the old version's prompts


class Answerer(Protocol):
    """The answer stage (`stages.answers.stage.generate_responses`): the target answers a window's split."""

    def __call__(self, config: NightlyConfig, window: Window, split: str, *, record_teacher: bool) -> GeneratedData: ...


def pool_root() -> Path:
    return run_root() / "pool"


def pool_answers(config: NightlyConfig, window: Window, train_data: GeneratedData, heldout_data: GeneratedData,
                 fingerprint: str, *, answer: Answerer) -> PooledData:
    """The data the night trains on: the pool's view (tonight's answers always in), or, with
    `pool.enabled` false, tonight's answers as they are. Tonight's eval prompts are recorded as held
    out first, so no view ever trains on a prompt that was evaluated on. `answer` answers the old
    target version's prompts after a target update."""
    if not config.pool.enabled:
        return PooledData(train_data.path, train_data.teacher_cache, train_data.answers, train_data.tokens)
    if not train_data.teacher_cache:
        raise ValueError("the answer pool needs the train answers' teacher cache (generate_responses record_teacher)")
    pc = config.pool
    pool = AnswerPool.open(pool_root(), fingerprint)
    pool.hold_out(read_done(Path(heldout_data.path)).values())
    pool.add_night(window.key, train_data.path, train_data.teacher_cache, features_dir(train_data.teacher_cache))
    reanswered = 0
    if pc.reanswer_from and pc.reanswer_from != fingerprint and pc.reanswer_prompts:
        reanswered = _reanswer(config, pool, window, pc.reanswer_from, answer)
    evicted = pool.enforce_disk_cap(pc.max_gb, keep=[window.key])
    view = pool.view(include=window.key, max_tokens=pc.max_tokens)
    retired = retire_pools(pool_root(), pc.keep_versions, fingerprint)
    summary = PoolSummary(fingerprint=fingerprint, nights=view.nights, duplicates=view.duplicates,
                          held_out=view.held_out, over_budget=view.over_budget, skipped=view.skipped,
                          evicted=evicted, retired=retired, reanswered=reanswered, disk_bytes=pool.disk_bytes())
    return PooledData(path=view.path, teacher_cache=view.teacher_cache, answers=view.answers, tokens=view.tokens,
                      pool=summary)


def _reanswer(config: NightlyConfig, pool, window: Window, old_fingerprint: str, answer: Answerer) -> int:
    """The old target version's most recent pooled prompts answered by this target (up to
    `pool.reanswer_prompts`, never tonight's or a held-out one), as a night just before tonight's. Done
    once per new pool; an answer already written is not generated again (the answer stage resumes)."""
    if any(n.key.startswith(REANSWERED) for n in pool.nights):
        return 0
    if not (pool_root() / old_fingerprint / POOL_MANIFEST).is_file():
        return 0  # no pool for the old version (it was never pooled, or retired): tonight's window alone
    old = AnswerPool.open(pool_root(), old_fingerprint)
    tonight = {p.id for p in window.train} | {p.id for p in window.eval}
    prompts = old.recent_prompts(config.pool.reanswer_prompts, exclude=tonight)
    pool.hold_out([])  # the new pool's held-out record starts with the old one's
    pool.manifest["held_out_ids"] = sorted(set(pool.manifest["held_out_ids"]) | set(old.manifest["held_out_ids"]))
    pool.manifest["held_out_prompts"] = sorted(set(pool.manifest["held_out_prompts"]) | set(old.manifest["held_out_prompts"]))
    pool.save()
    if not prompts:
        return 0
    digest = hashlib.sha256(json.dumps([p["id"] for p in prompts]).encode()).hexdigest()[:12]
    pseudo = Window(train=[Prompt(id=p["id"], messages=p["prompt"], slice="reanswer") for p in prompts],
                    eval=[], key=f"{REANSWERED}{old_fingerprint}-{digest}", since=None, replayed=len(prompts))
    data = answer(config, pseudo, "train", record_teacher=True)
    pool.add_night(pseudo.key, data.path, data.teacher_cache, features_dir(data.teacher_cache),
                   before=window.key)
    return data.answers


def data_line(tonight: GeneratedData) -> str:
    """Where tonight's training data came from: decoded answers and the logged responses labelled by prefill."""
    logged = tonight.logged
    if logged is None:
        return f"tonight's data: {tonight.answers} answers decoded by the target, {tonight.tokens} tokens"
    decoded = tonight.answers - logged.own
    parts = [f"{decoded} answers decoded by the target ({tonight.tokens - logged.own_tokens - logged.other_tokens} tokens)",
             f"{logged.own} logged answers of this target used as they are ({logged.own_tokens} tokens)",
             f"{logged.other} other models' responses labelled by the target ({logged.other_tokens} tokens)"]
    notes = []
    if logged.refused:
        why = "; ".join(f"{n} {reason}" for reason, n in sorted(logged.refused_why.items(), key=lambda kv: -kv[1]))
        notes.append(f"{logged.refused} claimed by this target refused as not its text ({why}) and answered again")
    if logged.skipped:
        notes.append("skipped: " + ", ".join(f"{n} {reason}" for reason, n in sorted(logged.skipped.items())))
    if logged.not_labelled:
        notes.append(f"{logged.not_labelled} logged responses not labelled for lack of time")
    return "tonight's data: " + " · ".join(parts) + "".join(f"\n- {n}" for n in notes)


def pool_report(pooled: PooledData, stale_dropped: int = 0, tonight: GeneratedData | None = None) -> str:
    """The report's lines on what the night trained on (`stale_dropped`: answers the trainer left out
    because their cached teacher rows were written for other token ids), after tonight's data line."""
    stale = (f"\n- {stale_dropped} answers not trained on: their cached teacher rows were written for other "
             "token ids") if stale_dropped else ""
    head = data_line(tonight) + "\n\n" if tonight is not None else ""
    s = pooled.pool
    if s is None:
        return (f"{head}trained on tonight's answers only (pool disabled): {pooled.answers} answers, {pooled.tokens} tokens"
                + stale)
    lines = [f"{head}trained on {pooled.answers} answers, {pooled.tokens} answer tokens, from {len(s.nights)} "
             f"night(s) of the answer pool of target `{s.fingerprint}` (newest first):"]
    lines += [f"- `{key}`: {n['answers']} answers, {n['tokens']} tokens" for key, n in s.nights.items()]
    if s.duplicates:
        lines.append(f"- {s.duplicates} prompts answered on several nights trained once (the newest answer)")
    if s.over_budget:
        lines.append(f"- {s.over_budget} older answers over the token budget left out")
    if s.held_out:
        lines.append(f"- {s.held_out} answers to held-out prompts left out")
    if s.reanswered:
        lines.append(f"- {s.reanswered} of the previous target version's prompts re-answered by this target")
    lines.append(f"- pool disk use {s.disk_bytes / 2**30:.2f} GiB")
    lines += [f"- disk cap: night `{e['key']}` evicted ({e['bytes'] / 2**20:.0f} MiB)" for e in s.evicted]
    lines += [f"- retired the pool of target `{r['fingerprint']}` ({r['bytes'] / 2**20:.0f} MiB)" for r in s.retired]
    lines += [f"- skipped: {x}" for x in s.skipped]
    return "\n".join(lines) + stale
