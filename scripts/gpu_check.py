"""The GPU check (`scripts/gpu_check.sh`): the project's stages on a CUDA device at small sizes, one table.

1. lossless: tiny random Llama targets on the device, greedy speculative output (a draft model, an
   early-exit self-draft, n-gram, an EAGLE-3 head, trees) token-identical to target-only output (fp32).
2. answers: the demo target answers ShareGPT prompts on the device, batched, recording its top-k
   teacher and the EAGLE-3 features (the nightly's answer pass); answer tokens/s.
3. bench: the harness's benchmark on the device (bf16): target-only tokens/s, n-gram and self-speculation
   speedups, α, τ, the lossless verdict, c and v(k) timed with device synchronisation.
4. distill: `torchrun --nproc_per_node <GPUs>` training a layer draft on the answers of step 2 (NCCL
   between the ranks) for a few steps.

`--device cpu` runs the same steps on the CPU (what the test suite does with tiny sizes), so the
script itself is tested where no GPU is.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import specdistill  # noqa: F401  (offline environment)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.conftest: the tiny random Llama builders the unit tests use


def lossless_on(device: str, prompts: int) -> dict:
    from specdistill.modeling.eagle3_init import init_eagle3_from_target
    from specdistill.modeling.vocab import DraftVocab
    from specdistill.speculative import ModelDrafter, NgramDrafter, SelfSpecDrafter
    from specdistill.speculative.decode import generate
    from specdistill.speculative.eagle import EagleDrafter
    from tests.conftest import lively, make_tiny_llama

    target = lively(make_tiny_llama(vocab_size=96, hidden=64, layers=4, seed=1), seed=1).float().to(device)
    draft = lively(make_tiny_llama(vocab_size=96, hidden=32, layers=2, seed=2), seed=2).float().to(device)
    head = init_eagle3_from_target(target, DraftVocab(torch.arange(96), 96)).float().to(device)
    drafters = {"draft": ModelDrafter(draft, 96), "draft-tree": ModelDrafter(draft, 96, tree_width=3),
                "self-spec": SelfSpecDrafter(target, 2), "ngram": NgramDrafter(1, 3),
                "eagle3-tree": EagleDrafter(head, target, tree_width=3)}
    g = torch.Generator().manual_seed(0)
    same = {name: 0 for name in drafters}
    for _ in range(prompts):
        ids = torch.randint(3, 96, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
        base = generate(target, ids, max_new_tokens=24).output_ids
        for name, drafter in drafters.items():
            same[name] += generate(target, ids, max_new_tokens=24, drafter=drafter, gamma=3).output_ids == base
    return {"device": str(next(target.parameters()).device), "prompts": prompts, "identical": same,
            "passed": all(v == prompts for v in same.values())}


def answers_on(device: str, prompts: int, max_new_tokens: int, out: Path, dtype: str) -> dict:
    from specdistill.data.datasets import sharegpt_first_turns
    from specdistill.data.prompts import Prompt
    from specdistill.distill.features import FeatureCache
    from specdistill.distill.teacher import TeacherCache
    from specdistill.modeling.eagle3 import default_aux_layers
    from specdistill.modeling.models import load_model
    from specdistill.pipeline.stages.answers.harness import generate_answers

    target = load_model("demo", dtype=dtype, device=device)
    chosen = [Prompt(f"p{i}", turn.messages) for i, turn in enumerate(sharegpt_first_turns(prompts, max_chars=1500))]
    teacher = TeacherCache.create(out / "teacher_cache", fingerprint=target.fingerprint, k=32, temperature=1.0, vocab="full")
    features = FeatureCache.create(out / "features", fingerprint=target.fingerprint,
                                   layers=default_aux_layers(target.config.num_hidden_layers), data="gpu-check",
                                   prompt_context=0)
    start = time.perf_counter()
    records = generate_answers(target.model, target.tokenizer, chosen, out / "train_generated.jsonl", batch_size=16,
                               max_new_tokens=max_new_tokens, teacher_cache=teacher, feature_cache=features)
    seconds = time.perf_counter() - start
    tokens = sum(len(r["response_ids"]) for r in records.values())
    heldout = out / "heldout_generated.jsonl"
    heldout.write_text("".join(json.dumps(r) + "\n" for r in list(records.values())[-4:]))
    return {"answers": len(records), "tokens": tokens, "tokens_per_s": tokens / seconds, "dtype": dtype,
            "teacher_shards": len(list(teacher.dir.glob("shard-*"))), "feature_entries": len(FeatureCache.open(
                out / "features", fingerprint=target.fingerprint, layers=features.meta["layers"], prompt_context=0).ids())}


def bench_on(device: str, prompts: int, max_new_tokens: int, dtype: str) -> dict:
    from specdistill.data.datasets import sharegpt_first_turns
    from specdistill.modeling.models import load_model
    from specdistill.speculative import NgramDrafter, SelfSpecDrafter
    from specdistill.speculative.gamma import measure_verify_costs
    from specdistill.speculative.harness_bench import BenchConfig, Prompt, run_bench_many

    target = load_model("demo", dtype=dtype, device=device)
    chosen = [Prompt(turn.text, "chat") for turn in sharegpt_first_turns(prompts, max_chars=1500)]
    results = run_bench_many(target.model, target.tokenizer, {"ngram": NgramDrafter(1, 3),
                                                              "self-spec:8": SelfSpecDrafter(target.model, 8)},
                             chosen, BenchConfig(gamma=4, max_new_tokens=max_new_tokens, repeats=2), progress=False)
    verify = measure_verify_costs(target.model, ks=(1, 2, 4, 8), repeats=5)
    rows = {name: {"speedup": r.speedup, "alpha": r.acceptance_rate, "tau": r.accepted_length, "c": r.cost_ratio,
                   "lossless": r.lossless, "exact": r.lossless_exact, "near_ties": r.lossless_near_ties,
                   "mismatches": r.lossless_mismatches, "target_only_tps": r.tokens_per_second_target_only}
            for name, r in results.items()}
    return {"dtype": dtype, "results": rows, "verify_costs": {str(k): round(v, 3) for k, v in verify.items()},
            "passed": all(r.lossless for r in results.values())}


def distill_on(device: str, data: Path, steps: int) -> dict:
    gpus = torch.cuda.device_count() if device.startswith("cuda") else 1
    ranks = max(1, min(gpus, 8))
    out = data / "draft"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               "-m", "specdistill.cli", "distill", "--json", "--config", str(REPO / "deploy/distill/demo.yaml"),
               f"data.path={data / 'train_generated.jsonl'}", f"data.heldout_path={data / 'heldout_generated.jsonl'}",
               f"teacher.cache_dir={data / 'teacher_cache'}", f"out_dir={out}", f"optim.max_steps={steps}",
               "optim.warmup_steps=1", f"checkpoint_every={steps}", f"eval_every={steps}", "layers=0,29",
               f"device={'cuda' if device.startswith('cuda') else 'cpu'}", "draft_vocab=2048"]
    start = time.perf_counter()
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if run.returncode != 0:
        return {"ranks": ranks, "passed": False, "error": (run.stderr or run.stdout)[-2000:]}
    result = json.loads(run.stdout.strip().splitlines()[-1])
    return {"ranks": ranks, "backend": "nccl" if device.startswith("cuda") else "gloo", "steps": result.get("steps"),
            "loss": result.get("loss"), "seconds": time.perf_counter() - start, "passed": True}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (the same steps on the CPU)")
    p.add_argument("--prompts", type=int, default=32, help="answers and bench prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="distillation steps under torchrun")
    p.add_argument("--only", default="lossless,answers,bench,distill")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_check: --device {args.device} but torch {torch.__version__} sees no CUDA device "
              "(a CPU build of torch, or no GPU on this machine); `--device cpu` runs the same steps on the CPU",
              file=sys.stderr)
        return 2
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    steps = args.only.split(",")
    report: dict = {"device": args.device, "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None,
                    "gpus": torch.cuda.device_count()}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        os.environ.setdefault("SPECDISTILL_HOME", tmp)
        data = Path(tmp) / "answers"
        if "lossless" in steps:
            report["lossless"] = lossless_on(args.device, max(4, args.prompts // 4))
        if "answers" in steps or "distill" in steps:
            report["answers"] = answers_on(args.device, args.prompts, args.max_new_tokens, data, dtype)
        if "bench" in steps:
            report["bench"] = bench_on(args.device, min(args.prompts, 8), args.max_new_tokens, dtype)
        if "distill" in steps:
            report["distill"] = distill_on(args.device, data, args.steps)
    passed = all(v.get("passed", True) for v in report.values() if isinstance(v, dict))
    report["passed"] = passed
    if args.json:
        print(json.dumps(report))
    else:
        print(render(report))
    return 0 if passed else 1


def render(r: dict) -> str:
    lines = [f"GPU check on {r['device']} ({r['gpu'] or 'CPU'}, {r['gpus']} GPUs, torch {r['torch']})",
             "| check | result |", "|---|---|"]
    if "lossless" in r:
        x = r["lossless"]
        lines.append(f"| lossless (fp32, tiny targets, greedy) | {'PASS' if x['passed'] else 'FAIL'}: "
                     + ", ".join(f"{k} {v}/{x['prompts']}" for k, v in x["identical"].items()) + " |")
    if "answers" in r:
        x = r["answers"]
        lines.append(f"| answers + teacher + features ({x['dtype']}) | {x['answers']} answers, {x['tokens']} tokens, "
                     f"{x['tokens_per_s']:.1f} tokens/s, {x['teacher_shards']} teacher shards, "
                     f"{x['feature_entries']} feature entries |")
    if "bench" in r:
        x = r["bench"]
        for name, b in x["results"].items():
            lines.append(f"| bench {name} ({x['dtype']}) | {b['speedup']:.2f}x over {b['target_only_tps']:.1f} tokens/s, "
                         f"α {b['alpha']:.3f}, τ {b['tau']:.2f}, c {b['c']:.3f}, lossless {b['lossless']} "
                         f"({b['exact']} exact, {b['near_ties']} near-tie, {b['mismatches']} mismatches) |")
        lines.append(f"| v(k) | {x['verify_costs']} |")
    if "distill" in r:
        x = r["distill"]
        lines.append("| distill under torchrun | " + (f"{x['ranks']} ranks ({x['backend']}), {x['steps']} steps, loss "
                                                     f"{x['loss']}, {x['seconds']:.0f} s |" if x["passed"]
                                                     else f"FAIL: {x['error'][-300:]} |"))
    lines.append(f"**{'PASS' if r['passed'] else 'FAIL'}**")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
