"""Does the project's head trainer train as good a head as the field's own (vLLM's speculators) from the same
night, in the same minutes and on the same tokens? Run after `make demo` (it reads the newest night):

    python benchmarks/trainoff.py [--minutes M] [--out DIR] [--no-norms] [--vllm] [--resume] [--peagle]

Both trainers get the night's train answers (the same prompts, answers and held-out split; the target's hidden
states at the same three layers) and the machine to themselves, one after the other:
- ours: `specdistill distill` on the night's own head config (the nightly's recipe) for M minutes (default: the
  minutes the night trained);
- the peer: speculators' model definition and loss in the smallest loop that follows `speculators train`'s
  defaults (benchmarks/peer/speculators_trainoff.py says what differs and why), in speculators' own environment,
  saved at M minutes and at ours's answer tokens (or at --cap-minutes, where it is that much slower);
- ours again to the peer's answer tokens, where the two counts differ: equal tokens at whichever count both reach.
A stopped run goes on with --resume (each finished step's record is kept in DIR).
Each head is then read four ways: the held-out per-position acceptance by one evaluator (speculators' unroll,
ours exported to its format); ours's own evaluator where the head imports; τ and speedup at one served shape in
the project's harness (`specdistill bench`) on the night's held-out prompts; and, with --vllm, in vLLM's CPU build.
Training answer tokens per second and the trainer process's peak memory come from each run.
With --peagle, speculators' P-EAGLE (K positions drafted in one forward) is trained too, on the same data at M
minutes and at the peer's equal-token count (or --cap-minutes), read by the same evaluator at each of its K
positions, and, with --vllm, benched in vLLM's CPU build with parallel drafting at --peagle-gamma. The project's
harness has no parallel-drafting path, so its harness columns read n/a.

Prints one table; writes DIR/trainoff.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from specdistill.data.prompt_files import read_prompt_file
from specdistill.data.prompts import Prompt
from specdistill.distill.examples import read_examples
from specdistill.engines.endpoint_bench import EngineBenchConfig
from specdistill.engines.speculators.install import cached as speculators_env
from specdistill.engines.vllm.bench import bench_vllm
from specdistill.hardware import describe_device
from specdistill.modeling.models import load_model, resolve_dtype, resolve_model_dir
from specdistill.recipe import load_yaml

ROOT = Path(__file__).resolve().parent.parent
SPECDISTILL = [sys.executable, "-m", "specdistill.cli"]


def newest_head_run(state: Path) -> Path:
    """The newest EAGLE-3 training run under the state directory (its config.yaml says kind eagle3)."""
    runs = [p.parent for p in state.glob("**/distill/*/config.yaml")
            if load_yaml(p.read_text()).get("kind") == "eagle3" and (p.parent / "result.json").is_file()]
    if not runs:
        raise SystemExit(f"no EAGLE-3 training run under {state}: run `make demo` first")
    return max(runs, key=lambda p: p.stat().st_mtime)


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("$ " + " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, text=True, **kw)


def train_ours(config: Path, out: Path, minutes: float | None, tokens: int | None, extra: list[str]) -> dict:
    """`specdistill distill` on the night's head config, to a minute or an answer-token budget (not both)."""
    overrides = [f"out_dir={out}", "optim.max_steps=1000000", "progress=false", *extra]
    overrides += [f"optim.max_minutes={minutes}"] if minutes else ["optim.max_minutes=null", f"optim.max_tokens={tokens}"]
    started = time.perf_counter()
    done = sh(["/usr/bin/time", "-f", "peak_rss_kb=%M", *SPECDISTILL, "distill", "--config", config, *overrides],
              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak_kb = int(done.stderr.strip().splitlines()[-1].split("=")[1])
    result = json.loads((out / "result.json").read_text())
    curve = result["curve"][-1] if result.get("curve") else {}
    return {"dir": str(out / "draft"), "steps": result["steps"], "answer_tokens": result["tokens"],
            "minutes": result["train_minutes"], "answer_tokens_per_s": result["tokens"] / (60 * result["train_minutes"]),
            "wall_minutes": (time.perf_counter() - started) / 60, "peak_rss_gb": peak_kb / 1e6,
            "heldout_ours": {k: curve.get(k) for k in ("acceptance_per_position", "accepted_per_position")}}


def done_or(record: Path, step) -> dict:
    """The step's result from a resumed run's record, else the step run now and recorded."""
    if record.is_file():
        return json.loads(record.read_text())
    result = step()
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(result, indent=1))
    return result


def examples_file(run_config: dict, target, out: Path, train_limit: int | None) -> Path:
    """The night's train and held-out answers as token ids and answer masks, encoded and limited as ours reads them."""
    data = run_config["data"]
    def encode(path, limit):
        return [{"id": ex.id, "ids": ex.input_ids, "mask": ex.assistant_mask}
                for ex in read_examples(path, "generated", target.tokenizer, data["max_len"], limit)]
    path = out / "examples.json"
    path.write_text(json.dumps({"train": encode(data["path"], train_limit or data["limit"]),
                                "heldout": encode(data["heldout_path"], data["heldout_limit"])}))
    return path


def export_speculators(head: str, out: Path) -> str:
    if (out / "config.json").is_file():  # exported by the run this one resumes
        return str(out)
    sh([*SPECDISTILL, "draft", "export", head, "--format", "speculators", "--out", out], stdout=subprocess.DEVNULL)
    return str(out)


def import_head(src: Path, out: Path) -> str | None:
    """A peer head in ours's layout, or None with the one sentence `draft import` refused it with."""
    if (out / "config.json").is_file():  # imported by the run this one resumes
        return str(out)
    done = subprocess.run([*SPECDISTILL, "draft", "import", str(src), "--target", "demo", "--out", str(out)],
                          capture_output=True, text=True)
    if done.returncode:
        print(f"import of {src} refused: {done.stderr.strip()}", file=sys.stderr)
        return None
    return str(out)


def bench(head: str, prompts: str, gamma: int, width: int, engine: str, limit: int) -> dict:
    cmd = [*SPECDISTILL, "bench", "--json", "--draft", head, "--prompts", prompts, "--gamma", str(gamma),
           "--limit", str(limit), "--engine", engine]
    if engine == "harness":
        cmd += ["--tree-width", str(width)]
    done = sh(cmd, capture_output=True)
    r = json.loads(done.stdout)
    return {"tau": r.get("accepted_length"), **{k: r.get(k) for k in ("speedup", "speedup_ci", "per_position_acceptance", "dtype")}}


def bench_parallel_vllm(head: Path, prompts: str, gamma: int, limit: int, threads: int) -> dict:
    """A P-EAGLE head in vLLM's CPU build, as its speculators config asks (eagle3 with parallel drafting), at
    `specdistill bench --engine vllm`'s defaults (64 new tokens, 3 interleaved repeats)."""
    spec = {"model": str(head), "method": "eagle3", "parallel_drafting": True, "num_speculative_tokens": gamma}
    firsts = [Prompt(r.turns[0], r.slice) for r in read_prompt_file(prompts, "first")[:limit]]
    r = bench_vllm("demo", {"peagle": spec}, firsts, EngineBenchConfig(max_new_tokens=64, repeats=3, gamma=gamma, seed=0),
                   threads=threads)
    if "peagle" in r.refused:
        return {"refused": r.refused["peagle"]}
    d = r.results["peagle"].to_dict()
    return {"tau": d.get("accepted_length"), **{k: d.get(k) for k in ("speedup", "speedup_ci", "per_position_acceptance")}}


def row(name: str, trained: dict, heldout: dict, harness: dict | None, vllm: dict | None) -> str:
    pos = heldout["given_previous"]
    h = harness or {}
    v = vllm or {}
    def f(x, spec=".2f"):
        return "n/a" if x is None else format(x, spec)
    return (f"| {name} | {f(trained.get('minutes'))} | {trained.get('answer_tokens', 0):,} | "
            f"{f(trained.get('answer_tokens_per_s'), ',.0f')} | {f(trained.get('peak_rss_gb'))} | "
            f"{pos[0]:.3f} | {pos[1]:.3f} | {pos[2]:.3f} | {f(h.get('tau'))} | {f(h.get('speedup'))} | "
            f"{f(v.get('tau'))} | {f(v.get('speedup'))} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state", default=os.environ.get("SPECDISTILL_HOME", ".specdistill"))
    p.add_argument("--run", default=None, help="the night's head training run (default: the newest under --state)")
    p.add_argument("--minutes", type=float, default=None, help="training minutes each (default: the night's)")
    p.add_argument("--out", default="trainoff")
    p.add_argument("--no-norms", action="store_true", help="the peer without its Eagle 3.1 norms (its config's defaults)")
    p.add_argument("--total-seq-len", type=int, default=2048)
    p.add_argument("--cap-minutes", type=float, default=15.0, help="the most either trainer trains to meet the other's tokens")
    p.add_argument("--gamma", type=int, default=1)
    p.add_argument("--tree-width", type=int, default=4)
    p.add_argument("--limit", type=int, default=24, help="held-out prompts benched per head")
    p.add_argument("--vllm", action="store_true", help="also bench each head in vLLM's CPU build (`make vllm`)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--train-limit", type=int, default=None, help="train answers each trainer reads (a smoke run)")
    p.add_argument("--resume", action="store_true", help="go on in --out: steps whose results are there are not rerun")
    p.add_argument("--peagle", action="store_true", help="also train speculators' P-EAGLE (parallel drafting)")
    p.add_argument("--peagle-gamma", type=int, default=3, help="positions P-EAGLE drafts in one forward in vLLM")
    args = p.parse_args(argv)

    env = speculators_env()
    if env is None:
        raise SystemExit("speculators is not installed: run `make speculators` first")
    out = Path(args.out).resolve()
    if out.exists() and any(out.iterdir()) and not (args.resume and (out / "examples.json").is_file()):
        raise SystemExit(f"{out} is not empty: a train-off writes its heads into a directory of its own (give another "
                         "--out, or --resume to go on with the train-off there)")
    out.mkdir(parents=True, exist_ok=True)
    run = Path(args.run) if args.run else newest_head_run(Path(args.state))
    config = load_yaml((run / "config.yaml").read_text())
    night = json.loads((run / "result.json").read_text())
    minutes = args.minutes or night["train_minutes"]
    dtype = "bfloat16" if resolve_dtype("auto") == torch.bfloat16 else "float32"
    examples = out / "examples.json"
    if not examples.is_file():
        examples = examples_file(config, load_model("demo", dtype="auto"), out, args.train_limit)

    limit = [f"data.limit={args.train_limit}"] if args.train_limit else []
    ours = {"minutes": done_or(out / "ours-minutes" / "trainoff.json",
                               lambda: train_ours(run / "config.yaml", out / "ours-minutes", minutes, None, limit))}
    spec = {"target": str(resolve_model_dir("demo")), "examples": str(examples), "out": str(out),
            "minutes": minutes, "tokens": ours["minutes"]["answer_tokens"], "cap_minutes": args.cap_minutes,
            "draft_vocab_size": config.get("draft_vocab") or 8192, "total_seq_len": args.total_seq_len,
            "seed": 0, "dtype": dtype, "threads": args.threads, "norms": not args.no_norms,
            "evaluate": {"ours-minutes": export_speculators(ours["minutes"]["dir"], out / "ours-minutes-speculators")}}
    peer_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "PYTHONPATH": "", "TORCH_COMPILE_DISABLE": "1"}
    if not (out / "peer_result.json").is_file():
        (out / "peer_spec.json").write_text(json.dumps(spec, indent=1))
        sh([env.python, ROOT / "benchmarks" / "peer" / "speculators_trainoff.py", out / "peer_spec.json"],
           env=peer_env, stdout=subprocess.DEVNULL)
    peer = json.loads((out / "peer_result.json").read_text())
    saved = peer["train"]["saved"]
    # equal tokens: ours again to the peer's count where the peer trained on more in M minutes, or where the cap
    # stopped it short of ours's (the peer's `tokens` head is then compared with ours at its count)
    equal = (saved["minutes"]["answer_tokens"] if saved["minutes"]["answer_tokens"] > ours["minutes"]["answer_tokens"]
             else saved["tokens"]["answer_tokens"])
    if abs(equal - ours["minutes"]["answer_tokens"]) > 0.02 * ours["minutes"]["answer_tokens"]:
        ours["tokens"] = done_or(out / "ours-tokens" / "trainoff.json",
                                 lambda: train_ours(run / "config.yaml", out / "ours-tokens", None, equal, limit))
        if "ours-tokens" not in peer["heldout"]:
            spec.update(minutes=0, evaluate={"ours-tokens": export_speculators(ours["tokens"]["dir"], out / "ours-tokens-speculators")})
            (out / "peer_spec_eval.json").write_text(json.dumps(spec, indent=1))
            extra = sh([env.python, ROOT / "benchmarks" / "peer" / "speculators_trainoff.py", out / "peer_spec_eval.json"],
                       env=peer_env, capture_output=True)
            peer["heldout"].update(json.loads(extra.stdout.strip().splitlines()[-1])["heldout"])
            (out / "peer_result.json").write_text(json.dumps(peer, indent=1))

    prompts = str(Path(config["data"]["heldout_path"]))
    benched = min(args.limit, sum(1 for line in Path(prompts).open() if line.strip()))  # the night may hold fewer
    heads = {f"ours ({k})": v["dir"] for k, v in ours.items()}
    for k in ("minutes", "tokens"):
        imported = import_head(out / f"peer-{k}", out / f"peer-{k}-imported")
        heads[f"peer ({k})"] = imported
    results = {"cpu": describe_device("cpu"), "dtype": dtype, "night_run": str(run), "minutes": minutes, "peer": peer,
               "ours": ours, "bench": {}}
    engines = ["harness"] + (["vllm"] if args.vllm else [])
    for name, head in heads.items():
        if head is not None:
            results["bench"][name] = {e: done_or(out / "bench" / f"{name.replace(' ', '')}-{e}-g{args.gamma}w{args.tree_width}.json",
                                                 lambda e=e, head=head: bench(head, prompts, args.gamma, args.tree_width, e, args.limit))
                                      for e in engines}
    if args.peagle:
        if not (out / "peagle_result.json").is_file():
            (out / "peagle_spec.json").write_text(json.dumps({**spec, "kind": "peagle", "name": "peagle", "minutes": minutes,
                                                              "tokens": equal, "evaluate": {}}, indent=1))
            sh([env.python, ROOT / "benchmarks" / "peer" / "speculators_trainoff.py", out / "peagle_spec.json"],
               env=peer_env, stdout=subprocess.DEVNULL)
        results["peagle"] = json.loads((out / "peagle_result.json").read_text())
        if args.vllm:
            for k in ("minutes", "tokens"):
                results["bench"][f"peagle ({k})"] = {"vllm": done_or(
                    out / "bench" / f"peagle{k}-vllm-g{args.peagle_gamma}.json",
                    lambda k=k: bench_parallel_vllm(out / f"peagle-{k}", prompts, args.peagle_gamma, args.limit, args.threads))}
    (out / "trainoff.json").write_text(json.dumps(results, indent=1))

    print(f"train-off on the night {run.name}: {results['cpu']}, {dtype}; held-out per position from one evaluator "
          f"(speculators' unroll) on {peer['heldout_sequences']} held-out answers; harness at gamma {args.gamma} "
          f"tree {args.tree_width} on {benched} held-out prompts; peer feature pass {peer['feature_pass_seconds']:.0f} s "
          f"(not in its minutes); peak GB: each trainer's process (the target, the features and the head)")
    print("| head | train min | answer tokens | tokens/s | peak GB | pos 1 | 2 given 1 | 3 given 1-2 | tau harness "
          "| speedup harness | tau vLLM | speedup vLLM |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k, trained in ours.items():
        name = f"ours ({k})"
        b = results["bench"].get(name, {})
        print(row(name, trained, peer["heldout"][f"ours-{k}"], b.get("harness"), b.get("vllm")))
    for k in ("minutes", "tokens"):
        name = f"peer ({k})"
        b = results["bench"].get(name, {})
        print(row(name, saved[k], peer["heldout"][k], b.get("harness"), b.get("vllm")))
    if args.peagle:
        pe = results["peagle"]
        for k in ("minutes", "tokens"):
            name = f"peagle ({k})"
            b = results["bench"].get(name, {})
            print(row(name, pe["train"]["saved"][k], pe["heldout"][k], None, b.get("vllm")))
        print(f"P-EAGLE drafts {len(pe['heldout']['minutes']['accepted'])} positions in one forward; per position given the "
              f"ones before, and tau if a round drafted k of them (the chained held-out reading; vLLM at gamma "
              f"{args.peagle_gamma}):")
        for k in ("minutes", "tokens"):
            h = pe["heldout"][k]
            print(f"  peagle ({k}): given previous " + " ".join(f"{x:.3f}" for x in h["given_previous"])
                  + " | tau at k=1.. " + " ".join(f"{x:.2f}" for x in h["tau_chain_at"]))
            refused = results["bench"].get(f"peagle ({k})", {}).get("vllm", {}).get("refused")
            if refused:
                print(f"  vLLM refused it: {refused}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
