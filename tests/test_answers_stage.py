"""The answer stage's choices that need no model run: the batch it answers in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdistill.hardware import FLAGS_ENV
from specdistill.pipeline.answers.stage import answer_batch
from specdistill.pipeline.config import load_nightly_config


def _target(dtype: torch.dtype, device: str = "cpu"):
    return SimpleNamespace(model=SimpleNamespace(dtype=dtype, device=torch.device(device)))


@pytest.mark.parametrize("flags, dtype, batch", [
    ("avx2 avx512f avx512_bf16 amx_bf16", torch.bfloat16, 128),  # AMX: 1.13x batch 64
    ("avx2 avx512f avx512_bf16", torch.bfloat16, 64),
    ("avx2 avx512f avx512_bf16 amx_bf16", torch.float32, 32),
    ("avx2 fma", torch.float32, 32),
])
def test_the_answer_batch_follows_the_dtype_and_the_cpu_kind_measured(monkeypatch, flags, dtype, batch):
    monkeypatch.setenv(FLAGS_ENV, flags)
    assert answer_batch(load_nightly_config(), _target(dtype)) == batch
    assert answer_batch(load_nightly_config(None, ["generation.batch_size=16"]), _target(dtype)) == 16  # the key wins
