"""tests.fixtures.waiting.wait_for: the suite's one polling loop returns what it waited for, and its
timeout says what that was and what it saw last."""

from __future__ import annotations

import itertools
import time

import pytest

from tests.fixtures.waiting import wait_for


def test_returns_the_value_that_satisfied_the_condition() -> None:
    counter = itertools.count()
    assert wait_for(lambda: next(counter), until=lambda n: n >= 3, timeout=5) == 3
    assert wait_for(lambda: "ready", timeout=0) == "ready"  # polled once even with no time at all


def test_timeout_names_what_was_awaited_and_the_last_value() -> None:
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 0.2 s waiting for the queue to empty; last seen: 7"):
        wait_for(lambda: 7, until=lambda n: n == 0, timeout=0.2, what="the queue to empty")
    assert 0.2 <= time.monotonic() - t0 < 2
    # Without `what`, the condition's source line says what it was.
    with pytest.raises(AssertionError, match=r"lambda: False.*last seen: False"):
        wait_for(lambda: False, timeout=0.05)


def test_ignored_errors_count_as_not_yet_and_others_propagate() -> None:
    attempts = iter([ConnectionError("refused"), ConnectionError("refused"), 200])

    def probe() -> int:
        item = next(attempts)
        if isinstance(item, Exception):
            raise item
        return item

    assert wait_for(probe, timeout=5, ignore=(ConnectionError,)) == 200

    def failing() -> int:
        raise ConnectionError("refused")

    with pytest.raises(AssertionError, match="last seen: ConnectionError: refused"):
        wait_for(failing, timeout=0.05, ignore=(ConnectionError,))
    with pytest.raises(ConnectionError):  # not ignored: no waiting for a condition that cannot hold
        wait_for(failing, timeout=5)
