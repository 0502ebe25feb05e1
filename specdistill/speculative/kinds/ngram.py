"""`ngram` / `ngram:MIN,MAX`: prompt lookup, the longest recent n-gram's continuation in the request."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from specdistill.speculative.specs import DrafterSpec, Kind, TargetKey, register_kind

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from specdistill.speculative.drafters import Drafter


def _sizes_ok(arg: str) -> bool:
    sizes = [s.strip() for s in arg.split(",")]
    return not arg or (len(sizes) == 2 and all(s.isdigit() for s in sizes))


def build(target: PreTrainedModel, spec: DrafterSpec, key: TargetKey) -> Drafter:
    from specdistill.speculative.drafters import NgramDrafter  # lazy: keeps torch off `serving show`

    return NgramDrafter(*spec.ngram_sizes)


def _vllm(c: Any) -> dict[str, Any]:
    return {"method": "ngram", "prompt_lookup_min": c.prompt_lookup_min, "prompt_lookup_max": c.prompt_lookup_max,
            "num_speculative_tokens": c.num_speculative_tokens}


def _sglang(c: Any) -> list[str]:
    return ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(c.num_speculative_tokens),
            "--speculative-ngram-min-match-window-size", str(c.prompt_lookup_min),
            "--speculative-ngram-max-match-window-size", str(c.prompt_lookup_max)]


NGRAM = register_kind(Kind("ngram", "ngram", "ngram or ngram:MIN,MAX", _sizes_ok, build,
                           serving=lambda s: {"prompt_lookup_min": s.ngram_sizes[0], "prompt_lookup_max": s.ngram_sizes[1]},
                           vllm=_vllm, sglang=_sglang))
