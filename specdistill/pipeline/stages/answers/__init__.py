"""The target answers the window's prompts: one home for the answer path."""
