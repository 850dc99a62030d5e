"""Sweep candidates of the DSA kernels, as the scripts' configs list them, parsed into kernel configs.

A candidate is a list of integers under a config key (`launch_candidates`, `key_candidates`,
`gather_launches`); one of a wrong length is refused naming that key. Shared by gpu_check_dsa.py,
which checks and times them, and bench_attention.py, which times the gather floor at them.
"""
from __future__ import annotations


def candidate_fields(candidate, required: int, defaults: tuple, parameter: str) -> tuple:
    """A sweep candidate's fields: its `required` leading ones, then the optional ones it gives, the rest
    from `defaults`. A candidate of another length is refused, naming the config key `parameter`."""
    if not required <= len(candidate) <= required + len(defaults):
        raise ValueError(f"{parameter}: candidate {list(candidate)} needs {required} to {required + len(defaults)} "
                         f"integers (see its script's yaml under experiments/conf/)")
    return (*candidate, *defaults[len(candidate) - required:])


def key_of(candidate):
    """The launch.KeyConfig of a key candidate [t, y, x, BLOCK_E, warps] or [t, y, x, BLOCK_E, warps, maxnreg]
    (key tiles of t x y x tokens; maxnreg 0 or left out: the compiler's register count)."""
    from megaslide.attention.dsa import launch
    t, y, x, block_e, num_warps, maxnreg = candidate_fields(candidate, 5, (0,), "key_candidates")
    return launch.KeyConfig(tile=(t, y, x), block_e=block_e, num_warps=num_warps, maxnreg=maxnreg or None)


def launch_of(candidate, head_dim: int, parameter: str = "launch_candidates"):
    """The launch.LaunchConfig of a sweep candidate [BLOCK_Q, warps], [BLOCK_Q, warps, block_y] (query
    patches of block_y rows; 1 when left out) or [BLOCK_Q, warps, block_y, maxnreg] (0: the compiler's
    register count) at head dim d. A malformed candidate is refused naming `parameter`, the config key."""
    from megaslide.attention.dsa import launch
    block_q, num_warps, block_y, maxnreg = candidate_fields(candidate, 2, (1, 0), parameter)
    return launch.LaunchConfig(block_q=block_q, block_d=launch.head_dim_block(head_dim),
                               num_warps=num_warps, block_y=block_y, maxnreg=maxnreg or None)
