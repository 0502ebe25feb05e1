"""Models: loading and fingerprinting a target or draft from any model reference, tokenizer
alignment, and building a draft from the target's own weights."""
