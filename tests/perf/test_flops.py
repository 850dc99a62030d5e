"""FLOP and memory accounting: the analytic count against torch's FLOP counter."""
import dataclasses
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megaslide.models.dit import VideoDiT
from megaslide.perf.flops import StepBreakdown, dit_flops, keys_per_query, mfu, token_path_flops
from megaslide.perf.memory import host_available_bytes, host_rss_bytes, host_total_bytes, memory_report, peak_hbm_bytes
from tests.helpers import tiny_model_cfg


@pytest.mark.parametrize("attention,batch,text_layers", [("dense", 2, 2), ("swin", 1, 1), ("dense", 3, 0)])
def test_forward_flops_match_torch_flop_counter(attention, batch, text_layers):
    """Every matmul, conv and attention product of a real forward, counted by torch (the math
    SDPA backend, so attention runs as counted bmm's), equals the analytic count."""
    cfg = dataclasses.replace(tiny_model_cfg(attention), text_layers=text_layers, depth=3)
    model = VideoDiT(cfg)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, 4, 16, 16, generator=g)
    t = torch.rand(batch, generator=g) * 1000
    ids = model.tokenizer(["a red ball bouncing"] * batch)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x, t, ids)
    assert counter.get_total_flops() == dit_flops(cfg, batch, cfg.token_grid(4, 16, 16)).forward


@pytest.mark.parametrize("final_layer", [True, False])
def test_token_path_flops_match_torch_flop_counter(final_layer):
    """Patch embedding, every block and (optionally) the final layer of one clip, counted by torch."""
    cfg = dataclasses.replace(tiny_model_cfg("dense"), depth=3)
    model = VideoDiT(cfg)
    x = torch.randn(1, 3, 4, 16, 16, generator=torch.Generator().manual_seed(0))
    e = model.embed(x, torch.tensor([500.0]), model.tokenizer(["a red ball bouncing"]))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        h = model.patch_embed(x)
        for i in range(cfg.depth):
            h = model.run_block(i, h, e)
        if final_layer:
            model.final(h, e.t_emb)
    n = math.prod(e.grid)
    assert counter.get_total_flops() == token_path_flops(cfg, n, n, cfg.text_len, final_layer).forward


def test_train_and_executed_flops_and_keys():
    cfg = tiny_model_cfg("dsa", kernel_size=(3, 5, 5))
    f = dit_flops(cfg, 2, (4, 8, 8))
    assert f.train == 3 * f.forward and f.executed == 4 * f.forward
    assert keys_per_query(cfg.attention, (4, 8, 8)) == 75
    assert keys_per_query(tiny_model_cfg("dense").attention, (4, 8, 8)) == 256
    assert f.attention == 2 * cfg.depth * (4 * 256 * 75 * 64 + 4 * 256 * cfg.text_len * 64) \
        + 2 * cfg.text_layers * 4 * cfg.text_len ** 2 * cfg.text_dim


def test_mfu_and_breakdown_arithmetic():
    assert mfu(500e12, 1.0, 1000.0) == 0.5
    b = StepBreakdown(step_s=2.0, compute_s=1.8, h2d_s=0.5, d2h_s=0.25, optimizer_s=1.0, h2d_bytes=25e9,
                      d2h_bytes=5e9)
    assert b.overlap_efficiency == pytest.approx(0.9)
    assert b.h2d_GBps == pytest.approx(50.0) and b.d2h_GBps == pytest.approx(20.0)
    assert b.as_dict()["overlap_efficiency"] == pytest.approx(0.9)


def test_host_memory_readings():
    assert 0 < host_rss_bytes() < host_total_bytes()
    assert 0 < host_available_bytes() <= host_total_bytes()
    before = host_rss_bytes()
    big = torch.ones(256 * 2 ** 20, dtype=torch.uint8)  # touch 256 MiB: RSS grows by about that
    assert host_rss_bytes() - before > 200 * 2 ** 20
    del big
    assert peak_hbm_bytes(torch.device("cpu")) == 0
    report = memory_report(torch.device("cpu"), pinned_bytes=3 * 10 ** 9)
    assert report.pinned_GB == 3.0 and report.host_rss_GB > 0
