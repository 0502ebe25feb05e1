"""Target-only and speculative decoding for one request, read top to bottom (gpt-fast style).

Invariant of the loop: `tokens[:length]` is the sequence so far and the target's KV cache holds
`tokens[:length - 1]`; the last token is pending. A round feeds the pending token plus k drafts to
the target in one forward, keeps the accepted prefix, crops the rejected drafts off the cache and
appends the target's own next token (its correction, or the bonus token when all k pass).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, fields

import torch
from transformers import PreTrainedModel

from specdistill.acceptance import DEFAULT_GAMMA, DraftCounts
from specdistill.modeling.attention import decode_attention_for
from specdistill.modeling.feature_hooks import FeatureHooks
from specdistill.modeling.kv_cache import preallocated_cache
from specdistill.modeling.lean import lean_forward, supports_lean
from specdistill.speculative.drafters import Drafter
from specdistill.speculative.sampling import SamplingConfig, pick_token, verify


@dataclass
class SpecStats:
    """Counters per request, summed over requests by `merge` (definitions in docs/metrics.md): the drafts'
    counts (α, τ and per-position acceptance are theirs) and what the request cost.

    `counts.rounds` are drafting rounds (target forwards that verified at least one draft); target steps
    with nothing to verify (prefill, no n-gram match, last token) count only in `target_forwards`.
    """

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    target_forwards: int = 0
    seconds: float = 0.0
    # requests whose output the target's context cut short of max_new_tokens (the prompt left less room)
    context_truncated: int = 0
    counts: DraftCounts = field(default_factory=DraftCounts)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def merge(self, other: SpecStats) -> SpecStats:
        # every counter adds up (a new one too, without an edit here); the counts add up position by position
        return SpecStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @classmethod
    def total(cls, stats: Iterable[SpecStats]) -> SpecStats:
        return functools.reduce(cls.merge, stats, cls())

    def to_dict(self) -> dict:
        """Flat, as results files have always held it (the counts' fields beside the request's); α 0.0 and
        τ 1.0 where nothing was drafted (a target-only run)."""
        c = self.counts
        return {
            **{f.name: getattr(self, f.name) for f in fields(self) if f.name != "counts"},
            **asdict(c),
            "acceptance_rate": c.acceptance_rate or 0.0,
            "accepted_length": c.accepted_length or 1.0,
            "per_position_acceptance": c.per_position_acceptance,
            "tokens_per_second": self.tokens_per_second,
        }


STOPPED_AT_STOP_TOKEN, STOPPED_AT_MAX_NEW_TOKENS, STOPPED_AT_CONTEXT = "stop_token", "max_new_tokens", "context"


@dataclass
class GenerationResult:
    output_ids: list[int]  # generated ids only, prompt excluded; ends with the stop token if one was hit
    stats: SpecStats
    # why the output ended: a stop token, max_new_tokens, or "context" when the target's context was
    # full first (the prompt left fewer than max_new_tokens positions): the caller must say so
    stopped: str = STOPPED_AT_MAX_NEW_TOKENS
    context: int = 0  # the target's context length, tokens


def context_length(model: PreTrainedModel) -> int:
    return int(getattr(model.config, "max_position_embeddings", None) or 1 << 30)


def default_stop_ids(model: PreTrainedModel) -> list[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = model.config.eos_token_id
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def _check_request(target: PreTrainedModel, prompt: torch.Tensor, max_new_tokens: int, gamma: int) -> None:
    if prompt.numel() == 0:
        raise ValueError("empty prompt: give at least one token")
    if gamma < 1:
        raise ValueError(f"gamma (draft tokens per round) must be >= 1, got {gamma}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    vocab = target.config.vocab_size
    if int(prompt.min()) < 0 or int(prompt.max()) >= vocab:
        raise ValueError(f"prompt has token ids outside the target vocabulary 0..{vocab - 1}")
    ctx = context_length(target)
    if prompt.numel() >= ctx:
        raise ValueError(f"prompt of {prompt.numel()} tokens does not fit the target's context of {ctx} tokens")


class TargetSide:
    """The target's side of one request: its KV cache, a forward that counts itself, and the features of the
    positions it last saw, which a drafter that drafts from them (EAGLE-3, `feature_layers`) is handed."""

    def __init__(self, target: PreTrainedModel, drafter: Drafter | None, stats: SpecStats, capacity: int):
        self.target, self.stats = target, stats
        self.cache = preallocated_cache(target, 1, capacity)  # a step writes its column, nothing is concatenated
        self.layers = list(drafter.feature_layers) if drafter is not None else []
        self.lean = supports_lean(target)  # else transformers' forward, the features from hooks on those layers
        self.hooks = FeatureHooks(target, self.layers) if self.layers and not self.lean else None
        self.features: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, keep: int, positions: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        """The target's logits for the last `keep` of `input_ids` [T], appended to the cache."""
        self.stats.target_forwards += 1
        if self.lean:
            logits, features = lean_forward(self.target, input_ids.unsqueeze(0), self.cache, positions=positions,
                                            mask=mask, keep=keep, capture=self.layers)
        else:
            device = self.target.device
            logits = self.target(input_ids=input_ids.unsqueeze(0).to(device),
                                 position_ids=None if positions is None else positions.to(device),
                                 attention_mask=None if mask is None else mask.to(device),
                                 cache=self.cache, use_cache=True, logits_to_keep=keep).logits
            features = self.hooks.take() if self.hooks is not None else None
        if features is not None:
            self.features = features[0]  # on the target's device: the EAGLE head drafts there too
        return logits[0].cpu()  # drafting and verification run on the CPU (a no-op there)

    def hand_features(self, drafter: Drafter | None, kept: int | torch.Tensor) -> None:
        """The last forward's features at the positions kept (the first `kept`, or those indexed) to the drafter."""
        if self.layers:
            features, self.features = self.features, None
            drafter.add_features(features[:kept] if isinstance(kept, int) else features[kept.to(features.device)])


def cut_at_stop(new: torch.Tensor, stop: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """A round's tokens up to and including the first stop token, as target-only decoding would end, and whether one was hit."""
    hit = torch.isin(new, stop).nonzero() if stop.numel() else new[:0]
    return (new[: int(hit[0, 0]) + 1], True) if hit.numel() else (new, False)


def target_round(side: TargetSide, drafter: Drafter | None, tokens: torch.Tensor, length: int, k: int,
                 sampling: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """No draft this round (`k` unused): one target step on the pending token; a drafter catches up on it."""
    new = pick_token(side(tokens[length - 1 : length], 1)[-1], sampling, generator)[0].view(1)
    if drafter is not None:
        drafter.rollback(length)
        side.hand_features(drafter, 1)
    return new


def chain_round(side: TargetSide, drafter: Drafter, tokens: torch.Tensor, length: int, k: int,
                sampling: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """Up to `k` drafts verified in one target forward (rejection sampling); the accepted ones and the target's next token."""
    draft_ids, draft_probs = drafter.propose(tokens[:length], k, sampling, generator) if k > 0 else (tokens[:0], None)
    k = draft_ids.numel()
    if k == 0:
        return target_round(side, drafter, tokens, length, 0, sampling, generator)
    logits = side(torch.cat([tokens[length - 1 : length], draft_ids]), k + 1)
    n, following = verify(logits, draft_ids, draft_probs, sampling, generator)
    if n < k:
        side.cache.crop(n - k)
    drafter.rollback(length + n)
    side.hand_features(drafter, n + 1)  # the pending token and the n accepted drafts; the new token has none yet
    side.stats.counts.record_round(k, n)
    return torch.cat([draft_ids[:n], following.view(1)])


def tree_round(side: TargetSide, drafter: Drafter, tokens: torch.Tensor, length: int, k: int,
               sampling: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """Greedy: a draft tree (several candidates for the first position) verified in one target forward."""
    ids, parents = drafter.propose_tree(tokens[:length], k) if k > 0 else (tokens[:0], [])
    if not ids.numel():
        return target_round(side, drafter, tokens, length, 0, sampling, generator)
    choice = side(*tree_inputs(tokens[length - 1], ids, parents, length - 1)).argmax(-1)
    path, following = greedy_path(choice, ids, parents)
    keep_cache_rows(side.cache, length - 1, [0] + [1 + i for i in path])
    # the leading nodes (parents -1, 0, 1, ...) are the chain a server would verify; the rest are runner-ups
    chain = next((i for i, p in enumerate(parents) if p != i - 1), len(parents))
    on_chain = next((i for i, node in enumerate(path) if node != i), len(path))
    drafter.rollback(length + on_chain)  # the drafter's cache holds the chain only
    side.hand_features(drafter, torch.tensor([0] + [1 + i for i in path]))
    side.stats.counts.record_round(chain, on_chain)
    side.stats.counts.runner_ups_accepted += len(path) - on_chain
    return torch.cat([ids[path], following.view(1)])


@torch.inference_mode()
def generate(
    target: PreTrainedModel,
    prompt_ids: Sequence[int] | torch.Tensor,
    *,
    max_new_tokens: int,
    drafter: Drafter | None = None,
    gamma: int = DEFAULT_GAMMA,
    sampling: SamplingConfig | None = None,
    stop_token_ids: Iterable[int] | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` after the prompt; with a drafter, speculatively.

    Target-only (drafter None) is the baseline every speedup is measured against. Generation stops
    after a stop token (kept in the output), at `max_new_tokens`, or when the context is full
    (`result.stopped` says which; `stats.context_truncated` counts the last).
    """
    sampling = sampling or SamplingConfig()
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    _check_request(target, prompt, max_new_tokens, gamma)
    stop = torch.tensor(sorted(set(default_stop_ids(target) if stop_token_ids is None else stop_token_ids)), dtype=torch.long)
    generator = None if sampling.greedy else sampling.generator()
    budget = min(max_new_tokens, context_length(target) - prompt.numel())
    stats = SpecStats(requests=1, prompt_tokens=prompt.numel())
    start = time.perf_counter()
    tokens = torch.empty(prompt.numel() + budget + gamma + 1, dtype=torch.long)
    tokens[: prompt.numel()] = prompt
    length = prompt.numel()
    side = TargetSide(target, drafter, stats, length + budget + gamma + (drafter.tree_width if drafter else 1) + 1)
    if drafter is not None:
        drafter.reset()
    # greedy decoding with a drafter that proposes several candidates for the first position verifies them as a tree
    play = (target_round if drafter is None else
            tree_round if sampling.greedy and drafter.tree_width > 1 else chain_round)

    # few-token forwards (decode steps, verifications) attend through matmuls, not SDPA's CPU flash kernel
    with decode_attention_for(target, drafter.model if drafter is not None else None), side.hooks or nullcontext():
        new = pick_token(side(prompt, 1)[-1], sampling, generator)[0].view(1)
        side.hand_features(drafter, prompt.numel())
        while True:
            new, hit = cut_at_stop(new, stop)
            tokens[length : length + new.numel()] = new
            length += new.numel()
            generated = length - prompt.numel()
            if hit or generated >= budget:
                stopped = (STOPPED_AT_STOP_TOKEN if hit else
                           STOPPED_AT_MAX_NEW_TOKENS if generated >= max_new_tokens else STOPPED_AT_CONTEXT)
                break
            new = play(side, drafter, tokens, length, min(gamma, budget - generated - 1), sampling, generator)

    stats.generated_tokens = length - prompt.numel()
    stats.seconds = time.perf_counter() - start
    stats.context_truncated = int(stopped == STOPPED_AT_CONTEXT)
    return GenerationResult(tokens[prompt.numel() : length].tolist(), stats, stopped, context_length(target))


# --------------------------------------------------------------------------------------------
# Tree verification (greedy): several candidates for the first draft position in one target forward


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node (1 for a child of the pending token); a parent always comes before its children."""
    depths: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"draft tree node {i} has parent {p}: parents must be -1 or an earlier node")
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def tree_inputs(pending: torch.Tensor, ids: torch.Tensor, parents: Sequence[int],
                past: int) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
    """One forward's arguments that verify a draft tree after `past` cached tokens: the pending token
    and the nodes `[1 + n]`, how many logits to keep (all), positions `[1, 1 + n]` and a bool mask
    `[1, 1, 1 + n, past + 1 + n]`.

    Node i sits at position `past + depth(i)` and attends to the cached `past` tokens, the pending
    token and its own ancestors only, so each row's logits are those of the node's own branch.
    """
    n = ids.numel()
    depths = tree_depths(parents)
    visible = torch.zeros((n + 1, n + 1), dtype=torch.bool)
    visible[:, 0] = True
    for i, p in enumerate(parents):
        if p >= 0:
            visible[i + 1] = visible[p + 1]
        visible[i + 1, i + 1] = True
    mask = torch.cat([torch.ones((n + 1, past), dtype=torch.bool), visible], dim=1)[None, None]
    positions = torch.tensor([[past, *(past + d for d in depths)]])
    return torch.cat([pending.view(1), ids]), n + 1, positions, mask


def greedy_path(choice: torch.Tensor, ids: torch.Tensor, parents: Sequence[int]) -> tuple[list[int], torch.Tensor]:
    """The accepted nodes (root to leaf) and the target's next token after them: from the pending
    token, follow the child whose id is the target's choice until none is."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    path: list[int] = []
    node = -1
    while True:
        want = choice[node + 1]
        step = next((c for c in children.get(node, []) if ids[c] == want), None)
        if step is None:
            return path, want
        path.append(step)
        node = step


def keep_cache_rows(cache, start: int, rows: Sequence[int]) -> None:
    """Keep only the forward's rows `rows` (increasing, relative to `start`) of every layer's KV cache."""
    if list(rows) != list(range(len(rows))):
        index = torch.tensor(rows, device=cache.layers[0].keys.device) + start
        for layer in cache.layers:
            layer.keys[:, :, start : start + len(rows)] = layer.keys[:, :, index]
            layer.values[:, :, start : start + len(rows)] = layer.values[:, :, index]
    extra = cache.get_seq_length() - start - len(rows)
    if extra > 0:
        cache.crop(-extra)
