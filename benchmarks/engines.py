"""How do the harness (fp32, bf16), llama.cpp and vLLM compare on this CPU: target-only speed, a draft's and n-gram's?

    python benchmarks/engines.py --draft DIR --prompts eval_generated.jsonl [--limit 20]
        [--max-new-tokens 48] [--gamma 4] [--threads 2] [--engines fp32,bf16,llamacpp,vllm]

The demo target in the engines side by side in one run: this PyTorch harness in fp32 and in bf16,
llama.cpp (`llama-server`, the target's own Q4_1 GGUF) and vLLM (its CPU build, `make vllm`, on the
target's safetensors in the dtype the harness's `auto` picks; each mode started from the
`speculative_config` serving.json would carry, eager). For each engine: target-only
tokens/s, and for a trained draft and for n-gram lookup their speedup, acceptance α and accepted
length τ.

Every (engine, mode) pair runs each prompt once, in an order that rotates from prompt to prompt, so
no engine or mode always runs first and all see the same machine state; tokens/s is summed tokens
over summed wall-clock seconds (prompt processing included), speedup is a mode's tokens/s over its
own engine's target-only tokens/s, and the per-prompt median of that ratio is shown beside it.
α and τ: the harness's own counts; llama.cpp's and vLLM's Δaccepted / Δdraft tokens and
1 + Δaccepted / Δdrafts of their /metrics counters. In llama.cpp the draft runs as a GGUF f16: a layer-extracted draft with
`draft-simple` and the full vocabulary head (llama.cpp refuses a reduced one), an EAGLE-3 head with
`draft-eagle3` and its own draft vocabulary (d2t).

--prompts: the nightly's `eval_generated.jsonl` ({"prompt": [messages]}) or any prompt file
`specdistill bench` reads; the first user turn of each is asked.

Measured 2026-11-30 08:38-09:20 UTC on the 2-core CPU while four other CPU-bound jobs ran (load
average 7-8 throughout), the demo nightly's trained layer draft (layers 0,1,2,29; 8k draft vocabulary
in the harness, full head in llama.cpp), 10 held-out prompts of that nightly, 32 new tokens, K=4:

    engine             target-only tok/s draft speedup (per-prompt median)  draft α ngram speedup (per-prompt median)  ngram α
    harness fp32                     2.0         0.33x               0.62x    0.139         0.66x               0.92x    0.302
    harness bf16                     0.9         0.94x               0.89x    0.161         1.61x               1.09x    0.194
    llama.cpp Q4_1                   2.9         0.50x               0.49x    0.122         0.61x               1.07x    0.000

Under that load every absolute tokens/s is 10-60x below the same engines on an idle machine (21 tok/s
fp32, ~180 tok/s llama.cpp), so only ratios within one engine mean anything, and with 10 prompts they
are noisy (the fp32 draft's 0.33x vs its 0.62x per-prompt median). llama.cpp's n-gram (3-gram lookup,
32 tokens) accepted nothing here.

llama.cpp alone, `specdistill bench --engine llamacpp --prompts` (the same 10 prompts' first turns,
48 new tokens, --repeats 3), 09:36-09:39 UTC when the load had dropped (load average 0.8 -> 2.4):
draft-simple α 0.138, τ 1.54, 0.31x, 10/10 outputs identical to target-only; ngram-simple (3-gram
lookup, K=4) α 0.603, τ 3.30, 1.69x, 10/10 identical.

The demo's EAGLE-3 head (a finished `make demo`: layers 2,15,27, 8k draft vocabulary; the harness
measured it at α 0.123, γ=4, 1.07x in bf16) in llama.cpp as `draft-eagle3` with its 8k vocabulary, the
same 10 held-out prompts, 32 new tokens, K=4, `--engines llamacpp --threads 1` (one thread: at load
average 8-15 two-thread llama.cpp stalled at seconds per token), 12:05-12:24 UTC 2026-11-30, load
average 7.4 -> 9.1 (10-15 between), four other engineers' CPU-bound jobs running:

  engine             target-only tok/s draft speedup (per-prompt median)  draft α draft τ ngram speedup (per-prompt median)  ngram α ngram τ
  llama.cpp Q4_1                   1.5         0.48x               0.54x    0.123    1.47         0.96x               0.99x    0.679    3.59

α is the harness's α exactly: the head drafts the same in llama.cpp. At α 0.12 it is a slowdown there,
as the layer draft is; n-gram is at parity under this load.

The quiet run (nothing else running, load average 1.5-2.0, 13:18-13:20 UTC 2026-11-30): the EAGLE-3 head of
a fresh `make demo` (3 minutes of training on 384 target answers; α 0.374 at γ=1, 1.21x in that demo's bench),
the demo's 10 held-out prompts, 40 new tokens, γ/K=2, 2 threads:

  engine             target-only tok/s draft speedup (per-prompt median)  draft α draft τ ngram speedup (per-prompt median)  ngram α ngram τ
  harness fp32                    16.4         0.69x               0.69x    0.219    1.43         0.96x               0.93x    0.449    1.89
  harness bf16                    24.1         1.21x               1.22x    0.256    1.51         1.19x               1.10x    0.277    1.55
  llama.cpp Q4_1                  67.7         0.62x               0.63x    0.250    1.49         1.00x               1.00x    0.000    1.00

llama.cpp decodes the target 2.8x faster than the bf16 harness; the head drafts the same there (α 0.250 vs
0.256) but its step is not cheap next to a Q4_1 target step, so it slows llama.cpp down. With K=2,
llama.cpp's ngram-simple drafted nothing on these prompts (α 0, τ 1.00): its draft length is its m-gram.

vLLM 0.32.0 (CPU build, bf16, eager, 2 OpenMP threads), 2026-12-01 13:47-13:50 UTC, load average
12-14 on the 2-core AVX-512-BF16 CPU (other engineers' jobs): a full `--engines fp32,bf16,vllm` run
did not get past its first prompt in 17 minutes, so only vLLM's own servers were measured (the
engine bench, `engines.endpoint_bench.run_engine_bench`, 4 of the prompts, 32 new tokens, K=4): target-only
2.2 tok/s; n-gram (1..3-grams, K=4) α 0.174, τ 1.68, per position 0.22 0.17 0.15 0.15, 4/4 lossless
(3 exact, 1 near-tie), 18.9 tok/s; the target's early-exit draft at layer 8 as `draft_model`
α 0.006, τ 1.02, 0.9 tok/s. The n-gram "speedup" (8.6x at τ 1.68) cannot come from acceptance: the
target-only vLLM server decoded 3-6x slower than a speculative one even where nothing was accepted,
in every run here, so speedups over vLLM's target-only on this CPU are not to be believed until that
is explained; and a layer draft whose harness α is far above zero is accepted almost never in vLLM.

Explained 2026-12-01 14:20-14:32 UTC (per-thread CPU of each server's worker during each request, two
servers alive, load average 3-7): vLLM's n-gram proposer calls numba's `set_num_threads` around each
proposal, numba's OpenMP layer does that with `omp_set_num_threads` in the libiomp5 the model runs in,
and the count it restores is 1 (numba sizes itself from the worker's affinity after KMP_AFFINITY has
pinned the main thread to one core). From its first proposal on, the n-gram server decoded on one
OpenMP thread and target-only on two; on the loaded 2-core CPU two pinned threads lost every barrier
to the other jobs (target-only burned 13 CPU-s for 32 tokens in 12 s, n-gram 1.4 CPU-s in 1.1 s, the
idle server under 0.7 CPU-s: not the idle server's spinning). `engines.vllm.server` now gives numba its own
thread pool (NUMBA_THREADING_LAYER=workqueue); both workers then run two threads and n-gram ran at
0.88x of target-only (6 ShareGPT prompts, 32 tokens, K=4, bf16, interleaved; load average 3.5-6.9).
The draft_model/eagle3 servers had no numba and ran two threads all along: the layer-8 early exit's
0.9 tok/s was measured fairly, and its α 0.006 at K=4 is averaged over four positions (the harness's
0.035 is at γ=1), not yet compared per position.

All four engines in one run, 2026-12-01 19:48-19:55 UTC, the EAGLE-3 head of that day's fresh `make
demo` (960 answers, 3 minutes of training; its draft vocabulary, layers 2,15,27) as a chain at K=4,
the demo's 10 held-out prompts, 40 new tokens, 2 threads, bf16 where the engine takes a dtype; the
2-core AMD EPYC with AVX-512 BF16, shared with niced test runs and vLLM's three servers (load
average 3-8, so the absolute tokens/s are low, fp32's most):

    python benchmarks/engines.py --draft RUN/distill/KEY/draft --prompts RUN/data/KEY/eval_generated.jsonl \
        --limit 10 --max-new-tokens 40 --gamma 4 --threads 2 --engines fp32,bf16,llamacpp,vllm

  engine             target-only tok/s draft speedup (per-prompt median)  draft α draft τ ngram speedup (per-prompt median)  ngram α ngram τ
  harness fp32                     9.6         1.10x               1.11x    0.140    1.54         1.65x               1.62x    0.320    2.23
  harness bf16                    23.5         1.12x               1.10x    0.140    1.54         1.27x               1.18x    0.182    1.70
  llama.cpp Q4_1                  47.4         0.55x               0.54x    0.143    1.55         1.01x               1.02x    0.650    3.45
  vLLM bfloat16                   12.2         0.84x               0.93x    0.149    1.60         0.95x               0.96x    0.210    1.84

The head drafts alike in the three engines: α 0.140 in the harness (fp32 and bf16), 0.143 in
llama.cpp (its GGUF f16), 0.149 in vLLM (within 0.01 absolute on 10 prompts; τ 1.54 / 1.55 / 1.60).
Speed is the engine's: a chain of 4 from a 3-layer head pays off only in the harness; llama.cpp
decodes the target 2x faster than the bf16 harness, so the head's step is dear there, and vLLM CPU
(eager) is the slowest target-only here and neither mode beats it. vLLM started its three servers
together in 92 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from transformers import AutoTokenizer

from specdistill.data.prompt_files import read_prompt_file
from specdistill.data.prompts import encode_chat
from specdistill.engines.client import chat, delta, metrics_url, scrape
from specdistill.engines.llamacpp.build import build_llama_server
from specdistill.engines.llamacpp.engine import gguf_dtype, target_gguf
from specdistill.engines.llamacpp.server import LlamaServer, ServerConfig, ServerMode
from specdistill.engines.vllm.bench import served_dtype, target_dir
from specdistill.engines.vllm.server import VllmConfig, VllmServer, start_together
from specdistill.modeling.models import load_model, resolve_model_dir
from specdistill.pipeline.stages.engine_bench import mode_for_spec, mode_serving_config
from specdistill.speculative import DrafterSpec, drafter_from_spec
from specdistill.speculative.decode import SpecStats, generate
from specdistill.speculative.specs import DRAFT_MODEL

SERVERS = ("llamacpp", "vllm")  # engines measured through their OpenAI-compatible servers


def read_prompts(path: Path, limit: int) -> list[str]:
    """First user turns, from the nightly's generated JSONL or from any prompt file."""
    first = path.open().readline()
    if first.strip().startswith("{") and '"prompt": [' in first:
        texts = []
        for line in path.open():
            messages = json.loads(line)["prompt"]
            texts.append(next(m["content"] for m in messages if m["role"] == "user"))
    else:
        texts = [r.turns[0] for r in read_prompt_file(path, "first")]
    return texts[:limit]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="demo")
    ap.add_argument("--draft", required=True, help="a layer-extracted draft (HF checkpoint) or an EAGLE-3 head directory")
    ap.add_argument("--prompts", required=True, type=Path)
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="fp32,bf16,llamacpp,vllm", help="which of fp32, bf16, llamacpp, vllm to run")
    ap.add_argument("--json", default=None, help="also write the raw numbers here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    texts = read_prompts(args.prompts, args.limit)
    chosen = args.engines.split(",")
    gguf = target_gguf(args.target) if "llamacpp" in chosen else None
    engines = {name: kind for key, name, kind in (
        ("fp32", "harness fp32", "float32"), ("bf16", "harness bf16", "bfloat16"),
        ("llamacpp", f"llama.cpp {gguf_dtype(gguf) if gguf else ''}", "llamacpp"),
        ("vllm", f"vLLM {served_dtype()}", "vllm")) if key in chosen}

    harness = {}
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(args.target))
    for dtype in (kind for kind in engines.values() if kind not in SERVERS):
        loaded = load_model(args.target, dtype=dtype)
        draft = drafter_from_spec(loaded.model, DrafterSpec.for_draft(args.draft))
        harness[dtype] = (loaded.model, {"target-only": None, "draft": draft, "ngram": drafter_from_spec(loaded.model, "ngram")})
    ids = [encode_chat(tokenizer, [{"role": "user", "content": t}]) for t in texts]

    runs = [(e, m) for e in engines for m in ("target-only", "draft", "ngram")]
    times = {run: [] for run in runs}  # (tokens, seconds) per prompt
    stats = {run: SpecStats() for run in runs if run[1] != "target-only" and engines[run[0]] not in SERVERS}
    with ExitStack() as stack:
        urls = {}  # (engine kind, mode) -> base URL
        if "llamacpp" in engines.values():
            engine = build_llama_server()
            llama_modes = {"target-only": ServerMode(), "draft": mode_for_spec(DrafterSpec(DRAFT_MODEL, args.draft), gguf, args.gamma),
                           "ngram": mode_for_spec(DrafterSpec("ngram"), gguf, args.gamma)}
            for m, mode in llama_modes.items():
                server = LlamaServer(engine.server, ServerConfig(model=gguf, mode=mode, threads=args.threads))
                urls[("llamacpp", m)] = stack.enter_context(server).url
        if "vllm" in engines.values():  # each mode from the speculative_config serving.json would carry
            blocks = {"target-only": None,
                      "draft": mode_serving_config(DrafterSpec(DRAFT_MODEL, args.draft), args.gamma, args.target).vllm(),
                      "ngram": mode_serving_config(DrafterSpec("ngram"), args.gamma, args.target).vllm()}
            servers = {m: VllmServer(VllmConfig(model=target_dir(args.target), speculative_config=b, threads=args.threads,
                                                dtype=served_dtype(), name=m)) for m, b in blocks.items()}
            for server in servers.values():
                stack.callback(server.stop)
            t0 = time.monotonic()
            errors = start_together(list(servers.values()))
            if errors:
                sys.exit("vLLM refused: " + "; ".join(f"{list(servers)[i]}: {e.cause or e}" for i, e in errors.items()))
            print(f"vLLM: {len(servers)} servers started together in {time.monotonic() - t0:.0f} s", file=sys.stderr)
            urls.update({("vllm", m): s.url for m, s in servers.items()})

        def one(run, i: int, max_new_tokens: int = args.max_new_tokens):
            name, mode = run
            if engines[name] in SERVERS:
                done = chat(urls[(engines[name], mode)], [{"role": "user", "content": texts[i]}], max_tokens=max_new_tokens)
                return done.generated_tokens, done.seconds, None
            model, drafters = harness[engines[name]]
            result = generate(model, ids[i], max_new_tokens=max_new_tokens, drafter=drafters[mode], gamma=args.gamma)
            return result.stats.generated_tokens, result.stats.seconds, result.stats

        for run in runs:  # warm-up: first-call allocations
            one(run, 0, 8)
        start = time.monotonic()
        before = {key: scrape(metrics_url(url)) for key, url in urls.items() if key[1] != "target-only"}
        for i in range(len(texts)):
            shift = i % len(runs)
            for run in runs[shift:] + runs[:shift]:
                n, s, st = one(run, i)
                times[run].append((n, s))
                if st is not None and run in stats:
                    stats[run] = stats[run].merge(st)
            print(f"prompt {i + 1}/{len(texts)} ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)
        after = {key: scrape(metrics_url(url)) for key, url in urls.items() if key[1] != "target-only"}

    def tps(run) -> float:
        return sum(n for n, _ in times[run]) / sum(s for _, s in times[run])

    def alpha_tau(run) -> tuple[float, float]:
        key = (engines[run[0]], run[1])
        counts = delta(before[key], after[key]).counts if engines[run[0]] in SERVERS else stats[run].counts
        return counts.acceptance_rate or 0.0, counts.accepted_length or 1.0

    rows = []
    print(f"\n{len(texts)} prompts, greedy, {args.max_new_tokens} new tokens, γ/K={args.gamma}, {args.threads} threads, "
          f"load average {os.getloadavg()[0]:.2f} at the end")
    print(f"{'engine':<18} {'target-only tok/s':>17} {'draft speedup':>13} {'(per-prompt median)':>19} {'draft α':>8} "
          f"{'draft τ':>7} {'ngram speedup':>13} {'(per-prompt median)':>19} {'ngram α':>8} {'ngram τ':>7}")
    for name in engines:
        base = tps((name, "target-only"))
        row = {"engine": name, "target_only_tokens_per_s": base}
        cells = []
        for mode in ("draft", "ngram"):
            run = (name, mode)
            ratios = [(n / s) / (bn / bs) for (n, s), (bn, bs) in zip(times[run], times[(name, "target-only")])]
            alpha, tau = alpha_tau(run)
            row.update({f"{mode}_speedup": tps(run) / base, f"{mode}_speedup_median": statistics.median(ratios),
                        f"{mode}_alpha": alpha, f"{mode}_tau": tau})
            cells.append(f"{tps(run) / base:>12.2f}x {statistics.median(ratios):>18.2f}x {alpha:>8.3f} {tau:>7.2f}")
        rows.append(row)
        print(f"{name:<18} {base:>17.1f} " + " ".join(cells))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
