"""The `specdistill` console script: each subcommand maps onto one library function.

Every command that reports numbers takes `--json` and then prints exactly one JSON object on stdout
(progress bars and logs go to stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

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

    from specdistill.models import resolve_model_dir
    from specdistill.vocab import check_vocab

    target_tok = AutoTokenizer.from_pretrained(resolve_model_dir(args.target))
    draft_tok = AutoTokenizer.from_pretrained(resolve_model_dir(args.draft))
    report = check_vocab(target_tok, draft_tok)
    _emit(args, report.to_dict(), report.render())
    return 0 if report.identical else 1


# --------------------------------------------------------------------------------------------
# draft


def cmd_draft_init(args: argparse.Namespace) -> int:
    from specdistill.drafts import init_draft_from_target, parse_layers, save_draft
    from specdistill.models import load_model, num_parameters
    from specdistill.vocab import build_draft_vocab, token_frequencies

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
# distill


def cmd_distill(args: argparse.Namespace) -> int:
    import os

    from specdistill.config import load_config
    from specdistill.train import distill

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
    from specdistill.logstore import LogStore

    return LogStore(args.db)


def cmd_ingest(args: argparse.Namespace) -> int:
    from specdistill.ingest import ingest

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
    return 0


# --------------------------------------------------------------------------------------------
# demo


def cmd_demo(args: argparse.Namespace) -> int:
    from specdistill.demo import run_demo

    result = run_demo()
    if args.json:
        print(json.dumps(result, default=str))
    return 0


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

    draft = sub.add_parser("draft", help="drafts").add_subparsers(dest="draft_command", required=True)
    p = add(draft, "init", cmd_draft_init, "a draft initialized from the target's own layers")
    p.add_argument("--target", default="demo")
    p.add_argument("--layers", default="0,1,2,29", help="'0,1,2,29', 'evenly:K' or 'first:K'")
    p.add_argument("--draft-vocab", type=int, default=None, help="keep only the N most frequent tokens")
    p.add_argument("--traffic", default=None, help="text file whose token counts choose the draft vocabulary")
    p.add_argument("out")

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

    add(sub, "demo", cmd_demo, "run the main job on the embedded defaults")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"specdistill: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
