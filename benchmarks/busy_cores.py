"""How fast do the harness and llama.cpp answer the nightly's prompts beside 0, 1 and 2 busy cores, at 1 and 2 threads?

    python benchmarks/busy_cores.py [--busy 0,1,2] [--threads 1,2] [--batch 0] [--prompts 0] [--tokens 32] [--dtype auto]

The answers stage's shape (issue 60): the harness decodes one batch of the stage's batch size (`--batch 0`:
`generation.batch_size`'s default for the dtype, 64 in bf16, 32 in fp32) through the stage's decode loop with the
top-32 teacher recorded; llama.cpp (when built, `make llama-server`) answers the same prompts over 8 slots of a
llama-server on the target's Q4_1 GGUF, at each thread count with its default polling and with `--poll 0`.
Busy cores are pure-Python loops at nice 10, started and killed by the script (`common.busy_loops`). Answer
tokens/s over the timed batch, after a warm-up. On a machine other work shares, the numbers are loaded ones.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import busy_loops, log

NICE = 10


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", default="0,1,2", help="busy cores to run beside (comma-separated counts)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--batch", type=int, default=0, help="harness batch (0: the stage's default for the dtype)")
    ap.add_argument("--prompts", type=int, default=0, help="prompts per measurement (0: one batch)")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per answer")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)

    import torch  # lazy: --help without torch

    from specdistill.data.datasets import sharegpt_first_turns
    from specdistill.data.prompts import Prompt, encode_chat
    from specdistill.engines.llamacpp import build
    from specdistill.engines.llamacpp.engine import target_server
    from specdistill.hardware import describe_device
    from specdistill.modeling.attention import decode_attention_for
    from specdistill.modeling.models import dtype_name, load_model
    from specdistill.pipeline.stages.answers.decode_loop import TopKRecorder, decode_batch
    from specdistill.pipeline.stages.answers.engine_client import connect, generate_answers_openai
    from specdistill.pipeline.stages.answers.harness import ANSWER_BATCH

    target = load_model("demo", dtype=args.dtype)
    tok = target.tokenizer
    batch = args.batch or ANSWER_BATCH.get(dtype_name(target.model.dtype), 16)
    n = args.prompts or batch
    turns = sharegpt_first_turns(n, min_chars=20, max_chars=400, continuations=False, tokenizer=tok)[:n]
    ids = [encode_chat(tok, t.messages)[-384:] for t in turns]
    pad, eos = (tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id), tok.eos_token_id

    def harness(threads: int) -> float:
        torch.set_num_threads(threads)
        tokens, start = 0, time.perf_counter()
        for begin in range(0, len(ids), batch):
            rows = ids[begin:begin + batch]
            with decode_attention_for(target.model):
                out = decode_batch(target.model, rows, max_new_tokens=args.tokens, pad=pad, eos=eos,
                                   recorder=TopKRecorder(32, 1.0, len(rows), args.tokens))
            tokens += sum(r.index(eos) + 1 if eos in r else len(r) for r in out.tolist())
        return tokens / (time.perf_counter() - start)

    def llama(threads: int, poll: int | None) -> float:
        prompts = [Prompt(id=f"p{i}", messages=t.messages) for i, t in enumerate(turns)]
        with target_server("demo", parallel=8, ctx_per_slot=384 + args.tokens + 1, threads=threads, poll=poll,
                           engine=build.cached()) as server, tempfile.TemporaryDirectory() as tmp:
            served = connect(server.url, ids[0], 1)
            start = time.perf_counter()
            done = generate_answers_openai(served, tok, prompts, Path(tmp) / "a.jsonl", parallel=8, batch_size=len(prompts),
                                           max_new_tokens=args.tokens, progress=False)
            return sum(len(r["response_ids"]) for r in done.values()) / (time.perf_counter() - start)

    variants = {f"harness {t}t": (lambda t=t: harness(t)) for t in map(int, args.threads.split(","))}
    if build.cached() is not None:
        for t in map(int, args.threads.split(",")):
            variants[f"llama.cpp {t}t"] = lambda t=t: llama(t, None)
            if t > 1:
                variants[f"llama.cpp {t}t poll 0"] = lambda t=t: llama(t, 0)
    else:
        log("llama.cpp not built (`make llama-server`): the harness only")
    harness(max(map(int, args.threads.split(","))))  # warm-up
    print(f"{describe_device('cpu')}; {dtype_name(target.model.dtype)}; {len(ids)} prompts, batch {batch}, "
          f"{args.tokens} new tokens; answer tokens/s beside busy loops at nice {NICE}")
    print(f"| busy cores | {' | '.join(variants)} |\n|---:|" + "---:|" * len(variants))
    for busy in [int(b) for b in args.busy.split(",") if b]:
        with busy_loops(busy, nice=NICE):
            time.sleep(0.5)
            cells = []
            for name, run in variants.items():
                log(f"busy {busy}: {name}")
                cells.append(f"{run():.1f}")
        print(f"| {busy} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
