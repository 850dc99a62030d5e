"""The downward import rule, read from the source with `ast`: experiments -> baselines -> megaslide.

The library (megaslide/) imports neither baselines/ nor experiments/; baselines/ does not import experiments/;
the library tests (tests/ outside tests/experiments/) import megaslide and baselines, never experiments/ (what
they share with the scripts lives in megaslide.testing). Inside the library the accounting (megaslide/perf/) sits
below the engines: offload/, train/, inference/ and parallel/ may import it, it imports none of them."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> the packages (dotted: a package and everything below it) no file below it may import; files below
# `except` are left out
RULES = {
    "megaslide": {"forbidden": {"experiments", "baselines"}},
    "megaslide/perf": {"forbidden": {"megaslide.offload", "megaslide.train", "megaslide.inference",
                                     "megaslide.parallel"}},
    "baselines": {"forbidden": {"experiments"}},
    "tests": {"forbidden": {"experiments"}, "except": "tests/experiments"},
}


def imported_modules(source: str) -> set[str]:
    """Every module `source` imports, by its full dotted name: import and from-import statements at any depth
    (also inside functions; `from a import b` counts as `a` and `a.b`, b may be a module) and
    `importlib.import_module` / `__import__` calls with a literal name."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
    return found


def forbidden_imports(source: str, forbidden: set[str]) -> list[str]:
    """The modules `source` imports that are, or lie below, one of the `forbidden` packages."""
    return sorted(m for m in imported_modules(source)
                  if any(m == f or m.startswith(f + ".") for f in forbidden))


def test_imported_modules_sees_every_form_of_import():
    source = ("import experiments.train\nfrom baselines import swin_attention\nfrom . import sibling\n"
              "def f():\n    import importlib\n    importlib.import_module('numpy.linalg')\n    __import__('os')\n")
    assert imported_modules(source) == {"experiments.train", "baselines", "baselines.swin_attention", "importlib",
                                        "numpy.linalg", "os"}


def test_forbidden_imports_match_a_package_and_what_lies_below_it():
    source = "from megaslide import offload\nimport megaslide.trainer\nfrom megaslide.train.engine import X\n"
    assert forbidden_imports(source, {"megaslide.offload", "megaslide.train"}) == [
        "megaslide.offload", "megaslide.train.engine", "megaslide.train.engine.X"]


@pytest.mark.parametrize("folder", RULES)
def test_imports_point_down(folder):
    rule = RULES[folder]
    files = [p for p in sorted((ROOT / folder).rglob("*.py"))
             if "except" not in rule or (ROOT / rule["except"]) not in p.parents]
    assert files, f"no Python files under {folder}/"
    broken = {str(p.relative_to(ROOT)): forbidden_imports(p.read_text(), rule["forbidden"]) for p in files}
    assert {path: bad for path, bad in broken.items() if bad} == {}, (
        f"files under {folder}/ import {sorted(rule['forbidden'])}; move what they need down a layer "
        "(for tests: megaslide.testing) or the test under tests/experiments/")
