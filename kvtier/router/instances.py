"""One upstream vLLM instance as the router sees it: where it is, how busy it is, whether it failed.

An instance that fails (connection refused, reset, a 5xx) is skipped for a back-off that doubles
with each failure in a row (``BACKOFF_S`` up to ``MAX_BACKOFF_S``), then tried again by the next
request that ranks it; a success clears it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0


@dataclass(eq=False)
class Instance:
    url: str  # http://host:port of vLLM's OpenAI server
    events: str | None = None  # vLLM's KV-events endpoint (--kv-events-config), e.g. tcp://host:5557
    kvtier: str | None = None  # HTTP address of the kvtier server this instance loads from
    in_flight: int = 0  # requests sent and not finished
    prefill_tokens: float = 0.0  # estimated prompt tokens still to compute of requests not yet answering
    failures: int = 0  # in a row
    down_until: float = 0.0  # time.monotonic() before which it is skipped
    counts: dict = field(default_factory=lambda: {"requests": 0, "failures": 0})

    def available(self, now: float | None = None) -> bool:
        return (now if now is not None else time.monotonic()) >= self.down_until

    def failed(self) -> None:
        self.failures += 1
        self.counts["failures"] += 1
        self.down_until = time.monotonic() + min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (self.failures - 1))

    def succeeded(self) -> None:
        self.failures = 0
        self.down_until = 0.0

    def status(self) -> dict:
        return {"url": self.url, "in_flight": self.in_flight, "prefill_tokens": round(self.prefill_tokens),
                "available": self.available(), **self.counts}


def parse_instance(spec: str, kvtier: str | None = None) -> Instance:
    """``URL[,events=ENDPOINT][,kvtier=URL]``; ``kvtier`` is the default kvtier server. ValueError
    names what is wrong."""
    url, *options = spec.split(",")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"instance URLs start with http:// or https://, got {url!r}")
    fields = {"events": None, "kvtier": kvtier}
    for option in options:
        name, sep, value = option.partition("=")
        if not sep or name not in fields or not value:
            raise ValueError(f"instance option {option!r}: expected events=ENDPOINT or kvtier=URL")
        fields[name] = value
    if fields["events"] is not None and not fields["events"].startswith(("tcp://", "ipc://")):
        raise ValueError(f"events endpoint {fields['events']!r}: expected tcp://HOST:PORT or ipc://PATH")
    if fields["kvtier"] is not None and not fields["kvtier"].startswith(("http://", "https://")):
        raise ValueError(f"kvtier server {fields['kvtier']!r}: expected its HTTP address, http://HOST:PORT")
    return Instance(url.rstrip("/"), fields["events"], fields["kvtier"].rstrip("/") if fields["kvtier"] else None)
