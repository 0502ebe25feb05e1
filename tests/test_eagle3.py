"""The EAGLE-3 head: the training-time-test unroll sees exactly what cached drafting sees."""

import copy

import pytest
import torch

from specdistill.modeling.eagle3 import (
    Eagle3Cache,
    Eagle3Draft,
    Eagle3ShapeError,
    check_head_fits,
    default_aux_layers,
    eagle3_config,
)
from specdistill.modeling.eagle3_init import init_eagle3_from_target
from specdistill.modeling.feature_hooks import FeatureHooks
from specdistill.modeling.vocab import DraftVocab
from tests.conftest import lively, make_tiny_llama


@pytest.fixture
def target():
    return lively(make_tiny_llama(vocab_size=64, hidden=32, layers=6, seed=3), seed=3)


@pytest.fixture
def head(target):
    vocab = DraftVocab(torch.arange(0, 64, 2), 64)
    head = init_eagle3_from_target(target, vocab)
    with torch.no_grad():  # the init leaves the token half of fc at zero: make every input matter
        for p in head.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.3)
    return head.double().eval()


def test_default_layers_follow_vllm():
    assert default_aux_layers(30) == [2, 15, 27]
    assert default_aux_layers(32) == [2, 16, 29]
    with pytest.raises(Eagle3ShapeError, match="at least 4 layers"):
        default_aux_layers(3)


def test_config_fields(target):
    config = eagle3_config(target.config, 32)
    assert config.architectures == ["LlamaForCausalLMEagle3"]
    assert config.num_hidden_layers == 1
    assert config.draft_vocab_size == 32 and config.vocab_size == 64
    assert config.target_hidden_size == 32
    assert config.eagle_config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
    with pytest.raises(Eagle3ShapeError, match="three layer indices"):
        eagle3_config(target.config, 32, [1, 2, 9])


def test_init_copies_target_weights(target):
    vocab = DraftVocab(torch.arange(10, 42), 64)
    head = init_eagle3_from_target(target, vocab)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[10:42])
    assert torch.equal(head.midlayer.mlp.down_proj.weight, target.model.layers[-1].mlp.down_proj.weight)
    assert torch.equal(head.draft_vocab.token_ids, vocab.token_ids)
    assert head.embed_tokens is target.get_input_embeddings()
    assert not head.embed_tokens.weight.requires_grad


def test_hooks_capture_layer_inputs(target):
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with FeatureHooks(target, [0, 2, 5]) as hooks:
        full = target(input_ids=ids, output_hidden_states=True).hidden_states
        features = hooks.take()
    assert torch.equal(features, torch.cat([full[0], full[2], full[5]], dim=-1))
    assert not target.model.layers[0]._forward_pre_hooks  # removed on exit


def with_norms(head, **options) -> Eagle3Draft:
    """The head's weights in a head with Eagle 3.1 switches set; the norms they add get non-trivial weights."""
    config = copy.deepcopy(head.config)
    for name, on in options.items():
        setattr(config, name, on)
    normed = Eagle3Draft(config, head.embed_tokens).double()
    missing, _ = normed.load_state_dict(head.state_dict(), strict=False)
    with torch.no_grad():
        for name in missing:
            normed.get_parameter(name).copy_(1 + 0.3 * torch.randn_like(normed.get_parameter(name)))
    return normed.eval()


EAGLE31 = [{}, {"norm_output": True, "norm_before_residual": True},
           {"norm_output": True, "norm_before_residual": True, "norm_before_fc": True}, {"fc_norm": True}]


@pytest.mark.parametrize("options", EAGLE31, ids=lambda o: "+".join(o) or "eagle3")
def test_unroll_matches_cached_drafting(target, head, options):
    head = with_norms(head, **options)
    torch.manual_seed(0)
    t, steps = 9, 3
    features = torch.randn(1, t, 3 * 32, dtype=torch.float64)
    next_ids = torch.randint(0, 64, (1, t))
    unrolled = head.unroll(next_ids, features, steps, torch.ones(1, t, dtype=torch.bool))

    # step 0 everywhere: one cached call over the whole sequence
    cache = Eagle3Cache()
    hidden0 = head(next_ids, head.project(features), torch.arange(t)[None], cache)
    torch.testing.assert_close(head.logits(hidden0), unrolled[0])

    # later steps at position p: a round that starts after p drafts steps 1.. from its own outputs
    for p in range(t - steps + 1):
        cache = Eagle3Cache()
        hidden = head(next_ids[:, : p + 1], head.project(features[:, : p + 1]), torch.arange(p + 1)[None], cache)[:, -1:]
        for j in range(1, steps):
            hidden = head(next_ids[:, p + j : p + j + 1], hidden, torch.tensor([[p + j]]), cache)
            torch.testing.assert_close(head.logits(hidden)[0, 0], unrolled[j][0, p])


def test_each_norm_switch_changes_the_drafts_and_none_changes_nothing(head):
    """A switch that changed nothing would be a switch not implemented; an empty one must be today's head exactly."""
    torch.manual_seed(2)
    features, next_ids = torch.randn(1, 6, 96, dtype=torch.float64), torch.randint(0, 64, (1, 6))
    valid = torch.ones(1, 6, dtype=torch.bool)
    today = head.unroll(next_ids, features, 3, valid)
    assert all(torch.equal(a, b) for a, b in zip(today, with_norms(head).unroll(next_ids, features, 3, valid)))
    for name in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
        other = with_norms(head, **{name: True}).unroll(next_ids, features, 3, valid)
        step = 0 if name != "norm_output" else 1  # norm_output first shows in what step 1 reads
        assert not torch.allclose(other[step], today[step]), name
    with pytest.raises(Eagle3ShapeError, match="norm_before_fc and fc_norm are exclusive"):
        with_norms(head, norm_before_fc=True, fc_norm=True)


def test_unroll_ignores_padding(target, head):
    torch.manual_seed(1)
    features = torch.randn(2, 7, 96, dtype=torch.float64)
    next_ids = torch.randint(0, 64, (2, 7))
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, 5:] = False
    both = head.unroll(next_ids, features, 2, valid)
    alone = head.unroll(next_ids[1:, :5], features[1:, :5], 2, valid[1:, :5])
    torch.testing.assert_close(both[0][1, :5], alone[0][0])
    torch.testing.assert_close(both[1][1, :4], alone[1][0, :4])



def test_later_steps_at_a_share_of_entries_are_exact_for_those_entries(target, head):
    """`deep`: the steps after the first run at the marked entries only, each giving what the full unroll gives
    there (kept rows with `keep`), so depth can be trained on a share of positions at a share of the cost."""
    torch.manual_seed(2)
    b, t, steps = 3, 9, 4
    features = torch.randn(b, t, 96, dtype=torch.float64)
    next_ids = torch.randint(0, 64, (b, t))
    valid = torch.ones(b, t, dtype=torch.bool)
    valid[2, 6:] = False
    deep = (torch.rand(b, t) < 0.4) & valid
    deep[1] = False  # a row with no marked entry at all
    full = head.unroll(next_ids, features, steps, valid)
    sparse = head.unroll(next_ids, features, steps, valid, deep=deep)
    torch.testing.assert_close(sparse[0], full[0])  # the first step runs everywhere
    for j in range(1, steps):
        torch.testing.assert_close(sparse[j], full[j][deep])
    keep = [torch.rand(b, t) < 0.7 for _ in range(steps)]
    kept = head.unroll(next_ids, features, steps, valid, keep, deep=deep)
    torch.testing.assert_close(kept[0], full[0][keep[0]])
    for j in range(1, steps):
        torch.testing.assert_close(kept[j], full[j][keep[j] & deep])
    # gradients flow through the shared first step from every step
    head.zero_grad()
    sum(x.sum() for x in head.unroll(next_ids, features.requires_grad_(), steps, valid, deep=deep)).backward()
    assert head.fc.weight.grad is not None and float(head.fc.weight.grad.abs().sum()) > 0

def test_cache_crop():
    cache = Eagle3Cache()
    cache.append(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4))
    cache.crop(3)
    assert cache.length == 3
    cache.crop(7)
    assert cache.length == 3


def test_head_for_another_target_is_refused(target, head):
    other = make_tiny_llama(vocab_size=64, hidden=48, layers=3)
    with pytest.raises(Eagle3ShapeError, match="hidden size 48.*layers \\[2, 3, 3\\]"):
        check_head_fits(head, other)


def test_cached_forward_builds_its_mask_on_the_heads_device(head):
    """The causal mask follows the head's device (a CPU-only mask broke any GPU run); checked on meta."""
    meta = head.to("meta")
    out = meta(torch.zeros(1, 3, dtype=torch.long, device="meta"), torch.zeros(1, 3, 32, device="meta", dtype=torch.float64),
               torch.arange(3, device="meta")[None], Eagle3Cache())
    assert out.shape == (1, 3, 32) and out.device.type == "meta"


# --------------------------------------------------------------------------------------------
# targets beyond Llama: every architecture transformers ships that the head supports, and one it refuses

def _tiny_config(arch: str):
    import transformers

    common = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    configs = {
        "LlamaForCausalLM": lambda: transformers.LlamaConfig(**common),
        "MistralForCausalLM": lambda: transformers.MistralConfig(**common),
        "Qwen2ForCausalLM": lambda: transformers.Qwen2Config(**common),
        "Qwen3ForCausalLM": lambda: transformers.Qwen3Config(**common, head_dim=8),
        "Gemma2ForCausalLM": lambda: transformers.Gemma2Config(**common, head_dim=8, query_pre_attn_scalar=8),
        "Phi3ForCausalLM": lambda: transformers.Phi3Config(**common),  # fused qkv_proj and gate_up_proj
        "GPT2LMHeadModel": lambda: transformers.GPT2Config(vocab_size=300, n_embd=32, n_layer=4, n_head=4,
                                                          n_positions=256, bos_token_id=1, eos_token_id=2),
    }
    config = configs[arch]()
    config.architectures = [arch]
    return config


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                  "Gemma2ForCausalLM", "Phi3ForCausalLM", "GPT2LMHeadModel"])
def test_draft_init_eagle3_works_or_refuses_each_architecture_in_one_line(arch, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from specdistill.cli import main
    from specdistill.modeling.eagle3 import EAGLE3_TARGET_ARCHITECTURES
    from specdistill.modeling.models import load_model
    from specdistill.speculative import drafter_from_spec, generate
    from tests.conftest import train_bpe

    torch.manual_seed(0)
    model = lively(AutoModelForCausalLM.from_config(_tiny_config(arch)), seed=1, std=0.3).float()
    target_dir, out = tmp_path / "target", tmp_path / "head"
    model.save_pretrained(target_dir)
    train_bpe(300).save_pretrained(target_dir)
    code = main(["draft", "init", "--target", str(target_dir), "--kind", "eagle3", str(out)])
    err = capsys.readouterr().err
    if arch not in EAGLE3_TARGET_ARCHITECTURES:
        assert code == 2 and not out.exists()
        line = err.strip().splitlines()[-1]
        assert line == (f"specdistill: error: {target_dir}: an EAGLE-3 head cannot be built for architecture {arch} "
                        f"(supported: {', '.join(EAGLE3_TARGET_ARCHITECTURES)})")
        assert "Loading weights" not in err  # refused before the target loads
        return
    assert code == 0, err
    target = load_model(target_dir, dtype="float32")
    drafter = drafter_from_spec(target.model, f"eagle3:{out}")
    assert type(drafter).__name__ == "EagleDrafter"
    for prompt in ([5, 17, 42, 9], [100, 3, 3, 250, 7, 61]):
        base = generate(target.model, prompt, max_new_tokens=12, stop_token_ids=[])
        spec = generate(target.model, prompt, max_new_tokens=12, drafter=drafter, gamma=3, stop_token_ids=[])
        assert spec.output_ids == base.output_ids and spec.stats.counts.rounds > 0  # lossless, and it did draft


def test_feature_alignment_reads_the_next_entry_and_skips_padding():
    from specdistill.modeling.eagle3 import feature_alignment

    projected = torch.randn(2, 5, 8)
    valid = torch.ones(2, 5, dtype=torch.bool)
    valid[1, 3:] = False
    shifted = torch.cat([projected[:, 1:], torch.randn(2, 1, 8)], dim=1)  # out_t = p_{t+1}: aligned
    assert float(feature_alignment(shifted, projected, valid)) == pytest.approx(0.0, abs=1e-6)
    off = shifted.clone()
    off[1, 3] += 100.0  # an entry whose next one is padding: not read
    assert float(feature_alignment(off, projected, valid)) == pytest.approx(0.0, abs=1e-6)
    assert float(feature_alignment(torch.zeros_like(projected), projected, valid)) == pytest.approx(1.0)
