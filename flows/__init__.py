"""Prefect flows: the pipeline diagram in code."""
