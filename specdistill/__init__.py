"""specdistill: keep a speculative-decoding draft aligned with its target LLM."""

from specdistill.env import apply_offline_env

apply_offline_env()

__version__ = "0.1.0"
