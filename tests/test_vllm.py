"""vLLM for real (e2e: needs `make vllm`, which `make test` runs first): one CPU vLLM server per mode for
the whole session (target-only, n-gram, an exported EAGLE-3 head, a layer draft with a reduced
vocabulary), all started together. The engine bench against them, the exports loading and drafting in
vLLM, answers with logprobs as token ids, the monitor's live sampler on vLLM's real /metrics, the
nightly's serving choice measured in vLLM, and a draft layout vLLM refuses (the layout drafts had
before the vocabulary map moved) reported with vLLM's own error. Generations are a few tokens."""

from __future__ import annotations

import time

import pytest

from specdistill.data.prompts import Prompt
from specdistill.engines.client import chat, delta, metrics_url, scrape
from specdistill.engines.endpoint_bench import TARGET_ONLY, EngineBenchConfig, run_engine_bench
from specdistill.speculative.specs import DrafterSpec
from tests.conftest import eval_window
from tests.test_llamacpp import REPEAT, _memorizing_head

pytestmark = pytest.mark.e2e

NGRAM_SPEC = "ngram"  # the harness's n-gram drafter: 1..3-grams
K = 4


def _serving_block(spec: str) -> dict:
    """The speculative_config serving.json would carry for a drafter spec."""
    from specdistill.pipeline.stages.engine_bench import mode_serving_config

    return mode_serving_config(DrafterSpec.parse(spec), K, "demo").vllm()


@pytest.fixture(scope="module")
def layer_draft(tmp_path_factory, demo_target):
    """A 4-layer draft of the target with an 8k reduced vocabulary, saved as the pipeline saves drafts."""
    import torch

    from specdistill.modeling.drafts import init_draft_from_target, save_draft
    from specdistill.modeling.vocab import DraftVocab

    draft = init_draft_from_target(demo_target.model, [0, 1, 2, 29])
    vocab = DraftVocab(torch.arange(8192), demo_target.config.vocab_size)
    return save_draft(draft, demo_target.tokenizer, tmp_path_factory.mktemp("draft") / "layers", draft_vocab=vocab)


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory, demo_target):
    head_dir, loss = _memorizing_head(demo_target, tmp_path_factory.mktemp("eagle3") / "head",
                                      [{"role": "user", "content": REPEAT}])
    assert loss < 0.5
    return head_dir


@pytest.fixture(scope="module")
def speculators_head(tmp_path_factory, eagle_head):
    """The same head exported in vLLM's speculators format (`draft export --format speculators`)."""
    from specdistill.engines.vllm.bench import target_dir
    from specdistill.modeling.eagle3_import import export_head

    return export_head(eagle_head, tmp_path_factory.mktemp("speculators") / "head", format="speculators",
                       target=str(target_dir("demo")))


@pytest.fixture(scope="module")
def legacy_draft(tmp_path_factory, layer_draft):
    """The layer draft as drafts were saved before the map moved: draft_vocab.safetensors beside the weights."""
    import shutil

    from specdistill.modeling.vocab import DRAFT_VOCAB_FILE, LEGACY_DRAFT_VOCAB_FILE

    legacy = tmp_path_factory.mktemp("legacy") / "layers"
    shutil.copytree(layer_draft, legacy)
    (legacy / DRAFT_VOCAB_FILE).rename(legacy / LEGACY_DRAFT_VOCAB_FILE)
    shutil.rmtree(legacy / DRAFT_VOCAB_FILE.split("/")[0])
    return legacy


class Servers(dict):
    refused: dict  # mode -> the VllmStartError it failed with


@pytest.fixture(scope="module")
def vllm_servers(vllm_env, layer_draft, eagle_head, legacy_draft, speculators_head):
    """target-only, ngram, eagle3, draft_model and speculators-format servers, started side by side with a
    legacy-layout draft that vLLM must refuse (its failure overlaps the others' start-up), stopped when this
    file's tests end (a session's would hold five servers while the worker runs other files: CI's other worker
    was killed for memory so). A quarter GiB of KV cache each (0.75 GiB less than the default): 11,600 tokens of
    the demo target, room for these tests' short prompts."""
    from specdistill.engines.vllm.bench import served_dtype, target_dir
    from specdistill.engines.vllm.server import VllmConfig, VllmServer, start_together

    modes = {TARGET_ONLY: None, "ngram": _serving_block(NGRAM_SPEC), "eagle3": _serving_block(f"draft_model:{eagle_head}"),
             "draft_model": _serving_block(f"draft_model:{layer_draft}"), "legacy": _serving_block(f"draft_model:{legacy_draft}"),
             "speculators": {"method": "eagle3", "model": str(speculators_head), "num_speculative_tokens": K}}
    assert modes["eagle3"]["method"] == "eagle3" and modes["draft_model"]["method"] == "draft_model"
    servers = {name: VllmServer(VllmConfig(model=target_dir("demo"), speculative_config=spec, dtype=served_dtype(),
                                           max_logprobs=20, kv_cache_gib=0.25, name=name), vllm_env)
               for name, spec in modes.items()}
    t0 = time.monotonic()
    errors = {list(servers)[i]: e for i, e in start_together(list(servers.values())).items()}
    try:
        assert set(errors) <= {"legacy"}, {n: str(e) for n, e in errors.items()}
        up = Servers((n, s) for n, s in servers.items() if n not in errors)
        up.refused = errors
        print(f"\nvLLM: {len(up)} servers up in {time.monotonic() - t0:.0f} s "
              + ", ".join(f"{n} {s.startup_s:.0f} s" for n, s in up.items()))
        yield up
    finally:
        for server in servers.values():
            server.stop()


def test_bench_against_real_vllm(vllm_servers):
    prompts = [Prompt(REPEAT, "repeat"), Prompt("Name three colors.", "chat")]
    endpoints = {TARGET_ONLY: vllm_servers[TARGET_ONLY].url, "ngram": vllm_servers["ngram"].url}
    r = run_engine_bench(endpoints, prompts, EngineBenchConfig(max_new_tokens=32), engine="vllm", dtype="served",
                         progress=False)["ngram"]
    assert r.engine == "vllm" and r.stats["metrics_prefix"] == "vllm:"
    assert r.stats["draft_tokens"] > 0 and 0.0 < r.acceptance_rate <= 1.0
    assert r.accepted_length == pytest.approx(1 + r.stats["accepted"] / r.stats["drafts"])
    # vLLM's per-position counters: position 0 is accepted at least as often as any later one
    assert len(r.per_position_acceptance) == K and r.per_position_acceptance[0] >= max(r.per_position_acceptance[1:])
    assert sum(r.per_position_acceptance) == pytest.approx(r.accepted_length - 1)
    assert r.lossless_exact + r.lossless_near_ties + r.lossless_mismatches == len(prompts) and r.lossless
    assert r.tokens_per_second_target_only > 0 and r.speedup > 0
    assert {s.name: s.accepted_length > 1.0 for s in r.slices}["repeat"]


def test_exported_eagle3_head_loads_and_drafts_in_vllm(vllm_servers):
    """The head as exported (LlamaForCausalLMEagle3, d2t/t2d, eagle_config) drafts in vLLM what it learnt."""
    server = vllm_servers["eagle3"]
    before = scrape(metrics_url(server.url))
    done = chat(server.url, [{"role": "user", "content": REPEAT}], max_tokens=24)
    d = scrape(metrics_url(server.url))
    drafted, accepted = d.counts.proposed - before.counts.proposed, d.counts.accepted - before.counts.accepted
    assert done.generated_tokens > 0 and drafted > 0
    assert accepted >= drafted / 4, f"{accepted:g}/{drafted:g} accepted of a memorised answer"
    base = chat(vllm_servers[TARGET_ONLY].url, [{"role": "user", "content": REPEAT}], max_tokens=24)
    assert done.text == base.text  # greedy: speculation changes nothing


def test_speculators_export_loads_in_vllm_and_drafts_as_the_eagle3_layout(vllm_servers):
    """vLLM reads the speculators export as a speculator (its SpeculatorsConfig: speculators_model_type eagle3,
    norm_before_residual false) and drafts exactly what the same head in the EAGLE-3 layout drafts there."""
    counts = {}
    for name in ("eagle3", "speculators"):
        server = vllm_servers[name]
        before = scrape(metrics_url(server.url))
        done = chat(server.url, [{"role": "user", "content": REPEAT}], max_tokens=24)
        counts[name] = (done.text, delta(before, scrape(metrics_url(server.url))).counts)
    text, drafted = counts["speculators"]
    assert drafted.proposed > 0 and drafted.accepted >= drafted.proposed / 4
    assert counts["speculators"] == counts["eagle3"]  # same text, rounds, per-position acceptance
    assert text == chat(vllm_servers[TARGET_ONLY].url, [{"role": "user", "content": REPEAT}], max_tokens=24).text


def test_layer_draft_with_reduced_vocabulary_loads_and_drafts_in_vllm(vllm_servers, layer_draft):
    """The draft vocabulary map is not a weights file beside the checkpoint: vLLM's draft_model loads it."""
    from specdistill.modeling.vocab import DRAFT_VOCAB_FILE

    assert (layer_draft / DRAFT_VOCAB_FILE).is_file() and not (layer_draft / "draft_vocab.safetensors").exists()
    server = vllm_servers["draft_model"]
    before = scrape(metrics_url(server.url))
    chat(server.url, [{"role": "user", "content": REPEAT}], max_tokens=16)
    after = scrape(metrics_url(server.url))
    assert after.counts.proposed > before.counts.proposed


def test_answers_with_logprobs_as_token_ids_from_vllm(vllm_servers, demo_target, tmp_path):
    from specdistill.data.prompts import Prompt as AnswerPrompt
    from specdistill.data.prompts import encode_chat
    from specdistill.distill.examples import read_done
    from specdistill.distill.teacher import TeacherCache
    from specdistill.pipeline.stages.answers.engine_client import connect, generate_answers_openai

    tok = demo_target.tokenizer
    prompts = [AnswerPrompt(id="a", messages=[{"role": "user", "content": REPEAT}]),
               AnswerPrompt(id="b", messages=[{"role": "user", "content": "Name three colors."}])]
    served = connect(vllm_servers[TARGET_ONLY].url, encode_chat(tok, prompts[0].messages), 5)
    assert served.top_k == 5 and served.model == "target"
    cache = TeacherCache.create(tmp_path / "teacher", fingerprint=demo_target.fingerprint, k=5, temperature=1.0, vocab="full",
                                data="vllm")
    records = generate_answers_openai(served, tok, prompts, tmp_path / "answers.jsonl", parallel=2, batch_size=1,
                                      max_new_tokens=12, teacher_cache=cache, progress=False)
    assert set(records) == {"a", "b"} and set(read_done(tmp_path / "answers.jsonl")) == {"a", "b"}
    for p in prompts:
        r = records[p.id]
        assert r["prompt_ids"] == encode_chat(tok, p.messages) and 0 < len(r["response_ids"]) <= 12
        text = chat(vllm_servers[TARGET_ONLY].url, p.messages, max_tokens=12).text
        assert tok.decode(r["response_ids"], skip_special_tokens=True) == text  # ids, not re-tokenised text
    # a resume asks for nothing more
    again = generate_answers_openai(served, tok, prompts, tmp_path / "answers.jsonl", parallel=2, batch_size=1,
                                    max_new_tokens=12, teacher_cache=cache, progress=False)
    assert again == records


def test_monitor_live_sampler_reads_vllm_metrics(vllm_servers, monkeypatch):
    """Two real scrapes of vLLM's counters with real speculative traffic between them."""
    import types

    from specdistill.ops import metrics

    server = vllm_servers["ngram"]
    counts = []

    def traffic(_seconds):
        counts.append(scrape(metrics_url(server.url)))
        chat(server.url, [{"role": "user", "content": REPEAT}], max_tokens=24)
        counts.append(scrape(metrics_url(server.url)))

    monkeypatch.setattr(metrics, "time", types.SimpleNamespace(time=time.time, sleep=traffic))
    sample = metrics.sample_live_acceptance(metrics_url(server.url), interval_s=1.0, min_draft_tokens=1)
    assert sample.ok, sample.reason
    before, after = counts
    assert sample.counts.proposed == after.counts.proposed - before.counts.proposed > 0
    assert sample.acceptance_rate == pytest.approx((after.counts.accepted - before.counts.accepted) / sample.counts.proposed)
    assert sample.per_position_acceptance and sample.per_position_acceptance[0] >= sample.per_position_acceptance[-1]


def test_nightly_serving_choice_measured_in_vllm(vllm_servers, eagle_head, tmp_path, monkeypatch):
    """serving.engine=vllm: every servable mode is started from the speculative_config serving.json
    would carry (the session's servers stand in for the ones the stage starts, checked block by block);
    the choice and serving.json name vLLM, its version and the CPU."""
    from specdistill.engines.vllm import bench as vllm_bench
    from specdistill.ops.policy import GateVerdict
    from specdistill.ops.serving import read_serving_config, write_serving_config
    from specdistill.pipeline.nightly_recipe import load_nightly_config
    from specdistill.pipeline.outputs import TargetInfo
    from specdistill.pipeline.serving import serving_config
    from specdistill.pipeline.stages.choose_mode import choose_serving
    from specdistill.pipeline.stages.engine_bench import engine_benchmark

    by_block = {repr(None): vllm_servers[TARGET_ONLY], repr(_serving_block(NGRAM_SPEC)): vllm_servers["ngram"],
                repr(_serving_block(f"draft_model:{eagle_head}")): vllm_servers["eagle3"]}

    class Running:  # a started session server in place of a new one with the same speculative config
        def __init__(self, config, env, **_):
            self.server = by_block[repr(config.speculative_config)]
            self.url, self.startup_s = self.server.url, 0.0

        def launch(self):
            return self

        def wait(self):
            return self

        def stop(self):
            pass

    monkeypatch.setattr(vllm_bench, "VllmServer", Running)
    config = load_nightly_config(None, ["serving.engine=vllm", "bench.max_new_tokens=24", "serving.margin=0.0",
                                        "serving.min_prompts=1"])  # the window's one prompt may decide
    window = eval_window(REPEAT)
    drafters = {"ngram": NGRAM_SPEC, "challenger": f"draft_model:{eagle_head}", "generic": "draft_model:/never/measured"}
    speeds = engine_benchmark(config, window, {name: DrafterSpec.parse(s) for name, s in drafters.items()})
    assert set(speeds) == {"ngram", "challenger"}
    for name, spec in (("ngram", NGRAM_SPEC), ("challenger", f"draft_model:{eagle_head}")):
        assert speeds[name].engine == "vllm" and speeds[name].stats["draft_tokens"] > 0
        assert speeds[name].stats["vllm_speculative_config"] == _serving_block(spec)
    decision = choose_serving(config, window, {}, GateVerdict(True), speeds)
    assert decision.engine == "vllm" and set(decision.measured) == {"ngram", "challenger"}
    target = TargetInfo("demo", "/t", "fp", num_layers=30, vocab_size=49152, dtype="bf16")
    written = read_serving_config(write_serving_config(serving_config(decision, target), tmp_path / "serving.json"))
    assert written.engine == "vllm" and "vLLM 0.32.0" in written.measured_on and "cores" in written.measured_on
    if decision.mode != "off":
        assert written.vllm() == speeds[decision.name].stats["vllm_speculative_config"]


def test_legacy_draft_layout_is_refused_with_vllms_error(vllm_servers, legacy_draft):
    """A draft saved before the map moved: vLLM loads draft_vocab.safetensors as weights and refuses;
    the error is vLLM's own (its worker's ValueError), and the server was stopped. This project still reads it."""
    from specdistill.modeling.vocab import DraftVocab

    assert DraftVocab.load(legacy_draft).size == 8192
    err = vllm_servers.refused.get("legacy")
    assert err is not None, "vLLM started a draft with draft_vocab.safetensors beside its weights"
    assert "exited with code" in str(err) and err.cause.startswith("ValueError") and "d2t" in err.cause


def test_nightly_answer_stage_through_vllm(vllm_servers, tmp_path, monkeypatch):
    """`generation.backend=openai`, `generation.engine=vllm`, no URL: the stage asks for a target-only
    vLLM for the window (the session's stands in; what it asked for is checked) and writes answers and a
    teacher cache whose `data` names vLLM and its dtype."""
    import contextlib
    import json
    from pathlib import Path

    from specdistill.distill.teacher import CACHE_META
    from specdistill.engines.vllm import bench as vllm_bench
    from specdistill.pipeline.nightly_recipe import load_nightly_config
    from specdistill.pipeline.stages.answers import stage as answers
    from specdistill.pipeline.stages.ingest import ingest_source
    from specdistill.pipeline.stages.window import select_window

    asked = []

    @contextlib.contextmanager
    def started(target_ref, **kw):
        asked.append((target_ref, kw))
        yield vllm_servers[TARGET_ONLY]

    monkeypatch.setattr(vllm_bench, "target_server", started)
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(json.dumps({"prompt": f"Name a color ({i}).", "response": "ok"}) + "\n" for i in range(30)))
    config = load_nightly_config(None, [
        "target=demo", f"log_db=sqlite:///{tmp_path / 'logs.db'}", f"sources=[{{path: '{traffic}', format: jsonl}}]",
        "window.train_prompts=3", "window.eval_prompts=1", "generation.max_new_tokens=8", "generation.parallel=2",
        "generation.teacher_top_k=8", "generation.backend=openai", "generation.engine=vllm"])
    ingest_source(config.sources[0], config.log_db)
    window = select_window(config)
    train = answers.generate_responses(config, window, "train", record_teacher=True)
    assert asked and asked[0][0] == "demo" and asked[0][1]["parallel"] == 2 and asked[0][1]["top_k"] == 8
    meta = json.loads((Path(train.teacher_cache) / CACHE_META).read_text())
    assert meta["k"] == 8 and meta["data"].endswith(f"vllm:{vllm_servers[TARGET_ONLY].config.dtype}")
    assert train.answers == len(window.train) and train.tokens > 0


_NUMBA_PROBE = """
import numpy as np, torch
from numba import get_num_threads, njit, prange, set_num_threads
@njit(parallel=True)
def total(a):
    s = 0.0
    for i in prange(a.shape[0]):
        s += a[i]
    return s
before = torch.get_num_threads()
original = get_num_threads()  # what vLLM's n-gram proposer saves, sets to 1 around a proposal, restores
set_num_threads(1); total(np.ones(8)); set_num_threads(original)
print(before, torch.get_num_threads())
"""


def test_ngram_proposer_leaves_the_models_openmp_threads_alone(tmp_path):
    """What vLLM's n-gram proposer does with numba around each proposal, in vLLM's own environment as the
    lifecycle sets it (libiomp5 preloaded, the main thread pinned by KMP_AFFINITY as vLLM's worker is):
    the model's OpenMP thread count stays at `threads`. With numba's OpenMP layer it fell to 1."""
    import subprocess

    from specdistill.engines.vllm.install import find_vllm
    from specdistill.engines.vllm.server import VllmConfig, bound_cpus, vllm_environment

    env = find_vllm()
    if env is None or env.device != "cpu" or len(bound_cpus(2)) < 2:
        pytest.skip("needs the vLLM CPU environment (make vllm) and two cores")
    cpus = ",".join(map(str, bound_cpus(2)))
    run_env = vllm_environment(env, VllmConfig(model=tmp_path, threads=2))
    run_env.update(OMP_NUM_THREADS="2", KMP_AFFINITY=f"granularity=fine,explicit,proclist=[{cpus}]")
    probe = subprocess.run([str(env.python), "-c", _NUMBA_PROBE], env=run_env, capture_output=True, text=True,
                           timeout=120)
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.split()[-2:] == ["2", "2"], probe.stdout
    del run_env["NUMBA_THREADING_LAYER"]  # the test can fail: without the setting the count drops
    probe = subprocess.run([str(env.python), "-c", _NUMBA_PROBE], env=run_env, capture_output=True, text=True,
                           timeout=120)
    assert probe.stdout.split()[-2:] == ["2", "1"], probe.stdout
