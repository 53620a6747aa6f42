"""One upstream vLLM instance as the router sees it: where it is, how busy it is, whether it failed.

An instance that fails (connection refused, reset, a 5xx) is skipped for a back-off that doubles
with each failure in a row (``BACKOFF_S`` up to ``MAX_BACKOFF_S``), then tried again by the next
request that ranks it; a success clears it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.backoff import Backoff
from kvtier.wire.curve import ClientKeys

BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0


@dataclass(eq=False)
class Instance:
    url: str  # http://host:port of vLLM's OpenAI server
    events: str | None = None  # vLLM's KV-events endpoint (--kv-events-config), e.g. tcp://host:5557
    kvtier: str | None = None  # HTTP address of the kvtier server this instance loads from
    events_key: str | None = None  # the events publisher's CurveZMQ public key file, where it requires CurveZMQ
    events_curve: ClientKeys | None = None  # the router's keys for that publisher (loaded from both files)
    in_flight: int = 0  # requests sent and not finished
    prefill_tokens: float = 0.0  # estimated prompt tokens still to compute of requests not yet answering
    backoff: Backoff = field(default_factory=lambda: Backoff(BACKOFF_S, MAX_BACKOFF_S))  # skipped while it waits
    counts: dict = field(default_factory=lambda: {"requests": 0, "failures": 0})

    def available(self) -> bool:
        return self.backoff.available()

    def failed(self) -> None:
        self.counts["failures"] += 1
        self.backoff.failed()

    def succeeded(self) -> None:
        self.backoff.succeeded()

    def status(self) -> dict:
        return {"url": self.url, "in_flight": self.in_flight, "prefill_tokens": round(self.prefill_tokens),
                "available": self.available(), **self.counts}


def parse_instance(spec: str, kvtier: str | None = None) -> Instance:
    """``URL[,events=ENDPOINT][,events_key=FILE][,kvtier=URL]``; ``kvtier`` is the default kvtier
    server. ValueError names what is wrong."""
    url, *options = spec.split(",")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"instance URLs start with http:// or https://, got {url!r}")
    fields = {"events": None, "events_key": None, "kvtier": kvtier}
    for option in options:
        name, sep, value = option.partition("=")
        if not sep or name not in fields or not value:
            raise ValueError(f"instance option {option!r}: expected events=ENDPOINT, events_key=FILE or kvtier=URL")
        fields[name] = value
    if fields["events"] is not None and not fields["events"].startswith(("tcp://", "ipc://")):
        raise ValueError(f"events endpoint {fields['events']!r}: expected tcp://HOST:PORT or ipc://PATH")
    if fields["events_key"] is not None and fields["events"] is None:
        raise ValueError("events_key=FILE (the publisher's CurveZMQ public key) needs events=ENDPOINT")
    if fields["kvtier"] is not None and not fields["kvtier"].startswith(("http://", "https://")):
        raise ValueError(f"kvtier server {fields['kvtier']!r}: expected its HTTP address, http://HOST:PORT")
    return Instance(url.rstrip("/"), events=fields["events"], events_key=fields["events_key"],
                    kvtier=fields["kvtier"].rstrip("/") if fields["kvtier"] else None)
