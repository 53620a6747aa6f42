"""Health (kvtier/tiers/health.py) on a fake clock; the remote tier tests cover it against real servers."""

import pytest

from kvtier import backoff as backoff_module
from kvtier.tiers.base import TierStats
from kvtier.tiers.health import Health


class Store:
    def __init__(self, up: bool) -> None:
        self.up = up
        self.probes = 0

    def probe(self) -> None:
        self.probes += 1
        if not self.up:
            raise ConnectionError("down")


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(backoff_module.time, "monotonic", lambda: now[0])
    return now


def test_down_at_start_is_probed_with_doubling_backoff_then_taken_back(clock):
    store, stats = Store(up=False), TierStats()
    health = Health("t", store.probe, stats, initial_backoff_s=1, max_backoff_s=4)
    assert not health.check() and stats.extra["healthy"] == 0
    waits = []
    for _ in range(4):  # probes due after 1, 2, 4, 4 s
        start = clock[0]
        while not health.available() and store.probes == len(waits) + 1:
            clock[0] += 0.5
        waits.append(clock[0] - start)
    assert waits == [1.0, 2.0, 4.0, 4.0] and stats.extra["skipped"] > 0
    store.up = True
    clock[0] += 4
    assert health.available() and health.healthy and stats.extra["healthy"] == 1


def test_failures_of_calls_in_flight_do_not_stretch_the_backoff(clock):
    store, stats = Store(up=True), TierStats()
    health = Health("t", store.probe, stats, initial_backoff_s=1, max_backoff_s=30)
    assert health.check()
    for _ in range(5):  # five concurrent calls fail as the store goes down
        health.failed(TimeoutError("slow"), timeout=True)
    assert stats.extra["timeouts"] == 5 and not health.healthy
    assert not health.available()
    clock[0] += 1
    assert health.available() and store.probes == 2  # back after the initial backoff, not 2**5 s


def test_dropped_writes_are_counted(clock):
    stats = TierStats()
    health = Health("t", Store(up=True).probe, stats)
    health.dropped(3)
    assert stats.as_dict()["dropped_puts"] == 3
