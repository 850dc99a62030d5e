import pytest


@pytest.fixture
def results(tmp_path, monkeypatch):
    """An empty results folder for the claims, whose results are stamped as run on an H200."""
    monkeypatch.setattr("experiments.results_io.hardware", lambda: {"cpu": "x", "gpus": ["NVIDIA H200"]})
    return tmp_path
