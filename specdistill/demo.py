"""`specdistill demo`: the main job on the embedded defaults.

At this stage: load the demo target through its safetensors cache, build drafts from its layers
(full and reduced vocabulary), and print the vocab report, the drafts' sizes and their cost ratios.
"""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path

from specdistill.datasets import humaneval_path
from specdistill.drafts import init_draft_from_target, measure_cost_ratio, parse_layers, save_draft
from specdistill.models import load_model, num_parameters
from specdistill.vocab import DraftVocab, build_draft_vocab, check_vocab, token_frequencies

DEMO_LAYERS = "0,1,2,29"
DEMO_DRAFT_VOCAB = 8192


def _humaneval_prompts() -> list[str]:
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def run_demo(out_dir: Path | None = None) -> dict:
    target = load_model("demo")
    cfg = target.config
    print(f"target  demo (SmolLM2-135M-Instruct)  layers {cfg.num_hidden_layers}  hidden {cfg.hidden_size}  "
          f"vocab {cfg.vocab_size}  {num_parameters(target.model) / 1e6:.1f}M params  fingerprint {target.fingerprint}")

    layers = parse_layers(DEMO_LAYERS, cfg.num_hidden_layers)
    draft = init_draft_from_target(target.model, layers)
    counts = token_frequencies(target.tokenizer, _humaneval_prompts())
    draft_vocab = build_draft_vocab(counts, DEMO_DRAFT_VOCAB, cfg.vocab_size, [target.tokenizer.eos_token_id])

    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="specdistill-demo-"))
    draft_dir = save_draft(draft, target.tokenizer, out_dir / "draft", draft_vocab=draft_vocab,
                           meta={"target_fingerprint": target.fingerprint, "layers": layers})
    reloaded = load_model(draft_dir)
    report = check_vocab(target.tokenizer, reloaded.tokenizer)
    print("\nvocab check: target vs draft")
    print(report.render())

    vocab = DraftVocab.load(draft_dir)
    c_full = measure_cost_ratio(target.model, reloaded.model)
    c_reduced = measure_cost_ratio(target.model, reloaded.model, draft_vocab=vocab)
    params = num_parameters(reloaded.model)
    body = num_parameters(reloaded.model, exclude_embeddings=True)
    print(f"\ndraft   layers {layers}  {params / 1e6:.1f}M params ({body / 1e6:.1f}M outside embeddings)  -> {draft_dir}")
    print(f"cost ratio c (draft / target, one decode step, median of interleaved repeats)")
    print(f"  full vocabulary   {cfg.vocab_size:>6} tokens   c = {c_full:.3f}")
    print(f"  reduced vocabulary {vocab.size:>5} tokens   c = {c_reduced:.3f}")
    return {
        "target_fingerprint": target.fingerprint,
        "draft_dir": str(draft_dir),
        "layers": layers,
        "draft_parameters": params,
        "vocab_identical": report.identical,
        "cost_ratio_full_vocab": c_full,
        "cost_ratio_reduced_vocab": c_reduced,
        "draft_vocab_size": vocab.size,
    }
