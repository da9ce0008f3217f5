"""The GPU check: one process that measures what docs/benchmarks.md owes for the static-shape /
CUDA-graph path, inside one short device command, and keeps whatever it measured if it is killed.

Parts, in order (bench/gpu_check/parts.py; `--parts` picks some):
  env          versions, GPU clocks, the decoder's cache argument, the SDPA backend (then pinned);
  correctness  graph verify vs eager vs HF forward (teacher-forced), greedy identity graph / eager /
               HF generate with rows joining and leaving, no bucket fell back to eager;
  timings      graph replays (CUDA events: median, p10, p90; on the CPU wall time, labelled so):
               verify T x batch at 2k, T = 1, 17 at 8k and 32k, the proposal head on / off, eager vs graph;
  e2e          oracle drafter at tau 1, 4, 7.17, batch 1 and 16, 256 new tokens, 3 repeats; graph ar;
               one adaptive-policy run; host ms per step;
  cuda_tests   tests/model/test_cuda.py (tiny models) with one chi-square through graphs, then the
               capture-failure test alone in its own process (skipped without CUDA).

Each part has a time box (a part past it is recorded as timed out and the next one runs) inside one
global deadline. Every measurement is appended to results.jsonl as it is made (flushed, fsynced);
log.txt holds everything printed (the pytest runs too); summary.md is rewritten after every part.
Those three files are all that is written under --out.

On the GPU machine (its own torch 2.11 / transformers 5.17; nothing to install or carry; ~30 MiB
of tree travels), as the device `run` tool's command, timeout_s 480 (~7 minutes, leaving time in
the 15-minute lease for the rerun below):

    PYTHONUNBUFFERED=1 python3 -m bench.gpu_check --out $OUT --deadline 420

The rerun, at once while the machine is warm, of the parts that failed or timed out (summary.md's
first table; the named parts share the deadline), <= 3 minutes, timeout_s 200:

    PYTHONUNBUFFERED=1 python3 -m bench.gpu_check --out $OUT --deadline 170 --parts timings,e2e

Here on the CPU (every width / 16, ~90 s on 2 cores; the times are CPU wall times, no GPU figures):

    .venv/bin/python -m bench.gpu_check --scale 16 --device cpu --out /tmp/gpu_check
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from bench.common import parse_ints, parse_names
from bench.gpu_check.parts import PART_FUNCTIONS
from bench.gpu_check.state import FILES, Check, PartTimeout, Skip
from bench.gpu_check.summary import summary_markdown

PARTS = ("env", "correctness", "timings", "e2e", "cuda_tests")
# Seconds per part at the default deadline (GPU), the model build inside the first part that needs
# it. The deadline is shared among the selected parts in proportion to these (a rerun of two parts
# gives them all of its deadline; a slow CPU run passes a longer one); --boxes overrides one.
DEADLINE = 420.0
BOXES = {"env": 10, "correctness": 110, "timings": 80, "e2e": 120, "cuda_tests": 100}


class Tee:
    """Writes to the terminal and to log.txt at once, flushing both: a killed run keeps its log."""

    def __init__(self, stream: TextIO, log: TextIO) -> None:
        self.stream, self.log = stream, log

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.stream.flush()
        self.log.write(text)
        self.log.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self.log.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.stream.fileno()


@contextlib.contextmanager
def time_box(seconds: float) -> Iterator[None]:
    """Raise PartTimeout in the main thread after `seconds` (SIGALRM; Python code only: a kernel
    or a C call that never returns is left to the global watchdog)."""

    def on_alarm(_signum: int, _frame: Any) -> None:
        raise PartTimeout(f"past its box of {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    t0 = time.monotonic()
    outer, interval = signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if outer > 0:  # someone else's alarm (pytest-timeout's, say): put back what is left of it
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - t0), 0.01), interval)


def run_part(check: Check, name: str, fn: Callable[[Check], None], box: float) -> dict[str, Any]:
    """Run one part inside min(box, time left), record its status; never raises (but ^C)."""
    check.part = name
    limit = min(box, check.remaining())
    t0 = time.monotonic()
    check.part_deadline = t0 + limit
    print(f"== {name}: at most {limit:.0f} s (t = {check.elapsed():.0f} s)", flush=True)
    fields: dict[str, Any]
    if check.remaining() < 1:
        fields = {"status": "skipped", "reason": "the global deadline was reached"}
    else:
        try:
            with time_box(limit):
                fn(check)
            fields = {"status": "ok"}
        except PartTimeout as exc:
            fields = {"status": "timed_out", "reason": str(exc)}
        except Skip as exc:
            fields = {"status": "skipped", "reason": str(exc)}
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - a failed part must not stop the next one
            traceback.print_exc()
            fields = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:2000]}
    rec = check.record("part", name=name, box_s=round(limit, 1), seconds=round(time.monotonic() - t0, 2), **fields)
    print(f"== {name}: {rec['status']} after {rec['seconds']:.1f} s {fields.get('reason', '')}", flush=True)
    return rec


def start_watchdog(check: Check, grace: float) -> threading.Timer:
    """Past the deadline + grace (a part stuck where SIGALRM cannot reach it), record that and exit."""

    def fire() -> None:
        check.part = check.part or "driver"
        with contextlib.suppress(Exception):
            check.record("killed", reason=f"the global deadline + {grace:.0f} s passed inside part {check.part}")
            write_summary(check)
        os._exit(124)

    timer = threading.Timer(max(check.remaining() + grace, 0.0), fire)
    timer.daemon = True
    timer.start()
    return timer


def write_summary(check: Check) -> None:
    (check.out / FILES[2]).write_text(summary_markdown(check.records, check.args))


def part_boxes(args: argparse.Namespace) -> dict[str, float]:
    """Each selected part's box: its share of the deadline (BOXES' proportions), or --boxes."""
    total = sum(BOXES[x] for x in args.parts)
    return {x: args.boxes.get(x, round(BOXES[x] / total * args.deadline, 1)) for x in args.parts}


def parse_boxes(text: str) -> dict[str, float]:
    """NAME=SECONDS,...: overrides of the per-part boxes."""
    boxes: dict[str, float] = {}
    for item in parse_names(text):
        name, _, seconds = item.partition("=")
        if name not in PARTS or not seconds:
            raise argparse.ArgumentTypeError(f"--boxes: {item!r} is not PART=SECONDS with PART in {PARTS}")
        boxes[name] = float(seconds)
    return boxes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "bench/results/gpu_check", help="the 3 files go here")
    p.add_argument("--parts", type=parse_names, default=list(PARTS), help=f"of {','.join(PARTS)}")
    p.add_argument("--deadline", type=float, default=DEADLINE, help="seconds for the whole run")
    p.add_argument("--boxes", type=parse_boxes, default={}, help="per-part seconds, e.g. timings=60,e2e=90")
    p.add_argument("--scale", type=int, default=1, help="divide every width by K (CPU runs: 16)")
    p.add_argument("--layers-scale", type=int, default=1, help="also divide layer counts by K")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--embed-rms", type=float, default=32.0, help="per-element RMS of the planted embeddings")
    # Sizes: None means the device's default (bench/gpu_check/parts.py: SIZES).
    p.add_argument("--capacities", type=parse_ints, default=None, help="verify capacities: the first all T x batch")
    p.add_argument("--batch-sizes", type=parse_ints, default=None, help="timing and e2e batch sizes")
    p.add_argument("--repeats", type=int, default=None, help="timed replays per measurement")
    p.add_argument("--new-tokens", type=int, default=None, help="e2e new tokens per row")
    p.add_argument("--e2e-repeats", type=int, default=None, help="e2e decodes per record (median kept)")
    p.add_argument("--taus", default="1,4,7.17", help="e2e oracle acceptance lengths")
    args = p.parse_args(argv)
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}; choose from {list(PARTS)}")
    args.parts = [x for x in PARTS if x in args.parts]
    args.taus = [float(x) for x in parse_names(args.taus)]
    return args


def main(argv: list[str] | None = None, parts: dict[str, Callable[[Check], None]] | None = None) -> list[dict]:
    """Run the selected parts; `parts` replaces the real ones (tests). Returns the records."""
    args = parse_args(argv)
    check = Check(args)
    log = (check.out / FILES[1]).open("w")
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = Tee(stdout, log), Tee(stderr, log)  # type: ignore[assignment]
    watchdog = start_watchdog(check, grace=20.0)
    try:
        if parts is None:
            parts = PART_FUNCTIONS
        boxes = part_boxes(args)
        print(f"gpu_check: deadline {args.deadline:.0f} s, boxes {boxes}, out {check.out}", flush=True)
        for name in args.parts:
            run_part(check, name, parts[name], boxes[name])
            write_summary(check)
        check.part = "driver"
        check.record("done", seconds=round(check.elapsed(), 2))
        write_summary(check)
        print((check.out / FILES[2]).read_text(), flush=True)
    finally:
        watchdog.cancel()
        watchdog.join()  # no thread of ours left running while the interpreter shuts down
        sys.stdout, sys.stderr = stdout, stderr
        log.close()
        check.close()
    return check.records
