"""Shared fixtures and builders: tiny random Llama models and BPE tokenizers (milliseconds), tiny target
directories, the demo tokenizer, and the real demo target (cached once).

Test modules import the builders as `from tests.conftest import ...`.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest
import torch

import specdistill  # noqa: F401  (offline environment)

REPO = Path(__file__).resolve().parents[1]
# One model cache for every test session: the demo target is dequantized once (~30 s), then reused.
os.environ.setdefault("SPECDISTILL_MODEL_CACHE", str(REPO / ".specdistill" / "models"))


def make_tiny_llama(vocab_size: int = 96, hidden: int = 32, layers: int = 4, seed: int = 0, tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


def lively(model, seed: int, std: float = 0.4):
    """Random weights large enough that greedy output varies (the default init repeats one token).
    float64 keeps one-token and many-token forwards equal far below any argmax margin."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model.double().eval()


BPE_CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "def add(a, b): return a + b",
    "speculative decoding drafts tokens and the target verifies them",
    "import torch as tt; print(tt.ones(3))",
] * 20


def train_bpe(vocab_size: int, extra_corpus: list[str] = ()):
    """A small real byte-level BPE tokenizer with a chat template (trained in milliseconds, deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(BPE_CORPUS) + list(extra_corpus), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    fast.chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    return fast


def save_tiny_target(path, *, seed: int = 0, layers: int = 4, tie: bool = True, tokenizer=None) -> Path:
    """A tiny target checkpoint directory (weights + tokenizer, a 300-token BPE unless given) at `path`."""
    tok = tokenizer if tokenizer is not None else train_bpe(300)
    make_tiny_llama(vocab_size=len(tok), layers=layers, seed=seed, tie=tie).save_pretrained(path)
    tok.save_pretrained(path)
    return Path(path)



def bench_result(spec: str = "", speedup: float = 1.0, lossless: bool | None = True, **fields):
    """A recorded benchmark entry (`BenchResult`) with plausible defaults for what a test leaves out."""
    from specdistill.data.results import BenchResult

    base = dict(drafter="recorded", gamma=4, max_new_tokens=40, repeats=1, greedy=True,
                lossless_mismatches=0, acceptance_rate=0.3, accepted_length=1.6, per_position_acceptance=[],
                request_acceptance_p10=0.0, request_acceptance_p50=0.0, request_acceptance_p90=0.0,
                tokens_per_second_target_only=21.4, tokens_per_second_speculative=21.4 * speedup, cost_ratio=None,
                ideal_speedup=None)
    return BenchResult.from_dict({**base, "spec": spec, "speedup": speedup, "lossless": lossless, **fields})


def trained_result(draft_dir: str = "/d/draft", **fields) -> dict:
    """A distillation result as `distill.train.distill()` returns it (and writes to result.json)."""
    return {"steps": 2, "tokens": 100, "train_minutes": 0.5, "clock": "wall", "loss": 1.0, "stop": "max_steps",
            "trainable_parameters": 10, "frozen_parameters": 20, "curve": [], "kind": "draft_model", "draft_vocab": None,
            "layers": [0, 3], "draft_dir": draft_dir, **fields}


def eval_window(*questions: str):
    """A night's window whose held-out prompts are these user questions (no train prompts)."""
    from specdistill.data.prompts import Prompt
    from specdistill.pipeline.outputs import Window

    evals = [Prompt(id=str(i), slice="chat", messages=[{"role": "user", "content": q}]) for i, q in enumerate(questions, 1)]
    return Window(train=[], eval=evals, key="eval-window", since=None, replayed=0)


def run_distill_ddp(config_path: Path, out: Path) -> dict:
    """`specdistill distill` on two ranks under torch.distributed.run (one thread each); its result.json."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "specdistill.cli", "distill", "--config", str(config_path), "--json"],
        env=env, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "result.json").read_text())

@pytest.fixture
def tiny_llama():
    return make_tiny_llama()


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from threads, and on a shared machine OpenMP spinning stalls them."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Each test gets its own state directory, and loads its own models (a spy on `load_model` sees every
    load); only the model cache on disk is shared."""
    from specdistill.modeling import models

    monkeypatch.setenv("SPECDISTILL_HOME", str(tmp_path / "home"))
    models._SHARED.clear()
    yield
    models._SHARED.clear()


@pytest.fixture(autouse=True)
def _live_log_streams():
    """Point log handlers left on a closed stream at the live stderr. A handler made while `capsys` held
    sys.stderr (Prefect makes its console handler the first time it sets up logging) keeps that stream
    after the test closes it; Prefect then prints its logging error through its own logger and recurses.
    Which test sets Prefect up first depends on the worker's order of files (pytest-dev/pytest#5743)."""
    loggers = [logging.getLogger(), *(lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger))]
    for handler in (h for lg in loggers for h in lg.handlers):
        if isinstance(handler, logging.StreamHandler) and getattr(handler.stream, "closed", False):
            handler.stream = sys.stderr  # not setStream: it flushes the closed stream first
            if hasattr(handler, "console"):  # Prefect's rich console writes to its own reference
                handler.console.file = sys.stderr
    yield


@pytest.fixture(scope="session")
def demo_tokenizer():
    """The demo target's tokenizer (chat template included); the first use on a machine converts the demo GGUF."""
    from transformers import AutoTokenizer

    from specdistill.modeling.models import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("demo"))


@pytest.fixture(scope="session")
def demo_target():
    from specdistill.modeling.models import load_model

    return load_model("demo", dtype="float32")  # the e2e expectations are exact (fp32)


# --------------------------------------------------------------------------------------------
# log store backends: every store test runs on SQLite and on PostgreSQL


PG_URL_ENV = "SPECDISTILL_TEST_PG_URL"


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path):
    """A fresh, empty log store database URL. PostgreSQL: a schema of its own on the server named by
    $SPECDISTILL_TEST_PG_URL (`make test` starts one); skipped when that is unset."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'logs.db'}"
        return
    base = os.environ.get(PG_URL_ENV)
    if not base:
        pytest.skip(f"{PG_URL_ENV} is not set (make test starts a PostgreSQL server and sets it)")
    import uuid

    import sqlalchemy as sa

    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(base)
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    url = sa.make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
    yield url.render_as_string(hide_password=False)
    with admin.begin() as conn:
        conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
    admin.dispose()


@pytest.fixture(scope="module")
def prefect_harness():
    """A temporary Prefect server for flow tests (slow to start on a busy machine)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


# --------------------------------------------------------------------------------------------
# llama.cpp: the built llama-server (make test builds it first and requires it)

LLAMA_REQUIRED_ENV = "SPECDISTILL_REQUIRE_LLAMA_SERVER"


@pytest.fixture(scope="session")
def llama_cpp():
    """The cached llama-server build; skipped when absent unless $SPECDISTILL_REQUIRE_LLAMA_SERVER is set
    (`make test` builds it, then sets it), where its absence is a failure."""
    from specdistill.engines.llamacpp.build import build_dir, cached

    engine = cached()
    if engine is None:
        message = f"llama-server is not built at {build_dir()} (make llama-server)"
        if os.environ.get(LLAMA_REQUIRED_ENV):
            pytest.fail(message)
        pytest.skip(message)
    return engine


# --------------------------------------------------------------------------------------------
# vLLM: its CPU build in its own venv (make test installs it first and requires it)

VLLM_REQUIRED_ENV = "SPECDISTILL_REQUIRE_VLLM"


@pytest.fixture(scope="session")
def vllm_env():
    """The installed vLLM (`make vllm`, or $SPECDISTILL_VLLM_PYTHON); skipped when absent unless
    $SPECDISTILL_REQUIRE_VLLM is set (`make test` installs it, then sets it), where absence fails."""
    from specdistill.engines.vllm.install import env_dir, find_vllm

    env = find_vllm()
    if env is None:
        message = f"vLLM is not installed at {env_dir()} (make vllm)"
        if os.environ.get(VLLM_REQUIRED_ENV):
            pytest.fail(message)
        pytest.skip(message)
    return env


# --------------------------------------------------------------------------------------------
# speculators: vLLM's head library in its own venv (make test installs it first and requires it)

SPECULATORS_REQUIRED_ENV = "SPECDISTILL_REQUIRE_SPECULATORS"


@pytest.fixture(scope="session")
def speculators_env():
    """The installed speculators (`make speculators`); skipped when absent unless
    $SPECDISTILL_REQUIRE_SPECULATORS is set (`make test` installs it, then sets it), where absence fails."""
    from specdistill.engines.speculators.install import cached, env_dir

    env = cached()
    if env is None:
        message = f"speculators is not installed at {env_dir()} (make speculators)"
        if os.environ.get(SPECULATORS_REQUIRED_ENV):
            pytest.fail(message)
        pytest.skip(message)
    return env
