"""The EAGLE-3 drafter: drafts from the target's own features, with its own KV cache.

Head entry t pairs the target's features at position t with token t+1 and predicts token t+2. With
the sequence `tokens[:L]` (the last token pending, not yet run through the target), the target has
produced features for positions 0..L-2 only, so the committed entries are 0..L-2 and entry L-2
drafts token L. Each later draft step feeds the head's own output (what `Eagle3Draft.forward` returns)
back at the next position; those entries are speculative and `rollback` drops all of them, accepted or not: once the target
has verified a round, its real features for the pending token and the accepted drafts replace them
(`add_features`, called by the decoding loop after every target forward). The correction or bonus token
has no features until the next round, which is why the committed entries always end at L-2.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specdistill.modeling.eagle3 import Eagle3Cache, Eagle3Draft, check_head_fits
from specdistill.modeling.models import pack_for_cpu
from specdistill.speculative.drafters import Drafter
from specdistill.speculative.sampling import SamplingConfig, pick_token


class EagleDrafter(Drafter):
    """Drafts with an EAGLE-3 head; `feature_layers` tells the decoding loop which target layers to hook."""

    def __init__(self, head: Eagle3Draft, target: PreTrainedModel, name: str = "eagle3", tree_width: int = 1,
                 tree_budget: int | None = None):
        check_head_fits(head, target)
        pack_for_cpu(head)  # however it was loaded: a bf16 head's step on unpacked weights cost ~1.6x
        self.head = head
        self.name = name
        self.tree_width = tree_width  # > 1: greedy decoding verifies a draft tree, the head's top candidates per node
        self.tree_budget = tree_budget  # draft tokens a tree round verifies (None: γ + tree_width - 1)
        self.feature_layers = head.aux_layers
        self.vocab = head.draft_vocab
        self.d2t = head.d2t.cpu()  # drafting and verification run on the CPU, the head's forwards on its device
        self.reset()

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.logits(hidden)[0, -1].float().cpu()

    def step_module(self):
        """The head's step is what a round costs beyond the target (its features come with the target's forward)."""
        return self.head, None

    def reset(self) -> None:
        self.cache = Eagle3Cache()
        self.committed = 0  # head entries built from the target's features (positions 0..committed-1)
        self.pending: torch.Tensor | None = None  # the target's features [T, 3·H] of positions committed..
        self.last_hidden: torch.Tensor | None = None  # output of the last committed entry [1, 1, H]

    @property
    def featured(self) -> int:
        """Positions whose target features the drafter has been given."""
        return self.committed + (0 if self.pending is None else self.pending.shape[0])

    def add_features(self, features: torch.Tensor) -> None:
        features = features.to(self.head.fc.weight.dtype)
        self.pending = features if self.pending is None else torch.cat([self.pending, features])

    def _commit(self, tokens: torch.Tensor) -> None:
        """Run the head over the positions whose features arrived since the last round."""
        end = tokens.numel() - 1
        if self.featured != end:
            raise RuntimeError(
                f"the EAGLE drafter has the target's features for {self.featured} positions, needs {end}: "
                "it drafts only inside the decoding loop's generate(), which hands it the features"
            )
        if self.pending is None:
            return
        start = self.committed
        positions = torch.arange(start, end).unsqueeze(0)
        out = self.head(tokens[start + 1 : end + 1].unsqueeze(0), self.head.project(self.pending).unsqueeze(0),
                        positions, self.cache)
        self.committed, self.pending, self.last_hidden = end, None, out[:, -1:]

    def propose(self, tokens: torch.Tensor, k: int, config: SamplingConfig, generator: torch.Generator | None):
        self._commit(tokens)
        position = tokens.numel() - 1
        hidden, ids, qs = self.last_hidden, [], []
        for i in range(k):
            d, q = pick_token(self._logits(hidden), config, generator)
            qs.append(q)
            ids.append(d + self.d2t[d])
            if i < k - 1:
                hidden = self.head(ids[-1].view(1, 1), hidden, torch.tensor([[position + i]]), self.cache)
        if config.greedy:
            return torch.stack(ids), None
        return torch.stack(ids), self.vocab.to_full(torch.stack(qs))  # zero outside the draft vocabulary: still lossless

    def propose_tree(self, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, list[int]]:
        """Greedy drafts as a tree grown where the head is sure (EAGLE-2, as SGLang drafts with
        `--speculative-num-steps` k, `--speculative-eagle-topk` w, `--speculative-num-draft-tokens` budget + 1):
        each of k - 1 steps expands the w likeliest nodes of the newest depth (by the product of the draft
        probabilities along their branch) into their top-w children; the `budget` likeliest nodes of all are
        verified. Returns (node ids, parent indices, -1 for a child of the pending token); the head's top-1
        chain comes first, so a round's first positions read as a chain-verifying engine would count them."""
        self._commit(tokens)
        w = self.tree_width
        budget = self.tree_budget or k + w - 1
        base = tokens.numel() - 1  # the position of the first speculative entry
        logp, idx = torch.log_softmax(self._logits(self.last_hidden), -1).topk(w)
        ids, parent, score = list(idx + self.d2t[idx]), [-1] * w, logp.tolist()
        depth, children = [1] * w, {}
        outputs: dict[int, torch.Tensor] = {-1: self.last_hidden}  # node -> the head output that drafts its children
        entry: dict[int, int] = {}  # node -> its entry in the head's cache
        newest = list(range(w))
        for step in range(1, k):
            grow = sorted(newest, key=lambda n: -score[n])[:w]
            past = self.cache.length
            mask = torch.zeros(len(grow), past + len(grow), dtype=torch.bool)
            mask[:, : self.committed] = True
            for row, n in enumerate(grow):
                a = parent[n]
                while a >= 0:  # its own branch only
                    mask[row, entry[a]] = True
                    a = parent[a]
                mask[row, past + row] = True
            hidden = torch.cat([outputs[parent[n]] for n in grow], dim=1)
            out = self.head(torch.stack([ids[n] for n in grow]).view(1, -1), hidden,
                            torch.full((1, len(grow)), base + step - 1), self.cache, mask[None, None])
            logps, tops = torch.log_softmax(self.head.logits(out)[0].float().cpu(), -1).topk(w, dim=-1)
            newest = []
            for row, n in enumerate(grow):
                entry[n], outputs[n] = past + row, out[:, row : row + 1]
                for lp, d in zip(logps[row].tolist(), tops[row]):
                    children.setdefault(n, []).append(len(ids))
                    newest.append(len(ids))
                    ids.append(d + self.d2t[d])
                    parent.append(n)
                    score.append(score[n] + lp)
                    depth.append(step + 1)
        chosen = set(sorted(range(len(ids)), key=lambda n: -score[n])[:budget])
        chain = [0]  # the top-1 chain: the best child of each chain node, while chosen
        while children.get(chain[-1]) and children[chain[-1]][0] in chosen:
            chain.append(children[chain[-1]][0])
        for n in list(chosen):  # a tie may leave a chosen node's parent out: take its branch whole
            while parent[n] >= 0 and parent[n] not in chosen:
                chosen.add(n := parent[n])
        order = chain + sorted(chosen - set(chain), key=lambda n: (depth[n], -score[n]))
        place = {n: i for i, n in enumerate(order)}
        return torch.stack([ids[n] for n in order]), [place.get(parent[n], -1) for n in order]

    def rollback(self, valid_len: int) -> None:
        """Drop every speculative entry; the target's features for the accepted tokens arrive next."""
        if valid_len - 1 < self.committed:
            raise RuntimeError(f"cannot roll back to {valid_len} tokens: {self.committed} positions are committed")
        self.cache.crop(self.committed)
        if self.featured > valid_len - 1:  # features of positions past the sequence (never from the decoding loop)
            self.pending = self.pending[: valid_len - 1 - self.committed] if valid_len - 1 > self.committed else None

