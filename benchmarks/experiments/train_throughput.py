"""EAGLE-3 head training throughput: each change of the profile measured against the code before it.

    python benchmarks/experiments/train_throughput.py --data DIR [--work DIR] [--repeats 5] [--steps 6] [--quality-steps 150]
    scripts/as_avx2.sh .venv/bin/python benchmarks/experiments/train_throughput.py --data DIR   # as an AVX2-only CPU (fp32)

DIR holds a night's training data as the answer pass writes it: train_generated.jsonl, teacher_cache/
and features/ (the demo's: .specdistill/nightly/data/<key>/); it is only read (its feature shards are
linked into --work). The head is the demo's: the demo target's three feature layers, an 8k draft
vocabulary, `eagle3.steps=2`, 4 sequences a step, bf16 autocast where the CPU has native bf16 (fp32
elsewhere, as `optim.bf16` resolves it).

Variants, cumulative, each timed over the same batches in one process, interleaved (variant A's
repeat, then B's, ...), median over --repeats, since the machine may be shared:
  before          the head as it trained before: logits at every entry, the loss through autograd
  trained rows    lm_head (and norm, loss) over the trained entries only (`unroll(keep=...)`)
  fused loss      forward KL over the teacher's top-k with its gradient in closed form (`losses.topk_forward_kl`)
  fused AdamW     one fused optimizer kernel (`torch.optim.AdamW(fused=True)`)
  matmul attention  step 0's attention by matmuls as the later steps', not SDPA's CPU kernel
  online          as `matmul attention`, the features from the target's pass inside each step (`eagle3.features: online`)
Then --quality-steps of training for `before` and the last cached variant from the same start, same
batches and learning-rate schedule: the loss and the held-out acceptance at equal tokens.

A record, no longer a reproduction of every "before": the head's switch back to SDPA for step 0
(`Eagle3Draft.unroll_sdpa`) left the library once the change had been measured, so every variant here
now runs step 0 by matmuls and `matmul attention` measures the same code as `fused AdamW`. The numbers
of both are in benchmarks/experiments/README.md and in the history of this file; `git checkout b84e883`
(the last commit with `unroll_sdpa`) reruns every variant as it was measured.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

import specdistill  # noqa: F401  (offline environment)
from specdistill import hardware
from specdistill.distill.distill_recipe import load_config
from specdistill.distill.eagle3_train import Eagle3Task, Eagle3Trainee, collate_eagle3, eagle3_heldout_acceptance, eagle3_loss
from specdistill.distill.examples import read_examples
from specdistill.distill.features import FeatureCache, OnlineFeatures, build_feature_cache
from specdistill.distill.train import apply_freeze, lr_at
from specdistill.modeling.models import load_model, resolve_dtype

VARIANTS = {  # name: (logits of trained rows only, fused loss, fused AdamW, matmul attention, online features)
    "before": (False, False, False, False, False),
    "trained rows": (True, False, False, False, False),
    "fused loss": (True, True, False, False, False),
    "fused AdamW": (True, True, True, False, False),
    "matmul attention": (True, True, True, True, False),
    "online": (True, True, True, True, True),
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def link_data(data: Path, work: Path) -> Path:
    """--work/data: the night's files, its feature shards linked (never written)."""
    out = work / "data"
    (out / "features").mkdir(parents=True, exist_ok=True)
    for f in (data / "features").iterdir():
        target = out / "features" / f.name
        if not target.exists():
            if f.suffix == ".json":
                shutil.copy(f, target)
            else:
                target.symlink_to(f.resolve())
    for name in ("train_generated.jsonl", "eval_generated.jsonl", "teacher_cache"):
        if (data / name).exists() and not (out / name).exists():
            (out / name).symlink_to((data / name).resolve())
    return out


def make_task(args, data: Path) -> tuple:
    dtype = resolve_dtype("auto")
    heldout = data / "eval_generated.jsonl"
    config = load_config(None, [
        "target=demo", "kind=eagle3", f"data.path={data / 'train_generated.jsonl'}", "teacher.mode=cache",
        f"teacher.cache_dir={data / 'teacher_cache'}", f"eagle3.feature_dir={data / 'features'}",
        f"eagle3.heldout_feature_dir={data / 'features-heldout'}", f"optim.bf16={dtype == torch.bfloat16}",
        f"out_dir={args.work / 'out'}", "progress=false",
        *([f"data.heldout_path={heldout}", "data.heldout_limit=40"] if heldout.is_file() else [])])
    target = load_model("demo", dtype="float32", device="cpu")
    tok = target.tokenizer
    examples = read_examples(config.data.path, "generated", tok, config.data.max_len)
    held = read_examples(str(heldout), "generated", tok, config.data.max_len, 40) if heldout.is_file() else []
    if held and not (data / "features-heldout" / "feature_cache.json").is_file():  # whole prompt, as served
        runner = copy.deepcopy(target.model).to(dtype)
        build_feature_cache(runner, held, data / "features-heldout", fingerprint=target.fingerprint,
                            layers=json.loads((data / "features" / "feature_cache.json").read_text())["layers"],
                            prompt_context=None, progress=False)
    task = Eagle3Task(config, target, examples, [], held, torch.device("cpu"))
    return config, target, task, dtype


class Run:
    """One variant's head, optimizer and step."""

    def __init__(self, name: str, task, config, online: OnlineFeatures | None):
        self.name, self.task, self.config = name, task, config
        self.rows_only, self.fused_loss, fused_opt, _matmul, self.online = VARIANTS[name]
        self.head = copy.deepcopy(task.head)  # `_matmul` is unread: step 0 runs by matmuls in every variant now
        self.head.embed_tokens = task.head.embed_tokens  # frozen, shared
        self.module = Eagle3Trainee(self.head, config.eagle3.steps)
        apply_freeze(self.head, config.frozen_patterns)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        o = config.optim
        self.opt = torch.optim.AdamW(self.params, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, fused=fused_opt)
        self.features = online
        self.step_no, self.tokens, self.losses = 0, 0, []
        self.clock: dict[str, float] | None = None  # seconds per section of the step, when profiling

    def _tick(self, section: str, since: float) -> float:
        now = time.perf_counter()
        if self.clock is not None:
            self.clock[section] = self.clock.get(section, 0.0) + now - since
        return now

    def step(self, indices: list[int]) -> int:
        o, steps = self.config.optim, self.module.steps
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step_no, o)
        t = time.perf_counter()
        chosen = [self.task.examples[i] for i in indices]
        batch = collate_eagle3(chosen, steps)
        keep = [batch.trained(j) for j in range(steps)] if self.rows_only else None
        t = self._tick("collate (Python)", t)
        if self.online:
            batch.features = self.features(chosen)
            t = self._tick("online feature pass", t)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(o.bf16)):
            outs = self.module(batch.next_ids, batch.features, batch.valid, keep)
        t = self._tick("forward", t)
        loss = eagle3_loss(outs, batch, decay=self.config.eagle3.decay, fused=self.fused_loss)
        t = self._tick("loss forward", t)
        loss.backward()
        t = self._tick("backward", t)
        torch.nn.utils.clip_grad_norm_(self.params, o.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self._tick("clip + AdamW", t)
        self.step_no += 1
        self.tokens += batch.tokens
        self.losses.append(float(loss.detach()))
        return batch.tokens


BACKWARD_PARTS = (  # autograd node name fragments -> part of the step
    ("loss over the top-k", ("LogSoftmax", "Logsumexp", "Gather", "Scatter", "Index", "TopKForwardKL", "Div", "Exp",
                             "Where", "Sub")),
    ("attention core", ("ScaledDotProduct", "Softmax", "Bmm", "MaskedFill", "Stack", "Sum")),
    ("linear layers (mm)", ("MmBackward", "TBackward", "Addmm")),
    ("autocast casts", ("ToCopy",)),
)


def profile(run: Run, order: list[list[int]]) -> list[tuple[str, float]]:
    """Seconds per step: timed sections, the forward split by module hooks (norm + lm_head, the attention
    between v_proj and o_proj) and the backward split by autograd node."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    run.clock = {}
    marks: dict[str, float] = {}
    attn = run.head.midlayer.self_attn

    def mark(key):
        return lambda *a: marks.__setitem__(key, time.perf_counter())

    def add(name, start_key):
        return lambda *a: run.clock.__setitem__(name, run.clock.get(name, 0.0) + time.perf_counter() - marks[start_key])

    hooks = [run.head.norm.register_forward_pre_hook(mark("norm")),
             run.head.lm_head.register_forward_hook(add("  forward: norm + lm_head", "norm")),
             attn.v_proj.register_forward_hook(mark("v")),
             attn.o_proj.register_forward_pre_hook(add("  forward: rope + attention core", "v"))]
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for indices in order:
            run.step(indices)
    for h in hooks:
        h.remove()
    nodes = [e for e in prof.key_averages() if e.key.startswith("autograd::engine::evaluate_function")]
    for name, fragments in BACKWARD_PARTS:
        picked = [e for e in nodes if any(f in e.key for f in fragments)]
        run.clock["  backward: " + name] = sum(e.cpu_time_total for e in picked) / 1e6
        nodes = [e for e in nodes if e not in picked]
    run.clock["  backward: other (norms, rope, MLP activations)"] = sum(e.cpu_time_total for e in nodes) / 1e6
    clock, run.clock = run.clock, None
    return [(k, v / len(order)) for k, v in clock.items()]


def throughput(runs: list[Run], order: list[list[int]], repeats: int, steps: int) -> dict[str, float]:
    """Tokens/s per variant: median over interleaved repeats of `steps` steps each (after 2 warm-up steps)."""
    for run in runs:
        for indices in order[:2]:
            run.step(indices)
    rates: dict[str, list[float]] = {run.name: [] for run in runs}
    for r in range(repeats):
        batches = order[2 + r * steps : 2 + (r + 1) * steps]
        for run in (runs if r % 2 == 0 else runs[::-1]):
            t0 = time.perf_counter()
            tokens = sum(run.step(indices) for indices in batches)
            rates[run.name].append(tokens / (time.perf_counter() - t0))
    return {name: statistics.median(v) for name, v in rates.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/train-throughput"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6, help="steps per timed repeat")
    ap.add_argument("--quality-steps", type=int, default=150)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--profile-steps", type=int, default=10, help="profiled steps of before and of the last variant")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    data = link_data(args.data, args.work)
    config, target, task, dtype = make_task(args, data)
    info = hardware.cpu_info()
    cpu = ("AVX2 flags (as_avx2)" if info.emulated else "native bf16 (AMX)" if info.native_bf16 else "no native bf16")
    dtype_name = "bf16" if config.optim.bf16 else "fp32"
    names = args.variants.split(",")
    online = None
    if "online" in names:
        online = OnlineFeatures(target.model, task.layers, resolve_dtype(config.eagle3.feature_dtype))
    rng = random.Random(0)
    order = [rng.sample(range(len(task.examples)), config.optim.batch_size) for _ in range(2 + args.repeats * args.steps)]
    torch.manual_seed(0)
    rates = throughput([Run(name, task, config, online) for name in names], order, args.repeats, args.steps)
    disk = FeatureCache.open(data / "features", fingerprint=target.fingerprint, layers=task.layers).disk_bytes()
    print(f"\n{info.describe()}")
    print(f"EAGLE-3 head training, demo target, {len(task.examples)} answers, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} interleaved repeats x {args.steps} steps")
    print("| CPU | dtype | variant | tokens/s | vs before | vs previous | feature disk |")
    print("|---|---|---|---|---|---|---|")
    previous = None
    for name in names:
        rate = rates[name]
        base = rates.get("before", rate)
        print(f"| {cpu} | {dtype_name} | {name} | {rate:.0f} | {rate / base:.2f}x | "
              f"{rate / (previous or rate):.2f}x | {'0 (online)' if VARIANTS[name][4] else f'{disk / 1e6:.0f} MB'} |")
        previous = rate
    result = {"cpu": cpu, "dtype": dtype_name, "threads": torch.get_num_threads(), "tokens_per_s": rates,
              "feature_disk_bytes": disk}
    if args.profile_steps:
        shown = [names[0]] + [n for n in names[1:] if not VARIANTS[n][4]][-1:] + [n for n in names if VARIANTS[n][4]]
        porder = [rng.sample(range(len(task.examples)), config.optim.batch_size) for _ in range(args.profile_steps + 2)]
        parts = {}
        for name in shown:
            run = Run(name, task, config, online)
            for indices in porder[:2]:
                run.step(indices)
            parts[name] = dict(profile(run, porder[2:]))
        keys = list(dict.fromkeys(k for p in parts.values() for k in p))
        sections = [k for k in keys if not k.startswith("  ")]
        keys = [x for k in sections for x in [k] + [sub for sub in keys if sub.startswith(f"  {k.split()[0]}:")]]
        print(f"\nOne step, ms (share of the step; indented rows split the section above them), {args.profile_steps} steps")
        print("| part | " + " | ".join(shown) + " |")
        print("|---|" + "---|" * len(shown))
        for k in keys:
            cells = []
            for name in shown:
                total = sum(v for key, v in parts[name].items() if not key.startswith("  "))
                v = parts[name].get(k)
                cells.append("" if v is None else f"{v * 1e3:.1f} ({v / total:.0%})")
            print(f"| {k} | " + " | ".join(cells) + " |")
        result["profile_ms"] = {n: {k: v * 1e3 for k, v in p.items()} for n, p in parts.items()}
    if args.quality_steps and "before" in names:
        after = [n for n in names if not VARIANTS[n][4]][-1]
        rng = random.Random(1)
        qorder = [rng.sample(range(len(task.examples)), config.optim.batch_size) for _ in range(args.quality_steps)]
        config.optim.max_steps = args.quality_steps
        print(f"\n{args.quality_steps} steps from the same start, same batches (equal tokens): before vs {after}")
        print("| variant | tokens | mean loss, last 20 steps | held-out acceptance pos 1 | chained τ(4) |")
        print("|---|---|---|---|---|")
        torch.manual_seed(0)
        for run in (Run("before", task, config, None), Run(after, task, config, None)):
            for indices in qorder:
                run.step(indices)
            acc = eagle3_heldout_acceptance(run.head, task.heldout, steps=config.eagle3.eval_steps) if task.heldout else {}
            print(f"| {run.name} | {run.tokens} | {statistics.mean(run.losses[-20:]):.4f} | "
                  f"{acc.get('acceptance', float('nan')):.3f} | {acc.get('tau_chain_4', float('nan')):.2f} |")
            result[f"quality_{run.name}"] = {"tokens": run.tokens, "loss": statistics.mean(run.losses[-20:]), **acc}
    (args.work / "results.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
