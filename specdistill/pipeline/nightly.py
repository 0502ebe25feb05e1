"""The nightly pipeline's stages as plain library calls: one function per Prefect task.

Each stage takes and returns small, JSON-friendly values (paths, ids, dicts), writes its outputs
under a content-addressed directory, and resumes from what is already there, so a rerun after a
failure recomputes nothing that finished. `flows/nightly.py` composes them in DESIGN.md's order.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from specdistill import paths
from specdistill.pipeline.config import (  # noqa: F401
    GenerationConfig,
    NightlyConfig,
    SourceConfig,
    load_nightly_config,
)


def config_hash(obj) -> str:
    data = obj.model_dump(mode="json") if hasattr(obj, "model_dump") else obj
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:12]


def run_root() -> Path:
    return paths.ensure(paths.home() / "nightly")


# --------------------------------------------------------------------------------------------
# Stage: target


def describe_target(target_ref: str) -> dict:
    """Load the target once (this is where an unloadable target fails the run) and name its version."""
    from specdistill.modeling.models import load_model

    loaded = load_model(target_ref)
    return {"ref": target_ref, "path": str(loaded.path), "fingerprint": loaded.fingerprint,
            "num_layers": loaded.config.num_hidden_layers, "vocab_size": loaded.config.vocab_size}


# --------------------------------------------------------------------------------------------
# Stage: ingest


def resolve_source_path(source: SourceConfig) -> Path:
    from specdistill.data.datasets import humaneval_path, sharegpt_path

    shipped = {"sharegpt": sharegpt_path, "humaneval": humaneval_path}
    return shipped[source.path]() if source.path in shipped else Path(source.path)


def ingest_source(source: SourceConfig, log_db: str | None) -> dict:
    from specdistill.data.ingest import ingest
    from specdistill.data.logstore import LogStore

    with LogStore(log_db) as store:
        result = ingest(resolve_source_path(source), source.format, store, progress=True)
        return result.to_dict()


# --------------------------------------------------------------------------------------------
# Stage: vocabulary alignment


def align_champion(config: NightlyConfig, champion: dict | None) -> dict | None:
    """The champion as a warm start for this target: as it is when the tokenizers are identical,
    else re-embedded over the target's vocabulary (a transplant, matched by token string)."""
    if champion is None:
        return None
    from transformers import AutoTokenizer

    from specdistill.modeling.drafts import load_draft_meta, save_draft
    from specdistill.modeling.models import load_model, resolve_model_dir
    from specdistill.modeling.vocab import (
        DraftVocab,
        check_vocab,
        remap_draft_vocab,
        transplant_vocab,
    )

    target_tok = AutoTokenizer.from_pretrained(resolve_model_dir(config.target))
    draft = load_model(champion["dir"])
    report = check_vocab(target_tok, draft.tokenizer)
    if report.identical:
        return {**champion, "transplanted": False, "vocab_report": report.to_dict()}
    out = run_root() / "aligned" / f"{champion['name']}-{champion['version']}-{config_hash(report.to_dict())}"
    if not (out / "config.json").is_file():
        old_vocab = DraftVocab.load(champion["dir"])
        transplant_vocab(draft.model, draft.tokenizer, target_tok)
        new_vocab = remap_draft_vocab(old_vocab, draft.tokenizer, target_tok) if old_vocab else None
        save_draft(draft.model, target_tok, out, draft_vocab=new_vocab,
                   meta={**load_draft_meta(champion["dir"]), "transplanted_from": champion["dir"]})
    return {**champion, "dir": str(out), "transplanted": True, "vocab_report": report.to_dict()}


# --------------------------------------------------------------------------------------------
# Stage: data window


@dataclass
class Window:
    train: list[dict]  # [{"id", "messages", "slice"}]
    eval: list[dict]
    key: str  # content hash: the cache key of everything computed from this window
    since: str | None
    replayed: int

    def to_dict(self) -> dict:
        return asdict(self)


def _prompt_messages(messages) -> list[dict]:
    """The conversation up to (not including) its first assistant answer: what the target answers."""
    out = []
    for m in messages:
        if m.role == "assistant":
            break
        out.append({"role": m.role, "content": m.content})
    return out


def select_window(config: NightlyConfig, now: datetime | None = None) -> Window:
    """Train prompts from the recent window plus a replay share from before it; eval prompts from the
    eval split (never trained on). Deterministic for a given store content and seed."""
    from transformers import AutoTokenizer

    from specdistill.data.logstore import LogStore
    from specdistill.modeling.models import resolve_model_dir

    w = config.window
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(config.target))
    now = now or datetime.now(timezone.utc)
    since = w.since if w.since is not None else (now - timedelta(days=w.days) if w.days is not None else None)
    if since is not None and since.tzinfo is None:
        since = since.replace(tzinfo=timezone.utc)
    slice_of = {str(resolve_source_path(s)): s.slice for s in config.sources}
    store = LogStore(config.log_db)
    rng = random.Random(w.seed)

    def usable(rows, n: int) -> list[dict]:
        out = []
        for row in rows:
            messages = _prompt_messages(row.messages)
            if not messages or messages[-1]["role"] != "user":
                continue
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            if len(ids) > w.max_prompt_tokens:
                continue
            out.append({"id": str(row.id), "messages": messages, "slice": slice_of.get(row.source, row.source)})
            if len(out) >= n:
                break
        return out

    def per_source(n: int, **filters) -> list[dict]:
        """An even share of prompts from every source, so code and chat are both represented."""
        picked: list[dict] = []
        sources = [s for s in slice_of if store.count(source=s, **filters)]
        for i, source in enumerate(sources):
            share = (n - len(picked)) // (len(sources) - i)
            rows = store.sample(max(4 * share, share + 16), seed=w.seed, source=source, **filters)
            picked += usable(rows, share)
        return picked

    try:
        n_replay = int(round(w.train_prompts * w.replay_share)) if since is not None else 0
        recent = per_source(w.train_prompts - n_replay, split="train", since=since)
        replay = per_source(n_replay, split="train", until=since) if n_replay else []
        evals = per_source(w.eval_prompts, split="eval")
    finally:
        store.close()
    if not recent:
        raise ValueError(f"empty data window: no usable train prompts since {since or 'the beginning'} "
                         f"in the log store ({', '.join(slice_of) or 'no sources'})")
    if not evals:
        raise ValueError("empty eval split: no held-out prompts to benchmark on")
    train = recent + replay
    rng.shuffle(train)
    key = hashlib.sha256(json.dumps([train, evals, config.target], sort_keys=True).encode()).hexdigest()[:12]
    return Window(train, evals, key, since.isoformat() if since else None, len(replay))


# --------------------------------------------------------------------------------------------
# Stage: target responses and teacher cache


def generate_responses(config: NightlyConfig, window: dict, split: str, *, record_teacher: bool) -> dict:
    """The target answers the window's prompts (greedy), resumably; train answers also record the
    target's top-k log-probs into the teacher cache in the same pass."""
    from specdistill.data.logstore import LogStore
    from specdistill.distill.datagen import Prompt, generate_answers
    from specdistill.distill.teacher import TeacherCache
    from specdistill.modeling.models import load_model

    g = config.generation
    target = load_model(config.target)
    out_dir = paths.ensure(run_root() / "data" / f"{window['key']}-{target.fingerprint}-{config_hash(g)}")
    out_path = out_dir / f"{split}_generated.jsonl"
    cache = None
    if record_teacher:
        cache = TeacherCache.create(out_dir / "teacher_cache", fingerprint=target.fingerprint, k=g.teacher_top_k,
                                    temperature=1.0, vocab="full", data=window["key"])
    prompts = [Prompt(p["id"], p["messages"]) for p in window[split]]
    records = generate_answers(target.model, target.tokenizer, prompts, out_path, batch_size=g.batch_size,
                               max_new_tokens=g.max_new_tokens, teacher_cache=cache)
    with LogStore(config.log_db) as store:
        for p in window[split]:
            rec = records[p["id"]]
            store.add_response(int(p["id"]), target.fingerprint, rec["response"], prompt_messages=len(p["messages"]),
                               params={"temperature": 0.0, "max_new_tokens": g.max_new_tokens},
                               token_ids=rec["response_ids"])
    return {"path": str(out_path), "teacher_cache": str(cache.dir) if cache else None,
            "answers": len(records), "tokens": sum(len(r["response_ids"]) for r in records.values())}


# --------------------------------------------------------------------------------------------
# Stage: distillation (and the generic baseline draft)


def _write_conversations(config: NightlyConfig, window: dict, path: Path) -> Path:
    """The window's train conversations with their human-written answers (for the generic baseline)."""
    from specdistill.data.logstore import LogStore

    with LogStore(config.log_db) as store:
        rows = store.by_ids(int(p["id"]) for p in window["train"])
    answered = [row for row in rows if any(m.role == "assistant" for m in row.messages)]
    if not answered:  # HumanEval-style traffic logs prompts only: there is nothing human-written to imitate
        raise ValueError("the window's train conversations have no human-written answers for the generic baseline")
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in answered:
            messages = [{"role": m.role, "content": m.content} for m in row.messages]
            f.write(json.dumps({"id": str(row.id), "messages": messages}, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path


def distill_draft(config: NightlyConfig, train_data: dict, heldout_data: dict, warm_start: str | None = None,
                  *, generic: bool = False, window: dict | None = None) -> dict:
    """Distill a draft on the target's own answers (KL on the cached teacher), fresh or warm-started
    from the champion; `generic=True` trains the off-the-shelf baseline instead: plain CE on the
    human-written answers of the same prompts, same size and budget."""
    from specdistill.distill.config import (
        DataConfig,
        DistillConfig,
        LossConfig,
        OptimConfig,
        TeacherConfig,
    )
    from specdistill.distill.train import distill

    tc = config.train
    if generic:
        out_dir = run_root() / "generic" / f"{window['key']}-{config_hash(tc)}"
        conv_path = paths.ensure(out_dir.parent) / f"{window['key']}-conversations.jsonl"
        if not conv_path.is_file():
            _write_conversations(config, window, conv_path)
        data = DataConfig(path=str(conv_path), kind="conversations", heldout_path=heldout_data["path"])
        loss, teacher, lr = LossConfig(kind="ce"), TeacherConfig(mode="none"), tc.lr
    else:
        key = config_hash({"train": tc.model_dump(), "data": train_data["path"], "warm": warm_start})
        out_dir = run_root() / "distill" / key
        data = DataConfig(path=train_data["path"], kind="generated", heldout_path=heldout_data["path"])
        loss = LossConfig(kind=tc.loss, temperature=1.0)
        teacher = TeacherConfig(mode="cache", cache_dir=train_data["teacher_cache"])
        lr = tc.incremental_lr if warm_start else tc.lr
    result_file = out_dir / "result.json"
    if result_file.is_file():  # finished before: a rerun reuses it
        return json.loads(result_file.read_text())
    dcfg = DistillConfig(
        target=config.target, draft=warm_start, layers=tc.layers,
        draft_vocab=None if warm_start else tc.draft_vocab, data=data, loss=loss, teacher=teacher,
        optim=OptimConfig(lr=lr, batch_size=tc.batch_size, max_steps=tc.max_steps, max_minutes=tc.max_minutes,
                          warmup_steps=min(20, tc.max_steps // 10)),
        out_dir=str(out_dir), checkpoint_every=max(10, tc.max_steps // 4), eval_every=max(10, tc.max_steps // 4),
        threads=config.bench.threads,
    )
    return distill(dcfg)


# --------------------------------------------------------------------------------------------
# Stage: benchmark


def bench_prompts(config: NightlyConfig, window: dict):
    from transformers import AutoTokenizer

    from specdistill.distill.datagen import prompt_ids
    from specdistill.modeling.models import resolve_model_dir
    from specdistill.speculative.bench import Prompt

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(config.target))
    return [Prompt(text="", slice=p["slice"], ids=prompt_ids(tokenizer, p["messages"])) for p in window["eval"]]


def benchmark(config: NightlyConfig, window: dict, drafters: dict[str, str]) -> dict[str, dict]:
    """Every drafter on the same held-out prompts, sharing one interleaved target-only run per prompt.

    A drafter spec is `draft:DIR`, `self_spec:K` or `ngram`; results are keyed by the given name.
    """
    import torch

    from specdistill.modeling.models import load_model
    from specdistill.speculative import make_drafter
    from specdistill.speculative.bench import BenchConfig, run_bench_many

    if config.bench.threads:
        torch.set_num_threads(config.bench.threads)
    target = load_model(config.target)
    prompts = bench_prompts(config, window)
    b = config.bench
    bcfg = BenchConfig(gamma=b.gamma, max_new_tokens=b.max_new_tokens, repeats=b.repeats)
    made = {}
    for name, spec in drafters.items():
        kind, _, arg = spec.partition(":")
        drafter = make_drafter(target.model, draft=arg if kind == "draft" else None,
                               self_spec=int(arg) if kind == "self_spec" else None, ngram=kind == "ngram")
        if drafter is None:
            raise ValueError(f"unknown drafter spec {spec!r} (draft:DIR, self_spec:K or ngram)")
        made[name] = drafter
    results = run_bench_many(target.model, target.tokenizer, made, prompts, bcfg)
    return {name: {**result.to_dict(), "spec": drafters[name]} for name, result in results.items()}


def gate(config: NightlyConfig, challenger: dict, champion: dict | None, baselines: dict | None = None) -> dict:
    """The gate's verdict (`speculative.gate.evaluate`) under the run's profile, overrides and `must_beat`."""
    from specdistill.speculative.gate import evaluate, gate_config

    g = config.gate
    return evaluate(challenger, gate_config(g.profile, **g.overrides), champion=champion,
                    baselines=baselines, must_beat=g.must_beat).to_dict()


# --------------------------------------------------------------------------------------------
# Stage: registry and serving


def champion_of(config: NightlyConfig) -> dict | None:
    """The current champion (version, local draft directory, parent chain) or None."""
    from specdistill.ops import registry

    name = registry.model_name_for(config.target_name)
    mv = registry.version_by_alias(name, registry.CHAMPION)
    if mv is None:
        return None
    return {"name": name, "version": str(mv.version), "dir": str(registry.download_draft(f"models:/{name}/{mv.version}")),
            "tags": dict(mv.tags)}


def register(config: NightlyConfig, target: dict, window: dict, trained: dict, results: dict, verdict: dict,
             parent: str | None, report_path: str | None) -> dict:
    from specdistill.ops import registry

    challenger = results["challenger"]
    metrics = {"acceptance_rate": challenger["acceptance_rate"], "accepted_length": challenger["accepted_length"],
               "speedup": challenger["speedup"], "cost_ratio": challenger.get("cost_ratio") or 0.0,
               "train_tokens": trained["tokens"], "train_minutes": trained["train_minutes"]}
    for i, a in enumerate(challenger["per_position_acceptance"]):
        metrics[f"acceptance_pos_{i}"] = a
    for name, r in results.items():
        if name != "challenger":
            key = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
            metrics[f"baseline_{key}_acceptance_rate"] = r["acceptance_rate"]
            metrics[f"baseline_{key}_speedup"] = r["speedup"]
    curve_file = Path(trained["draft_dir"]).parent / "train_log.jsonl"
    losses = [json.loads(line)["loss"] for line in curve_file.read_text().splitlines()] if curve_file.is_file() else []
    artifacts_dir = paths.ensure(Path(trained["draft_dir"]).parent / "artifacts")
    (artifacts_dir / "benchmark.json").write_text(json.dumps(results, indent=2, default=str))
    (artifacts_dir / "nightly_config.json").write_text(config.model_dump_json(indent=2))
    (artifacts_dir / "gate.json").write_text(json.dumps(verdict, indent=2))
    artifacts = [artifacts_dir / "benchmark.json", artifacts_dir / "nightly_config.json", artifacts_dir / "gate.json"]
    plot = artifacts_dir / "acceptance.png"
    try:
        from specdistill.speculative.bench import BenchResult, SliceResult

        data = {k: v for k, v in challenger.items() if k != "spec"}
        data["slices"] = [SliceResult(**s) for s in data["slices"]]
        BenchResult(**data).plot(plot)
        artifacts.append(plot)
    except Exception:  # a plot is a convenience; never lose a registration over it
        pass
    if report_path:
        artifacts.append(Path(report_path))
    reg = registry.register_draft(
        trained["draft_dir"], target_name=config.target_name,
        params={"layers": trained.get("layers"), "draft_vocab": trained.get("draft_vocab"), **config.train.model_dump()},
        metrics=metrics, curves={"train_loss": losses}, artifacts=artifacts,
        tags={"target_fingerprint": target["fingerprint"], "data_window": window["key"],
              "gate_verdict": "pass" if verdict["passed"] else "fail", "parent": parent or ""},
        run_name=f"nightly-{window['key']}",
    )
    return asdict(reg)


def promote(config: NightlyConfig, registered: dict, target: dict, expected_champion: str | None) -> dict:
    """Alias `champion` and the serving config, together (see registry.promote)."""
    from specdistill.ops import registry
    from specdistill.ops.serving import ServingConfig

    draft_dir = registry.download_draft(f"models:/{registered['name']}/{registered['version']}")
    serving = ServingConfig(mode="draft", draft_dir=str(draft_dir), draft_version=registered["version"],
                            target_fingerprint=target["fingerprint"], num_speculative_tokens=config.bench.gamma,
                            reason=f"nightly: version {registered['version']} passed the gate")
    registry.promote(registered["name"], registered["version"], serving, expected_champion=expected_champion,
                     serving_path=config.serving_path)
    from specdistill.ops.serving import serving_path

    return {"version": registered["version"], "serving_config": str(config.serving_path or serving_path())}


# --------------------------------------------------------------------------------------------
# Report


def report_table(results: dict[str, dict], verdict: dict | None = None, registered: dict | None = None,
                 promoted: dict | None = None) -> str:
    """Markdown: the challenger against the champion and the baselines, on the same prompts."""
    lines = ["| drafter | acceptance α | accepted length τ | speedup | cost ratio c | lossless |",
             "|---|---:|---:|---:|---:|---|"]
    for name, r in results.items():
        c = "" if r.get("cost_ratio") is None else f"{r['cost_ratio']:.3f}"
        spec = r.get("spec", "")
        label = name if spec.startswith("draft:") or not spec else f"{name} ({spec})"
        lines.append(f"| {label} | {r['acceptance_rate']:.3f} | {r['accepted_length']:.2f} | "
                     f"{r['speedup']:.2f}x | {c} | {'yes' if r['lossless'] else 'NO'} |")
    lines.append("| no speculation | – | 1.00 | 1.00x | – | yes |")
    if verdict is not None:
        lines += ["", f"**gate: {'PASS' if verdict['passed'] else 'FAIL'}**", ""]
        lines += [f"- {reason}" for reason in verdict["reasons"]]
    if registered is not None:
        alias = "champion" if promoted else "challenger"
        lines += ["", f"registered: `{registered['name']}` version {registered['version']} (alias `{alias}`)"]
    if promoted:
        lines.append(f"serving config: `{promoted['serving_config']}`")
    elif registered is not None:
        lines.append("champion and serving config unchanged")
    return "\n".join(lines)


def write_report(text: str, window: dict, path: str | None = None) -> str:
    """The human-readable record of what a run measured and decided."""
    path = Path(path) if path else paths.ensure(run_root() / "reports") / f"{time.strftime('%Y%m%d-%H%M%S')}-{window['key']}.md"
    path.write_text(text + "\n")
    return str(path)
