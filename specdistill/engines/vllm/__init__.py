"""vLLM's CPU build in the loop: installed in its own cached venv (`install`), a `vllm serve` process per
speculative config (`server`), and the engine bench over it (`bench`)."""
