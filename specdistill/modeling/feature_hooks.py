"""The target's features an EAGLE-3 head reads: the inputs of its feature layers, captured during the target's
own forward passes (answering, prefill, decoding) by hooks on just those layers."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel


class FeatureHooks:
    """Captures the inputs of the target's feature layers during its forward passes: forward pre-hooks on
    just those decoder layers (no `output_hidden_states` over all 30); `take()` returns them concatenated [B, T, 3·H]."""

    def __init__(self, target: PreTrainedModel, layers: list[int]):
        self.layers = list(layers)
        self._seen: dict[int, torch.Tensor] = {}
        self._handles = [
            target.model.layers[i].register_forward_pre_hook(self._hook(i), with_kwargs=True) for i in self.layers
        ]

    def _hook(self, index: int):
        def capture(module, args, kwargs):
            self._seen[index] = args[0] if args else kwargs["hidden_states"]

        return capture

    def take(self) -> torch.Tensor:
        missing = [i for i in self.layers if i not in self._seen]
        if missing:
            raise RuntimeError(f"no target features captured for layers {missing}: run a target forward first")
        features = torch.cat([self._seen[i] for i in self.layers], dim=-1)
        self._seen.clear()
        return features

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> FeatureHooks:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()
