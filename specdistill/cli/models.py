"""`specdistill vocab check|transplant` and `specdistill draft init`: tokenizer alignment and new drafts."""

from __future__ import annotations

import argparse
import io

from specdistill import bounds, paths
from specdistill.cli.common import Subcommands, add_out, command, count_in, emit, group
from specdistill.modeling.eagle3_files import DRAFT_MODEL, EAGLE3, kind_name


def cmd_vocab_check(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer  # lazy: CLI start-up

    from specdistill.modeling.models import resolve_model_dir  # lazy: CLI start-up
    from specdistill.modeling.vocab import check_vocab  # lazy: CLI start-up

    target_tok = AutoTokenizer.from_pretrained(resolve_model_dir(args.target))
    draft_tok = AutoTokenizer.from_pretrained(resolve_model_dir(args.draft))
    report = check_vocab(target_tok, draft_tok)
    emit(args, report.to_dict(), report.render())
    return 0 if report.identical else 1


def cmd_vocab_transplant(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer  # lazy: CLI start-up

    from specdistill.modeling.drafts import save_draft  # lazy: CLI start-up
    from specdistill.modeling.models import load_model, resolve_model_dir  # lazy: CLI start-up
    from specdistill.modeling.vocab import check_vocab, transplant_vocab  # lazy: CLI start-up

    check_out(args)
    target_tok = AutoTokenizer.from_pretrained(resolve_model_dir(args.target))
    draft = load_model(args.draft, dtype="float32")  # its weights are saved: as stored
    transplant_vocab(draft.model, draft.tokenizer, target_tok)
    out = save_draft(draft.model, target_tok, args.out, meta={"transplanted_from": str(draft.path)}, force=args.force)
    report = check_vocab(target_tok, load_model(out).tokenizer)
    payload = {"out": str(out), "vocab_size": draft.model.config.vocab_size, "identical": report.identical}
    emit(args, payload, f"draft re-embedded over the target's {payload['vocab_size']} tokens -> {out}")
    return 0 if report.identical else 1


def cmd_draft_init(args: argparse.Namespace) -> int:
    from transformers import AutoConfig  # lazy: CLI start-up

    from specdistill.modeling.drafts import init_draft_from_target, parse_layers, save_draft  # lazy: CLI start-up
    from specdistill.modeling.eagle3 import check_eagle3_target, target_architecture  # lazy: CLI start-up
    from specdistill.modeling.models import load_model, num_parameters, resolve_model_dir  # lazy: CLI start-up
    from specdistill.modeling.vocab import DraftVocab, build_draft_vocab, token_frequencies  # lazy: CLI start-up

    check_out(args)  # before the target loads: a refused OUT costs nothing
    if args.traffic:  # a directory, a FIFO or a device is said so before the target loads, never opened
        paths.check_regular(args.traffic, "traffic file")
    if args.kind == EAGLE3:  # an architecture the head cannot start from is refused before the target loads
        model_dir = resolve_model_dir(args.target)
        check_eagle3_target(target_architecture(AutoConfig.from_pretrained(model_dir)), where=model_dir)
    target = load_model(args.target, dtype="float32")  # the draft is made of its weights and saved
    draft_vocab = None
    if args.draft_vocab:
        if not args.traffic:
            raise SystemExit("--draft-vocab needs --traffic FILE (text, one sample per line) to count tokens")
        with io.TextIOWrapper(paths.open_regular(args.traffic, "traffic file"), encoding="utf-8", errors="replace") as f:
            counts = token_frequencies(target.tokenizer, f)
        draft_vocab = build_draft_vocab(counts, args.draft_vocab, target.config.vocab_size, [target.tokenizer.eos_token_id])
    if args.kind == EAGLE3:
        import torch  # lazy: CLI start-up

        full = DraftVocab(torch.arange(target.config.vocab_size), target.config.vocab_size)
        return _init_eagle3(args, target, draft_vocab or full)
    layers = parse_layers(args.layers or "0,1,2,29", target.config.num_hidden_layers)
    draft = init_draft_from_target(target.model, layers)
    meta = {"target_fingerprint": target.fingerprint, "layers": layers, "draft_vocab": args.draft_vocab}
    out = save_draft(draft, target.tokenizer, args.out, draft_vocab=draft_vocab, meta=meta, force=args.force)
    payload = {"out": str(out), "kind": DRAFT_MODEL, "layers": layers, "parameters": num_parameters(draft), **meta}
    emit(args, payload, f"draft with layers {layers} ({payload['parameters'] / 1e6:.1f}M parameters) -> {out}")
    return 0


def _init_eagle3(args: argparse.Namespace, target, draft_vocab) -> int:
    """An untrained EAGLE-3 head over the target's features (layers low/mid/high unless given)."""
    from specdistill.modeling.eagle3_init import init_eagle3_from_target  # lazy: CLI start-up
    from specdistill.modeling.eagle3_io import save_eagle3  # lazy: CLI start-up

    layers = None
    if args.layers:
        try:
            layers = [int(x) for x in args.layers.split(",")]
        except ValueError:
            raise SystemExit(f"--layers {args.layers!r}: an EAGLE-3 head reads three target layers, e.g. 2,15,27") from None
    head = init_eagle3_from_target(target.model, draft_vocab, layers)
    meta = {"target_fingerprint": target.fingerprint, "target": str(target.path)}
    out = save_eagle3(head, target.tokenizer, args.out, meta, force=args.force)
    parameters = sum(p.numel() for name, p in head.named_parameters() if not name.startswith("embed_tokens."))
    payload = {"out": str(out), "kind": "eagle3", "layers": head.aux_layers, "draft_vocab": draft_vocab.size,
               "parameters": parameters, **meta}
    emit(args, payload, f"EAGLE-3 head over target layers {head.aux_layers}, draft vocabulary {draft_vocab.size} "
                        f"({parameters / 1e6:.1f}M parameters) -> {out}")
    return 0


def cmd_draft_import(args: argparse.Namespace) -> int:
    from specdistill.modeling.eagle3_import import import_head  # lazy: CLI start-up
    from specdistill.modeling.models import load_model  # lazy: CLI start-up

    if not args.out:
        raise SystemExit("draft import needs --out DIR: where the imported head is written")
    check_out(args)  # before the target loads: a refused OUT costs nothing
    target = load_model(args.target, dtype="float32")  # the head is checked against it and saved
    done = import_head(args.source, target, args.out, force=args.force)
    payload = {"out": str(done.out), "kind": "eagle3", "source_format": done.source_format, **done.meta}
    emit(args, payload, f"EAGLE-3 head from {args.source} ({done.source_format} format, sha256 "
                        f"{done.source_sha256[:12]}) checked against {target.path} -> {done.out}")
    return 0


def cmd_draft_export(args: argparse.Namespace) -> int:
    from specdistill.modeling.eagle3_import import export_head  # lazy: CLI start-up

    if not args.out:
        raise SystemExit("draft export needs --out DIR: where the exported head is written")
    check_out(args)
    out = export_head(args.head, args.out, format=args.format, target=args.target, force=args.force)
    emit(args, {"out": str(out), "format": args.format}, f"EAGLE-3 head {args.head} in the {args.format} format -> {out}")
    return 0


def check_out(args: argparse.Namespace) -> None:
    """Refuse OUT before any work when it would replace what `draft` writers did not write."""
    from specdistill import paths  # lazy: CLI start-up
    from specdistill.modeling.drafts import DRAFT_OUTPUT  # lazy: CLI start-up

    paths.check_output_dir(args.out, DRAFT_OUTPUT, force=args.force)


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
    add_out(p)

    draft = group(sub, "draft", "drafts")
    p = command(draft, "init", cmd_draft_init, "a draft initialized from the target's own layers, or an EAGLE-3 head",
                example="draft init --target demo --layers 0,1,2,29 --draft-vocab 8192 --traffic traffic.txt runs/draft")
    p.add_argument("--target", default="demo")
    # `--kind layers`, its name before, is read as draft_model
    p.add_argument("--kind", type=kind_name, choices=(DRAFT_MODEL, EAGLE3), default=DRAFT_MODEL,
                   help="draft_model: a small model of a few target layers; eagle3: one layer over the target's features "
                        "(EAGLE-3)")
    p.add_argument("--layers", default=None,
                   help="draft_model: '0,1,2,29' (default), 'evenly:K' or 'first:K'; eagle3: the three feature layers "
                        "(default 2, N/2, N-3 as vLLM and SGLang capture them)")
    p.add_argument("--draft-vocab", type=count_in(bounds.MAX_TOP_K), default=None, help="keep only the N most frequent tokens")
    p.add_argument("--traffic", default=None, help="text file whose token counts choose the draft vocabulary")
    add_out(p)
    p = command(draft, "import", cmd_draft_import,
                "an EAGLE-3 head in the speculators format or the EAGLE-3/SpecForge layout, checked against the target",
                example="draft import speculators-head/ --target demo --out runs/imported")
    p.add_argument("source", metavar="DIR")
    p.add_argument("--target", default="demo")
    add_out(p, "--out")
    p = command(draft, "export", cmd_draft_export, "an EAGLE-3 head written in the speculators format or the EAGLE-3 layout",
                example="draft export runs/head --format speculators --out runs/head-speculators")
    p.add_argument("head", metavar="DIR")
    p.add_argument("--format", choices=("eagle3", "speculators"), default="eagle3",
                   help="eagle3: the layout vLLM's eagle3 method, SGLang and SpecForge load (default); speculators: "
                        "vLLM's speculators format")
    p.add_argument("--target", default=None, help="the verifier a speculators config names (default: the head's own target)")
    add_out(p, "--out")
