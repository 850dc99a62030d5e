import json

from experiments.report import render
from experiments.results_io import write_result


def test_report_renders_rows_and_provenance(tmp_path):
    write_result("demo", "run1", {"rows": [{"n": 8192, "ms": 1.5, "shape": [1, 2, 3], "nested": {"a": 1}},
                                           {"n": 16384, "ms": 3.25}], "note": "a note"}, results_dir=tmp_path)
    data = json.loads((tmp_path / "demo" / "run1.json").read_text())
    assert {"command", "commit", "hardware", "date"} <= set(data)
    md = render("demo", tmp_path).read_text()
    assert "### rows" in md and "| n | ms | shape |" in md and "| 8192 | 1.5 | 1x2x3 |" in md and "| 16384 | 3.25 |  |" in md
    assert "nested" not in md and "a note" in md and "- commit:" in md
