"""`DOMINO_DTYPE=auto` for the embedded default on a CPU: int4 or bf16, by a measurement at start-up.

The embedded default ships as a Q4_1 GGUF, so its int4 packing is the file's own blocks
(model/nn/packed.py) and costs no accuracy a bf16 copy keeps; which one is faster depends on the
CPU's kernels (on AVX-512 BF16, one thread: a one-token forward 22 ms int4 against 70 ms bf16).
Both are built from the float32 weights and one-token forwards of each are timed in turn; the
faster is kept. Only where the CPU multiplies bf16 natively: both formats take bf16 activations,
and without native bf16 `auto` stays float32 (unmeasured here; docs/benchmarks.md).
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


def choose_cpu_format(model: PreTrainedModel) -> tuple[PreTrainedModel, str, dict[str, float]]:
    """From a float32 model: the faster of its int4 packing and a bf16 copy (the model, 'int4' or
    'bfloat16', and each one's best one-token ms). The float32 model is consumed."""
    from model.load.loading import pack_weights

    dense = copy.deepcopy(model).to(torch.bfloat16)
    pack_weights(model, "int4")
    packed = model.to(torch.bfloat16)
    candidates = {"int4": packed, "bfloat16": dense}
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(ROUNDS):
        for name, candidate in candidates.items():
            samples[name].append(one_token_ms(candidate))
    timings = {name: min(ms) for name, ms in samples.items()}
    chosen = min(timings, key=lambda name: timings[name])
    return candidates[chosen], chosen, timings
