"""The nightly's and the monitor's stages, one module each, in the order the flows run them: answers,
pool, corpus (the suffix drafter's), bench and engine_bench, choose_mode (what serving.json runs), monitor."""
