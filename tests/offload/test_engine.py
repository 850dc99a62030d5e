"""The offload engine against the resident reference trainer, on CPU (the CI path).

fp32 with the torch AdamW backend (the `torch_adamw` fixture of conftest.py, torch.optim.AdamW's exact math):
losses, gradient norms and every weight are bit-identical to `Trainer` after several steps,
with clipping active, in every mode (overlap on/off, optimizer on the "GPU" = torch ops on
the compute device). With the default fused C++ AdamW the weights agree to ~1e-7: its IEEE
square root differs from torch's vectorised one by 1 ulp on some elements (see cpu_adam.py).
"""
import dataclasses

import pytest
import torch

from megaslide.config import OffloadConfig
from megaslide.models.dit import VideoDiT
from megaslide.offload.engine import OffloadEngine
from megaslide.offload.host_state import BlockLayout, HostState
from megaslide.train.trainer import Trainer
from tests.helpers import tiny_data_cfg, tiny_model_cfg, tiny_train_cfg

STEPS = 3
CLIP = 0.05  # the tiny model's gradient norm is ~2-3: clipping triggers on every step
DEPTH = 5    # > 2 blocks, so the backward re-streams blocks and both shells alternate

pytestmark = pytest.mark.usefixtures("torch_adamw")


def _model_cfg(attention="dense", **kw):
    return dataclasses.replace(tiny_model_cfg(attention, **kw), depth=DEPTH)


def _pair(tmp_path, model_cfg=None, *, overlap=True, optimizer_device="cpu", resident_blocks=0, **train):
    train = {"steps": STEPS, "grad_clip": CLIP, "weight_decay": 0.01, **train}
    model_cfg = model_cfg or _model_cfg()
    ref = Trainer(model_cfg, tiny_data_cfg(), tiny_train_cfg(**train), tmp_path / "ref")
    eng = Trainer(model_cfg, tiny_data_cfg(), tiny_train_cfg(**train), tmp_path / "eng",
                  offload_cfg=OffloadConfig(enabled=True, overlap=overlap, optimizer_device=optimizer_device,
                                            resident_blocks=resident_blocks))
    return ref, eng


def _run_both(ref, eng, steps=STEPS):
    rows = []
    for _ in range(steps):
        a, b = ref.train_step(), eng.train_step()
        rows.append((a["loss"].item(), b["loss"].item(), a["grad_norm"].item(), b["grad_norm"].item()))
    return rows


def _assert_weights(ref, eng, exact=True):
    mine = eng.engine.model_state_dict()
    theirs = dict(ref.engine.model.named_parameters())
    assert mine.keys() == theirs.keys()
    for name, p in theirs.items():
        if exact:
            assert torch.equal(p.detach(), mine[name]), name
        else:
            torch.testing.assert_close(mine[name], p.detach(), rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("overlap,optimizer_device", [(True, "cpu"), (False, "cpu"), (True, "gpu")])
def test_bit_identical_to_resident_trainer_with_clipping(tmp_path, overlap, optimizer_device):
    ref, eng = _pair(tmp_path, overlap=overlap, optimizer_device=optimizer_device)
    rows = _run_both(ref, eng)
    for loss_ref, loss_eng, norm_ref, norm_eng in rows:
        assert loss_ref == loss_eng and norm_ref == norm_eng
        assert norm_ref > CLIP  # the clip coefficient really was < 1
    _assert_weights(ref, eng)


def test_wan_blocks_train_bit_identical_to_resident_trainer(tmp_path):
    """A model of the wan block family (6 modulation rows, unmodulated cross-attention) streams and trains."""
    ref, eng = _pair(tmp_path, dataclasses.replace(_model_cfg(), block="wan"))
    for loss_ref, loss_eng, norm_ref, norm_eng in _run_both(ref, eng, steps=2):
        assert loss_ref == loss_eng and norm_ref == norm_eng
    _assert_weights(ref, eng)


@pytest.mark.parametrize("optimizer_device", ["cpu", "gpu"])
def test_bit_identical_without_clipping(tmp_path, optimizer_device):
    """grad_clip=0: updates are queued during the backward, as each gradient lands."""
    ref, eng = _pair(tmp_path, optimizer_device=optimizer_device, grad_clip=0.0)
    for loss_ref, loss_eng, _, _ in _run_both(ref, eng):
        assert loss_ref == loss_eng
    _assert_weights(ref, eng)


@pytest.mark.parametrize("resident_blocks,grad_clip", [(1, CLIP), (2, 0.0), (DEPTH, CLIP)])
def test_resident_tail_is_bit_identical(tmp_path, resident_blocks, grad_clip):
    """The last k blocks keep their graphs from the forward instead of being recomputed: the
    same numbers as recomputing (and as the resident trainer), with and without clipping."""
    ref, eng = _pair(tmp_path, resident_blocks=resident_blocks, grad_clip=grad_clip)
    for loss_ref, loss_eng, norm_ref, norm_eng in _run_both(ref, eng):
        assert loss_ref == loss_eng and norm_ref == norm_eng
    _assert_weights(ref, eng)


def test_resident_tail_is_not_restreamed(tmp_path):
    """With k kept blocks the backward re-streams depth - k - 2 blocks (the two streamed last
    stay in their shells); the forward still loads every block (their weights changed)."""
    _, eng = _pair(tmp_path, steps=4, resident_blocks=2)
    for _ in range(4):
        eng.train_step()
    parts = eng.engine.breakdown(range(1, 3))
    depth = eng.engine.host.depth
    assert parts.h2d_bytes == eng.engine.layout.numel * 4 * (depth + depth - 2 - 2)


def test_resident_blocks_beyond_depth_are_refused(tmp_path):
    with pytest.raises(ValueError, match="resident_blocks=6"):
        _pair(tmp_path, resident_blocks=DEPTH + 1)


def test_swin_blocks_keep_their_own_layer_index(tmp_path):
    """Odd Swin blocks shift their windows: each block must run as itself, not as its shell's."""
    ref, eng = _pair(tmp_path, _model_cfg("swin", window=(2, 4, 4)))
    for loss_ref, loss_eng, _, _ in _run_both(ref, eng, steps=2):
        assert loss_ref == loss_eng
    _assert_weights(ref, eng)


def test_parameters_without_gradient_stay_untouched(tmp_path):
    """dsa_zero's offset net gets no gradient; torch.optim.AdamW then skips it (no decay)."""
    ref, eng = _pair(tmp_path, dataclasses.replace(_model_cfg("dsa_zero"), depth=3), weight_decay=0.1)
    before = eng.engine.model_state_dict()
    for loss_ref, loss_eng, _, _ in _run_both(ref, eng, steps=2):
        assert loss_ref == loss_eng
    _assert_weights(ref, eng)
    after = eng.engine.model_state_dict()
    assert torch.equal(before["blocks.0.attn.offset_proj.weight"], after["blocks.0.attn.offset_proj.weight"])
    assert not torch.equal(before["blocks.0.attn.qkv.weight"], after["blocks.0.attn.qkv.weight"])


def test_fused_cpu_adam_agrees_to_1e6(tmp_path, monkeypatch):
    monkeypatch.delenv("MEGASLIDE_CPU_ADAM_BACKEND")
    ref, eng = _pair(tmp_path)
    for loss_ref, loss_eng, _, _ in _run_both(ref, eng):
        assert abs(loss_ref - loss_eng) <= 1e-6 * abs(loss_ref)
    _assert_weights(ref, eng, exact=False)


def test_ablation_modes_switch_on_one_host_state(tmp_path):
    """set_mode flips overlap / optimizer device between steps; the numbers stay the reference's."""
    ref, eng = _pair(tmp_path, steps=4)
    modes = [(True, "cpu"), (False, "cpu"), (True, "gpu"), (False, "gpu")]
    for overlap, device in modes:
        eng.engine.set_mode(overlap=overlap, optimizer_device=device)
        (loss_ref, loss_eng, _, _), = _run_both(ref, eng, steps=1)
        assert loss_ref == loss_eng
    _assert_weights(ref, eng)


def test_resume_continues_exactly(tmp_path):
    straight = Trainer(_model_cfg(), tiny_data_cfg(), tiny_train_cfg(steps=4, grad_clip=CLIP), tmp_path / "a",
                       offload_cfg=OffloadConfig(enabled=True))
    straight.fit()
    first = Trainer(_model_cfg(), tiny_data_cfg(), tiny_train_cfg(steps=2, grad_clip=CLIP), tmp_path / "b",
                    offload_cfg=OffloadConfig(enabled=True))
    first.fit()                                                   # writes checkpoints/step_2/
    assert (tmp_path / "b" / "checkpoints" / "step_2" / "state.pt").is_file()
    resumed = Trainer(_model_cfg(), tiny_data_cfg(), tiny_train_cfg(steps=4, grad_clip=CLIP, resume="auto"),
                      tmp_path / "b", offload_cfg=OffloadConfig(enabled=True))
    resumed.fit()
    assert resumed.step == 4
    a, b = straight.engine.model_state_dict(), resumed.engine.model_state_dict()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # the next step's loss is the same too (moments and step count restored)
    assert straight.train_step()["loss"].item() == resumed.train_step()["loss"].item()


def test_a_checkpoint_of_another_block_layout_is_refused(tmp_path):
    from megaslide.checkpoint import BLOCK_LAYOUT, SHARDED_STATE, load_checkpoint, save_checkpoint
    _, eng = _pair(tmp_path)
    eng.train_step()
    folder = eng.engine.save(tmp_path / "step_1", {})
    state = load_checkpoint(folder / SHARDED_STATE)
    state[BLOCK_LAYOUT] = {**state[BLOCK_LAYOUT], "names": state[BLOCK_LAYOUT]["names"][::-1]}
    save_checkpoint(folder / SHARDED_STATE, state)
    with pytest.raises(ValueError, match="lays its blocks out otherwise"):
        eng.engine.load(folder)


def test_exported_weights_load_into_the_resident_model(tmp_path):
    _, eng = _pair(tmp_path)
    eng.train_step()
    path = eng.export_model(tmp_path / "model.pt")
    from megaslide.checkpoint import load_checkpoint
    state = load_checkpoint(path)
    assert state["model_cfg"]["depth"] == DEPTH and state["step"] == 1
    model = VideoDiT(_model_cfg())
    model.load_state_dict(state["model"])
    mine = eng.engine.model_state_dict()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), mine[name])


def test_streamed_velocity_equals_the_resident_model(tmp_path):
    _, eng = _pair(tmp_path)
    eng.train_step()
    model = VideoDiT(_model_cfg())
    model.load_state_dict(eng.engine.model_state_dict())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 4, 16, 16, generator=g)
    t = torch.rand(2, generator=g) * 1000
    ids = model.tokenizer(["a red circle", ""])
    with torch.no_grad():
        assert torch.equal(eng.engine.velocity(x, t, ids), model(x, t, ids))
    video = eng.sample(["a blue square moving down"])
    assert video.shape == (1, 3, 4, 16, 16) and video.abs().max() <= 1


def test_breakdown_counts_every_transfer(tmp_path):
    """Per step: forward streams every block, backward every block but the last two (still in
    their shells), the gradients of every block go D2H; fp32 here, 4 bytes per element."""
    _, eng = _pair(tmp_path, steps=4)
    for _ in range(4):
        eng.train_step()
    parts = eng.engine.breakdown(range(1, 3))
    block_bytes = eng.engine.layout.numel * 4
    depth = eng.engine.host.depth
    assert parts.h2d_bytes == block_bytes * (2 * depth - 2)
    assert parts.d2h_bytes == block_bytes * depth
    assert parts.step_s > 0 and parts.compute_s > 0 and parts.optimizer_s > 0
    assert 0 < parts.overlap_efficiency <= 1.5  # CPU: "streams" are timed on one timeline


def test_optimizer_worker_errors_reach_the_training_thread(tmp_path):
    _, eng = _pair(tmp_path)

    def broken(*args, **kwargs):
        raise FloatingPointError("boom")
    eng.engine.updater.adam = broken
    with pytest.raises(RuntimeError, match="CPU AdamW worker failed"):
        eng.train_step()
        eng.train_step()  # the failed update surfaces at the latest when its block is loaded again


@pytest.mark.parametrize("part,phase", [("model.embed", "forward"), ("streamer.forward", "forward"),
                                        ("model.unembed", "loss"), ("streamer.backward", "backward"),
                                        ("optimizer.step", "optimizer step")])
def test_phase_names_the_part_of_the_step_that_failed(tmp_path, monkeypatch, part, phase):
    """What the OOM tables record instead of reading tracebacks: the step's part running when it raised."""
    _, eng = _pair(tmp_path)
    engine = eng.engine
    assert engine.phase == ""
    owner, name = part.split(".")

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("simulated")
    monkeypatch.setattr(getattr(engine, owner), name, out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        eng.train_step()
    assert engine.phase == phase


def test_ema_is_rejected_before_allocating(tmp_path):
    with pytest.raises(ValueError, match="ema_decay"):
        Trainer(tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(ema_decay=0.9), tmp_path,
                offload_cfg=OffloadConfig(enabled=True))


# ---- host state ------------------------------------------------------------------------------
def _layout():
    return BlockLayout.from_module(VideoDiT(tiny_model_cfg("dsa_zero")).blocks[0])


def test_layout_views_round_trip_and_alignment():
    block = VideoDiT(tiny_model_cfg()).blocks[1]
    layout = BlockLayout.from_module(block)
    flat = layout.flatten(block)
    assert all(s.offset % 64 == 0 for s in layout.slots)
    for view, (_, p) in zip(layout.views(flat), block.named_parameters()):
        assert torch.equal(view, p.detach())
    assert layout.param_count == sum(p.numel() for p in block.parameters()) <= layout.numel


def test_spans_merge_runs_of_used_parameters():
    layout = _layout()
    n = len(layout.slots)
    assert layout.spans([True] * n) == [(0, layout.slots[-1].end)]
    used = [True] * n
    used[2] = False
    spans = layout.spans(used)
    assert spans == [(0, layout.slots[1].end), (layout.slots[3].offset, layout.slots[-1].end)]
    assert layout.spans([False] * n) == []


@pytest.mark.parametrize("dtype,pin_state", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False)])
def test_host_state_buffers_and_bytes_per_param(dtype, pin_state):
    layout = _layout()
    host = HostState(layout, 3, dtype, pin=False, pin_optimizer_state=pin_state)
    report = host.bytes_report()
    assert report["bytes_per_param_total"] == 16
    assert report["pinned_bytes"] == 0  # nothing is pinned without CUDA
    ptrs = set()
    for b in host.blocks:
        bufs = [b.weights, b.grads, b.master, b.exp_avg, b.exp_avg_sq]
        assert all(t.numel() == layout.numel and t.is_contiguous() for t in bufs)
        assert b.weights.dtype == b.grads.dtype == dtype
        assert (b.weights is b.master) == (dtype == torch.float32)
        ptrs |= {t.data_ptr() for t in bufs}
    assert len(ptrs) == 3 * (4 if dtype == torch.float32 else 5)  # no two buffers share storage
    flat = torch.randn(layout.numel)
    host.load_block_(1, flat)
    assert torch.equal(host.blocks[1].master, flat)
    assert torch.equal(host.blocks[1].weights, flat.to(dtype))
    state = host.block_state(1)
    other = HostState(layout, 3, dtype, pin=False)
    other.load_block_state(1, state)
    assert torch.equal(other.blocks[1].weights, host.blocks[1].weights)
    with pytest.raises(ValueError, match="same model config"):
        other.load_block_state(0, {k: v[:-1] for k, v in state.items()})


def test_bf16_mode_runs_and_stays_close_to_fp32(tmp_path):
    """precision=bf16 on CPU: bf16 block weights (and gradients) with fp32 masters."""
    ref, eng = _pair(tmp_path, precision="bf16", steps=2)
    rows = _run_both(ref, eng, steps=2)
    for loss_ref, loss_eng, _, _ in rows:
        assert abs(loss_ref - loss_eng) < 0.02 * loss_ref
    eng.engine.flush()  # the last step's updates run on the worker thread
    host = eng.engine.host
    assert host.blocks[0].weights.dtype == torch.bfloat16
    assert torch.equal(host.blocks[0].weights, host.blocks[0].master.to(torch.bfloat16))


@pytest.mark.parametrize("attention", ["dense", "dsa"])
def test_from_config_initialises_like_the_host_model(attention):
    """With build_on_host: the host VideoDiT's weights exactly. Built on meta, one block on the host
    at a time (another random stream): per parameter the same exact constants (adaLN-Zero gates,
    final layer, biases, norms, DSA offsets) and the same init statistics."""
    cfg = _model_cfg(attention)
    kw = {"device": torch.device("cpu"), "train_cfg": tiny_train_cfg(), "offload_cfg": OffloadConfig(enabled=True),
          "grid": cfg.token_grid(4, 16, 16)}
    torch.manual_seed(0)
    host = {name: p.detach() for name, p in VideoDiT(cfg).named_parameters()}
    weights = {}
    for build_on_host in (True, False):
        torch.manual_seed(0)
        engine = OffloadEngine.from_config(cfg, build_on_host=build_on_host, **kw)
        weights[build_on_host] = engine.model_state_dict()
        engine.close()
    exact, lean = weights[True], weights[False]
    assert exact.keys() == lean.keys() == host.keys()
    for name, ref in host.items():
        assert torch.equal(exact[name], ref), name
        if (ref == ref.flatten()[0]).all():
            assert torch.equal(lean[name], ref), name
        else:
            n = ref.numel()
            assert abs(lean[name].mean() - ref.mean()) <= 5 * ref.std() / n ** 0.5, name
            assert abs(lean[name].std() / ref.std() - 1) <= 5 / n ** 0.5, name
    zero = ["t_proj.1.weight", "final.linear.weight", *(f"blocks.{i}.modulation" for i in range(DEPTH))]
    zero += [f"blocks.{i}.attn.offset_proj.weight" for i in range(DEPTH)] if attention == "dsa" else []
    assert not any(lean[name].any() for name in zero)


def test_unloaded_blocks_are_refused(tmp_path):
    cfg = tiny_model_cfg()
    with torch.device("meta"):
        model = VideoDiT(dataclasses.replace(cfg))
    for name, child in model.named_children():
        if name != "blocks":
            child.to_empty(device="cpu")
    from megaslide.data.build import build_dataset
    from megaslide.diffusion.batches import make_batch
    engine = OffloadEngine(model, device=torch.device("cpu"), train_cfg=tiny_train_cfg(),
                           offload_cfg=OffloadConfig(enabled=True))
    batch = make_batch(build_dataset(tiny_data_cfg(), in_channels=3), model.tokenizer, tiny_train_cfg(), 0)
    with pytest.raises(ValueError, match="load_block_"):
        engine.train_step(batch, 1e-3)


# ---- on a GPU (the lead runs these on the H200) ---------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("overlap,optimizer_device", [(True, "cpu"), (False, "cpu"), (True, "gpu")])
def test_cuda_fp32_matches_resident_trainer(tmp_path, monkeypatch, overlap, optimizer_device):
    """Three CUDA streams, pinned arena, fused CPU AdamW: the reference's numbers to 1e-5."""
    monkeypatch.delenv("MEGASLIDE_CPU_ADAM_BACKEND")
    ref, eng = _pair(tmp_path, overlap=overlap, optimizer_device=optimizer_device,
                     device="cuda", precision="fp32")
    for loss_ref, loss_eng, norm_ref, norm_eng in _run_both(ref, eng):
        assert abs(loss_ref - loss_eng) <= 1e-5 * loss_ref and abs(norm_ref - norm_eng) <= 1e-4 * norm_ref
    mine = eng.engine.model_state_dict()
    for name, p in ref.engine.model.named_parameters():
        torch.testing.assert_close(mine[name], p.detach().cpu(), rtol=1e-5, atol=1e-5, msg=name)


@cuda
def test_cuda_bf16_stays_close_to_resident_autocast(tmp_path, monkeypatch):
    """bf16 block weights on the GPU vs fp32 weights under bf16 autocast: close, not equal."""
    monkeypatch.delenv("MEGASLIDE_CPU_ADAM_BACKEND")
    ref, eng = _pair(tmp_path, device="cuda", precision="bf16", steps=5)
    rows = _run_both(ref, eng, steps=5)
    print("bf16 losses (reference, engine):", [(a, b) for a, b, _, _ in rows])
    for loss_ref, loss_eng, _, _ in rows:
        assert abs(loss_ref - loss_eng) < 0.02 * loss_ref


@cuda
def test_cuda_host_state_is_pinned_once():
    layout = _layout()
    host = HostState(layout, 3, torch.bfloat16, pin=True, pin_optimizer_state=False)
    assert host.pinned_bytes == host.pinned_arena.nbytes > 0
    assert host.blocks[2].weights.is_pinned() and host.blocks[2].grads.is_pinned()
    assert not host.blocks[2].master.is_pinned()
    host.close()
    assert not host.pinned_arena.buffer.is_pinned()
