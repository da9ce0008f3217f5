"""Counting the calls of a piece of torch code that bring tensor values to the host (device->host
reads) and, on CUDA, its synchronizing calls, per call site (bench/step_overhead.py counts an engine
step's; a CPU test can count any code's).

`ReadCounter`, a `TorchFunctionMode`, counts the calls that bring a tensor's values to Python:
`Tensor.item`, `tolist`, `__bool__`, `__int__`, `__float__`, `__index__`, `numpy` (and `__array__`),
`cpu`, `to` a CPU device from another device, `equal`, `allclose`, `__contains__`. Two views of the
same calls:

- `all:read`: reads of tensors on the counter's device. On the CPU every tensor is on that device
  and none of these is a real device sync, so there the count is of "reads that would be
  device->host on CUDA", and an upper bound: tensors the engine keeps on the host on CUDA too (the
  policy's CPU tensors, a mask built without `device=`) count on the CPU and not on CUDA.
- `device:read`: reads of tensors that live on the device on CUDA. On CUDA that is the tensor's
  real device; on the CPU an estimate by residency tracking (see `ReadCounter`) that leaves host
  tensors out. A device tensor written into a host tensor (`host[i] = dev`) counts.

Not counted: `.to("cpu")` in the `all` view on the CPU (it cannot be told from `.to(self.device)`),
`torch.cuda.synchronize()` on the CPU (the engine's guard skips it), reads made from C++, and calls
inside an `Excluded` region (the captured bucket functions, which a CUDA graph replays without
Python; tests/model/test_static.py checks they read nothing). Ops whose output shape depends on the
data (`nonzero`, `argwhere`, `masked_select`, `unique`, one-argument `where`, boolean-mask indexing)
sync on CUDA as well and are counted apart, as `all:shape` / `device:shape`. On CUDA,
`cuda_sync_log` records every synchronizing CUDA call (`torch.cuda.set_sync_debug_mode("warn")`:
device->host copies, blocking host->device copies, `nonzero`) plus explicit
`torch.cuda.synchronize()` calls.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

REPO = Path(__file__).resolve().parent.parent
TORCH_DIR = str(Path(torch.__file__).parent)
# The real functions: counting patches the module attributes (model code looks them up at each call).
cuda_synchronize = torch.cuda.synchronize
FROM_NUMPY = torch.from_numpy

# Tensor methods (and torch functions) whose result is host data: one read of the tensor's values.
READS = frozenset(
    ["item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "numpy", "__array__"]
    + ["cpu", "to", "equal", "allclose", "is_nonzero", "__contains__"]
)
# Ops whose output shape depends on the data: the host waits for the device to learn it.
SHAPE_SYNCS = frozenset(["nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"])
# Factories that copy their data argument (Python values, NumPy, a host tensor) to `device=`.
DATA_FACTORIES = frozenset(["tensor", "as_tensor", "asarray"])
INDEXING = frozenset(["__getitem__", "__setitem__"])


class Excluded:
    """The stretches of code whose reads and syncs are not counted (nor, on the CPU, tracked):
    `with excluded.region(): ...` (bench/step_overhead.py: the captured bucket functions)."""

    def __init__(self) -> None:
        self.inside = 0
        self.sync_log: list[str] | None = None  # a cuda_sync_log's record, trimmed of what ran inside

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        mark = len(self.sync_log) if self.sync_log is not None else 0
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1
            if self.sync_log is not None:
                del self.sync_log[mark:]  # an eager (failed-capture) bucket's own syncs


HOST = "_host_reads_host"  # tensor attribute: this tensor would live on the host on CUDA too
DEVICE_PROPERTY = torch._C.TensorBase.__dict__["device"]


def _tensors(values: Any) -> list[torch.Tensor]:
    """The tensors among call arguments (one level into lists and tuples: torch.cat, index tuples)."""
    found = []
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, list | tuple):
            found += [x for x in v if isinstance(x, torch.Tensor)]
    return found


def _to_target(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Where Tensor.to(...) sends a tensor: a device (str, torch.device, index) or another tensor;
    None when it keeps the device (a dtype change)."""
    if kwargs.get("device") is not None:
        return kwargs["device"]
    first = args[1] if len(args) > 1 else None
    return first if isinstance(first, torch.Tensor | str | torch.device | int) else None


IN_PLACE_DUNDERS = frozenset(["__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__iand__", "__ior__"])


def _in_place(name: str) -> bool:
    return (name.endswith("_") and not name.startswith("__")) or name in IN_PLACE_DUNDERS


def classify(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], device: torch.device) -> str | None:
    """The "all" view of one call: "read", "shape" (a data-dependent shape) or None, for tensors on
    `device`'s type (on the CPU: every tensor)."""
    src = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if src is None or src.device.type != device.type:
        return None
    if name in READS:
        if name == "to":
            target = _to_target(args, kwargs)
            if target is None:
                return None
            dst = target.device if isinstance(target, torch.Tensor) else torch.device(target)
            return "read" if dst.type == "cpu" and src.device.type != "cpu" else None
        return "read"
    if name in SHAPE_SYNCS or (name == "where" and len(args) == 1 and not kwargs):
        return "shape"
    if name == "__getitem__" and any(i.dtype == torch.bool for i in _tensors(args[1:2])):
        return "shape"
    return None


def call_site() -> str:
    """The first caller outside torch and this module: "model/engine/engine.py:645 _decode"."""
    frame = sys._getframe(2)
    skip = (__file__, warnings.__file__)
    while frame is not None and (frame.f_code.co_filename.startswith(TORCH_DIR) or frame.f_code.co_filename in skip):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = Path(frame.f_code.co_filename)
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
    return f"{shown}:{frame.f_lineno} {frame.f_code.co_name}"


class ReadCounter(TorchFunctionMode):
    """Counts the calls that read tensor values to the host, per call site, in two views:

    - "all": reads of tensors on the counter's device type (on the CPU: all);
    - "device": reads of tensors that would live on the device on CUDA. On CUDA that is the real
      device. On the CPU it is an estimate by residency tracking: while the mode is on, a tensor is
      marked "host" when made without `device=` (torch.tensor(list), from_numpy), by `.cpu()`, or
      by an op whose tensor inputs are all host; an explicit `device=` / `.to(device)` means the
      device unless that device object came from a host tensor's `.device` (or is the string
      "cpu"). Unmarked tensors (parameters, caches, anything made while the mode was off) count as
      device tensors, so the estimate errs towards more reads. Writes of a device tensor into a
      host tensor (`host.copy_(dev)`, `host[i] = dev`) are device reads too.

    Calls inside an `excluded` region are neither counted nor tracked.
    """

    def __init__(self, device: torch.device, excluded: Excluded | None = None) -> None:
        super().__init__()
        self.device = device
        self.excluded = excluded if excluded is not None else Excluded()
        self.counting = False  # False: only track residency (e.g. an engine's construction, its prefill)
        self.counts: dict[str, Counter[str]] = {
            f"{view}:{kind}": Counter() for view in ("all", "device") for kind in ("read", "shape")
        }
        # Host->device copies, in the device view only (on the CPU the "all" view cannot tell them):
        # "h2d" blocking (on CUDA the host waits for a pageable copy), "h2d_async" asked for with
        # non_blocking=True (which does not block only from pinned memory; the counter cannot see pinning).
        self.counts.update({"device:h2d": Counter(), "device:h2d_async": Counter()})
        self.host_devices: dict[int, torch.device] = {}  # `.device` objects read from host tensors

    def total(self, key: str) -> int:
        return sum(self.counts[key].values())

    def is_host(self, t: torch.Tensor) -> bool:
        if self.device.type != "cpu":
            return t.device.type == "cpu"
        return getattr(t, HOST, False)

    def _host_target(self, target: Any) -> bool:
        """Does this `device=` / `.to()` argument mean the host (on CUDA too)?"""
        if isinstance(target, torch.Tensor):
            return self.is_host(target)
        if self.device.type != "cpu":
            return torch.device(target).type == "cpu"
        if isinstance(target, str):
            return target == "cpu"
        held = self.host_devices.get(id(target))
        return held is target

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if self.excluded.inside:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if self.counting:
            self._count(name, args, kwargs)
        out = func(*args, **kwargs)
        if self.device.type == "cpu":
            out = self._track(func, name, args, kwargs, out)
        return out

    def _count(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        copy = self._host_to_device(name, args, kwargs)
        if copy is not None:
            self.counts[f"device:{copy}"][f"{call_site()} .{name}"] += 1
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if src is None:
            return
        site = None
        for view, kind in (
            ("all", classify(name, args, kwargs, self.device)),
            ("device", self._device_kind(name, args, kwargs, src)),
        ):
            if kind is not None:
                site = site or f"{call_site()} .{name}"
                self.counts[f"{view}:{kind}"][site] += 1

    def _host_to_device(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """ "h2d" / "h2d_async" when the call copies host data to the device, else None: `.to(device)`
        / `.cuda()` of a host tensor; `torch.tensor(data, device=...)` (and as_tensor, asarray) of
        anything but a device tensor; indexing a device tensor with a Python list, or assigning one
        into it; any other call that mixes device tensors with host tensors of one or more
        dimensions (`dev.copy_(host)`, `dev[host_index]`; on CUDA the host one is copied over, or the
        call fails). Host scalars (0-dim) travel as kernel arguments and do not count."""
        kind = "h2d_async" if kwargs.get("non_blocking") else "h2d"
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in ("to", "cuda") and src is not None:
            target = _to_target(args, kwargs) if name == "to" else "cuda"
            if target is None or not self.is_host(src):
                return None
            return kind if name == "cuda" or not self._host_target(target) else None
        if name in DATA_FACTORIES:
            device = kwargs.get("device")
            data = args[0] if args else kwargs.get("data")
            if device is None or self._host_target(device):
                return None
            return None if isinstance(data, torch.Tensor) and not self.is_host(data) else kind
        tensors = _tensors(args) + _tensors(kwargs.values())
        if not any(not self.is_host(t) for t in tensors):
            return None  # host-only (or no tensors): nothing reaches the device
        if src is not None and self.is_host(src) and _in_place(name):
            return None  # written into a host tensor: a device read (counted as one), not a copy to it
        if name in INDEXING and src is not None and not self.is_host(src):
            if any(isinstance(v, list) for v in args[1:3]):
                return kind  # dev[[0, 2]], dev[i] = [1, 2]: the list becomes a host tensor, copied
        if any(self.is_host(t) and t.dim() > 0 for t in tensors):
            return kind
        return None

    def _device_kind(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], src: torch.Tensor) -> str | None:
        if name in READS:
            if name == "to":
                target = _to_target(args, kwargs)
                return "read" if target is not None and not self.is_host(src) and self._host_target(target) else None
            return None if self.is_host(src) else "read"
        if name in SHAPE_SYNCS or (name == "where" and len(args) == 1 and not kwargs):
            return None if self.is_host(src) else "shape"
        if name == "__getitem__" and len(args) > 1:
            masks = [i for i in _tensors(args[1:2]) if i.dtype == torch.bool]
            return "shape" if any(not self.is_host(m) for m in masks) else None
        if _in_place(name) and self.is_host(src):
            others = _tensors(args[1:]) + _tensors(kwargs.values())
            return "read" if any(not self.is_host(t) for t in others) else None
        return None

    def _track(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
        """Mark the outputs of one call host or device (CPU only; see the class docstring); the output."""
        if isinstance(out, torch.device):
            if getattr(func, "__self__", None) is DEVICE_PROPERTY and args and self.is_host(args[0]):
                self.host_devices[id(out)] = out
            return out
        outputs = [out] if isinstance(out, torch.Tensor) else _tensors([out]) if isinstance(out, tuple) else []
        if not outputs or _in_place(name):
            return out  # an in-place op's output is its input, already marked
        inputs = _tensors(args) + _tensors(kwargs.values())
        if name == "cpu":
            host = True
        elif name == "cuda":
            host = False
        elif name == "to" and _to_target(args, kwargs) is not None:
            host = self._host_target(_to_target(args, kwargs))
        elif kwargs.get("device") is not None:
            host = self._host_target(kwargs["device"])
        else:
            host = all(self.is_host(t) for t in inputs)  # no inputs at all: a factory without device=
        if isinstance(out, torch.Tensor) and host != self.is_host(out) and any(out is t for t in inputs):
            # `.cpu()`, `.to(self.device)` hand back their input on the CPU, where CUDA makes a copy:
            # copy here too, or marking the result would re-mark the input.
            out = outputs[0] = out.clone()
        for t in outputs:
            if host:
                setattr(t, HOST, True)
            elif getattr(t, HOST, False):
                setattr(t, HOST, False)
        return out

    def __enter__(self) -> ReadCounter:
        if self.device.type == "cpu":
            # torch.from_numpy is no torch function (the mode never sees it): mark its host tensors here.
            def from_numpy(array: Any) -> torch.Tensor:
                t = FROM_NUMPY(array)
                setattr(t, HOST, True)
                return t

            torch.from_numpy = from_numpy
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.from_numpy = FROM_NUMPY
        super().__exit__(*exc)

    def new_step(self) -> None:
        self.host_devices.clear()  # device objects are short-lived; ids must not be reused


@contextlib.contextmanager
def cuda_sync_log(device: torch.device, excluded: Excluded) -> Iterator[list[str]]:
    """On CUDA: every synchronizing CUDA call (torch.cuda.set_sync_debug_mode warnings) and every
    torch.cuda.synchronize() outside `excluded` regions, as call sites (`excluded.sync_log` while
    it lasts, which its regions trim). Elsewhere an empty log."""
    log: list[str] = []
    if device.type != "cuda":
        yield log
        return

    def counted_synchronize(*args: Any, **kwargs: Any) -> None:
        if not excluded.inside:
            log.append(f"{call_site()} torch.cuda.synchronize")
        cuda_synchronize(*args, **kwargs)

    def on_warning(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if "synchroniz" in str(message):
            log.append(f"{call_site()} sync")

    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = on_warning  # restored by catch_warnings
        torch.cuda.synchronize = counted_synchronize  # type: ignore[assignment]
        torch.cuda.set_sync_debug_mode("warn")
        excluded.sync_log = log
        try:
            yield log
        finally:
            excluded.sync_log = None
            torch.cuda.set_sync_debug_mode(previous)
            torch.cuda.synchronize = cuda_synchronize  # type: ignore[assignment]
