"""Run inside speculators' own environment (`make speculators`), never imported by the project's tests:
`python speculators_side.py build|load SPEC.json`. It uses speculators' own classes only.

- build: an EAGLE-3 head for a tiny Llama target, made with `Eagle3SpeculatorConfig` and `Eagle3DraftModel`
  (random weights, seeded; the target's embeddings), saved with `save_pretrained`;
- load: a checkpoint read back with `Eagle3SpeculatorConfig.from_pretrained` and `Eagle3DraftModel.from_pretrained`
  (what validates an export).

Both then run the head's training-time-test forward (eager attention) on the inputs in SPEC["inputs"] and save
each step's draft logits (captured at lm_head) to SPEC["logits"], for the test to compare with the project's head.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import LlamaConfig


def build(spec: dict) -> Eagle3DraftModel:
    target = Path(spec["target"])
    tc = json.loads((target / "config.json").read_text())
    layer = LlamaConfig(vocab_size=tc["vocab_size"], hidden_size=tc["hidden_size"], intermediate_size=tc["intermediate_size"],
                        num_hidden_layers=1, num_attention_heads=tc["num_attention_heads"],
                        num_key_value_heads=tc["num_key_value_heads"], max_position_embeddings=tc["max_position_embeddings"],
                        rms_norm_eps=tc["rms_norm_eps"], tie_word_embeddings=False)
    layer._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=spec["draft_vocab_size"],
        target_hidden_size=tc["hidden_size"], eagle_aux_hidden_state_layer_ids=spec["aux_layers"],
        **spec.get("options", {}),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=spec["steps"])],
            verifier=VerifierConfig.from_pretrained(str(target))))
    model = Eagle3DraftModel(config)
    torch.manual_seed(spec["seed"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("embed_tokens", "verifier_")):
                continue
            p.copy_(torch.randn_like(p) * 0.3 if p.dim() == 2 else 1 + 0.1 * torch.randn_like(p))
        weights = load_file(str(target / "model.safetensors"))
        model.embed_tokens.weight.copy_(weights["model.embed_tokens.weight"])
    if spec["draft_vocab_size"] < tc["vocab_size"]:
        ids = torch.tensor(spec["draft_ids"])
        t2d = torch.zeros(tc["vocab_size"], dtype=torch.bool)
        t2d[ids] = True
        model.load_vocab_mappings(t2d, ids - torch.arange(ids.numel()))
    model.save_pretrained(spec["out"])
    return model


def load(spec: dict) -> Eagle3DraftModel:
    config = Eagle3SpeculatorConfig.from_pretrained(spec["out"])
    assert config.speculators_model_type == "eagle3", config
    config.transformer_layer_config._attn_implementation = "eager"
    model = Eagle3DraftModel.from_pretrained(spec["out"], config=config)
    saved = load_file(str(Path(spec["out"]) / "model.safetensors"))
    if "embed_tokens.weight" not in saved:  # an export leaves the embeddings to the target: load the target's
        weights = load_file(str(Path(spec["target"]) / "model.safetensors"))
        with torch.no_grad():
            model.embed_tokens.weight.copy_(weights["model.embed_tokens.weight"])
    return model


def draft_logits(model: Eagle3DraftModel, spec: dict) -> None:
    inputs = load_file(spec["inputs"])
    seen: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.detach().clone()))
    model.eval()
    with torch.no_grad():
        model(hidden_states=inputs["features"], input_ids=inputs["next_ids"],
              document_ids=torch.zeros_like(inputs["next_ids"]), ttt_steps=spec["steps"])
    save_file({f"step{j}": t.contiguous() for j, t in enumerate(seen)}, spec["logits"])
    json.dump({"d2t": None if model.d2t is None else model.d2t.tolist()[:3], "steps": len(seen),
               "attn": model.config.transformer_layer_config._attn_implementation}, sys.stdout)


if __name__ == "__main__":
    action, spec_file = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(spec_file).read_text())
    model = build(spec) if action == "build" else load(spec)
    draft_logits(model, spec)
