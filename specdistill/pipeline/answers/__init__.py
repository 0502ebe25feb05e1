"""The target answers the window's prompts: one home for the answer path.

`decode_loop` (the batched decode), `harness` (answers in this process), `engine_client` (answers from an
OpenAI-compatible server), `answer_file` (the resumable JSONL both write), `choose_engine` (which of them
answers, measured) and `stage` (the nightly's stage over them)."""
