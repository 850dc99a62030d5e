import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Two threads on a shared 2-core runner spin against each other; one is several times faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
