import pytest

import experiments.claims as claims


@pytest.fixture
def results(tmp_path, monkeypatch):
    """An empty results folder for claims.py, whose results are stamped as run on an H200."""
    monkeypatch.setattr(claims, "load", lambda results_dir, e, n: None)
    monkeypatch.setattr("experiments.results_io.hardware", lambda: {"cpu": "x", "gpus": ["NVIDIA H200"]})
    return tmp_path
