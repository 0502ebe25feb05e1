"""Epoch time with the offline teacher cache vs the online teacher, side by side in one process.

    python benchmarks/experiments/teacher_cache_speed.py [--work DIR] [--examples 24] [--repeats 3]

Uses the target-generated answers and the recorded top-k cache that `distill_budget.py` wrote in
--work (run its prepare phase first). One "epoch" is a pass over --examples training examples
(forward, loss, backward, AdamW step) of a [0,1,2,29] draft with the 8k draft vocabulary. The two
teachers alternate, repeat by repeat; the table reports the median ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import specdistill  # noqa: F401  (offline environment)
from specdistill.distill.distill_recipe import load_config
from specdistill.distill.examples import collate, read_examples
from specdistill.distill.layer_task import DraftWithHead, batch_loss
from specdistill.distill.teacher import OnlineTeacher, TeacherCache
from specdistill.modeling.drafts import init_draft_from_target, parse_layers
from specdistill.modeling.models import load_model
from specdistill.modeling.vocab import DraftVocab

REPO = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default=str(REPO / ".specdistill" / "bench" / "distill_budget"))
    parser.add_argument("--examples", type=int, default=24)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    target = load_model("demo", dtype="float32")  # the draft is made of its weights and trained
    examples = read_examples(str(work / "train_generated.jsonl"), "generated", target.tokenizer, 384, args.examples)
    vocab = DraftVocab.load(work / "vocab8192")
    cache_rows = TeacherCache.open(work / "teacher_cache", fingerprint=target.fingerprint).load_all()
    draft = init_draft_from_target(target.model, parse_layers("0,1,2,29", 30)).train()
    draft.model.embed_tokens.weight.requires_grad_(False)
    module = DraftWithHead(draft, vocab, target.config.hidden_size)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)
    online = OnlineTeacher(target.model, vocab)
    cfg = load_config(None, ["data.path=unused", "teacher.mode=online"])

    def epoch(mode: str) -> float:
        start = time.perf_counter()
        for i in range(0, len(examples), args.batch):
            batch = collate(examples[i : i + args.batch])
            logits, hidden = module(batch.input_ids, batch.attention, batch.positions)
            if mode == "online":
                loss = batch_loss(cfg, logits, hidden, batch, teacher=online, draft_vocab=vocab, module=module)
            else:  # the cache holds full-vocabulary rows: remapped to the 8k draft vocabulary
                loss = batch_loss(cfg, logits, hidden, batch, cache_rows=cache_rows, remap=True, draft_vocab=vocab, module=module)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    epoch("cache")  # warm-up
    times = {"online": [], "cache": []}
    for _ in range(args.repeats):
        for mode in ("online", "cache"):
            times[mode].append(epoch(mode))
    ratios = [o / c for o, c in zip(times["online"], times["cache"])]
    tokens = sum(int(collate([e]).positions.sum()) for e in examples)
    print(f"epoch = {len(examples)} target answers ({tokens} answer tokens), draft [0,1,2,29], vocab 8192, batch {args.batch}")
    print(f"{'teacher':10} {'median s':>9} {'tokens/s':>9}")
    for mode in ("online", "cache"):
        med = statistics.median(times[mode])
        print(f"{mode:10} {med:9.2f} {tokens / med:9.0f}")
    print(f"speedup of the cache (median of {args.repeats} interleaved ratios): {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
