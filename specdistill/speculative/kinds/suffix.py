"""`suffix:CORPUS`: SuffixDecoding over a corpus of the target's past answers and the request itself."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from specdistill.speculative.specs import DrafterSpec, Kind, TargetKey, register_kind

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from specdistill.speculative.drafters import Drafter


def build(target: PreTrainedModel, spec: DrafterSpec, key: TargetKey) -> Drafter:
    """The suffix drafter over the spec's corpus, checked against the target's identity in `key`."""
    from specdistill.speculative.suffix_corpus import load_suffix_drafter  # lazy: keeps torch off `serving show`

    return load_suffix_drafter(spec.corpus, key.fingerprint, key.tokenizer, tree_width=spec.tree_width,
                               vocab_size=target.config.vocab_size)


def _serving(spec: DrafterSpec) -> dict[str, Any]:
    """The corpus and the SuffixDecoding knobs the drafter is measured with, under serving.json's names."""
    from specdistill.speculative.suffix import SuffixParams  # lazy: keeps torch off `serving show`

    p = SuffixParams()
    return {"suffix_corpus": spec.corpus, "suffix_max_tree_depth": p.max_depth,
            "suffix_max_spec_factor": p.max_spec_factor, "suffix_min_token_prob": p.min_token_prob}


def _vllm(c: Any) -> dict[str, Any]:
    # vLLM's global tree fills from served requests only: our corpus cannot seed it
    return {"method": "suffix", "num_speculative_tokens": c.num_speculative_tokens,
            "suffix_decoding_max_tree_depth": c.suffix_max_tree_depth, "suffix_decoding_max_spec_factor": c.suffix_max_spec_factor,
            "suffix_decoding_min_token_prob": c.suffix_min_token_prob,
            "suffix_decoding_max_cached_requests": c.suffix_max_cached_requests}


def _sglang(c: Any) -> list[str]:
    # SGLang's NGRAM trie over the request, plus our corpus as its external corpus; SGLang re-tokenizes the
    # texts and refuses a corpus above its max tokens (answers plus separators)
    k = c.num_speculative_tokens
    out = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(k),
           "--speculative-ngram-max-trie-depth", str(c.suffix_max_tree_depth)]
    if c.suffix_corpus_sglang:
        out += ["--speculative-ngram-external-corpus-path", c.suffix_corpus_sglang, "--speculative-ngram-external-sam-budget",
                str(k), "--speculative-ngram-external-corpus-max-tokens", str(max(1, 2 * c.suffix_corpus_tokens))]
    return out


SUFFIX = register_kind(Kind("suffix", "suffix", "suffix:CORPUS", bool, build, serving=_serving, llamacpp=False,
                            vllm=_vllm, sglang=_sglang, needs=("suffix_corpus", "its corpus file (suffix_corpus)")))
