"""A `vllm serve` process on loopback: the target (an HF directory or the demo's safetensors cache)
with one `--speculative-config` (or none), started on a free port, waited for at `/health`, stopped.

The speculative config is taken as given: callers pass the very block `serving.json` carries, so a
mode vLLM refuses fails here, with vLLM's own error and the last lines of its log, not in a user's
deployment. What vLLM's CPU build needs is set here, from its source (`vllm/envs.py`,
`vllm/platforms/cpu.py`, `vllm/utils/ompmultiprocessing.py`):
- `VLLM_TARGET_DEVICE=cpu`: the CPU platform, whatever the distribution's version string says;
- `--kv-cache-memory-bytes` (`kv_cache_gib`, 1 by default; vLLM reserves 4, more than a small target needs, and
  the CPU build holds all of it resident: 0.75 GiB a server less at 0.25); its legacy `VLLM_CPU_KVCACHE_SPACE`
  (whole GiB only) overrides the flag, so it is removed from the server's environment;
- `VLLM_CPU_OMP_THREADS_BIND`: the cores the OpenMP threads are pinned to. vLLM's `auto` keeps one
  core of each NUMA node for its scheduler, i.e. one thread on a 2-core machine; we bind `threads`
  cores of this process's affinity, as llama-server's `-t`;
- `LD_PRELOAD` of the wheel's `libiomp5.so` (vLLM then binds with KMP_AFFINITY; else it preloads
  torch's libgomp itself), and the soft open-file limit raised to the hard one (one fd per socket);
- `NUMBA_THREADING_LAYER=workqueue`: vLLM's n-gram proposer sets numba's thread count around each
  proposal, and numba's default (OpenMP) layer does that with `omp_set_num_threads` in the very
  libiomp5 the model runs in; numba reads its count from the worker's affinity after KMP_AFFINITY has
  pinned the main thread to one core, so it "restores" 1 and every later forward of an n-gram server
  ran on one OpenMP thread while target-only ran on `threads` (on a loaded 2-core machine the one
  thread was 3-6x faster, which read as an impossible n-gram speedup). With its own thread pool numba
  leaves the model's threads alone;
- `--enforce-eager`: vLLM's compiled graphs took 165-228 s to start on a 2-core CPU and their cache
  never reloaded there; eager starts in about a minute.
A GPU machine's own vLLM (`$SPECDISTILL_VLLM_PYTHON`) gets none of the CPU variables.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specdistill.engines.llamacpp.server import LOOPBACK, EngineProcess, ServerError, die_with_parent
from specdistill.engines.vllm.install import VllmEnv, find_vllm
from specdistill.hardware import usable_cpus

SERVED_NAME = "target"  # the model name requests carry


class VllmStartError(ServerError):
    """vLLM did not come up: `cause` is vLLM's own error line (a refused speculative config, say)."""

    def __init__(self, message: str, cause: str = "", log_tail: str = ""):
        super().__init__(message)
        self.cause = cause
        self.log_tail = log_tail


@dataclass
class VllmConfig:
    model: Path  # the target's HF directory
    speculative_config: dict | None = None  # vLLM's --speculative-config, as serving.json carries it
    threads: int = 2
    dtype: str = "auto"  # vLLM's --dtype: auto (the checkpoint's), float32, bfloat16
    max_model_len: int = 2048
    max_num_seqs: int = 8  # requests decoded together
    max_logprobs: int = 32  # the teacher's top-k must fit under it
    kv_cache_gib: float = 1.0  # the CPU build's KV cache (resident from the start)
    host: str = LOOPBACK
    port: int = 0  # 0: a free port is picked
    seed: int = 0
    name: str = field(default="", compare=False)  # for messages (the mode's name)


def vllm_args(config: VllmConfig, port: int, cpu: bool = False) -> list[str]:
    """`vllm serve`'s arguments: eager, greedy-friendly (no generation_config.json defaults), logprobs
    within `max_logprobs`, the speculative config as JSON."""
    args = ["serve", str(config.model), "--host", config.host, "--port", str(port), "--served-model-name", SERVED_NAME,
            "--enforce-eager", "--dtype", config.dtype, "--max-model-len", str(config.max_model_len),
            "--max-num-seqs", str(config.max_num_seqs), "--max-logprobs", str(config.max_logprobs),
            "--seed", str(config.seed), "--generation-config", "vllm"]
    if cpu:  # a GPU sizes its cache from --gpu-memory-utilization
        args += ["--kv-cache-memory-bytes", str(int(config.kv_cache_gib * 2**30))]
    if config.speculative_config:
        args += ["--speculative-config", json.dumps(config.speculative_config, sort_keys=True)]
    return args


def bound_cpus(threads: int) -> list[int]:
    """The first `threads` cores this process may run on (its affinity), for vLLM's OpenMP threads."""
    allowed = usable_cpus()
    return allowed[: max(1, min(threads, len(allowed)))]


def vllm_environment(env: VllmEnv, config: VllmConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    """Offline, no usage reports, and on the CPU build the variables of the module's docstring."""
    out = dict(os.environ if base is None else base)
    out.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "PYTHONUNBUFFERED": "1"})
    out.pop("PYTHONPATH", None)  # the project's packages must not shadow vLLM's pins
    if env.device == "cpu":
        out["VLLM_TARGET_DEVICE"] = "cpu"
        out.pop("VLLM_CPU_KVCACHE_SPACE", None)  # would override --kv-cache-memory-bytes
        out["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, bound_cpus(config.threads)))
        out["NUMBA_THREADING_LAYER"] = "workqueue"  # never the model's OpenMP runtime (see the module's docstring)
        iomp = env.libiomp5()
        preload = [p for p in out.get("LD_PRELOAD", "").split(":") if p and "libgomp" not in p]
        if iomp is not None and not any("libiomp" in p for p in preload):
            preload.append(str(iomp))  # vLLM asserts one OpenMP runtime: never iomp and gomp both
        if preload:
            out["LD_PRELOAD"] = ":".join(preload)
    return out


def _child_setup() -> None:
    """In `vllm serve`'s process before exec: one fd per socket, and stop with the command (a test worker
    killed for memory left three servers of 3.5 GiB each running)."""
    _raise_fd_limit()
    die_with_parent()


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65535) if hard != resource.RLIM_INFINITY else 65535, hard))


_PREFIX = re.compile(r"^(?:\(\w+ pid=\d+\)\s*)?(?:(?:ERROR|WARNING|INFO) [\d-]+ [\d:]+ \[[^\]]+\]\s*)?")
_EXCEPTION = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception)): .+")
_POINTERS = ("root cause", "See stack trace")  # vLLM's wrappers that point back at the real error


def vllm_error(log: str) -> str:
    """vLLM's own reason from its log: the last exception raised (`ValueError: ...` from the worker),
    past the wrappers that only point back at it; else the last ERROR line."""
    messages = [_PREFIX.sub("", line.strip()) for line in log.splitlines() if line.strip()]
    raised = [m for m in messages if _EXCEPTION.match(m)]
    real = [m for m in raised if not any(p in m for p in _POINTERS)]
    if real or raised:
        return (real or raised)[-1]
    errors = [line.strip() for line in log.splitlines() if " ERROR " in f" {line} "]
    return errors[-1] if errors else ""


class VllmServer(EngineProcess):
    """A running `vllm serve`; use as a context manager (`with VllmServer(config) as s: s.url`)."""

    def __init__(self, config: VllmConfig, env: VllmEnv | None = None, *, startup_timeout_s: float = 600.0):
        self.config = config
        self.env = env
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None
        self.port = 0
        self.log_path: Path | None = None
        self.startup_s: float | None = None
        self._t0 = 0.0

    @property
    def what(self) -> str:
        mode = self.config.name or (self.config.speculative_config or {}).get("method", "target-only")
        return f"vLLM ({mode})"

    def command(self) -> list[str]:
        return self.env.command(*vllm_args(self.config, self.port, cpu=self.env.device == "cpu"))

    def start(self) -> VllmServer:
        """Launch and wait until healthy (or raise, the process stopped)."""
        self.launch()
        return self.wait()

    def launch(self) -> VllmServer:
        """Start the process and return at once: `wait()` for it (several servers load side by side)."""
        self.env = self.env or find_vllm()
        if self.env is None:
            raise VllmStartError("vLLM is not installed: run `make vllm` (its own environment, cached outside the "
                                 "repository) or point SPECDISTILL_VLLM_PYTHON at a Python that has vLLM")
        model = Path(self.config.model)
        if not (model / "config.json").is_file():
            raise VllmStartError(f"vLLM serves a target from an HF directory with config.json; {model} has none")
        draft = (self.config.speculative_config or {}).get("model")
        if draft and not (Path(draft) / "config.json").is_file():
            raise VllmStartError(f"the speculative config's draft {draft} is not an HF directory (no config.json)")
        self.port = self._pick_port(VllmStartError)
        fd, log = tempfile.mkstemp(prefix=f"vllm-{self.port}-", suffix=".log")
        self.log_path = Path(log)
        self._t0 = time.monotonic()
        with os.fdopen(fd, "w") as out:
            out.write(f"$ {' '.join(self.command())}\n")
            out.flush()
            # its own process group: vLLM forks an engine-core process that must stop with it
            self.process = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=vllm_environment(self.env, self.config), start_new_session=True,
                                            preexec_fn=_child_setup)
        return self

    def wait(self) -> VllmServer:
        """Until `/health` answers; on failure the process is stopped and the error names vLLM's reason."""
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - self._t0
        return self

    def _fail(self, message: str) -> VllmStartError:
        tail = self.log_tail(25)
        cause = vllm_error(self.log_tail(400))
        cause = cause if len(cause) <= 400 else cause[:400] + " …"
        if "address already in use" in tail.lower():
            cause = cause or f"port {self.port} is in use"
        return VllmStartError(f"{message}{': ' + cause if cause else ''}; log {self.log_path}:\n{tail}", cause, tail)

    def _wait_healthy(self) -> None:
        deadline = self._t0 + self.startup_timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise self._fail(f"{self.what} exited with code {code} before it was ready")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # refused before it listens
            time.sleep(0.5)
        raise self._fail(f"{self.what} did not become healthy within {self.startup_timeout_s:.0f} s at {self.url}")

    def stop(self) -> None:
        """SIGTERM to the API server (it shuts its engine core down), SIGKILL to its process group after 20 s."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):  # stragglers of the group (the engine core outliving its parent)
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process = None

    def __enter__(self) -> VllmServer:
        return self.wait() if self.process is not None else self.start()


def start_together(servers: list[VllmServer]) -> dict[int, VllmStartError]:
    """Launch every server, then wait for each: start-ups overlap (model loading is mostly waiting on
    one core). Returns the errors by index; the servers that failed are stopped, the others run."""
    errors: dict[int, VllmStartError] = {}
    for i, server in enumerate(servers):
        try:
            server.launch()
        except VllmStartError as exc:
            errors[i] = exc
    for i, server in enumerate(servers):
        if i in errors:
            continue
        try:
            server.wait()
        except VllmStartError as exc:
            errors[i] = exc
        except BaseException:
            for other in servers:
                other.stop()
            raise
    return errors
