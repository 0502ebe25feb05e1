"""Two sections of the nightly recipe (`nightly_recipe.NightlyConfig`), kept apart for size. `generation:`: how
the night's training data is bought. The target answers the window's prompts (decode speed, on-policy), and the
logged responses are labelled by one target prefill (prefill speed): the current target's own, used as they are,
and other models', as extra examples. `remeasure:`: when a kept measurement (the answer engine, autocast) is taken again."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from specdistill import bounds
from specdistill.recipe import BatchSize, Days, Minutes, NewTokens, Seconds, Strict, Threads, TopK, count


class LoggedConfig(Strict):
    """`generation.logged`: the window's logged responses as training data (`pipeline.stages.answers.logged`).

    `served_names` maps a model name production logs responses under (an OpenAI log's `model`) to the
    target that served it (its reference, directory or fingerprint; `specdistill target register PATH
    --served-name NAME` records the same): the responses of the current target's names are its own
    answers. `other`: other models' responses (ShareGPT's are ChatGPT's) labelled too (see the measurement
    at the key). Labelling takes at most `max_share` of the answers' time budget."""

    own: bool = True
    # off by default: in the demo's budget (2048 prompts, 3.5 of the answers' 7 minutes labelling 1,789 ChatGPT
    # responses, 3 training minutes) the head reached 0.435 against 0.446 on decoded answers alone; it pays
    # where decoded answers run out (benchmarks/experiments/data_sources.py: 0.391 against 0.359 on 3 data-minutes)
    other: bool = False
    served_names: dict[str, str] = {}
    max_share: float = Field(0.5, ge=0.0, le=1.0)
    max_tokens: count(bounds.MAX_SEQUENCE) = 192  # response tokens labelled per logged response (a longer one is cut)
    # the temperature production samples at when a logged request does not say: 0, greedy (its answers are held
    # to the target's greedy choices); null: unknown, held as at temperature 1 (admits any plausible text)
    temperature: float | None = Field(0.0, ge=0.0, le=2.0)
    tokens_per_batch: count(bounds.MAX_SEQUENCE, low=64) = 4096  # padded tokens per labelling prefill


class RemeasureConfig(Strict):
    """`remeasure:` when a measured choice kept in the state directory (the answer engine,
    `nightly/answer-engine/`; autocast for training, `nightly/autocast/`) is measured again instead of
    reused, and when a running stage drops the engine it chose. A choice holds while the other work on this
    machine's cores stays within `load_shift` cores of what it was measured beside (read from /proc/stat as
    the monitor's thread watch reads it), for `max_runs` runs and `max_days` days. The answers stage
    switches engines for the rest of its prompts when its live rate over `window_s` seconds falls below
    `switch_below` of the other engine's probe rate (on the AVX2 EPYC beside a nice-10 neighbour llama.cpp
    answered at 14.5 tokens/s where its probe read 37.9)."""

    # cores of other work come or gone: about one busy core (a busy loop reads 0.9-1.0 over a second of
    # /proc/stat beside an idle process, so a whole core would be missed at 1.0)
    load_shift: float = Field(0.75, gt=0.0)
    max_runs: count(10_000) = 7
    max_days: Days = 7.0
    switch_below: float = Field(0.6, ge=0.0, le=1.0)  # 0: never switch
    window_s: Seconds = 60.0


class GenerationConfig(Strict):
    """How the target answers the window's prompts (greedy) and records its top-k teacher on the way.

    `harness`: this PyTorch harness, `batch_size` prompts per batched forward, in the run's dtype.
    `openai`: a serving engine through its OpenAI-compatible API, `parallel` requests at a time over its
    slots: the server at `url` (vLLM, SGLang or llama.cpp; with or without the trailing `/v1`), or, with
    `url: null`, a server started here for the window and stopped after (`engine`): llama-server on the
    target's GGUF (`demo` or a `.gguf` target), or vLLM on its HF directory (`make vllm`), with
    `serving.threads` threads, as `serving.engine` does. The teacher is then the engine's top-k as
    served (k = `teacher_top_k` or fewer when the server caps it, recorded in the cache).
    `auto`: whichever of the two (llama-server on the target's GGUF, when built) answered a probe batch
    faster on this machine (`pipeline.stages.answers.choose_engine`)."""

    max_new_tokens: NewTokens = 96
    # the train answers' wall-clock budget (null: none): answers stop between batches when it is spent,
    # and training uses what was written (bf16 answers the demo's 1024 in ~6 min; fp32 on AVX2 took ~19)
    max_minutes: Minutes | None = 7.0
    # prompts per batched forward (backend openai: answers per teacher shard, what a kill can lose); null: by the
    # run's dtype, measured (benchmarks/experiments/README.md): 64 in bf16 (AMX: 1.5-1.6x batch 16), 32 in fp32
    # (as AVX2: 1.3x batch 16; 64 fell back to 1.05x)
    batch_size: BatchSize | None = None
    teacher_top_k: TopK = 32
    backend: Literal["harness", "openai", "auto"] = "harness"
    url: str | None = None  # backend openai: the server's base URL; null: start `engine` on the target
    engine: Literal["llamacpp", "vllm"] = "llamacpp"  # backend openai without a url: the server started here
    parallel: BatchSize = 8  # backend openai: concurrent requests (the started llama-server's slots)
    logged: LoggedConfig = LoggedConfig()
    # torch threads for the harness's answers: auto probes 1, half and all cores for the load found and again
    # when it moves (`speculative.threads.ThreadWatch`, as the monitor does); a number sets it; null: torch's default
    threads: Threads | Literal["auto"] | None = "auto"

    @model_validator(mode="after")
    def _url_needs_openai(self):
        if self.url and self.backend != "openai":
            raise ValueError("generation.url is read by generation.backend=openai only")
        return self
