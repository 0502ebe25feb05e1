"""speculators (vLLM's library of draft heads and their trainer), in a virtual environment of its own."""
