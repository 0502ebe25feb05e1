"""`draft_model:DIR`: a layer draft, a small LM with the target's tokenizer (vLLM `draft_model`, SGLang `STANDALONE`).
A spec written before as `draft:DIR` is read as `draft_model:DIR` (its alias)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from specdistill.speculative.specs import DRAFT_MODEL, DrafterSpec, Kind, TargetKey, register_kind

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from specdistill.modeling.models import LoadedModel
    from specdistill.speculative.drafters import Drafter

NEEDS_DIR = ("draft_dir", "a draft directory")  # a draft model is served from its directory


def model_vllm(c: Any, method: str = DRAFT_MODEL) -> dict[str, Any]:
    """vLLM's settings for a draft model from its serving config `c`: it verifies a chain, so a head measured
    as a tree is served there at the chain depth measured for it."""
    k = getattr(c, "chain_speculative_tokens", None) or c.num_speculative_tokens
    return {"method": method, "model": c.draft_dir, "num_speculative_tokens": k}


def model_sglang(c: Any, algorithm: str = "STANDALONE") -> list[str]:
    """SGLang's flags for a draft model: k draft steps, each expanding the `tree_width` likeliest nodes into their
    top `tree_width` children, of which the likeliest k + tree_width - 1 are verified with the pending token
    (EAGLE-2's dynamic tree, as `speculative.eagle.EagleDrafter.propose_tree` drafts and the harness measured it;
    a layer draft's width is 1: a chain)."""
    k, w = c.num_speculative_tokens, c.tree_width
    return ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", str(c.draft_dir),
            "--speculative-num-steps", str(k), "--speculative-eagle-topk", str(w), "--speculative-num-draft-tokens", str(k + w)]


def build(target: PreTrainedModel, spec: DrafterSpec, key: TargetKey) -> Drafter:
    """The layer draft, in the target's dtype on its device; a reference (`models:/NAME@ALIAS`) resolved
    first, and built by the kind its directory turns out to be (a registered head)."""
    from specdistill.modeling import models  # lazy: keeps torch off `serving show`
    from specdistill.modeling.vocab import DraftVocab  # lazy: keeps torch off `serving show`
    from specdistill.speculative.drafters import ModelDrafter  # lazy: keeps torch off `serving show`

    path = models.resolve_model_dir(spec.arg)
    if (resolved := spec.resolved(str(path))).kind != spec.kind:
        return resolved.build(target, key)
    weights = next(target.parameters())
    loaded = models.load_model(path, dtype=weights.dtype, device=weights.device)  # the draft runs as the target does
    return ModelDrafter(loaded.model, target.config.vocab_size, DraftVocab.load(loaded.path),
                        name=f"{DRAFT_MODEL}:{loaded.path.name}", tree_width=spec.tree_width)


def _shared(target: PreTrainedModel, spec: DrafterSpec) -> LoadedModel:
    """The layer draft in the target's dtype on its device, loaded once per process (a replay changes no weight:
    a transplant is made on a copy)."""
    from specdistill.modeling.models import shared_model  # lazy: keeps torch off `serving show`

    weights = next(target.parameters())
    return shared_model(spec.arg, dtype=weights.dtype, device=weights.device)


def mismatch(target: PreTrainedModel, spec: DrafterSpec, tokenizer: Any) -> str:
    """Why the target cannot read the draft's token ids as they are ("": it can)."""
    from specdistill.modeling.vocab import check_vocab, vocab_mismatch  # lazy: keeps torch off `serving show`

    draft = _shared(target, spec)
    return vocab_mismatch(check_vocab(tokenizer, draft.tokenizer), draft.config.vocab_size, target.config.vocab_size)


def carry(target: PreTrainedModel, spec: DrafterSpec, tokenizer: Any) -> tuple[Drafter, str]:
    """The layer draft as it is where the target reads its token ids as they are, else a copy re-embedded over
    the target's vocabulary, its reduced vocabulary carried over (`modeling.drafts.align_draft`)."""
    from specdistill.modeling.drafts import align_draft  # lazy: keeps torch off `serving show`
    from specdistill.modeling.vocab import DraftVocab  # lazy: keeps torch off `serving show`
    from specdistill.speculative.drafters import ModelDrafter  # lazy: keeps torch off `serving show`

    draft = _shared(target, spec)
    aligned = align_draft(draft.model, draft.tokenizer, tokenizer, DraftVocab.load(draft.path),
                          target_vocab_size=target.config.vocab_size)
    return ModelDrafter(aligned.model, target.config.vocab_size, aligned.draft_vocab, name=f"{DRAFT_MODEL}:{draft.path.name}",
                        tree_width=spec.tree_width), aligned.reason


DRAFT = register_kind(Kind(DRAFT_MODEL, "draft", f"{DRAFT_MODEL}:DIR", bool, build, vllm=model_vllm, sglang=model_sglang,
                           needs=NEEDS_DIR, draft_dir=True, mismatch=mismatch, carry=carry, aliases=("draft",)))
