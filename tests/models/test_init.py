"""`VideoDiT.initialize_weights` defines every parameter and buffer: a meta-device build, `to_empty` and
`initialize_weights()` give the host build (FSDP2's path)."""
import dataclasses

import pytest
import torch

from megaslide.config import AttentionConfig
from megaslide.models.dit import DIT_PRESETS, DiTBlock, VideoDiT

ATTENTIONS = ["dense", "dsa", "swin"]


def _cfg(attention: str):
    return dataclasses.replace(DIT_PRESETS["tiny"], text_layers=2, attention=AttentionConfig(attention))


def _host(cfg, seed: int) -> VideoDiT:
    torch.manual_seed(seed)
    return VideoDiT(cfg)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _poison(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.fill_(float("nan"))


def _check_against_host(state: dict, cfg, seed: int) -> None:
    """No NaN; constant tensors (zeros, ones) exactly the host build's; random ones with its statistics."""
    host = _state(_host(cfg, seed + 1))
    assert state.keys() == host.keys()
    for name, got in state.items():
        want = host[name]
        assert not got.isnan().any(), name
        if (want == want.flatten()[0]).all():
            assert torch.equal(got, want), f"{name}: a deterministic part differs from the host build"
        else:
            assert not torch.equal(got, want), f"{name}: the same draws under another seed"
            assert got.std() == pytest.approx(want.std().item(), rel=0.3), name
            assert abs(got.mean() - want.mean()) < 4 * want.std() / got.numel() ** 0.5 + 1e-6, name


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_initialize_weights_defines_every_parameter_after_nan_poisoning(attention):
    cfg = _cfg(attention)
    model = _host(cfg, 0)
    want = _state(model)
    _poison(model)
    torch.manual_seed(0)
    model.initialize_weights()
    got = _state(model)
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name}: not defined by initialize_weights as built"
    _poison(model)
    torch.manual_seed(7)
    model.initialize_weights()
    _check_against_host(_state(model), cfg, 7)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_meta_build_to_empty_and_initialize_weights_is_the_host_build(attention):
    cfg = _cfg(attention)
    with torch.device("meta"):
        model = VideoDiT(cfg)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    _poison(model)
    torch.manual_seed(3)
    model.initialize_weights()
    host = _host(cfg, 3)
    for name, value in _state(host).items():
        assert torch.equal(model.state_dict()[name], value), name
    x, t, ids = torch.randn(1, 3, 4, 8, 8), torch.tensor([500.0]), torch.randint(2, 1024, (1, 16))
    out = model(x, t, ids)                 # a NaN anywhere would reach it (0 x NaN is NaN)
    assert out.isfinite().all()
    assert torch.equal(out, host(x, t, ids))


def test_a_block_initialises_alone_as_the_offload_engine_builds_it():
    cfg = _cfg("dsa")
    with torch.device("meta"):
        block = DiTBlock(cfg, 1)
    block.to_empty(device="cpu")
    _poison(block)
    block.initialize_weights()
    state = _state(block)
    assert not any(v.isnan().any() for v in state.values())
    assert torch.equal(state["modulation"], torch.zeros_like(state["modulation"]))
    assert torch.equal(state["attn.offset_proj.weight"], torch.zeros_like(state["attn.offset_proj.weight"]))
    assert torch.equal(state["cross.q_norm.weight"], torch.ones_like(state["cross.q_norm.weight"]))
    assert state["attn.offset_conv.weight"].std() > 0


def test_a_module_owning_parameters_without_reset_parameters_is_refused():
    from megaslide.models.layers import default_init

    class Bare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(2))

    with pytest.raises(TypeError, match="Bare owns parameters but has no reset_parameters"):
        default_init(torch.nn.Sequential(Bare()))
