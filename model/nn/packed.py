"""Weight-only int8 linear layers for the CPU (`DOMINO_DTYPE=int8`, issue 56).

On a CPU a one-token decode step is mostly its matmuls reading the weights (docs/benchmarks.md,
"The embedded default against llama.cpp": 61 % of a step, at ~5.5 GB/s for bf16 on one thread).
Stored as int8 with one bf16 scale per output channel, a layer reads half the bytes of bf16, and
torch's weight-only kernel (`torch._weight_int8pack_mm`: `x @ (w * s[:, None]).T`) takes bf16
activations on its vectorized x86 path (fp32 activations go to a scalar one ~10x slower), so the
model keeps bf16 activations and only its `nn.Linear` weights change.

The int8 kernel pays only for a few rows: measured here (AMD EPYC, one thread), a 1536×576 layer
takes 0.048 ms for one row against 0.088 in bf16, as much at 4 rows, and 1.7-2.5× bf16's time from
9 rows on; a 500-token prefill through it would take 2.5× longer. So a layer also keeps its int8
weight de-quantized to bf16 and runs more than `INT8_ROWS` rows through that: the same weights
(up to bf16's rounding of q × scale), the dense kernel, 1.5× bf16's memory in all.

Per output channel, symmetric: scale = max |w| / 127, q = round(w / scale). The LM head keeps a
reference to its dense weight (tied to the embedding in small models, and what a drafter borrows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INT8_ROWS = 4  # rows (tokens) up to which the int8 kernel beats the dense one; more take `wide`


class Int8Linear(nn.Module):
    """y = x @ (q * scale[:, None]).T (+ bias), q int8 [out, in], scale bf16 [out]."""

    def __init__(self, linear: nn.Linear, keep_dense: bool = False) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.register_buffer("wide", self.dequantized(), persistent=False)  # for more than INT8_ROWS rows
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(torch.bfloat16))
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The dense weight where something else reads it (a drafter borrows the LM head's rows).
        self.dense = linear.weight if keep_dense else None

    @property
    def weight(self) -> torch.Tensor:
        if self.dense is None:
            raise AttributeError("an Int8Linear keeps no dense weight (keep_dense=False)")
        return self.dense

    def dequantized(self) -> torch.Tensor:
        """The weight this layer applies, [out, in] in bf16."""
        return (self.qweight.float() * self.scale.float()[:, None]).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if rows.shape[0] <= INT8_ROWS:
            y = torch._weight_int8pack_mm(rows, self.qweight, self.scale)
        else:
            y = F.linear(rows, self.wide)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)


def pack_int8(model: nn.Module, dense: nn.Module | None = None) -> int:
    """Every `nn.Linear` under `model` becomes an `Int8Linear` (`dense`, e.g. the LM head, keeps
    its dense weight too); the count replaced."""
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear(child, keep_dense=child is dense))
            count += 1
        else:
            count += pack_int8(child, dense)
    return count
