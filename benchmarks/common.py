"""What several benchmarks do alike: copy a state before running commands in it, keep cores busy beside a
measurement, answer prompts with the target as the nightly does, and log progress.

A script in benchmarks/ imports it as `common` (Python puts a script's own folder first on its path);
one under benchmarks/experiments/ as `benchmarks.common`. Importing it loads no torch: the scripts that
run the CLI in subprocesses (drift_scenario, monitor_load) keep their own process light.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

BUSY_LOOP = "while True: pass"  # one core kept busy by a pure-Python loop, as other CPU-bound work would


def log(msg: str) -> None:
    """Progress, timestamped, on stderr: stdout keeps the tables."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def copy_state(state: Path, home: Path) -> Path:
    """A copy of a state directory (SPECDISTILL_HOME) at `home`, the paths it records under itself moved with it."""
    shutil.copytree(state, home, symlinks=True)
    targets = home / "targets.json"
    if targets.is_file():
        targets.write_text(targets.read_text().replace(str(state.resolve()), str(home)))
    return home


@contextmanager
def busy_loops(n: int, nice: int = 0) -> Iterator[list[subprocess.Popen]]:
    """`n` busy loops at niceness `nice` for the block, killed on the way out: the other jobs of a shared machine."""
    prefix = ["nice", "-n", str(nice)] if nice else []
    loops = [subprocess.Popen([*prefix, sys.executable, "-c", BUSY_LOOP]) for _ in range(n)]
    try:
        yield loops
    finally:
        for p in loops:
            p.kill()


def answer_caches(directory: Path, target, k: int = 32) -> tuple:
    """The top-k teacher and EAGLE-3 feature caches of an answer directory, as the nightly's answer stage writes them."""
    from specdistill.distill.distill_recipe import Eagle3Config  # lazy: keeps torch off the scripts that drive the CLI
    from specdistill.distill.features import FeatureCache  # lazy: keeps torch off the scripts that drive the CLI
    from specdistill.distill.teacher import TeacherCache  # lazy: keeps torch off the scripts that drive the CLI
    from specdistill.modeling.eagle3 import default_aux_layers  # lazy: keeps torch off the scripts that drive the CLI

    teacher = TeacherCache.create(directory / "teacher_cache", fingerprint=target.fingerprint, k=k, temperature=1.0,
                                  vocab="full", data=directory.name)
    features = FeatureCache.create(directory / "features", fingerprint=target.fingerprint,
                                   layers=default_aux_layers(target.model.config.num_hidden_layers),
                                   data=directory.name, prompt_context=Eagle3Config().prompt_context)
    return teacher, features


def answer(work: Path, target, name: str, prompts: list[dict], *, batch_size: int, max_new_tokens: int,
           record: bool = True) -> tuple[dict, float]:
    """The target's greedy answers in work/name (with teacher and features when `record`), resumable; (records, seconds)."""
    from specdistill.data.prompts import Prompt  # lazy: keeps torch off the scripts that drive the CLI
    from specdistill.pipeline.stages.answers.harness import generate_answers  # lazy: keeps torch off the scripts that drive the CLI

    directory = work / name
    directory.mkdir(parents=True, exist_ok=True)
    teacher, features = answer_caches(directory, target) if record else (None, None)
    t0 = time.time()
    done = generate_answers(target.model, target.tokenizer, [Prompt(id=p["id"], messages=p["prompt"]) for p in prompts],
                            directory / "train_generated.jsonl", batch_size=batch_size, max_new_tokens=max_new_tokens,
                            teacher_cache=teacher, feature_cache=features)
    return done, time.time() - t0
