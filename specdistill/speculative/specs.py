"""Drafter specs: the one parser of the strings that name a drafting method (`draft:DIR`, `self-spec:K`,
`ngram`, `ngram:MIN,MAX`, `suffix:CORPUS`, `hybrid:DIR,CORPUS[,THRESHOLD]`), and the one registry of the
kinds of drafter (`KINDS`): the serving modes, and which of them may be served, are read from it.

    spec = DrafterSpec.parse("self-spec:8")      # kind "self-spec", exit_layer 8, serving mode "self_speculation"
    drafter = drafter_from_spec(target, spec.with_(tree_width=4))

A spec's text is what the nightly's benchmark entries, the monitor's fallback and the reports carry
(it is part of cache keys and of `serving.json`'s record), so `str(DrafterSpec.parse(s)) == s`. γ and
the tree width are not in the text: they are measured settings a spec is run with (`with_`).

A new kind registers a `Kind` in `KINDS` (`register_kind`); nothing else lists the kinds.

Specs travel as `DrafterSpec`s: parsed where text comes in (the CLI, configs, records read back), written as
text only where they leave (JSON records, cache keys, reports: `to_dict`).

Self-speculation is `self-spec` everywhere a drafter is named (specs `self-spec:K`, results `self-spec@K`,
the CLI's `--self-spec K`); `self_spec:K`, the spelling of records written before, is still read. Its
serving mode keeps the name serving.json and the `specdistill_serving_mode{mode}` gauge have always
carried, `self_speculation`.

Torch-free at import (drafters are built on first use), so `serving show` and the metrics read the modes fast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from specdistill.acceptance import NGRAM_WINDOW

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from specdistill.speculative.drafters import Drafter


class DrafterSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Kind:
    name: str
    mode: str  # the serving mode it is written as: draft | self_speculation | ngram | ...
    usage: str  # how its spec is written, for error messages
    check: Callable[[str], bool]  # is this argument (after "kind:", "" when there is none) valid?
    # (target, spec, the target's identity: what a corpus is checked against) -> the drafter
    build: Callable[[PreTrainedModel, DrafterSpec, TargetKey], Drafter]
    served: bool = True  # False: measured, never written to serving.json (no engine runs it)
    # the serving.json keys the spec's text decides (a window, an exit layer, a corpus); a draft directory is
    # the writer's to give (a registered copy, an exported early-exit draft)
    serving: Callable[[DrafterSpec], dict[str, Any]] = lambda spec: {}
    llamacpp: bool = True  # llama-server runs it (its lookup cache is its own format: no suffix corpus)
    # its mode's vLLM `speculative_config` and SGLang flags, from a serving config (`ops.serving.ServingConfig`)
    vllm: Callable[[Any], dict[str, Any] | None] = lambda config: None
    sglang: Callable[[Any], list[str]] = lambda config: []
    needs: tuple[str, str] = ()  # the serving config key its mode cannot be served without, and its name for errors
    aliases: tuple[str, ...] = ()  # older spellings of the name, read from records written before


class TargetKey(NamedTuple):
    """What a suffix corpus must have been built for: the target's fingerprint and its tokenizer's digest
    (`modeling.fingerprints.tokenizer_digest`); None: not checked (a notebook's own corpus)."""

    fingerprint: str | None = None
    tokenizer: str | None = None


KINDS: dict[str, Kind] = {}
_ALIASES: dict[str, str] = {}
OFF = "off"  # the serving mode without speculation


def register_kind(kind: Kind) -> Kind:
    if kind.name in KINDS or kind.name in _ALIASES or any(a in KINDS or a in _ALIASES for a in kind.aliases):
        raise ValueError(f"drafter kind {kind.name!r} (or one of its aliases) is already registered")
    KINDS[kind.name] = kind
    _ALIASES.update(dict.fromkeys(kind.aliases, kind.name))
    return kind


def serving_modes() -> tuple[str, ...]:
    """The modes serving.json may name: each servable kind's, then `off`."""
    return (*dict.fromkeys(k.mode for k in KINDS.values() if k.served), OFF)


def served_kind(mode: str) -> Kind | None:
    """The servable kind a serving mode names (None: `off`, or a mode no kind is served as)."""
    return next((k for k in KINDS.values() if k.served and k.mode == mode), None)


def usage() -> str:
    return ", ".join(k.usage for k in KINDS.values())


@dataclass(frozen=True)
class DrafterSpec:
    """A drafting method: its kind, its argument (a path or a parameter; "" when it has none), and the
    γ and tree width it is run with (None: the caller's)."""

    kind: str
    arg: str = ""
    gamma: int | None = None
    tree_width: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _ALIASES.get(self.kind, self.kind))  # one spelling inside

    @classmethod
    def parse(cls, text: str | DrafterSpec) -> DrafterSpec:
        if isinstance(text, DrafterSpec):
            return text
        kind, sep, arg = str(text).partition(":")
        kind = _ALIASES.get(kind, kind)
        known = KINDS.get(kind)
        if known is None or (sep and not arg) or not known.check(arg):
            raise DrafterSpecError(f"unknown drafter spec {text!r} ({usage()})")
        return cls(kind, arg)

    def __str__(self) -> str:
        return f"{self.kind}:{self.arg}" if self.arg else self.kind

    def to_dict(self) -> str:
        """Its JSON is its text (`data.record.to_dict`, and so cache keys); `parse` reads it back."""
        return str(self)

    def with_(self, **changes: Any) -> DrafterSpec:
        return replace(self, **changes)

    @property
    def mode(self) -> str:
        return KINDS[self.kind].mode

    @property
    def served(self) -> bool:
        return KINDS[self.kind].served

    @property
    def runs_in_llamacpp(self) -> bool:
        return KINDS[self.kind].llamacpp

    def serving_keys(self) -> dict[str, Any]:
        """Its serving.json keys: the mode and what the spec's text decides (no draft directory)."""
        return {"mode": self.mode, **KINDS[self.kind].serving(self)}

    @property
    def path(self) -> str | None:
        """A draft's checkpoint or EAGLE-3 head (kind draft, and the model half of a hybrid)."""
        if self.kind == "hybrid":
            return hybrid_parts(self.arg)[0]
        return self.arg if self.kind == "draft" else None

    @property
    def corpus(self) -> str | None:
        if self.kind == "hybrid":
            return hybrid_parts(self.arg)[1]
        return self.arg if self.kind == "suffix" else None

    @property
    def exit_layer(self) -> int | None:
        return int(self.arg) if self.kind == SELF_SPEC else None

    @property
    def ngram_sizes(self) -> tuple[int, int] | None:
        """(min n, max n) of prompt lookup; plain `ngram`: `acceptance.NGRAM_WINDOW`."""
        if self.kind != "ngram":
            return None
        if not self.arg:
            return NGRAM_WINDOW
        lo, hi = (int(s) for s in self.arg.split(","))
        return (lo, hi)


def hybrid_parts(arg: str) -> tuple[str, str, float | None]:
    """`DIR,CORPUS[,THRESHOLD]` of a hybrid spec: the draft, the corpus file and the threshold."""
    parts = arg.split(",")
    threshold = None
    if len(parts) >= 3:
        try:
            threshold = float(parts[-1])
            parts = parts[:-1]
        except ValueError:
            pass
    if len(parts) != 2 or not all(parts):
        raise DrafterSpecError(f"hybrid drafter spec needs DIR,CORPUS[,THRESHOLD], got {arg!r}")
    return parts[0], parts[1], threshold


def _hybrid_ok(arg: str) -> bool:
    try:
        return bool(hybrid_parts(arg))
    except DrafterSpecError:
        return False


def _sizes_ok(arg: str) -> bool:
    sizes = [s.strip() for s in arg.split(",")]
    return not arg or (len(sizes) == 2 and all(s.isdigit() for s in sizes))


def _suffix_serving(spec: DrafterSpec) -> dict[str, Any]:
    """The corpus and the SuffixDecoding knobs the drafter is measured with, under serving.json's names."""
    from specdistill.speculative.suffix import SuffixParams  # lazy: keeps torch off `serving show`

    p = SuffixParams()
    return {"suffix_corpus": spec.corpus, "suffix_max_tree_depth": p.max_depth,
            "suffix_max_spec_factor": p.max_spec_factor, "suffix_min_token_prob": p.min_token_prob}


# A served mode's engine settings, from its serving config `c` (`ops.serving.ServingConfig.vllm()`, `.sglang()`):
# a draft model is a layers checkpoint (a draft, self-speculation's early-exit export) or an EAGLE-3 head

def _model_vllm(c: Any) -> dict[str, Any]:
    # vLLM verifies a chain: a head measured as a tree is served there at the chain depth measured for it
    k = getattr(c, "chain_speculative_tokens", None) or c.num_speculative_tokens
    return {"method": "eagle3" if c.draft_kind == "eagle3" else "draft_model", "model": c.draft_dir,
            "num_speculative_tokens": k}


def _model_sglang(c: Any) -> list[str]:
    # k draft steps, each expanding the `tree_width` likeliest nodes into their top `tree_width` children, of
    # which the likeliest k + tree_width - 1 are verified with the pending token (EAGLE-2's dynamic tree, as
    # `speculative.eagle.EagleDrafter.propose_tree` drafts and the harness measured it)
    k, w = c.num_speculative_tokens, c.tree_width
    return ["--speculative-algorithm", "EAGLE3" if c.draft_kind == "eagle3" else "STANDALONE",
            "--speculative-draft-model-path", str(c.draft_dir), "--speculative-num-steps", str(k),
            "--speculative-eagle-topk", str(w), "--speculative-num-draft-tokens", str(k + w)]


def _ngram_vllm(c: Any) -> dict[str, Any]:
    return {"method": "ngram", "prompt_lookup_min": c.prompt_lookup_min, "prompt_lookup_max": c.prompt_lookup_max,
            "num_speculative_tokens": c.num_speculative_tokens}


def _ngram_sglang(c: Any) -> list[str]:
    return ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(c.num_speculative_tokens),
            "--speculative-ngram-min-match-window-size", str(c.prompt_lookup_min),
            "--speculative-ngram-max-match-window-size", str(c.prompt_lookup_max)]


def _suffix_vllm(c: Any) -> dict[str, Any]:
    # vLLM's global tree fills from served requests only: our corpus cannot seed it
    return {"method": "suffix", "num_speculative_tokens": c.num_speculative_tokens,
            "suffix_decoding_max_tree_depth": c.suffix_max_tree_depth, "suffix_decoding_max_spec_factor": c.suffix_max_spec_factor,
            "suffix_decoding_min_token_prob": c.suffix_min_token_prob,
            "suffix_decoding_max_cached_requests": c.suffix_max_cached_requests}


def _suffix_sglang(c: Any) -> list[str]:
    # SGLang's NGRAM trie over the request, plus our corpus as its external corpus; SGLang re-tokenizes the
    # texts and refuses a corpus above its max tokens (answers plus separators)
    k = c.num_speculative_tokens
    out = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(k),
           "--speculative-ngram-max-trie-depth", str(c.suffix_max_tree_depth)]
    if c.suffix_corpus_sglang:
        out += ["--speculative-ngram-external-corpus-path", c.suffix_corpus_sglang, "--speculative-ngram-external-sam-budget",
                str(k), "--speculative-ngram-external-corpus-max-tokens", str(max(1, 2 * c.suffix_corpus_tokens))]
    return out


def _make_drafter(target: PreTrainedModel, **options: Any) -> Drafter | None:
    from specdistill.speculative.factory import make_drafter  # lazy: keeps torch off `serving show`

    return make_drafter(target, **options)


SELF_SPEC = "self-spec"
_MODEL = dict(vllm=_model_vllm, sglang=_model_sglang, needs=("draft_dir", "a draft directory"))  # a draft model served
register_kind(Kind("draft", "draft", "draft:DIR", lambda arg: bool(arg),
                   lambda target, s, key: _make_drafter(target, draft=s.arg, tree_width=s.tree_width), **_MODEL))
register_kind(Kind(SELF_SPEC, "self_speculation", "self-spec:K", str.isdigit,
                   lambda target, s, key: _make_drafter(target, self_spec=s.exit_layer, tree_width=s.tree_width),
                   serving=lambda s: {"exit_layer": s.exit_layer}, aliases=("self_spec",), **_MODEL))
register_kind(Kind("ngram", "ngram", "ngram or ngram:MIN,MAX", _sizes_ok,
                   lambda target, s, key: _make_drafter(target, ngram=True, ngram_min=s.ngram_sizes[0],
                                                      ngram_max=s.ngram_sizes[1]),
                   serving=lambda s: {"prompt_lookup_min": s.ngram_sizes[0], "prompt_lookup_max": s.ngram_sizes[1]},
                   vllm=_ngram_vllm, sglang=_ngram_sglang))
register_kind(Kind("suffix", "suffix", "suffix:CORPUS", lambda arg: bool(arg),
                   lambda target, s, key: _make_drafter(target, suffix=s.arg, tree_width=s.tree_width,
                                                       target_fingerprint=key.fingerprint,
                                                       target_tokenizer=key.tokenizer),
                   serving=_suffix_serving, llamacpp=False, vllm=_suffix_vllm, sglang=_suffix_sglang,
                   needs=("suffix_corpus", "its corpus file (suffix_corpus)")))
# measured, never served: no serving engine runs our distilled draft with the suffix drafter beside it
register_kind(Kind("hybrid", "hybrid", "hybrid:DIR,CORPUS[,THRESHOLD]", _hybrid_ok,
                   lambda target, s, key: _make_drafter(target, draft=s.path, suffix=s.corpus, tree_width=s.tree_width,
                                                       target_fingerprint=key.fingerprint, target_tokenizer=key.tokenizer,
                                                       hybrid_threshold=hybrid_parts(s.arg)[2]),
                   served=False))


def drafter_from_spec(target: PreTrainedModel, spec: str | DrafterSpec, tree_width: int | None = None,
                      target_fingerprint: str | None = None, target_tokenizer: str | None = None) -> Drafter:
    """The drafter a spec names, as the nightly benchmark and the monitor's fallback build them.
    `tree_width` (default: the spec's) applies to model and suffix drafters; a corpus is checked against
    `target_fingerprint` and `target_tokenizer` (the target's `tokenizer_digest`) when given."""
    spec = DrafterSpec.parse(spec)
    if tree_width is not None:
        spec = spec.with_(tree_width=tree_width)
    return KINDS[spec.kind].build(target, spec, TargetKey(target_fingerprint, target_tokenizer))
