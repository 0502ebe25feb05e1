"""Drafter specs: the one parser of the strings that name a drafting method (`draft_model:DIR`, `eagle3:DIR`,
`self-spec:K`, `ngram`, `ngram:MIN,MAX`, `suffix:CORPUS`, `hybrid:DIR,CORPUS[,THRESHOLD]`), and the one
registry of the kinds of drafter (`KINDS`): how each is built, served and recorded, read from it.

    spec = DrafterSpec.parse("self-spec:8")      # kind "self-spec", exit_layer 8, serving mode "self-spec"
    drafter = drafter_from_spec(target, spec.with_(tree_width=4))

A spec's text is what the nightly's benchmark entries, the monitor's fallback and the reports carry
(it is part of cache keys and of `serving.json`'s record), so `str(DrafterSpec.parse(s)) == s`. γ and
the tree width are not in the text: they are measured settings a spec is run with (`with_`).

Each kind lives in its own module (`speculative.kinds`), which registers a `Kind` in `KINDS`
(`register_kind`); nothing else lists the kinds. As vLLM's `method`: one kind per way of drafting, so a
layer draft (`draft_model`) and an EAGLE-3 head (`eagle3`) are two kinds, named as vLLM names them; both are
served in the `draft` mode (a draft model beside the target).

Specs travel as `DrafterSpec`s: parsed where text comes in (the CLI, configs, records read back), written as
text only where they leave (JSON records, cache keys, reports: `to_dict`). Records written before are read
here and only here: an older spelling of a kind's name (`Kind.aliases`: `self_spec:K`, `draft:DIR`), and an older,
wider kind's spec that a kind now claims (`Kind.claims`: `draft:DIR` naming an EAGLE-3 head reads as `eagle3:DIR`);
an older name of a serving mode (`OLD_MODES`: `self_speculation`) and of serving.json's `draft_kind`
(`modeling.eagle3_files.OLD_KIND_NAMES`: `layers`) are read by `mode_name` and `draft_kind_name`.

Torch-free at import (drafters are built on first use), so `serving show` and the metrics read the modes fast.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from specdistill.acceptance import NGRAM_WINDOW
from specdistill.modeling.eagle3_files import DRAFT_MODEL, kind_name  # DRAFT_MODEL: a draft directory's kind unless another claims it

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from specdistill.speculative.drafters import Drafter


class DrafterSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Kind:
    name: str
    mode: str  # the serving mode it is written as: draft | self-spec | ngram | ...
    usage: str  # how its spec is written, for error messages
    check: Callable[[str], bool]  # is this argument (after "kind:", "" when there is none) valid?
    # (target, spec, the target's identity: what a corpus is checked against) -> the drafter
    build: Callable[[PreTrainedModel, DrafterSpec, TargetKey], Drafter]
    served: bool = True  # False: measured, never written to serving.json (no engine runs it)
    # the serving.json keys the spec's text decides (a window, an exit layer, a corpus); a draft directory is
    # the writer's to give (a registered copy, an exported early-exit draft)
    serving: Callable[[DrafterSpec], dict[str, Any]] = lambda spec: {}
    llamacpp: bool = True  # llama-server runs it (its lookup cache is its own format: no suffix corpus)
    # its vLLM `speculative_config` and SGLang flags, from a serving config (`ops.serving.ServingConfig`);
    # None: as the first kind served in its mode writes them (a new n-gram kind served as n-gram is)
    vllm: Callable[[Any], dict[str, Any] | None] | None = None
    sglang: Callable[[Any], list[str]] | None = None
    needs: tuple[str, str] = ()  # the serving config key its mode cannot be served without, and its name for errors
    aliases: tuple[str, ...] = ()  # older spellings of the name, read from records written before, never written
    # (the older kind, is this argument of it ours?): records that kind wrote for what is now this kind
    claims: tuple[str, Callable[[str], bool]] | None = None
    draft_dir: bool = False  # its argument is a draft's directory (or reference): `DrafterSpec.path`
    label: str = ""  # what `serving show` calls its draft ("EAGLE-3 head"; "": nothing beside the version)
    # drafts from its target's hidden states: it loads, replays and smoke-tests only beside its target
    on_target: bool = False
    # the target layers whose hidden states a draft of this kind reads (hooked while the target runs), from its
    # directory, without loading it; None: it reads none
    feature_layers: Callable[[str], list[int] | None] = lambda draft_dir: None
    tree: bool = False  # served as a tree of first-position candidates (SGLang verifies one); else as a chain
    # the γ it is first measured at, from the benchmark's: a kind may know its draft proposes fewer positions
    first_gamma: Callable[[DrafterSpec, int], int] = lambda spec, gamma: gamma
    # the lineage tags a registered draft of this kind carries (`ops.registry`), from its directory
    tags: Callable[[str], dict[str, str]] = lambda draft_dir: {}
    # a draft replayed on a target that may have changed since it was trained (an update added tokens), its
    # reference resolved (`DrafterSpec.resolved`): (target, spec, the target's tokenizer) -> why the target cannot
    # read the draft's token ids as they are ("": it can), without building the drafter; and -> (the drafter,
    # carried over to the target's vocabulary where it must be, why it was: "" when not). What is replayed is a
    # registered draft (`draft`, `eagle3`); by default a kind is built as it is and reads the target's own ids
    mismatch: Callable[[PreTrainedModel, DrafterSpec, Any], str] = lambda target, spec, tokenizer: ""
    carry: Callable[[PreTrainedModel, DrafterSpec, Any], tuple[Drafter, str]] = (
        lambda target, spec, tokenizer: (spec.build(target), ""))

    @property
    def draft_kind(self) -> str:
        """What serving.json's `draft_kind` says when this kind is served: its name (one name everywhere)."""
        return self.name


class TargetKey(NamedTuple):
    """What a suffix corpus must have been built for: the target's fingerprint and its tokenizer's digest
    (`modeling.fingerprints.tokenizer_digest`); None: not checked (a notebook's own corpus)."""

    fingerprint: str | None = None
    tokenizer: str | None = None


KINDS: dict[str, Kind] = {}
_ALIASES: dict[str, str] = {}
OFF = "off"  # the serving mode without speculation
SELF_SPEC = "self-spec"  # self-speculation: its kind, its spec (`self-spec:K`), its serving mode, `--self-spec K`
# Read only, never written: a serving mode's name in a serving.json written before the mode took its kind's name
# (`ops.serving.ServingConfig` reads it; what is served, the gauge's label included, is the new name)
OLD_MODES = {"self_speculation": SELF_SPEC}


def mode_name(mode: Any) -> Any:
    """A serving mode's one name, from the name a record gives (an old one read as its new)."""
    return OLD_MODES.get(mode, mode) if isinstance(mode, str) else mode


def draft_kind_name(draft_kind: Any) -> Any:
    """serving.json's (or a registered version's tag) `draft_kind`, its old name read as its new (`layers`)."""
    return kind_name(draft_kind)


def register_kind(kind: Kind) -> Kind:
    if kind.name in KINDS or kind.name in _ALIASES or any(a in KINDS or a in _ALIASES for a in kind.aliases):
        raise ValueError(f"drafter kind {kind.name!r} (or one of its aliases) is already registered")
    KINDS[kind.name] = kind
    _ALIASES.update(dict.fromkeys(kind.aliases, kind.name))
    return kind


def serving_modes() -> tuple[str, ...]:
    """The modes serving.json may name: each servable kind's, then `off`."""
    return (*dict.fromkeys(k.mode for k in KINDS.values() if k.served), OFF)


def served_kind(mode: str, draft_kind: str | None = None) -> Kind | None:
    """The servable kind a serving mode names (None: `off`, or a mode no kind is served as); of the kinds
    served in one mode (a layer draft and an EAGLE-3 head), the one serving.json's `draft_kind` says."""
    kinds = [k for k in KINDS.values() if k.served and k.mode == mode]
    return next((k for k in kinds if k.draft_kind == draft_kind), kinds[0] if kinds else None)


def engine_settings(mode: str, draft_kind: str | None, engine: str) -> Callable[[Any], Any] | None:
    """The served kind's settings writer for `engine` ("vllm" or "sglang"), or its mode's first kind's when it
    has none of its own; None: the mode serves without speculation."""
    kinds = (served_kind(mode, draft_kind), served_kind(mode))
    return next((getattr(k, engine) for k in kinds if k is not None and getattr(k, engine) is not None), None)


def draft_kinds() -> tuple[str, ...]:
    """What serving.json's `draft_kind` may say: each servable kind's."""
    return tuple(dict.fromkeys(k.draft_kind for k in KINDS.values() if k.served))


def usage() -> str:
    return ", ".join(k.usage for k in KINDS.values())


def _claimed(kind: str, arg: str) -> str:
    """The kind that now owns a spec an older, wider kind wrote (a head's `draft:DIR`), else `kind`."""
    return next((k.name for k in KINDS.values() if k.claims and k.claims[0] == kind and k.claims[1](arg)), kind)


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
        return cls(_claimed(kind, arg), arg)

    @classmethod
    def for_draft(cls, draft_dir: str | Any) -> DrafterSpec:
        """The spec of a draft directory, by the kind that claims it: `eagle3:DIR` for a head, else `draft_model:DIR`."""
        return cls(_claimed(DRAFT_MODEL, str(draft_dir)), str(draft_dir))

    def resolved(self, draft_dir: str) -> DrafterSpec:
        """This spec with its draft reference (`models:/NAME@ALIAS`) resolved to `draft_dir`, and the kind
        that directory turns out to be (a registered head named `draft_model:` reads as `eagle3:`)."""
        return self.with_(kind=_claimed(self.kind, draft_dir), arg=draft_dir)

    def __str__(self) -> str:
        return f"{self.kind}:{self.arg}" if self.arg else self.kind

    def to_dict(self) -> str:
        """Its JSON is its text (`data.record.to_dict`, and so cache keys); `parse` reads it back."""
        return str(self)

    def with_(self, **changes: Any) -> DrafterSpec:
        return replace(self, **changes)

    @property
    def of(self) -> Kind:
        """Its kind, as registered."""
        return KINDS[self.kind]

    @property
    def mode(self) -> str:
        return self.of.mode

    @property
    def served(self) -> bool:
        return self.of.served

    @property
    def runs_in_llamacpp(self) -> bool:
        return self.of.llamacpp

    def serving_keys(self) -> dict[str, Any]:
        """Its serving.json keys: the mode, the kind served and what the spec's text decides (no draft directory)."""
        return {"mode": self.mode, "draft_kind": self.of.draft_kind, **self.of.serving(self)}

    def build(self, target: PreTrainedModel, key: TargetKey = TargetKey()) -> Drafter:
        """The drafter this spec names, as its kind builds it."""
        return self.of.build(target, self, key)

    @property
    def path(self) -> str | None:
        """A draft's checkpoint or EAGLE-3 head (kinds draft_model and eagle3, and the model half of a hybrid)."""
        if self.kind == "hybrid":
            return hybrid_model(self.arg).path
        return self.arg if self.of.draft_dir else None

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


def hybrid_model(arg: str) -> DrafterSpec:
    """A hybrid's model half: a draft directory (a layer draft's or a head's, `DrafterSpec.for_draft`), or
    self-speculation written as its spec (`hybrid:self-spec:K,CORPUS`)."""
    model = hybrid_parts(arg)[0]
    kind, _, layer = model.partition(":")
    if _ALIASES.get(kind, kind) == SELF_SPEC and layer.isdigit():
        return DrafterSpec(SELF_SPEC, layer)
    return DrafterSpec.for_draft(model)


def drafter_from_spec(target: PreTrainedModel, spec: str | DrafterSpec, tree_width: int | None = None,
                      target_fingerprint: str | None = None, target_tokenizer: str | None = None) -> Drafter:
    """The drafter a spec names, built by its kind: the one way a drafter is made (the CLI, the nightly
    benchmark, the monitor's fallback). `tree_width` (default: the spec's) applies to model and suffix
    drafters; a corpus is checked against `target_fingerprint` and `target_tokenizer` (the target's
    `tokenizer_digest`) when given."""
    spec = DrafterSpec.parse(spec)
    if tree_width is not None:
        spec = spec.with_(tree_width=tree_width)
    return spec.build(target, TargetKey(target_fingerprint, target_tokenizer))

