"""The serving config: what the pipeline tells vLLM or SGLang to run.

A small JSON file, replaced atomically (write, fsync, rename) so a serving system never reads half a
config. It names the mode and the draft, and carries the exact vLLM `speculative_config` and the
SGLang flags for that mode. One typed model (`ServingConfig`, pydantic) reads and writes it: a wrong
type is named with its key, and keys a newer version writes are kept, not fatal.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, StrictStr, ValidationError, model_validator

from specdistill import bounds, paths
from specdistill.acceptance import DEFAULT_GAMMA, NGRAM_WINDOW
from specdistill.speculative.specs import KINDS, draft_kinds, engine_settings, mode_name, served_kind, serving_modes

# Read only, never written: what serving.json said whatever was served, before `draft_kind` named the served kind
# (and the layer draft's name until it took vLLM's, `draft_model`)
OLD_DRAFT_KIND = "layers"
SERVING_FILE = "serving.json"
# The one exception to "traffic and answers are the owner's only" (see specdistill.paths): what a serving
# engine must read. This file (0644: modes, paths, speedups, no traffic) and the draft directory it names
# (`draft_dir`: a registered copy or an early-exit export, weights only, 0755/0644) are readable by a
# serving engine that runs as another user. The suffix corpora it names (`suffix_corpus`,
# `suffix_corpus_sglang`) are the target's answers and stay 0600: vLLM never reads them (its suffix
# tree fills from served requests), and an SGLang that loads the external corpus runs as the owner or
# is granted access by the operator.
SERVING_FILE_MODE = 0o644
DERIVED_KEYS = ("vllm", "sglang", "llamacpp")  # written for the engines, recomputed on read
SERVING_MAX_BYTES = 1 << 20  # a serving config is a few keys: a larger file is not read whole


Speedup = Annotated[StrictFloat, Field(ge=0.0)]  # a measured speedup: finite, never negative


class ServingConfigError(ValueError):
    """A serving config that cannot be used; the message names the file and every bad key."""


def _problems(exc: ValidationError) -> str:
    out = []
    for err in exc.errors():
        where = ".".join(str(x) for x in err["loc"]) or "config"
        message = err["msg"].removeprefix("Value error, ")
        out.append(f"{where}: {message}" + (f" (got {err['input']!r})" if err["type"] not in ("value_error", "missing")
                                            and not isinstance(err["input"], dict) else ""))
    return "; ".join(out)


class ServingConfig(BaseModel):
    """The serving file's schema. Ints are strict (`true` is not 1), numbers finite, and every field within
    the range the engines accept (vLLM's `SpeculativeConfig` checks: a suffix tree at least 1 deep, a
    token probability in [0, 1], no negative counts) and under the bound of what sizes an engine's memory
    or work (`specdistill.bounds`: γ, the tree, the suffix tree's depth), at read and at write; unknown
    keys are kept as extras."""

    model_config = ConfigDict(extra="allow", validate_assignment=True, allow_inf_nan=False)

    mode: StrictStr  # one of `speculative.specs.serving_modes()`: a servable drafter kind's, or off (checked first)
    num_speculative_tokens: StrictInt = Field(DEFAULT_GAMMA, ge=0, le=bounds.MAX_GAMMA)  # at least 1 unless mode off (checked below)
    draft_dir: StrictStr | None = None  # draft mode, and self-spec mode's early-exit draft (exported)
    draft_version: StrictStr | None = None
    # the served kind (`speculative.specs.draft_kinds()`): draft_model (a layer draft: vLLM draft_model, SGLang
    # STANDALONE), eagle3 (a head: vLLM eagle3, SGLang EAGLE3), self-spec, ngram, suffix; None: off
    draft_kind: StrictStr | None = None
    target_fingerprint: StrictStr | None = None
    exit_layer: StrictInt | None = Field(None, ge=1, le=bounds.MAX_LAYERS)  # self-speculation: the target's layers 0..exit_layer-1
    # ngram mode: the window that was measured (unset: `acceptance.NGRAM_WINDOW`, what plain `ngram` measures);
    # other modes carry none
    prompt_lookup_min: StrictInt | None = Field(None, ge=1, le=bounds.MAX_NGRAM)
    prompt_lookup_max: StrictInt | None = Field(None, ge=1, le=bounds.MAX_NGRAM)
    # suffix mode: the corpus of the target's past answers (ours, token ids) and its SGLang export (JSONL of
    # answer texts); SuffixDecoding's knobs under vLLM's names (suffix_decoding_*) and vLLM's ranges
    suffix_corpus: StrictStr | None = None
    suffix_corpus_sglang: StrictStr | None = None
    suffix_corpus_tokens: StrictInt = Field(0, ge=0, le=bounds.MAX_TOKENS)
    suffix_max_tree_depth: StrictInt = Field(24, ge=1, le=bounds.MAX_SUFFIX_DEPTH)
    suffix_max_spec_factor: StrictFloat = Field(1.0, ge=0.0, le=bounds.MAX_SUFFIX_SPEC_FACTOR)
    suffix_min_token_prob: StrictFloat = Field(0.1, ge=0.0, le=1.0)
    suffix_max_cached_requests: StrictInt = Field(10000, ge=0, le=bounds.MAX_CACHED_REQUESTS)  # 0: vLLM keeps no global tree
    reason: StrictStr = ""
    measured: dict[str, Speedup] = Field(default_factory=dict)  # every mode's measured speedup, same prompts
    measured_on: StrictStr = ""  # engine and dtype the speedups were measured with, e.g. "harness bf16"
    engine: StrictStr = "harness"  # harness | llamacpp | openai: where `measured` comes from
    llamacpp_args: list[StrictStr] = Field(default_factory=list)  # llama-server flags of this mode, as measured
    # an EAGLE-3 head's first-position candidates, verified as a tree (SGLang's --speculative-eagle-topk);
    # vLLM's eagle3 method and llama.cpp verify a chain (width 1)
    tree_width: StrictInt = Field(1, ge=1, le=bounds.MAX_TREE_WIDTH)
    # a head served as a tree (tree_width > 1) to SGLang: the chain depth measured for the engines that verify a
    # chain only (vLLM's eagle3 method on its CPU build, llama.cpp's draft-eagle3); None: num_speculative_tokens
    chain_speculative_tokens: StrictInt | None = Field(None, ge=1, le=bounds.MAX_GAMMA)
    hardware: StrictStr = ""  # the GPU or CPU (model, flags that matter) `measured` came from
    updated_at: StrictFloat = Field(default_factory=time.time, ge=0.0, le=bounds.MAX_TIMESTAMP)  # printable as a date

    def __init__(self, mode: str | None = None, /, **data: Any) -> None:
        if mode is not None:  # ServingConfig("ngram", ...) as the dataclass allowed
            data["mode"] = mode
        super().__init__(**data)

    @model_validator(mode="before")
    @classmethod
    def _mode_first(cls, data: Any) -> Any:
        if isinstance(data, dict) and "mode" in data:  # a file written before: its mode's old name read as the new
            data = {**data, "mode": mode_name(data["mode"])}
        if isinstance(data, dict) and "mode" in data and data["mode"] not in (modes := serving_modes()):
            raise ValueError(f"serving mode {data['mode']!r} is not one of {modes}")
        kind = data.get("draft_kind") if isinstance(data, dict) else None
        if kind not in (None, OLD_DRAFT_KIND) and kind not in (kinds := draft_kinds()):
            raise ValueError(f"draft kind {data['draft_kind']!r} is not one of {kinds}")
        if isinstance(data, dict) and "mode" in data:
            data = {**data, "draft_kind": _served_draft_kind(data["mode"], data.get("draft_kind"))}
        if isinstance(data, dict) and data.get("mode") == "ngram":
            data = {"prompt_lookup_min": NGRAM_WINDOW[0], "prompt_lookup_max": NGRAM_WINDOW[1], **data}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> ServingConfig:
        kind = served_kind(self.mode, self.draft_kind)
        if kind and kind.needs and not getattr(self, kind.needs[0]):
            raise ValueError(f"serving mode {self.mode!r} needs {kind.needs[1]}")
        if self.mode != "off" and self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if self.tree_width < 1 or (self.tree_width > 1 and not (kind and kind.tree)):
            raise ValueError(f"tree_width {self.tree_width}: a tree of first-position candidates needs an EAGLE-3 head "
                             "(a kind served as a tree)")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is not None and hi is not None and hi < lo:
            raise ValueError(f"prompt lookup window {self.prompt_lookup_min}..{self.prompt_lookup_max} is empty")
        return self

    @property
    def extras(self) -> dict[str, Any]:
        """Keys this version does not know (a newer version wrote them): kept and written back."""
        return dict(self.__pydantic_extra__ or {})

    def vllm(self) -> dict | None:
        """vLLM's `--speculative-config` (None: serve without speculation), as its mode's kind writes it."""
        return write(self) if (write := engine_settings(self.mode, self.draft_kind, "vllm")) else None

    def sglang(self) -> list[str]:
        """SGLang `launch_server` flags (empty: serve without speculation), as its mode's kind writes them."""
        return write(self) if (write := engine_settings(self.mode, self.draft_kind, "sglang")) else []

    def llamacpp(self) -> dict | None:
        """llama-server's flags and a command line for this mode (None: not measured in llama.cpp)."""
        if self.engine != "llamacpp":
            return None
        return {"args": list(self.llamacpp_args), "command": shlex.join(["llama-server", *self.llamacpp_args, "--metrics"])}

    def to_dict(self) -> dict:
        dumped = {k: v for k, v in self.model_dump().items() if not (k.startswith("prompt_lookup_") and v is None)}
        out = {**dumped, "vllm": {"speculative_config": self.vllm()}, "sglang": self.sglang()}
        if self.llamacpp() is not None:
            out["llamacpp"] = self.llamacpp()
        return out

    def render(self) -> str:
        lines = [f"mode            {self.mode}"]
        if self.draft_dir:
            what = f"version {self.draft_version}"
            label = kind.label if (kind := served_kind(self.mode, self.draft_kind)) else ""
            lines.append(f"draft           {self.draft_dir} ({label + ', ' if label else ''}{what})")
        if self.exit_layer is not None:
            lines.append(f"exit layer      {self.exit_layer}")
        if self.suffix_corpus:
            lines.append(f"suffix corpus   {self.suffix_corpus} ({self.suffix_corpus_tokens} tokens)")
        lines.append(f"target          {self.target_fingerprint}")
        # quoted for a shell: a pasted line never runs a word of a draft path (shlex.join for every engine)
        vllm = shlex.join(["--speculative-config", json.dumps(self.vllm())]) if self.vllm() else "(no speculation)"
        lines.append(f"vLLM            {vllm}")
        lines.append(f"SGLang          {shlex.join(self.sglang()) or '(no speculation)'}")
        if self.llamacpp() is not None:
            lines.append(f"llama.cpp       {self.llamacpp()['command']}")
        if self.reason:
            lines.append(f"reason          {self.reason}")
        if self.measured:
            speedups = ", ".join(f"{name} {x:.2f}x" for name, x in sorted(self.measured.items(), key=lambda kv: -kv[1]))
            lines.append(f"measured        {speedups}" + (f" ({self.measured_on})" if self.measured_on else ""))
        if self.hardware:
            lines.append(f"hardware        {self.hardware}")
        lines.append(f"updated         {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.updated_at))}")
        return "\n".join(lines)


def _served_draft_kind(mode: Any, draft_kind: Any) -> str | None:
    """serving.json's `draft_kind` for a mode: the one given, the mode's kind where none is (None: off), and for
    a record written before (`layers`: whatever was served, and the layer draft's old name) the mode's kind, in
    draft mode the layer draft; a kind that is not served in the mode is refused."""
    kind = served_kind(mode, draft_kind) if isinstance(mode, str) else None
    if kind is None or draft_kind is None or draft_kind == OLD_DRAFT_KIND:
        return kind.draft_kind if kind else None
    if kind.draft_kind != draft_kind:
        served_in = next(k.mode for k in KINDS.values() if k.draft_kind == draft_kind)
        raise ValueError(f"draft_kind {draft_kind!r} is served in {served_in} mode, not {mode!r}")
    return draft_kind


def serving_path() -> Path:
    override = os.environ.get("SPECDISTILL_SERVING_CONFIG")
    return Path(override).resolve() if override else paths.home() / SERVING_FILE


def write_serving_config(config: ServingConfig, path: str | Path | None = None) -> Path:
    """Validated again first (a config changed after it was built, or built without validation, is refused
    before it reaches the file): a `ServingConfigError` naming the file and the key."""
    path = Path(path) if path else serving_path()
    checked = parse_serving_config(config.model_dump(), path)
    return paths.atomic_write_json(path, checked.to_dict(), mode=SERVING_FILE_MODE)


def parse_serving_config(data: Any, where: str | Path = "serving config") -> ServingConfig:
    """A serving config from its JSON value; a wrong shape or type is a `ServingConfigError` naming `where`."""
    if not isinstance(data, dict):
        raise ServingConfigError(f"serving config {where}: expected a JSON object, got {type(data).__name__}")
    data = {k: v for k, v in data.items() if k not in DERIVED_KEYS}
    try:
        return ServingConfig(**data)
    except ValidationError as exc:
        raise ServingConfigError(f"serving config {where}: {_problems(exc)}") from None


def read_serving_config(path: str | Path | None = None) -> ServingConfig | None:
    """The serving config on disk (None: no file). A truncated, mistyped or wrongly shaped file is a
    `ServingConfigError` naming the file and the key; keys from a newer version are kept."""
    path = Path(path) if path else serving_path()
    if not path.exists():
        return None
    try:
        raw = paths.read_whole(path, "serving config", SERVING_MAX_BYTES)  # a FIFO or a device is refused, unread
        if not raw.strip():
            raise ServingConfigError(f"serving config {path} is empty")
        data = paths.parse_json(raw, path, "serving config")
    except ServingConfigError:
        raise
    except ValueError as exc:  # corrupt, nested too deep, not a regular file, too large: the message names the file
        raise ServingConfigError(str(exc)) from None
    except OSError as exc:
        raise ServingConfigError(f"cannot read serving config {path}: {paths.os_error_reason(exc)}") from None
    return parse_serving_config(data, path)
