"""The peer's side of the train-off (benchmarks/trainoff.py runs it): speculators' own EAGLE-3 model definition
and loss, trained in the smallest loop that follows `speculators train`'s defaults. Runs inside speculators'
environment (`make speculators`), never in the project's: `python speculators_trainoff.py SPEC.json`.

Why not `speculators train` itself: speculators 0.9's Trainer moves the model and every batch to
`cuda:local_rank` when torch sees no accelerator (speculators/train/trainer.py), so it cannot run on a CPU as
shipped. What follows its defaults here, and what differs:
- the draft: `create_transformer_layer_config` + `Eagle3DraftModel.from_training_args` as `speculators train`
  builds it (llama, one layer, the verifier's widths, target layers [2, n//2, n-3], embeddings frozen, its own
  weight init) with its eagle3 defaults `norm_before_residual`, `norm_before_fc` and `norm_output` on
  (`--no-norms` turns the three off);
- the vocabulary: `build_vocab_mappings_from_distribution` over the answer tokens' frequencies, as
  `save_token_frequency_distribution` counts them, at the project's draft vocabulary size;
- the loss: its forward's kl_div against the verifier's distribution over the draft vocabulary, 3 TTT steps,
  decay 1.0; the eager implementation (the fused one is triton, which a CPU has not);
- the optimizer: AdamW lr 1e-3, weight decay 0.01, a linear schedule with warmup total//100 over 20 epochs,
  gradient clip 1.0, fp32 master weights under bf16 autocast with bf16 hidden states (fp32 on a CPU without
  native bf16, as the project's trainer);
- the layer's attention: full instead of its default sliding window of 2048 (the same mask here, where a packed
  row holds at most 2048 entries; the project's head has no sliding window, so `draft import` refuses one);
- the data: sequences packed whole (prompt and answer, loss on the answer) into one row with document ids, as its
  multipack sampler does; `total_seq_len` 2048 instead of 8192 (DIFFERS: at 8192 the dense attention of 3 TTT
  steps is 9 heads x 8192 x 24576 scores a step, more than 2 cores train in minutes); attention `sdpa` instead
  of flex attention (DIFFERS: flex attention needs torch.compile's GPU kernels);
- the target's hidden states: one teacher-forced pass here over the night's answers (what its
  `data_generation` gets from vLLM), timed apart from training.

Every head named in SPEC["evaluate"] and the heads trained here are read with one evaluator: per draft position,
greedy agreement with the target's held-out continuation under the training-time-test unroll, chained as a
drafting round accepts (the project's `eagle3_heldout_acceptance` definition).

SPEC["kind"] "peagle" trains speculators' P-EAGLE instead (a head that drafts K positions in one forward: mask
tokens and a learned `mask_hidden` stand in for the positions not yet drafted), as `speculators train
--speculator-type peagle` builds it by default: a qwen3 layer, `norm_before_residual` only, trainable embeddings,
the mask token its `resolve_mask_token_id` picks, 8 depths under COD sampling (ratio 0.7, floor 0.2). Its held-out
reading runs its own forward with every anchor at every depth (no sampling) and reads depth j at anchor i as the
draft of token i+2+j, chained as for EAGLE-3: the same numbers a parallel drafting round would accept.
"""

from __future__ import annotations

import json
import random
import resource
import sys
import time
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import load_file
from speculators.losses import resolve_loss_config
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
from speculators.models.peagle import core as peagle_core
from speculators.train.cli import create_transformer_layer_config
from speculators.train.utils import resolve_mask_token_id
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
from transformers import AutoConfig, AutoModelForCausalLM, get_linear_schedule_with_warmup

EPOCHS, LR, WEIGHT_DECAY, CLIP, TTT_STEPS, SLIDING_WINDOW = 20, 1e-3, 0.01, 1.0, 3, 2048
NUM_DEPTHS, DOWN_SAMPLE_RATIO, DOWN_SAMPLE_RATIO_MIN = 8, 0.7, 0.2  # `speculators train`'s P-EAGLE defaults


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


def target_states(target_dir: str, examples: list[dict], aux: list[int], dtype: torch.dtype) -> list[dict]:
    """Each example's aux-layer inputs [L, 3H] and last layer's output before the final norm [L, H], bf16."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    seen: dict = {}
    hooks = [model.model.layers[i].register_forward_pre_hook(
        lambda m, args, kw, i=i: seen.__setitem__(i, args[0] if args else kw["hidden_states"]), with_kwargs=True)
        for i in aux]
    last = model.model.layers[-1]
    hooks.append(last.register_forward_hook(lambda m, args, out: seen.__setitem__("last", out[0] if isinstance(out, tuple) else out)))
    out = []
    with torch.no_grad():
        for n, ex in enumerate(examples):
            ids = torch.tensor(ex["ids"])[None]
            model.model(input_ids=ids)  # the decoder stack is enough: the hooks hold what the head reads
            out.append({"ids": ids[0], "mask": torch.tensor(ex["mask"], dtype=torch.bool),
                        "aux": torch.cat([seen[i][0] for i in aux], -1).to(torch.bfloat16),
                        "last": seen["last"][0].to(torch.bfloat16)})
            if n % 200 == 0:
                print(f"target states {n}/{len(examples)}", file=sys.stderr, flush=True)
    for h in hooks:
        h.remove()
    return out


def draft_vocabulary(train: list[dict], size: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """speculators' d2t/t2d from the answer tokens' frequencies (save_token_frequency_distribution's count)."""
    ids = torch.cat([s["ids"][s["mask"]] for s in train])
    unique, counts = ids.unique(return_counts=True)
    return build_vocab_mappings_from_distribution(dict(zip(unique.tolist(), counts.tolist(), strict=True)), size, vocab_size)


def build_draft(target_dir: str, d2t: torch.Tensor, t2d: torch.Tensor, size: int, norms: bool,
                kind: str = "eagle3") -> Eagle3DraftModel:
    layer = create_transformer_layer_config(verifier_name_or_path=target_dir, num_layers=1,
                                            draft_arch="llama" if kind == "eagle3" else "qwen3",
                                            hidden_act="silu", sliding_window=SLIDING_WINDOW, full_attention_indices=[0])
    if kind == "peagle":  # its CLI's defaults for peagle: norm_before_fc and norm_output off
        return PEagleDraftModel.from_training_args(
            verifier_config=layer, t2d=t2d, d2t=d2t, draft_vocab_size=size, norm_before_residual=True,
            mask_token_id=resolve_mask_token_id(target_dir, layer.vocab_size), num_depths=NUM_DEPTHS,
            verifier_name_or_path=target_dir, target_layer_ids=None, draft_attn_impl="sdpa")
    return Eagle3DraftModel.from_training_args(
        verifier_config=layer, t2d=t2d, d2t=d2t, draft_vocab_size=size, norm_before_residual=norms,
        norm_before_fc=norms, norm_output=norms, fc_norm=False, embed_requires_grad=False, ttt_steps=TTT_STEPS,
        verifier_name_or_path=target_dir, target_layer_ids=None, draft_attn_impl="sdpa")


def shifted(s: dict) -> dict:
    """speculators' `shift_batch`: token t+1 beside the features at t, positions from 1."""
    n = s["ids"].numel() - 1
    return {"input_ids": s["ids"][1:], "hidden_states": s["aux"][:-1], "verifier_last_hidden_states": s["last"][1:],
            "loss_mask": s["mask"][1:], "position_ids": torch.arange(1, n + 1)}


def packed_rows(train: list[dict], total_seq_len: int, rng: random.Random) -> list[list[int]]:
    """One epoch: the sequences shuffled, then packed whole into rows of at most total_seq_len entries."""
    order = list(range(len(train)))
    rng.shuffle(order)
    rows, row, used = [], [], 0
    for i in order:
        n = min(train[i]["ids"].numel() - 1, total_seq_len)
        if used + n > total_seq_len and row:
            rows.append(row)
            row, used = [], 0
        row.append(i)
        used += n
    return rows + ([row] if row else [])


def collate(train: list[dict], row: list[int], total_seq_len: int) -> dict:
    parts = [shifted(train[i]) for i in row]
    batch = {k: torch.cat([p[k] for p in parts])[:total_seq_len][None] for k in parts[0]}
    batch["document_ids"] = torch.cat([torch.full((p["input_ids"].numel(),), d) for d, p in enumerate(parts)])[:total_seq_len][None]
    return batch


def save(model: Eagle3DraftModel, out: Path, record: dict) -> None:
    model.save_pretrained(str(out))
    (out / "trainoff.json").write_text(json.dumps(record, indent=1))


def train(spec: dict, train_set: list[dict], model: Eagle3DraftModel, dtype: torch.dtype, out: Path) -> dict:
    """AdamW under its defaults until both stops are reached: the minutes, and the answer tokens."""
    rng = random.Random(spec["seed"])
    steps_per_epoch = len(packed_rows(train_set, spec["total_seq_len"], random.Random(0)))
    total = EPOCHS * steps_per_epoch
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    sched = get_linear_schedule_with_warmup(opt, total // 100, total)
    loss_config = resolve_loss_config("kl_div", "eager")
    if spec.get("kind", "eagle3") == "peagle":
        unroll = {"num_depths": NUM_DEPTHS, "down_sample_ratio": DOWN_SAMPLE_RATIO,
                  "down_sample_ratio_min": DOWN_SAMPLE_RATIO_MIN}
    else:
        unroll = {"ttt_steps": TTT_STEPS, "ttt_step_loss_decay": 1.0}
    minutes, want_tokens, cap = spec["minutes"], spec["tokens"], spec["cap_minutes"]
    model.train()
    step = answer_tokens = positions = 0
    saved: dict = {}
    log = []
    t0 = time.perf_counter()
    while True:
        for row in packed_rows(train_set, spec["total_seq_len"], rng):
            batch = collate(train_set, row, spec["total_seq_len"])
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                _, loss, _ = model(**{k: (v.to(dtype) if v.is_floating_point() else v) for k, v in batch.items()},
                                   loss_config=loss_config, **unroll)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, CLIP)
            opt.step()
            sched.step()
            step += 1
            positions += int(batch["input_ids"].numel())
            answer_tokens += int(batch["loss_mask"].sum())
            elapsed = (time.perf_counter() - t0) / 60
            if step % 10 == 0:
                log.append({"step": step, "minutes": round(elapsed, 3), "loss": float(loss), "answer_tokens": answer_tokens})
                print(f"step {step} {elapsed:.2f} min loss {float(loss):.3f} answer tokens {answer_tokens}",
                      file=sys.stderr, flush=True)
            record = {"steps": step, "minutes": elapsed, "answer_tokens": answer_tokens, "positions": positions,
                      "answer_tokens_per_s": answer_tokens / (elapsed * 60), "positions_per_s": positions / (elapsed * 60),
                      "peak_rss_gb": peak_rss_gb(), "loss": float(loss)}
            stops = {"minutes": elapsed >= minutes, "tokens": bool(want_tokens) and answer_tokens >= want_tokens}
            if elapsed >= cap:  # the cap stops the longer of the two where it was, and says so
                stops = {name: True for name in stops if name == "minutes" or want_tokens}
                record["cap_reached"] = True
            for name, reached in stops.items():
                if reached and name not in saved:
                    saved[name] = record
                    save(model, out / f"{spec.get('name', 'peer')}-{name}", record)
            if "minutes" in saved and ("tokens" in saved or not want_tokens):
                return {"saved": saved, "log": log, "steps_per_epoch": steps_per_epoch}


def load_head(path: str, target_dir: str) -> Eagle3DraftModel:
    """A speculators-format head (ours exported, or trained here), embeddings from the target when left out."""
    parallel = json.loads((Path(path) / "config.json").read_text()).get("speculators_model_type") == "peagle"
    config_class, model_class = (PEagleSpeculatorConfig, PEagleDraftModel) if parallel else (Eagle3SpeculatorConfig, Eagle3DraftModel)
    config = config_class.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "sdpa"
    config.speculators_config.verifier.name_or_path = target_dir  # an export names the target by its hub id, or not at all
    model = model_class.from_pretrained(path, config=config)
    if "embed_tokens.weight" not in load_file(str(Path(path) / "model.safetensors")):
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        with torch.no_grad():
            model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    return model


@torch.no_grad()
def heldout_acceptance(model: Eagle3DraftModel, heldout: list[dict], dtype: torch.dtype) -> dict:
    """Per draft position j (0-based): at entry i the draft of step j predicts token i+2+j; counted where that
    token is an answer token; `accepted` chains positions 1..j as a drafting round does."""
    if isinstance(model, PEagleDraftModel):
        return heldout_acceptance_parallel(model, heldout, dtype)
    model.eval()
    agree, chain, total = torch.zeros(TTT_STEPS), torch.zeros(TTT_STEPS), torch.zeros(TTT_STEPS)
    for s in heldout:
        b = shifted(s)
        n = b["input_ids"].numel()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            drafts = model(hidden_states=b["hidden_states"][None].to(dtype), input_ids=b["input_ids"][None],
                           document_ids=torch.zeros(1, n, dtype=torch.long), position_ids=b["position_ids"][None],
                           ttt_steps=TTT_STEPS)
        predicted = [d[0] + model.d2t[d[0]] if model.d2t is not None else d[0] for d in drafts]
        a, c, t = chain_counts(predicted, s["ids"], s["mask"], torch.arange(n))
        agree, chain, total = agree + a, chain + c, total + t
    return summarize(agree, chain, total)


def chain_counts(predicted: list[torch.Tensor], ids: torch.Tensor, mask: torch.Tensor, anchors: torch.Tensor) -> tuple:
    """Per draft position j: agreement, chained agreement and label count, where position j's draft at anchor i is
    of token i+2+j and counts where that token is an answer token."""
    depth = len(predicted)
    agree, chain, total = torch.zeros(depth), torch.zeros(depth), torch.zeros(depth)
    alive = torch.ones(anchors.numel(), dtype=torch.bool)
    for j, predicted_j in enumerate(predicted):
        where = anchors + 2 + j
        has = where < ids.numel()
        label = torch.where(has, ids[where.clamp(max=ids.numel() - 1)], -1)
        has &= mask[where.clamp(max=ids.numel() - 1)]
        ok = (predicted_j == label) & has
        alive &= ok
        agree[j] += int(ok.sum())
        chain[j] += int((alive & has).sum())
        total[j] += int(has.sum())
    return agree, chain, total


def summarize(agree: torch.Tensor, chain: torch.Tensor, total: torch.Tensor) -> dict:
    per_position = (agree / total.clamp_min(1)).tolist()
    accepted = (chain / total.clamp_min(1)).tolist()
    given = [accepted[0]] + [accepted[j] / max(accepted[j - 1], 1e-9) for j in range(1, len(accepted))]
    tau = [1.0 + sum(accepted[:k]) for k in range(1, len(accepted) + 1)]
    return {"per_position": per_position, "accepted": accepted, "given_previous": given, "entries": int(total[0]),
            "tau_chain": tau[-1], "tau_chain_at": tau}


def parallel_logits(model: PEagleDraftModel, b: dict, anchor_pos: torch.Tensor, depth: torch.Tensor,
                    dtype: torch.dtype, depths: int) -> torch.Tensor:
    """P-EAGLE's own forward over the given (anchor, depth) elements instead of a COD sample, its logits kept from
    the loss they would feed."""
    kept: dict = {}

    def keep_logits(logits, **_):
        kept["logits"] = logits[0]
        return logits.new_zeros(()), {}

    n = b["input_ids"].numel()
    with (mock.patch.object(peagle_core, "generate_cod_sample_indices", lambda **_: (anchor_pos, depth)),
          mock.patch.object(peagle_core, "compute_metrics", keep_logits),
          torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)):
        model(hidden_states=b["hidden_states"][None].to(dtype), input_ids=b["input_ids"][None],
              document_ids=torch.zeros(1, n, dtype=torch.long), position_ids=b["position_ids"][None],
              loss_mask=b["loss_mask"][None].float(), verifier_last_hidden_states=b["verifier_last_hidden_states"][None].to(dtype),
              num_depths=depths)
    return kept["logits"]


@torch.no_grad()
def heldout_acceptance_parallel(model: PEagleDraftModel, heldout: list[dict], dtype: torch.dtype,
                                depths: int = NUM_DEPTHS) -> dict:
    """P-EAGLE's held-out acceptance: its own forward with every anchor at every depth (COD sampling replaced by
    all of them), the logits kept from its loss; depth j at anchor i drafts token i+2+j."""
    model.eval()
    agree, chain, total = torch.zeros(depths), torch.zeros(depths), torch.zeros(depths)
    for s in heldout:
        b = shifted(s)
        n, ids, mask = b["input_ids"].numel(), s["ids"], s["mask"]
        positions = torch.arange(n)
        labelled = torch.stack([mask[(positions + 2 + j).clamp(max=ids.numel() - 1)] & (positions + 2 + j < ids.numel())
                                for j in range(depths)]).any(0)
        anchors = positions[labelled]  # those whose round drafts at least one answer token
        at_depth = [positions] + [anchors[anchors + d <= n - 1] for d in range(1, depths)]
        anchor_pos = torch.cat(at_depth)
        depth = torch.cat([torch.full((a.numel(),), d) for d, a in enumerate(at_depth)])
        logits = parallel_logits(model, b, anchor_pos, depth, dtype, depths)
        draft = logits.argmax(-1)
        draft = draft + model.d2t[draft] if model.d2t is not None else draft
        predicted, start = [], n
        for d in range(depths):  # the anchors' drafts at each depth, -1 where the chain ran off the sequence
            p = torch.full((anchors.numel(),), -1, dtype=torch.long)
            if d == 0:
                p = draft[:n][anchors]
            else:
                m = anchors + d <= n - 1
                p[m] = draft[start:start + int(m.sum())]
                start += int(m.sum())
            predicted.append(p)
        a, c, t = chain_counts(predicted, ids, mask, anchors)
        agree, chain, total = agree + a, chain + c, total + t
    return summarize(agree, chain, total)


def main(spec: dict) -> None:
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(spec["seed"])
    dtype = getattr(torch, spec["dtype"])
    out = Path(spec["out"])
    data = json.loads(Path(spec["examples"]).read_text())
    config = AutoConfig.from_pretrained(spec["target"])
    n = config.num_hidden_layers
    aux = [2, n // 2, n - 3]  # speculators' default target layers (the project's default too)
    t0 = time.perf_counter()
    train_set = target_states(spec["target"], data["train"], aux, dtype) if spec["minutes"] > 0 else []  # 0: evaluate only
    heldout = target_states(spec["target"], data["heldout"], aux, dtype)
    feature_seconds = time.perf_counter() - t0
    result: dict = {"kind": spec.get("kind", "eagle3"), "feature_pass_seconds": feature_seconds, "train_sequences": len(train_set),
                    "heldout_sequences": len(heldout), "aux_layers": aux, "dtype": spec["dtype"],
                    "rss_before_training_gb": peak_rss_gb(), "recipe": "default" if spec["norms"] else "no-norms",
                    "total_seq_len": spec["total_seq_len"]}
    if spec["minutes"] > 0:
        d2t, t2d = draft_vocabulary(train_set, spec["draft_vocab_size"], config.vocab_size)
        torch.manual_seed(spec["seed"])
        model = build_draft(spec["target"], d2t, t2d, spec["draft_vocab_size"], spec["norms"], spec.get("kind", "eagle3"))
        result["train"] = train(spec, train_set, model, dtype, out)
    result["heldout"] = {}
    prefix = spec.get("name", "peer")
    heads = {name: str(out / f"{prefix}-{name}") for name in ("minutes", "tokens") if (out / f"{prefix}-{name}").is_dir()}
    heads.update(spec.get("evaluate", {}))
    for name, path in heads.items():
        result["heldout"][name] = heldout_acceptance(load_head(path, spec["target"]), heldout, dtype)
        print(f"held-out {name}: {result['heldout'][name]}", file=sys.stderr, flush=True)
    if spec["minutes"] > 0:  # an evaluation-only run (minutes 0) answers on stdout, never over the training's record
        (out / f"{prefix}_result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "train"}))


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
