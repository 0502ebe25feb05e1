"""`specdistill vocab check|transplant` and `specdistill draft init`: tokenizer alignment and new drafts."""

from __future__ import annotations

import argparse

from specdistill.cli.common import Subcommands, command, emit, group


def cmd_vocab_check(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from specdistill.modeling.models import resolve_model_dir
    from specdistill.modeling.vocab import check_vocab

    target_tok = AutoTokenizer.from_pretrained(resolve_model_dir(args.target))
    draft_tok = AutoTokenizer.from_pretrained(resolve_model_dir(args.draft))
    report = check_vocab(target_tok, draft_tok)
    emit(args, report.to_dict(), report.render())
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
    emit(args, payload, f"draft re-embedded over the target's {payload['vocab_size']} tokens -> {out}")
    return 0 if report.identical else 1


def cmd_draft_init(args: argparse.Namespace) -> int:
    from specdistill.modeling.drafts import init_draft_from_target, parse_layers, save_draft
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
        draft_vocab = build_draft_vocab(counts, args.draft_vocab, target.config.vocab_size, [target.tokenizer.eos_token_id])
    meta = {"target_fingerprint": target.fingerprint, "layers": layers, "draft_vocab": args.draft_vocab}
    out = save_draft(draft, target.tokenizer, args.out, draft_vocab=draft_vocab, meta=meta)
    payload = {"out": str(out), "layers": layers, "parameters": num_parameters(draft), **meta}
    emit(args, payload, f"draft with layers {layers} ({payload['parameters'] / 1e6:.1f}M parameters) -> {out}")
    return 0


def register(sub: Subcommands) -> None:
    vocab = group(sub, "vocab", "tokenizer alignment")
    p = command(vocab, "check", cmd_vocab_check, "tokenizer alignment report; exit 0 only when identical",
                example="vocab check demo runs/draft")
    p.add_argument("target")
    p.add_argument("draft")
    p = command(vocab, "transplant", cmd_vocab_transplant, "rebuild a draft's embedding and head over the target's vocabulary",
                example="vocab transplant demo other-draft/ runs/aligned")
    p.add_argument("target")
    p.add_argument("draft")
    p.add_argument("out")

    draft = group(sub, "draft", "drafts")
    p = command(draft, "init", cmd_draft_init, "a draft initialized from the target's own layers",
                example="draft init --target demo --layers 0,1,2,29 --draft-vocab 8192 --traffic traffic.txt runs/draft")
    p.add_argument("--target", default="demo")
    p.add_argument("--layers", default="0,1,2,29", help="'0,1,2,29', 'evenly:K' or 'first:K'")
    p.add_argument("--draft-vocab", type=int, default=None, help="keep only the N most frequent tokens")
    p.add_argument("--traffic", default=None, help="text file whose token counts choose the draft vocabulary")
    p.add_argument("out")
