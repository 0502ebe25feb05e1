"""Stage: the run's target, loaded once at the start (where an unloadable target fails the run); the
stages after it reuse the load."""

from __future__ import annotations

import sys

from specdistill.hardware import describe_device
from specdistill.modeling import models
from specdistill.modeling.models import dtype_name, shared_model
from specdistill.pipeline.outputs import TargetInfo


def describe_target(target_ref: str, dtype: str = "auto", device: str = "auto") -> TargetInfo:
    """Load the target once (this is where an unloadable target fails the run) and name its version
    and the dtype every stage runs it in (the fingerprint does not depend on the dtype). Its weights are
    hashed in full first, once per run (a load checks a sample), and the load refuses a target whose
    canary logits are non-finite or flat (`modeling.canary`)."""
    check = models.verify_model_files(target_ref)
    print(f"specdistill: target weights {check.outcome}: {check.bytes / 1e6:.0f} MB hashed in {check.seconds:.2f} s"
          + (f" ({check.detail})" if check.detail else ""), file=sys.stderr)
    loaded = shared_model(target_ref, dtype=dtype, device=device)  # the stages after it reuse this load
    return TargetInfo(ref=target_ref, path=str(loaded.path), fingerprint=loaded.fingerprint,
                      num_layers=loaded.config.num_hidden_layers, vocab_size=loaded.config.vocab_size,
                      dtype=dtype_name(loaded.model.dtype), hardware=describe_device(loaded.model.device))
