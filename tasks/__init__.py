"""Prefect tasks: thin wrappers, one library call each."""
