"""Every committed results page is what its generator makes from the committed JSON: the experiment pages
(results/<experiment>.md, experiments/report.py) and the claims page (results/README.md, experiments.claims),
regenerated into a temporary folder and compared byte for byte. Plots are drawn by the experiment runs, not by
the generators, so they are not regenerated here."""
import sys

from experiments.claims import main as claims_main
from experiments.report import main as report_main
from experiments.results_io import RESULTS_DIR

EXPERIMENTS = sorted(p.name for p in RESULTS_DIR.iterdir() if p.is_dir())


def test_every_experiment_folder_has_a_page_and_every_page_a_folder():
    assert sorted(p.stem for p in RESULTS_DIR.glob("*.md") if p.name != "README.md") == EXPERIMENTS


def test_every_results_page_regenerates_unchanged(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["report.py", "--out", str(tmp_path)])
    report_main()
    monkeypatch.setattr(sys, "argv", ["claims", "--out", str(tmp_path / "README.md")])
    claims_main()
    capsys.readouterr()
    pages = [f"{e}.md" for e in EXPERIMENTS] + ["README.md"]
    stale = [p for p in pages if (tmp_path / p).read_bytes() != (RESULTS_DIR / p).read_bytes()]
    assert not stale, (f"stale against their JSON: {', '.join(f'results/{p}' for p in stale)}; regenerate with "
                       "`python -m experiments.report` and `python -m experiments.claims`")
