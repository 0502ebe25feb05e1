"""A drift scenario you can run: a new target version made from the demo target.

The update does what real target updates do to a draft: it adds domain words to the tokenizer as
single tokens (`QuantLib`, `CalcBlackScholesVega`, ...) and fine-tunes the top decoder layers on a
new domain (HumanEval code, answered as chat, with the domain words woven into the code), with the
loss on the assistant turns only: the update changes how the target answers, not how it reads
prompts. The champion draft was distilled against the old target, so its acceptance against the new
one drops, and its vocabulary no longer covers the target's: both are what the monitor must notice.

The default learning rate is measured (benchmarks/experiments/drift_acceptance.py, 30 steps on the demo target,
the 28-layer champion of tests/test_monitor_flow.py, bf16, γ=4): the smallest lr of 1e-4, 2e-4,
3e-4, 1e-3 that takes the champion's acceptance below the red line (0.577 -> 0.275 at 2e-4) while
the updated target stays a good model: its loss on held-out ShareGPT answers (chat it never trained
on) rises by at most 0.1 nats/token (1.563 -> 1.655 at 2e-4; 3e-4 adds 0.156, and 1e-3 adds 0.266
and repeats its import lines).

Only the top `top_layers` decoder layers and the new tokens' rows train (`finetune_top_layers`): a step
costs a fraction of a full one. With tied embeddings (the demo target) the trained head rows are the input rows too.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specdistill import paths
from specdistill.data.datasets import humaneval_path

DEFAULT_DOMAIN_TOKENS = ("QuantLib", "CalcBlackScholesVega", "BlackScholesProcess", "YieldTermStructure")
UPDATE_META_FILE = "specdistill_target_update.json"
TARGET_OUTPUT = "target"  # the output kind of a target update (paths.atomic_dir)


@dataclass
class TargetUpdateConfig:
    domain_tokens: tuple[str, ...] = DEFAULT_DOMAIN_TOKENS
    top_layers: int = 4
    steps: int = 30
    lr: float = 2e-4  # measured: see the module docstring
    batch_size: int = 1
    max_len: int = 320  # the prompt and the first answer tokens (HumanEval prompts run ~175 tokens)
    seed: int = 0
    examples: int | None = None  # HumanEval problems to train on (None: all 164)


@dataclass
class TargetUpdateResult:
    out_dir: str
    domain_token_ids: dict[str, int]
    vocab_size_before: int
    vocab_size_after: int
    losses: list[float] = field(default_factory=list)
    config: dict = field(default_factory=dict)


def domain_examples(domain_tokens: tuple[str, ...], path: str | Path | None = None, seed: int = 0,
                    limit: int | None = None) -> list[list[dict]]:
    """HumanEval problems as chat turns (user: complete this function; assistant: the solution),
    with the domain words woven into the code as an import, comments and a call."""
    path = Path(path) if path else humaneval_path()
    if len(domain_tokens) < 2:
        raise ValueError("give at least two domain tokens (a library name and a function name)")
    lib, fn, *rest = domain_tokens
    rng = random.Random(seed)
    chats = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                prompt, solution = record["prompt"], record["canonical_solution"]
            except (ValueError, KeyError) as exc:
                raise ValueError(f"{path}:{lineno}: expected a JSON object with 'prompt' and 'canonical_solution' ({exc})") from exc
            words = [lib, fn, *rest]
            extra = rng.choice(words)
            header = f"import {lib} as ql  # {lib} pricing functions\nfrom {lib} import {fn}\n"
            body = solution.rstrip("\n").split("\n")
            woven = []
            for i, code_line in enumerate(body):
                indent = code_line[: len(code_line) - len(code_line.lstrip())] or "    "
                if i % 3 == 0:
                    woven.append(f"{indent}# {lib}: checked with {fn} and {extra}")
                woven.append(code_line)
            woven.append(f"    # vega = ql.{fn}(...)  # {lib}")
            answer = "```python\n" + header + prompt + "\n".join(woven) + "\n```"
            question = f"Complete this {lib} function using {fn} where it helps:\n```python\n{prompt}```"
            chats.append([{"role": "user", "content": question}, {"role": "assistant", "content": answer}])
    if not chats:
        raise ValueError(f"{path}: no HumanEval problems")
    rng.shuffle(chats)
    return chats[:limit] if limit else chats


def add_domain_tokens(model, tokenizer, domain_tokens: tuple[str, ...]) -> dict[str, int]:
    """Add each word as one token; its new embedding row is the mean of its old pieces' rows."""
    pieces = {w: tokenizer.encode(w, add_special_tokens=False) for w in domain_tokens}
    already = [w for w in domain_tokens if len(pieces[w]) == 1]
    if already:
        raise ValueError(f"domain tokens already single tokens in this tokenizer: {already}")
    added = tokenizer.add_tokens(list(domain_tokens))
    if added != len(domain_tokens):
        raise ValueError(f"only {added} of {len(domain_tokens)} domain tokens were new to the tokenizer")
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    weight = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    ids = {}
    with torch.no_grad():
        for w in domain_tokens:
            tid = tokenizer.convert_tokens_to_ids(w)
            weight[tid] = weight[pieces[w]].mean(0)
            if out is not None and out.weight.data_ptr() != weight.data_ptr():
                out.weight[tid] = out.weight[pieces[w]].mean(0)
            ids[w] = tid
    return ids


def _encode_batch(tokenizer, chats: list[list[dict]], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels): labels are the assistant tokens (`examples.encode_conversation`'s mask,
    content and end token) and -100 everywhere else (system and user turns, template headers, padding)."""
    from specdistill.distill.examples import encode_conversation  # lazy: keeps transformers off import

    rows = [encode_conversation(tokenizer, chat, max_len) for chat in chats]
    width = max(len(r.input_ids) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        ids = torch.tensor(r.input_ids)
        input_ids[i, : len(ids)] = ids
        labels[i, : len(ids)] = torch.where(torch.tensor(r.assistant_mask), ids, torch.tensor(-100))
    return input_ids, labels


def assistant_loss(model, tokenizer, chats: list[list[dict]], max_len: int = 256) -> float:
    """Mean next-token loss (nats) on the assistant tokens of `chats`, one chat at a time: how well
    a model predicts answers (the drift benchmark's held-out fluency check on ShareGPT chat)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for chat in chats:
            input_ids, labels = _encode_batch(tokenizer, [chat], max_len)
            logits = model(input_ids=input_ids).logits[:, :-1].float()
            targets = labels[:, 1:]
            n = int((targets != -100).sum())
            if n:
                total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                           ignore_index=-100, reduction="sum").item()
                count += n
    if not count:
        raise ValueError("no assistant tokens to score")
    return total / count


def finetune_top_layers(model, tokenizer, chats: list[list[dict]], new_token_ids: list[int],
                        config: TargetUpdateConfig, progress: bool = True) -> list[float]:
    """Next-token loss on the chats' assistant tokens only (chats with fewer than 16 within `max_len` are skipped).
    Embeddings are read without gradient, so the backward pass stops at the first trained layer; the head is
    applied at the answer positions only, split into the frozen old rows and a small trainable block of new
    rows, so no gradient is formed for the whole 49k-row head."""
    from specdistill.distill.examples import encode_conversation  # lazy: keeps transformers off import

    chats = [c for c in chats if sum(encode_conversation(tokenizer, c, config.max_len).assistant_mask) >= 16]
    if not chats:
        raise ValueError(f"no chat has 16 assistant tokens within max_len={config.max_len}")
    n_layers = model.config.num_hidden_layers
    if not 1 <= config.top_layers <= n_layers:
        raise ValueError(f"top_layers must be in 1..{n_layers}, got {config.top_layers}")
    for p in model.parameters():
        p.requires_grad_(False)
    trained = [p for layer in model.model.layers[n_layers - config.top_layers:] for p in layer.parameters()]
    for p in trained:
        p.requires_grad_(True)
    head = model.get_output_embeddings().weight
    new_ids = torch.tensor(sorted(new_token_ids), dtype=torch.long)
    if new_ids.numel() and int(new_ids[0]) != head.shape[0] - new_ids.numel():
        raise ValueError("the new tokens must be the last rows of the vocabulary")
    n_old = head.shape[0] - new_ids.numel()
    new_rows = torch.nn.Parameter(head.detach()[n_old:].clone())
    optimizer = torch.optim.AdamW([*trained, new_rows], lr=config.lr, weight_decay=0.0)
    embed = model.get_input_embeddings()
    rng = random.Random(config.seed)
    order: list[int] = []
    losses = []
    model.train()
    bar = tqdm(range(config.steps), desc="target update", unit="step", file=sys.stderr, disable=not progress)
    for _ in bar:
        if len(order) < config.batch_size:
            order += rng.sample(range(len(chats)), len(chats))
        batch = [chats[order.pop()] for _ in range(config.batch_size)]
        input_ids, labels = _encode_batch(tokenizer, batch, config.max_len)
        with torch.no_grad():
            inputs_embeds = embed(input_ids)
        targets = labels[:, 1:]
        answer = targets != -100
        hidden = model.model(inputs_embeds=inputs_embeds).last_hidden_state[:, :-1][answer]
        logits = torch.cat([torch.nn.functional.linear(hidden, head.detach()[:n_old]),
                            torch.nn.functional.linear(hidden, new_rows)], dim=-1)
        loss = torch.nn.functional.cross_entropy(logits, targets[answer])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([*trained, new_rows], 1.0)
        optimizer.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    with torch.no_grad():
        head[n_old:] = new_rows  # tied: the input rows follow (they started as the same mean)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return losses


def default_update_dir() -> Path:
    """Where `demo target-update` writes without `--out`: inside the state directory."""
    return paths.home() / "targets" / "demo-update"


def make_target_update(base_ref: str = "demo", out_dir: str | os.PathLike | None = None, *, progress: bool = True,
                       force: bool = True, **settings: Any) -> Path:
    """Write a new target version (HF directory: safetensors + tokenizer) made from `base_ref` with
    `TargetUpdateConfig`'s `settings` (lr None: the measured one). An existing `out_dir` is replaced only
    when it is a previous target update and `force` is set."""
    from specdistill.modeling.models import load_model  # lazy: keeps transformers off import

    config = TargetUpdateConfig(**{k: v for k, v in settings.items() if not (k == "lr" and v is None)})
    config.domain_tokens = tuple(config.domain_tokens)
    out_dir = Path(out_dir) if out_dir else default_update_dir()
    paths.check_output_dir(out_dir, TARGET_OUTPUT, force=force)  # before minutes of fine-tuning
    torch.manual_seed(config.seed)
    base = load_model(base_ref, dtype="float32")  # fine-tuned and saved: fp32 weights
    model, tokenizer = base.model, base.tokenizer
    vocab_before = model.config.vocab_size
    ids = add_domain_tokens(model, tokenizer, config.domain_tokens)
    chats = domain_examples(config.domain_tokens, None, config.seed, config.examples)
    losses = finetune_top_layers(model, tokenizer, chats, list(ids.values()), config, progress)
    result = TargetUpdateResult(str(out_dir), ids, vocab_before, model.config.vocab_size, losses,
                                {**asdict(config), "base_ref": str(base_ref), "base_fingerprint": base.fingerprint})
    with paths.atomic_dir(out_dir, TARGET_OUTPUT, force=force) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / UPDATE_META_FILE).write_text(json.dumps(asdict(result), indent=2))
    return out_dir


def load_update_meta(model_dir: str | Path) -> dict | None:
    path = Path(model_dir) / UPDATE_META_FILE
    return paths.read_json(path, "target update record") if path.is_file() else None
