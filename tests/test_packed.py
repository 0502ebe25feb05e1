import copy

import pytest
import torch

from specdistill import hardware
from specdistill.modeling.models import load_model
from specdistill.modeling.packed import FusedLinear, PackedLinear, fuse_projections, pack_linears, packing_available
from tests.conftest import make_tiny_llama, save_tiny_target

# The library's own predicate decides, so a test skips exactly where the library would not pack.
needs_packing = pytest.mark.skipif(not packing_available(),
                                   reason="no bf16 packing on this machine (packing_available(): needs native bf16 "
                                          f"and oneDNN; CPU: {hardware.cpu_info().describe()})")


def _pair(in_features=48, out_features=80, bias=True, seed=0):
    torch.manual_seed(seed)
    plain = torch.nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    packed = copy.deepcopy(plain)
    assert pack_linears(packed) == 1
    return plain, packed


@needs_packing
@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (2, 3, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_matches_linear(shape, bias):
    plain, packed = _pair(bias=bias)
    x = torch.randn(shape, dtype=torch.bfloat16)
    with torch.inference_mode():
        want, got = plain(x), packed(x)
        # as `logits_to_keep` slices hidden states (F.linear itself rounds a strided input differently)
        strided = torch.randn(2, 7, 48, dtype=torch.bfloat16)[:, -1:]
        torch.testing.assert_close(packed(strided), plain(strided.contiguous()))
    assert isinstance(packed, PackedLinear) and isinstance(packed, torch.nn.Linear)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)
    assert packed.state_dict().keys() == plain.state_dict().keys()


@needs_packing
def test_packed_follows_weight_changes_and_trains():
    plain, packed = _pair()
    x = torch.randn(4, 48, dtype=torch.bfloat16)
    with torch.no_grad():
        packed(x)  # packs
        packed.weight.mul_(-2.0)  # an in-place update (an optimizer step) repacks
        plain.weight.mul_(-2.0)
        torch.testing.assert_close(packed(x), plain(x))
        packed.load_state_dict({"weight": torch.zeros_like(packed.weight), "bias": packed.bias})
        assert packed(x).sub(packed.bias).abs().max() == 0
    # with autograd on, the packed path steps aside and gradients flow to the weight
    packed.weight.grad = None
    packed(x).sum().backward()
    assert packed.weight.grad is not None and packed.weight.grad.abs().sum() > 0


@needs_packing
def test_packed_model_copies_and_pickles_after_use(tmp_path):
    plain, packed = _pair()
    x = torch.randn(3, 48, dtype=torch.bfloat16)
    with torch.inference_mode():
        packed(x)
    twin = copy.deepcopy(packed)
    torch.save(packed, tmp_path / "packed.pt")
    with torch.inference_mode():
        torch.testing.assert_close(twin(x), plain(x))
        assert torch.equal(twin.float()(x.float()), plain.float()(x.float()))


@needs_packing
def test_packed_falls_back_outside_bf16():
    plain, packed = _pair()
    packed.float(), plain.float()
    x = torch.randn(3, 48)
    with torch.inference_mode():
        assert torch.equal(packed(x), plain(x))  # fp32 keeps MKL's exact numbers
    assert pack_linears(torch.nn.Linear(4, 4)) == 0  # fp32 layers are never packed


@needs_packing
def test_bf16_load_packs_and_keeps_greedy_logits(tmp_path):
    path = save_tiny_target(tmp_path / "tiny")
    packed = load_model(path, dtype="bfloat16").model
    kinds = {type(m).__name__ for m in packed.modules() if isinstance(m, torch.nn.Linear)}
    assert kinds == {"PackedLinear", "FusedLinear"}  # o_proj, down_proj and the head alone; q/k/v and gate/up fused
    assert not any(isinstance(m, PackedLinear) for m in load_model(path, dtype="float32").model.modules())
    plain = make_tiny_llama(vocab_size=packed.config.vocab_size).to(torch.bfloat16)
    plain.load_state_dict(packed.state_dict())
    ids = torch.randint(0, packed.config.vocab_size, (2, 9))
    with torch.inference_mode():
        torch.testing.assert_close(packed(ids).logits, plain(ids).logits)


@needs_packing
def test_fused_projections_match_separate_ones_bit_for_bit():
    torch.manual_seed(0)
    separate = make_tiny_llama().to(torch.bfloat16)
    pack_linears(separate)
    fused = copy.deepcopy(separate)
    layers = separate.config.num_hidden_layers
    assert fuse_projections(fused) == 2 * layers
    assert sum(isinstance(m, FusedLinear) for m in fused.modules()) == 5 * layers
    assert fused.state_dict().keys() == separate.state_dict().keys()
    ids = torch.randint(0, separate.config.vocab_size, (3, 11))
    with torch.inference_mode():
        assert torch.equal(fused(ids).logits, separate(ids).logits)
        attn, x = fused.model.layers[0].self_attn, torch.randn(2, 5, separate.config.hidden_size, dtype=torch.bfloat16)
        other = torch.randn_like(x)
        want = [torch.nn.functional.linear(t, m.weight) for t, m in ((x, attn.q_proj), (other, attn.k_proj), (x, attn.v_proj))]
        # k called with another tensor than q: computed on its own; v with q's input: its part of q's GEMM
        got = [attn.q_proj(x), attn.k_proj(other), attn.v_proj(x)]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
        assert attn.k_proj(x).shape == want[1].shape  # called out of order: still right, computed alone
    with torch.no_grad():  # a changed weight repacks the group
        attn.v_proj.weight.mul_(-1.0)
        _, v = attn.q_proj(x), attn.v_proj(x)
        torch.testing.assert_close(v, torch.nn.functional.linear(x, attn.v_proj.weight))
        copied = copy.deepcopy(fused)  # after a forward: the group's packed weight stays behind too
        torch.testing.assert_close(copied(ids).logits, fused(ids).logits)
    # with autograd on, every member runs F.linear and gradients flow
    fused.train()
    fused(ids).logits.float().sum().backward()
    assert attn.k_proj.weight.grad is not None and attn.k_proj.weight.grad.abs().sum() > 0


@needs_packing
def test_the_eagle_drafter_packs_a_bf16_head_however_it_was_loaded():
    """A head built or loaded outside `load_model` (the bench's drafter specs) drafted on unpacked
    weights: 3.5 ms a step against 1.6 ms packed on the demo target's head."""
    from specdistill.modeling.eagle3_init import init_eagle3_from_target
    from specdistill.modeling.vocab import DraftVocab
    from specdistill.speculative.eagle import EagleDrafter

    target = make_tiny_llama().to(torch.bfloat16)
    vocab = target.config.vocab_size
    head = init_eagle3_from_target(target, DraftVocab(torch.arange(vocab), vocab)).to(torch.bfloat16)
    EagleDrafter(head, target)
    kinds = {type(m).__name__ for m in head.modules() if isinstance(m, torch.nn.Linear)}
    assert kinds == {"PackedLinear", "FusedLinear"}


@pytest.mark.parametrize("flags", ["avx2 fma", "avx2 fma avx512f avx512bw avx512vl avx512dq"])
def test_without_native_bf16_a_bf16_load_stays_unpacked_and_keeps_the_logits(tmp_path, monkeypatch, flags):
    """Every machine: on a CPU kind without native bf16 (AVX2 only; AVX-512 without BF16) nothing is
    packed, the EAGLE drafter's head neither, and the logits are the plain bf16 model's."""
    from specdistill.modeling.eagle3_init import init_eagle3_from_target
    from specdistill.modeling.vocab import DraftVocab
    from specdistill.speculative.eagle import EagleDrafter

    monkeypatch.setenv(hardware.FLAGS_ENV, flags)
    assert not hardware.cpu_has_native_bf16() and not packing_available()
    path = save_tiny_target(tmp_path / "tiny")
    loaded = load_model(path, dtype="bfloat16").model
    assert loaded.dtype == torch.bfloat16
    assert {type(m) for m in loaded.modules() if isinstance(m, torch.nn.Linear)} == {torch.nn.Linear}
    assert pack_linears(copy.deepcopy(loaded)) == 0
    plain = make_tiny_llama(vocab_size=loaded.config.vocab_size).to(torch.bfloat16)
    plain.load_state_dict(loaded.state_dict())
    ids = torch.randint(0, loaded.config.vocab_size, (2, 9))
    with torch.inference_mode():
        assert torch.equal(loaded(ids).logits, plain(ids).logits)
    head = init_eagle3_from_target(loaded, DraftVocab(torch.arange(loaded.config.vocab_size), loaded.config.vocab_size))
    EagleDrafter(head.to(torch.bfloat16), loaded)
    assert not any(isinstance(m, PackedLinear) for m in head.modules())
