import json

from experiments.report import render
from experiments.results_io import write_result


def test_report_renders_rows_and_provenance(tmp_path):
    write_result("demo", "run1", {"rows": [{"n": 8192, "ms": 1.5, "shape": [1, 2, 3], "nested": {"a": 1}},
                                           {"n": 16384, "ms": 3.25}], "note": "a note"}, results_dir=tmp_path)
    data = json.loads((tmp_path / "demo" / "run1.json").read_text())
    assert {"command", "commit", "hardware", "date"} <= set(data)
    md = render("demo", tmp_path).read_text()
    assert "### rows" in md and "| n | ms | shape |" in md and "| 8192 | 1.5 | 1x2x3 |" in md
    assert "| 16384 | 3.25 |  |" in md
    assert "nested" not in md and "a note" in md and "- commit:" in md


def test_each_plot_is_shown_under_its_own_result(tmp_path):
    for name in ("h200", "h200_seeds12"):
        write_result("demo", name, {"rows": [{"x": 1}]}, results_dir=tmp_path)
        (tmp_path / "demo" / f"{name}_samples.png").write_bytes(b"")
    md = render("demo", tmp_path).read_text()
    assert md.count("](demo/h200_samples.png)") == 1 and md.count("](demo/h200_seeds12_samples.png)") == 1
    first, second = md.split("## h200_seeds12")
    assert "h200_samples.png" in first and "h200_seeds12_samples.png" in second


def test_partial_results_are_marked(tmp_path):
    write_result("demo", "cut", {"rows": [{"x": 1}], "jobs_done": 2, "jobs_total": 6}, results_dir=tmp_path)
    write_result("demo", "whole", {"rows": [{"x": 1}], "jobs_done": 6, "jobs_total": 6}, results_dir=tmp_path)
    md = render("demo", tmp_path).read_text()
    cut, whole = md.split("## whole")
    assert "2 of 6 planned runs" in cut and "Partial" not in whole


def test_results_from_a_dirty_tree_are_marked(tmp_path):
    write_result("demo", "dirty", {"rows": [{"x": 1}], "commit": "a" * 40, "dirty": True, "diff_sha256": "d" * 64,
                                   "provenance_source": "stamp"}, results_dir=tmp_path)
    write_result("demo", "old", {"rows": [{"x": 1}], "commit": "abc1234+dirty"}, results_dir=tmp_path)
    write_result("demo", "clean", {"rows": [{"x": 1}], "commit": "c" * 40, "dirty": False,
                                   "provenance_note": "relabelled by hand"}, results_dir=tmp_path)
    md = render("demo", tmp_path).read_text()
    assert "## clean\n" in md and "## dirty (dirty tree)\n" in md and "## old (dirty tree)\n" in md
    assert f"- commit: `{'a' * 40}`, dirty tree (diff sha256 `{'d' * 64}`), from stamp" in md
    assert f"- commit: `{'c' * 40}`, clean tree" in md and "- provenance note: relabelled by hand" in md


def test_a_users_results_folder_and_the_source_of_each_table(tmp_path, monkeypatch, capsys):
    import sys

    from experiments.report import main
    write_result("demo", "mine", {"rows": [{"x": 1}]}, results_dir=tmp_path)
    monkeypatch.setattr(sys, "argv", ["report.py", "--results", str(tmp_path)])
    main()
    assert capsys.readouterr().out == f"demo: {tmp_path / 'demo.md'}\n  from {tmp_path / 'demo' / 'mine.json'}\n"
    md = (tmp_path / "demo.md").read_text()
    assert f"report.py --results {tmp_path} demo` from {tmp_path.name}/demo/*.json" in md
    assert "\n\nSource: [demo/mine.json](demo/mine.json)\n" in md.split("## mine")[1]  # (a dirty tree marks the title)


def test_out_writes_the_same_page_elsewhere(tmp_path, monkeypatch):
    import sys

    from experiments.report import main
    write_result("demo", "mine", {"rows": [{"x": 1}]}, results_dir=tmp_path / "results")
    render("demo", tmp_path / "results")
    monkeypatch.setattr(sys, "argv", ["report.py", "--results", str(tmp_path / "results"), "--out", str(tmp_path)])
    main()
    assert (tmp_path / "demo.md").read_text() == (tmp_path / "results" / "demo.md").read_text()
    assert "one section per file: the rows of a section's tables come from the file its Source line links" in \
        (tmp_path / "demo.md").read_text()
