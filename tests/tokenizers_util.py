"""Small real BPE tokenizers for alignment tests (trained in milliseconds, deterministic)."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "def add(a, b): return a + b",
    "speculative decoding drafts tokens and the target verifies them",
    "import torch as tt; print(tt.ones(3))",
] * 20


def train_bpe(vocab_size: int, extra_corpus: list[str] = ()) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(CORPUS) + list(extra_corpus), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", unk_token="<|endoftext|>"
    )
    fast.chat_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    return fast
