"""bench.step_overhead: a short CPU run (ar and domino, batch 1 and 8, 3 steps) and its read counter
(bench/host_reads.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench.host_reads import ReadCounter
from bench.step_overhead import main

COUNTS = ("reads", "shape_syncs", "device_reads", "device_shape_syncs", "h2d_copies", "h2d_async_copies")


def test_short_run_reports_every_case(tmp_path: Path) -> None:
    json_path, md_path = tmp_path / "step_overhead.json", tmp_path / "step_overhead.md"
    argv = ["--modes", "ar,domino", "--batches", "1,8", "--steps", "3", "--json", str(json_path)]
    main([*argv, "--markdown", str(md_path)])
    result = json.loads(json_path.read_text())
    env = result["environment"]
    assert (env["device"], env["dtype"], env["threads"]) == ("cpu", "float32", 1)
    assert env["cpu"] and isinstance(env["avx512_bf16"], bool)
    cases = {(r["mode"], r["policy"], r["batch"], r["sampling"]) for r in result["results"]}
    runs = [("ar", "adaptive"), ("domino", "adaptive"), ("domino", "fixed")]  # ar never drafts: one policy
    assert cases == {(m, p, b, s) for m, p in runs for b in (1, 8) for s in ("greedy", "sampled")}
    for r in result["results"]:
        assert r["steps"] == 3
        for name in COUNTS:
            counts = r[name]
            assert len(counts["per_step"]) == 3
            assert all(isinstance(n, int) and n >= 0 for n in counts["per_step"])
            assert isinstance(counts["max"], int) and counts["max"] == max(counts["per_step"])
            assert sum(counts["by_site"].values()) == counts["total"] == sum(counts["per_step"])
        assert r["cuda_syncs"] is None  # CUDA only
        # Issue 54: what a step needs from the host travels without blocking it (model/upload.py).
        assert r["h2d_copies"]["max"] == 0, r["h2d_copies"]["by_site"]
        # One copy of the step's host data (anchors, draws, parameters, the choice: DecodeStep.load),
        # plus one per cache (the target's, the drafter's) on steps where a row's block table grew.
        caches = 1 if r["mode"] == "ar" else 2
        assert all(1 <= n <= 1 + caches for n in r["h2d_async_copies"]["per_step"]), r["h2d_async_copies"]
        # One read of the device per step: the step's results (with the drafter's confidences, which
        # the policy uses at the next step), nothing else (no shape syncs, no branch on a device value).
        assert r["device_shape_syncs"]["max"] == 0, r["device_shape_syncs"]["by_site"]
        # A site is "model/engine/step.py:99 read .cpu": the file and function, not the line.
        sites = {f"{s.split()[0].rsplit(':', 1)[0]} {s.split()[1]}" for s in r["device_reads"]["by_site"]}
        assert sites == {"model/engine/step.py read"}, r["device_reads"]["by_site"]
        assert r["device_reads"]["per_step"] == [1, 1, 1], r["device_reads"]["by_site"]
        assert r["reads"]["total"] + r["device_reads"]["total"] > 0
        host, step = r["host_ms"], r["step_ms"]
        assert len(host["per_step"]) == len(step["per_step"]) == 3
        assert all(0 < h < s for h, s in zip(host["per_step"], step["per_step"]))
        assert 0 < host["median"] < step["median"] and host["mean"] < step["mean"]
        assert 0 < r["host_cpu_ms"]["median"] < r["step_cpu_ms"]["median"]
        assert r["kv_bytes_read_per_step"] > 0  # static shapes: the whole capacity, every step
        assert r["static_verify_calls"] >= 3 and r["dynamic_verifies"] == 0  # every verify in a bucket
        if r["mode"] == "ar":
            assert r["static_propose_calls"] == 0
        elif r["policy"] == "fixed" and r["sampling"] == "greedy":
            assert r["static_propose_calls"] == 3  # a full block every step, through the drafting bucket
    report = md_path.read_text()
    assert "| domino | fixed | 8 | sampled |" in report and env["cpu"] in report


def test_read_counter_views() -> None:
    """The brief's view counts every CPU tensor; the device view only what lives on a CUDA device."""
    cpu = torch.device("cpu")
    counter = ReadCounter(cpu)
    counter.counting = True
    with counter:
        x = torch.zeros(3, device=cpu)  # explicit device=: a device tensor
        h = torch.tensor([1, 2])  # no device=: a host tensor on CUDA too
        x.tolist()
        h.tolist()
        y = x.cpu()
        y.tolist()
        bool((x > 0).any())
        int(torch.arange(2, device=h.device)[0])  # made on a host tensor's device
        torch.zeros(3).copy_(x)  # a device tensor written into a host one
        x.nonzero()
        h.nonzero()
        with counter.excluded.region():
            x.tolist()  # inside an excluded region (a bucket): not counted
    assert counter.total("all:read") == 6
    assert counter.total("device:read") == 4  # x.tolist, x.cpu, bool(...), copy_
    assert counter.total("all:shape") == 2 and counter.total("device:shape") == 1
    assert all("test_step_overhead.py" in site for site in counter.counts["device:read"])
    assert counter.total("device:h2d") == counter.total("device:h2d_async") == 0  # nothing went host->device


def test_read_counter_counts_host_to_device_copies() -> None:
    """Copies of host data to the device, blocking or asked for with non_blocking=True; device-only
    work, host scalars and writes into host tensors are no such copies."""
    cpu = torch.device("cpu")
    counter = ReadCounter(cpu)
    counter.counting = True
    with counter:
        x = torch.zeros(4, device=cpu)  # a device tensor
        h = torch.tensor([1, 2])  # a host tensor
        torch.tensor([1, 2], device=cpu)  # 1: Python data to the device
        h.to(x.device)  # 2
        h.to(x.device, non_blocking=True)  # async
        x.copy_(torch.ones(4))  # 3: a host tensor into a device one
        x[[0, 1]]  # 4: a list index becomes a host tensor, copied over
        x[h]  # 5: a host index tensor
        torch.as_tensor(x, device=cpu)  # already on the device: no copy
        x[1] = 3.0  # a scalar: a kernel argument
        x + torch.tensor(2.0)  # a host scalar tensor: a kernel argument
        torch.zeros(4).copy_(x)  # into a host tensor: a device read
        torch.full((3,), 1, device=x.device)  # made on the device
        h.to(h.device)  # stays on the host
    assert counter.total("device:h2d") == 5 and counter.total("device:h2d_async") == 1
    assert counter.total("device:read") == 1
