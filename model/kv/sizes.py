"""Memory sizes as settings write them (`512MiB`, `4GiB`, `0.9`) and as logs print them. Torch-free:
the settings module (the wire side) validates with it."""

from __future__ import annotations

import re

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str) -> int | float:
    """`512MiB`, `4GiB`, `1.5GB`, `1073741824` -> bytes (int); `0.9` -> a fraction (float in (0, 1])
    of the memory left after the weights. ValueError for anything else."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(2).lower() not in UNITS:
        raise ValueError(f"{text!r} is neither a size with a unit (512MiB, 4GiB) nor a fraction in (0, 1] (0.9)")
    number, unit = float(m.group(1)), m.group(2).lower()
    if not unit and "." in m.group(1):
        if not 0 < number <= 1:
            raise ValueError(f"a fraction of the memory must be in (0, 1], got {text!r}")
        return number
    size = int(number * UNITS[unit])
    if size < 1:
        raise ValueError(f"a KV cache of {text!r} holds nothing")
    return size


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
