"""Backoff (kvtier/backoff.py) on a fake clock."""

from kvtier.backoff import Backoff


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_waits_double_from_the_base_up_to_the_cap():
    backoff = Backoff(0.5, 3.0, Clock())
    assert [backoff.failed() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_unavailable_until_the_wait_is_over():
    clock = Clock()
    backoff = Backoff(1.0, 30.0, clock)
    assert backoff.available() and backoff.remaining == 0.0
    backoff.failed()
    assert not backoff.available() and backoff.remaining == 1.0
    clock.now += 0.5
    assert not backoff.available() and backoff.remaining == 0.5
    clock.now += 0.5
    assert backoff.available() and backoff.remaining == 0.0


def test_a_success_clears_the_wait_and_the_count():
    backoff = Backoff(1.0, 30.0, Clock())
    backoff.failed()
    backoff.failed()
    backoff.succeeded()
    assert backoff.available() and backoff.failures == 0
    assert backoff.failed() == 1.0
