"""The MLflow pyfunc wrapper of a draft, logged as "models from code" (no pickled object).

`predict` gives the draft's own greedy continuation of each prompt: a smoke test of the logged
model. Serving systems read the HF checkpoint under the model's `artifacts/draft` directory.
"""

from __future__ import annotations

import mlflow
from mlflow.pyfunc import PythonModel


class DraftModel(PythonModel):
    def load_context(self, context):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = context.artifacts["draft"]
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True).eval()

    def predict(self, context, model_input: list[str], params=None) -> list[str]:
        import torch

        prompts = list(model_input)
        max_new_tokens = int((params or {}).get("max_new_tokens", 16))
        outputs = []
        for prompt in prompts:
            ids = self.tokenizer(prompt, return_tensors="pt")
            with torch.inference_mode():
                out = self.model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
            outputs.append(self.tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
        return outputs


mlflow.models.set_model(DraftModel())
