"""The nightly's and the monitor's stages, one module each, in the order the nightly flow runs them: target,
ingest, window, champion (and where training starts), align, answers, pool, distill, corpus (the suffix
drafter's), bench (and the gate) and engine_bench, choose_mode (what serving.json runs), register, promote or
write_serving; then monitor, the monitor flow's. Each takes and returns small, JSON-friendly values (the
records of `pipeline.outputs`), writes its outputs under a content-addressed directory, and resumes from what
is already there, so a rerun after a failure recomputes nothing that finished. Stages do not import one
another: what two of them share lives below them, in `pipeline` (`layout`, `serving`, `outputs`, `tail`, ...)."""
