"""Weight-only packed linear layers for the CPU (`DOMINO_DTYPE=int8|int4`, issue 56).

On a CPU a one-token decode step is mostly its matmuls reading the weights (docs/benchmarks.md,
"The embedded default against llama.cpp": 61 % of a step, at ~5.5 GB/s for bf16 on one thread).
Packed, a layer reads a half (int8) or under a third (int4 in groups of 32) of bf16's bytes.
torch's weight-only kernels take bf16 activations on their vectorized x86 path (fp32 activations
go to a scalar one ~10x slower), so the rows a packed layer multiplies are bf16; the rest of the
model keeps bf16 activations where the CPU has native bf16 and float32 where it has not (AVX2
only: there bf16 GEMMs are emulated, ~3x slower than float32). Only its `nn.Linear` weights change:

- int8 (`torch._weight_int8pack_mm`: `x @ (q * s[:, None]).T`): per output channel, symmetric,
  scale = max |w| / 127.
- int4 (`torch._weight_int4pack_mm_for_cpu`: `w = (q - 8) * scale + zero` per group of 32 inputs):
  asymmetric per group, scale = (max - min) / 15 and zero = min + 8 * scale, which is GGUF's Q4_1
  (`w = q * d + m`, d = (max - min) / 15, m = min) written in torch's form. On weights de-quantized
  from a Q4_1 file (the embedded default) min and max are the block's own q = 0 and q = 15 values,
  so this recovers the file's d and m exactly; only their rounding to bf16 (the kernel's dtype)
  moves a weight, by at most 1/64 of its group's step.

The packed kernels pay only for a few rows: measured here (AMD EPYC, one thread), a 1536×576
layer takes 0.048 ms for one row in either format against 0.084 in bf16, about as much at 4 rows,
and 1.6-2.5× bf16's time from 9 rows on when its weights are in cache; a 500-token prefill
through them would take 2-2.5× longer. So a layer also keeps its weight de-quantized to bf16 and
runs more than `max_rows` rows through that: the same weights, the dense kernel, the activations'
dtype's memory on top of the packed one. Where the crossing lies is a whole forward's matter (bf16 reads 4× int4's
bytes from memory): for the embedded default's int4 forward after 300 tokens, T = 5-8 tokens took
42-49 ms through the int4 kernel and 61-76 ms through the bf16 copy, T = 12 as long either way;
for int8, whose kernel is slower, the crossing stays at 4. Without native bf16 (AVX2, float32
`wide`) both kernels keep up to 11 rows.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

INT4_GROUP = 32  # inputs per int4 scale/zero: GGUF Q4_1's block


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX)."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


class PackedLinear(nn.Module):
    """A linear layer applying a packed weight to up to `max_rows` rows and its bf16
    de-quantization (`wide`) to more. Subclasses pack in `__init__` and apply in `packed_mm`."""

    # Rows (tokens) up to which the packed kernel beats the dense one, with native bf16 and without
    # (`wide` then in float32); more take `wide`.
    max_rows = 4
    max_rows_without_native_bf16 = 4

    def __init__(self, linear: nn.Linear, keep_dense: bool, max_rows: int | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if max_rows is None:
            max_rows = self.max_rows if cpu_has_native_bf16() else self.max_rows_without_native_bf16
        self.max_rows = max_rows
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(torch.bfloat16))
        # The dense weight where something else reads it (a drafter borrows the LM head's rows).
        self.dense = linear.weight if keep_dense else None

    @property
    def weight(self) -> torch.Tensor:
        if self.dense is None:
            raise AttributeError(f"a {type(self).__name__} keeps no dense weight (keep_dense=False)")
        return self.dense

    @classmethod
    def fits(cls, linear: nn.Linear) -> bool:
        """Whether this kind can pack the layer's shape."""
        return True

    def packed_mm(self, rows: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Called ~200 times a one-token step: no op that is not needed (each costs microseconds).
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= self.max_rows:
            if x.dtype != torch.bfloat16:
                rows = rows.to(torch.bfloat16)
            y = self.packed_mm(rows)
            if self.bias is not None:
                y = y + self.bias
        else:
            wide = self.wide
            if rows.dtype != wide.dtype:
                rows = rows.to(wide.dtype)
            y = F.linear(rows, wide, None if self.bias is None else self.bias.to(wide.dtype))
        y = y.view(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)


class Int8Linear(PackedLinear):
    """y = x @ (q * scale[:, None]).T (+ bias), q int8 [out, in], scale bf16 [out]."""

    max_rows_without_native_bf16 = 11  # against float32 (as an int4 model's LM head: 69 vs 77 ms at T = 5)

    def __init__(self, linear: nn.Linear, keep_dense: bool = False, max_rows: int | None = None) -> None:
        super().__init__(linear, keep_dense, max_rows)
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        applied = self.qweight.float() * self.scale.float()[:, None]  # what the kernel applies
        self.register_buffer("wide", applied.to(linear.weight.dtype), persistent=False)

    def packed_mm(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(rows, self.qweight, self.scale)


class Int4Linear(PackedLinear):
    """y = x @ ((q - 8) * scale + zero).T (+ bias) per group of `INT4_GROUP` inputs: q in 0..15
    packed two to a byte ([out, in / 2] uint8, torch's CPU layout), scale and zero bf16
    [in / group, out, 2]."""

    # A verify of up to 10 drafts stays on the int4 kernel (see the module's note); without native
    # bf16 too, against a float32 `wide`: the kernel works in blocks of 4 rows there (a 5-8 token
    # forward of the embedded default took 69-83 ms through it, 98 ms through float32, T = 12 equal).
    max_rows = 11
    max_rows_without_native_bf16 = 11

    @classmethod
    def fits(cls, linear: nn.Linear) -> bool:
        # Whole groups of inputs; the kernel's layout packs 16 output channels together.
        return linear.in_features % INT4_GROUP == 0 and linear.out_features % 16 == 0

    def __init__(self, linear: nn.Linear, keep_dense: bool = False, max_rows: int | None = None) -> None:
        super().__init__(linear, keep_dense, max_rows)
        out_f, in_f = self.out_features, self.in_features
        if not self.fits(linear):
            raise ValueError(
                f"int4 needs in_features divisible by {INT4_GROUP} and out_features by 16, got {in_f}, {out_f}"
            )
        w = linear.weight.detach().float().view(out_f, in_f // INT4_GROUP, INT4_GROUP)
        lo, hi = w.amin(-1), w.amax(-1)
        step = (hi - lo) / 15
        safe = torch.where(step > 0, step, torch.ones_like(step))  # a constant group: q = 0, w = lo
        q = torch.round((w - lo[..., None]) / safe[..., None]).clamp(0, 15).to(torch.int32)
        scales_zeros = torch.stack([step, lo + 8 * step], dim=-1).to(torch.bfloat16)  # [out, groups, 2]
        self.register_buffer("qweight", torch._convert_weight_to_int4pack_for_cpu(q.view(out_f, in_f), 1))
        self.register_buffer("scales_zeros", scales_zeros.transpose(0, 1).contiguous())
        s, z = scales_zeros.float().unbind(-1)
        wide = (q.float() - 8) * s[..., None] + z[..., None]  # what the kernel applies, in fp32
        self.register_buffer("wide", wide.view(out_f, in_f).to(linear.weight.dtype), persistent=False)

    def packed_mm(self, rows: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(rows, self.qweight, INT4_GROUP, self.scales_zeros)


def pack_linears(model: nn.Module, kind: type[PackedLinear], dense: nn.Module | None = None) -> int:
    """Every `nn.Linear` under `model` that `kind` fits becomes a `kind` layer (`dense`, e.g. the LM
    head, keeps its dense weight too; others stay as they are); the count replaced."""
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear) and kind.fits(child):
            setattr(model, name, kind(child, keep_dense=child is dense))
            count += 1
        else:
            count += pack_linears(child, kind, dense)
    return count
