"""vLLM's lifecycle without a real vLLM: `vllm serve`'s command line and the CPU environment it is
given (from vLLM's own source), the errors (not installed, port in use, a server that exits with
vLLM's refusal, one that never becomes healthy), and the refused-mode path of the serving choice."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from specdistill.engines.vllm.install import LAUNCHER_SOURCE, VllmEnv
from specdistill.engines.vllm.server import (
    VllmConfig,
    VllmServer,
    VllmStartError,
    bound_cpus,
    vllm_args,
    vllm_environment,
    vllm_error,
)
from tests.conftest import eval_window

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _target(tmp_path) -> Path:
    (tmp_path / "t").mkdir(exist_ok=True)
    (tmp_path / "t" / "config.json").write_text("{}")
    return tmp_path / "t"


def _env(tmp_path, body: str, device: str = "cpu") -> VllmEnv:
    """A fake vLLM: `sh` running a script in place of the launcher."""
    prefix = tmp_path / "venv"
    (prefix / "bin").mkdir(parents=True, exist_ok=True)
    (prefix / "lib").mkdir(exist_ok=True)
    (prefix / "lib" / "libiomp5.so").write_bytes(b"")
    if not (prefix / "bin" / "python").exists():
        (prefix / "bin" / "python").symlink_to("/bin/sh")
    launcher = tmp_path / "fake-vllm.sh"
    launcher.write_text(body + "\n")
    return VllmEnv(prefix / "bin" / "python", "0.32.0", device, launcher)


def test_serve_args_carry_the_speculative_config_as_given(tmp_path):
    args = vllm_args(VllmConfig(model=tmp_path, speculative_config=NGRAM, dtype="bfloat16"), 8123)
    assert args[:2] == ["serve", str(tmp_path)] and "--enforce-eager" in args
    assert args[args.index("--port") + 1] == "8123" and args[args.index("--host") + 1] == "127.0.0.1"
    assert json.loads(args[args.index("--speculative-config") + 1]) == NGRAM
    assert args[args.index("--dtype") + 1] == "bfloat16" and args[args.index("--generation-config") + 1] == "vllm"
    assert "--speculative-config" not in vllm_args(VllmConfig(model=tmp_path), 8123)
    # the CPU build's KV cache by the flag, in bytes (a quarter GiB is allowed); a GPU sizes its own
    cpu = vllm_args(VllmConfig(model=tmp_path, kv_cache_gib=0.25), 8123, cpu=True)
    assert cpu[cpu.index("--kv-cache-memory-bytes") + 1] == str(2**28)
    assert "--kv-cache-memory-bytes" not in vllm_args(VllmConfig(model=tmp_path), 8123)


def test_cpu_environment_follows_vllms_cpu_backend(tmp_path):
    env = _env(tmp_path, "exit 0")
    out = vllm_environment(env, VllmConfig(model=tmp_path, threads=2, kv_cache_gib=3),
                           {"LD_PRELOAD": "/x/libgomp.so.1:/y/libfoo.so", "PYTHONPATH": "/repo", "VLLM_CPU_KVCACHE_SPACE": "4"})
    # vLLM's legacy whole-GiB variable would override --kv-cache-memory-bytes: a user's is not passed on
    assert out["VLLM_TARGET_DEVICE"] == "cpu" and "VLLM_CPU_KVCACHE_SPACE" not in out
    assert out["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, bound_cpus(2)))
    # numba (the n-gram proposer) on its own thread pool, never the model's OpenMP runtime
    assert out["NUMBA_THREADING_LAYER"] == "workqueue"
    # one OpenMP runtime (vLLM asserts it): libiomp5 preloaded, libgomp dropped, other preloads kept
    assert out["LD_PRELOAD"] == f"/y/libfoo.so:{env.prefix / 'lib' / 'libiomp5.so'}"
    assert "PYTHONPATH" not in out and out["HF_HUB_OFFLINE"] == "1" and out["VLLM_NO_USAGE_STATS"] == "1"
    gpu = vllm_environment(_env(tmp_path, "exit 0", device="auto"), VllmConfig(model=tmp_path), {})
    assert not any(k.startswith("VLLM_CPU") for k in gpu) and "VLLM_TARGET_DEVICE" not in gpu
    assert "NUMBA_THREADING_LAYER" not in gpu


def test_bound_cpus_stay_within_the_affinity():
    cpus = bound_cpus(64)
    assert cpus and len(cpus) <= 64 and len(bound_cpus(1)) == 1


def test_vllms_own_error_is_found_in_its_log():
    log = ("(APIServer pid=1) WARNING 12-01 13:01:03 [system_utils.py:255] Found ulimit of 20000: `OSError: [Errno 24]`\n"
           "(Worker pid=3) ERROR 12-01 13:02:31 [multiproc_executor.py:953]     raise ValueError(msg)\n"
           "(Worker pid=3) ERROR 12-01 13:02:31 [multiproc_executor.py:953] ValueError: There is no module or parameter "
           "named 'd2t' in LlamaForCausalLM\n"
           "(EngineCore pid=2) ERROR 12-01 13:02:37 [core.py:1510] Exception: WorkerProc initialization failed due to an "
           "exception in a background process. See stack trace for root cause.\n"
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert vllm_error(log) == "ValueError: There is no module or parameter named 'd2t' in LlamaForCausalLM"
    assert vllm_error("RuntimeError: Engine core initialization failed. See root cause above.\n").startswith("RuntimeError")
    assert vllm_error("(APIServer pid=1) INFO 12-01 13:01:03 [x.py:1] fine\n") == ""


def test_launcher_answers_the_cpu_version(tmp_path):
    """The launcher's version answer is the one vLLM's platform check reads as its CPU build."""
    namespace = {"__name__": "launcher"}
    exec(compile(LAUNCHER_SOURCE, "launch_vllm.py", "exec"), namespace)
    version = namespace["_metadata"].version
    try:
        assert version("pytest") == namespace["_version"]("pytest")  # other distributions untouched
    finally:
        namespace["_metadata"].version = namespace["_version"]


def test_not_installed_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr("specdistill.engines.vllm.server.find_vllm", lambda: None)
    with pytest.raises(VllmStartError, match="make vllm"):
        VllmServer(VllmConfig(model=_target(tmp_path))).start()


def test_target_without_config_is_named(tmp_path):
    with pytest.raises(VllmStartError, match="no config.json|has none"):
        VllmServer(VllmConfig(model=tmp_path / "nowhere"), _env(tmp_path, "exit 0")).start()


def test_port_in_use_is_named(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = VllmServer(VllmConfig(model=_target(tmp_path), port=port), _env(tmp_path, "exit 0"))
        with pytest.raises(VllmStartError, match=f"port {port} on 127.0.0.1 is in use"):
            server.start()


def test_refused_mode_carries_vllms_error_and_log(tmp_path):
    env = _env(tmp_path, 'echo "(EngineCore pid=7) ValueError: There is no module or parameter named \'d2t\'"; exit 1')
    server = VllmServer(VllmConfig(model=_target(tmp_path), speculative_config=NGRAM, name="draft"), env)
    with pytest.raises(VllmStartError, match=r"vLLM \(draft\) exited with code 1 before it was ready: ValueError") as err:
        server.start()
    assert err.value.cause.startswith("ValueError: There is no module or parameter named 'd2t'")
    assert "d2t" in err.value.log_tail and server.process is None


def test_server_that_never_becomes_healthy_is_stopped(tmp_path):
    server = VllmServer(VllmConfig(model=_target(tmp_path)), _env(tmp_path, "exec sleep 30"), startup_timeout_s=1)
    with pytest.raises(VllmStartError, match="did not become healthy within 1 s"):
        server.start()
    assert server.process is None


def test_a_server_stops_when_the_command_that_started_it_is_killed(tmp_path):
    """A nightly or a test worker killed for memory (SIGKILL, no teardown) must not leave its vLLM running."""
    import subprocess
    import sys
    import time

    env = _env(tmp_path, "exec sleep 60")
    code = ("import os, signal, sys\nfrom pathlib import Path\n"
            "from specdistill.engines.vllm.install import VllmEnv\n"
            "from specdistill.engines.vllm.server import VllmConfig, VllmServer\n"
            "env = VllmEnv(Path(sys.argv[1]), '0.32.0', 'cpu', Path(sys.argv[2]))\n"
            "server = VllmServer(VllmConfig(model=Path(sys.argv[3])), env).launch()\n"
            "print(server.process.pid, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    done = subprocess.run([sys.executable, "-c", code, str(env.python), str(env.launcher), str(_target(tmp_path))],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == -9, done.stderr
    pid = int(done.stdout.split()[0])

    def running() -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while running() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running()


def test_serving_choice_skips_a_mode_vllm_refused():
    from specdistill.ops.policy import GateVerdict
    from specdistill.pipeline.nightly_recipe import load_nightly_config
    from specdistill.pipeline.stages.choose_mode import choose_serving
    from specdistill.pipeline.stages.engine_bench import refused_entry
    from specdistill.speculative.harness_bench import BenchResult
    from specdistill.speculative.specs import DrafterSpec

    config = load_nightly_config(None, ["serving.engine=vllm", "serving.margin=0.0"])
    ok = BenchResult(drafter="ngram", gamma=4, max_new_tokens=8, repeats=1, greedy=True, lossless=True,
                     lossless_mismatches=0, acceptance_rate=0.5, accepted_length=2.0, per_position_acceptance=[0.5],
                     request_acceptance_p10=0.0, request_acceptance_p50=0.0, request_acceptance_p90=0.0,
                     tokens_per_second_target_only=10.0, tokens_per_second_speculative=12.0, speedup=1.2,
                     cost_ratio=None, ideal_speedup=None, stats={"vllm_version": "0.32.0"}, dtype="bfloat16", engine="vllm",
                     spec="ngram")
    speeds = {"ngram": ok,
              "challenger": refused_entry("challenger", DrafterSpec("draft_model", "/d"), "ValueError: no d2t", 4, "bfloat16")}
    decision = choose_serving(config, eval_window(), {}, GateVerdict(True), speeds)
    assert decision.mode == "ngram" and decision.measured == {"ngram": 1.2}
    assert "vLLM refused: challenger (ValueError: no d2t)" in decision.reason
    assert "vLLM 0.32.0" in decision.measured_on and decision.engine == "vllm"


def test_live_sample_carries_per_position_acceptance():
    from specdistill.acceptance import DraftCounts
    from specdistill.engines.client import Scrape
    from specdistill.ops.metrics import acceptance_between

    first = Scrape(DraftCounts(10, 40, 20, [8, 6, 4, 2]))
    second = Scrape(DraftCounts(20, 80, 35, [16, 11, 6, 2]))
    sample = acceptance_between(first, second)
    assert sample.ok and sample.per_position_acceptance == pytest.approx([0.8, 0.5, 0.2, 0.0])
    assert sum(sample.per_position_acceptance) == pytest.approx(sample.mean_accepted_length - 1)


def test_vllm_answers_need_no_gguf_target(tmp_path):
    from specdistill.pipeline.nightly_recipe import load_nightly_config
    from specdistill.recipe import ConfigError

    ok = load_nightly_config(None, [f"target={tmp_path}", "generation.backend=openai", "generation.engine=vllm"])
    assert ok.generation.engine == "vllm" and ok.generation.url is None
    with pytest.raises((ConfigError, ValueError), match="llama-server"):
        load_nightly_config(None, [f"target={tmp_path}", "generation.backend=openai"])
