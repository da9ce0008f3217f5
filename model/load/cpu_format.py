"""`DOMINO_DTYPE=auto` for the embedded default on a CPU: int4 or dense, by a measurement at start-up.

The embedded default ships as a Q4_1 GGUF, so its int4 packing is the file's own blocks
(model/nn/packed.py) and costs no accuracy a dense copy keeps; which one is faster depends on the
CPU's kernels. The dense candidate is what `auto` serves other targets in: bf16 where the CPU
multiplies bf16 natively, else float32; the int4 one runs its other ops in that same dtype (the
packed kernels take bf16 rows either way). Measured one-token forwards, one thread: AVX-512 BF16
22 ms int4 against 70 ms bf16; AVX2 only 36 ms int4 against 53 ms float32. Both are built from
the float32 weights and one-token forwards of each are timed in turn; the faster is kept.
"""

from __future__ import annotations

import copy
import time

import torch
from transformers import PreTrainedModel

from model.nn.target import TargetModel

CONTEXT = 64  # tokens before the timed step: a short chat turn
ROUNDS = 3  # each format timed this many times, in turn; the fastest of each counts


@torch.inference_mode()
def one_token_ms(model: PreTrainedModel) -> float:
    """One one-token forward of `model` after CONTEXT tokens (its lean forward, a one-slot cache)."""
    target = TargetModel(model)
    cache = target.new_cache(1, CONTEXT + 1)
    target.forward(cache, 0, torch.arange(CONTEXT)[None] % target.vocab_size, want_features=False)
    cache.set_lengths(0, [CONTEXT])
    token = torch.tensor([[1]])
    target.forward(cache, 0, token, want_features=False)  # warm-up
    started = time.perf_counter()
    target.forward(cache, 0, token, want_features=False)
    return 1e3 * (time.perf_counter() - started)


def choose_cpu_format(model: PreTrainedModel, dense: torch.dtype) -> tuple[PreTrainedModel, str, dict[str, float]]:
    """From a float32 model: the faster of its int4 packing and a `dense` (bf16 or float32) copy,
    both with `dense` activations (the model, 'int4' or the dense dtype's name, and each one's best
    one-token ms). The float32 model is consumed."""
    from model.load.loading import pack_as

    dense_name = str(dense).removeprefix("torch.")
    dense_model = copy.deepcopy(model).to(dense)
    packed, _ = pack_as(model, "int4", dense)
    candidates = {"int4": packed, dense_name: dense_model}
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(ROUNDS):
        for name, candidate in candidates.items():
            samples[name].append(one_token_ms(candidate))
    timings = {name: min(ms) for name, ms in samples.items()}
    chosen = min(timings, key=lambda name: timings[name])
    return candidates[chosen], chosen, timings
