"""A minimal client for OpenAI-compatible servers (llama.cpp, vLLM, SGLang): one chat completion,
timed, with the engine's own timings and speculative counts when it reports them (llama.cpp's
`timings.draft_n` / `draft_n_accepted`), and top-k logprobs when asked; and the engine's Prometheus
`/metrics` page: its speculative-decoding counters. vLLM (`vllm:spec_decode_*`) and llama.cpp
(`llamacpp:spec_decode_*`) name them alike; acceptance between two scrapes is Δaccepted / Δdraft
tokens, a ratio of sums over every label set.

Plain `urllib`: nothing to install, and nothing hidden between the request and the clock.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from specdistill.acceptance import DraftCounts
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


DEFAULT_TIMEOUT_S = 120.0  # seconds a request may go without an answer (a non-streamed reply comes whole at the end)


def server_root(base_url: str) -> str:
    """The server's root (where `/metrics` and `/health` are), from a base URL given either way: the
    OpenAI clients' `http://h:p/v1` or the bare `http://h:p`."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def api_url(base_url: str, path: str) -> str:
    """`path` (`chat/completions`, `completions`, `models`) under an OpenAI-compatible server's base URL, as
    OpenAI's clients append it: to `http://h:p/v1` as given, and `/v1` added to a bare `http://h:p`."""
    return f"{server_root(base_url)}/v1/{path.lstrip('/')}"


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
        if isinstance(exc, TimeoutError) or isinstance(getattr(exc, "reason", None), TimeoutError):
            raise EngineRequestError(f"{url}: no answer within {timeout_s:g} s: the server took the request and sent "
                                     "nothing back (overloaded or stuck?)") from None
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


def chat(base_url: str, messages: list[dict], *, max_tokens: int, seed: int = 0, top_logprobs: int = 0,
         timeout_s: float = DEFAULT_TIMEOUT_S) -> Completion:
    """One greedy `/v1/chat/completions` request; `top_logprobs > 0` asks for the top-k alternatives of
    every generated token. No `model` is named: the server's only model answers (vLLM refuses a name it
    does not serve; llama.cpp ignores it)."""
    payload = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
               "seed": seed, "stream": False, "top_k": 1}  # top_k: llama.cpp and vLLM accept it; no sampler noise
    if top_logprobs:
        payload["logprobs"] = True
        payload["top_logprobs"] = top_logprobs
    start = time.perf_counter()
    reply = post_json(api_url(base_url, "chat/completions"), payload, timeout_s)
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
    return server_root(base_url) + "/metrics"


ENGINE_PREFIXES = ("vllm:", "llamacpp:")
COUNTERS = {  # the engine's counter: our count's name (its drafts are drafting rounds)
    "spec_decode_num_drafts_total": "rounds",
    "spec_decode_num_draft_tokens_total": "proposed",
    "spec_decode_num_accepted_tokens_total": "accepted",
}


@dataclass
class Scrape:
    """An engine's spec-decode counters on one /metrics page (or the change between two), as draft counts:
    accepted per position (0-based) where the engine exports them."""

    counts: DraftCounts
    prefix: str = ""  # the engine whose names were found ("vllm:", "llamacpp:", ...)


PER_POSITION = "spec_decode_num_accepted_tokens_per_pos_total"


def _samples(text: str) -> tuple[dict[str, float], dict[str, dict[int, float]]]:
    """Totals per sample name (summed over label sets), and per-position counters by position."""
    totals: dict[str, float] = {}
    positions: dict[str, dict[int, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
                if sample.name.endswith(PER_POSITION) and "position" in sample.labels:
                    by_pos = positions.setdefault(sample.name, {})
                    pos = int(sample.labels["position"])
                    by_pos[pos] = by_pos.get(pos, 0.0) + float(sample.value)
    except Exception as exc:  # the parser raises ValueError and others on malformed pages
        raise ValueError(f"malformed metrics page: {exc}") from exc
    return totals, positions


def parse_spec_decode_counters(text: str, prefix: str | None = None) -> Scrape:
    """Sum the spec-decode counters over every label set (engines, models) of one /metrics page.
    `prefix=None` finds the engine by its names (vLLM's or llama.cpp's)."""
    totals, positions = _samples(text)
    candidates = [prefix] if prefix is not None else list(ENGINE_PREFIXES)
    for p in candidates:
        if all(p + name in totals for name in COUNTERS):
            by_pos = positions.get(p + PER_POSITION, {})
            per_position = [by_pos.get(i, 0.0) for i in range(max(by_pos) + 1)] if by_pos else []
            return Scrape(DraftCounts(**{key: totals[p + name] for name, key in COUNTERS.items()},
                                      accepted_per_position=per_position), prefix=p)
    wanted = candidates[0] if len(candidates) == 1 else "{" + ",".join(candidates) + "}"
    missing = [wanted + name for name in COUNTERS if not any(p + name in totals for p in candidates)]
    raise KeyError(f"metrics page lacks {', '.join(missing or [wanted + 'spec_decode_* (incomplete set)'])}")


def delta(before: Scrape, after: Scrape) -> Scrape:
    """The counters' change between two scrapes (per position over the later page's positions)."""
    b, a = before.counts, after.counts
    pos = [n - (b.accepted_per_position[i] if i < len(b.accepted_per_position) else 0.0)
           for i, n in enumerate(a.accepted_per_position)]
    return Scrape(DraftCounts(a.rounds - b.rounds, a.proposed - b.proposed, a.accepted - b.accepted, pos), prefix=after.prefix)


def scrape(url: str, timeout_s: float = 5.0) -> Scrape:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            text = response.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError) as exc:  # HTTPError too: the page is not there
        raise EngineRequestError(f"{mask_url(url)}: no metrics page: {getattr(exc, 'reason', exc)}") from None
    return parse_spec_decode_counters(text)
