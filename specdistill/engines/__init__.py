"""Real serving engines in the loop: llama.cpp built from its PyPI sdist (build, server lifecycle,
GGUF export) and any OpenAI-compatible server (client, Prometheus `/metrics`).

Ranked just above `speculative` (an engine bench reuses its BenchResult and lossless check) and below
`ops` (the monitor samples an engine's `/metrics`).
"""
