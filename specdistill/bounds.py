"""The ranges of the counts that size memory or work (γ, a tree, new tokens, threads, steps, prompts),
shared by every place one is read: the configs and their overrides (`specdistill.recipe`'s bounded
types), serving.json (`ops.serving`) and the command line's flags (`cli.common`). A typo or a hostile
value (`num_speculative_tokens: 1000000000`) is then one sentence naming the key where it is read, not
an out-of-memory kill minutes later. Each bound is far above any real run's value and far below one
that exhausts a machine. No import beyond the standard library: the command line's parser reads it."""

from __future__ import annotations

import os

MAX_GAMMA = 64  # draft tokens per round (EAGLE-3 serves up to ~8, n-gram and suffix modes a few dozen)
MAX_TREE_WIDTH = 64  # first-position candidates verified as a tree
MAX_NGRAM = 64  # prompt lookup's n-gram length
MAX_NEW_TOKENS = 32_768  # tokens generated per request
MAX_SEQUENCE = 131_072  # tokens of one training sequence or prompt, or of a labelling batch
MAX_LAYERS = 1_024  # a layer index or a count of the target's layers
MAX_STEPS = 100_000_000  # optimizer steps, and the intervals counted in steps
MAX_BATCH = 65_536  # sequences per batch, micro-batches per step, requests in flight, records per transaction
MAX_PROMPTS = 10_000_000  # prompts, records or requests drawn, replayed or kept
MAX_TOKENS = 100_000_000_000  # a token budget (a pool, a corpus, tokens trained on)
MAX_REPEATS = 1_000  # timed repeats of a benchmark
MAX_TOP_K = 1_048_576  # a teacher's top-k (vocabularies stop near 260k)
MAX_SUFFIX_DEPTH = 1_024  # the suffix tree's depth (vLLM's default 24)
MAX_SUFFIX_SPEC_FACTOR = 1_024.0  # suffix decoding's speculation per matched token
MAX_CACHED_REQUESTS = 10_000_000  # requests the suffix tree keeps
MAX_CHECKPOINTS = 1_000  # checkpoints or versions kept
MAX_DAYS = 36_525.0  # a time span in days (a window, a budget): a century; a timedelta overflows near 10^9 days
MAX_BYTES = 1 << 50  # a size in bytes (a decompression cap): a pebibyte
MAX_TIMESTAMP = 253_402_300_799.0  # 9999-12-31T23:59:59Z: the last second a date can be printed
THREADS_PER_CPU = 4  # more torch threads than this per usable CPU only stall, and tens of thousands abort OpenMP


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity, a container's share), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def max_threads() -> int:
    return THREADS_PER_CPU * usable_cpus()


def check_threads(threads: int, what: str = "threads") -> int:
    """`threads` if this machine can run that many torch threads (1 to `max_threads()`), else a ValueError."""
    if not 1 <= threads <= max_threads():
        raise ValueError(f"{what} {threads}: must be 1 to {max_threads()} ({THREADS_PER_CPU} per CPU; this process "
                         f"may use {usable_cpus()} CPUs)")
    return threads
