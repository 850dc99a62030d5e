"""The downward import rule, read from the source with `ast`: experiments -> baselines -> megaslide.

The library (megaslide/) imports neither baselines/ nor experiments/; baselines/ does not import experiments/;
the library tests (tests/ outside tests/experiments/) import megaslide and baselines, never experiments/ (what
they share with the scripts lives in megaslide.testing)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> the top-level packages no file below it may import; files below `except` are left out
RULES = {
    "megaslide": {"forbidden": {"experiments", "baselines"}},
    "baselines": {"forbidden": {"experiments"}},
    "tests": {"forbidden": {"experiments"}, "except": "tests/experiments"},
}


def imported_packages(source: str) -> set[str]:
    """The top-level package of every module `source` imports: import and from-import statements at any depth
    (also inside functions) and `importlib.import_module` / `__import__` calls with a literal name."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value.split(".")[0])
    return found


def test_imported_packages_sees_every_form_of_import():
    source = ("import experiments.train\nfrom baselines import swin_attention\nfrom . import sibling\n"
              "def f():\n    import importlib\n    importlib.import_module('numpy.linalg')\n    __import__('os')\n")
    assert imported_packages(source) == {"experiments", "baselines", "importlib", "numpy", "os"}


@pytest.mark.parametrize("folder", RULES)
def test_imports_point_down(folder):
    rule = RULES[folder]
    files = [p for p in sorted((ROOT / folder).rglob("*.py"))
             if "except" not in rule or (ROOT / rule["except"]) not in p.parents]
    assert files, f"no Python files under {folder}/"
    broken = {str(p.relative_to(ROOT)): sorted(imported_packages(p.read_text()) & rule["forbidden"]) for p in files}
    assert {path: bad for path, bad in broken.items() if bad} == {}, (
        f"files under {folder}/ import {sorted(rule['forbidden'])}; move what they need down a layer "
        "(for tests: megaslide.testing) or the test under tests/experiments/")
