"""The `specdistill` console script: each subcommand maps onto one library function.

Every command that reports numbers takes `--json` and then prints exactly one JSON object on stdout
(progress bars and logs go to stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import specdistill  # noqa: F401  (sets the offline environment before anything else imports)


def _emit(args: argparse.Namespace, payload: dict, text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps(payload, default=str))
    else:
        print(text)


# --------------------------------------------------------------------------------------------
# vocab


def cmd_vocab_check(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from specdistill.modeling.models import resolve_model_dir
    from specdistill.modeling.vocab import check_vocab

    target_tok = AutoTokenizer.from_pretrained(resolve_model_dir(args.target))
    draft_tok = AutoTokenizer.from_pretrained(resolve_model_dir(args.draft))
    report = check_vocab(target_tok, draft_tok)
    _emit(args, report.to_dict(), report.render())
    return 0 if report.identical else 1


def cmd_vocab_transplant(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from specdistill.modeling.drafts import save_draft
    from specdistill.modeling.models import load_model, resolve_model_dir
    from specdistill.modeling.vocab import check_vocab, transplant_vocab

    target_tok = AutoTokenizer.from_pretrained(resolve_model_dir(args.target))
    draft = load_model(args.draft)
    transplant_vocab(draft.model, draft.tokenizer, target_tok)
    out = save_draft(draft.model, target_tok, args.out, meta={"transplanted_from": str(draft.path)})
    report = check_vocab(target_tok, load_model(out).tokenizer)
    payload = {"out": str(out), "vocab_size": draft.model.config.vocab_size, "identical": report.identical}
    _emit(args, payload, f"draft re-embedded over the target's {payload['vocab_size']} tokens -> {out}")
    return 0 if report.identical else 1


# --------------------------------------------------------------------------------------------
# draft


def cmd_draft_init(args: argparse.Namespace) -> int:
    from specdistill.modeling.drafts import (
        init_draft_from_target,
        parse_layers,
        save_draft,
    )
    from specdistill.modeling.models import load_model, num_parameters
    from specdistill.modeling.vocab import build_draft_vocab, token_frequencies

    target = load_model(args.target)
    layers = parse_layers(args.layers, target.config.num_hidden_layers)
    draft = init_draft_from_target(target.model, layers)
    draft_vocab = None
    if args.draft_vocab:
        if not args.traffic:
            raise SystemExit("--draft-vocab needs --traffic FILE (text, one sample per line) to count tokens")
        with open(args.traffic, encoding="utf-8", errors="replace") as f:
            counts = token_frequencies(target.tokenizer, f)
        draft_vocab = build_draft_vocab(
            counts, args.draft_vocab, target.config.vocab_size, [target.tokenizer.eos_token_id]
        )
    meta = {"target_fingerprint": target.fingerprint, "layers": layers, "draft_vocab": args.draft_vocab}
    out = save_draft(draft, target.tokenizer, args.out, draft_vocab=draft_vocab, meta=meta)
    payload = {"out": str(out), "layers": layers, "parameters": num_parameters(draft), **meta}
    _emit(args, payload, f"draft with layers {layers} ({payload['parameters'] / 1e6:.1f}M parameters) -> {out}")
    return 0


# --------------------------------------------------------------------------------------------
# serving


def cmd_serving_show(args: argparse.Namespace) -> int:
    from specdistill.ops.serving import read_serving_config, serving_path

    config = read_serving_config(args.path)
    where = args.path or serving_path()
    if config is None:
        _emit(args, {"path": str(where), "config": None}, f"no serving config at {where}")
        return 1
    _emit(args, {"path": str(where), "config": config.to_dict()}, f"{where}\n{config.render()}")
    return 0


# --------------------------------------------------------------------------------------------

# distill


def cmd_distill(args: argparse.Namespace) -> int:
    import os

    from specdistill.distill.config import load_config
    from specdistill.distill.train import distill

    config = load_config(args.config, args.overrides)  # fails on unknown keys before any work
    result = distill(config)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    last = result["curve"][-1] if result["curve"] else {}
    text = (f"{result['steps']} steps, {result['tokens']} tokens, {result['train_minutes']:.1f} min, loss {result['loss']:.4f}"
            + (f", held-out acceptance {last['acceptance']:.3f}, tau(4) {last['tau']:.2f}" if "acceptance" in last else "")
            + f" -> {result.get('draft_dir')}")
    _emit(args, result, text)
# log store


def _log_store(args: argparse.Namespace):
    from specdistill.data.logstore import LogStore

    return LogStore(args.db)


def cmd_ingest(args: argparse.Namespace) -> int:
    from specdistill.data.ingest import ingest

    result = ingest(args.path, args.format, _log_store(args), batch_size=args.batch_size, source=args.source,
                    progress=not args.no_progress)
    _emit(args, result.to_dict(), result.render())
    return 0


def cmd_logs_stats(args: argparse.Namespace) -> int:
    stats = _log_store(args).stats()
    lines = [f"log store {stats['database']} (schema {stats['schema_revision']})",
             f"conversations: {stats['conversations']} (train {stats['by_split']['train']}, "
             f"eval {stats['by_split']['eval']}); target responses: {stats['responses']}; "
             f"quarantined: {stats['quarantined']}; acceptance samples: {stats['acceptance_samples']}",
             "ingested (all runs): read {read} = stored {stored} + duplicates {duplicates} + "
             "quarantined {quarantined}".format(**stats["ingested"])]
    lines += [f"  {s['conversations']:>8}  {s['source']}  ({s['first_arrival']} .. {s['last_arrival']})"
              for s in stats["by_source"]]
    _emit(args, stats, "\n".join(lines))
    return 0


def cmd_logs_quarantine(args: argparse.Namespace) -> int:
    store = _log_store(args)
    rows = store.quarantined(source=args.source, limit=args.limit)
    total = store.count_quarantined(source=args.source)
    text = "\n".join(f"{r['location']}: {r['reason']}\n    {r['raw'][:160]!r}" for r in rows) or "quarantine is empty"
    if total > len(rows):
        text += f"\n({len(rows)} of {total} shown; --limit N for more)"
    _emit(args, {"records": rows, "shown": len(rows), "total": total}, text)

# generate, bench


def _set_threads(args: argparse.Namespace) -> None:
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def _drafter_from_args(args: argparse.Namespace, target):
    from specdistill.speculative import make_drafter

    return make_drafter(target, draft=args.draft, self_spec=args.self_spec, ngram=args.ngram,
                        ngram_min=args.ngram_min, ngram_max=args.ngram_max)


def cmd_generate(args: argparse.Namespace) -> int:
    from specdistill.modeling.models import load_model
    from specdistill.speculative import SamplingConfig, generate
    from specdistill.speculative.bench import encode_prompt

    _set_threads(args)
    target = load_model(args.target)
    if args.prompt_ids is not None:
        try:
            prompt = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError as exc:
            raise ValueError(f"--prompt-ids: expected comma-separated integers, got {args.prompt_ids!r}") from exc
    else:
        prompt = encode_prompt(target.tokenizer, args.prompt) if args.prompt.strip() else []
    result = generate(
        target.model,
        prompt,
        max_new_tokens=args.max_new_tokens,
        drafter=_drafter_from_args(args, target.model),
        gamma=args.gamma,
        sampling=SamplingConfig(args.temperature, args.top_p, args.seed),
    )
    text = target.tokenizer.decode(result.output_ids, skip_special_tokens=True)
    stats = result.stats
    _emit(args, {"output_ids": result.output_ids, "text": text, "stats": stats.to_dict()},
          f"{text}\n\n[{stats.generated_tokens} tokens, {stats.tokens_per_second:.2f} tokens/s, "
          f"α {stats.acceptance_rate:.3f}, τ {stats.accepted_length:.2f}]")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from specdistill.modeling.models import load_model
    from specdistill.speculative.bench import BenchConfig, load_prompts, run_bench
    from specdistill.speculative.gate import evaluate, gate_config

    _set_threads(args)
    prompts = load_prompts(args.prompts)
    if args.limit:
        prompts = prompts[: args.limit]
    target = load_model(args.target)
    drafter = _drafter_from_args(args, target.model)
    if drafter is None:
        raise ValueError("bench needs a drafting method: --draft DIR, --self-spec K or --ngram")
    config = BenchConfig(gamma=args.gamma, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                         temperature=args.temperature, top_p=args.top_p, seed=args.seed or 0)
    result = run_bench(target.model, target.tokenizer, drafter, prompts, config)
    payload, text = result.to_dict(), result.render()
    if args.plot:
        payload["plot"] = str(result.plot(args.plot))
        text += f"\nplot -> {payload['plot']}"
    if args.gate:
        champion = json.loads(open(args.champion, encoding="utf-8").read()) if args.champion else None
        verdict = evaluate(result, gate_config(args.gate), champion)
        payload["gate"] = verdict.to_dict()
        text += "\n\n" + verdict.render()
    _emit(args, payload, text)
    return 0


# --------------------------------------------------------------------------------------------
# demo


def _run_nightly(config_path: str | None, overrides: list[str]) -> dict:
    # The flows are the one place Prefect is imported; the library itself never imports it.
    from flows.nightly import nightly

    return nightly(config_path=config_path, overrides=overrides)


def _summary(result: dict) -> str:
    from specdistill.ops.serving import serving_path

    lines = ["", result["report"], ""]
    reg = result["registered"]
    alias = "champion" if result["promoted"] else "challenger"
    lines.append(f"registered version {reg['version']} of {reg['name']} (alias {alias}); "
                 f"gate {'PASS' if result['verdict']['passed'] else 'FAIL'}")
    lines.append(f"serving config: {serving_path()}" + ("" if result["promoted"] else " (unchanged)"))
    return "\n".join(lines)


def cmd_pipeline_run(args: argparse.Namespace) -> int:
    result = _run_nightly(args.config, args.overrides)
    _emit(args, result, _summary(result))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The nightly flow on the embedded defaults: demo target, ShareGPT + HumanEval, SQLite, local MLflow."""
    result = _run_nightly(None, args.overrides)
    _emit(args, result, _summary(result))
    return 0


# --------------------------------------------------------------------------------------------
# target versions and the monitor


def cmd_target_register(args: argparse.Namespace) -> int:
    from specdistill.ops.targets import register_target

    version = register_target(args.path)
    emitted = _emit_target_updated(version.to_dict()) if not args.no_event else False
    payload = {**version.to_dict(), "event_emitted": emitted}
    _emit(args, payload, f"target {version.fingerprint} ({version.path}) is the current version"
          + ("; emitted specdistill.target.updated" if emitted else ""))
    return 0


def _emit_target_updated(version: dict) -> bool:
    """The Prefect event the monitor deployment is triggered by (Prefect is imported only here)."""
    from prefect.events import emit_event

    event = emit_event(
        event="specdistill.target.updated",
        resource={"prefect.resource.id": f"specdistill.target.{version['fingerprint']}",
                  "prefect.resource.name": version["ref"]},
        payload={"fingerprint": version["fingerprint"], "path": version["path"], "ref": version["ref"]},
    )
    return event is not None


def cmd_monitor_run(args: argparse.Namespace) -> int:
    from flows.monitor import monitor  # the flows are the one place Prefect is imported

    outcome = monitor(config_path=args.config, overrides=args.overrides)
    _emit(args, outcome, outcome["report"] if "report" in outcome else f"decision: {outcome['decision']}")
    return 0


def cmd_target_history(args: argparse.Namespace) -> int:
    from specdistill.ops.targets import target_history

    versions = [v.to_dict() for v in target_history()]
    lines = [f"{v['registered_at']}  {v['fingerprint']}  {v['path']}" for v in versions] or ["no target registered"]
    _emit(args, {"versions": versions}, "\n".join(lines))
    return 0


def cmd_monitor_sample(args: argparse.Namespace) -> int:
    import torch

    from specdistill.data.logstore import LogStore
    from specdistill.ops.monitor import decide, replay_acceptance

    if args.threads:
        torch.set_num_threads(args.threads)
    sample = replay_acceptance(args.target, args.draft, LogStore(args.db), n_prompts=args.n, gamma=args.gamma,
                               max_new_tokens=args.max_new_tokens, draft_version=args.draft_version,
                               min_draft_tokens=args.min_draft_tokens)
    payload = {**sample.to_dict(), "decision": decide(sample, args.threshold)}
    if sample.ok:
        text = (f"acceptance rate α {sample.acceptance_rate:.3f}   mean accepted length τ {sample.mean_accepted_length:.3f}"
                f"   ({sample.accepted}/{sample.proposed} draft tokens, {sample.requests} requests)"
                f"\ndecision: {payload['decision']}" + (f"\n{sample.reason}" if sample.reason else ""))
    else:
        text = f"no sample: {sample.reason}"
    _emit(args, payload, text)
    return 0


def cmd_monitor_serve(args: argparse.Namespace) -> int:
    from specdistill.data.logstore import LogStore
    from specdistill.ops.monitor import serve_metrics

    print(f"serving metrics on http://{args.host}:{args.port}/metrics (refresh every {args.interval:g} s)", file=sys.stderr)
    try:
        serve_metrics(LogStore(args.db), args.port, args.host, args.interval, args.serving)
    except KeyboardInterrupt:
        pass
    return 0


def cmd_demo_target_update(args: argparse.Namespace) -> int:
    import torch

    from specdistill.modeling.models import load_model
    from specdistill.ops.drift import load_update_meta, make_target_update

    if args.threads:
        torch.set_num_threads(args.threads)
    out = make_target_update(args.base, args.out, steps=args.steps, lr=args.lr, top_layers=args.top_layers)
    meta = load_update_meta(out)
    payload = {"out": str(out), "fingerprint": load_model(out).fingerprint, **meta}
    _emit(args, payload, f"new target version {payload['fingerprint']} -> {out} "
          f"(vocabulary {meta['vocab_size_before']} -> {meta['vocab_size_after']}, "
          f"loss {meta['losses'][0]:.3f} -> {meta['losses'][-1]:.3f})")
    return 0


def demo_target_update_parser() -> argparse.ArgumentParser:
    """`specdistill demo target-update`: parsed on its own, since `demo` takes free key=value overrides."""
    p = argparse.ArgumentParser(prog="specdistill demo target-update",
                                description="a new target version from the demo target: domain tokens + top layers fine-tuned on code")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    p.add_argument("--base", default="demo")
    p.add_argument("--out", default=None, help="default: $SPECDISTILL_HOME/targets/demo-update")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--top-layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.set_defaults(func=cmd_demo_target_update)
    return p


# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdistill", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def add(parent, name: str, fn: Callable, help: str) -> argparse.ArgumentParser:
        p = parent.add_parser(name, help=help, description=help)
        p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
        p.set_defaults(func=fn)
        return p

    vocab = sub.add_parser("vocab", help="tokenizer alignment").add_subparsers(dest="vocab_command", required=True)
    p = add(vocab, "check", cmd_vocab_check, "tokenizer alignment report; exit 0 only when identical")
    p.add_argument("target")
    p.add_argument("draft")
    p = add(vocab, "transplant", cmd_vocab_transplant, "rebuild a draft's embedding and head over the target's vocabulary")
    p.add_argument("target")
    p.add_argument("draft")
    p.add_argument("out")

    draft = sub.add_parser("draft", help="drafts").add_subparsers(dest="draft_command", required=True)
    p = add(draft, "init", cmd_draft_init, "a draft initialized from the target's own layers")
    p.add_argument("--target", default="demo")
    p.add_argument("--layers", default="0,1,2,29", help="'0,1,2,29', 'evenly:K' or 'first:K'")
    p.add_argument("--draft-vocab", type=int, default=None, help="keep only the N most frequent tokens")
    p.add_argument("--traffic", default=None, help="text file whose token counts choose the draft vocabulary")
    p.add_argument("out")

    serving = sub.add_parser("serving", help="serving config").add_subparsers(dest="serving_command", required=True)
    p = add(serving, "show", cmd_serving_show, "print the current serving config")
    p.add_argument("--path", default=None, help="default: $SPECDISTILL_HOME/serving.json")


    p = add(sub, "distill", cmd_distill, "distill a draft from its target (YAML config, key=value overrides)")
    p.add_argument("--config", default=None, help="YAML file; see specdistill.config.DistillConfig")
    p.add_argument("overrides", nargs="*", help="dotted overrides such as optim.lr=3e-4 loss.kind=jsd")
    db_help = "log store URL (default $SPECDISTILL_LOG_DB, else sqlite under $SPECDISTILL_HOME/logs.db)"
    p = add(sub, "ingest", cmd_ingest, "ingest a traffic file into the log store (idempotent, incremental)")
    p.add_argument("path")
    p.add_argument("--format", required=True, choices=["sharegpt", "openai", "jsonl", "humaneval"])
    p.add_argument("--db", default=None, help=db_help)
    p.add_argument("--source", default=None, help="source name (default: the file's absolute path)")
    p.add_argument("--batch-size", type=int, default=1000, help="records per transaction")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    logs = sub.add_parser("logs", help="log store").add_subparsers(dest="logs_command", required=True)
    p = add(logs, "stats", cmd_logs_stats, "what the log store holds")
    p.add_argument("--db", default=None, help=db_help)
    p = add(logs, "quarantine", cmd_logs_quarantine, "rejected records with their reasons and locations")
    p.add_argument("--db", default=None, help=db_help)
    p.add_argument("--source", default=None, help="only this source")
    p.add_argument("--limit", type=int, default=100)

    def add_drafting(p: argparse.ArgumentParser) -> None:
        p.add_argument("--target", default="demo")
        how = p.add_mutually_exclusive_group()
        how.add_argument("--draft", default=None, help="draft model directory (its draft_vocab.safetensors is used if present)")
        how.add_argument("--self-spec", type=int, default=None, metavar="K", help="the target drafts by exiting at layer K")
        how.add_argument("--ngram", action="store_true", help="prompt-lookup drafting from the history")
        p.add_argument("--ngram-min", type=int, default=1)
        p.add_argument("--ngram-max", type=int, default=3)
        p.add_argument("--gamma", type=int, default=4, help="draft tokens per round")
        p.add_argument("--max-new-tokens", type=int, default=64)
        p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--seed", type=int, default=None)
        p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 avoids stalls on a busy machine)")

    p = add(sub, "generate", cmd_generate, "one generation, target-only or speculative")
    add_drafting(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, wrapped as one user turn with the chat template")
    prompt.add_argument("--prompt-ids", help="raw token ids, comma-separated, no chat template")

    p = add(sub, "bench", cmd_bench, "acceptance, accepted length and speedup over target-only on a prompt set")
    add_drafting(p)
    p.add_argument("--prompts", required=True, help='JSONL {"prompt", "slice"} or plain text, one prompt a line')
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats; tokens/s is their median")
    p.add_argument("--plot", default=None, metavar="PNG", help="acceptance per position and speedup per slice")
    p.add_argument("--gate", default=None, choices=["default", "production"], help="also print the gate's verdict")
    p.add_argument("--champion", default=None, metavar="JSON", help="the champion's bench JSON, for the gate's τ check")

    pipeline = sub.add_parser("pipeline", help="the nightly flow").add_subparsers(dest="pipeline_command", required=True)
    p = add(pipeline, "run", cmd_pipeline_run, "run the nightly distillation flow once, now")
    p.add_argument("--config", default=None, help="nightly YAML config (default: the embedded demo defaults)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.max_minutes=2")

    target = sub.add_parser("target", help="target versions").add_subparsers(dest="target_command", required=True)
    p = add(target, "register", cmd_target_register, "record a target (its fingerprint and location) as the current version")
    p.add_argument("--no-event", action="store_true", help="do not emit the specdistill.target.updated Prefect event")
    p.add_argument("path", help="HF directory, .gguf file or 'demo'")
    add(target, "history", cmd_target_history, "every recorded target version, oldest first")

    monitor = sub.add_parser("monitor", help="acceptance monitoring").add_subparsers(dest="monitor_command", required=True)
    p = add(monitor, "run", cmd_monitor_run, "run the monitoring flow once: sample acceptance, fall back and retrain below 50%")
    p.add_argument("--config", default=None, help="monitor YAML config (default: the embedded demo defaults)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. replay_prompts=8")
    p = add(monitor, "sample", cmd_monitor_sample, "replay the newest logged prompts: the draft's acceptance on the target")
    p.add_argument("--target", default="demo")
    p.add_argument("--draft", required=True, help="draft directory or models:/NAME@champion")
    p.add_argument("--draft-version", default=None, help="version recorded with the samples (default: the reference)")
    p.add_argument("--n", type=int, default=16, help="prompts to replay")
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--min-draft-tokens", type=int, default=100, help="fewer proposed tokens: no sample")
    p.add_argument("--threshold", type=float, default=None, help="default: the red line, 0.5")
    p.add_argument("--db", default=None, help=db_help)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p = add(monitor, "serve", cmd_monitor_serve, "expose the spec-decode metrics over HTTP, fed from the log store")
    p.add_argument("--port", type=int, default=9464)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--interval", type=float, default=15.0, help="seconds between refreshes from the log store")
    p.add_argument("--db", default=None, help=db_help)
    p.add_argument("--serving", default=None, help="serving config (default: $SPECDISTILL_HOME/serving.json)")

    p = add(sub, "demo", cmd_demo, "run the main job (the nightly flow) on the embedded defaults")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the embedded defaults")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:2] == ["demo", "target-update"]:
        args = demo_target_update_parser().parse_args(argv[2:])
    else:
        args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"specdistill: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
