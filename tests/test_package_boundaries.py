"""The runtime package stands alone: kvtier never imports the harness (kvtier_testing), neither
package reaches above itself to the checkout, bench/ and tests/ import both like any user (installed
or on PYTHONPATH), never by editing sys.path; and ``kvtier.paged``, what any paged engine needs,
never imports an engine."""

from __future__ import annotations

import ast
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import kvtier.paged

ROOT = Path(__file__).resolve().parents[1]


def _python_files(*folders: str) -> list[Path]:
    files = [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))]
    assert files, f"no Python files under {folders}"
    return files


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_runtime_never_imports_the_harness():
    offenders = {}
    for path in _python_files("kvtier"):
        harness = sorted(m for m in _imported_modules(path) if m.split(".")[0] == "kvtier_testing")
        if harness:
            offenders[str(path.relative_to(ROOT))] = harness
    assert offenders == {}


def test_bench_and_tests_never_edit_sys_path():
    offenders = []
    for path in _python_files("bench", "tests"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr == "path"
                    and isinstance(node.value, ast.Name) and node.value.id == "sys"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


# Path(__file__)...parent.parent or .parents[N]: how many folders a line climbs from its file
_CLIMB = re.compile(r"__file__\)?(?P<chain>(?:\.resolve\(\)|\.absolute\(\)|\.parent\b|\.parents\[\d+\])*)")


def _levels_climbed(chain: str) -> int:
    indexed = re.findall(r"\.parents\[(\d+)\]", chain)
    return chain.count(".parent") - len(indexed) + sum(int(n) + 1 for n in indexed)


def test_packages_never_reach_above_themselves():
    """A file at kvtier/a/b.py may climb to kvtier/a and kvtier, never to the checkout above them:
    an installed package has no checkout around it."""
    offenders = []
    for path in _python_files("kvtier", "kvtier_testing"):
        depth = len(path.relative_to(ROOT).parts) - 1  # folders from the package root down to the file
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            for match in _CLIMB.finditer(line):
                if _levels_climbed(match["chain"]) > depth:
                    offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert offenders == []


def test_the_climb_counter_sees_both_spellings():
    assert _levels_climbed(".resolve().parent.parent") == 2
    assert _levels_climbed(".resolve().parents[1]") == 2
    assert _levels_climbed(".parent") == 1
    line = 'ROOT = Path(__file__).resolve().parents[3]'
    assert _levels_climbed(_CLIMB.search(line)["chain"]) == 4

CHECK = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(sorted({m.split(".")[0] for m in sys.modules if m.split(".")[0].startswith("vllm")}))
"""


def _engines_imported(*modules: str) -> str:
    """The engine packages a fresh interpreter holds after importing ``modules``."""
    result = subprocess.run([sys.executable, "-c", CHECK, *modules], cwd=ROOT, capture_output=True, text=True, check=True)
    return result.stdout.strip()


def test_paged_modules_import_no_engine():
    modules = ["kvtier.paged", *(m.name for m in pkgutil.walk_packages(kvtier.paged.__path__, "kvtier.paged."))]
    assert "kvtier.paged.groups" in modules
    assert _engines_imported(*modules) == "[]"


def test_the_check_catches_a_module_that_imports_vllm():
    assert _engines_imported("kvtier.integrations.vllm.common") == "['vllm']"
