"""Where ``kvtier server`` publishes its KV events, and who may subscribe (docs/security.md).

The events carry every tenant's prompt tokens, so the sockets admit whom the data port admits:

- ``--kv-events-dir DIR``: ``ipc://DIR/events`` (PUB) and ``ipc://DIR/replay``, Unix sockets in a
  folder only the server's user may enter (0700, its owner the server's user; made so if new,
  refused otherwise), each socket 0600. The kernel checks who connects: a subscriber needs nothing
  but the endpoint, as for vLLM's own publisher, which takes ``ipc://`` endpoints too.
- ``--kv-events-port N``: TCP on ``--host``, only with CurveZMQ on; the sockets then use the data
  port's server keys and allowed clients (config.py refuses it without).

A second server given the same folder would take the sockets over (ZeroMQ replaces a socket file
on bind), so a socket that answers is "in use" and stops the start.
"""

from __future__ import annotations

import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError

PUBLISH_NAME = "events"
REPLAY_NAME = "replay"
#: The longest path a Unix socket may have (``sun_path``, 108 bytes with its terminating zero).
MAX_SOCKET_PATH = 107


@dataclass(frozen=True)
class EventsEndpoints:
    publish: str  # ZeroMQ endpoint of the PUB socket
    replay: str  # ZeroMQ endpoint of the replay (ROUTER) socket
    folder: Path | None = None  # the ipc sockets' folder; None for TCP

    @classmethod
    def tcp(cls, host: str, port: int, replay_port: int) -> EventsEndpoints:
        address = f"[{host}]" if ":" in host else host
        return cls(f"tcp://{address}:{port}", f"tcp://{address}:{replay_port}")

    @classmethod
    def ipc(cls, folder: str | os.PathLike) -> EventsEndpoints:
        """The sockets in ``folder``, made private now (ConfigError naming what is wrong)."""
        folder = Path(os.path.abspath(folder))
        private_folder(folder)
        for name in (PUBLISH_NAME, REPLAY_NAME):
            _not_in_use(folder / name)
        return cls(f"ipc://{folder / PUBLISH_NAME}", f"ipc://{folder / REPLAY_NAME}", folder)

    def sockets(self) -> list[Path]:
        """The socket files (none for TCP)."""
        return [] if self.folder is None else [self.folder / PUBLISH_NAME, self.folder / REPLAY_NAME]


def socket_path_fits(folder: str) -> bool:
    """Whether the longer socket's path in ``folder`` fits a Unix socket address."""
    return len(os.fsencode(os.path.join(os.path.abspath(folder), REPLAY_NAME))) <= MAX_SOCKET_PATH


def private_folder(folder: Path) -> None:
    """``folder`` exists (made 0700 if missing), is a real folder, is the server's user's, and no
    other user may enter it."""
    try:
        folder.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"--kv-events-dir {folder}: cannot make it: {exc.strerror}") from None
    info = folder.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"--kv-events-dir {folder} is not a folder")
    if info.st_uid != os.geteuid():
        raise ConfigError(f"--kv-events-dir {folder} belongs to uid {info.st_uid}, not this server's user ({os.geteuid()})")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        raise ConfigError(f"--kv-events-dir {folder} is open to other users (mode {mode:04o}); chmod 700 {folder}")


def _not_in_use(path: Path) -> None:
    if not path.exists():
        return
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise ConfigError(f"--kv-events-dir: {path} is not a socket; remove it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:  # nobody listens: a socket left by a server that is gone, replaced on bind
        return
    finally:
        probe.close()
    raise ConfigError(f"--kv-events-dir: {path} is in use by another server; give each server its own folder")
