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


def cmd_vocab_transplant(args: argparse.Namespace) -> int:
    from specdistill.drafts import save_draft
    from specdistill.models import load_model, resolve_model_dir
    from specdistill.vocab import check_vocab, transplant_vocab
    from transformers import AutoTokenizer

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
# serving


def cmd_serving_show(args: argparse.Namespace) -> int:
    from specdistill.serving import read_serving_config, serving_path

    config = read_serving_config(args.path)
    where = args.path or serving_path()
    if config is None:
        _emit(args, {"path": str(where), "config": None}, f"no serving config at {where}")
        return 1
    _emit(args, {"path": str(where), "config": config.to_dict()}, f"{where}\n{config.render()}")
    return 0


# --------------------------------------------------------------------------------------------
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
