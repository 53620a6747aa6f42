"""CurveZMQ on the data port: who may talk to a server that other hosts can reach.

The data port carries KV (from which prompts can be partly rebuilt) and takes stores, so a server
bound to anything but loopback requires CurveZMQ: every peer proves it holds a secret key whose
public half is in the server's allowed-clients folder, and every frame is encrypted. A peer without
such a key gets nothing; the handshake fails before a message reaches the server, so it disturbs
nobody else. Loopback (and the shared-memory arena, which only a process on the host can map)
needs none of this, but ``--curve`` turns it on there too.

Keys are ZeroMQ certificate files, written by ``kvtier keys generate`` (pyzmq's format:
``NAME.key`` holds the public key, ``NAME.key_secret`` both halves). A file holding a secret must
be readable by its owner only (0600); the allowed-clients folder must not be writable by others.
Anything else is a ConfigError at start, before a port is bound.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from kvtier.errors import ConfigError

#: Length of a CurveZMQ key in Z85 text.
Z85_KEY_CHARS = 40


def is_loopback(host: str) -> bool:
    """Whether a data port bound to ``host`` is reachable from this host only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name, an interface name, "*": assume others can reach it
        return False


@dataclass(frozen=True)
class KeyPair:
    public: bytes
    secret: bytes


def generate(folder: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` into ``folder``, both 0600 from the
    first byte, never over existing files. Returns their paths."""
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"a key name is a plain file name, got {name!r}")
    folder = Path(folder)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise ConfigError(f"{path} exists already; remove it or choose another name")
    with _private_files():
        zmq.auth.create_certificates(folder, name)
    for path in (public, secret):
        path.chmod(0o600)
    return public, secret


@contextlib.contextmanager
def _private_files():
    """Files created meanwhile are 0600 (the umask is the process's: a CLI command's)."""
    previous = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(previous)


def load_key_pair(path: str | os.PathLike) -> KeyPair:
    """Both halves from a ``.key_secret`` file that only its owner can read."""
    path = Path(path)
    _require_private(path)
    public, secret = _read(path)
    if secret is None:
        raise ConfigError(f"{path} holds no secret key (give the NAME.key_secret file)")
    return KeyPair(public, secret)


def load_public_key(path: str | os.PathLike) -> bytes:
    return _read(Path(path))[0]


def _read(path: Path) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise ConfigError(f"key file {path} does not exist (kvtier keys generate writes one)")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"key file {path} is not a ZeroMQ certificate: {exc}") from None
    for key in (public, secret):
        if key is not None and len(key) != Z85_KEY_CHARS:
            raise ConfigError(f"key file {path} holds a key of {len(key)} characters, not {Z85_KEY_CHARS}")
    return public, secret


def _require_private(path: Path) -> None:
    if not path.is_file():
        raise ConfigError(f"key file {path} does not exist (kvtier keys generate writes one)")
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise ConfigError(f"key file {path} is readable by others (mode {mode:04o}); chmod 600 {path}")


def allowed_clients(folder: str | os.PathLike) -> Path:
    """The allowed-clients folder, checked: it exists, only its owner may change it, and it
    holds at least one public key (``*.key``)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"allowed-clients folder {folder} does not exist")
    mode = stat.S_IMODE(folder.stat().st_mode)
    if mode & 0o022:
        raise ConfigError(f"allowed-clients folder {folder} is writable by others (mode {mode:04o}); chmod 700 {folder}")
    keys = sorted(folder.glob("*.key"))
    if not keys:
        raise ConfigError(f"allowed-clients folder {folder} holds no client public key (NAME.key)")
    for key in keys:
        _read(key)
    return folder


@dataclass(frozen=True)
class ServerKeys:
    """What a server needs to require CurveZMQ: its own key pair and who may connect."""

    pair: KeyPair
    clients: Path

    @classmethod
    def load(cls, secret_key: str, clients_dir: str) -> ServerKeys:
        return cls(load_key_pair(secret_key), allowed_clients(clients_dir))

    def apply(self, socket: zmq.Socket) -> None:
        """Make ``socket`` (before it binds) a CurveZMQ server."""
        socket.curve_secretkey = self.pair.secret
        socket.curve_publickey = self.pair.public
        socket.curve_server = True

    def authenticator(self, context: zmq.Context) -> ThreadAuthenticator:
        """The ZAP handler that admits exactly the allowed clients' keys (started; ``stop()`` it)."""
        # pyzmq logs each refused handshake at DEBUG: under kvtier's logger, the server's level applies
        auth = ThreadAuthenticator(context, log=logging.getLogger(__name__))
        auth.start()
        auth.configure_curve(domain="*", location=str(self.clients))
        return auth


@dataclass(frozen=True)
class ClientKeys:
    """What a client needs to reach a CurveZMQ server: its own key pair and the server's public key."""

    pair: KeyPair
    server_public: bytes

    @classmethod
    def load(cls, secret_key: str | None, server_key: str | None) -> ClientKeys | None:
        """From the two file names, both or neither given."""
        if (secret_key is None) != (server_key is None):
            raise ConfigError("CurveZMQ needs both the client's key (.key_secret) and the server's public key (.key)")
        if secret_key is None:
            return None
        return cls(load_key_pair(secret_key), load_public_key(server_key))

    def apply(self, socket: zmq.Socket) -> None:
        """Make ``socket`` (before it connects) a CurveZMQ client of the server."""
        socket.curve_secretkey = self.pair.secret
        socket.curve_publickey = self.pair.public
        socket.curve_serverkey = self.server_public
