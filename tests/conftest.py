import os
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")

SCRIPT_SMOKE_DIR = Path(__file__).parent / "experiments"


def pytest_collection_modifyitems(config, items):
    """The script smoke tests (tests/experiments) run whole scripts in subprocesses: mark them
    `slow`, so that `pytest -m "not slow"` is the fast development loop."""
    for item in items:
        if SCRIPT_SMOKE_DIR in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)
