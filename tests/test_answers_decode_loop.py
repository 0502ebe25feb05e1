"""The batched answer loop (`decode_loop.decode_batch`) against transformers' `generate` on tiny random Llamas:
same greedy tokens and teacher rows in fp32 with mixed prompt lengths (grouped prefills) and rows
finishing early; the preallocated KV cache it decodes with."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specdistill.modeling.attention import decode_attention_for
from specdistill.modeling.kv_cache import BLOCK, dense_buffers, preallocated_cache, select_rows, write_rows
from specdistill.pipeline.stages.answers.decode_loop import TopKRecorder, decode_batch, generate_batch, prefill_groups
from tests.conftest import lively, make_tiny_llama

VOCAB, PAD = 96, 0
PROMPTS = [[5, 17, 33], [9, 4, 61, 22, 8, 40, 3], [70], [12, 12, 45, 81, 6], [30, 31, 32, 33, 34, 35, 36, 37, 38],
           [50, 51, 52, 53, 54, 55, 56, 57]]  # lengths 7, 8, 9 share a padded prefill


@pytest.fixture(scope="module")
def target():
    return lively(make_tiny_llama(vocab_size=VOCAB, layers=2, seed=11), seed=4, std=0.3).float()


def _eos_mid_answer(target, steps: int) -> int:
    """A token that some rows produce part-way through their greedy answer, so they finish early."""
    free = generate_batch(target, PROMPTS, max_new_tokens=steps, pad=PAD, eos=VOCAB + 1)
    counts = torch.bincount(free[:, 2 : steps - 2].flatten(), minlength=VOCAB)
    return int(counts.argmax())


@pytest.mark.parametrize("decode_attention", [True, False])
def test_greedy_answers_and_teacher_rows_match_generate(target, decode_attention):
    steps = 12
    eos = _eos_mid_answer(target, steps)
    recorders = [TopKRecorder(8, 1.0, len(PROMPTS), steps) for _ in range(2)]
    with decode_attention_for(target) if decode_attention else torch.inference_mode():
        want = generate_batch(target, PROMPTS, max_new_tokens=steps, pad=PAD, eos=eos, recorder=recorders[0])
        got = decode_batch(target, PROMPTS, max_new_tokens=steps, pad=PAD, eos=eos, recorder=recorders[1])
    finished = [(row == eos).nonzero() for row in want]
    assert any(f.numel() and f[0, 0] < steps - 1 for f in finished)  # some rows really left the batch early
    assert torch.equal(got, want)
    for row, f in enumerate(finished):
        n = int(f[0, 0]) + 1 if f.numel() else steps
        a, b = recorders[0].rows(row, n), recorders[1].rows(row, n)
        assert torch.equal(a["indices"], b["indices"])
        assert torch.allclose(a["logprobs"], b["logprobs"], atol=1e-5)
        assert torch.allclose(a["residual"], b["residual"], atol=1e-6)
        assert b["indices"][:, 0].tolist() == got[row, :n].tolist()  # greedy: the top-1 is what was generated


def test_sampling_draws_what_generate_draws_until_a_row_finishes(target):
    steps = 10
    eos = _eos_mid_answer(target, steps)
    torch.manual_seed(3)
    want = generate_batch(target, PROMPTS, max_new_tokens=steps, pad=PAD, eos=eos, temperature=1.3)
    torch.manual_seed(3)
    got = decode_batch(target, PROMPTS, max_new_tokens=steps, pad=PAD, eos=eos, temperature=1.3)
    hits = (want == eos).nonzero()
    same_until = int(hits[:, 1].min()) + 1 if hits.numel() else steps
    assert torch.equal(got[:, :same_until], want[:, :same_until])
    torch.manual_seed(3)
    assert torch.equal(decode_batch(target, PROMPTS, max_new_tokens=steps, pad=PAD, eos=eos, temperature=1.3), got)


def test_prefill_groups_bound_the_padding_and_cover_every_row():
    lengths = [47, 145, 48, 59, 63, 47, 101, 92, 54]
    groups = prefill_groups(lengths, waste=0.15)
    assert sorted(r for g in groups for r in g) == list(range(len(lengths)))
    for g in groups:
        assert max(lengths[r] for r in g) * len(g) <= 1.15 * sum(lengths[r] for r in g)
    assert len(groups) < len(lengths) and [1] in groups  # similar lengths share a forward; the long one is alone
    assert prefill_groups([7, 7, 7]) == [[0, 1, 2]]


def test_preallocated_cache_takes_separate_prefills_and_drops_rows(target):
    ids = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    cache = preallocated_cache(target, rows=3, capacity=6)
    with torch.inference_mode():
        whole = DynamicCache(config=target.config)
        target(input_ids=ids, cache=whole, use_cache=True)
        for rows in ([0, 2], [1]):
            part = DynamicCache(config=target.config)
            target(input_ids=ids[rows], cache=part, use_cache=True)
            write_rows(cache, torch.tensor(rows), 3, part)
        assert cache.get_seq_length() == 3
        # layer 1's keys come from layer 0's output computed in batches of 3 and of 2+1 rows: fp32 GEMMs of
        # other shapes round differently (1e-5 on AVX2 kernels); a row written to the wrong place is off by O(1)
        assert torch.allclose(cache.layers[1].keys, whole.layers[1].keys, atol=1e-4)
        select_rows(cache, torch.tensor([0, 2]))
        assert torch.equal(cache.layers[0].keys, cache.layers[0].key_buffer[:, :, :3])
        assert dense_buffers(cache.layers[0].keys, cache.layers[0].values)[0] is cache.layers[0].key_buffer
        assert torch.allclose(cache.layers[0].values, whole.layers[0].values[[0, 2]], atol=1e-4)
        target(input_ids=ids[[0, 2], :1], cache=cache, use_cache=True)
        assert cache.get_seq_length() == 4
        cache.crop(-2)
        assert cache.layers[1].keys.shape[-2] == 2
        with pytest.raises(ValueError, match="capacity 6"):
            target(input_ids=torch.ones((2, 5), dtype=torch.long), cache=cache, use_cache=True)


def test_preallocated_cache_grows_by_blocks_and_keeps_its_contents(target):
    """Buffers grow a block at a time (what `decode_attention` attends over whole); the filled part survives."""
    capacity = 2 * BLOCK + 5
    cache = preallocated_cache(target, rows=2, capacity=capacity)
    ids = torch.randint(3, VOCAB, (2, capacity), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        whole = DynamicCache(config=target.config)
        target(input_ids=ids, cache=whole, use_cache=True)
        assert cache.layers[0].key_buffer.shape[2] == BLOCK
        target(input_ids=ids[:, : BLOCK + 1], cache=cache, use_cache=True)
        assert cache.layers[0].key_buffer.shape[2] == 2 * BLOCK
        for t in range(BLOCK + 1, capacity):
            target(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
        assert cache.layers[0].key_buffer.shape[2] == capacity
        assert torch.allclose(cache.layers[1].keys, whole.layers[1].keys, atol=1e-5)
        assert torch.allclose(cache.layers[1].values, whole.layers[1].values, atol=1e-5)
