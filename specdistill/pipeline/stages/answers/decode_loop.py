"""The batched answer loop: the target answers a batch of prompts, greedy or sampled, recording its
top-k log-probs (the offline teacher) and, for EAGLE-3 heads, its feature layers' inputs on the way:
the answer pass is the only target pass the training data needs.

An own decode loop rather than `generate`: the KV cache is preallocated and written in place, a row
that reaches EOS leaves the batch with its cache rows, and prompts are prefilled in groups of similar
length. `generate_batch` (transformers' `generate`) is kept as the reference the loop is tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList, PreTrainedModel

from specdistill.distill.losses import topk_rows
from specdistill.modeling.feature_hooks import FeatureHooks
from specdistill.modeling.kv_cache import preallocated_cache, select_rows, write_rows
from specdistill.modeling.lean import lean_forward, supports_lean


class TopKRecorder:
    """Keeps the target's top-k log-probs at every generated step: the offline teacher for free,
    since these are exactly the target's distributions at the answer positions."""

    def __init__(self, k: int, temperature: float, rows: int, steps: int):
        self.k, self.temperature = k, temperature
        self.logprobs = torch.zeros((rows, steps, k))
        self.indices = torch.zeros((rows, steps, k), dtype=torch.int32)
        self.residual = torch.zeros((rows, steps))

    def record(self, step: int, rows: torch.Tensor, logits: torch.Tensor) -> None:
        """`logits[i]` is the distribution of batch row `rows[i]` at answer token `step`."""
        top, idx, res = topk_rows(logits, self.k, self.temperature)  # on the target's device, kept on the CPU
        rows = rows.cpu()
        self.logprobs[rows, step], self.indices[rows, step], self.residual[rows, step] = top.cpu(), idx.cpu(), res.cpu()

    def rows(self, row: int, n: int) -> dict[str, torch.Tensor]:
        return {"logprobs": self.logprobs[row, :n], "indices": self.indices[row, :n], "residual": self.residual[row, :n]}


class FeatureRecorder:
    """Keeps the inputs of the target's feature `layers` (EAGLE-3) for every row: the last
    `prompt_context + 1` prompt positions from the prefill (None: the whole prompt) and every answer
    token fed back in a decode step, which together are the positions a feature cache stores."""

    def __init__(self, layers: Sequence[int], prompt_context: int | None, rows: int, steps: int):
        self.layers, self.prompt_context = list(layers), prompt_context
        self.prompt: list[torch.Tensor | None] = [None] * rows
        self.answer: torch.Tensor | None = None  # [rows, steps, F], allocated at the first step
        self.steps = steps

    def record_prompt(self, row: int, features: torch.Tensor) -> None:
        keep = features.shape[0] if self.prompt_context is None else min(features.shape[0], self.prompt_context + 1)
        self.prompt[row] = features[features.shape[0] - keep:].cpu().clone()

    def record(self, step: int, rows: torch.Tensor, features: torch.Tensor) -> None:
        """`features[i]` `[F]` is batch row `rows[i]`'s at answer token `step`."""
        if self.answer is None:
            self.answer = torch.zeros((len(self.prompt), self.steps, features.shape[-1]), dtype=features.dtype)
        self.answer[rows.cpu(), step] = features.cpu()

    def rows(self, row: int, answer_length: int) -> torch.Tensor:
        """Row `row`'s features at its stored prompt positions and answer tokens 0..n-2 (the last token
        is never an input of the head)."""
        answer = self.answer[row, : answer_length - 1] if self.answer is not None else self.prompt[row][:0]
        return torch.cat([self.prompt[row], answer])


def left_pad(prompts: Sequence[Sequence[int]], pad: int, room: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids `[rows, width]` left-padded so every answer starts at the same column, and the attention
    mask with `room` more (zero) columns for the answer tokens."""
    width = max(len(ids) for ids in prompts)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention = torch.zeros((len(prompts), width + room), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
        attention[row, width - len(ids): width] = 1
    return input_ids, attention


def prefill_groups(lengths: Sequence[int], waste: float = 0.15) -> list[list[int]]:
    """Row indices in groups of similar prompt length, so left padding adds at most `waste` to a group's prefill.

    One padded prefill of a whole batch spends most of its time on padding when one prompt is much
    longer than the rest (ShareGPT: a batch of 47- to 145-token prompts is half padding), and a
    prefill costs tens of decode steps; one prefill per row wastes the matmuls' efficiency instead.
    """
    groups: list[list[int]] = []
    group: list[int] = []
    tokens = 0
    for row in sorted(range(len(lengths)), key=lambda r: lengths[r]):
        if group and lengths[row] * (len(group) + 1) > (1 + waste) * (tokens + lengths[row]):
            groups.append(group)
            group, tokens = [], 0
        group.append(row)
        tokens += lengths[row]
    return [*groups, group] if group else groups


def _positions(attention: torch.Tensor) -> torch.Tensor:
    """Position ids counted from each row's first real token (left padding at 0), as `generate` sets them."""
    return (attention.cumsum(-1) - 1).clamp(min=0)


@torch.inference_mode()
def decode_batch(target: PreTrainedModel, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, pad: int, eos: int,
                 temperature: float = 0.0, recorder: TopKRecorder | None = None,
                 features: FeatureRecorder | None = None) -> torch.Tensor:
    """Answers to a batch of prompts, `[rows, max_new_tokens]`, each row padded with `pad` after its EOS.

    Rows never see each other, so greedy answers are `generate`'s (argmax over fp32 logits, ties to the
    lowest id) up to float rounding of the differently grouped matmuls. Sampling draws as `generate` does
    (softmax of logits / temperature, one multinomial over the rows still going).
    """
    rows, width = len(prompts), max(len(ids) for ids in prompts)
    device = target.device  # the whole loop runs there; recorders keep what they record on the CPU
    attention = left_pad(prompts, pad, max_new_tokens)[1].to(device)
    cache = preallocated_cache(target, rows, width + max_new_tokens)
    capture = features.layers if features is not None else []
    lean = supports_lean(target)  # decode steps through `modeling.lean` (prefill keeps transformers' forward)
    with FeatureHooks(target, capture) as hooks:  # the prefill's (and a non-lean step's) features
        logits = _prefill(target, prompts, pad, cache, hooks, features)
        positions = _positions(attention[:, :width])[:, -1:]
        answers = torch.full((rows, max_new_tokens), pad, dtype=torch.long, device=device)
        going = torch.arange(rows, device=device)  # the batch rows still generating, in cache order
        length = width
        for step in range(max_new_tokens):
            logits = logits.float()
            if recorder is not None:
                recorder.record(step, going, logits)
            if temperature > 0:
                new = torch.multinomial(torch.softmax(logits / temperature, dim=-1), num_samples=1).squeeze(1)
            else:
                new = logits.argmax(dim=-1)
            answers[going, step] = new
            unfinished = new != eos
            if step + 1 == max_new_tokens or not bool(unfinished.any()):
                break
            attention[:, length] = 1
            length += 1
            positions = positions + 1
            if not bool(unfinished.all()):
                kept = unfinished.nonzero().squeeze(1)
                going, new, attention, positions = going[kept], new[kept], attention[kept], positions[kept]
                select_rows(cache, kept)
            if lean:
                out, seen = lean_forward(target, new[:, None], cache, positions=positions,
                                         mask=attention[:, None, None, :length].bool(), capture=capture)
                logits = out[:, -1]
            else:
                logits = target(input_ids=new[:, None], attention_mask=attention[:, :length], position_ids=positions,
                                cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
                seen = hooks.take() if capture else None
            if features is not None:
                features.record(step, going, seen[:, 0])
    return answers.cpu()


def _prefill(target: PreTrainedModel, prompts: Sequence[Sequence[int]], pad: int, cache, hooks: FeatureHooks,
             features: FeatureRecorder | None) -> torch.Tensor:
    """Every row's next-token logits after its prompt, the prompts written into `cache` right-aligned."""
    width = max(len(ids) for ids in prompts)
    logits = None
    for group in prefill_groups([len(ids) for ids in prompts]):
        input_ids, group_attention = (t.to(target.device) for t in left_pad([prompts[r] for r in group], pad))
        prefill = DynamicCache(config=target.config)
        last = target(input_ids=input_ids, attention_mask=group_attention, position_ids=_positions(group_attention),
                      cache=prefill, use_cache=True, logits_to_keep=1).logits[:, -1]
        logits = last.new_empty((len(prompts), last.shape[-1])) if logits is None else logits
        logits[group] = last
        write_rows(cache, torch.tensor(group, device=target.device), width, prefill)
        if features is not None:
            seen = hooks.take()
            for i, row in enumerate(group):
                features.record_prompt(row, seen[i, input_ids.shape[1] - len(prompts[row]):])
    return logits


class _RecordScores(LogitsProcessor):

    def __init__(self, recorder: TopKRecorder):
        self.recorder, self.step = recorder, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.recorder.record(self.step, torch.arange(scores.shape[0]), scores)
        self.step += 1
        return scores


@torch.inference_mode()
def generate_batch(target: PreTrainedModel, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, pad: int, eos: int,
                   temperature: float = 0.0, recorder: TopKRecorder | None = None) -> torch.Tensor:
    """`decode_batch` through transformers' `model.generate`: the reference it is tested and benchmarked against."""
    input_ids, attention = left_pad(prompts, pad)
    kwargs = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    if recorder is not None:
        kwargs["logits_processor"] = LogitsProcessorList([_RecordScores(recorder)])
    generated = target.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                                pad_token_id=pad, eos_token_id=eos, **kwargs)[:, input_ids.shape[1]:]
    return torch.nn.functional.pad(generated, (0, max_new_tokens - generated.shape[1]), value=pad)
