"""Act as another user of the host: what a local attacker who is not the server's user can do.

A test runs a short script as ``nobody`` (uid and gid 65534) in a new interpreter: as root, the
script drops to nobody once its imports are in (``become_nobody()``, which the script calls).
No file mode stops root, so these checks need the test to run as root; ``is_root()`` says
whether it does, and a test that is not must check the file modes themselves instead.

A folder a test creates with ``shared_folder`` can be walked through by nobody (0755), as any
folder on the host's disk can: what protects the files inside is their own modes, not the
test's private temporary folder (pytest's are 0700).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

NOBODY = 65534

_PRELUDE = f"""
import os

def become_nobody():
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid({NOBODY})
        os.setuid({NOBODY})
"""


def is_root() -> bool:
    return os.geteuid() == 0


def run_as_nobody(script: str, *args: str, timeout_s: float = 60) -> object:
    """Run ``script`` (which calls ``become_nobody()`` after its imports) with ``args`` in
    ``sys.argv[1:]``; returns the JSON value of its last line of output."""
    out = subprocess.run([sys.executable, "-c", _PRELUDE + script, *args], capture_output=True, text=True,
                         timeout=timeout_s)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


@contextmanager
def shared_folder() -> Iterator[Path]:
    """A new folder in the temporary folder that every user may walk through (0755)."""
    folder = Path(tempfile.mkdtemp(prefix="kvtier-shared-"))
    try:
        folder.chmod(0o755)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
