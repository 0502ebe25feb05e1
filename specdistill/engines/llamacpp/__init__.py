"""llama.cpp in the loop: `llama-server` built from its PyPI sdist (`build`), one server process per
speculative mode (`server`), the engine bench and serving command over GGUF files (`engine`), and the
EAGLE-3 head's GGUF export (`gguf_export`)."""
