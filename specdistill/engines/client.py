"""A minimal client for OpenAI-compatible servers (llama.cpp, vLLM, SGLang): one chat completion,
timed, with the engine's own timings and speculative counts when it reports them (llama.cpp's
`timings.draft_n` / `draft_n_accepted`), and top-k logprobs when asked.

Plain `urllib`: nothing to install, and nothing hidden between the request and the clock.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from specdistill.env import mask_url


class EngineRequestError(RuntimeError):
    """The server answered with an error or not at all; the message names the URL and the reply."""


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: dict[str, float] = field(default_factory=dict)  # the server's top-k alternatives, token text -> logprob


@dataclass
class Completion:
    text: str
    generated_tokens: int
    seconds: float  # wall clock of the whole request, prompt processing included (as the harness times it)
    engine_tokens_per_second: float | None = None  # the engine's own decode rate (llama.cpp timings)
    draft_tokens: int | None = None  # proposed draft tokens, when the engine reports them per request
    accepted: int | None = None
    logprobs: list[TokenLogprob] | None = None


def post_json(url: str, payload: dict, timeout_s: float = 300.0) -> dict:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    return _reply_json(request, url, timeout_s)


def get_json(url: str, timeout_s: float = 30.0) -> dict:
    return _reply_json(urllib.request.Request(url), url, timeout_s)


def _reply_json(request: urllib.request.Request, url: str, timeout_s: float) -> dict:
    url = mask_url(url)  # as it is shown in errors: an endpoint may carry a token
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return json.loads(response.read().decode("utf-8"))
    except urllib.error.HTTPError as exc:
        body = exc.read().decode("utf-8", errors="replace")[:500]
        raise EngineRequestError(f"{url}: HTTP {exc.code}: {body}") from exc
    except (urllib.error.URLError, OSError) as exc:
        raise EngineRequestError(f"{url}: no answer: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise EngineRequestError(f"{url}: reply is not JSON: {exc}") from exc


def _logprobs(choice: dict) -> list[TokenLogprob] | None:
    content = (choice.get("logprobs") or {}).get("content")
    if content is None:
        return None
    return [TokenLogprob(item["token"], float(item["logprob"]),
                         {alt["token"]: float(alt["logprob"]) for alt in item.get("top_logprobs") or []})
            for item in content]


def chat(base_url: str, messages: list[dict], *, max_tokens: int, temperature: float = 0.0, seed: int = 0,
         top_logprobs: int = 0, model: str | None = None, timeout_s: float = 300.0) -> Completion:
    """One `/v1/chat/completions` request (greedy by default); `top_logprobs > 0` asks for the top-k
    alternatives of every generated token. No `model` asks the server's only model (vLLM refuses a
    name it does not serve; llama.cpp ignores it)."""
    payload = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature,
               "seed": seed, "stream": False}
    if model is not None:
        payload["model"] = model
    if temperature == 0.0:
        payload["top_k"] = 1  # llama.cpp and vLLM accept it; greedy without sampler noise
    if top_logprobs:
        payload["logprobs"] = True
        payload["top_logprobs"] = top_logprobs
    start = time.perf_counter()
    reply = post_json(base_url.rstrip("/") + "/v1/chat/completions", payload, timeout_s)
    seconds = time.perf_counter() - start
    try:
        choice = reply["choices"][0]
        text = choice["message"].get("content") or ""
    except (KeyError, IndexError, TypeError) as exc:
        raise EngineRequestError(f"{base_url}: unexpected chat completion reply: {str(reply)[:300]}") from exc
    usage = reply.get("usage") or {}
    timings = reply.get("timings") or {}
    generated = int(usage.get("completion_tokens") or timings.get("predicted_n") or 0)
    return Completion(
        text=text,
        generated_tokens=generated,
        seconds=seconds,
        engine_tokens_per_second=timings.get("predicted_per_second"),
        draft_tokens=timings.get("draft_n"),
        accepted=timings.get("draft_n_accepted"),
        logprobs=_logprobs(choice),
    )


def metrics_url(base_url: str) -> str:
    return base_url.rstrip("/") + "/metrics"
