import pytest


@pytest.fixture
def torch_adamw(monkeypatch):
    """The offload engine's CPU AdamW on its torch backend (cpu_adam.adamw_step_torch_): torch.optim.AdamW's
    exact math, so the engine can be compared bit for bit with the resident trainer. A test that wants the
    fused C++ AdamW back calls monkeypatch.delenv("MEGASLIDE_CPU_ADAM_BACKEND")."""
    monkeypatch.setenv("MEGASLIDE_CPU_ADAM_BACKEND", "torch")
