"""The admin token of a server's HTTP port: the operator's, or one the server makes at start and
leaves where its own user, and no other, finds it.

Clearing the cache and ``POST /api/lookup`` always need ``Authorization: Bearer <token>``: on
loopback too, where every local user reaches the port. Without ``--admin-token`` (allowed on a
loopback HTTP host only) the server makes a random token at start and writes it to
``http-<port>.admin-token`` in its user's token folder: ``$XDG_RUNTIME_DIR/kvtier`` (a per-user
folder systemd makes for a login or a user service), else ``~/.cache/kvtier/admin-tokens`` (a
folder of its own: ``~/.cache/kvtier`` also holds caches made with the usual modes). The folder
is 0700 and the file 0600 from its first byte; the file is removed at stop. ``kvtier kvcache clear`` and
the router read the file of the port they call when its URL is on loopback and they were given no
token, so the server's user needs no flag; a token file is never read for any other URL, so a
local token never leaves the host.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
import urllib.parse
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.wire.curve import is_loopback

#: Random bytes of a token the server makes (URL-safe text, 43 characters).
TOKEN_BYTES = 32
#: The longest token file read: far longer than any token.
MAX_TOKEN_CHARS = 4096


def token_folder() -> Path:
    """This user's folder of the tokens its servers made."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "kvtier" if runtime else Path.home() / ".cache" / "kvtier" / "admin-tokens"


def token_path(http_port: int) -> Path:
    return token_folder() / f"http-{http_port}.admin-token"


def token_for(url: str) -> str:
    """The token a server of this user made for the HTTP port of ``url``; "" where ``url`` is not
    on loopback or there is no such file (the server was given its token, or is another user's)."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a port that is not a number
        return ""
    if not parts.hostname or not is_loopback(parts.hostname):
        return ""
    return _read(token_path(port))


def _read(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return ""
    try:
        return os.read(fd, MAX_TOKEN_CHARS).decode("ascii", "replace").strip()
    except OSError:
        return ""
    finally:
        os.close(fd)


class AdminToken:
    """What the HTTP port checks admin requests against."""

    def __init__(self, given: str = "") -> None:
        self.value = given or secrets.token_urlsafe(TOKEN_BYTES)
        self.made = not given
        self.path: Path | None = None  # the file, while the server's made token is in it

    def accepts(self, presented: str | None) -> bool:
        return hmac.compare_digest((presented or "").encode(), self.value.encode())

    def publish(self, http_port: int) -> None:
        """Write a made token to the file of ``http_port`` (once the port is bound: it is ours).
        A file a server killed before its stop left there is replaced."""
        if not self.made:
            return
        folder = token_folder()
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            found = os.stat(folder)
        except OSError as exc:
            raise ConfigError(f"cannot make the admin token's folder {folder}: {exc}; "
                              "give --admin-token, or set XDG_RUNTIME_DIR to a folder of this user's") from None
        if found.st_uid != os.geteuid() or found.st_mode & 0o077:
            raise ConfigError(
                f"the admin token's folder {folder} is open to other users (mode {stat.S_IMODE(found.st_mode):04o}, "
                f"owner uid {found.st_uid}; this server runs as uid {os.geteuid()}): chmod 700 {folder} if it is "
                "this user's, else remove it; or give --admin-token")
        path = token_path(http_port)
        temp = folder / f".{path.name}.{secrets.token_hex(4)}"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            try:
                os.write(fd, self.value.encode())
            finally:
                os.close(fd)
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        self.path = path

    def withdraw(self) -> None:
        """Remove the file, unless a server on another loopback address with the same port has
        written its own there since."""
        if self.path is not None and _read(self.path) == self.value:
            self.path.unlink(missing_ok=True)
        self.path = None
