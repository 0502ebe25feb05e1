"""A KV cache allocated once per batch, for batched decoding with transformers models.

transformers' `DynamicCache` grows by `torch.cat` of every layer's keys and values at every step:
in a profile of one bf16 batch of 16 answers (96 new tokens, demo target) that was 14% of the
time. `PreallocatedLayer` keeps `DynamicLayer`'s interface over buffers of fixed capacity, so a
step writes one column. Rows can be filled from separate prefills (`write_rows`), so prompts of
very different lengths need not be prefilled through one padded forward.

The buffers grow in blocks of `BLOCK` columns so that `decode_attention` can attend over a whole
buffer (`dense_buffers`): why, and the numbers, are in `modeling.attention`.
"""

from __future__ import annotations

import torch
from transformers import Cache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

BLOCK = 16  # columns a buffer grows by


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values in `[rows, kv_heads, columns, head_dim]` buffers; `length` columns are filled."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int | None = None):
        super().__init__()
        self.key_buffer, self.value_buffer = keys, values
        self.capacity = keys.shape[2] if capacity is None else capacity
        self.device, self.length, self.is_initialized = keys.device, 0, True
        self._expose()

    def _expose(self) -> None:
        self.keys, self.values = self.key_buffer[:, :, : self.length], self.value_buffer[:, :, : self.length]
        # the whole buffers behind the views, for `dense_buffers`
        self.keys._dense_buffer, self.values._dense_buffer = self.key_buffer, self.value_buffer

    def _reserve(self, end: int) -> None:
        if end > self.capacity:
            raise ValueError(f"KV cache capacity {self.capacity} exceeded: {end} tokens")
        if end <= self.key_buffer.shape[2]:
            return
        columns = min(self.capacity, -(-end // BLOCK) * BLOCK)

        def grow(buffer: torch.Tensor) -> torch.Tensor:
            grown = buffer.new_empty((buffer.shape[0], buffer.shape[1], columns, buffer.shape[3]))
            grown[:, :, : self.length] = buffer[:, :, : self.length]
            grown[:, :, self.length :] = 0  # unfilled columns are masked, and must be finite
            return grown

        self.key_buffer, self.value_buffer = grow(self.key_buffer), grow(self.value_buffer)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # the buffers exist from the start

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + key_states.shape[-2]
        self._reserve(end)
        self.key_buffer[:, :, self.length : end] = key_states
        self.value_buffer[:, :, self.length : end] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values

    def write_rows(self, rows: torch.Tensor, end: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Put a separate prefill's keys and values into batch rows `rows`, ending at column `end`."""
        start = end - keys.shape[-2]
        self._reserve(end)
        self.key_buffer[rows, :, start:end] = keys
        self.value_buffer[rows, :, start:end] = values
        self.length = max(self.length, end)
        self._expose()

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number: the tokens to remove")
        self.length = max(0, self.length + tokens_to_remove)
        self._expose()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows `indices` (finished sequences leave the batch): one copy of their buffers (the
        columns past `length`, zeros or stale keys, stay finite and masked)."""
        self.key_buffer = self.key_buffer.index_select(0, indices)
        self.value_buffer = self.value_buffer.index_select(0, indices)
        self._expose()

    def reset(self) -> None:
        self.length = 0
        self._expose()


def preallocated_cache(model: PreTrainedModel, rows: int, capacity: int) -> Cache:
    """A cache for `model` holding up to `capacity` tokens for each of `rows` sequences. Zero-filled:
    columns a row never writes (left padding, the rest of a block) are masked, and must be finite."""
    config = model.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype, device = model.dtype, model.device

    def buffer() -> torch.Tensor:
        return torch.zeros((rows, kv_heads, min(capacity, BLOCK), head_dim), dtype=dtype, device=device)

    return Cache(layers=[PreallocatedLayer(buffer(), buffer(), capacity) for _ in range(config.num_hidden_layers)])


def dense_buffers(keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The whole buffers behind a `PreallocatedLayer`'s exposed keys and values, or None for other tensors."""
    key_buffer, value_buffer = getattr(keys, "_dense_buffer", None), getattr(values, "_dense_buffer", None)
    if key_buffer is None or value_buffer is None:
        return None
    return key_buffer, value_buffer


def select_rows(cache: Cache, indices: torch.Tensor) -> None:
    for layer in cache.layers:
        layer.batch_select_indices(indices)


def write_rows(cache: Cache, rows: torch.Tensor, end: int, prefill: Cache) -> None:
    """Copy `prefill` (a cache of `len(rows)` sequences) into `cache`'s rows `rows`, right-aligned at column `end`."""
    for layer, source in zip(cache.layers, prefill.layers, strict=True):
        layer.write_rows(rows, end, source.keys, source.values)
