"""bf16 linear layers on a CPU through oneDNN with weights packed once, not at every call.

`F.linear` in bf16 on a CPU hands oneDNN the plain weight on every call, and oneDNN reorders it into
its blocked layout each time. For the few rows of a decode step that reorder is most of the work:
on the 2-core AVX-512-BF16 CPU, `[1, 576] x [576, 1536]` took 62 µs through `F.linear` and 34 µs
with the weight reordered once (`mkldnn._reorder_linear_weight`) and reused
(`mkldnn._linear_pointwise`); the demo target's 49k-token head 3.8 ms against 2.2 ms. Whole bf16
decode steps of the demo target ran 1.40x (1 row), 1.34x (5 rows) and 1.23x (16 rows) faster, and
their logits were bit-identical: both paths run the same oneDNN kernels, so nothing about
losslessness changes. `benchmarks/dtype_speed.py` and `benchmarks/answer_generation.py` measure
the effect on decoding and on answer generation.

Only bf16: oneDNN's fp32 results differ from MKL's in the last bits and by row count, which would
break fp32's exact-equality lossless check. A packed layer is still an `nn.Linear` (same
parameters, same `state_dict`); it falls back to `F.linear` whenever autograd needs the weight or
input, or the weight is no longer bf16 on a CPU, and packs again when the weight changed (a
training step, `load_state_dict`, `.to()`), so a packed model can still be trained or moved.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def packing_available() -> bool:
    """True where this torch build has the oneDNN ops a packed layer calls."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(torch.nn.Linear):
    """An `nn.Linear` whose bf16 CPU inference runs on a weight packed for oneDNN once."""

    def _packed_weight(self) -> torch.Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version, w.shape)
        if getattr(self, "_packed_key", None) != key:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self._packed_key = key
        return self._packed

    def __getstate__(self) -> dict:
        """Copies and pickles leave the packed weight behind (oneDNN's opaque tensor has no storage to
        copy); the copy packs its own on first use."""
        state = self.__dict__.copy()
        state.pop("_packed", None)
        state.pop("_packed_key", None)
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (w.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or w.device.type != "cpu"
                or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
            return F.linear(x, w, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight(), self.bias, "none", [], "")


def pack_linears(model: torch.nn.Module) -> int:
    """Turn every plain `nn.Linear` of a bf16 CPU `model` into a `PackedLinear`, in place; returns how many.

    Does nothing (returns 0) where oneDNN's ops are missing or the model is not bf16 on a CPU.
    """
    if not packing_available():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype == torch.bfloat16 and module.weight.device.type == "cpu":
            module.__class__ = PackedLinear
            count += 1
    return count
