"""The stateful fuzzer's KV-events subscriber (kvtier_testing/fuzz_server.py): the target server
publishes its events on ipc sockets in a private folder (``server_flags``), the fuzzer's stores
carry the vLLM connector's block records of a tenant with a cache salt (``records``), and
``check`` subscribes as the server's user (the one who may) and checks what arrives, live and
replayed:

- no message holds the salt's bytes (it never leaves the engine);
- every block announced is one of a record the fuzzer stored, on the fuzzer's topic, in a tier
  that publishes (memory, disk);
- a replay that starts at the run's first batch applies cleanly (``holdings``: no block removed
  that was not announced).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from kvtier.events import decode_record
from kvtier.keys import ChunkSpan
from kvtier.objects import read_header
from kvtier_testing.kv_event_subscriber import EventSubscriber, holdings
from kvtier_testing.salted_prompts import salted_records

SALT = "fuzz-tenant-9d41c7-salt"
BLOCK = 4  # vLLM's block size in the records
MODEL = "fuzz-model"
SOURCE = "fuzz"


class EventsProbe:
    def __init__(self, workdir: Path) -> None:
        self.folder = workdir / "events"
        self.hashes: set = set()  # every block hash of a record made
        self._subscriber: EventSubscriber | None = None

    def server_flags(self) -> tuple[str, ...]:
        return "--kv-events-dir", str(self.folder), "--kv-events-source", SOURCE

    def records(self, keys: Sequence[bytes], objects: Sequence[bytes]) -> list[bytes]:
        """The connector's record of each object (its whole blocks, as the prompt of a salted
        request whose tokens follow from the key); b"" for one under a block."""
        out = []
        for key, data in zip(keys, objects):
            whole = read_header(data).num_tokens // BLOCK * BLOCK
            if not whole:
                out.append(b"")
                continue
            toks = np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 50_000, whole)
            [record] = salted_records(toks, [ChunkSpan(key, 0, whole)], SALT, BLOCK, MODEL)
            self.hashes.update(decode_record(record).block_hashes)
            out.append(record)
        return out

    def check(self, timeout_s: float) -> int:
        """What the subscription got since the last check and a replay from 0, checked (above);
        returns the events checked."""
        if self._subscriber is None:
            self._subscriber = EventSubscriber(f"ipc://{self.folder}/events", f"ipc://{self.folder}/replay")
        self._subscriber.receive(idle_s=0.05, timeout_s=timeout_s)
        live, self._subscriber.received = self._subscriber.received, []
        replayed = self._subscriber.replay(0, timeout_s)
        messages = [*live, *replayed]
        for message in messages:
            assert SALT.encode() not in message.payload, f"KV event batch {message.seq} holds the cache salt"
        if replayed and replayed[0].seq == 0:
            for tier, blocks in holdings(replayed).items():
                assert tier in ("memory", "disk"), f"blocks announced in tier {tier!r}"
                for topic, _, block in blocks:
                    assert topic == f"kv@{SOURCE}@{MODEL}", f"a block announced on topic {topic!r}"
                    assert block in self.hashes, f"a block announced that no stored record holds: {block!r}"
        return sum(len(message.batch.events) for message in messages)

    def close(self) -> None:
        if self._subscriber is not None:
            self._subscriber.close()
