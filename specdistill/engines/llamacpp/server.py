"""A `llama-server` process on loopback: the command line for one speculative mode, start (on a free
port, waiting for `/health`), stop.

The same `server_args` feed both the benchmark and `serving.json`, so the command a user copies is the
one that was measured.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

LOOPBACK = "127.0.0.1"
SPEC_TYPES = ("none", "draft-simple", "draft-eagle3", "ngram-simple")


class ServerError(RuntimeError):
    """llama-server did not come up (or the port was taken): the message says which and shows its log."""


@dataclass(frozen=True)
class ServerMode:
    """One speculative mode of llama-server: target-only (`none`), a draft GGUF, or n-gram lookup."""

    spec_type: str = "none"
    draft: Path | None = None  # the draft GGUF for draft-simple / draft-eagle3
    draft_n_max: int = 4  # K, tokens drafted per round
    ngram_n: int | None = None  # ngram-simple: the lookup n-gram's length (None: llama.cpp's default, 12)

    def __post_init__(self):
        if self.spec_type not in SPEC_TYPES:
            raise ValueError(f"spec_type {self.spec_type!r}: expected one of {', '.join(SPEC_TYPES)}")
        if self.spec_type.startswith("draft") and self.draft is None:
            raise ValueError(f"spec_type {self.spec_type} needs a draft GGUF")

    @property
    def name(self) -> str:
        if self.spec_type == "none":
            return "target-only"
        if self.spec_type == "ngram-simple":
            return f"ngram-simple(K={self.draft_n_max}" + (f", n={self.ngram_n})" if self.ngram_n else ")")
        return f"{self.spec_type}:{Path(self.draft).stem}(K={self.draft_n_max})"

    def args(self) -> list[str]:
        """The flags that select this mode (the part of the command line `serving.json` records)."""
        if self.spec_type == "none":
            return []
        out = ["--spec-type", self.spec_type, "--spec-draft-n-max", str(self.draft_n_max)]
        if self.spec_type == "ngram-simple":  # its draft length is its m-gram (default 48), not n-max
            out += ["--spec-ngram-simple-size-m", str(self.draft_n_max)]
            if self.ngram_n:
                out += ["--spec-ngram-simple-size-n", str(self.ngram_n)]
        if self.draft is not None:
            out = ["-md", str(self.draft), *out]
        return out


@dataclass
class ServerConfig:
    model: Path  # the target GGUF
    mode: ServerMode = field(default_factory=ServerMode)
    threads: int = 2
    # llama.cpp's `--poll` (0-100, its default 50): how hard its idle threads spin for work; beside a busy core
    # a spinning thread holds a core the other thread's barrier waits for. None: llama.cpp's default
    poll: int | None = None
    ctx_size: int = 2048
    parallel: int = 1  # slots: 1 for timing, more for batched answer generation
    host: str = LOOPBACK
    port: int = 0  # 0: a free port is picked


def server_args(config: ServerConfig, port: int) -> list[str]:
    """llama-server's arguments (binary excluded): greedy-friendly defaults, metrics on, no web UI."""
    args = ["-m", str(config.model), "--host", config.host, "--port", str(port),
            "-t", str(config.threads), "-tb", str(config.threads), "-c", str(config.ctx_size),
            "-np", str(config.parallel), "--metrics", "--no-webui", *config.mode.args()]
    if config.mode.spec_type.startswith("draft"):
        args += ["-td", str(config.threads)]
    if config.poll is not None:
        args += ["--poll", str(config.poll), "--poll-batch", str(int(config.poll > 0))]
    return args


def exit_words(code: int) -> str:
    """How a process ended, in words: a crash names its signal and what to try."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    hint = ""
    if name in ("SIGSEGV", "SIGILL", "SIGBUS"):
        hint = (" (a binary built for another CPU, or a native build this CPU cannot run: rebuild it with "
                "`make llama-server`, or SPECDISTILL_LLAMA_CPP_ISA=native-noamx to build without AMX)")
    return f"crashed with {name}{hint}"


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def log_tail(path: Path | None, lines: int) -> str:
    if path is None or not path.is_file():
        return ""
    return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])


_HANDED_OUT: set[int] = set()  # ports given to servers of this process


PR_SET_PDEATHSIG = 1  # prctl(2)


def die_with_parent() -> None:
    """A server child's `preexec_fn`: SIGTERM when the process that started it dies, even by SIGKILL or the
    OOM killer, so no server outlives its command holding gigabytes (Linux; elsewhere nothing). The signal
    follows the *thread* that started the child: start servers from a thread that outlives them."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class EngineProcess:
    """What a llama-server and a `vllm serve` share: the port they get (`config.port`), their URL and log,
    and `with` stopping them."""

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self.log_path, lines)

    def _pick_port(self, error: type[ServerError]) -> int:
        if self.config.port:
            if port_in_use(self.config.port, self.config.host):
                raise error(f"port {self.config.port} on {self.config.host} is in use: pick another or pass port 0")
            return self.config.port
        port = free_port(self.config.host)
        while port in _HANDED_OUT:  # servers launched together have not bound theirs yet: never one port twice
            port = free_port(self.config.host)
        _HANDED_OUT.add(port)
        return port

    def __exit__(self, *exc) -> None:
        self.stop()


class LlamaServer(EngineProcess):
    """A running llama-server; use as a context manager (`with LlamaServer(bin, config) as s: s.url`)."""

    def __init__(self, binary: str | os.PathLike, config: ServerConfig, *, startup_timeout_s: float = 120.0):
        self.binary = Path(binary)
        self.config = config
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None
        self.port = 0
        self.log_path: Path | None = None

    @property
    def command(self) -> list[str]:
        return [str(self.binary), *server_args(self.config, self.port)]

    def start(self) -> LlamaServer:
        if not self.binary.is_file():
            raise ServerError(f"no llama-server binary at {self.binary} (build it: make llama-server)")
        for path, what in ((self.config.model, "target GGUF"), (self.config.mode.draft, "draft GGUF")):
            if path is not None and not Path(path).is_file():
                raise ServerError(f"{what} not found: {path}")
        self.port = self._pick_port(ServerError)
        fd, log = tempfile.mkstemp(prefix=f"llama-server-{self.port}-", suffix=".log")
        self.log_path = Path(log)
        with os.fdopen(fd, "w") as out:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self._wait_healthy()
            self._check_speculation()
        except BaseException:
            self.stop()
            raise
        return self

    def _check_speculation(self) -> None:
        """llama-server that cannot pair a draft with the target logs it and serves target-only anyway;
        a benchmark of that would measure the wrong mode, so it is an error here."""
        if self.config.mode.spec_type == "none":
            return
        log = self.log_tail(400)
        if "failed to initialize speculative decoding" in log or "failed to load draft model" in log:
            why = [line for line in log.splitlines() if "compatible" in line or "failed" in line]
            vocab = " as vocabulary-incompatible" if any("vocab" in line for line in why) else ""
            raise ServerError(f"llama-server refused the {self.config.mode.spec_type} draft "
                              f"{self.config.mode.draft or ''}{vocab}: " + " | ".join(why[-4:]))

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                hint = ""
                if "bind" in self.log_tail(40).lower() or "address already in use" in self.log_tail(40).lower():
                    hint = f" (port {self.port} is in use)"
                raise ServerError(f"llama-server {exit_words(code)} before it was ready{hint}; "
                                  f"log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # 503 while loading, refused before listening
            time.sleep(0.2)
        raise ServerError(f"llama-server did not become healthy within {self.startup_timeout_s:.0f} s at {self.url}; "
                          f"log {self.log_path}:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def __enter__(self) -> LlamaServer:
        return self.start()
