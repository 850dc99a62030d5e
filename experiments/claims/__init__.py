"""Generate results/README.md: every claim of the three papers beside our own figure.

    python -m experiments.claims                                         # the repository's results/
    python -m experiments.claims --results runs/ablate_offsets/results   # your own runs' results folder

The paper's figures are quoted as the papers state them (shared PAPERS.md); every figure
of ours is read from a result JSON under the results folder (its file is linked) or computed here
analytically and said to be so. Every verdict is computed from the data by a rule stated
here, or the cell states a fact without a verdict word; a claim we could not measure says why.
A verdict rests only on results whose provenance audit status is ok (`common.PROVENANCE_RULE`,
applied to every claim by `common.Evidence.judge`); the page states that rule at its top.

One module per paper section: `memory` (C1-C3), `throughput` (C4, C5, C9), `quality` (C6-C8),
`causal_sp` (S1-S4), `swiftfusion` (F1-F4); `common` holds what they share and `page` builds the page.
"""
from experiments.claims.memory import DSA_HEAD_GROUPS
from experiments.claims.page import CLAIMS, main, readme

__all__ = ["CLAIMS", "DSA_HEAD_GROUPS", "main", "readme"]
