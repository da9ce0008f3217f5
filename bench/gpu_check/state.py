"""What the GPU check's parts share with its driver (bench/gpu_check/driver.py): the run's state and
records (`Check`), and the two ways a part ends early (`PartTimeout`, `Skip`). Apart from the
driver so that the parts import it and the driver imports the parts, with no circle."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from bench.report import json_ready

FILES = ("results.jsonl", "log.txt", "summary.md")  # all that a run writes under --out


class PartTimeout(BaseException):
    """Raised in the main thread when a part's box runs out. A BaseException, so that code which
    catches Exception (StaticFunction's capture fallback, say) does not swallow it."""


class Skip(Exception):
    """A part that cannot run here (no CUDA device, say): recorded with its reason, not a failure."""


class Check:
    """One run's state: flags, the output files, the deadline, the records so far, and what the
    parts share (the planted model, the SDPA backends)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.deadline
        self.part_deadline = self.deadline  # set by run_part: the running part's box ends here
        self.records: list[dict[str, Any]] = []
        self.part = ""
        self.shared: dict[str, Any] = {}
        self._results = (self.out / FILES[0]).open("w")

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def part_remaining(self) -> float:
        return min(self.deadline, self.part_deadline) - time.monotonic()

    def record(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Append one measurement to results.jsonl now (flushed and fsynced)."""
        rec = {"part": self.part, "kind": kind, "t_s": round(self.elapsed(), 2), **fields}
        self.records.append(rec)
        self._results.write(json.dumps(json_ready(rec), default=str) + "\n")
        self._results.flush()
        os.fsync(self._results.fileno())
        return rec

    def close(self) -> None:
        self._results.close()
