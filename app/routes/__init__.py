"""One router per route group: completions, chat, models, ops (health, metrics)."""
