"""A drift scenario you can run: a new target version made from the demo target.

The update does what real target updates do to a draft: it adds domain words to the tokenizer as
single tokens (`QuantLib`, `CalcBlackScholesVega`, ...) and fine-tunes the top decoder layers on a
new domain (HumanEval code, answered as chat, with the domain words woven into the code). The
champion draft was distilled against the old target, so its acceptance against the new one drops,
and its vocabulary no longer covers the target's: both are what the monitor must notice.

Only the top `top_layers` decoder layers and the new tokens' rows train; the new rows start as the
mean of the rows of the pieces the old tokenizer split each word into. Embeddings are read without
gradient, so the backward pass stops at the first trained layer, and the head's gradient is formed
for the new rows only: a step costs a fraction of a full one. With tied embeddings (the demo
target) the trained head rows are the input rows too.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

DEFAULT_DOMAIN_TOKENS = ("QuantLib", "CalcBlackScholesVega", "BlackScholesProcess", "YieldTermStructure")
UPDATE_META_FILE = "specdistill_target_update.json"


@dataclass
class TargetUpdateConfig:
    domain_tokens: tuple[str, ...] = DEFAULT_DOMAIN_TOKENS
    top_layers: int = 4
    steps: int = 30
    lr: float = 1e-3
    batch_size: int = 1
    max_len: int = 160
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
    from specdistill.data.datasets import humaneval_path

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
    rows = []
    for chat in chats:
        ids = tokenizer.apply_chat_template(chat, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)[:max_len]
        rows.append(ids)
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, : len(r)] = torch.tensor(r)
        labels[i, : len(r)] = torch.tensor(r)
    return input_ids, labels


def finetune_top_layers(model, tokenizer, chats: list[list[dict]], new_token_ids: list[int],
                        config: TargetUpdateConfig, progress: bool = True) -> list[float]:
    """Next-token loss on the chats; only the top layers and the new tokens' (output) rows learn.

    The head is split into the frozen old rows and a small trainable block of new rows, so the
    backward pass never forms a gradient for the whole 49k-row head."""
    from tqdm import tqdm

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
        hidden = model.model(inputs_embeds=inputs_embeds).last_hidden_state[:, :-1]
        logits = torch.cat([torch.nn.functional.linear(hidden, head.detach()[:n_old]),
                            torch.nn.functional.linear(hidden, new_rows)], dim=-1)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
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


def make_target_update(
    base_ref: str = "demo",
    out_dir: str | os.PathLike | None = None,
    *,
    domain_tokens: tuple[str, ...] = DEFAULT_DOMAIN_TOKENS,
    top_layers: int = 4,
    steps: int = 30,
    lr: float = 1e-3,
    batch_size: int = 1,
    max_len: int = 160,
    seed: int = 0,
    examples: int | None = None,
    humaneval: str | Path | None = None,
    progress: bool = True,
) -> Path:
    """Write a new target version (HF directory: safetensors + tokenizer) made from `base_ref`."""
    from specdistill import paths
    from specdistill.modeling.models import load_model

    config = TargetUpdateConfig(tuple(domain_tokens), top_layers, steps, lr, batch_size, max_len, seed, examples)
    out_dir = Path(out_dir) if out_dir else paths.home() / "targets" / "demo-update"
    torch.manual_seed(seed)
    base = load_model(base_ref)
    model, tokenizer = base.model, base.tokenizer
    vocab_before = model.config.vocab_size
    ids = add_domain_tokens(model, tokenizer, config.domain_tokens)
    chats = domain_examples(config.domain_tokens, humaneval, seed, examples)
    losses = finetune_top_layers(model, tokenizer, chats, list(ids.values()), config, progress)
    result = TargetUpdateResult(str(out_dir), ids, vocab_before, model.config.vocab_size, losses,
                                {**asdict(config), "base_ref": str(base_ref), "base_fingerprint": base.fingerprint})
    with paths.atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / UPDATE_META_FILE).write_text(json.dumps(asdict(result), indent=2))
    return out_dir


def load_update_meta(model_dir: str | Path) -> dict | None:
    path = Path(model_dir) / UPDATE_META_FILE
    return json.loads(path.read_text()) if path.is_file() else None
