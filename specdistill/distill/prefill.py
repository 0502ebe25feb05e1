"""Label existing text with the target in one prefill: its top-k teacher rows, the EAGLE-3 head's
features and each response's mean log-likelihood, for text the target did not just decode.

A prefill costs a fraction of decoding (demo target, bf16, 8×512 tokens with the top-32 and three
feature layers: 1.8-2.5k tokens/s against 290-350 for batched greedy decoding), so logged responses are
the cheapest training data: the target's own logged answers and other models' responses (off-policy text,
on-policy teacher). The shards are the answer pass's, so trainer and pool read both alike.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import PreTrainedModel

from specdistill.budget import Deadline
from specdistill.distill.features import FEATURE_DTYPE, FeatureCache, feature_start
from specdistill.distill.teacher import TeacherCache, pad_batch, teacher_positions
from specdistill.modeling.feature_hooks import FeatureHooks

TOKENS_PER_BATCH = 4096  # padded tokens per prefill: long enough for the GEMMs, short enough for the logits


NEAR_TIE = 1.0  # nats: a written token this close to the target's top choice is greedy text from another engine or dtype
TOP_K = 20  # the written token among the target's 20 most likely: text it could have sampled


@dataclass(frozen=True)
class Labelled:
    """What the prefill says of one response: how likely the target finds it (mean log-probability of
    its tokens, in nats), how often the target's own greedy choice is the token written (exactly, and
    within `NEAR_TIE` of it), how often it is among the target's `TOP_K`, and `sampled_z`: the written
    tokens' log-likelihood at the request's temperature against what the target's own samples at that
    temperature score, in standard deviations (Fast-DetectGPT's analytic sampling discrepancy: about
    N(0, 1) for the target's samples, far below 0 for text it would not write)."""

    mean_logprob: float
    greedy_share: float
    tokens: int
    near_greedy_share: float = 0.0
    top_k_share: float = 0.0
    sampled_z: float = 0.0


def authorship(logp: torch.Tensor, written: torch.Tensor, temperature: float | None = 1.0,
               ignore: torch.Tensor | None = None) -> dict[str, float]:
    """The statistics of `Labelled` beyond the mean log-probability, from the target's log-probabilities
    `logp` [N, V] (temperature 1) at the positions that predict the `written` tokens [N], but those that
    write an `ignore` token (the chat template's end of turn after a response cut short: not its text).
    `sampled_z` is taken at `temperature` (1 when unknown; 0: greedy requests, for which only the greedy
    shares speak)."""
    if ignore is not None and len(written):
        keep = ~torch.isin(written, ignore.to(written.device))
        logp, written = logp[keep], written[keep]
    if not len(written):
        return {"near_greedy_share": 0.0, "top_k_share": 0.0, "sampled_z": 0.0}
    chosen = logp.gather(-1, written[:, None])[:, 0]
    rank = (logp > chosen[:, None]).sum(-1)
    margin = logp.max(-1).values - chosen
    t = 1.0 if temperature is None or temperature <= 0 else float(temperature)
    lp = logp if t == 1.0 else F.log_softmax(logp / t, dim=-1)
    p = lp.exp()
    expected = (p * lp).sum(-1)
    variance = (p * lp.square()).sum(-1) - expected.square()
    z = (lp.gather(-1, written[:, None])[:, 0] - expected).sum() / variance.sum().clamp_min(1e-6).sqrt()
    return {"near_greedy_share": float((margin <= NEAR_TIE).float().mean()),
            "top_k_share": float((rank < TOP_K).float().mean()), "sampled_z": float(z)}


def length_batches(lengths: Sequence[int], tokens_per_batch: int = TOKENS_PER_BATCH) -> list[list[int]]:
    """Indices grouped by length (little padding) into batches of at most `tokens_per_batch` padded
    tokens (a longer sequence is a batch alone), in a fixed order so a resume meets the same batches."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[i] <= tokens_per_batch:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def response_rows(hidden: torch.Tensor, head: torch.Tensor, next_ids: torch.Tensor, k: int,
                  temperature: float | None = 1.0, ignore: torch.Tensor | None = None
                  ) -> tuple[dict[str, torch.Tensor], Labelled]:
    """Teacher rows (temperature 1, full vocabulary) at the hidden states `hidden` [N, H] that predict the
    response tokens `next_ids` [N], and what the target says of the response (`Labelled`, its z at the
    request's `temperature`), from one log-softmax."""
    logp = F.log_softmax((hidden @ head.T).float(), dim=-1)
    top, idx = logp.topk(min(k, logp.shape[-1]), dim=-1)
    residual = torch.logsumexp(logp.scatter(-1, idx, float("-inf")), dim=-1).exp()
    written = logp.gather(-1, next_ids[:, None])[:, 0]
    stats = Labelled(mean_logprob=float(written.mean()) if len(written) else 0.0,
                     greedy_share=float((idx[:, 0] == next_ids).float().mean()) if len(written) else 0.0,
                     tokens=int(len(written)), **authorship(logp, next_ids, temperature, ignore))
    return {"logprobs": top.cpu(), "indices": idx.to(torch.int32).cpu(), "residual": residual.cpu()}, stats


@torch.inference_mode()
def label_by_prefill(
    target: PreTrainedModel,
    examples: Sequence,
    teacher: TeacherCache | None,
    features: FeatureCache | None = None,
    *,
    shard_prefix: str = "log",
    tokens_per_batch: int = TOKENS_PER_BATCH,
    deadline: Deadline | None = None,
    progress: bool = True,
    temperatures: dict[str, float | None] | None = None,
    special_ids: Sequence[int] = (),
) -> dict[str, Labelled]:
    """One target prefill per batch of examples (`distill.examples.Example`: ids and the mask of the
    response tokens): writes their teacher rows into `teacher` and, with `features`, the head's feature
    rows at the positions that cache stores. Returns each labelled example's `Labelled` by id.

    Shards are named by the ids they hold and written atomically, so a rerun over the examples still
    unrecorded rewrites a shard a kill left without its records. With a `deadline`, no batch starts
    after it; what was labelled is kept. `temperatures`: each example's request temperature, where its
    `sampled_z` is taken (1 for an example not in it); `special_ids` (the tokenizer's control tokens) are
    left out of the authorship statistics."""
    head = target.get_output_embeddings().weight
    k = int(teacher.meta["k"]) if teacher is not None else 1
    if teacher is not None and (float(teacher.meta["temperature"]) != 1.0 or teacher.meta["vocab"] != "full"):
        raise ValueError(f"teacher cache {teacher.dir}: prefill labels at temperature 1 over the full vocabulary")
    context = features.meta["prompt_context"] if features is not None else None
    out: dict[str, Labelled] = {}
    ignore = torch.tensor(sorted(special_ids), dtype=torch.long) if special_ids else None
    batches = length_batches([len(ex.input_ids) for ex in examples], tokens_per_batch)
    bar = tqdm(total=sum(len(b) for b in batches), desc="target labels", unit="seq", disable=not progress, file=sys.stderr)
    hooks = FeatureHooks(target, features.meta["layers"]) if features is not None else None
    try:
        for batch_index in batches:
            batch = [examples[i] for i in batch_index]
            name = f"{shard_prefix}-{zlib.crc32('|'.join(str(ex.id) for ex in batch).encode()):08x}"
            if deadline is not None and deadline.expired():
                bar.write(f"target labels: time budget reached after {len(out)} responses; the labels so far are kept",
                          file=sys.stderr)
                break
            input_ids, attention = pad_batch([ex.input_ids for ex in batch])
            hidden = target.model(input_ids=input_ids.to(target.device),
                                  attention_mask=attention.to(target.device)).last_hidden_state
            layer_inputs = hooks.take() if hooks is not None else None
            teacher_entries, feature_entries = {}, {}
            for row, ex in enumerate(batch):
                ids = torch.tensor(ex.input_ids, dtype=torch.int32)
                positions = torch.tensor(teacher_positions(ex.assistant_mask), dtype=torch.long)
                rows, stats = response_rows(hidden[row, positions.to(hidden.device)], head,
                                            input_ids[row, positions + 1].to(hidden.device), k,
                                            (temperatures or {}).get(str(ex.id), 1.0), ignore)
                teacher_entries[str(ex.id)] = {"input_ids": ids, **rows}
                out[str(ex.id)] = stats
                if layer_inputs is not None:
                    start = feature_start(ex.assistant_mask, context)
                    feature_entries[str(ex.id)] = {
                        "input_ids": ids, "start": torch.tensor(start, dtype=torch.int64),
                        "features": layer_inputs[row, start : len(ex.input_ids) - 1].to("cpu", FEATURE_DTYPE)}
            if teacher is not None:
                teacher.write_shard(name, teacher_entries)
            if features is not None:
                features.write_shard(name, feature_entries)
            bar.update(len(batch))
    finally:
        if hooks is not None:
            hooks.remove()
        bar.close()
    return out
