"""The MLflow pyfunc wrapper of a draft, logged as "models from code" (no pickled object).

`predict` is a smoke test of the logged model: a layer-extracted draft's own greedy continuation of
each prompt; for an EAGLE-3 head, which cannot run without its target's features, the target's
greedy continuation decoded speculatively with the head (the target named in the head's meta, or
$SPECDISTILL_EAGLE3_TARGET). Serving systems read the checkpoint under the `artifacts/draft` directory.

MLflow runs this file at every registration (to find the model it sets) as well as when it loads one:
torch comes in with a model, not with the file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import mlflow
from mlflow.pyfunc import PythonModel

from specdistill.speculative.specs import DrafterSpec

if TYPE_CHECKING:
    from transformers import PreTrainedModel

EAGLE3_TARGET_ENV = "SPECDISTILL_EAGLE3_TARGET"


class DraftModel(PythonModel):
    def load_context(self, context):
        from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: torch with a model, not at registration

        path = context.artifacts["draft"]
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.target = self.drafter = None
        spec = DrafterSpec.for_draft(path)
        if spec.of.on_target:  # a head: it drafts from its target's features, built by its kind beside it
            self.target = _target_of(path)
            self.drafter = spec.build(self.target)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True).eval()

    def predict(self, context, model_input: list[str], params=None) -> list[str]:
        import torch  # lazy: torch with a model, not at registration

        from specdistill.speculative import generate  # lazy: torch with a model, not at registration

        prompts = list(model_input)
        max_new_tokens = int((params or {}).get("max_new_tokens", 16))
        outputs = []
        for prompt in prompts:
            ids = self.tokenizer(prompt, return_tensors="pt")
            if self.drafter is not None:
                new = generate(self.target, ids["input_ids"][0], max_new_tokens=max_new_tokens, drafter=self.drafter).output_ids
            else:
                with torch.inference_mode():
                    out = self.model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
                new = out[0, ids["input_ids"].shape[1]:]
            outputs.append(self.tokenizer.decode(new, skip_special_tokens=True))
        return outputs


def _target_of(path: str) -> PreTrainedModel:
    """The target a head drafts for: $SPECDISTILL_EAGLE3_TARGET, else the one its meta names."""
    from specdistill.modeling.drafts import load_draft_meta  # lazy: torch with a model, not at registration
    from specdistill.modeling.models import load_model  # lazy: torch with a model, not at registration

    target_ref = os.environ.get(EAGLE3_TARGET_ENV) or load_draft_meta(path).get("target")
    if not target_ref or (target_ref != "demo" and not Path(target_ref).exists()):
        raise FileNotFoundError(
            f"the EAGLE-3 head in {path} drafts from its target's features, and its target {target_ref!r} is not "
            f"here: set ${EAGLE3_TARGET_ENV} to the target's directory"
        )
    return load_model(target_ref).model


mlflow.models.set_model(DraftModel())
