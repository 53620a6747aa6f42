"""The stateful fuzzer (kvtier_testing/fuzz_server.py) over a real ``kvtier server``: a bounded
number of examples here; ``bench/fuzz.py --minutes N`` runs it longer."""

from __future__ import annotations

import random

import pytest

from kvtier_testing import fuzz_server

pytestmark = pytest.mark.servers  # starts real servers (kvtier, Redis/Valkey or SeaweedFS)

#: About a minute and a half on an idle 2-core machine (each example is tens of moves; one in
#: four restarts the server, one in six waits out the lease time).
EXAMPLES = 30


@pytest.mark.slow
def test_fuzzer_breaks_no_invariant(tmp_path):
    target = fuzz_server.started_target(tmp_path, seed=random.randrange(1 << 32))
    try:
        fuzz_server.run(target, max_examples=EXAMPLES)
    finally:
        target.close()
    stats = target.stats
    assert target.examples >= EXAMPLES
    # the moves that matter ran: a fuzzer that stops reaching them would pass vacuously (the rare
    # ones, restarts and lease waits, by the test below)
    for figure in ("objects_checked", "retrieve_hits", "stored"):
        assert stats[figure] >= 1, f"no {figure} in {EXAMPLES} examples: {dict(stats)}"


@pytest.mark.slow
def test_every_move_in_one_example(tmp_path):
    """One example that makes every move, the rare ones included, with its invariants checked
    after each."""
    target = fuzz_server.started_target(tmp_path, seed=random.randrange(1 << 32))
    fuzz_server.ServerFuzz.target = target
    machine = fuzz_server.ServerFuzz()
    moves = [
        lambda: machine.stored_first(c=0, chains_first=2),
        lambda: machine.retrieve(c=1, chain=0, n=3, hold=True),
        lambda: machine.lookup(c=0, chain=1, n=3, pin=True),
        lambda: machine.raw_retrieve(s=0, chain=1, n=2, inline=False),
        lambda: machine.raw_lookup(s=0, chain=0, n=2, pin=True),
        lambda: machine.raw_reserve(s=0, chain=2, i=0),
        *[lambda i=i, how=how: machine.foreign_handle(s=1, i=i, how=how)
          for i in range(4) for how in ("done", "release", "abort", "commit")],
        lambda: machine.clear(now=2),
        lambda: machine.store(c=2, chain=3, n=3),
        *[lambda i=i: machine.finish_held(i=0) for i in range(4)],
        *[lambda what=what, args=args: machine.crafted(request={"what": what, "s": 1, **args}) for what, args in [
            ("repeated_keys", {"chain": 3, "i": 0, "j": 0}), ("stale_arena", {"kind": "commit", "arena": b"x" * 8}),
            ("out_of_range", {"case": 0, "big": 5}), ("forged_put", {"chain": 1, "flip": 99}),
            ("garbage", {"raw": False, "junk": [b"\x00"]}), ("unadmitted", {"kind": "forged"})]],
        *[lambda what=what, args=args: machine.crafted(request={"what": what, **args}) for what, args in [
            ("before_hello", {"frames": 2, "frame_kib": 64}), ("unfinished", {"frames": 3, "frame_kib": 1024}),
            ("oversized", {"hello": True}), ("oversized", {"hello": False}), ("many_hellos", {"count": 100}),
            *[("reserve_race", {"a": 0, "chain": 3, "i": i, "ahead": ahead, "first": first})
              for i, (ahead, first) in enumerate([(False, "aborts-after"), (True, "aborts-after"), (False, "expires")])]]],
        lambda: machine.kill_session(s=0),
        lambda: machine.reconnect(c=1),
        lambda: machine.restart(kill=True, now=3),
        lambda: machine.retrieve(c=0, chain=0, n=3, hold=False),
        lambda: machine.wait_out_leases(now=5),
    ]
    try:
        for move in moves:
            move()
            machine.held_objects_are_intact()
            machine.server_answers()
    finally:
        machine.teardown()
        target.close()
    stats = target.stats
    for figure in ("restarts", "lease_waits", "foreign_counted", "stale_refused", "unadmitted_refused",
                   "forged_refused", "repeated_refused", "retrieve_hits", "cut_before_hello", "unfinished_cut",
                   "oversized_refused", "hello_floods", "races_stored"):
        assert stats[figure] >= 1, f"no {figure}: {dict(stats)}"
    assert target.moves["reserve_race"] == 3 and target.moves["wait_out_leases"] == 1, dict(target.moves)
