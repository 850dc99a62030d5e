import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")
# compiled code goes to a cache of this run's own: an inductor cache left on the machine by another run (another
# torch, another tree) has been seen to hand a compiled block garbage gradients
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="megaslide-inductor-"))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # each of the xdist workers (two on CI's two cores) computes on one thread: two intra-op threads per
    # worker spin against the other worker's; the scripts the tests start inherit the setting
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

SCRIPT_SMOKE_DIR = Path(__file__).parent / "experiments"


def pytest_collection_modifyitems(config, items):
    """The script smoke tests (tests/experiments) run whole scripts in subprocesses: mark them
    `slow`, so that `pytest -m "not slow"` is the fast development loop."""
    for item in items:
        if SCRIPT_SMOKE_DIR in Path(item.fspath).parents:
            item.add_marker(pytest.mark.slow)
