"""The engine layer without a real engine: llama-server's command line per mode, the server lifecycle's
errors (port in use, a server that exits or never becomes healthy), the divergence judge, and the GGUF
exporter's refusal of a vocabulary llama.cpp would not pair with the target."""

from __future__ import annotations

import socket
import stat

import pytest

from specdistill.engines.client import Completion, TokenLogprob
from specdistill.engines.endpoint_bench import divergence_margin
from specdistill.engines.llamacpp.gguf_export import GgufExportError, export_draft_gguf
from specdistill.engines.llamacpp.server import LlamaServer, ServerConfig, ServerError, ServerMode, server_args
from specdistill.speculative.specs import DrafterSpec
from tests.conftest import save_tiny_target


def test_mode_flags_are_llama_cpp_flags(tmp_path):
    assert ServerMode().args() == [] and ServerMode().name == "target-only"
    draft = ServerMode("draft-simple", tmp_path / "d.gguf", 3)
    assert draft.args() == ["-md", str(tmp_path / "d.gguf"), "--spec-type", "draft-simple", "--spec-draft-n-max", "3"]
    assert ServerMode("ngram-simple", None, 6).args() == ["--spec-type", "ngram-simple", "--spec-draft-n-max", "6",
                                                          "--spec-ngram-simple-size-m", "6"]
    assert ServerMode("ngram-simple", None, 6, ngram_n=3).args()[-2:] == ["--spec-ngram-simple-size-n", "3"]
    args = server_args(ServerConfig(model=tmp_path / "t.gguf", mode=draft, threads=2), 8123)
    assert args[:4] == ["-m", str(tmp_path / "t.gguf"), "--host", "127.0.0.1"] and "--metrics" in args
    assert args[args.index("--port") + 1] == "8123" and args[args.index("-td") + 1] == "2"
    with pytest.raises(ValueError, match="needs a draft GGUF"):
        ServerMode("draft-simple")
    with pytest.raises(ValueError, match="expected one of"):
        ServerMode("medusa")


def _script(tmp_path, body: str):
    path = tmp_path / "fake-llama-server"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "t.gguf").write_bytes(b"GGUF")
    return path


def test_port_in_use_is_named(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = LlamaServer(_script(tmp_path, "exit 0"), ServerConfig(model=tmp_path / "t.gguf", port=port))
        with pytest.raises(ServerError, match=f"port {port} on 127.0.0.1 is in use"):
            server.start()


def test_server_that_exits_shows_its_log(tmp_path):
    binary = _script(tmp_path, 'echo "llama_model_load: error loading model: bad magic"; exit 1')
    with pytest.raises(ServerError, match=r"exited with code 1 before it was ready(.|\n)*bad magic"):
        LlamaServer(binary, ServerConfig(model=tmp_path / "t.gguf")).start()


def test_server_that_never_becomes_healthy_is_stopped(tmp_path):
    server = LlamaServer(_script(tmp_path, "exec sleep 30"), ServerConfig(model=tmp_path / "t.gguf"), startup_timeout_s=1)
    with pytest.raises(ServerError, match="did not become healthy within 1 s"):
        server.start()
    assert server.process is None  # killed, not left running


def test_missing_files_are_named(tmp_path):
    binary = _script(tmp_path, "exit 0")
    with pytest.raises(ServerError, match="draft GGUF not found"):
        LlamaServer(binary, ServerConfig(model=tmp_path / "t.gguf", mode=ServerMode("draft-simple", tmp_path / "no.gguf"))).start()
    with pytest.raises(ServerError, match="no llama-server binary"):
        LlamaServer(tmp_path / "nothing", ServerConfig(model=tmp_path / "t.gguf")).start()


def _reference(tokens: list[tuple[str, float, dict]]) -> Completion:
    return Completion("".join(t for t, _, _ in tokens), len(tokens), 1.0,
                      logprobs=[TokenLogprob(t, lp, top) for t, lp, top in tokens])


def test_divergence_margin_reads_the_target_only_logprobs():
    ref = _reference([("The", -0.1, {"The": -0.1}), (" cat", -0.60, {" cat": -0.60, " dog": -0.85}),
                      (" sat", -0.2, {" sat": -0.2})])
    assert divergence_margin("The cat sat", "The dog ran", ref) == pytest.approx(0.25)  # a near-tie
    assert divergence_margin("The cat sat", "The bird", ref) == float("inf")  # not in the top-k: real mismatch
    assert divergence_margin("The cat sat", "The cat", ref) == float("inf")  # one stopped early


def test_export_refuses_a_vocabulary_llama_cpp_would_refuse(tmp_path):
    from specdistill.modeling.models import demo_gguf_path

    draft = save_tiny_target(tmp_path / "tiny")  # a 300-token vocabulary against the demo's 49,152
    with pytest.raises(GgufExportError, match="vocabulary-incompatible: draft vocab_size 300 vs target 49152"):
        export_draft_gguf(draft, demo_gguf_path(), tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_a_drafter_specs_llama_server_mode_is_read_by_the_one_spec_parser():
    from specdistill.pipeline.stages.engine_bench import mode_for_spec

    assert mode_for_spec(DrafterSpec.parse("ngram"), None, 5) == ServerMode("ngram-simple", None, 5, ngram_n=3)  # the harness's 1..3-grams
    assert mode_for_spec(DrafterSpec.parse("ngram:2,6"), None, 4) == ServerMode("ngram-simple", None, 4, ngram_n=6)
    with pytest.raises(ValueError, match="no llama.cpp mode"):
        mode_for_spec(DrafterSpec.parse("suffix:/c.json"), None)


def test_the_engine_bench_stops_at_its_deadline_after_the_prompt_in_hand(monkeypatch):
    """Fake endpoints whose every request takes 10 s of a fake clock: with 25 s left the bench finishes the
    prompts it started (every mode ran them, so the speedups stay paired) and says what it cut."""
    from specdistill.acceptance import DraftCounts
    from specdistill.budget import Deadline
    from specdistill.data.prompts import Prompt
    from specdistill.engines import endpoint_bench
    from specdistill.engines.client import Scrape

    clock = {"now": 0.0}
    asked = []

    def fake_chat(url, messages, max_tokens, **kw):
        if max_tokens > 4:  # warm-up requests take no time
            clock["now"] += 10.0
            asked.append((url, messages[-1]["content"]))
        return Completion("same text", max_tokens, 2.0 if url == "http://target" else 1.0)

    monkeypatch.setattr(endpoint_bench, "chat", fake_chat)
    monkeypatch.setattr(endpoint_bench, "scrape",
                        lambda url, timeout_s=5.0: Scrape(DraftCounts(len(asked), 4 * len(asked), 2 * len(asked))))
    monkeypatch.setattr(Deadline, "remaining", lambda self, now=None: max(0.0, self.at - clock["now"]))
    prompts = [Prompt(f"question {i}") for i in range(6)]
    endpoints = {endpoint_bench.TARGET_ONLY: "http://target", "ngram": "http://ngram"}
    results = endpoint_bench.run_engine_bench(endpoints, prompts, endpoint_bench.EngineBenchConfig(repeats=2), engine="fake", dtype="f",
                                     progress=False, deadline=Deadline(25.0))
    r = results["ngram"]
    # prompt 0 (20 s), prompt 1 started before the deadline (40 s), then the deadline: 2 of 6 prompts, one repeat
    assert len(asked) == 4 and r.budget_note == "time budget reached: 2 of 6 prompts"
    assert len(r.prompt_speedups) == 2 and r.repeats == 1 and r.speedup == pytest.approx(2.0) and r.lossless
    whole = endpoint_bench.run_engine_bench(endpoints, prompts, endpoint_bench.EngineBenchConfig(repeats=2), engine="fake", dtype="f",
                                   progress=False)  # no deadline: every prompt, every repeat
    assert whole["ngram"].budget_note == "" and len(whole["ngram"].prompt_speedups) == 6 and whole["ngram"].repeats == 2


# ----------------------------------------------------------------------------------------------
# an endpoint that accepts and never answers; a base URL given with its /v1


@pytest.fixture
def silent_server():
    """A loopback server that accepts connections and never answers a byte (at most 30 s, then it closes)."""
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    held, stop = [], threading.Event()

    def serve():
        deadline = __import__("time").monotonic() + 30
        while not stop.is_set() and __import__("time").monotonic() < deadline:
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


def test_bench_against_an_endpoint_that_never_answers_stops_at_its_timeout_saying_so(silent_server, tmp_path, capsys):
    """`bench --engine openai` sat silent for 307 s against a server that accepted and never answered."""
    import json
    import time

    from specdistill.cli import main

    prompts = tmp_path / "p.txt"
    prompts.write_text("hello there\n")
    began = time.monotonic()
    code = main(["bench", "--target", "demo", "--engine", "openai", "--url", silent_server, "--baseline-url",
                 silent_server, "--prompts", str(prompts), "--timeout", "2.5", "--json"])
    took = time.monotonic() - began
    out, err = capsys.readouterr()
    assert code != 0 and took < 20, (code, took)
    assert json.loads(out)["exit_code"] == code and "Traceback" not in err
    sentence = [line for line in err.splitlines() if line.startswith("specdistill: error:")]  # on a line of its own
    assert len(sentence) == 1 and "no answer within 2.5 s" in sentence[0] and "--timeout" in sentence[0]
    assert "first answer" in sentence[0]
    assert "/v1/chat/completions" in sentence[0] and "/v1/v1" not in sentence[0]
    assert "waiting for the target-only endpoint's first answer: 1 s of 2.5 s" in err  # progress while it waits


def test_a_base_url_is_used_as_given_with_or_without_v1():
    import http.server
    import json
    import threading

    from specdistill.engines.client import api_url, chat, metrics_url, scrape

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _reply(self, body: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # noqa: N802 (http.server's name)
            seen.append(self.path)
            self.rfile.read(int(self.headers["Content-Length"]))
            self._reply(json.dumps({"choices": [{"message": {"content": "hi"}}], "usage": {"completion_tokens": 1}})
                        .encode(), "application/json")

        def do_GET(self):  # noqa: N802
            seen.append(self.path)
            self._reply(b"vllm:spec_decode_num_drafts_total 2\nvllm:spec_decode_num_draft_tokens_total 4\n"
                        b"vllm:spec_decode_num_accepted_tokens_total 3\n", "text/plain")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    root = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for base in (root, root + "/", root + "/v1", root + "/v1/"):
            assert chat(base, [{"role": "user", "content": "q"}], max_tokens=1, timeout_s=10).text == "hi"
            assert scrape(metrics_url(base)).counts.accepted == 3
            assert api_url(base, "models") == root + "/v1/models"
    finally:
        server.shutdown()
        server.server_close()
    assert seen == ["/v1/chat/completions", "/metrics"] * 4
