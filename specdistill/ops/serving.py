"""The serving config: what the pipeline tells vLLM or SGLang to run.

A small JSON file, replaced atomically (write, fsync, rename) so a serving system never reads half a
config. It names the mode and the draft, and carries the exact vLLM `speculative_config` and the
SGLang flags for that mode.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdistill import paths

MODES = ("draft", "ngram", "self_speculation", "off")
DRAFT_KINDS = ("layers", "eagle3")  # a plain HF draft checkpoint, or an EAGLE-3 head over the target's features
SERVING_FILE = "serving.json"


@dataclass
class ServingConfig:
    mode: str
    num_speculative_tokens: int = 4
    draft_dir: str | None = None  # draft mode, and self-speculation exported as an early-exit draft
    draft_version: str | None = None
    draft_kind: str = "layers"  # draft mode: layers (vLLM draft_model, SGLang STANDALONE) or eagle3 (EAGLE3)
    target_fingerprint: str | None = None
    exit_layer: int | None = None  # self-speculation
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    reason: str = ""
    measured: dict[str, float] = field(default_factory=dict)  # every mode's measured speedup, same prompts
    measured_on: str = ""  # engine and dtype the speedups were measured with, e.g. "harness bf16"
    engine: str = "harness"  # harness | llamacpp | openai: where `measured` comes from
    llamacpp_args: list[str] = field(default_factory=list)  # llama-server flags of this mode, as measured
    # an EAGLE-3 head's first-position candidates, verified as a tree (SGLang's --speculative-eagle-topk);
    # vLLM's eagle3 method and llama.cpp verify a chain (width 1)
    tree_width: int = 1
    updated_at: float = field(default_factory=time.time)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"serving mode {self.mode!r} is not one of {MODES}")
        if self.mode in ("draft", "self_speculation") and not self.draft_dir:
            raise ValueError(f"serving mode {self.mode!r} needs a draft directory")
        if self.draft_kind not in DRAFT_KINDS:
            raise ValueError(f"draft kind {self.draft_kind!r} is not one of {DRAFT_KINDS}")
        if self.draft_kind == "eagle3" and self.mode != "draft":
            raise ValueError(f"an EAGLE-3 head is served in draft mode, not {self.mode!r}")
        if self.mode != "off" and self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if self.tree_width < 1 or (self.tree_width > 1 and self.draft_kind != "eagle3"):
            raise ValueError(f"tree_width {self.tree_width}: a tree of first-position candidates needs an EAGLE-3 head")

    def vllm(self) -> dict | None:
        """vLLM's `--speculative-config` (None: serve without speculation)."""
        k = self.num_speculative_tokens
        if self.draft_kind == "eagle3":
            return {"method": "eagle3", "model": self.draft_dir, "num_speculative_tokens": k}
        if self.mode in ("draft", "self_speculation"):
            return {"method": "draft_model", "model": self.draft_dir, "num_speculative_tokens": k}
        if self.mode == "ngram":
            return {
                "method": "ngram",
                "prompt_lookup_min": self.prompt_lookup_min,
                "prompt_lookup_max": self.prompt_lookup_max,
                "num_speculative_tokens": k,
            }
        return None

    def sglang(self) -> list[str]:
        """SGLang `launch_server` flags (empty: serve without speculation)."""
        k = self.num_speculative_tokens
        if self.mode in ("draft", "self_speculation"):
            # k draft steps; with a tree the head's top `tree_width` per step, of which the best
            # k + tree_width - 1 nodes (our engine's tree size) are verified with the pending token
            w = self.tree_width
            return [
                "--speculative-algorithm", "EAGLE3" if self.draft_kind == "eagle3" else "STANDALONE",
                "--speculative-draft-model-path", str(self.draft_dir),
                "--speculative-num-steps", str(k),
                "--speculative-eagle-topk", str(w),
                "--speculative-num-draft-tokens", str(k + w),
            ]
        if self.mode == "ngram":
            return [
                "--speculative-algorithm", "NGRAM",
                "--speculative-num-draft-tokens", str(k),
                "--speculative-ngram-min-match-window-size", str(self.prompt_lookup_min),
                "--speculative-ngram-max-match-window-size", str(self.prompt_lookup_max),
            ]
        return []

    def llamacpp(self) -> dict | None:
        """llama-server's flags and a command line for this mode (None: not measured in llama.cpp)."""
        if self.engine != "llamacpp":
            return None
        return {"args": list(self.llamacpp_args), "command": shlex.join(["llama-server", *self.llamacpp_args, "--metrics"])}

    def to_dict(self) -> dict:
        out = {**asdict(self), "vllm": {"speculative_config": self.vllm()}, "sglang": self.sglang()}
        if self.llamacpp() is not None:
            out["llamacpp"] = self.llamacpp()
        return out

    def render(self) -> str:
        lines = [f"mode            {self.mode}"]
        if self.draft_dir:
            what = f"version {self.draft_version}"
            lines.append(f"draft           {self.draft_dir} ({'EAGLE-3 head, ' if self.draft_kind == 'eagle3' else ''}{what})")
        if self.exit_layer is not None:
            lines.append(f"exit layer      {self.exit_layer}")
        lines.append(f"target          {self.target_fingerprint}")
        vllm = f"--speculative-config '{json.dumps(self.vllm())}'" if self.vllm() else "(no speculation)"
        lines.append(f"vLLM            {vllm}")
        lines.append(f"SGLang          {' '.join(self.sglang()) or '(no speculation)'}")
        if self.llamacpp() is not None:
            lines.append(f"llama.cpp       {self.llamacpp()['command']}")
        if self.reason:
            lines.append(f"reason          {self.reason}")
        if self.measured:
            speedups = ", ".join(f"{name} {x:.2f}x" for name, x in sorted(self.measured.items(), key=lambda kv: -kv[1]))
            lines.append(f"measured        {speedups}" + (f" ({self.measured_on})" if self.measured_on else ""))
        lines.append(f"updated         {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.updated_at))}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The no-slowdown guard: one implementation for the nightly flow and the monitor's fallback

DEFAULT_MARGIN = 0.05


@dataclass
class Candidate:
    """One speculation mode measured against target-only decoding on the same prompts."""

    name: str
    mode: str  # draft | self_speculation | ngram
    speedup: float
    lossless: bool | None  # None: sampling run, not decidable from outputs
    gamma: int = 4
    draft_dir: str | None = None
    exit_layer: int | None = None


@dataclass
class ServingChoice:
    mode: str  # a mode of MODES; "off" when nothing beats target-only by the margin
    candidate: Candidate | None
    reason: str
    margin: float
    speedups: dict[str, float] = field(default_factory=dict)


def fastest_mode(candidates: list[Candidate], margin: float = DEFAULT_MARGIN) -> ServingChoice:
    """The fastest lossless candidate, kept only if it beats target-only by more than `margin`
    (speedup > 1 + margin); otherwise speculation is off. Serving never gets slower than no
    speculation on the measured prompts."""
    speedups = {c.name: c.speedup for c in candidates}
    table = ", ".join(f"{c.name} {c.speedup:.2f}x" + ("" if c.lossless is not False else " (lossy)")
                      for c in sorted(candidates, key=lambda c: -c.speedup))
    usable = [c for c in candidates if c.lossless is not False and c.mode in MODES]
    best = max(usable, key=lambda c: c.speedup, default=None)
    if best is None or best.speedup <= 1.0 + margin:
        why = ("no lossless speculation mode was measured" if best is None else
               f"the fastest mode, {best.name} at {best.speedup:.2f}x, does not beat target-only by more than {margin:.0%}")
        return ServingChoice("off", None, f"{why} ({table or 'nothing measured'})", margin, speedups)
    return ServingChoice(best.mode, best, f"{best.name} measured fastest at {best.speedup:.2f}x ({table})", margin, speedups)


def serving_path() -> Path:
    override = os.environ.get("SPECDISTILL_SERVING_CONFIG")
    return Path(override).resolve() if override else paths.home() / SERVING_FILE


def write_serving_config(config: ServingConfig, path: str | Path | None = None) -> Path:
    """Replace the serving config atomically: readers see the old file or the new one, never a mix."""
    return paths.atomic_write_json(Path(path) if path else serving_path(), config.to_dict())


def read_serving_config(path: str | Path | None = None) -> ServingConfig | None:
    path = Path(path) if path else serving_path()
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"corrupt serving config {path}: {exc}") from exc
    data.pop("vllm", None)
    data.pop("sglang", None)
    data.pop("llamacpp", None)
    return ServingConfig(**data)
