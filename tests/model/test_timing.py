"""model/engine/timing.py on the CPU: phases are host-clock spans around their blocks (the CUDA
event path is tests/model/test_cuda.py's)."""

from __future__ import annotations

import pytest
import torch

from model.engine.timing import PhaseTimer


def test_phases_are_timed_around_their_blocks_and_a_failed_one_is_not_recorded() -> None:
    timer = PhaseTimer(torch.device("cpu"))
    with timer.phase("verify"):
        x = torch.randn(64, 64)
        x @ x
    with timer.phase("draft"):
        pass
    verify, draft = timer.seconds("verify"), timer.seconds("draft")
    assert verify > 0 and draft >= 0
    outer = timer.marks["verify"]
    assert isinstance(outer[0], float) and outer[0] <= outer[1] <= timer.marks["draft"][0]  # in order
    with pytest.raises(RuntimeError), timer.phase("broken"):
        raise RuntimeError("a failed forward")
    assert "broken" not in timer.marks
    with pytest.raises(KeyError):
        timer.seconds("broken")
