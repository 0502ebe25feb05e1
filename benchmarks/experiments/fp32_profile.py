"""Where an fp32 decode step of the demo target goes, and what MKL's packed GEMM gives there.

On a CPU without native bf16 (AVX2: `dtype: auto` is fp32) every stage decodes in fp32. This profiles
one decode step (`--rows` rows of one new token each over a KV cache of `--context` tokens: 1 row is the
benchmark's target-only step, 16 the answer batch) under `torch.profiler`, self CPU time grouped by
what it is (the 30 layers' projections, the 49k-token output head, attention, norms and rotary, the
rest), then times the step with the linear layers' weights packed once for MKL
(`mkl._mkl_reorder_linear_weight` / `mkl._mkl_linear`, the kernels inductor's CPU freezing uses): the
output head only, or every projection. Numerics: the packed GEMM rounds differently from `F.linear` in
the last bits (as `F.linear` itself does between row counts), so each variant's greedy answers to the
same prompts are compared with plain fp32's, token for token, and its logits' largest difference is shown.

    scripts/as_avx2.sh .venv/bin/python benchmarks/experiments/fp32_profile.py --rows 1,16 --threads 2

Steps are timed in interleaved rounds (median of per-round medians); run it alone on the machine.

Measured 2026-12-01 22:35 UTC on the 2-core AMD EPYC as an AVX2 machine (`scripts/as_avx2.sh`: AVX2 kernels
in PyTorch, oneDNN and MKL; this CPU's clock and caches), fp32, 2 threads, quiet, KV context 128:

    one decode step        1 row               16 rows
    projections (30 layers) 36.1 ms  67.8%     50.2 ms  53.6%
    output head (49k)        9.7 ms  18.2%     19.9 ms  21.3%
    norms, rotary, SiLU      2.7 ms   5.0%     14.0 ms  15.0%
    copies, cache, Python    3.8 ms   7.1%      4.7 ms   5.0%
    attention                1.0 ms   1.8%      4.8 ms   5.1%
    step, plain F.linear    57.95 ms  1.00x   107.59 ms  1.00x
    MKL packed head         52.70 ms  1.10x   102.64 ms  1.05x
    MKL packed all          53.17 ms  1.09x   110.05 ms  0.98x
    greedy agreement: 8/8 prompts x 32 tokens identical for both packings, first-step logits equal

A one-row step reads all 540 MB of fp32 weights for ~30 GFLOP/s of work: it is bound by memory
bandwidth (~9.3 GB/s here), not by the GEMM kernel, so repacking the same fp32 bytes gains 5-10%
and nothing for the answer batch; the library keeps `F.linear` in fp32. What would pay on such a CPU
is fewer weight bytes (bf16 or int8 weights), which changes the target's numerics: not lossless.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from transformers import DynamicCache

import specdistill  # noqa: F401  (offline environment)
from specdistill import hardware
from specdistill.data.datasets import sharegpt_first_turns
from specdistill.data.prompts import MAX_PROMPT_TOKENS, encode_chat
from specdistill.modeling.attention import decode_attention_for
from specdistill.modeling.models import load_model


@contextmanager
def mkl_packed(model: torch.nn.Module, which: str):
    """Inside the block, the chosen linear layers (`head`: the output head; `all`: every linear layer)
    run `mkl._mkl_linear` on their weight packed once."""
    patched = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and (which == "all" or name == "lm_head"):
            packed = torch.ops.mkl._mkl_reorder_linear_weight(module.weight.detach(), 1)

            def forward(x, module=module, packed=packed):
                flat = x.reshape(-1, x.shape[-1])
                out = torch.ops.mkl._mkl_linear(flat, packed, module.weight, module.bias, flat.shape[0])
                return out.reshape(*x.shape[:-1], out.shape[-1])

            patched.append(module)
            module.forward = forward
    try:
        yield
    finally:
        for module in patched:
            del module.forward  # back to nn.Linear.forward


def prefill(model, prompts: list[list[int]], context: int) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """A KV cache of `context` tokens per row (each prompt cut or repeated to that length) and the next token."""
    ids = torch.tensor([(p * (context // len(p) + 1))[:context] for p in prompts])
    cache = DynamicCache()
    with torch.inference_mode():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache, out.logits[:, -1:].argmax(-1), torch.ones(ids.shape[0], context + 1, dtype=torch.long)


def step_seconds(model, prompts, context: int, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        cache, token, mask = prefill(model, prompts, context)
        with torch.inference_mode(), decode_attention_for(model):
            start = time.perf_counter()
            model(input_ids=token, past_key_values=cache, attention_mask=mask, use_cache=True)
            times.append(time.perf_counter() - start)
    return times


def profile(model, prompts, context: int) -> dict[str, float]:
    """Self CPU milliseconds of one decode step, by kind of op (a GEMM whose shapes name the vocabulary is the head's)."""
    cache, token, mask = prefill(model, prompts, context)
    with torch.inference_mode(), decode_attention_for(model), torch.profiler.profile(record_shapes=True) as prof:
        model(input_ids=token, past_key_values=cache, attention_mask=mask, use_cache=True)
    groups: dict[str, float] = defaultdict(float)
    head_rows = model.lm_head.out_features
    for event in prof.events():
        if event.device_type.name != "CPU":
            continue
        name = event.name
        shapes = str(getattr(event, "input_shapes", "") or "")
        if name in ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul", "mkl::_mkl_linear"):
            kind = "output head" if str(head_rows) in shapes else "projections"
        elif "attention" in name or name in ("aten::bmm", "aten::baddbmm", "aten::_softmax", "aten::softmax",
                                               "aten::_scaled_dot_product_flash_attention_for_cpu"):
            kind = "attention"
        elif name in ("aten::pow", "aten::mean", "aten::rsqrt", "aten::mul", "aten::add", "aten::neg", "aten::cat",
                      "aten::cos", "aten::sin", "aten::silu"):
            kind = "norms, rotary, SiLU, residuals"
        else:
            kind = "the rest (copies, indexing, cache, Python)"
        groups[kind] += event.self_cpu_time_total / 1000.0
    return dict(groups)


def greedy(model, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], torch.Tensor]:
    """Each prompt's greedy continuation, one row at a time, and the logits of its first step."""
    outs, first = [], []
    with torch.inference_mode(), decode_attention_for(model):
        for p in prompts:
            cache, ids, out = DynamicCache(), torch.tensor([p]), []
            for _ in range(tokens):
                logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
                if not out:
                    first.append(logits[0])
                ids = logits.argmax(-1, keepdim=True)
                out.append(int(ids))
            outs.append(out)
    return outs, torch.stack(first)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16", help="rows per decode step (1: the benchmark's step; 16: an answer batch)")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--agreement-prompts", type=int, default=8)
    ap.add_argument("--agreement-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = load_model("demo", dtype="float32")
    model, tok = target.model, target.tokenizer
    turns = sharegpt_first_turns(max(16, args.agreement_prompts), min_chars=20, max_chars=400, continuations=False,
                                 tokenizer=tok, max_tokens=MAX_PROMPT_TOKENS)
    prompts = [encode_chat(tok, t.messages) for t in turns]
    print(f"{hardware.cpu_info().describe()}; fp32, threads {torch.get_num_threads()}, KV context {args.context}",
          file=sys.stderr)

    for rows in [int(r) for r in args.rows.split(",")]:
        batch = (prompts * rows)[:rows]
        print(f"\none decode step, {rows} row(s), fp32 — self CPU time by kind (torch.profiler, one step)")
        parts = profile(model, batch, args.context)
        total = sum(parts.values())
        for kind, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
            print(f"  {kind:<44} {ms:7.2f} ms  {ms / total:5.1%}")
        variants = ("plain F.linear", "MKL packed head", "MKL packed all")
        medians: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(args.rounds):
            for v in variants[r % 3:] + variants[: r % 3]:
                which = {"MKL packed head": "head", "MKL packed all": "all"}.get(v)
                with mkl_packed(model, which) if which else _nothing():
                    medians[v].append(statistics.median(step_seconds(model, batch, args.context, args.repeats)))
        base = statistics.median(medians["plain F.linear"])
        print(f"  {'variant':<20} {'step ms (median)':>17} {'speedup':>8}")
        for v in variants:
            m = statistics.median(medians[v])
            print(f"  {v:<20} {m * 1e3:17.2f} {base / m:7.2f}x")

    agree = prompts[: args.agreement_prompts]
    ref, ref_logits = greedy(model, agree, args.agreement_tokens)
    print(f"\ngreedy agreement with plain fp32 ({len(agree)} prompts x {args.agreement_tokens} tokens, one row at a time)")
    for which in ("head", "all"):
        with mkl_packed(model, which):
            outs, logits = greedy(model, agree, args.agreement_tokens)
        same = sum(a == b for a, b in zip(outs, ref))
        print(f"  MKL packed {which:<5} identical {same}/{len(agree)}, first-step logits max |diff| "
              f"{(logits - ref_logits).abs().max().item():.2e}")
    return 0


@contextmanager
def _nothing():
    yield


if __name__ == "__main__":
    sys.exit(main())
