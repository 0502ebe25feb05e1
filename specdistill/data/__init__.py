"""Traffic: the record formats, streaming readers, ingestion into the log store, the shipped demo
datasets, and the prompt window definition every stage replays."""
