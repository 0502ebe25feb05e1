"""bf16 linear layers on a CPU through oneDNN with weights packed once, not at every call.

`F.linear` in bf16 on a CPU makes oneDNN reorder the weight into its blocked layout at every call,
most of the work for the few rows of a decode step: on the 2-core AVX-512-BF16 CPU, `[1, 576] x
[576, 1536]` took 62 µs through `F.linear` and 34 µs with the weight reordered once and reused; the
demo target's 49k-token head 3.8 ms against 2.2 ms. Whole bf16 decode steps ran 1.40x (1 row),
1.34x (5 rows) and 1.23x (16 rows) faster with bit-identical logits (the same oneDNN kernels).
`benchmarks/experiments/dtype_speed.py` and `benchmarks/experiments/answer_generation.py` measure the effect.

Only bf16: oneDNN's fp32 results differ from MKL's in the last bits and by row count, which would
break fp32's exact-equality lossless check. A packed layer is still an `nn.Linear`; it falls back
to `F.linear` whenever autograd needs the weight or input, and packs again when the weight changed,
so a packed model can still be trained or moved.

Projections of one input (q/k/v, gate/up) are fused at inference (`fuse_projections`): the first
member's call runs one GEMM on the members' weights concatenated, and the others take their columns
of it when called with that very tensor; logits stay bit-identical. For 16 rows of the demo target,
1 thread, q/k/v took 112 µs fused against 135 µs as three calls, gate/up 320 µs against 333 µs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdistill import hardware


def packing_available() -> bool:
    """Where bf16 linear layers are packed (and the tests that need packing run): elsewhere packing would
    not pay, and on CPUs without AVX-512 BW/VL/DQ oneDNN's bf16 reorder refuses to run at all."""
    return (hardware.cpu_has_native_bf16() and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


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

    def _packable(self, x: torch.Tensor) -> bool:
        w = self.weight
        return not (w.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or w.device.type != "cpu"
                    or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._packable(x):
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight(), self.bias, "none", [], "")


def _version(x: torch.Tensor) -> int | None:
    return None if x.is_inference() else x._version  # inference tensors keep no version counter


class _FusedGroup:
    """Linear layers over one input, computed as one GEMM on their weights concatenated and packed."""

    def __init__(self, members: list[PackedLinear]):
        self.members, self.sizes = members, [m.out_features for m in members]
        self._key, self._packed, self._bias = None, None, None
        self.forget()

    def forget(self) -> None:
        self.input, self.input_version, self.parts = None, None, ()

    def __getstate__(self) -> dict:
        """As `PackedLinear.__getstate__`: the packed weight and the last GEMM are left behind."""
        state = self.__dict__.copy()
        state.update(_key=None, _packed=None, _bias=None, input=None, input_version=None, parts=())
        return state

    def packed(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        key = tuple((m.weight.data_ptr(), m.weight._version, m.weight.shape) for m in self.members)
        key += tuple((m.bias.data_ptr(), m.bias._version) for m in self.members if m.bias is not None)
        if key != self._key:
            with torch.no_grad():
                weight = torch.cat([m.weight.detach() for m in self.members])
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
                self._bias = None if self.members[0].bias is None else torch.cat([m.bias.detach() for m in self.members])
            self._key = key
        return self._packed, self._bias


class FusedLinear(PackedLinear):
    """A `PackedLinear` in a `_FusedGroup`: member 0 computes the group's GEMM, the others take their part of it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group, index = self._fused_group, self._fused_index
        if index == 0:
            group.forget()
            if not self._packable(x):
                return super().forward(x)
            weight, bias = group.packed()
            out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
            group.input, group.input_version, group.parts = x, _version(x), out.split(group.sizes, dim=-1)
            return group.parts[0]
        if group.input is x and group.input_version == _version(x) and self._packable(x):
            part = group.parts[index]
            if index == len(group.sizes) - 1:
                group.forget()
            return part
        return super().forward(x)


FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fuse_projections(model: torch.nn.Module) -> int:
    """Fuse each module's packed projections named together in `FUSED`; returns how many groups. The
    first name must be the one the model calls first: called in another order they stay correct, unfused."""
    count = 0
    for module in model.modules():
        for group_names in FUSED:
            members = [getattr(module, n, None) for n in group_names]
            if not all(type(m) is PackedLinear for m in members):
                continue
            if len({m.in_features for m in members}) > 1 or len({m.bias is None for m in members}) > 1:
                continue
            group = _FusedGroup(members)
            for index, member in enumerate(members):
                member.__class__ = FusedLinear
                member._fused_group, member._fused_index = group, index
            count += 1
    return count


def pack_linears(model: torch.nn.Module) -> int:
    """Turn every plain bf16 CPU `nn.Linear` of `model` into a `PackedLinear`, in place; returns how many."""
    if not packing_available():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype == torch.bfloat16 and module.weight.device.type == "cpu":
            module.__class__ = PackedLinear
            count += 1
    return count
