"""Target answers from a serving engine: the logged prompts answered through an OpenAI-compatible server
(llama.cpp here, vLLM or SGLang in production), its top-k logprobs recorded as the teacher.

The teacher cache is keyed by token positions, so answers must come back as the target tokenizer's ids,
never as text to re-tokenise: we apply the chat template ourselves (`encode_chat`, as the harness does)
and send the prompt as token ids to `/v1/completions`; the answer's ids come with its logprobs (llama.cpp
puts an `id` in every `logprobs.content` item; vLLM names tokens `token_id:N` when asked with
`return_tokens_as_token_ids`).

It lives in `pipeline`, not `engines`: it joins the engine's HTTP client (`engines.client`) with the
distillation's teacher cache (`distill`), two sibling layers neither of which imports the other.
"""

from __future__ import annotations

import os
import sys
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specdistill import paths
from specdistill.budget import Deadline
from specdistill.data.prompts import Prompt, encode_chat
from specdistill.distill.teacher import TeacherCache
from specdistill.engines.client import EngineRequestError, get_json, post_json, server_root
from specdistill.env import mask_url
from specdistill.pipeline.stages.answers.answer_file import answer_record, append_records, resume

TOKEN_ID_PREFIX = "token_id:"  # vLLM's token names under return_tokens_as_token_ids


@dataclass
class EngineAnswer:
    """One greedy answer as the engine gave it: token ids and, at each, its top-k (ids, logprobs)."""

    token_ids: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    finish: str  # "eos" or "length", as the harness records it


@dataclass(frozen=True)
class ServedTarget:
    """What answers: the server, the model name it wants in requests, and the top-k it gives."""

    url: str
    model: str
    top_k: int


base_url = server_root  # a server's base URL, accepting the OpenAI SDK's `.../v1` form too


def _token_id(item: dict, url: str) -> int:
    if "id" in item:
        return int(item["id"])
    token = str(item.get("token", ""))
    if token.startswith(TOKEN_ID_PREFIX):
        return int(token[len(TOKEN_ID_PREFIX):])
    raise EngineRequestError(f"{mask_url(url)}: logprobs name tokens by text ({token!r}), not by id: re-tokenising text "
                             "would misplace the teacher rows (vLLM gives ids with return_tokens_as_token_ids)")


def parse_completion(reply: dict, url: str = "server") -> EngineAnswer:
    """A `/v1/completions` reply with logprobs: llama.cpp's `logprobs.content` items or the OpenAI
    legacy `tokens` / `top_logprobs` lists (vLLM), into ids and top-k rows sorted by logprob."""
    try:
        choice = reply["choices"][0]
    except (KeyError, IndexError, TypeError) as exc:
        raise EngineRequestError(f"{mask_url(url)}: unexpected completion reply: {str(reply)[:300]}") from exc
    logprobs = choice.get("logprobs") or {}
    rows: list[list[tuple[int, float]]] = []
    ids: list[int] = []
    if logprobs.get("content") is not None:
        for item in logprobs["content"]:
            ids.append(_token_id(item, url))
            rows.append([(_token_id(alt, url), float(alt["logprob"])) for alt in item.get("top_logprobs") or []])
    elif logprobs.get("tokens") is not None:
        for token, top in zip(logprobs["tokens"], logprobs.get("top_logprobs") or [{}] * len(logprobs["tokens"])):
            ids.append(_token_id({"token": token}, url))
            rows.append([(_token_id({"token": t}, url), float(lp)) for t, lp in (top or {}).items()])
    else:
        raise EngineRequestError(f"{mask_url(url)}: the server returned no logprobs: it cannot give token ids and a teacher "
                                 "(it needs /v1/completions with `logprobs`)")
    rows = [sorted(r, key=lambda x: -x[1]) for r in rows]
    finish = "eos" if choice.get("finish_reason") == "stop" else "length"
    return EngineAnswer(ids, [[i for i, _ in r] for r in rows], [[lp for _, lp in r] for r in rows], finish)


def teacher_entry(prompt_ids: list[int], answer: EngineAnswer, k: int) -> dict[str, torch.Tensor]:
    """A teacher-cache entry from an engine's answer: row t is the top-k at answer token t (its
    distribution given the prompt and the answer before it), the residual is 1 - Σ top-k
    probabilities (the engine gives nothing beyond its top-k), clamped at 0."""
    short = [t for t, r in enumerate(answer.top_ids) if len(r) < k]
    if short:
        raise EngineRequestError(f"the server gave {len(answer.top_ids[short[0]])} top logprobs at answer token "
                                 f"{short[0]}, the teacher cache holds {k}")
    logprobs = torch.tensor([r[:k] for r in answer.top_logprobs], dtype=torch.float64).reshape(-1, k)
    indices = torch.tensor([r[:k] for r in answer.top_ids], dtype=torch.int32).reshape(-1, k)
    residual = (1.0 - logprobs.exp().sum(-1)).clamp_min(0.0)
    return {"input_ids": torch.tensor(prompt_ids + answer.token_ids, dtype=torch.int32),
            "logprobs": logprobs.float(), "indices": indices, "residual": residual.float()}


def complete_ids(url: str, prompt_ids: list[int], *, model: str, max_tokens: int, top_logprobs: int,
                 timeout_s: float = 600.0) -> EngineAnswer:
    """One greedy completion of a token-id prompt, with the top `top_logprobs` at every answer token."""
    payload = {"model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0.0, "top_k": 1,
               "seed": 0, "stream": False, "logprobs": max(top_logprobs, 1), "return_tokens_as_token_ids": True}
    endpoint = base_url(url) + "/v1/completions"
    answer = parse_completion(post_json(endpoint, payload, timeout_s), endpoint)
    if len(answer.token_ids) > max_tokens:  # llama.cpp may finish a multi-byte character past the limit
        answer = EngineAnswer(answer.token_ids[:max_tokens], answer.top_ids[:max_tokens],
                              answer.top_logprobs[:max_tokens], "length")
    return answer


def connect(url: str, probe_ids: list[int], top_k: int, timeout_s: float = 60.0) -> ServedTarget:
    """Check the server before any work: it answers, it is OpenAI-compatible, it returns token ids and
    logprobs; and learn the model name it expects and how many top logprobs it gives (≤ `top_k`)."""
    base = base_url(url)
    try:
        models = get_json(base + "/v1/models", timeout_s).get("data") or []
    except EngineRequestError as exc:
        raise EngineRequestError(f"no OpenAI-compatible server at {mask_url(base)} (is it running, is the URL its base "
                                 f"URL?): {exc}") from exc
    if not models:
        raise EngineRequestError(f"{mask_url(base)}/v1/models lists no model to ask")
    model = str(models[0]["id"])
    try:
        probe = complete_ids(base, probe_ids, model=model, max_tokens=1, top_logprobs=top_k, timeout_s=timeout_s)
    except EngineRequestError as exc:
        if "logprobs" not in str(exc).lower():
            raise
        raise EngineRequestError(f"{exc}: lower generation.teacher_top_k to what the server allows (vLLM: "
                                 "--max-logprobs, 20 by default)") from exc
    given = min((len(r) for r in probe.top_ids), default=0)
    if not probe.token_ids or given == 0:
        raise EngineRequestError(f"{base}: the server returned no logprobs for a completion: no token ids and no "
                                 "teacher to record")
    return ServedTarget(base, model, min(top_k, given))


def generate_answers_openai(
    served: ServedTarget,
    tokenizer,
    prompts: Iterable[Prompt],
    out_path: str | os.PathLike,
    *,
    parallel: int = 8,
    batch_size: int = 16,
    max_new_tokens: int = 128,
    teacher_cache: TeacherCache | None = None,
    progress: bool = True,
    timeout_s: float = 600.0,
    deadline: Deadline | None = None,
    after_answer: Callable[[int], bool] | None = None,
) -> dict[str, dict]:
    """`harness.generate_answers` through a serving engine: the same JSONL records and teacher rows
    (greedy; k from the cache's metadata, which `served.top_k` must cover), returns all records.
    With a `deadline`, no request is sent after it; the requests in flight finish and are kept. `after_answer`
    gets each finished answer's tokens (a rate watch); once it returns True no request is sent either."""
    k = int(teacher_cache.meta["k"]) if teacher_cache is not None else 1
    if k > served.top_k:
        raise ValueError(f"the teacher cache holds top-{k}, {mask_url(served.url)} gives top-{served.top_k}")
    out_path = Path(out_path)
    done, todo = resume(out_path, prompts, [teacher_cache])

    def answer(p: Prompt) -> tuple[Prompt, list[int], EngineAnswer]:
        ids = encode_chat(tokenizer, p.messages)
        try:
            return p, ids, complete_ids(served.url, ids, model=served.model, max_tokens=max_new_tokens,
                                        top_logprobs=k, timeout_s=timeout_s)
        except EngineRequestError as exc:
            raise EngineRequestError(f"prompt {p.id!r}: {exc}") from exc

    bar = tqdm(total=len(todo), desc="target answers (engine)", unit="prompt", disable=not progress, file=sys.stderr)
    new_tokens = 0

    def flush(finished: list[tuple[Prompt, list[int], EngineAnswer]], out) -> None:
        """Teacher shard first, then the JSONL lines: a line on disk always has its teacher rows."""
        nonlocal new_tokens
        if not finished:
            return
        if teacher_cache is not None:
            name = f"engine-{zlib.crc32('|'.join(p.id for p, _, _ in finished).encode()):08x}"
            teacher_cache.write_shard(name, {p.id: teacher_entry(ids, a, k) for p, ids, a in finished})
        new_tokens += append_records(out, [answer_record(p, ids, a.token_ids, tokenizer, a.finish, 0.0)
                                           for p, ids, a in finished], done)
        bar.update(len(finished))
        bar.set_postfix(tokens=new_tokens)
        finished.clear()

    finished: list[tuple[Prompt, list[int], EngineAnswer]] = []
    waiting = iter(todo)
    stopped = False
    with paths.open_private(out_path, "a", encoding="utf-8") as out, ThreadPoolExecutor(max_workers=parallel) as pool:
        running: set[Future] = set()
        try:
            while True:  # at most `parallel` requests in flight, none sent after the deadline
                while len(running) < parallel and not stopped and not (deadline is not None and deadline.expired()):
                    p = next(waiting, None)
                    if p is None:
                        break
                    running.add(pool.submit(answer, p))
                if not running:
                    break
                done_now, running = wait(running, return_when=FIRST_COMPLETED)
                for future in done_now:
                    finished.append(future.result())
                    if after_answer is not None and after_answer(len(finished[-1][2].token_ids)):
                        stopped = True
                if len(finished) >= batch_size:
                    flush(finished, out)
        finally:  # after a failed request or an interrupt too: keep what finished, ask nothing more
            for future in running:
                future.cancel()
            flush(finished, out)
    bar.close()
    return done
