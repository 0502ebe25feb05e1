"""Suffix drafting (SuffixDecoding, arXiv 2411.04975; vLLM's `suffix` method): the target's own past
answers, and the request itself, as the draft.

Each round the context's last m tokens are matched, for every m, against a corpus of past answers
(`SuffixIndex`) and against the request's prompt and output so far (`RequestIndex`). From the
occurrences of a match the draft follows the most frequent continuation token by token; a token's
estimated probability is the product of the frequency ratios on its path, and the draft stops below
`min_token_prob`, at `max_spec_factor * m + max_spec_offset` tokens (a short match speculates
little), at γ, and where match plus draft would pass `max_depth` (vLLM's tree depth). Of all match
lengths and both sources the draft with the highest score (the sum of its token probabilities: the
expected accepted length under the frequency model) wins; the request wins ties, a longer match wins
ties among lengths. The proposal is deterministic, so q is one-hot and both greedy and sampled
decoding stay lossless under the decoding loop's rejection rule. With `tree_width` > 1 (greedy) the runner-up
continuations along the chain are verified as a tree in the same target forward.

The corpus index is a suffix array of the reversed corpus (sorted to `INDEX_DEPTH` tokens by prefix
doubling): the occurrences of the context's last m tokens form one contiguous range for each m,
each inside the previous one, so matching every length costs a binary search per length. Memory is
8 bytes per corpus token (the tokens and the array, int32). Occurrence sets larger than
`max_occurrences` are counted on an evenly strided sample of their range (bounded time per round;
the array orders the sample by left context).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specdistill.speculative.drafters import Drafter

SEP = -1  # between corpus sequences: never matches a token, ends every continuation
INDEX_DEPTH = 32  # tokens the corpus index is sorted to: the longest match it resolves


@dataclass(frozen=True)
class SuffixParams:
    """SuffixDecoding's knobs, named as vLLM's `suffix_decoding_*` keys (defaults are vLLM's)."""

    max_depth: int = 24  # match length + draft length
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    max_occurrences: int | None = 4096  # count larger occurrence sets on a strided sample (None: exact)

    def __post_init__(self):
        if not 2 <= self.max_depth <= INDEX_DEPTH:
            raise ValueError(f"max_depth must be in 2..{INDEX_DEPTH}, got {self.max_depth}")
        if self.max_spec_factor < 0 or not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"need max_spec_factor >= 0 and 0 <= min_token_prob <= 1, got {self.max_spec_factor}, "
                             f"{self.min_token_prob}")

    def limit(self, match_len: int, k: int) -> int:
        """Draft tokens a match of `match_len` may speculate (adaptive length, capped at k and the depth)."""
        return max(0, min(k, int(match_len * self.max_spec_factor + self.max_spec_offset + 1e-6),
                          self.max_depth - match_len))


@dataclass
class SuffixDraft:
    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # estimated probability of each token (path product)
    match_len: int = 0
    source: str = ""  # "request" or "corpus"; empty when nothing matched
    # runner-up continuations: (parent: index into tokens or -1, token, estimated probability)
    alternatives: list[tuple[int, int, float]] = field(default_factory=list)

    @property
    def score(self) -> float:
        return float(sum(self.probs))


def _top(nxt: np.ndarray) -> tuple[list[int], list[int]]:
    """Distinct continuation tokens and their counts, most frequent first (ties: smaller token first)."""
    if nxt.size <= 32:
        counts: dict[int, int] = {}
        for t in nxt.tolist():
            counts[t] = counts.get(t, 0) + 1
        ranked = sorted(counts.items(), key=lambda tc: (-tc[1], tc[0]))
        return [t for t, _ in ranked], [c for _, c in ranked]
    if nxt.size > 256:
        counts = np.bincount(nxt)
        tokens = np.flatnonzero(counts)
        counts = counts[tokens]
    else:
        tokens, counts = np.unique(nxt, return_counts=True)
    order = np.lexsort((tokens, -counts))
    return tokens[order].tolist(), counts[order].tolist()


def follow(seq: np.ndarray, ends: np.ndarray, limit: int, min_prob: float,
           alternatives: int = 0) -> tuple[list[int], list[float], list[tuple[int, int, float]]]:
    """The most frequent continuation of the occurrences ending at `ends` in `seq`, up to `limit`
    tokens, each kept while its path probability is at least `min_prob`; with `alternatives`, the best
    runner-up tokens at each step (above `min_prob` too). A longer limit extends the same path."""
    tokens: list[int] = []
    probs: list[float] = []
    alts: list[tuple[int, int, float]] = []
    prob = 1.0
    while len(tokens) < limit:
        if ends.size == 1:  # one occurrence: its continuation, at the same probability, up to its end
            run = seq[int(ends[0]) + 1 : int(ends[0]) + 1 + limit - len(tokens)].tolist()
            run = run[: run.index(SEP)] if SEP in run else run
            tokens += run
            probs += [prob] * len(run)
            break
        nxt = seq[ends + 1]
        keep = nxt >= 0
        if not keep.all():
            ends, nxt = ends[keep], nxt[keep]
        if ends.size == 0:
            break
        top, counts = _top(nxt)
        total = float(ends.size)
        for t, c in zip(top[1 : 1 + alternatives], counts[1 : 1 + alternatives]):
            if prob * c / total >= min_prob:
                alts.append((len(tokens) - 1, t, prob * c / total))
        p = prob * counts[0] / total
        if p < min_prob:
            break
        prob = p
        tokens.append(top[0])
        probs.append(p)
        ends = ends[nxt == top[0]] + 1
    return tokens, probs, alts


def best_draft(seq: np.ndarray, matches: Sequence, k: int, params: SuffixParams, alternatives: int = 0,
               source: str = "") -> SuffixDraft:
    """The best-scoring draft over all match lengths; `matches[m - 1]` is a callable giving the end
    positions of the context's last m tokens (nested: each set inside the previous) and its size.

    Exact pruning: a draft from a match of m tokens scores at most its limit, which shrinks with m, so
    shorter matches are skipped once they cannot beat the best (ties go to the longer match anyway);
    equal occurrence counts mean equal sets, whose path is computed once and cut to each limit."""
    best = SuffixDraft(source=source)
    cache: dict[int, tuple] = {}
    for m in range(len(matches), 0, -1):
        limit = params.limit(m, k)
        bound = min(k, int(m * params.max_spec_factor + params.max_spec_offset + 1e-6))  # non-increasing as m falls
        if best.tokens and bound <= best.score:
            break
        if limit == 0:
            continue
        count, ends_of = matches[m - 1]
        if count not in cache:  # the path at the longest limit any match length may take: cut to each one
            cache[count] = follow(seq, ends_of(), k, params.min_token_prob, alternatives)
        tokens, probs, alts = cache[count]
        tokens, probs = tokens[:limit], probs[:limit]
        score = float(sum(probs))
        if tokens and (not best.tokens or score > best.score):
            kept = [a for a in alts if a[0] < len(tokens) - 1]  # siblings of chain tokens: the tree stays within the limit
            best = SuffixDraft(list(tokens), list(probs), m, source, kept)
    return best


class SuffixIndex:
    """The corpus side: past answers (token id sequences) in a reversed suffix array, built in about a
    second per million tokens."""

    def __init__(self, sequences: Sequence[Sequence[int]] = ()):
        self.sequences: list[np.ndarray] = []
        for s in sequences:
            arr = np.asarray(s, dtype=np.int64)
            if arr.size and int(arr.min()) < 0:
                raise ValueError("corpus token ids must be >= 0")
            if arr.size:
                self.sequences.append(arr.astype(np.int32))
        parts = [np.array([SEP], dtype=np.int32)]
        for s in self.sequences:
            parts += [s, np.array([SEP], dtype=np.int32)]
        seq = np.concatenate(parts)
        n = seq.size
        rank = np.unique(seq, return_inverse=True)[1].astype(np.int64)  # dense: every rank < n
        h = 1
        while h < INDEX_DEPTH and n > 1:  # prefix doubling on the backward strings seq[e], seq[e-1], ...
            before = np.zeros(n, dtype=np.int64)  # rank + 1 of the string h tokens back (0: before the start)
            before[h:] = rank[:-h] + 1
            key = (rank + 1) * (n + 1) + before  # the pair as one int64 (ranks < n + 1)
            order = np.argsort(key, kind="stable")
            key = key[order]
            new = np.empty(n, dtype=np.int64)
            new[order] = np.concatenate([[0], np.cumsum(key[1:] != key[:-1])])
            rank = new
            h *= 2
        valid = np.flatnonzero((seq[:-1] >= 0) & (seq[1:] >= 0))  # a token with a continuation
        self.seq = seq
        self.sa = valid[np.argsort(rank[valid], kind="stable")].astype(np.int32)

    @property
    def num_tokens(self) -> int:
        return int(sum(s.size for s in self.sequences))

    @property
    def nbytes(self) -> int:
        return int(self.seq.nbytes + self.sa.nbytes)

    def matches(self, context: Sequence[int], longest: int, cap: int | None) -> list:
        """(count, ends getter) for the context's last 1..`longest` tokens, while they occur."""
        out = []
        lo, hi = 0, self.sa.size
        seq, sa = self.seq, self.sa
        for m in range(1, min(longest, len(context), INDEX_DEPTH) + 1):
            t = int(context[-m])
            if hi - lo <= 2048:
                column = seq[sa[lo:hi].astype(np.int64) - (m - 1)]
                lo, hi = lo + int(np.searchsorted(column, t, "left")), lo + int(np.searchsorted(column, t, "right"))
            else:
                def key(j: int, m=m) -> int:
                    return int(seq[int(sa[j]) - (m - 1)])
                lo, hi = bisect.bisect_left(range(hi), t, lo, hi, key=key), bisect.bisect_right(range(hi), t, lo, hi, key=key)
            if lo >= hi:
                break
            stride = max(1, math.ceil((hi - lo) / cap)) if cap else 1
            out.append((hi - lo, lambda lo=lo, hi=hi, s=stride: sa[lo:hi:s].astype(np.int64)))
        return out


class RequestIndex:
    """The request side: its prompt and output so far, updated as tokens are accepted (the decoding loop's
    sequence only ever holds accepted tokens), with a separator after the last one."""

    def __init__(self):
        self.seq = np.full(256, SEP, dtype=np.int64)
        self.length = 0

    def sync(self, tokens: torch.Tensor | Sequence[int]) -> None:
        arr = tokens.numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens, dtype=np.int64)
        n = arr.size
        if n < self.length:  # another request without a reset: start over
            self.length = 0
        if n + 1 > self.seq.size:
            grown = np.full(max(2 * self.seq.size, n + 1), SEP, dtype=np.int64)
            grown[: self.length] = self.seq[: self.length]
            self.seq = grown
        self.seq[self.length : n] = arr[self.length :]
        self.seq[n:] = SEP
        self.length = n

    def matches(self, longest: int) -> list:
        seq, n = self.seq, self.length
        out: list = []
        if n < 2:
            return out
        ends = np.flatnonzero(seq[: n - 1] == seq[n - 1])
        for m in range(1, min(longest, n - 1) + 1):
            if m > 1:
                ends = ends[ends >= m - 1]
                ends = ends[seq[ends - (m - 1)] == seq[n - m]]
            if ends.size == 0:
                break
            out.append((int(ends.size), lambda e=ends: e))
        return out


class SuffixDrafter(Drafter):
    """Drafts from the corpus (None or empty: the request's own context alone) and the request."""

    def __init__(self, corpus: SuffixIndex | None, params: SuffixParams | None = None, *, tree_width: int = 1,
                 name: str = "suffix"):
        self.corpus = corpus if corpus is not None and corpus.sa.size else None
        self.params = params or SuffixParams()
        self.tree_width = tree_width
        self.name = name
        self.request = RequestIndex()

    def reset(self) -> None:
        self.request = RequestIndex()

    def draft(self, tokens: torch.Tensor | Sequence[int], k: int, alternatives: int = 0) -> SuffixDraft:
        """The best draft of up to k tokens after `tokens` (the accepted sequence so far)."""
        self.request.sync(tokens)
        p = self.params
        longest = p.max_depth - 1
        mine = best_draft(self.request.seq, self.request.matches(longest), k, p, alternatives, "request")
        if self.corpus is not None:
            context = self.request.seq[max(0, self.request.length - longest) : self.request.length]
            theirs = best_draft(self.corpus.seq, self.corpus.matches(context, longest, p.max_occurrences), k, p,
                                alternatives, "corpus")
            if theirs.score > mine.score:
                mine = theirs
        return mine

    def propose(self, tokens, k, config, generator):
        return torch.tensor(self.draft(tokens, k).tokens, dtype=torch.long), None

    def propose_tree(self, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, list[int]]:
        return self.tree(self.draft(tokens, k, alternatives=self.tree_width - 1), self.tree_width)

    @staticmethod
    def tree(d: SuffixDraft, width: int) -> tuple[torch.Tensor, list[int]]:
        """A draft's chain (parents -1, 0, 1, ...) then up to `width - 1` runner-up tokens, best first."""
        alts = sorted(d.alternatives, key=lambda a: -a[2])[: width - 1] if d.tokens else []
        ids = d.tokens + [t for _, t, _ in alts]
        return torch.tensor(ids, dtype=torch.long), list(range(-1, len(d.tokens) - 1)) + [a[0] for a in alts]
