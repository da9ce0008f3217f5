"""The KV cache room: the target's and the drafter's per-row caches, how a row moves between slots,
and the prefix cache."""
