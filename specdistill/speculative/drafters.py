"""Where draft tokens come from: a draft model, the target's own early exit, or the history (n-gram).

A drafter proposes up to k tokens after the current sequence and, for sampling, the distribution q
it drew them from. Model drafters keep their own KV cache: `propose` feeds only the tokens the
cache has not seen (usually the last accepted token and the target's correction), and `rollback`
drops the cached drafts the target rejected.
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

from specdistill.acceptance import NGRAM_WINDOW
from specdistill.modeling.lean import decode_forward
from specdistill.modeling.vocab import DraftVocab, VocabAlignmentError
from specdistill.speculative.sampling import SamplingConfig, pick_token


class Drafter(Protocol):
    """Everything the decoding loop asks of a drafter. A drafter class subclasses this to get the defaults: a
    chain drafter (`tree_width` 1) that needs no target features, has no model of its own and no state
    to reset or roll back.

    - `tree_width` > 1: when decoding greedily the loop verifies `propose_tree`'s tree instead of a chain;
    - `feature_layers` (the EAGLE drafter): the target layers whose inputs it drafts from; the loop
      hands it the target's features at the positions it kept after every forward (`add_features`);
    - `model`: its own decoder, which the loop's few-token attention covers too (None: none)."""

    name: str
    tree_width: int = 1
    feature_layers: tuple[int, ...] | list[int] = ()
    model: PreTrainedModel | None = None

    def reset(self) -> None: ...

    def propose(
        self, tokens: torch.Tensor, k: int, config: SamplingConfig, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def rollback(self, valid_len: int) -> None: ...

    def propose_tree(self, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, list[int]]:
        """Greedy drafts as a tree: node ids and parent indices (-1: the pending token)."""
        raise NotImplementedError(f"{self.name} drafts chains only (tree_width 1)")

    def add_features(self, features: torch.Tensor) -> None:
        """The target's features [T, F] for the next T positions it has verified (kept ones only)."""
        raise NotImplementedError(f"{self.name} drafts without the target's features")

    def parts(self) -> list[Drafter]:
        """The drafters it is made of, whose draft costs add up (a hybrid's model and lookup); itself alone."""
        return [self]

    def step_module(self) -> tuple[torch.nn.Module, DraftVocab | None] | None:
        """Its draft step as one module's decode step, timed against the target's (`modeling.drafts.measure_cost_ratio`),
        with the draft vocabulary its head covers; None: no model (a lookup, timed by its proposal)."""
        return None


class ModelDrafter(Drafter):
    """A small causal LM (or the target's early exit) drafting autoregressively with its own KV cache.

    With a reduced draft vocabulary the draft's head covers only the N kept tokens: the sliced head
    weight is taken once here, so each draft step is one [N, H] matmul instead of the full head.
    `tree_width` > 1: greedy decoding also verifies the draft's next `tree_width - 1` candidates for
    the first position (`propose_tree`), read off logits the chain computes anyway.
    """

    def step_module(self) -> tuple[torch.nn.Module, DraftVocab | None]:
        return self.model, self.vocab

    def __init__(
        self,
        model: PreTrainedModel,
        target_vocab_size: int,
        draft_vocab: DraftVocab | None = None,
        name: str = "draft",
        tree_width: int = 1,
    ):
        self.model = model
        self.name = name
        self.tree_width = tree_width
        self.vocab = draft_vocab
        embed_rows = model.get_input_embeddings().weight.shape[0]
        if draft_vocab is None:
            if model.config.vocab_size != target_vocab_size:
                raise VocabAlignmentError(
                    f"draft vocabulary size {model.config.vocab_size} differs from the target's {target_vocab_size} "
                    "and the draft has no d2t map (draft_vocab.safetensors): run a vocab transplant or give a draft vocabulary"
                )
            self.head_weight = None
        else:
            if draft_vocab.target_vocab_size != target_vocab_size:
                raise VocabAlignmentError(
                    f"draft vocabulary maps into a vocabulary of {draft_vocab.target_vocab_size} tokens, "
                    f"the target has {target_vocab_size}"
                )
            if embed_rows < target_vocab_size:
                raise VocabAlignmentError(
                    f"draft embeddings cover {embed_rows} tokens, fewer than the target's {target_vocab_size}"
                )
            head = model.get_output_embeddings().weight.detach()
            if head.shape[0] == draft_vocab.size:  # head already reduced (EAGLE-3 style)
                self.head_weight = head.contiguous()
            else:
                self.head_weight = head.index_select(0, draft_vocab.token_ids).contiguous()
            self._token_ids = draft_vocab.token_ids.cpu()
        self.cache: DynamicCache | None = None
        self.cached = 0

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.cached = 0

    def _next_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = decode_forward(self.model, input_ids, self.cache, head=self.head_weight is None)[0, -1]
        return (out if self.head_weight is None else torch.mv(self.head_weight, out)).cpu()  # drafting runs on the CPU

    def _full_ids(self, d: torch.Tensor) -> torch.Tensor:
        return d if self.head_weight is None else self._token_ids[d]

    def _draft(self, tokens: torch.Tensor, k: int, config: SamplingConfig, generator: torch.Generator | None,
               width: int = 1) -> tuple[torch.Tensor, list, torch.Tensor]:
        """k drafts, each fed back through the draft's cache; their q; and (width > 1, greedy) the first
        position's next width - 1 candidates, which never enter the cache."""
        if self.cache is None:
            self.reset()
        x = tokens[self.cached :].unsqueeze(0)
        ids, qs, runner_ups = [], [], torch.empty(0, dtype=torch.long)
        for i in range(k):
            logits = self._next_logits(x)
            self.cached += x.shape[1]
            if i == 0 and width > 1:
                top = logits.topk(min(width, logits.numel())).indices
                d, q, runner_ups = top[0], None, self._full_ids(top[1:])
            else:
                d, q = pick_token(logits, config, generator)
            qs.append(q)
            ids.append(self._full_ids(d))
            x = ids[-1].view(1, 1)
        return torch.stack(ids), qs, runner_ups

    def propose(self, tokens, k, config, generator):
        draft_ids, qs, _ = self._draft(tokens, k, config, generator)
        if config.greedy:
            return draft_ids, None
        q = torch.stack(qs)
        if self.vocab is not None:  # q is zero outside the kept tokens: still lossless
            q = self.vocab.to_full(q)
        return draft_ids, q

    def propose_tree(self, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, list[int]]:
        """Greedy drafts as a tree (node ids, parent indices, -1 for the pending token): the chain of k
        after the draft's top candidate, then its next `tree_width - 1` candidates for the first position.

        Only the chain enters the draft's KV cache; the loop rolls back to the accepted chain prefix,
        so a runner-up that wins is fed to the draft with the target's next token in the next round.
        """
        chain, _, runner_ups = self._draft(tokens, k, SamplingConfig(), None, self.tree_width)
        return torch.cat([chain, runner_ups]), list(range(-1, k - 1)) + [-1] * runner_ups.numel()

    def rollback(self, valid_len: int) -> None:
        extra = self.cached - valid_len
        if extra > 0:
            self.cache.crop(-extra)
            self.cached = valid_len


def early_exit_model(target: PreTrainedModel, exit_layer: int) -> PreTrainedModel:
    """The target cut after `exit_layer` decoder layers, through its own final norm and LM head.

    Every module is the target's own (shared, not copied): self-speculation costs no memory beyond
    a KV cache of `exit_layer` layers. The shell is built on the meta device, so nothing is allocated.
    """
    n = target.config.num_hidden_layers
    if not 1 <= exit_layer < n:
        raise ValueError(f"self-speculation exit layer must be in 1..{n - 1}, got {exit_layer}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = exit_layer
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:exit_layer]
    with torch.device("meta"):
        shell = type(target)(config)
    body, src = shell.model, target.model
    body.embed_tokens = src.embed_tokens
    body.layers = torch.nn.ModuleList(src.layers[:exit_layer])
    body.norm = src.norm
    body.rotary_emb = src.rotary_emb
    shell.lm_head = target.get_output_embeddings()
    leftover = [name for name, t in shell.state_dict().items() if t.is_meta]
    if leftover:
        raise ValueError(f"cannot build an early exit for {type(target).__name__}: unshared {leftover[:3]}")
    return shell.eval()


class SelfSpecDrafter(ModelDrafter):
    """The target drafts for itself by exiting early at layer k (LayerSkip-style, untrained exit)."""

    def __init__(self, target: PreTrainedModel, exit_layer: int, tree_width: int = 1):
        super().__init__(early_exit_model(target, exit_layer), target.config.vocab_size, name=f"self-spec:{exit_layer}",
                         tree_width=tree_width)


class NgramDrafter(Drafter):
    """Prompt lookup (vLLM's `ngram` method): find the sequence's last n tokens earlier in the
    prompt or output, longest n first from `max_n` down to `min_n`, and propose what followed the
    earliest occurrence. Deterministic, so q is one-hot (returned as None)."""

    def __init__(self, min_n: int = NGRAM_WINDOW[0], max_n: int = NGRAM_WINDOW[1]):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.name = f"ngram[{min_n},{max_n}]"

    def propose(self, tokens, k, config, generator):
        length = tokens.numel()
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            windows = tokens[: length - 1].unfold(0, n, 1)  # every earlier n-gram, not the suffix itself
            hits = (windows == tokens[length - n :]).all(dim=1).nonzero()
            if hits.numel():
                start = int(hits[0, 0]) + n
                return tokens[start : start + k], None
        return tokens[:0], None
