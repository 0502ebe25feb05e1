"""Distillation: the config, the target's answers and teacher signal, the losses, and the trainer."""
