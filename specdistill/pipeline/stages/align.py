"""Stage: the draft training starts from (or the champion measured beside it) carried over to this
target: its vocabulary aligned, or a head's embeddings taken from the target."""

from __future__ import annotations

from transformers import AutoConfig

from specdistill.modeling import drafts, models
from specdistill.modeling.drafts import align_draft, load_draft_meta
from specdistill.modeling.eagle3 import Eagle3ShapeError
from specdistill.modeling.eagle3_io import align_head
from specdistill.modeling.models import resolve_model_dir, shared_model
from specdistill.modeling.vocab import DraftVocab
from specdistill.pipeline.nightly_recipe import NightlyConfig, config_hash, run_root, target_tokenizer
from specdistill.pipeline.outputs import Champion, WarmStart
from specdistill.speculative.specs import DrafterSpec


def align_champion(config: NightlyConfig, champion: Champion | None) -> WarmStart | None:
    """The champion as a warm start for this target: as it is when the target reads its token ids
    as they are, else re-embedded over the target's vocabulary (`modeling.drafts.align_draft`)."""
    if champion is None:
        return None
    target_tok = target_tokenizer(config)

    def warm(directory: str, transplanted: bool, report: dict, unfit: str = "") -> WarmStart:
        return WarmStart(champion.name, champion.version, directory, dict(champion.tags), transplanted, report, unfit)

    if DrafterSpec.for_draft(champion.dir).of.on_target:  # a head: its draft vocabulary carried over; embeddings the target's
        target = shared_model(config.target, dtype=config.dtype, device=config.device)
        out = run_root() / "aligned" / f"{champion.name}-{champion.version}-{target.fingerprint}"
        try:
            aligned_dir, head, report = align_head(champion.dir, target.model, target_tok, out)
        except Eagle3ShapeError as exc:  # another width or depth: tonight starts from the target, and says why
            return warm("", False, {}, unfit=str(exc))
        return warm(str(aligned_dir), head.transplanted, report)
    target_vocab_size = AutoConfig.from_pretrained(resolve_model_dir(config.target)).vocab_size
    draft = models.load_model(champion.dir, dtype=config.dtype, device=config.device)
    aligned = align_draft(draft.model, draft.tokenizer, target_tok, DraftVocab.load(champion.dir),
                          target_vocab_size=target_vocab_size, copy_model=False)
    report = aligned.report.to_dict()
    if not aligned.transplanted:
        return warm(champion.dir, False, report)
    out = run_root() / "aligned" / f"{champion.name}-{champion.version}-{config_hash(report)}"
    if not (out / "config.json").is_file():
        drafts.save_draft(aligned.model, target_tok, out, draft_vocab=aligned.draft_vocab,
                   meta={**load_draft_meta(champion.dir), "transplanted_from": champion.dir})
    return warm(str(out), True, report)
