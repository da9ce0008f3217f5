"""The KV cache room: paged storage (pools of blocks, per-slot block tables, lengths mirrored on the
host), the target's and the drafter's caches over it, and the blocks' accounting and prefix index."""
