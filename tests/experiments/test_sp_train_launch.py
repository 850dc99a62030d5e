"""Sequence-parallel training launched as users launch it (`torchrun --nproc-per-node=2 experiments/train.py
parallel.sp=2 train.device=cpu ...`, gloo): one clip of 5 token frames (3 + 2 per rank) with DSA, whose offset
net is trained, and rank 0's metrics.jsonl and final weights equal one process's, fp32; so do the losses of 2
data-parallel replicas of 2 SP ranks each (4 processes, Swin with shifted windows). On the offload engine (host
state sharded over all 4 ranks), 2 replicas of 2 SP ranks with activation offload, a boundary stride, a resident
tail, token chunks and frame slabs log one process's losses and grad norms, and their checkpoint resumes in one
process for the step one process takes next. A bad value is refused with exit status 2 and one line naming the
key, before anything is built or written."""
import json
import os
import subprocess
import sys

import pytest
import torch

from experiments.hydra_config import run_of
from megaslide.checkpoint import load_checkpoint
from megaslide.train.trainer import Trainer
from tests.experiments.runner import REPO_ROOT, run_script

BASE = ["train.batch_size=2", "train.device=cpu", "train.precision=fp32", "train.log_every=1", "train.lr=1e-3",
        "data.height=8", "data.width=8", "data.shape_size=4", "data.num_videos=4", "sample_captions=[]"]
TINY = ["attention=dsa", "attention.max_offset=1.5", "data.frames=5", "train.steps=3", *BASE]
SWIN = ["attention=swin", "attention.window=[2,2,2]", "data.frames=4", "train.steps=2", *BASE]
RTOL = 1e-5


class Losses:
    """A Trainer's logger that keeps the losses."""

    def __init__(self):
        self.values: list[float] = []

    def log(self, metrics: dict, step: int) -> None:
        self.values.append(metrics["loss"])


def test_two_sp_ranks_train_one_clip_like_one_process(tmp_path):
    out = tmp_path / "sp"
    run_script(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "experiments/train.py",
                "parallel.sp=2", f"out_dir={out}", *TINY], OMP_NUM_THREADS="1")
    run = run_of(TINY)
    trainer = Trainer(run.model, run.data, run.train, tmp_path / "one", Losses(), offload_cfg=run.offload,
                      execution=run.execution)
    trainer.fit()
    one = trainer.engine.model_state_dict()
    trainer.close()
    logged = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == pytest.approx(trainer.logger.values, rel=RTOL)
    sp = load_checkpoint(out / "checkpoints" / "step_3.pt")["model"]
    assert sp.keys() == one.keys()
    moved = [name for name in one if "offset_proj" in name]
    assert moved and all(one[name].abs().max() > 0 for name in moved)  # the offsets were trained
    for name in one:
        assert torch.linalg.vector_norm(sp[name] - one[name]) <= RTOL * torch.linalg.vector_norm(one[name]) + 1e-9, name


def test_two_replicas_of_two_sp_ranks_log_one_process_losses(tmp_path):
    out = tmp_path / "dpsp"
    run_script(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "experiments/train.py",
                "parallel.dp=2", "parallel.sp=2", f"out_dir={out}", *SWIN], OMP_NUM_THREADS="1")
    run = run_of(SWIN)
    trainer = Trainer(run.model, run.data, run.train, tmp_path / "one", Losses(), offload_cfg=run.offload,
                      execution=run.execution)
    trainer.fit()
    trainer.close()
    logged = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == pytest.approx(trainer.logger.values, rel=RTOL)


ENGINE = ["offload=engine", "model.depth=5", "offload.activation_offload=true", "offload.boundary_stride=2",
          "offload.resident_blocks=1", "execution.chunk_tokens=24", "execution.slab_frames=2", "data.frames=7",
          "attention=dsa", "attention.max_offset=1.5", "train.steps=3", *BASE]


def _logged(out) -> list[float]:
    """Each logged step's loss, then its grad norm."""
    rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [value for row in rows for value in (row["loss"], row["grad_norm"])]


def test_replicas_of_sp_ranks_on_the_offload_engine_train_like_one_process(tmp_path):
    out, args = tmp_path / "sp", [*ENGINE, "train.batch_size=4"]
    run_script(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "experiments/train.py",
                "parallel.dp=2", "parallel.sp=2", f"out_dir={out}", *args], OMP_NUM_THREADS="1")
    one = tmp_path / "one"
    run_script(["experiments/train.py", f"out_dir={one}", *args, "train.steps=4"])
    expected = _logged(one)
    assert len(expected) == 8 and _logged(out) == pytest.approx(expected[:6], rel=RTOL)
    run_script(["experiments/train.py", f"out_dir={out}", *args, "train.steps=4", "train.resume=auto"])
    assert _logged(out)[6:] == pytest.approx(expected[6:], rel=RTOL)   # the P-rank checkpoint, resumed on one


def test_more_sp_ranks_than_token_frames_is_refused_before_anything_is_written(tmp_path):
    done = subprocess.run([sys.executable, "experiments/train.py", "parallel.sp=6", f"out_dir={tmp_path / 'x'}",
                           *TINY], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "WANDB_MODE": "disabled"})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "parallel.sp=6 is larger than the clip's 5 token frames" in done.stderr
    assert not (tmp_path / "x").exists()
