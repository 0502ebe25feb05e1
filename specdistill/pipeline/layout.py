"""Where one stage's files lie for another stage to find them: a source's traffic (ingested under its
path, which the window maps back to the source's slice), the suffix corpus (written by the corpus stage,
read by the monitor, served through SGLang's export of it) and an EAGLE-3 head's training features
(written by the answer pass, pooled, read by the trainer). Stages do not import each other; what they
share lives here.
"""

from __future__ import annotations

from pathlib import Path

from specdistill import paths
from specdistill.data.datasets import humaneval_path, sharegpt_path
from specdistill.distill.features import FEATURE_META
from specdistill.pipeline.nightly_recipe import SourceConfig

CORPUS_FILE = "suffix_corpus.safetensors"  # beside the answers; under the state directory, the newest night's


def resolve_source_path(source: SourceConfig) -> Path:
    """The file a source names: the shipped demo traffic by its name (`sharegpt`, `humaneval`), else its path."""
    shipped = {"sharegpt": sharegpt_path, "humaneval": humaneval_path}
    return shipped[source.path]() if source.path in shipped else Path(source.path)


def current_corpus_path() -> Path:
    """The newest night's corpus, what the monitor reads."""
    return paths.home() / CORPUS_FILE


def sglang_corpus_path(corpus: str | Path) -> Path:
    corpus = Path(corpus)
    return corpus.with_name(corpus.stem + ".sglang.jsonl")


def features_dir(teacher_cache: str | Path, layers: list[int] | None = None) -> Path:
    """Where an EAGLE-3 head's training features for these answers live: beside their teacher cache,
    so every run on the same answers reuses them. The answer pass writes `features` (the default
    layers); a head that reads other `layers` (a warm start from an imported head) gets a directory of
    its own, which the trainer fills."""
    directory = Path(teacher_cache).parent / "features"
    meta = directory / FEATURE_META
    if layers is not None and meta.is_file() and paths.read_json(meta, "feature cache file").get("layers") != list(layers):
        return directory.with_name("features-layers-" + "-".join(str(i) for i in layers))
    return directory
