"""The README's "Fine-tune Wan on your clips" runs end to end at a tiny size: its four commands, read from the
README, on a tiny random Wan checkpoint (transformer, VAE, umT5, tokenizer) and two clips, each on the CPU with
only the sizes changed (clip size, steps, device). The export loads back bit for bit, into MegaSlide and diffusers.
The commands run in this process (Hydra mains called in turn), which keeps the test near 30 s."""
from __future__ import annotations

import importlib
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megaslide.data.video_folder import clip_size
from megaslide.data.video_io import MP4_SECONDS
from megaslide.inference.weights import sampling_weights
from megaslide.models import load_pretrained
from megaslide.models.pretrained import pretrained_config
from megaslide.train.trainer import Trainer
from tests.experiments.runner import REPO_ROOT
from tests.experiments.test_readme_commands import readme_commands, recipe_block
from tests.helpers import tiny_train_cfg
from tests.wan_assets import FRAMES, SIZE, TEXT_LEN, write_checkpoint, write_clips

diffusers = pytest.importorskip("diffusers", reason='needs the wan extra: pip install -e ".[wan]"')
pytest.importorskip("transformers", reason='needs the wan extra: pip install -e ".[wan]"')

STEPS = 2
TINY = {   # script -> overrides that shrink the README command to this CPU (replacing the key, or added)
    "precompute": {"frames": FRAMES, "height": SIZE, "width": SIZE, "text_len": TEXT_LEN},
    "train": {"train.device": "cpu", "train.steps": STEPS, "train.batch_size": 2, "train.warmup_steps": 1},
    "sample": {"device": "cpu", "steps": 2},
    "export": {},
}


def recipe_commands(folders: dict[str, Path]) -> list[tuple[str, list[str]]]:
    """(script, arguments) of the recipe's bash block, its folder variables pointing at `folders`."""
    block = recipe_block()
    for name, path in folders.items():
        block, count = re.subn(rf"^{name}=\S+$", f"{name}={path}", block, flags=re.M)
        assert count == 1, f"the recipe sets {name} once"
    return [(m.removeprefix("experiments."), args) for m, args in (c.target() for c in readme_commands(block))]


def tiny(script: str, args: list[str]) -> list[str]:
    sizes = {k: str(v) for k, v in TINY[script].items()}
    args = [f"{a.split('=')[0]}={sizes.pop(a.split('=')[0])}" if a.split("=")[0] in sizes else a for a in args]
    return [re.sub(r"step_\d+", f"step_{STEPS}", a) for a in args] + [f"{k}={v}" for k, v in sizes.items()]


def run_main(script: str, args: list[str]) -> None:
    module = importlib.import_module(f"experiments.{script}")
    argv = sys.argv
    sys.argv = [f"experiments/{script}.py", *args]
    try:
        module.main()
    except SystemExit as exit:   # script_main exits 2 with the error on stderr
        pytest.fail(f"experiments/{script}.py {' '.join(args)} exited with {exit.code}")
    finally:
        sys.argv = argv


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wan")
    write_checkpoint(root / "ckpt")
    write_clips(root / "clips", ["a red circle moving left", "a blue square moving up"])
    return {"WAN": root / "ckpt", "CLIPS": root / "clips", "CACHE": root / "cache"}


def test_the_readme_recipe_runs_end_to_end(wan, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)              # the recipe's relative paths (runs/wan, samples/) land here
    commands = recipe_commands(wan)
    assert [script for script, _ in commands] == ["precompute", "train", "sample", "export"]
    for script, args in commands:
        run_main(script, tiny(script, args))
    out = capsys.readouterr().out
    assert "2 clips (2 encoded now, 0 already cached)" in out and f"trained {STEPS} steps" in out
    sample = next((tmp_path / "samples").glob("*.mp4"))
    assert clip_size(sample) == (FRAMES * math.ceil(MP4_SECONDS * 8 / FRAMES), SIZE, SIZE)   # looped, 8 fps
    weights, _ = sampling_weights(tmp_path / "runs/wan/checkpoints" / f"step_{STEPS}")
    exported = tmp_path / "runs/wan/transformer"
    model = load_pretrained(exported)
    assert model.cfg.attention.name == "dsa"          # the recipe trains with attention=dsa; the export keeps it
    loaded = model.state_dict()
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights), "the export differs from the checkpoint"
    start = diffusers.WanTransformer3DModel.from_pretrained(wan["WAN"] / "transformer").state_dict()
    back = diffusers.WanTransformer3DModel.from_pretrained(exported).state_dict()
    assert back.keys() == start.keys()
    assert any(not torch.equal(back[k], start[k]) for k in start), "two training steps changed no weight"


def test_model_pretrained_starts_training_from_the_folder(wan, tmp_path):
    """`model.pretrained`: the trainer's model at step 0 is load_pretrained's, weight for weight."""
    cfg = pretrained_config(wan["WAN"] / "transformer")
    from megaslide.config import DataConfig
    from megaslide.data.encode_cache import encode_video_folder
    from megaslide.models.encoders import UMT5Text, WanVAE
    vae = WanVAE(wan["WAN"] / "vae", torch.device("cpu"))
    text = UMT5Text(wan["WAN"] / "text_encoder", wan["WAN"] / "tokenizer", TEXT_LEN, torch.device("cpu"))
    encode_video_folder(wan["CLIPS"], tmp_path / "cache", frames=FRAMES, height=SIZE, width=SIZE, vae=vae, text=text,
                        sources={}, progress=False)
    data = DataConfig(name="latent_cache", root=str(tmp_path / "cache"), frames=0, height=0, width=0)
    trainer = Trainer(cfg, data, tiny_train_cfg(steps=1), tmp_path / "run")
    reference = load_pretrained(wan["WAN"] / "transformer").state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in trainer.engine.model.state_dict().items())
    assert (data.frames, data.height, data.width) == (3, 8, 8)   # the cache's latent size, read by validate


def test_without_the_wan_extra_the_commands_say_what_to_install(tmp_path):
    """diffusers and safetensors made unimportable (a stand-in package that raises as a missing one does)."""
    for package in ("diffusers", "safetensors"):
        (tmp_path / "hide" / package).mkdir(parents=True)
        (tmp_path / "hide" / package / "__init__.py").write_text(
            f"raise ModuleNotFoundError('No module named {package}', name={package!r})\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "hide"), str(REPO_ROOT)]),
           "WANDB_MODE": "disabled"}
    folder = str(tmp_path)
    for script, args in [("precompute", [f"{k}={folder}" for k in ("root", "vae", "text_encoder", "tokenizer")]
                          + [f"out={folder}/cache"]),
                         ("export", [f"checkpoint={folder}", f"out={folder}/out"])]:
        done = subprocess.run([sys.executable, "-m", f"experiments.{script}", *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stderr
        assert 'pip install -e ".[wan]"' in done.stderr.strip().splitlines()[-1], done.stderr
