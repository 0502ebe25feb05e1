"""llama.cpp for real (e2e: needs the built llama-server, `make llama-server`): a GGUF export of the
target's own weights drafts for the target with acceptance > 0; an EAGLE-3 head exported to GGUF
drafts in `draft-eagle3` mode as it does in our engine; the OpenAI-compatible bench against
real servers on loopback; the monitor's live sampler on llama.cpp's real /metrics; a draft llama.cpp
refuses is an error, not a silent target-only server. Generations are a few tokens."""

from __future__ import annotations

import pytest

from specdistill.data.prompts import Prompt
from specdistill.engines.client import chat, metrics_url, scrape
from specdistill.engines.endpoint_bench import TARGET_ONLY, EngineBenchConfig, run_engine_bench
from specdistill.engines.llamacpp.gguf_export import export_draft_gguf
from specdistill.engines.llamacpp.server import LlamaServer, ServerConfig, ServerError, ServerMode
from specdistill.speculative.specs import DrafterSpec
from tests.conftest import eval_window

pytestmark = pytest.mark.e2e

# A prompt whose answer repeats itself: 3-gram lookup finds drafts in it (greedy, so every run).
REPEAT = "Translate to French: I love my cat. I love my dog. I love my house."
NGRAM = ServerMode("ngram-simple", None, 4, ngram_n=3)


@pytest.fixture(scope="module")
def target_gguf():
    from specdistill.modeling.models import demo_gguf_path

    return demo_gguf_path()


@pytest.fixture(scope="module")
def self_draft(tmp_path_factory, target_gguf):
    """The target's own (dequantized) weights as a draft GGUF: it should agree with the Q4_1 target."""
    from specdistill.modeling.models import resolve_model_dir

    out = tmp_path_factory.mktemp("gguf") / "self.gguf"
    export = export_draft_gguf(resolve_model_dir("demo"), target_gguf, out)
    assert export.layers == 30 and export.vocab_size == 49152 and export.head == "full"
    return out


def test_exported_draft_loads_and_drafts(llama_cpp, target_gguf, self_draft):
    mode = ServerMode("draft-simple", self_draft, 4)
    with LlamaServer(llama_cpp.server, ServerConfig(model=target_gguf, mode=mode, threads=2)) as server:
        done = chat(server.url, [{"role": "user", "content": "What is the capital of France?"}], max_tokens=16)
        counters = scrape(metrics_url(server.url))
    assert done.generated_tokens > 0 and done.draft_tokens and done.draft_tokens > 0
    assert done.accepted > 0, f"the target's own weights were never accepted ({done.accepted}/{done.draft_tokens})"
    assert counters.prefix == "llamacpp:" and counters.counts.accepted == done.accepted
    assert counters.counts.proposed == done.draft_tokens


def _memorizing_head(target, out_dir, messages: list[dict], answer_tokens: int = 32, steps: int = 2):
    """An EAGLE-3 head trained (seconds) on the target's own greedy answer to `messages`, so that
    drafting that answer is easy: its first `steps` draft positions are learnt, later ones are not.
    The draft vocabulary is 1k tokens plus the answer's, so the export carries a reduced vocabulary.
    Returns the head's directory and its last loss."""
    import torch
    import torch.nn.functional as F

    from specdistill.modeling.eagle3_init import init_eagle3_from_target
    from specdistill.modeling.eagle3_io import save_eagle3
    from specdistill.modeling.feature_hooks import FeatureHooks
    from specdistill.modeling.vocab import DraftVocab

    tok, model = target.tokenizer, target.model
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        ids = model.generate(prompt, max_new_tokens=answer_tokens, do_sample=False)
    vocab = DraftVocab(torch.cat([torch.arange(1024), ids[0]]).unique(), target.config.vocab_size)
    head = init_eagle3_from_target(model, vocab).float()
    with FeatureHooks(model, head.aux_layers) as hooks, torch.no_grad():
        model(ids)
        features = hooks.take().float()[:, :-1]
    next_ids, t = ids[:, 1:], ids.shape[1] - 1
    labels = [vocab.to_draft_ids(ids[0, 2 + j:]) for j in range(steps)]  # step j at entry i drafts token i+2+j
    valid = torch.ones_like(next_ids, dtype=torch.bool)
    optimizer = torch.optim.Adam([p for n, p in head.named_parameters() if not n.startswith("embed_tokens")], lr=1e-3)
    for _ in range(60):
        logits = head.unroll(next_ids, features, steps, valid)
        loss = sum(F.cross_entropy(x[0, : t - 1 - j], labels[j]) for j, x in enumerate(logits))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 0.05 * steps:
            break
    return save_eagle3(head, tok, out_dir), loss.item()


@pytest.fixture(scope="module")
def memorized_head(tmp_path_factory, demo_target):
    head_dir, loss = _memorizing_head(demo_target, tmp_path_factory.mktemp("eagle3") / "head",
                                      [{"role": "user", "content": REPEAT}])
    assert loss < 0.5
    return head_dir


def test_exported_eagle3_head_loads_and_drafts(llama_cpp, target_gguf, memorized_head):
    """The exported head pairs with the target GGUF (target layers, hidden size, its tokenizer, the
    reduced draft vocabulary through d2t) and drafts what it learnt: acceptance > 0 and, a memorised
    answer, a good part of the first two draft positions (our engine accepts about half of K=4 here)."""
    from specdistill.pipeline.stages.engine_bench import mode_for_spec

    mode = mode_for_spec(DrafterSpec("draft_model", str(memorized_head)), target_gguf, 4)
    assert mode.spec_type == "draft-eagle3"
    with LlamaServer(llama_cpp.server, ServerConfig(model=target_gguf, mode=mode, threads=2)) as server:
        done = chat(server.url, [{"role": "user", "content": REPEAT}], max_tokens=24)
        counters = scrape(metrics_url(server.url))
    assert done.generated_tokens > 0 and done.draft_tokens and done.draft_tokens > 0
    assert done.accepted > 0, f"the memorised answer was never accepted ({done.accepted}/{done.draft_tokens})"
    assert done.accepted >= done.draft_tokens / 4, f"{done.accepted}/{done.draft_tokens} accepted"
    assert counters.counts.accepted == done.accepted and counters.counts.proposed == done.draft_tokens


def test_nightly_measures_an_eagle3_head_in_llama_cpp(llama_cpp, memorized_head, tmp_path, capsys):
    """serving.engine=llamacpp: the challenger head runs as draft-eagle3 from its exported GGUF; that
    GGUF goes to MLflow with the version, and serving.json (when the head is served) names it."""
    from specdistill.cli import main
    from specdistill.engines.llamacpp.gguf_export import gguf_spec_type
    from specdistill.ops.policy import PLAUSIBLE_FACTOR, GateVerdict
    from specdistill.ops.serving import write_serving_config
    from specdistill.pipeline.nightly_recipe import load_nightly_config
    from specdistill.pipeline.outputs import TargetInfo, Trained
    from specdistill.pipeline.report import registration_artifacts
    from specdistill.pipeline.serving import serving_config
    from specdistill.pipeline.stages.choose_mode import choose_serving
    from specdistill.pipeline.stages.engine_bench import engine_benchmark
    from tests.conftest import trained_result

    config = load_nightly_config(None, ["serving.engine=llamacpp", "bench.max_new_tokens=24", "serving.margin=0.0",
                                        "serving.min_prompts=1"])  # the window's one prompt may decide
    window = eval_window(REPEAT)
    speeds = engine_benchmark(config, window, {"challenger": DrafterSpec("draft_model", str(memorized_head))})
    head = speeds["challenger"]
    args = head.stats["llamacpp_args"]
    assert args[args.index("--spec-type") + 1] == "draft-eagle3" and args[args.index("--spec-draft-n-max") + 1] == "4"
    gguf = args[args.index("-md") + 1]
    assert gguf_spec_type(gguf) == "draft-eagle3" and head.stats["accepted"] > 0

    verdict = GateVerdict(True)
    trained = Trained.from_dict(trained_result(str(memorized_head)))
    assert str(registration_artifacts(config, speeds, verdict, trained, None, speeds)[-1]) == gguf

    decision = choose_serving(config, window, {}, verdict, speeds)
    assert decision.engine == "llamacpp" and decision.measured == {"challenger": head.speedup}
    if decision.mode == "off":  # a loaded machine can make any mode slower (or implausibly fast): the guard says so
        assert head.speedup <= 1.0 or not head.lossless or head.speedup > PLAUSIBLE_FACTOR * head.accepted_length
        return
    target = TargetInfo("demo", "/t", "fp", num_layers=30, vocab_size=49152, dtype="Q4_1")
    path = write_serving_config(serving_config(decision, target, "1", str(memorized_head)), tmp_path / "serving.json")
    assert main(["serving", "show", "--path", str(path)]) == 0
    shown = capsys.readouterr().out
    assert "EAGLE-3 head" in shown and f"-md {gguf} --spec-type draft-eagle3 --spec-draft-n-max 4" in shown


def test_openai_bench_against_real_servers(llama_cpp, target_gguf):
    prompts = [Prompt(REPEAT, "repeat"), Prompt("Name three colors.", "chat")]
    with LlamaServer(llama_cpp.server, ServerConfig(model=target_gguf, threads=2)) as base, \
            LlamaServer(llama_cpp.server, ServerConfig(model=target_gguf, mode=NGRAM, threads=2)) as ngram:
        results = run_engine_bench({TARGET_ONLY: base.url, "ngram": ngram.url}, prompts,
                                   EngineBenchConfig(max_new_tokens=32, repeats=1), engine="openai", dtype="Q4_1",
                                   progress=False)
    r = results["ngram"]
    assert r.engine == "openai" and r.dtype == "Q4_1" and r.drafter == "ngram"
    assert r.stats["draft_tokens"] > 0 and 0.0 <= r.acceptance_rate <= 1.0
    # the Prometheus deltas and the per-request timings count the same drafts
    assert r.stats["draft_tokens"] == r.stats["timings_draft_tokens"] and r.stats["accepted"] == r.stats["timings_accepted"]
    assert r.accepted_length == pytest.approx(1 + r.stats["accepted"] / r.stats["drafts"])
    assert r.lossless_exact + r.lossless_near_ties + r.lossless_mismatches == len(prompts)
    assert r.tokens_per_second_target_only > 0 and r.speedup > 0
    assert {s.name for s in r.slices} == {"repeat", "chat"}
    # per-slice τ from the counters around each request: measured, and > 1 exactly where drafts were accepted
    by_name = {s.name: s for s in r.slices}
    assert by_name["repeat"].accepted_length > 1.0
    assert all((s.acceptance_rate > 0) == (s.accepted_length > 1.0) for s in r.slices)


def test_monitor_live_sampler_reads_llama_cpp_metrics(llama_cpp, target_gguf, monkeypatch):
    """Two real scrapes with real speculative traffic between them (run where the sampler waits)."""
    import time
    import types

    from specdistill.ops import metrics

    with LlamaServer(llama_cpp.server, ServerConfig(model=target_gguf, mode=NGRAM, threads=2)) as server:
        chat(server.url, [{"role": "user", "content": "Say hi."}], max_tokens=8)  # history before the window
        done = []
        traffic = types.SimpleNamespace(
            time=time.time,
            sleep=lambda s: done.append(chat(server.url, [{"role": "user", "content": REPEAT}], max_tokens=32)))
        monkeypatch.setattr(metrics, "time", traffic)
        sample = metrics.sample_live_acceptance(metrics_url(server.url), interval_s=1.0, min_draft_tokens=1)
    assert len(done) == 1 and done[0].draft_tokens, "the request between the scrapes drafted nothing"
    assert sample.ok, sample.reason
    assert sample.counts.proposed == done[0].draft_tokens and sample.counts.accepted == done[0].accepted
    assert sample.acceptance_rate == pytest.approx(done[0].accepted / done[0].draft_tokens)


def _truncated_target(tmp_path, layers: int = 2):
    """The demo target's first `layers` layers as an HF directory (a truncated copy: a small draft)."""
    import json

    from safetensors.torch import load_file, save_file

    from specdistill.modeling.models import resolve_model_dir

    src = resolve_model_dir("demo")
    out = tmp_path / "truncated"
    out.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config))
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update({k: v for k, v in load_file(str(f)).items()
                        if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers})
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _with_token_renamed(src, dst, token_id: int):
    """A copy of a GGUF whose vocabulary differs from the target's in one token text."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        if name == "tokenizer.ggml.tokens":
            value = list(value)
            value[token_id] = value[token_id] + "_renamed"
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_truncated_copy_drafts_and_a_renamed_vocabulary_is_refused(llama_cpp, target_gguf, tmp_path):
    draft = export_draft_gguf(_truncated_target(tmp_path), target_gguf, tmp_path / "trunc.gguf")
    assert draft.layers == 2
    mode = ServerMode("draft-simple", tmp_path / "trunc.gguf", 2)
    with LlamaServer(llama_cpp.server, ServerConfig(model=target_gguf, mode=mode, threads=2)) as server:
        done = chat(server.url, [{"role": "user", "content": REPEAT}], max_tokens=12)
    assert done.draft_tokens and done.draft_tokens > 0  # it loads and drafts (a 2-layer copy rarely agrees)

    bad = _with_token_renamed(tmp_path / "trunc.gguf", tmp_path / "renamed.gguf", 1000)
    server = LlamaServer(llama_cpp.server, ServerConfig(model=target_gguf, mode=ServerMode("draft-simple", bad, 2), threads=2))
    with pytest.raises(ServerError, match="refused the draft-simple draft .*renamed.gguf as vocabulary-incompatible"):
        server.start()
    assert server.process is None


def test_nightly_serving_choice_measured_in_llama_cpp(llama_cpp, tmp_path):
    """serving.engine=llamacpp: the servable modes run in llama-server on the window's prompts; the
    choice, serving.json and the report name the engine; the never-served baseline is not measured."""
    from specdistill.modeling.models import demo_gguf_path
    from specdistill.ops.policy import PLAUSIBLE_FACTOR, GateVerdict, speedup_lower_bound
    from specdistill.ops.serving import read_serving_config, write_serving_config
    from specdistill.pipeline.nightly_recipe import load_nightly_config
    from specdistill.pipeline.outputs import TargetInfo
    from specdistill.pipeline.report import report_table
    from specdistill.pipeline.serving import serving_config
    from specdistill.pipeline.stages.choose_mode import choose_serving
    from specdistill.pipeline.stages.engine_bench import engine_benchmark

    config = load_nightly_config(None, ["serving.engine=llamacpp", "bench.max_new_tokens=32", "serving.margin=0.0",
                                        "serving.min_prompts=2"])  # the window's two prompts may decide
    window = eval_window(REPEAT, "Name three colors.")
    speeds = engine_benchmark(config, window, {"ngram": DrafterSpec("ngram"), "generic": DrafterSpec("draft_model", "/never/measured")})
    assert set(speeds) == {"ngram"}
    ngram = speeds["ngram"]
    assert ngram.engine == "llamacpp" and ngram.dtype == "Q4_1" and ngram.stats["draft_tokens"] > 0
    args = ngram.stats["llamacpp_args"]
    assert args[:2] == ["-m", str(demo_gguf_path())] and args[args.index("--spec-type") + 1] == "ngram-simple"
    assert args[args.index("--spec-ngram-simple-size-n") + 1] == "3"  # the harness's n-gram: up to 3-grams
    decision = choose_serving(config, window, {}, GateVerdict(False), speeds)
    assert decision.engine == "llamacpp" and decision.measured == {"ngram": ngram.speedup}
    bound = speedup_lower_bound(ngram.prompt_speedups)  # the gain must hold over the prompts too
    plausible = ngram.speedup <= PLAUSIBLE_FACTOR * ngram.accepted_length  # within what τ tokens per forward allow
    holds = ngram.speedup > 1.0 and ngram.lossless and (bound is None or bound > 1.0) and plausible
    assert decision.mode == ("ngram" if holds else "off")
    target = TargetInfo("demo", "/t", "fp", num_layers=30, vocab_size=49152, dtype="Q4_1")
    path = write_serving_config(serving_config(decision, target), tmp_path / "serving.json")
    written = read_serving_config(path)
    assert written.engine == "llamacpp" and written.measured_on.startswith("llamacpp, Q4_1")
    assert written.llamacpp()["command"].startswith("llama-server -m ")
    assert "speeds in the serving engine: **llamacpp**, Q4_1" in report_table({}, speeds=speeds)
