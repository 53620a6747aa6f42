"""``kvtier.paged`` is what any paged engine needs: importing it must never import an engine."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import kvtier.paged

CHECK = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(sorted({m.split(".")[0] for m in sys.modules if m.split(".")[0].startswith("vllm")}))
"""


def _engines_imported(*modules: str) -> str:
    """The engine packages a fresh interpreter holds after importing ``modules``."""
    root = Path(kvtier.paged.__file__).parents[2]  # this checkout's kvtier, not an installed one
    result = subprocess.run([sys.executable, "-c", CHECK, *modules], cwd=root, capture_output=True, text=True, check=True)
    return result.stdout.strip()


def test_paged_modules_import_no_engine():
    modules = ["kvtier.paged", *(m.name for m in pkgutil.walk_packages(kvtier.paged.__path__, "kvtier.paged."))]
    assert "kvtier.paged.groups" in modules
    assert _engines_imported(*modules) == "[]"


def test_the_check_catches_a_module_that_imports_vllm():
    assert _engines_imported("kvtier.integrations.vllm.common") == "['vllm']"
