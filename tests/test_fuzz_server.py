"""The stateful fuzzer (kvtier_testing/fuzz_server.py) over a real ``kvtier server``: a bounded
number of examples here; ``bench/fuzz.py --minutes N`` runs it longer."""

from __future__ import annotations

import random

from kvtier_testing import fuzz_server

#: About a minute and a half on an idle 2-core machine (each example is tens of moves; one in
#: four restarts the server, one in six waits out the lease time).
EXAMPLES = 30


def test_fuzzer_breaks_no_invariant(tmp_path):
    target = fuzz_server.started_target(tmp_path, seed=random.randrange(1 << 32))
    try:
        fuzz_server.run(target, max_examples=EXAMPLES)
    finally:
        target.close()
    stats = target.stats
    assert target.examples >= EXAMPLES
    # the moves that matter ran: a fuzzer that stops reaching them would pass vacuously
    for figure in ("objects_checked", "retrieve_hits", "restarts", "lease_waits", "owner_commits",
                   "foreign_counted", "stale_refused"):
        assert stats[figure] >= 1, f"no {figure} in {EXAMPLES} examples: {dict(stats)}"
