"""The host-byte accounting the offload engine allocates by and the planner plans with."""
import dataclasses

import pytest
import torch

from megaslide.models.dit import DIT_PRESETS, DiTBlock
from megaslide.offload.host_state import BlockLayout, HostState
from megaslide.perf.host_memory import (
    ARENA_ALIGN,
    HOST_RESERVE_BYTES,
    PARAM_ALIGN,
    StateFormat,
    arena_bytes,
    block_layout,
    host_bytes,
    host_bytes_per_param,
    require_host_fit,
)
from tests.helpers import tiny_model_cfg


@pytest.mark.parametrize("cfg", [tiny_model_cfg("dsa"), dataclasses.replace(tiny_model_cfg("dense"), dim=40),
                                 DIT_PRESETS["1B"]], ids=["tiny-dsa", "tiny-dense-odd", "1B"])
def test_block_layout_is_the_engines_layout(cfg):
    with torch.device("meta"):
        layout = BlockLayout.from_module(DiTBlock(cfg, 0))
    size = block_layout(cfg)
    assert (size.numel, size.param_count) == (layout.numel, layout.param_count)
    assert size.numel % PARAM_ALIGN == 0 and size.numel >= size.param_count


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("pin_state", [False, True])
def test_host_bytes_are_what_the_host_state_allocates(dtype, pin_state):
    layout = BlockLayout.from_module(DiTBlock(tiny_model_cfg("dsa"), 0))
    state = HostState(layout, 3, StateFormat(dtype), pin=False, pin_optimizer_state=pin_state)
    arenas = host_bytes(layout.numel, 3, StateFormat(dtype), pin_state)
    assert (arenas["pinned"], arenas["pageable"]) == (state.pinned_arena.nbytes, state.pageable_arena.nbytes)
    assert (arenas["pageable"] == 0) == pin_state
    assert sum(host_bytes_per_param(StateFormat(dtype)).values()) == 16


def test_arenas_round_each_buffer_up_to_a_page():
    assert arena_bytes([]) == 0
    assert arena_bytes([1, ARENA_ALIGN, ARENA_ALIGN + 1]) == 4 * ARENA_ALIGN


def test_host_fit_counts_the_reserve_and_names_the_fix():
    arenas = {"pinned": 2 * 10 ** 9, "pageable": 10 ** 9}
    require_host_fit(arenas, 3 * 10 ** 9 + HOST_RESERVE_BYTES, what="x")
    with pytest.raises(ValueError, match="the host state of 3 blocks needs 7.3 GB.*experiments.plan check=true"):
        require_host_fit(arenas, 3 * 10 ** 9 + HOST_RESERVE_BYTES - 1, what="the host state of 3 blocks")
