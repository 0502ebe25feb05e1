"""What does a training step of the head cost at unroll depth k = 1..4, and what does each recipe buy per
CPU-minute at every draft position?

    python benchmarks/head_depth.py --run DIR [--work /tmp/head_depth] [--minutes 3] [--warm HEAD_DIR] \\
        [--variant NAME=key=value,key=value ...] [--cost-steps 12] [--repeats 3]

DIR is a nightly training run's directory (`.specdistill/nightly/distill/<key>/`): its `config.yaml` names the
night's answers, teacher and feature caches and held-out answers, which are only read. Each variant trains the
head with that config plus its overrides (keys of `specdistill distill --config`, e.g. `eagle3.steps=3`,
`eagle3.deep_share=0.25`) for the same compute, from the target (or from --warm, a head to warm-start from, as
a night after the first does): --minutes of training each, or with --k1-steps N the steps k = 1 takes in the
same time as each variant's (N times the measured cost ratio of part 1), which a shared machine does not
skew. Each is read at its evaluations along the way: per draft position, teacher-forced top-1 agreement and
the chained share a drafting round accepts, on the run's held-out answers.

1. Step cost: seconds per training step of each variant over the same batches in one process, interleaved,
   median of --repeats (the machine may be shared), relative to k = 1.
2. Learning curves: per variant, the chain's acceptance at each position and its conditional acceptance
   (position i given 1..i-1 accepted) at the end, τ of a chain of 3, and a plot of each position against
   training minutes (--plot, PNG).

Prints both tables; writes results.json in --work (a rerun reuses finished variants).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import yaml
from common import log

from specdistill.distill.distill_recipe import load_config
from specdistill.distill.eagle3_train import Eagle3Task
from specdistill.distill.examples import read_examples
from specdistill.distill.train import distill
from specdistill.hardware import describe_device
from specdistill.modeling.models import load_model

VARIANTS = {  # name: overrides of the run's config
    "k1": ["eagle3.steps=1"],
    "k2": ["eagle3.steps=2"],
    "k3": ["eagle3.steps=3"],
    "k4": ["eagle3.steps=4"],
    "k3 share 0.5": ["eagle3.steps=3", "eagle3.deep_share=0.5"],
    "k4 share 0.25": ["eagle3.steps=4", "eagle3.deep_share=0.25"],
}


def run_config(run: Path, out: Path, overrides: list[str], minutes: float | None, warm: str | None,
               steps: int = 100000):
    base = yaml.safe_load((run / "config.yaml").read_text())
    base.pop("out_dir", None)
    every = max(50, steps // 6) if steps < 100000 else 250
    sets = [f"out_dir={out}", f"optim.max_minutes={minutes if minutes is not None else 'null'}",
            f"optim.max_steps={steps}", f"eval_every={every}", f"checkpoint_every={every}", "eagle3.eval_steps=4",
            "progress=false", *(f"draft={warm}" for _ in [warm] if warm), *overrides]
    path = out.parent / f"{out.name}.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(base))
    return load_config(str(path), sets)


def step_costs(args, names: list[str]) -> dict[str, float]:
    """Seconds per step of each variant, same batches, interleaved (the trainer's own micro_loss and AdamW)."""
    target = load_model("demo", dtype="float32", device="cpu")
    configs = {n: run_config(args.run, args.work / "cost" / n.replace(" ", "_"), VARIANTS[n], 1.0, args.warm) for n in names}
    first = configs[names[0]]
    examples = read_examples(first.data.path, "generated", target.tokenizer, first.data.max_len)
    tasks = {n: Eagle3Task(c, target, examples, [], [], torch.device("cpu")) for n, c in configs.items()}
    g = torch.Generator().manual_seed(0)
    order = [torch.randint(0, len(examples), (first.optim.batch_size,), generator=g).tolist()
             for _ in range(args.cost_steps)]
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(first.optim.bf16))
    opts = {n: torch.optim.AdamW([p for p in t.module.parameters() if p.requires_grad], lr=1e-4, fused=True)
            for n, t in tasks.items()}
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.repeats):
        for n in names:
            task = tasks[n]
            for i, indices in enumerate(order[:2]):  # warm-up
                task.micro_loss(task.module, indices, i, 0, autocast)[0].backward()
            opts[n].zero_grad(set_to_none=True)
            start = time.perf_counter()
            for i, indices in enumerate(order):
                loss = task.micro_loss(task.module, indices, i, 0, autocast)[0]
                loss.backward()
                opts[n].step()
                opts[n].zero_grad(set_to_none=True)
            times[n].append((time.perf_counter() - start) / len(order))
    return {n: statistics.median(v) for n, v in times.items()}


def budget_key(args) -> str:
    return f"{args.k1_steps} k1-steps" if args.k1_steps else f"{args.minutes} min"


def curves(args, names: list[str], cost: dict[str, float] | None) -> dict[str, dict]:
    results_path = args.work / "results.json"
    results = json.loads(results_path.read_text()) if results_path.is_file() else {}
    for n in names:
        key = f"{n} | {budget_key(args)} | warm={args.warm}"
        if key in results:
            continue
        steps = round(args.k1_steps * cost["k1"] / cost[n]) if args.k1_steps else 100000
        log(f"training {n} for {budget_key(args)} ({steps if args.k1_steps else 'its minutes'} steps)")
        out = args.work / "runs" / f"{n.replace(' ', '_')}-{budget_key(args).replace(' ', '')}-{'warm' if args.warm else 'scratch'}"
        result = distill(run_config(args.run, out, VARIANTS[n], None if args.k1_steps else args.minutes, args.warm, steps))
        results[key] = {"variant": n, "steps": result.steps, "minutes": result.train_minutes, "tokens": result.tokens,
                        "curve": result.curve, "draft_dir": result.draft_dir}
        results_path.write_text(json.dumps(results, indent=2))
    return {n: results[f"{n} | {budget_key(args)} | warm={args.warm}"] for n in names}


def chain_row(point: dict) -> tuple[list[float], list[float], float]:
    """(chained acceptance by position, conditional acceptance by position, τ of a chain of 3) at one evaluation."""
    chain = point["accepted_per_position"]
    conditional = [chain[0]] + [chain[i] / chain[i - 1] if chain[i - 1] else 0.0 for i in range(1, len(chain))]
    return chain, conditional, 1.0 + sum(chain[:3])


def plot(path: Path, runs: dict[str, dict]) -> None:
    import matplotlib  # lazy: only with --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after the backend is chosen, which must come first

    fig, axes = plt.subplots(1, 3, figsize=(13, 4), sharey=True)
    for name, r in runs.items():
        pts = [p for p in r["curve"] if p.get("accepted_per_position")]
        for pos, ax in enumerate(axes):
            ax.plot([p["minutes"] for p in pts], [chain_row(p)[1][pos] for p in pts], marker="o", label=name)
    for pos, ax in enumerate(axes):
        ax.set_title(f"position {pos + 1}" + (f" given 1..{pos} accepted" if pos else ""))
        ax.set_xlabel("training minutes")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("acceptance (teacher-forced, held-out)")
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="a nightly training run's directory (config.yaml)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/head_depth"))
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--k1-steps", type=int, help="equal compute by steps: k = 1's steps, the others' scaled by cost")
    parser.add_argument("--warm", help="a head to warm-start every variant from (a night after the first)")
    parser.add_argument("--variant", action="append", default=[], help="NAME=key=value,key=value (adds a variant)")
    parser.add_argument("--only", help="comma-separated variant names to run (default: all)")
    parser.add_argument("--cost-steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--skip-curves", action="store_true")
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(argv)
    for v in args.variant:
        name, _, sets = v.partition("=")
        VARIANTS[name] = [s for s in sets.split(",") if s]
    names = args.only.split(",") if args.only else list(VARIANTS)
    args.work.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"machine: {describe_device(torch.device('cpu'))}; run {args.run}; warm start {args.warm or 'none (the target)'}")
    cost = None
    if not args.skip_cost or args.k1_steps:
        cost = step_costs(args, list(dict.fromkeys(["k1", *names])))
        base = cost.get("k1") or next(iter(cost.values()))
        print("\n| variant | s/step | vs k1 |\n|---|---:|---:|")
        for n in names:
            print(f"| {n} | {cost[n]:.3f} | {cost[n] / base:.2f}x |")
    if not args.skip_curves:
        runs = curves(args, names, cost)
        print(f"\n{budget_key(args)} of compute each; chain acceptance by position (conditional in brackets), held-out, "
              "teacher-forced\n\n| variant | steps | tokens | pos 1 | pos 2 | pos 3 | pos 4 | τ chain 3 |\n"
              "|---|---:|---:|---:|---:|---:|---:|---:|")
        for n, r in runs.items():
            chain, cond, tau = chain_row(r["curve"][-1])
            cells = " | ".join(f"{c:.3f} ({q:.2f})" for c, q in zip(chain[:4], cond[:4]))
            print(f"| {n} | {r['steps']} | {r['tokens']} | {cells} | {tau:.2f} |")
        if args.plot:
            plot(args.plot, runs)
            print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
