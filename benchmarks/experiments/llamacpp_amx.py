"""llama.cpp with and without Intel AMX on this CPU: the same pinned source built two ways, side by side.

`make llama-server` builds -march=native; on an AMX CPU (`amx_tile amx_int8` in /proc/cpuinfo) that
build runs ggml's AMX kernels for the quantized matmuls of a batch (Q4_1 among them; a one-row
matmul keeps the AVX-512 VNNI path). `SPECDISTILL_LLAMA_CPP_ISA=native-noamx` builds the same
source with AMX turned off in the compiler. This script builds (or finds) both in the engine cache
and serves the demo target's own Q4_1 GGUF with each, on loopback, the two servers up together:

- answers: the nightly's engine-answer shape: `--prompts` ShareGPT first turns (chat template
  applied, as text), `--parallel` slots decoding together, `--max-new-tokens` each (EOS ignored, so
  every round decodes the same number of tokens); answer tokens/s over the batch's wall time;
- prefill: one long prompt (`--prefill-tokens`) evaluated alone, the server's own prompt tokens/s;
- decode: one request alone, the server's own generated tokens/s.

Rounds are interleaved (the order alternates), median over rounds; the ratio is AMX / no-AMX.

    python benchmarks/experiments/llamacpp_amx.py --rounds 3 --threads 2

2026-12-02 04:48 UTC, 2-core Intel Xeon with AMX and AVX-512 BF16 (`amx_tile amx_int8 amx_bf16`),
quiet, GCC 12.2 with the ldtilecfg patch (`engines.llamacpp.build.SOURCE_PATCHES`; without it the AMX build
crashed at start-up), 32 prompts, 16 slots, 64 new tokens, a 480-token prefill:

    build     answers tok/s  prefill tok/s  decode tok/s   per round (answers)
    AMX               319.8         1249.3         172.7   337.4 319.8 319.2
    no AMX            122.3          331.6          85.2   122.1 122.3 125.4
    AMX/none          2.62x          3.77x         2.03x

AMX pays most where a matmul has many rows (prefill, a batch of slots), and one-stream decoding
doubles too: the AMX buffer type repacks the Q4_1 weights, which its one-row VNNI path reads.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import specdistill  # noqa: F401  (offline environment)
from specdistill.data.datasets import sharegpt_first_turns
from specdistill.engines.llamacpp import build
from specdistill.engines.llamacpp.server import LlamaServer, ServerConfig
from specdistill.modeling.models import demo_gguf_path, load_model


def built(isa: str) -> build.LlamaCpp:
    """The cached build for `isa` (built first when missing: minutes)."""
    os.environ[build.ISA_ENV] = isa
    try:
        return build.build_llama_server()
    finally:
        del os.environ[build.ISA_ENV]


def post(url: str, body: dict, timeout: float = 600.0) -> dict:
    request = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def answers(url: str, prompts: list[str], parallel: int, new_tokens: int) -> float:
    """Answer tokens/s of the whole batch, `parallel` requests in flight."""
    body = {"n_predict": new_tokens, "ignore_eos": True, "temperature": 0.0, "cache_prompt": False}
    t0 = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        done = list(pool.map(lambda p: post(url, {**body, "prompt": p}), prompts))
    return sum(r["tokens_predicted"] for r in done) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=480)
    args = ap.parse_args()

    flags = set(open("/proc/cpuinfo").read().split())
    if not {"amx_tile", "amx_int8"} <= flags:
        sys.exit("this CPU has no AMX (amx_tile, amx_int8 in /proc/cpuinfo): nothing to compare")
    builds = {"AMX": built("native"), "no AMX": built("native-noamx")}
    for name, engine in builds.items():
        tiles = subprocess.run(f"objdump -d {engine.server} | grep -c ldtilecfg", shell=True,
                               capture_output=True, text=True).stdout.strip()
        print(f"{name:7s} {engine.server}  (ldtilecfg instructions: {tiles})", file=sys.stderr)

    tok = load_model("demo", dtype="float32").tokenizer
    turns = sharegpt_first_turns(args.prompts, tokenizer=tok, max_tokens=160)
    prompts = [tok.apply_chat_template(t.messages, tokenize=False, add_generation_prompt=True) for t in turns]
    words = " ".join(t.text for t in sharegpt_first_turns(200, min_chars=200)).split()
    long_prompt = tok.decode(tok(" ".join(words))["input_ids"][: args.prefill_tokens])

    model = demo_gguf_path()
    config = ServerConfig(model=model, threads=args.threads, parallel=args.parallel,
                          ctx_size=args.parallel * max(160 + args.max_new_tokens + 32, args.prefill_tokens + 64))
    rows: dict[str, dict[str, list[float]]] = {n: {"answers": [], "prefill": [], "decode": []} for n in builds}
    with LlamaServer(builds["AMX"].server, config) as amx, LlamaServer(builds["no AMX"].server, config) as plain:
        urls = {"AMX": amx.url, "no AMX": plain.url}
        for name in urls:  # warm both (first requests pay page faults and repacking)
            answers(urls[name], prompts[:2], 2, 4)
        for r in range(args.rounds):
            for name in (list(urls) if r % 2 == 0 else list(urls)[::-1]):
                url = urls[name]
                rows[name]["answers"].append(answers(url, prompts, args.parallel, args.max_new_tokens))
                t = post(url, {"prompt": long_prompt, "n_predict": 1, "cache_prompt": False})["timings"]
                rows[name]["prefill"].append(t["prompt_per_second"])
                t = post(url, {"prompt": prompts[0], "n_predict": args.max_new_tokens, "ignore_eos": True,
                               "temperature": 0.0, "cache_prompt": False})["timings"]
                rows[name]["decode"].append(t["predicted_per_second"])
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

    med = {n: {k: statistics.median(v) for k, v in m.items()} for n, m in rows.items()}
    print(f"\nllama.cpp {build.LLAMA_CPP_VERSION}, demo target Q4_1, {args.threads} threads, "
          f"median of {args.rounds} interleaved rounds")
    print(f"{'build':8s} {'answers tok/s':>14s} {'prefill tok/s':>14s} {'decode tok/s':>13s}   per round (answers)")
    for name, m in med.items():
        per = " ".join(f"{x:.1f}" for x in rows[name]["answers"])
        print(f"{name:8s} {m['answers']:14.1f} {m['prefill']:14.1f} {m['decode']:13.1f}   {per}")
    ratio = {k: med["AMX"][k] / med["no AMX"][k] for k in ("answers", "prefill", "decode")}
    print(f"{'AMX/none':8s} {ratio['answers']:13.2f}x {ratio['prefill']:13.2f}x {ratio['decode']:12.2f}x")


if __name__ == "__main__":
    main()
