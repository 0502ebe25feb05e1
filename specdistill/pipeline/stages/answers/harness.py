"""The target answers prompts in this process (sequence-level distillation's data).

A draft learns the target's own output distribution far faster from the target's answers than from
the human-written ones in the logs (DistillSpec). Generation is batched with left padding, greedy
or sampled, through an own decode loop (`decode_loop.decode_batch`: no cache re-concatenation, no steps for
finished answers, prefills grouped by length), and append-only (`answer_file`).
"""

from __future__ import annotations

import os
import sys
import time
import zlib
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdistill import paths
from specdistill.budget import Deadline
from specdistill.data.prompts import Prompt, encode_chat
from specdistill.distill.features import FEATURE_DTYPE, FeatureCache, feature_start
from specdistill.distill.teacher import TeacherCache
from specdistill.modeling.attention import decode_attention_for
from specdistill.modeling.models import LoadedModel, dtype_name
from specdistill.pipeline.nightly_recipe import NightlyConfig
from specdistill.pipeline.stages.answers.answer_file import answer_record, append_records, resume
from specdistill.pipeline.stages.answers.decode_loop import FeatureRecorder, TopKRecorder, decode_batch
from specdistill.speculative.threads import ThreadWatch, chosen_threads

SORT_CHUNK = 8  # batches sorted by length together: little padding, and a time cut keeps a sample of the prompts
# generation.batch_size null: by the run's dtype, as measured on each CPU kind (benchmarks/README.md, "The answer stage's batch")
ANSWER_BATCH = {"bfloat16": 64, "float32": 32}
THREAD_PROBE_PROMPT, THREAD_PROBE_TOKENS = 32, 4  # the thread probe's batch: the stage's rows, short prompts, a few steps


def answer_batch(config: NightlyConfig, target: LoadedModel) -> int:
    return config.generation.batch_size or ANSWER_BATCH.get(dtype_name(target.model.dtype), 16)


def answer_threads(config: NightlyConfig, target: LoadedModel, prompts: list[Prompt],
                   batch: int) -> AbstractContextManager[ThreadWatch | None]:
    """torch's threads while the harness answers (`generation.threads`): with `auto`, the count that decodes a
    batch of the stage's `batch` rows fastest under the load found (`speculative.threads`), probed again when
    other work comes or goes; the stage calls the watch's `check` between batches. A 2-thread decode beside one
    busy core lost 6-9x on the AVX2 EPYC; one thread did not."""
    rows = [encode_chat(target.tokenizer, p.messages)[-THREAD_PROBE_PROMPT:] for p in prompts[:batch]]
    tok = target.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def run() -> int:
        with decode_attention_for(target.model):
            decode_batch(target.model, rows, max_new_tokens=THREAD_PROBE_TOKENS, pad=pad, eos=-1)
        return len(rows) * THREAD_PROBE_TOKENS

    return chosen_threads(config.generation.threads, target.model, rows[0] if rows else None, run=run)


@torch.inference_mode()
def generate_answers(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Iterable[Prompt],
    out_path: str | os.PathLike,
    *,
    batch_size: int = 16,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    seed: int = 0,
    progress: bool = True,
    teacher_cache: TeacherCache | None = None,
    feature_cache: FeatureCache | None = None,
    decode_attention: bool = True,
    deadline: Deadline | None = None,
    after_batch: Callable[[int], bool] | None = None,
) -> dict[str, dict]:
    """Answer every prompt with the target, appending one JSONL record per answer; returns all records.

    With a `deadline`, no batch starts that the previous batch's time says would end past it: the
    answers written so far are kept (a later run with more time resumes from them). With sampling, each
    batch is seeded from `seed` and its first id, so a resumed run samples what an uninterrupted one would
    have. `teacher_cache` and `feature_cache` get the target's top-k log-probs at every answer token and the
    EAGLE-3 feature layers' inputs (at the cache's `layers` and `prompt_context`), so no second target pass
    is needed. `decode_attention`: decode steps use `modeling.attention.decode_attention` instead of SDPA's
    CPU flash kernel (faster for a batch; the same answers up to numerical near-ties). `after_batch` gets each
    written batch's answer tokens (a thread watch, a rate watch) and stops the answers when it returns True.
    """
    if teacher_cache is not None and temperature > 0:
        raise ValueError("record the teacher during greedy generation only; for sampled answers use features.build_cache")
    context = feature_cache.meta["prompt_context"] if feature_cache is not None else None
    out_path = Path(out_path)
    done, todo = resume(out_path, prompts, [teacher_cache, feature_cache])
    encoded = [(p, encode_chat(tokenizer, p.messages)) for p in todo]
    chunk = SORT_CHUNK * batch_size
    encoded = [x for begin in range(0, len(encoded), chunk) for x in sorted(encoded[begin:begin + chunk], key=lambda x: len(x[1]))]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    bar = tqdm(total=len(encoded), desc="target answers", unit="prompt", disable=not progress, file=sys.stderr)
    new_tokens, last = 0, 0.0  # `last`: the previous batch's seconds, what the next one is expected to take
    with paths.open_private(out_path, "a", encoding="utf-8") as out:  # answers to production traffic: the owner only
        for start in range(0, len(encoded), batch_size):
            if deadline is not None and (deadline.expired() or deadline.remaining() < last):
                bar.write(f"target answers: time budget reached after {len(done)} of {len(done) + len(encoded) - start} "
                          f"prompts; the answers so far are kept", file=sys.stderr)
                break
            batch, began = encoded[start : start + batch_size], time.monotonic()
            if temperature > 0:
                torch.manual_seed(seed + zlib.crc32(batch[0][0].id.encode()))
            recorder = None if teacher_cache is None else TopKRecorder(
                int(teacher_cache.meta["k"]), float(teacher_cache.meta["temperature"]), len(batch), max_new_tokens)
            features = None if feature_cache is None else FeatureRecorder(
                feature_cache.meta["layers"], context, len(batch), max_new_tokens)
            with decode_attention_for(target) if decode_attention else nullcontext():
                generated = decode_batch(target, [ids for _, ids in batch], max_new_tokens=max_new_tokens, pad=pad,
                                         eos=eos, temperature=temperature, recorder=recorder, features=features)
            answers = [a[: a.index(eos) + 1] if eos in a else a for a in generated.tolist()]
            rows = [(row, p.id, torch.tensor(ids + a, dtype=torch.int32), ids, a) for row, ((p, ids), a) in enumerate(zip(batch, answers))]
            name = f"gen-{zlib.crc32('|'.join(p.id for p, _ in batch).encode()):08x}"
            if recorder is not None:
                teacher_cache.write_shard(name, {pid: {"input_ids": seq, **recorder.rows(row, len(a))} for row, pid, seq, _, a in rows})
            if features is not None:
                feature_cache.write_shard(name, {pid: {
                    "input_ids": seq, "start": torch.tensor(feature_start([False] * len(ids) + [True] * len(a), context),
                                                             dtype=torch.int64),
                    "features": features.rows(row, len(a)).to(FEATURE_DTYPE)} for row, pid, seq, ids, a in rows})
            written = append_records(out, [answer_record(p, ids, a, tokenizer, "eos" if eos in a else "length", temperature)
                                           for (p, ids), a in zip(batch, answers)], done)
            new_tokens += written
            bar.update(len(batch))
            bar.set_postfix(tokens=new_tokens)
            last = time.monotonic() - began
            if after_batch is not None and after_batch(written):
                break
    bar.close()
    return done
