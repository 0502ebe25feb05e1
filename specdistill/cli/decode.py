"""`specdistill generate` and `specdistill bench`: speculative decoding with one drafting method."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdistill import bounds
from specdistill.acceptance import DEFAULT_GAMMA, NGRAM_WINDOW
from specdistill.cli.common import (
    Subcommands,
    add_db,
    add_threads,
    command,
    count_in,
    emit,
    log_store,
    number_in,
    printable,
    seed,
    set_threads,
)

DTYPE_CHOICES = ("auto", "float32", "bfloat16")  # modeling.models.DTYPE_CHOICES, without importing torch to parse


def drafter_spec(args: argparse.Namespace):
    """The drafter spec the command line names (None: target-only): `--draft DIR` (a head's directory reads as
    `eagle3:DIR`), `--self-spec K`, `--ngram`, `--suffix CORPUS`, and beside a model drafter the hybrid."""
    from specdistill.speculative.specs import SELF_SPEC, DrafterSpec  # lazy: CLI start-up

    suffix = getattr(args, "suffix", None)
    chosen = [flag for flag, on in (("--draft", args.draft), ("--self-spec", args.self_spec is not None),
                                    ("--ngram", args.ngram), ("--suffix", suffix)) if on]
    if len(chosen) > 1 and not (suffix and not args.ngram and len(chosen) == 2):
        raise ValueError(f"choose one drafting method, got {' and '.join(chosen)}")
    if suffix and len(chosen) == 2:
        model = args.draft or f"{SELF_SPEC}:{args.self_spec}"
        threshold = getattr(args, "hybrid_threshold", None)
        spec = DrafterSpec.parse(f"hybrid:{model},{suffix}" + (f",{threshold!r}" if threshold is not None else ""))
    elif suffix:
        spec = DrafterSpec.parse(f"suffix:{suffix}")
    elif args.draft:
        spec = DrafterSpec.for_draft(args.draft)
    elif args.self_spec is not None:
        spec = DrafterSpec(SELF_SPEC, str(args.self_spec))
    elif args.ngram:
        spec = DrafterSpec.parse(f"ngram:{args.ngram_min},{args.ngram_max}")
    else:
        return None
    return spec.with_(tree_width=args.tree_width)


def _drafter(args: argparse.Namespace, target, fingerprint: str | None = None, tokenizer: str | None = None):
    """The drafter the command line names, built by its kind (a suffix corpus is checked against the target's
    fingerprint and tokenizer digest: the commands pass both)."""
    from specdistill.speculative import drafter_from_spec  # lazy: CLI start-up

    spec = drafter_spec(args)
    drafter = drafter_from_spec(target, spec, target_fingerprint=fingerprint, target_tokenizer=tokenizer) if spec else None
    if args.tree_width != 1 and (drafter is None or drafter.tree_width != args.tree_width):
        raise ValueError(f"--tree-width {args.tree_width}: only a model drafter drafts a tree (--draft DIR or "
                         "--self-spec K), or a suffix drafter (--suffix CORPUS)")
    note = getattr(drafter, "note", "") or getattr(getattr(drafter, "suffix", None), "note", "")
    if note:  # the suffix drafter says when its corpus is empty and it drafts from the request alone
        print(printable(note), file=sys.stderr)
    return drafter


def _check_drafting(args: argparse.Namespace) -> None:
    """What argparse types cannot check alone, before any model loads."""
    if args.ngram_max < args.ngram_min:
        raise ValueError(f"--ngram-max {args.ngram_max} is below --ngram-min {args.ngram_min}")


def cmd_generate(args: argparse.Namespace) -> int:
    from specdistill.modeling.models import dtype_name, load_model  # lazy: CLI start-up
    from specdistill.speculative import SamplingConfig, generate  # lazy: CLI start-up
    from specdistill.speculative.decode import STOPPED_AT_CONTEXT  # lazy: CLI start-up
    from specdistill.speculative.harness_bench import encode_prompt  # lazy: CLI start-up

    _check_drafting(args)
    set_threads(args)
    target = load_model(args.target, dtype=args.dtype)
    if args.prompt_ids is not None:
        try:
            prompt = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError as exc:
            raise ValueError(f"--prompt-ids: expected comma-separated integers, got {args.prompt_ids!r}") from exc
    else:
        prompt = encode_prompt(target.tokenizer, args.prompt) if args.prompt.strip() else []
    result = generate(target.model, prompt, max_new_tokens=args.max_new_tokens,
                      drafter=_drafter(args, target.model, target.fingerprint, target.tokenizer_digest),
                      gamma=args.gamma, sampling=SamplingConfig(args.temperature, args.top_p, args.seed))
    text = target.tokenizer.decode(result.output_ids, skip_special_tokens=True)
    stats, dtype = result.stats, dtype_name(target.model.dtype)
    if result.stopped == STOPPED_AT_CONTEXT:  # fewer tokens than asked for: say why, never silently
        print(f"specdistill: the output stopped at {stats.generated_tokens} of {args.max_new_tokens} new tokens: "
              f"the prompt's {len(prompt)} tokens filled the target's context of {result.context} tokens",
              file=sys.stderr)
    summary = stats.to_dict()  # α 0.0 and τ 1.0 without a drafter
    emit(args, {"output_ids": result.output_ids, "text": text, "dtype": dtype,
                "stats": {**summary, "stopped": result.stopped}},
         f"{text}\n\n[{stats.generated_tokens} tokens, {stats.tokens_per_second:.2f} tokens/s in {dtype}, "
         f"α {summary['acceptance_rate']:.3f}, τ {summary['accepted_length']:.2f}; stopped: {result.stopped.replace('_', ' ')}]")
    return 0


def _bench_prompts(args: argparse.Namespace, target, records: list | None) -> list:
    """The measured prompts: from a prompt file (every turn with --turns all), or from the log store."""
    from specdistill.data.prompts import Prompt  # lazy: CLI start-up
    from specdistill.speculative.harness_bench import prompts_from_records  # lazy: CLI start-up

    if records is not None:
        return prompts_from_records(target.model, target.tokenizer, records, args.max_new_tokens)
    from specdistill.data.prompts import prompts_from_logs  # lazy: CLI start-up

    with log_store(args) as store:
        logged = prompts_from_logs(store, target.tokenizer, args.from_logs, args.limit or 32, seed=args.log_seed)
        where = store.display_url
    if not logged:
        raise ValueError(f"no usable prompt in the {args.from_logs} split of the log store {where}")
    return [Prompt(text=p.messages[-1]["content"], slice=p.slice, ids=p.ids) for p in logged]  # as the harness runs them


def _bench_engine(args: argparse.Namespace):
    """The bench in a serving engine: llama.cpp started here per mode, or running OpenAI-compatible
    servers given by URL (the speculative one and a target-only one)."""
    from specdistill.data.prompt_files import read_prompt_file  # lazy: CLI start-up
    from specdistill.data.prompts import Prompt  # lazy: CLI start-up
    from specdistill.engines.endpoint_bench import TARGET_ONLY, EngineBenchConfig, run_engine_bench  # lazy: CLI start-up

    if args.prompts is None or args.turns == "all":
        raise ValueError(f"--engine {args.engine} measures first turns of a --prompts file "
                         "(--from-logs and --turns all need the target's own tokenizer and answers)")
    if args.temperature != 0.0:
        raise ValueError(f"--engine {args.engine} measures greedy decoding only (--temperature 0)")
    prompts = [Prompt(r.turns[0], r.slice) for r in read_prompt_file(args.prompts, "first")[: args.limit or None]]
    from specdistill.engines.client import DEFAULT_TIMEOUT_S  # lazy: CLI start-up

    timeout = args.timeout or (DEFAULT_TIMEOUT_S if args.engine == "openai" else None)  # else: the started server's
    config = EngineBenchConfig(max_new_tokens=args.max_new_tokens, repeats=args.repeats, gamma=args.gamma,
                               seed=args.seed or 0, **({"timeout_s": timeout} if timeout else {}))
    threads = args.threads or 2
    if args.engine == "openai":
        if not (args.url and args.baseline_url):
            raise ValueError("--engine openai needs --url (the speculative server) and --baseline-url (target-only)")
        results = run_engine_bench({TARGET_ONLY: args.baseline_url, args.mode_name: args.url}, prompts, config,
                                   engine="openai", dtype=args.engine_dtype, threads=0)
        return results[args.mode_name]
    if args.engine == "vllm":
        return _bench_vllm(args, prompts, config, threads)
    from specdistill.engines.llamacpp.engine import bench_llamacpp, target_gguf  # lazy: CLI start-up
    from specdistill.pipeline.stages.engine_bench import mode_for_spec  # lazy: CLI start-up

    spec = drafter_spec(args)
    if spec is None or not spec.runs_in_llamacpp or spec.exit_layer is not None:
        raise ValueError("--engine llamacpp measures --draft (a GGUF, or a draft or EAGLE-3 head directory exported to one) "
                         "or --ngram")
    if spec.ngram_sizes is not None:  # llama-server's lookup decoding has its own window
        spec = spec.with_(arg="")
    mode = mode_for_spec(spec, target_gguf(args.target), args.gamma)
    return bench_llamacpp(args.target, {mode.name: mode}, prompts, config, threads=threads)[mode.name]


def _bench_vllm(args: argparse.Namespace, prompts: list, config, threads: int):
    """vLLM started here twice, target-only and with the mode's `speculative_config` as serving.json
    would carry it; a config vLLM refuses is an error carrying vLLM's own message."""
    from specdistill.engines.vllm.bench import bench_vllm  # lazy: CLI start-up
    from specdistill.pipeline.stages.engine_bench import mode_serving_config  # lazy: CLI start-up

    spec = drafter_spec(args)
    if spec is None or not spec.served or spec.corpus:
        raise ValueError("--engine vllm measures --draft DIR, --self-spec K or --ngram")
    name = spec.kind
    run = bench_vllm(args.target, {name: mode_serving_config(spec, args.gamma, args.target).vllm()}, prompts, config,
                     threads=threads, dtype=args.dtype)
    if name in run.refused:
        raise ValueError(f"vLLM {run.version} refused the {name} mode: {run.refused[name]}")
    return run.results[name]


def cmd_bench(args: argparse.Namespace) -> int:
    from specdistill.data.prompt_files import read_prompt_file  # lazy: CLI start-up
    from specdistill.modeling.models import load_model  # lazy: CLI start-up
    from specdistill.speculative.gamma import plain_step_share, render_curve, speedup_curve  # lazy: CLI start-up
    from specdistill.speculative.harness_bench import BenchConfig, run_bench  # lazy: CLI start-up

    if args.engine != "harness":
        result = _bench_engine(args)
        payload, text = result.to_dict(), result.render()
        return _emit_bench(args, result, payload, text)
    _check_drafting(args)
    if args.plot:
        from specdistill.data.results import check_plot_path  # lazy: CLI start-up

        check_plot_path(args.plot, force=args.force)  # before any work: a refusal costs nothing
    set_threads(args)
    if args.from_logs is not None and args.turns is not None:
        raise ValueError("--turns applies to --prompts files; a logged prompt is every turn before its first answer")
    records = None
    if args.prompts is not None:  # read before loading the model: a bad file fails at once
        records = read_prompt_file(args.prompts, args.turns or "first")[: args.limit or None]
    target = load_model(args.target, dtype=args.dtype)
    drafter = _drafter(args, target.model, target.fingerprint, target.tokenizer_digest)
    if drafter is None:
        raise ValueError("bench needs a drafting method: --draft DIR, --self-spec K, --ngram or --suffix CORPUS")
    prompts = _bench_prompts(args, target, records)
    config = BenchConfig(gamma=args.gamma, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                         temperature=args.temperature, top_p=args.top_p, seed=args.seed or 0)
    result = run_bench(target.model, target.tokenizer, drafter, prompts, config)
    payload, text = result.to_dict(), result.render()
    try:  # what follows the measurement never loses it: a failure is reported with the result
        curve = speedup_curve(target.model, result.per_position_acceptance, result.cost_ratio,
                              plain_share=plain_step_share(result.stats))
        payload.update(curve)
        text += "\n\n" + render_curve(curve, result.dtype, result.cost_ratio)
        if args.plot:
            payload["plot"] = str(result.plot(args.plot))
            text += f"\nplot -> {payload['plot']}"
    except (ValueError, RuntimeError, OSError) as exc:
        payload["error"] = f"after the benchmark: {exc}"
        _emit_bench(args, result, payload, text + f"\n\nerror after the benchmark (the result above stands): {exc}")
        return 2
    return _emit_bench(args, result, payload, text)


def _emit_bench(args, result, payload: dict, text: str) -> int:
    """Print a bench result (either engine), with the gate's verdict when `--gate` asks for it."""

    from specdistill.ops.policy import evaluate, gate_config  # lazy: CLI start-up

    if args.gate:
        from specdistill import paths  # lazy: CLI start-up
        from specdistill.data.results import BenchResult  # lazy: CLI start-up

        champion = BenchResult.from_dict(paths.read_json(Path(args.champion), "champion bench JSON")) if args.champion else None
        verdict = evaluate(result, gate_config(args.gate), champion)
        payload["gate"] = verdict.to_dict()
        text += "\n\n" + verdict.render()
    emit(args, payload, text)
    return 0


def _add_drafting(p: argparse.ArgumentParser) -> None:
    """The target, one drafting method and the decoding settings (generate and bench alike)."""
    p.add_argument("--target", default="demo")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="auto: bf16 on CUDA and on CPUs with native bf16 (AVX-512 BF16, AMX), else fp32; drafts follow the target")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--draft", default=None,
                     help="draft model directory or models:/NAME@ALIAS (its draft_vocab.safetensors is used if present)")
    how.add_argument("--self-spec", type=count_in(bounds.MAX_LAYERS), default=None, metavar="K",
                     help="the target drafts by exiting at layer K")
    how.add_argument("--ngram", action="store_true", help="prompt-lookup drafting from the history")
    p.add_argument("--suffix", default=None, metavar="CORPUS",
                   help="suffix drafting from a corpus of the target's past answers (and the request itself); "
                        "beside --draft or --self-spec: the hybrid of both")
    p.add_argument("--hybrid-threshold", type=number_in(0.0), default=None, metavar="X",
                   help="hybrid: take the suffix proposal when its expected accepted tokens reach X")
    p.add_argument("--ngram-min", type=count_in(bounds.MAX_NGRAM), default=NGRAM_WINDOW[0])
    p.add_argument("--ngram-max", type=count_in(bounds.MAX_NGRAM), default=NGRAM_WINDOW[1])
    p.add_argument("--gamma", type=count_in(bounds.MAX_GAMMA), default=DEFAULT_GAMMA, help="draft tokens per round")
    p.add_argument("--tree-width", type=count_in(bounds.MAX_TREE_WIDTH), default=1, metavar="W",
                   help="draft model, EAGLE-3 head or early exit, greedy: verify its top W candidates for the first "
                        "draft position as a tree")
    p.add_argument("--max-new-tokens", type=count_in(bounds.MAX_NEW_TOKENS), default=64)
    p.add_argument("--temperature", type=number_in(0.0), default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=number_in(0.0, 1.0, low_open=True), default=1.0)
    p.add_argument("--seed", type=seed, default=None)
    add_threads(p)


def register(sub: Subcommands) -> None:
    p = command(sub, "generate", cmd_generate, "one generation, target-only or speculative",
                example="generate --target demo --draft runs/draft --prompt 'Write a haiku' --max-new-tokens 32 --gamma 4")
    _add_drafting(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="text, wrapped as one user turn with the chat template")
    prompt.add_argument("--prompt-ids", help="raw token ids, comma-separated, no chat template")

    p = command(sub, "bench", cmd_bench, "acceptance, accepted length and speedup over target-only on a prompt set",
                example="bench --target demo --draft runs/draft --prompts question.jsonl --turns all --dtype bfloat16 --gate default")
    _add_drafting(p)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", default=None, metavar="FILE",
                        help='plain text (one prompt a line), JSONL {"prompt", "slice"}, Spec-Bench question.jsonl, or '
                             'chat records: a nightly answers file (eval_generated.jsonl) or {"messages"} conversations')
    source.add_argument("--from-logs", default=None, choices=["eval", "train"],
                        help="prompts of this log-store split, as the nightly draws them (see --db, --log-seed, --limit)")
    p.add_argument("--turns", default=None, choices=["first", "all"],
                   help="Spec-Bench files: the first turn (default), or every turn, each asked after the target's own "
                        "greedy answers to the turns before it (one measured prompt per turn; the slice is the category)")
    p.add_argument("--limit", type=count_in(bounds.MAX_PROMPTS), default=None,
                   help="only the first N prompts (records) of a file; with --from-logs how many to draw (default 32)")
    p.add_argument("--log-seed", type=seed, default=None, help="--from-logs: a seeded sample instead of the newest")
    add_db(p)
    p.add_argument("--repeats", type=count_in(bounds.MAX_REPEATS), default=3, help="interleaved repeats; tokens/s is their median")
    p.add_argument("--plot", default=None, metavar="PNG", help="acceptance per position and speedup per slice (.png, .pdf "
                   "or .svg; an existing file only if bench wrote it, unless --force)")
    p.add_argument("--force", action="store_true", help="replace --plot FILE even when bench did not write it")
    p.add_argument("--gate", default=None, choices=["default", "production"], help="also print the gate's verdict")
    p.add_argument("--champion", default=None, metavar="JSON", help="the champion's bench JSON, for the gate's τ check")
    p.add_argument("--engine", default="harness", choices=["harness", "llamacpp", "vllm", "openai"],
                   help="what measures: this PyTorch harness, llama-server built and started here (the target a "
                        ".gguf or demo; --threads its threads, default 2), vLLM started here (make vllm; the "
                        "target an HF directory, .gguf or demo, in --dtype), or running OpenAI-compatible servers")
    p.add_argument("--url", default=None, help="--engine openai: base URL of the speculative server (its /metrics too)")
    p.add_argument("--baseline-url", default=None, help="--engine openai: base URL of a target-only server")
    p.add_argument("--mode-name", default="speculative", help="--engine openai: the speculative mode's name in reports")
    p.add_argument("--engine-dtype", default="unknown", help="--engine openai: the served weights' dtype, for reports")
    p.add_argument("--timeout", type=number_in(0.0, 24 * 3600.0, low_open=True), default=None, metavar="SECONDS",
                   help="--engine openai, llamacpp, vllm: how long one request may go unanswered before the bench "
                        "stops (default 120 for running servers, 300 for a server started here)")
