"""A small run logger: W&B (imported lazily, offline by default) plus a local metrics.jsonl.

Training logs scalars per step (`log`) and sample videos; a benchmark or table script logs its
result tables (`log_table`), its headline numbers (`summary`) and its plots (`log_image`).
Only rank 0 logs. metrics.jsonl holds one run (a non-finite value is written as null: valid JSON): a fresh run
empties it, a resumed run keeps the rows up to the checkpoint it resumed from (those after it are logged again).
The W&B mode comes from `WANDB_MODE` when set, else `offline`, so runs never need a network; upload them later with
`wandb sync <run folder>/wandb/offline-run-*`. W&B's own banners are silenced (the scripts print where the run
is); `WANDB_SILENT=false` brings them back.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path


class RunLogger:
    def __init__(self, out_dir: str | Path, project: str = "megaslide", name: str | None = None,
                 config: dict | None = None, rank: int = 0, mode: str | None = None, resume_step: int | None = None):
        self.out_dir = Path(out_dir)
        self.active = rank == 0
        self.run = None
        self.last_train: dict = {}   # the newest row with a loss: a resumed run starts from its kept rows'
        if not self.active:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_file, kept = _open_metrics(self.out_dir / "metrics.jsonl", resume_step)
        self.last_train = next((row for row in reversed(kept) if "loss" in row), {})
        mode = mode or os.environ.get("WANDB_MODE", "offline")
        if mode != "disabled":
            import wandb  # lazy: a heavy import, and optional for library users
            self.run = wandb.init(project=project, name=name, config=config or {}, dir=str(self.out_dir),
                                  mode=mode, reinit="finish_previous", settings=wandb.Settings(silent=quiet_wandb()))

    def log(self, metrics: dict, step: int) -> None:
        if not self.active:
            return
        if "loss" in metrics:
            self.last_train = {"step": step, **metrics}
        metrics = {k: _finite_or_none(v) for k, v in metrics.items()}
        self.metrics_file.write(json.dumps({"step": step, **metrics}, allow_nan=False) + "\n")
        self.metrics_file.flush()
        if self.run is not None:
            self.run.log(metrics, step=step)

    def log_video(self, key: str, mp4_path: str | Path, caption: str, step: int) -> None:
        """Attach an mp4 already written to disk (W&B needs moviepy only for raw arrays)."""
        if self.run is None:
            return
        import wandb
        self.run.log({key: wandb.Video(str(mp4_path), caption=caption, format="mp4")}, step=step)

    def log_table(self, key: str, rows: list[dict]) -> None:
        """A result table as a W&B table: one column per key any row has (in first-seen order);
        a value that is not a number, string or bool (a list, a dict) is shown as its JSON, and a column
        whose values are of more than one kind (a block index beside "all", say) as text, since a W&B
        table refuses a column of mixed types."""
        if self.run is None:
            return
        import wandb
        columns = list(dict.fromkeys(k for row in rows for k in row))
        data = [[_cell(row.get(c)) for c in columns] for row in rows]
        for i in range(len(columns)):
            if len({_kind(r[i]) for r in data} - {None}) > 1:
                for r in data:
                    r[i] = None if r[i] is None else str(r[i])
        self.run.log({key: wandb.Table(columns=columns, data=data)})

    def log_image(self, key: str, path: str | Path) -> None:
        """Attach a plot already written to disk (png)."""
        if self.run is None:
            return
        import wandb
        self.run.log({key: wandb.Image(str(path))})

    def summary(self, values: dict) -> None:
        """Headline numbers of the run: the run's W&B summary (nested dicts allowed)."""
        if self.run is not None:
            self.run.summary.update(values)

    @property
    def wandb_dir(self) -> str | None:
        return None if self.run is None else str(Path(self.run.dir).parent)

    def finish(self) -> None:
        if not self.active:
            return
        self.metrics_file.close()
        if self.run is not None:
            self.run.finish()


def _open_metrics(path: Path, resume_step: int | None) -> tuple:
    """`path` opened for writing, holding the rows of steps < resume_step and the first row of
    resume_step (none for a fresh run): training logs a step's row just before it checkpoints that
    step, and rows logged after the checkpoint (a finished run's evaluation) are logged again by the
    resumed run. A line cut off by a crash is dropped. Returns the file and the kept rows (dicts)."""
    kept, rows = [], []
    if resume_step is not None and path.is_file():
        at_resume = False                    # whether the first row of resume_step is kept already
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
                step = row["step"]
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
            if step < resume_step or (step == resume_step and not at_resume):
                kept.append(line + "\n")
                rows.append(row)
                at_resume = at_resume or step == resume_step
    f = open(path, "w")  # noqa: SIM115  (the logger's file, open for the run, closed by finish)
    f.writelines(kept)
    return f, rows


def _finite_or_none(value):
    """A metric as JSON can hold it: a non-finite float (NaN, inf) becomes null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _kind(value) -> str | None:
    """What a W&B table column takes a cell as: "number" (int or float), "bool", "str"; None for an empty cell."""
    if value is None:
        return None
    return "bool" if isinstance(value, bool) else "number" if isinstance(value, (int, float)) else "str"


def _cell(value):
    """A table cell W&B can show: scalars as they are, anything else as its JSON text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, default=str)


def quiet_wandb() -> bool:
    """W&B's banners off unless the user asks for them with WANDB_SILENT=false (W&B's own variable)."""
    return os.environ.get("WANDB_SILENT", "true").lower() not in ("false", "0", "no")
