"""Target answers from a serving engine (`generation.backend: openai`): a reply's logprobs become token
ids and teacher-cache rows (unit, on replies recorded from llama-server and in vLLM's shape), clear
errors for a server that is not there or gives no logprobs; and for real (e2e: the built llama-server on
loopback with the demo target's GGUF): answers and teacher rows, resume after a failure, and the nightly's
answer stage feeding the distillation trainer. Generations are a few tokens."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from specdistill.engines.client import EngineRequestError
from specdistill.engines.llamacpp.server import free_port
from specdistill.pipeline.nightly_recipe import load_nightly_config
from specdistill.pipeline.stages.answers.engine_client import base_url, connect, parse_completion, teacher_entry
from specdistill.recipe import ConfigError

# llama-server 11434's /v1/completions reply (logprobs=3) for "Name three colors." (4 tokens), bytes dropped
LLAMACPP_REPLY = {"choices": [{"text": "1. Red\n", "index": 0, "finish_reason": "length", "logprobs": {"content": [
    {"id": 33, "token": "1", "logprob": -2.031554698944092, "top_logprobs": [
        {"id": 33, "token": "1", "logprob": -2.031554698944092}, {"id": 504, "token": "The", "logprob": -2.194699764251709},
        {"id": 2122, "token": "There", "logprob": -2.467772960662842}]},
    {"id": 30, "token": ".", "logprob": -0.0497615747153759, "top_logprobs": [
        {"id": 30, "token": ".", "logprob": -0.0497615747153759}, {"id": 25, "token": ")", "logprob": -4.007718086242676},
        {"id": 198, "token": "\n", "logprob": -5.965810775756836}]},
    {"id": 3950, "token": " Red", "logprob": -1.284706473350525, "top_logprobs": [
        {"id": 3950, "token": " Red", "logprob": -1.284706473350525},
        {"id": 10062, "token": " Blue", "logprob": -1.84629487991333},
        {"id": 4290, "token": " Black", "logprob": -1.928865909576416}]},
    {"id": 198, "token": "\n", "logprob": -1.0733839273452759, "top_logprobs": [
        {"id": 198, "token": "\n", "logprob": -1.0733839273452759}, {"id": 42, "token": ":", "logprob": -1.5867811441421509},
        {"id": 731, "token": " -", "logprob": -2.171297550201416}]}]}}]}
# the same two first tokens in the OpenAI legacy completions shape vLLM returns (return_tokens_as_token_ids),
# its top-logprob dicts unordered, ending on the end-of-turn token
VLLM_REPLY = {"choices": [{"text": "1.", "index": 0, "finish_reason": "stop", "logprobs": {
    "tokens": ["token_id:33", "token_id:2"], "token_logprobs": [-2.0315547, -0.1665758],
    "top_logprobs": [{"token_id:504": -2.1946998, "token_id:33": -2.0315547, "token_id:2122": -2.4677730},
                     {"token_id:198": -2.0591655, "token_id:2": -0.1665758, "token_id:3717": -4.5900035}]}}]}
PROMPT_IDS = [1, 9690, 198, 2683, 359]


def test_llamacpp_reply_becomes_ids_and_teacher_rows():
    answer = parse_completion(LLAMACPP_REPLY)
    assert answer.token_ids == [33, 30, 3950, 198] and answer.finish == "length"
    entry = teacher_entry(PROMPT_IDS, answer, 3)
    assert entry["input_ids"].tolist() == PROMPT_IDS + [33, 30, 3950, 198] and entry["input_ids"].dtype == torch.int32
    assert entry["indices"].tolist()[0] == [33, 504, 2122] and entry["indices"].dtype == torch.int32
    assert entry["logprobs"].shape == (4, 3) and entry["logprobs"].dtype == torch.float32
    assert entry["logprobs"][1, 1].item() == pytest.approx(-4.007718086242676)
    first = [-2.031554698944092, -2.194699764251709, -2.467772960662842]
    assert entry["residual"][0].item() == pytest.approx(1 - sum(math.exp(x) for x in first), rel=1e-6)
    assert (entry["residual"] >= 0).all()
    # row t predicts answer token t: greedy answers are the top-1 of their own rows
    assert entry["indices"][:, 0].tolist() == answer.token_ids


def test_vllm_legacy_reply_gives_the_same_rows_sorted():
    answer = parse_completion(VLLM_REPLY)
    assert answer.token_ids == [33, 2] and answer.finish == "eos"
    assert answer.top_ids == [[33, 504, 2122], [2, 198, 3717]]
    assert answer.top_logprobs[0] == sorted(answer.top_logprobs[0], reverse=True)
    llamacpp = teacher_entry([], parse_completion(LLAMACPP_REPLY), 3)
    assert torch.allclose(teacher_entry([], answer, 3)["logprobs"][0], llamacpp["logprobs"][0])


def test_replies_without_ids_or_logprobs_and_short_rows_are_refused():
    no_logprobs = {"choices": [{"text": "Hi", "finish_reason": "length", "logprobs": None}]}
    with pytest.raises(EngineRequestError, match="no logprobs"):
        parse_completion(no_logprobs, "http://x")
    by_text = {"choices": [{"text": "1", "finish_reason": "length",
                            "logprobs": {"tokens": ["1"], "top_logprobs": [{"1": -0.1}]}}]}
    with pytest.raises(EngineRequestError, match="by text"):
        parse_completion(by_text)
    with pytest.raises(EngineRequestError, match="gave 3 top logprobs at answer token 0"):
        teacher_entry([], parse_completion(LLAMACPP_REPLY), 4)
    with pytest.raises(EngineRequestError, match="unexpected completion reply"):
        parse_completion({"error": "boom"})


def test_base_url_accepts_the_sdk_form():
    assert base_url("http://h:8000/v1/") == base_url("http://h:8000") == "http://h:8000"


def _fake_server(completion: tuple[int, dict] | None):
    """A loopback HTTP server: 404 everywhere when `completion` is None (not OpenAI-compatible), else one
    model in /v1/models and this (status, body) for every /v1/completions."""

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, body: dict):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if completion is None:
                self.send_error(404, "Not Found")
            else:
                self._reply(200, {"data": [{"id": "org/target"}]})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self._reply(*completion)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("completion, match", [
    (None, "no OpenAI-compatible server.*HTTP 404"),
    ((400, {"message": "Requested logprobs of 32, which is greater than max of 20"}), "--max-logprobs"),
    ((200, {"choices": [{"text": "Hi", "finish_reason": "length"}]}), "no logprobs"),
])
def test_connect_names_a_server_that_cannot_answer_for_the_teacher(completion, match):
    server = _fake_server(completion)
    try:
        with pytest.raises(EngineRequestError, match=match):
            connect(f"http://127.0.0.1:{server.server_address[1]}/v1", PROMPT_IDS, 32, timeout_s=5)
    finally:
        server.shutdown()
    with pytest.raises(EngineRequestError, match="no OpenAI-compatible server at http://127.0.0.1:.*(refused|no answer)"):
        connect(f"http://127.0.0.1:{free_port()}", PROMPT_IDS, 8, timeout_s=5)


class _ExpiresAfter:
    """A deadline that expires once `n` requests have been let through (asked before each one)."""

    def __init__(self, n: int):
        self.left = n

    def expired(self) -> bool:
        self.left -= 1
        return self.left < 0


def test_no_request_is_sent_after_the_deadline_and_what_finished_is_kept(demo_tokenizer, tmp_path):
    from specdistill.distill.teacher import TeacherCache
    from specdistill.pipeline.stages.answers.engine_client import generate_answers_openai

    server = _fake_server((200, LLAMACPP_REPLY))
    try:
        engine = connect(f"http://127.0.0.1:{server.server_address[1]}", PROMPT_IDS, 3, timeout_s=5)
        cache = TeacherCache.create(tmp_path / "tc", fingerprint="f", k=3, temperature=1.0, vocab="full", data="d")
        prompts = _prompts(PROMPTS)
        done = generate_answers_openai(engine, demo_tokenizer, prompts, tmp_path / "a.jsonl", parallel=1, batch_size=2,
                                       max_new_tokens=4, teacher_cache=cache, progress=False, deadline=_ExpiresAfter(3))
        assert sorted(done) == ["q0", "q1", "q2"] and sorted(cache.load_all()) == sorted(done)
        again = generate_answers_openai(engine, demo_tokenizer, prompts, tmp_path / "a.jsonl", parallel=2, batch_size=2,
                                        max_new_tokens=4, teacher_cache=cache, progress=False)
        assert sorted(again) == ["q0", "q1", "q2", "q3", "q4"]  # the rest, on a rerun without a deadline
    finally:
        server.shutdown()


def test_generation_backend_config():
    cfg = load_nightly_config(None, ["generation.backend=openai", "generation.url=http://h:8000/v1"])
    assert cfg.generation.backend == "openai" and cfg.generation.parallel == 8
    assert load_nightly_config(None, ["generation.backend=openai"]).generation.url is None  # demo: llama-server here
    with pytest.raises(ConfigError, match="generation.url is read by generation.backend=openai"):
        load_nightly_config(None, ["generation.url=http://h:8000"])
    with pytest.raises(ConfigError, match="needs generation.url, or a GGUF target"):
        load_nightly_config(None, ["generation.backend=openai", "target=/models/llama-70b"])


# --------------------------------------------------------------------------------------------
# for real: llama-server on loopback with the demo target's GGUF

PROMPTS = ["Name three colors.", "Say hi.", "What is 2+2?", "Name a dog breed.", "Give me a fruit."]


def _prompts(texts):
    from specdistill.data.prompts import Prompt

    return [Prompt(id=f"q{i}", messages=[{"role": "user", "content": t}]) for i, t in enumerate(texts)]


@pytest.fixture(scope="module")
def served(llama_cpp):
    from specdistill.engines.llamacpp.engine import target_server

    with target_server("demo", parallel=2, ctx_per_slot=256, threads=2, engine=llama_cpp) as server:
        yield server


@pytest.mark.e2e
def test_answers_and_teacher_rows_from_llama_server(served, demo_tokenizer, tmp_path):
    from specdistill.data.prompts import encode_chat
    from specdistill.distill.examples import encode_generated
    from specdistill.distill.teacher import TeacherCache
    from specdistill.pipeline.stages.answers.engine_client import generate_answers_openai

    prompts = _prompts(PROMPTS[:3])
    engine = connect(served.url + "/v1", encode_chat(demo_tokenizer, prompts[0].messages), 16)
    assert engine.top_k == 16 and engine.model.endswith(".gguf")
    cache = TeacherCache.create(tmp_path / "tc", fingerprint="f", k=engine.top_k, temperature=1.0, vocab="full",
                                data="llamacpp:Q4_1")
    records = generate_answers_openai(engine, demo_tokenizer, prompts, tmp_path / "a.jsonl", parallel=2, batch_size=2,
                                      max_new_tokens=8, teacher_cache=cache, progress=False)
    rows = cache.load_all()
    assert sorted(records) == sorted(rows) == ["q0", "q1", "q2"]
    for p in prompts:
        rec, entry = records[p.id], rows[p.id]
        assert rec["prompt_ids"] == encode_chat(demo_tokenizer, p.messages)  # the harness's prompt ids exactly
        assert 0 < len(rec["response_ids"]) <= 8 and rec["finish"] in ("eos", "length")
        assert rec["response"] == demo_tokenizer.decode(rec["response_ids"], skip_special_tokens=True)
        assert entry["input_ids"].tolist() == rec["prompt_ids"] + rec["response_ids"]
        assert entry["logprobs"].shape == (len(rec["response_ids"]), 16)
        assert entry["indices"][:, 0].tolist() == rec["response_ids"]  # greedy: each token is its row's top-1
        assert ((entry["residual"] >= 0) & (entry["residual"] < 1)).all()
        example = encode_generated(demo_tokenizer, rec)  # what the trainer reads back lines up with the rows
        assert sum(example.assistant_mask[1:]) == entry["logprobs"].shape[0]
    assert records["q0"]["response_ids"][:3] == [33, 30, 3950]  # "1. Red", as recorded in LLAMACPP_REPLY


@pytest.mark.e2e
def test_a_failed_request_keeps_what_finished_and_a_rerun_asks_only_the_rest(served, demo_tokenizer, tmp_path,
                                                                              monkeypatch):
    from specdistill.data.prompts import encode_chat
    from specdistill.distill.teacher import TeacherCache
    from specdistill.pipeline.stages.answers import engine_client as answers

    prompts = _prompts(PROMPTS[:4] + ["Repeat this: " + "blue sky " * 200])  # over the slot's 256 tokens
    engine = connect(served.url, encode_chat(demo_tokenizer, prompts[0].messages), 4)
    cache = TeacherCache.create(tmp_path / "tc", fingerprint="f", k=4, temperature=1.0, vocab="full", data="d")
    out = tmp_path / "a.jsonl"
    with pytest.raises(EngineRequestError, match="prompt 'q4'"):
        answers.generate_answers_openai(engine, demo_tokenizer, prompts, out, parallel=1, batch_size=1,
                                        max_new_tokens=6, teacher_cache=cache, progress=False)
    kept = {json.loads(line)["id"]: line for line in out.read_text().splitlines()}
    assert set(kept) == {"q0", "q1", "q2", "q3"} and set(cache.load_all()) == set(kept)  # parallel 1: in order
    with open(out, "a") as f:
        f.write('{"id": "q4", "prompt": [')  # and a write torn by a kill
    asked = []
    real = answers.complete_ids
    monkeypatch.setattr(answers, "complete_ids", lambda url, ids, **kw: asked.append(ids) or real(url, ids, **kw))
    done = answers.generate_answers_openai(engine, demo_tokenizer, prompts[:4] + _prompts(PROMPTS)[4:], out,
                                           parallel=2, batch_size=2, max_new_tokens=6, teacher_cache=cache,
                                           progress=False)
    lines = out.read_text().splitlines()
    assert len(asked) == 1 and len(lines) == 5 and sorted(done) == [f"q{i}" for i in range(5)]
    assert {json.loads(line)["id"]: line for line in lines[:4]} == kept  # the old answers were kept, not redone
    assert sorted(cache.load_all()) == sorted(done)


@pytest.mark.e2e
def test_nightly_answer_stage_through_llama_server_feeds_the_trainer(llama_cpp, tmp_path, monkeypatch):
    """`generation.backend=openai` with no URL: the stage starts llama-server on the demo GGUF, writes the
    teacher cache (k and engine recorded), and the nightly's distillation trains a layer draft on it."""
    from specdistill.distill.teacher import CACHE_META
    from specdistill.pipeline.stages.answers import stage as answers
    from specdistill.pipeline.stages.distill import distill_draft
    from specdistill.pipeline.stages.ingest import ingest_source
    from specdistill.pipeline.stages.window import select_window

    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(json.dumps({"prompt": f"{t} ({i})", "response": "ok"}) + "\n"
                               for i, t in enumerate(PROMPTS * 12)))  # 60: a few land in the eval split
    settings = [
        "target=demo", f"log_db=sqlite:///{tmp_path / 'logs.db'}", f"sources=[{{path: '{traffic}', format: jsonl}}]",
        "window.train_prompts=4", "window.eval_prompts=2", "generation.max_new_tokens=8", "generation.parallel=2",
        "generation.teacher_top_k=8", "train.kind=draft_model", "train.layers=0,29", "train.draft_vocab=null",
        "train.optim.max_steps=2", "train.optim.batch_size=2", "bench.threads=1"]
    config = load_nightly_config(None, [*settings, "generation.backend=openai"])
    ingest_source(config.sources[0], config.log_db)
    window = select_window(config)
    train = answers.generate_responses(config, window, "train", record_teacher=True)
    heldout = answers.generate_responses(config, window, "eval", record_teacher=False)
    meta = json.loads((Path(train.teacher_cache) / CACHE_META).read_text())
    assert meta["k"] == 8 and meta["data"].endswith("llamacpp:Q4_1") and meta["temperature"] == 1.0
    assert train.answers == len(window.train) and heldout.teacher_cache is None
    assert "llamacpp-Q4_1" in train.path and train.tokens > 0
    trained = distill_draft(config, train, heldout)
    assert trained.steps == 2 and 0.0 <= trained.curve[-1]["acceptance"] <= 1.0
    # the harness backend on the same window: other data (its own directory), the same records, prompt for prompt
    harness = answers.generate_responses(load_nightly_config(None, settings), window, "eval", record_teacher=False)
    assert harness.path != heldout.path
    read = [{r["id"]: r for r in map(json.loads, Path(d.path).read_text().splitlines())} for d in (harness, heldout)]
    assert read[0].keys() == read[1].keys()
    for pid, rec in read[0].items():
        assert rec.keys() == read[1][pid].keys() and rec["prompt_ids"] == read[1][pid]["prompt_ids"]
