"""Where a hit may end when every KV-cache group of the model must be restored there: each
group's kind (kvtier/paged/groups.py) says which ends it allows; this combines them.

A lookup asks the store once per group: the longest cached prefix of each attention group's
chunks (with the partial chunk where it stops), then, for each state group, the longest of the
remaining candidate ends whose state is cached (one ``locate`` whose candidates are those ends,
longest first). The hit is the longest end every group allows.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Sequence

from kvtier.cache import LookupResult
from kvtier.keys import ChunkSpan, PrefixKeys
from kvtier.paged.groups import span_ending_at
from kvtier.paged.layout import GroupLayout


def best_end(
    groups: Sequence[GroupLayout],
    keys: Sequence[PrefixKeys],
    attention: dict[int, LookupResult],
    find_state: Callable[[int, list[ChunkSpan]], int],
    prompt_len: int,
    block_size: int,
    limit: int,
) -> int:
    """The longest end (at most ``limit``) every group can be restored at: ``attention`` holds
    the lookup of each attention group (by position in ``groups``); ``find_state(g, candidates)``
    answers the index of the first cached candidate of state group ``g`` (-1: none)."""
    longest = min([limit, *(group.kind.longest_hit(attention.get(g), prompt_len) for g, group in enumerate(groups))])
    windows = [ends for g, group in enumerate(groups) if (ends := group.kind.hit_ends(attention.get(g))) is not None]
    states = [g for g, group in enumerate(groups) if group.kind.keeps_state]
    if states:  # a state is kept on block boundaries only
        candidates = range(longest // block_size * block_size, 0, -block_size)
    else:
        candidates = [longest] if not windows else sorted(windows[0], reverse=True)
    ends = [e for e in candidates if e <= longest and all(e in w for w in windows)]
    confirmed: set[int] = set()  # state groups that hold a state at ends[0]
    while ends and len(confirmed) < len(states):
        for g in states:
            if g in confirmed:
                continue
            found = find_state(g, [span_ending_at(keys[g], e) for e in ends])
            if found < 0:
                return 0
            if found:
                ends, confirmed = ends[found:], set()
            confirmed.add(g)
    return ends[0] if ends else 0


def tokens_by_tier(tiers: list[str], chunk: int, start: int, end: int) -> Counter:
    """Tokens of ``[start, end)`` by the tier of the chunk they fall in (``tiers``: one per chunk
    from token 0)."""
    counts: Counter = Counter()
    for index in range(start // chunk, (end - 1) // chunk + 1):
        counts[tiers[index]] += min(end, (index + 1) * chunk) - max(start, index * chunk)
    return counts
