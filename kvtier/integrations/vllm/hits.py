"""Which objects each KV-cache group needs for a hit, and which it stores at a save.

A hit of P tokens is usable only if every group of the model can be restored at P:

    full attention, MLA   the KV of every token before P: the chunks covering [0, P), cut
                          anywhere on a block boundary
    sliding window,       the KV of the ``lookback`` tokens before P: an object holds the window
    chunked local         before its own end, so P must be the end of an object (or one token
                          before it: a load leaves the prompt's last token to compute)
    recurrent state       the state after token P-1, which vLLM keeps (``mamba_cache_mode
                          align``) only where a step of the prefill ended on a block boundary:
                          P must be the end of a state object, and never the prompt's end

A lookup asks the store once per group: the longest cached prefix of each attention group's
chunks (with the partial chunk where it stops), then, for each state group, the longest of the
remaining candidate ends whose state is cached (one ``locate`` whose candidates are those ends,
longest first). The hit is the longest end every group allows.
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvtier.cache import LookupResult
from kvtier.integrations.vllm.common import GroupLayout, save_spans
from kvtier.keys import ChunkSpan, PrefixKeys


def spans_by_end(keys: PrefixKeys) -> dict[int, ChunkSpan]:
    """Every object a group could hold for this prompt, by where it ends: its chunks and the
    partial chunks ending on each block boundary."""
    ends = {span.end: span for partials in keys.partials for span in partials}
    ends.update((span.end, span) for span in keys.spans)
    return ends


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
    longest = min([limit, *(r.hit_tokens for g, r in attention.items() if groups[g].retention == "all")])
    windows = [{s.end for s in r.spans} for g, r in attention.items() if groups[g].retention == "window"]
    states = [g for g, group in enumerate(groups) if group.retention == "state"]
    if states:  # a state is kept on block boundaries only, and the prompt's last token is computed
        longest = min(longest, prompt_len - 1)
        candidates = range(longest // block_size * block_size, 0, -block_size)
    else:
        candidates = [longest] if not windows else sorted(windows[0], reverse=True)
    ends = [e for e in candidates if e <= longest and all(e in w for w in windows)]
    confirmed: set[int] = set()  # state groups that hold a state at ends[0]
    while ends and len(confirmed) < len(states):
        for g in states:
            if g in confirmed:
                continue
            found = find_state(g, [spans_by_end(keys[g])[e] for e in ends])
            if found < 0:
                return 0
            if found:
                ends, confirmed = ends[found:], set()
            confirmed.add(g)
    return ends[0] if ends else 0


def hit_spans(group: GroupLayout, keys: PrefixKeys, attention: LookupResult | None, hit: int) -> list[ChunkSpan]:
    """The objects of a hit ending at ``hit`` that a load may read for ``group``."""
    if group.retention == "state":
        return [spans_by_end(keys)[hit]] if hit else []
    return [s for s in attention.spans if s.start < hit]


def load_spans(group: GroupLayout, spans: list[ChunkSpan], start: int, end: int) -> list[ChunkSpan]:
    """Of a hit's objects, those a load of tokens [start, end) reads for ``group``."""
    if group.retention == "state":
        return spans[-1:]
    low = start if group.retention == "all" else max(start, end - group.layout.lookback)
    return [s for s in spans if s.end > low and s.start < end]


def group_save_spans(group: GroupLayout, keys: PrefixKeys, saved_upto: int, end: int, step_end: int) -> list[ChunkSpan]:
    """The objects of ``group`` a save stores: for attention, the chunks (and partial and tail
    chunks) of the first ``end`` tokens past ``saved_upto``; for recurrent state, the state at
    ``step_end`` if the step ended on a block boundary (vLLM keeps no other)."""
    block = group.layout.block_size
    if group.retention == "state":
        span = spans_by_end(keys).get(step_end) if step_end % block == 0 else None
        return [span] if span is not None else []
    return [s for s in save_spans(keys, end, block) if s.end > saved_upto]
