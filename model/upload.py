"""Host data to the device in one non-blocking copy.

A decode step needs a few small arrays of host data on the device (anchors, sampling parameters,
random draws, chosen drafts, block tables). One `torch.tensor(..., device=)` each is one blocking
copy each on CUDA: the host waits for every one of them. `upload` packs the arrays into one pinned
byte buffer and copies it with `non_blocking=True`, so the host goes on launching work while the
copy runs; the arrays come back as typed views of the device buffer. PyTorch's caching host
allocator keeps a pinned buffer from reuse until the copies that read it are done, so a fresh buffer
per call is safe and cheap. On the CPU the "copy" is the buffer itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

ALIGN = 8  # bytes: every part starts where any dtype's view may start

TORCH_DTYPES = {
    np.dtype(np.int64): torch.long,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.bool_): torch.bool,
}


def upload(parts: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """`parts` (NumPy arrays of the dtypes in TORCH_DTYPES) on `device`, in one copy: device tensors
    of the same shapes and dtypes, views of one buffer (write into them only knowing that)."""
    offsets, total = [], 0
    for part in parts:
        offsets.append(total)
        total += -(-part.nbytes // ALIGN) * ALIGN
    host = torch.empty(max(total, ALIGN), dtype=torch.uint8, pin_memory=device.type == "cuda")
    raw = host.numpy()  # NumPy writes: no torch call per part
    for part, offset in zip(parts, offsets):
        raw[offset : offset + part.nbytes] = np.ascontiguousarray(part).view(np.uint8).reshape(-1)
    buffer = host.to(device, non_blocking=True)
    out = []
    for part, offset in zip(parts, offsets):
        flat = buffer[offset : offset + part.nbytes].view(TORCH_DTYPES[part.dtype])
        out.append(flat.view(part.shape))
    return out
