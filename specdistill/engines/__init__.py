"""Serving engines: what runs the target model outside this process. llama.cpp built from its PyPI sdist
(build, server lifecycle, GGUF export), vLLM's CPU build and speculators each in a venv of their own, and
any OpenAI-compatible server (client, Prometheus `/metrics`, the endpoint bench). "Engine" means this
everywhere: the nightly's answer engine and `serving.engine` pick one of these or the harness (this
project's PyTorch runner, whose speculative decoding loop is `speculative.decode`).

A sibling of `distill` and `speculative` (train, decode, serve): none of the three imports another. What an
engine bench shares with the harness bench (`BenchResult`, `Prompt`, `DraftCounts`) lives below them in `data`
and the base modules; `ops` sits above (the monitor samples an engine's `/metrics`).
"""
