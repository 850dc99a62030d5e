"""A training run's progress as labelled plain lines, for runs that share one terminal or log file.

Several processes drawing tqdm bars on one terminal overwrite each other's line (each bar redraws with a
carriage return), and a log file gets every redraw. `ProgressLines` prints instead one whole line per tenth
of the run, each starting with the run's label:

    [dsa 16f seed 0] step 30/300 (10%) loss 0.4123, 41 s

Each line is one write and a flush, so lines of different processes never mix, in a terminal or in a file.
It has the two methods of a tqdm bar that `Trainer.fit` calls (`update`, `set_postfix`), so the loop
drives either one.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

MARKS = 10  # lines per run: one at each tenth of its steps


class ProgressLines:
    """Progress of steps (initial, total] of the run `label`: a line at each step where a tenth of `total` is
    reached, and at the last step; the line shows the last `set_postfix` values. `disable` prints nothing
    (the ranks other than rank 0). Lines go to `stream`, stderr by default (as tqdm's bars)."""

    def __init__(self, label: str, total: int, initial: int = 0, *, disable: bool = False,
                 stream: TextIO | None = None):
        self.label, self.total, self.step, self.disable = label, total, initial, disable
        self.stream = stream
        self.postfix: dict[str, str] = {}
        self.start = time.monotonic()

    def __enter__(self) -> ProgressLines:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def set_postfix(self, **values: str) -> None:
        self.postfix = {k: str(v) for k, v in values.items()}

    def update(self, n: int = 1) -> None:
        for _ in range(n):
            self.step += 1
            if self.step == self.total or MARKS * self.step // self.total > MARKS * (self.step - 1) // self.total:
                self._write()

    def line(self) -> str:
        """The line of the current step (without its newline)."""
        shown = "".join(f" {k} {v}" for k, v in self.postfix.items())
        return (f"[{self.label}] step {self.step}/{self.total} ({100 * self.step // self.total}%){shown}, "
                f"{time.monotonic() - self.start:.0f} s")

    def _write(self) -> None:
        if self.disable:
            return
        stream = self.stream or sys.stderr
        stream.write(self.line() + "\n")
        stream.flush()
