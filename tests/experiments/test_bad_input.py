"""Bad input to the scripts: each kind is refused before any work with a ValueError that names the key
and the fix, shown as the message alone (exit status 2), and leaves no folder, log or W&B run behind.

The scripts' Hydra mains run in this process (experiments/hydra_config.script_main), from an empty
working directory, so that anything they would write shows up there."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

import experiments.ablate_offsets
import experiments.bench_attention
import experiments.compact_state
import experiments.dp_scaling
import experiments.export
import experiments.generate_causal
import experiments.generate_full
import experiments.mfu_overlap
import experiments.offload_peers
import experiments.offset_stats
import experiments.oom_thresholds
import experiments.plan
import experiments.planner_error
import experiments.precompute
import experiments.profile_step
import experiments.quality
import experiments.sample
import experiments.scaling
import experiments.sp_training
import experiments.train
import experiments.tune_recipe
import experiments.wan_parity
from experiments.hydra_config import CONF_DIR, refuse_unknown_keys, typed_configs
from megaslide.checkpoint import save_checkpoint
from megaslide.config import DiTConfig
from megaslide.train.trainer import Trainer
from tests.experiments.runner import REPO_ROOT
from tests.helpers import tiny_data_cfg, tiny_model_cfg, tiny_train_cfg

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny dense run's step_1.pt (the train.py defaults' model)."""
    out = tmp_path_factory.mktemp("run")
    Trainer(tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(steps=1), out).fit()
    return out / "checkpoints" / "step_1.pt"


def run_main(script, args: list[str], cwd: Path, monkeypatch, capsys) -> str:
    """Run `script`'s main with command-line `args` in `cwd`; it must refuse them: returns stderr."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [script.__file__, *args])
    monkeypatch.setenv("WANDB_MODE", "offline")          # a W&B run, if one started, would leave a folder
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as exit_:
        script.main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err, err
    return err


# kind -> (overrides, what the message must say); {tmp}: an empty folder, {ckpt}: a tiny dense run's
# checkpoint, {damaged}: that checkpoint cut short, {clips}: a folder without captions.jsonl
BAD_TRAIN = {
    "fractional steps": (["train.steps=2.5"], "train.steps=2.5 must be an integer"),
    "non-numeric batch": (["train.batch_size=abc"], "train.batch_size='abc' must be an integer"),
    "zero log interval": (["train.log_every=0"], "train.log_every=0 must be >= 1"),
    "zero checkpoint interval": (["train.ckpt_every=0"], "train.ckpt_every=0 must be >= 1"),
    "zero sampling steps": (["train.sample_steps=0"], "train.sample_steps=0 must be >= 1"),
    "negative sampling steps": (["train.sample_steps=-4"], "train.sample_steps=-4 must be >= 1"),
    "negative clip norm": (["train.grad_clip=-1"], "train.grad_clip=-1.0 must be >= 0: the global-norm bound, "
                                                   "or 0 to turn clipping off"),
    "boolean as number": (["train.lr=true"], "train.lr=True must be a number"),
    "unknown key": (["+train.epochs=3"], "unknown TrainConfig field(s) ['epochs'] under train"),
    "heads": (["model.num_heads=5"], "model.num_heads=5 does not divide model.dim=64"),
    "patch": (["data.height=7"], "data.height=7 is not divisible by the patch size 2"),
    "kernel": (["attention=dsa", "attention.kernel_size=[9,3,3]"], "attention.kernel_size=(9, 3, 3) is larger"),
    "latent preset on RGB": (["model=1B"], "model.in_channels=16, but data=moving_shapes is RGB video (3 channels, "
                                           "pixel space; precompute VAE latents"),
    "missing data folder": (["data=video_folder", "data.root={tmp}/nope"], "is not a folder"),
    "no captions": (["data=video_folder", "data.root={clips}"], "has no captions.jsonl"),
    "missing checkpoint": (["train.resume={tmp}/step_9.pt"], "does not exist"),
    "damaged checkpoint": (["train.resume={damaged}"], "checkpoint file '{damaged}' is damaged"),
    "other architecture": (["train.resume={ckpt}", "attention=dsa_zero", "model.dim=128"],
                           "model.dim: 64 in the checkpoint vs 128 now; model.attention.name: 'dense' in the "
                           "checkpoint vs 'dsa_zero' now"),
    "EMA with offload": (["offload=engine", "train.ema_decay=0.9"], "train.ema_decay=0.9: the offload engine keeps "
                                                                    "no EMA"),
    "captions not a list": (["sample_captions=hello"], "sample_captions='hello' must be a list, e.g. "
                                                       "sample_captions=[hello]"),
    "no GPU": (["train.device=cuda"], "train.device=cuda but no CUDA device is visible"),
}


@pytest.mark.parametrize("kind", BAD_TRAIN)
def test_train_refuses_before_writing_anything(kind, tmp_path, checkpoint, monkeypatch, capsys):
    if kind == "no GPU" and CUDA:
        pytest.skip("a GPU is visible")
    damaged, clips, cwd = tmp_path / "damaged.pt", tmp_path / "clips", tmp_path / "cwd"
    damaged.write_bytes(checkpoint.read_bytes()[:100])
    clips.mkdir()
    cwd.mkdir()
    paths = dict(tmp=tmp_path, ckpt=checkpoint, damaged=damaged, clips=clips)
    args, message = ([a.format(**paths) for a in BAD_TRAIN[kind][0]], BAD_TRAIN[kind][1].format(**paths))
    err = run_main(experiments.train, ["out_dir=runs/x", *args], cwd, monkeypatch, capsys)
    assert message in err
    assert list(cwd.iterdir()) == []                     # no run folder, .hydra, *.log or wandb/


# the quality protocol's study keys (ablate_offsets.py, quality.py); one training step each, so that a
# key accepted by mistake fails the test quickly instead of running the study
BAD_STUDY = {
    "zero n_eval": (["n_eval=0"], "n_eval=0 must be an integer >= 1: held-out captions each run samples"),
    "fractional n_eval": (["n_eval=2.5"], "n_eval=2.5 must be an integer >= 1"),
    "n_train_eval past the data": (["n_train_eval=9", "data.num_videos=8"],
                                   "n_train_eval=9 must be an integer from 0 (off) to data.num_videos=8"),
    "zero workers": (["workers=0"], "workers=0 must be an integer >= 1: runs at once"),
    "zero sample batch": (["sample_batch=0"], "sample_batch=0 must be an integer >= 1: clips sampled per batch"),
    "no seeds": (["seeds=[]"], "seeds=[] must be a non-empty list of integers"),
    "seed not a list": (["seeds=3"], "seeds=3 must be a non-empty list of integers"),
    "fractional seed": (["seeds=[0.5]"], "seeds=[0.5] must be a non-empty list of integers"),
    "negative seed": (["seeds=[-1]"], "seeds[0]=-1 must be in [0, 2**63): choose a smaller non-negative seed"),
    "seed past int64": (["seeds=[0,99999999999999999999]"], "seeds[1]=99999999999999999999 must be in [0, 2**63)"),
    "negative eval seed": (["eval_seed=-5"], "eval_seed=-5 must be in [0, 2**63)"),
    "eval seed past int64": (["eval_seed=99999999999999999999"], "eval_seed=99999999999999999999 must be in [0, "
                                                                 "2**63)"),
    "eval seed not a number": (["eval_seed=abc"], "eval_seed='abc' must be an integer in [0, 2**63)"),
    "variants not a list": (["variants=dsa"], "variants='dsa' must be a list, e.g. variants=[dsa]"),
    "unknown added key": (["+lr=1e-3"], "unknown key(s) +lr: this script has no such key and would ignore it"),
    "unknown added nested key": (["+eval.n=4"], "unknown key(s) +eval.n"),
    "unknown added run field": (["+train.lrate=1e-3"], "unknown TrainConfig field(s) ['lrate'] under train"),
}


@pytest.mark.parametrize("script", [experiments.ablate_offsets, experiments.quality], ids=["ablate_offsets", "quality"])
@pytest.mark.parametrize("kind", BAD_STUDY)
def test_studies_refuse_before_writing_anything(script, kind, tmp_path, monkeypatch, capsys):
    args, message = BAD_STUDY[kind]
    err = run_main(script, ["out_dir=runs/x", "train.steps=1", *args], tmp_path, monkeypatch, capsys)
    assert message in err and ("num_videos" in message or "num_videos" not in err)   # n_eval=0 is not a data error
    assert list(tmp_path.iterdir()) == []                # no run folder, results, .hydra, *.log or wandb/


NAMED = [experiments.oom_thresholds, experiments.scaling, experiments.mfu_overlap, experiments.offload_peers,
         experiments.bench_attention, experiments.train, experiments.ablate_offsets]


BAD_NAMES = [*((s, "name", v) for s in NAMED for v in ("../../x", "a/b")),
             (experiments.ablate_offsets, "results_name", "../x")]


@pytest.mark.parametrize("script,key,value", BAD_NAMES, ids=lambda v: getattr(v, "__name__", v))
def test_a_name_that_leaves_its_folder_is_refused_first(script, key, value, tmp_path, monkeypatch, capsys):
    """The one check (results_io.check_result_name, run by script_main) before the script does anything."""
    err = run_main(script, [f"{key}={value}"], tmp_path, monkeypatch, capsys)
    assert err.startswith(f"error: {key}='{value}': a result name must be one plain file name"), err
    assert list(tmp_path.iterdir()) == []


def test_full_error_keeps_the_traceback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", "train.steps=0"])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ValueError, match="train.steps=0 must be >= 1"):
        experiments.train.main()


@pytest.mark.parametrize("args,message", [
    (["steps=0"], "steps=0 must be >= 1"),
    (["steps=-2"], "steps=-2 must be >= 1"),
    (["steps=1.5"], "steps=1.5 must be an integer"),
    (["cfg_scale=abc"], "cfg_scale='abc' must be a number"),
    (["seed=-1"], "seed=-1 must be in [0, 2**63): choose a smaller non-negative seed"),
    (["seed=99999999999999999999"], "seed=99999999999999999999 must be in [0, 2**63)"),
    (["out=x.gif"], "out='x.gif': sample.py writes mp4 video only; give a name ending in .mp4"),
    (["checkpoint=missing.pt"], "checkpoint='missing.pt' does not exist"),
    *([] if CUDA else [(["device=cuda"], "device=cuda but no CUDA device is visible; use device=cpu")]),
])
def test_sample_refuses_before_loading(args, message, tmp_path, checkpoint, monkeypatch, capsys):
    err = run_main(experiments.sample, [f"checkpoint={checkpoint}", *args], tmp_path, monkeypatch, capsys)
    assert message in err and "train.device" not in err
    assert list(tmp_path.iterdir()) == []


def test_sample_names_a_damaged_checkpoint(tmp_path, checkpoint, monkeypatch, capsys):
    damaged = save_checkpoint(tmp_path / "ckpt" / "step_1.pt", {})
    damaged.write_bytes(b"")
    err = run_main(experiments.sample, [f"checkpoint={damaged}", f"out={tmp_path / 'o.mp4'}"], tmp_path, monkeypatch,
                   capsys)
    assert f"checkpoint file '{damaged}' is damaged" in err and not (tmp_path / "o.mp4").exists()


def test_sample_refuses_an_unwritable_out_folder(tmp_path, checkpoint, monkeypatch, capsys):
    """A read-only folder (chmod, where this user is not root, whom chmod does not stop), else one whose
    parent is a regular file: refused before sampling, naming the out path, nothing written."""
    folder = tmp_path / "folder"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
    else:
        folder.rmdir()
        folder.write_text("")
    out = folder / "x.mp4"
    err = run_main(experiments.sample, [f"checkpoint={checkpoint}", f"out={out}"], tmp_path, monkeypatch, capsys)
    assert f"out='{out}'" in err
    assert ("this user cannot write into" if os.geteuid() != 0 else f"lies under {folder}, a file") in err
    assert [p.name for p in tmp_path.iterdir()] == ["folder"] and not out.exists()


def test_sample_full_disk_exits_nonzero_without_a_file(tmp_path, checkpoint):
    """A write that fails after sampling (here a file-size limit, as a full disk): exit status 1, the error
    names the out path and ffmpeg's cause, and neither the video nor a temp file is left."""
    out = tmp_path / "x.mp4"
    code = ("import resource, runpy, sys\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))\n"
            f"sys.argv = ['sample.py', 'checkpoint={checkpoint}', 'out={out}', 'steps=1', 'device=cpu']\n"
            "runpy.run_path('experiments/sample.py', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"error: could not write the video {out}: ffmpeg exited with status" in done.stderr
    assert "wrote" not in done.stdout and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script", ["generate_full", "generate_causal"])
def test_generate_full_disk_exits_nonzero_without_a_file(script, tmp_path):
    """A write of the latents that fails after sampling (a file-size limit, as a full disk): exit status 1, the error
    names the out path and the cause, no 'wrote', and neither a partial .pt (before: a 1024-byte one and a
    traceback) nor a temp file is left."""
    out = tmp_path / "x.pt"
    code = ("import resource, runpy, sys\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))\n"
            f"sys.argv = ['{script}.py', 'out={out}']\n"
            f"runpy.run_path('experiments/{script}.py', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith(f"error: could not write the latents {out}: "), done.stderr
    assert "Traceback" not in done.stderr and "wrote" not in done.stdout and list(tmp_path.iterdir()) == []


def test_export_refuses_an_out_folder_under_a_file_before_loading(tmp_path, checkpoint, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    err = run_main(experiments.export, [f"checkpoint={checkpoint}", f"out={blocker}/model"], tmp_path, monkeypatch,
                   capsys)
    assert f"out='{blocker}/model' lies under {blocker}, a file, not a folder; give a folder path" in err
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


@pytest.mark.parametrize("seed", ["-1", "99999999999999999999"])
def test_offset_stats_refuses_a_data_seed_out_of_range(seed, tmp_path, checkpoint, monkeypatch, capsys):
    err = run_main(experiments.offset_stats, [f"checkpoint={checkpoint}", f"data_seed={seed}"], tmp_path,
                   monkeypatch, capsys)
    assert f"data_seed={seed} must be in [0, 2**63)" in err and list(tmp_path.iterdir()) == []


def _compose(overrides: list[str]):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return typed_configs(compose("train", overrides=[*overrides, "train.device=cpu"]))


def test_every_model_field_is_overridable_without_plus():
    fields = [f.name for f in dataclasses.fields(DiTConfig) if f.name != "attention"]
    listed = (CONF_DIR / "model" / "_fields.yaml").read_text()
    assert [f for f in fields if f"\n{f}: null" not in listed] == []
    model = _compose(["model.num_heads=8", "model.patch_size=[1,4,4]", "model.qk_norm=false", "model.depth=3"])[0]
    assert (model.num_heads, model.patch_size, model.qk_norm, model.depth) == (8, (1, 4, 4), False, 3)
    assert _compose(["model=quality_gpu"])[0].dim == 256               # a preset file's own values still apply


def test_a_pixel_space_preset_trains_on_rgb_clips():
    model, data, _, _ = _compose(["model=1B", "model.in_channels=3", "data.height=16", "data.width=16",
                                  "data.frames=2"])
    assert model.in_channels == data.channels == 3 and model.dim == 2048


# zero, negative and NaN sizes, ceilings and scales of the scripts: refused with the key, before any run or W&B run
BAD_TABLE = [
    (experiments.oom_thresholds, "hbm_budget_GB=-1", "hbm_budget_GB=-1.0 must be >= 0"),
    (experiments.oom_thresholds, "host_ram_fraction=0", "host_ram_fraction=0.0 must be in (0, 1]"),
    (experiments.oom_thresholds, "long_step_s=nan", "long_step_s=nan must be > 0"),
    (experiments.oom_thresholds, "frames=[0,8]", "frames [0] must be >= 1"),
    (experiments.scaling, "forward_repeats=0", "forward_repeats=0 must be > 0"),
    (experiments.scaling, "host_budget_GB=-5", "host_budget_GB=-5.0 must be >= 0"),
    (experiments.scaling, "cap_GB=nan", "cap_GB=nan must be > 0"),
    (experiments.dp_scaling, "inter_node_GBps=nan", "inter_node_GBps=nan must be > 0"),
    (experiments.sp_training, "intra_node_GBps=nan", "intra_node_GBps=nan must be > 0"),
    (experiments.sp_training, "inter_node_GBps=-3", "inter_node_GBps=-3.0 must be > 0"),
    (experiments.sample, "cfg_scale=nan", "cfg_scale=nan must be a finite number >= 0"),
    (experiments.wan_parity, "text_len=0", "text_len=0 must be > 0"),
    (experiments.wan_parity, "grad_frames=-1", "grad_frames=-1 must be > 0"),
    (experiments.wan_parity, "height=61", "height=61 is not divisible by the patch size 2"),
    (experiments.wan_parity, "model=tiny", "only a wan model with QK-norm has a diffusers form"),
    (experiments.wan_parity, "device=tpu", "device='tpu': choose one of auto, cpu, cuda"),
    (experiments.profile_step, "steps=0", "steps=0 must be >= 5"),
    (experiments.profile_step, "batch=0", "batch=0 must be > 0"),
    (experiments.profile_step, "size=33", "size=33 is not divisible by the patch size 2"),
    (experiments.profile_step, "variants=[nope]", "variants=['nope'] must name attention variants"),
    (experiments.profile_step, "device=gpu", "device='gpu': choose one of auto, cpu, cuda"),
    (experiments.bench_attention, "frames=[0]", "frames=[0]: [0] must be >= 1 each"),
    (experiments.bench_attention, "head_dim=0", "head_dim=0 must be > 0"),
    (experiments.planner_error, "results=no_such_folder", "results=no_such_folder is not a folder"),
    (experiments.tune_recipe, "val_seed=-1", "val_seed=-1 must be in [0, 2**63)"),
    *((script, arg, message) for script in (experiments.generate_full, experiments.generate_causal)
      for arg, message in (
        ("frames=0", "frames=0 must be > 0"),
        ("frames=-1", "frames=-1 must be > 0"),
        ("height=2.5", "height=2.5 must be an integer"),
        ("width=nan", "width=nan must be an integer"),
        ("seed=-1", "seed=-1 must be in [0, 2**63): choose a smaller non-negative seed"),
        ("seed=99999999999999999999", "seed=99999999999999999999 must be in [0, 2**63)"),
        ("caption=[a]", "caption=['a'] must be one caption (a string)"),
        ("out=.", "out='.' is a folder; give the file to write the latents to"),
        ("height=7", "height=7 is not divisible by the patch size 2"))),
]


# a key the script's config does not have: refused with its closest keys, not with Hydra's advice to add it with '+'
UNKNOWN_KEYS = [(experiments.ablate_offsets, "variantz=[dsa]", "unknown key variantz: experiments/conf/"
                 "ablate_offsets.yaml has no such key (did you mean variants?)"),
                (experiments.train, "train.lrr=1", "unknown key train.lrr: experiments/conf/train.yaml has no such "
                 "key (did you mean train.lr or"),
                (experiments.sample, "ckpt=run/x", "unknown key ckpt: experiments/conf/sample.yaml has no such key;")]


@pytest.mark.parametrize("script,arg,message", UNKNOWN_KEYS, ids=lambda v: getattr(v, "__name__", v))
def test_an_unknown_key_is_refused_with_the_keys_it_may_mean(script, arg, message, tmp_path, monkeypatch, capsys):
    assert message in run_main(script, [arg], tmp_path, monkeypatch, capsys)
    assert list(tmp_path.iterdir()) == []


def test_hydra_flags_and_other_refusals_are_left_to_hydra():
    """The unknown-key check steps aside for Hydra's own flags and for what only Hydra reports (it returns)."""
    for argv in (["train.steps=1", "--cfg", "job"], ["-m", "train.lr=1e-3,2e-3"], ["model=no_such_preset"],
                 ["train.steps"], []):
        assert refuse_unknown_keys("train", argv) is None


def test_bench_attention_at_full_size_needs_a_gpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = run_main(experiments.bench_attention, ["name=x"], tmp_path, monkeypatch, capsys)
    assert "it needs a CUDA GPU; smoke=true runs it tiny on the CPU" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script,arg,message", BAD_TABLE, ids=lambda v: getattr(v, "__name__", v))
def test_table_scripts_refuse_bad_sizes_first(script, arg, message, tmp_path, monkeypatch, capsys):
    assert message in run_main(script, [arg], tmp_path, monkeypatch, capsys)
    assert list(tmp_path.iterdir()) == []


# a list whose entries each name a run: an entry given twice would train two runs into one folder at once
REPEATS = [(experiments.ablate_offsets, "variants=[dsa,dsa]", "variants=['dsa', 'dsa'] lists 'dsa' more than once"),
           (experiments.quality, "seeds=[1,1]", "seeds=[1, 1] lists 1 more than once"),
           (experiments.quality, "clip_frames=[16,16]", "clip_frames=[16, 16] lists 16 more than once"),
           (experiments.tune_recipe, "lrs=[1e-3,1e-3]", "lrs=[0.001, 0.001] lists 0.001 more than once"),
           (experiments.tune_recipe, "warmups=[10,10]", "warmups=[10, 10] lists 10 more than once"),
           (experiments.compact_state, "variants=[fp32,both,both]", "lists 'both' more than once")]


@pytest.mark.parametrize("script,arg,message", REPEATS, ids=lambda v: getattr(v, "__name__", v))
def test_a_run_listed_twice_is_refused_first(script, arg, message, tmp_path, monkeypatch, capsys):
    assert message in run_main(script, [arg], tmp_path, monkeypatch, capsys)
    assert list(tmp_path.iterdir()) == []


# an output folder that is a file (or lies under one) is refused by its key before anything is written, not met
# as a traceback at the first write
@pytest.mark.parametrize("script,key", [(experiments.train, "out_dir"), (experiments.quality, "results_dir"),
                                        (experiments.quality, "out_dir"), (experiments.dp_scaling, "wandb.dir"),
                                        (experiments.generate_full, "out"), (experiments.generate_causal, "out")])
def test_an_output_folder_that_is_a_file_is_refused_first(script, key, tmp_path, monkeypatch, capsys):
    blocker = tmp_path.parent / f"{tmp_path.name}_file"
    blocker.write_text("")
    err = run_main(script, [f"{key}={blocker}/sub"], tmp_path, monkeypatch, capsys)
    assert f"{key}='{blocker}/sub' lies under {blocker}, a file, not a folder" in err
    assert list(tmp_path.iterdir()) == []


def test_precompute_refuses_a_cache_folder_under_a_file_before_any_encoder_loads(tmp_path, monkeypatch, capsys):
    blocker = tmp_path.parent / f"{tmp_path.name}_file"
    blocker.write_text("")
    folder = tmp_path.parent   # stands in for the encoder folders, which are checked only to exist here
    args = ["root=", "prompts=[a cat]", f"text_encoder={folder}", f"tokenizer={folder}", f"out={blocker}/cache"]
    err = run_main(experiments.precompute, args, tmp_path, monkeypatch, capsys)
    assert f"out='{blocker}/cache' lies under {blocker}, a file, not a folder" in err
    assert list(tmp_path.iterdir()) == []


def test_a_results_dir_that_is_a_file_is_refused_before_the_run_folder(tmp_path, monkeypatch, capsys):
    blocker = tmp_path.parent / f"{tmp_path.name}_results"
    blocker.write_text("")
    monkeypatch.setenv("MEGASLIDE_RESULTS_DIR", str(blocker))
    err = run_main(experiments.wan_parity, ["model.depth=1", "device=cpu"], tmp_path, monkeypatch, capsys)
    assert f"MEGASLIDE_RESULTS_DIR='{blocker}' is a file, not a folder; give a folder path" in err
    assert list(tmp_path.iterdir()) == []


# dp_scaling's reference= (predictions from a committed one-GPU step): a step of other work, or no stated collective
# bandwidth, is refused by name before anything is written
REFERENCE = Path(__file__).parents[2] / "results/mfu_overlap/h200_7Bwidth_d20_5steps.json"   # 7B width, 20 blocks
BAD_REFERENCE = [(["model.depth=25", "collective_GBps=200"], "model.depth=25 (the reference: 20)"),
                 (["model.depth=20"], "give their bus bandwidth as collective_GBps="),
                 (["model.depth=20", "collective_GBps=200", "data.frames=32"], "tokens per GPU (the reference: 32768)"),
                 (["model.depth=20", "collective_GBps=200", "smoke=true"], "drop one of them")]


@pytest.mark.parametrize("args,message", BAD_REFERENCE)
def test_dp_scaling_refuses_a_reference_of_other_work(args, message, tmp_path, monkeypatch, capsys):
    assert message in run_main(experiments.dp_scaling, [f"reference={REFERENCE}", *args], tmp_path, monkeypatch,
                               capsys)
    assert list(tmp_path.iterdir()) == []


# a trial flag's preset replaces sizes: a key the user also gave is refused, never lost without a word
PRESET_CLASHES = [
    (experiments.oom_thresholds, ["smoke=true", "frames=[4]"], "smoke=true sets frames itself"),
    (experiments.offload_peers, ["smoke=true", "model=7B"], "smoke=true sets model itself"),
    (experiments.mfu_overlap, ["tiny=true", "model.depth=5"], "tiny=true sets model.depth itself"),
    (experiments.mfu_overlap, ["tiny=true", "bench.timed_steps=3"], "tiny=true sets bench.timed_steps itself"),
]


@pytest.mark.parametrize("script,args,message", PRESET_CLASHES, ids=lambda v: getattr(v, "__name__", None))
def test_a_trial_preset_refuses_the_keys_it_would_replace(script, args, message, tmp_path, monkeypatch, capsys):
    err = run_main(script, args, tmp_path, monkeypatch, capsys)
    assert message in err and "drop " in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args,message", [
    (["execution.slab_frames=auto"], "execution.slab_frames=auto is planned within an HBM budget"),
    (["offload.keep_attention=auto", "execution.slab_frames=auto"],
     "offload.keep_attention=auto and execution.slab_frames=auto are planned within an HBM budget")])
def test_plan_without_hbm_to_read_names_what_needs_a_budget(args, message, tmp_path, monkeypatch, capsys):
    """experiments/plan.py where no device's free HBM can be read: what is planned within an HBM budget is named,
    with the fix (hbm_budget_GB)."""
    monkeypatch.setattr(experiments.plan, "hbm_available_bytes", lambda device: None)
    err = run_main(experiments.plan, ["model=tiny", "attention=dsa", "offload=engine", *args], tmp_path, monkeypatch,
                   capsys)
    assert err.startswith(f"error: {message}") and "set hbm_budget_GB" in err, err
