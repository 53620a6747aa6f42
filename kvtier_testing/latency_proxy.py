"""A TCP proxy that makes a real server slow: every reply waits ``delay_s`` before it is passed
on, and its bytes go at most ``bytes_per_s``. Put in front of a Redis (or SeaweedFS) lower tier,
it gives a remote tier that is slower than recomputing, for load-or-recompute's tests and
``bench/vllm_ttft.py --scenario slow-remote``. Both figures can be changed while it runs."""

from __future__ import annotations

import socket
import threading
import time

from kvtier_testing.services import free_port


class LatencyProxy:
    def __init__(self, upstream: tuple[str, int], delay_s: float, bytes_per_s: float | None = None) -> None:
        self.upstream = upstream
        self.delay_s = delay_s
        self.bytes_per_s = bytes_per_s
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="latency-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
                server = socket.create_connection(self.upstream)
            except OSError:
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._sockets.append(s)
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, dest: socket.socket, slow: bool) -> None:
        """Copy ``source`` to ``dest``; replies (``slow``) wait ``delay_s`` once per burst of
        bytes (a reply the server sent at once) and are paced to ``bytes_per_s``."""
        try:
            while True:
                data = source.recv(1 << 20)
                if not data:
                    break
                if slow:
                    time.sleep(self.delay_s)
                    if self.bytes_per_s:
                        time.sleep(len(data) / self.bytes_per_s)
                    source.setblocking(False)
                    try:  # the rest of the same reply goes on without a second delay
                        while True:
                            more = source.recv(1 << 20)
                            if not more:
                                break
                            data += more
                            if self.bytes_per_s:
                                time.sleep(len(more) / self.bytes_per_s)
                    except BlockingIOError:
                        pass
                    finally:
                        source.setblocking(True)
                dest.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, dest):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for s in self._sockets:
            s.close()

    def __enter__(self) -> "LatencyProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
