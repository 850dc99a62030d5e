"""Data-parallel training launched as users launch it (`torchrun --nproc-per-node=P experiments/train.py
parallel.dp=P train.device=cpu ...`, gloo) equals one process on the same global batch: the losses rank 0 logs
and the final weights, fp32, with clipping active (the clip norm well under the gradient norm). The offload
engine on 3 ranks (its flat blocks not divisible by 3) also resumes from its sharded checkpoint as if never
stopped, on 3 ranks and in one process. Bad input is refused before anything is built, naming the key."""
import json
import os
import subprocess
import sys

import pytest
import torch

from experiments.hydra_config import run_of
from megaslide.checkpoint import load_checkpoint
from megaslide.inference.weights import sampling_weights
from megaslide.train.trainer import Trainer
from tests.experiments.runner import REPO_ROOT, run_script

TINY = ["train.batch_size=6", "train.device=cpu", "train.precision=fp32", "train.grad_clip=0.05", "train.log_every=1",
        "train.lr=1e-3", "data.frames=4", "data.height=8", "data.width=8", "data.shape_size=4", "data.num_videos=8",
        "sample_captions=[]"]
RTOL = 1e-6


def torchrun(ranks: int, args: list[str]) -> str:
    return run_script(["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                       "experiments/train.py", f"parallel.dp={ranks}", *args], OMP_NUM_THREADS="1")


class Losses:
    """A Trainer's logger that keeps the losses."""

    def __init__(self):
        self.values: list[float] = []

    def log(self, metrics: dict, step: int) -> None:
        self.values.append(metrics["loss"])


def one_process(out_dir, overrides: list[str]) -> tuple[list[float], dict]:
    """(losses, final weights) of the run train.py makes with `overrides` in one process, trained here."""
    run = run_of(overrides)
    trainer = Trainer(run.model, run.data, run.train, out_dir, Losses(), offload_cfg=run.offload,
                      execution=run.execution)
    trainer.fit()
    weights = trainer.engine.model_state_dict()
    trainer.close()
    return trainer.logger.values, weights


def losses(out_dir) -> list[float]:
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(row["grad_norm"] > 10 * 0.05 for row in rows)   # clipping scaled every step
    return [row["loss"] for row in rows]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.linalg.vector_norm(a[name] - b[name]) <= RTOL * torch.linalg.vector_norm(a[name]) + 1e-12, name


def test_resident_trainer_on_two_ranks_equals_one_process(tmp_path):
    torchrun(2, [f"out_dir={tmp_path / 'two'}", "train.steps=3", *TINY])
    one_losses, one = one_process(tmp_path / "one", ["train.steps=3", *TINY])
    assert losses(tmp_path / "two") == pytest.approx(one_losses, rel=RTOL)
    assert_same_weights(one, load_checkpoint(tmp_path / "two" / "checkpoints" / "step_3.pt")["model"])
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["checkpoints", "metrics.jsonl"]
    # a fresh run into that folder is refused on every rank at once (none waits at a barrier for the others)
    again = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                            "experiments/train.py", "parallel.dp=2", f"out_dir={tmp_path / 'two'}", "train.steps=3",
                            *TINY], cwd=REPO_ROOT, env={**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"},
                           capture_output=True, text=True, timeout=240)
    assert again.returncode != 0, again.stdout + again.stderr
    assert again.stderr.count("train.resume='' starts a fresh run, but") == 2, again.stderr   # one line per rank


def test_sharded_offload_engine_on_three_ranks_equals_one_process_and_resumes(tmp_path):
    engine = ["offload=engine", "train.ckpt_every=1", *TINY]
    torchrun(3, [f"out_dir={tmp_path / 'three'}", "train.steps=2", *engine])
    out = torchrun(3, [f"out_dir={tmp_path / 'three'}", "train.steps=3", "train.resume=auto", *engine])
    assert out.count("resumed from") == 1    # rank 0 speaks for the run
    one_losses, one = one_process(tmp_path / "one", ["train.steps=3", *engine])
    assert losses(tmp_path / "three") == pytest.approx(one_losses, rel=RTOL)
    step = tmp_path / "three" / "checkpoints" / "step_3"
    assert sorted(p.name for p in step.iterdir()) == ["block_0000.rank0of3.pt", "block_0000.rank1of3.pt",
                                                      "block_0000.rank2of3.pt", "block_0001.rank0of3.pt",
                                                      "block_0001.rank1of3.pt", "block_0001.rank2of3.pt", "state.pt"]
    assert_same_weights(one, sampling_weights(step)[0])
    # the 3-rank checkpoint of step 2 resumes in one process (another number of ranks) as well
    resumed_losses, resumed = one_process(tmp_path / "resumed", ["train.steps=3", *engine,
                                                                 f"train.resume={step.with_name('step_2')}"])
    assert resumed_losses == pytest.approx(one_losses[2:], rel=RTOL)
    assert_same_weights(one, resumed)


@pytest.mark.parametrize("args, message", [
    (["parallel.dp=2"], "parallel.dp=2 x parallel.sp=1 = 2 must equal the number of processes, WORLD_SIZE=1"),
    (["parallel.dp=4"], "train.batch_size=6 (the global batch) is not divisible by parallel.dp=4"),
])
def test_bad_input_is_refused_naming_the_key(tmp_path, args, message):
    done = subprocess.run([sys.executable, "experiments/train.py", f"out_dir={tmp_path / 'run'}", *TINY, *args],
                          cwd=REPO_ROOT, env={**os.environ, "WANDB_MODE": "disabled"}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "run").exists()


def test_sharded_offload_engine_with_compact_state_on_two_ranks_equals_one_process(tmp_path):
    """bf16 master (stochastic rounding) and 8-bit moments on 2 ranks' shards: each rank rounds and quantises its
    shard as the one process does that part of the block, so the runs agree to the gradients' summation order;
    the 2-rank checkpoint (codes and scales per rank part) resumes in one process."""
    engine = ["offload=engine", "offload.master_dtype=bf16", "offload.moments=int8", "train.ckpt_every=1", *TINY]
    torchrun(2, [f"out_dir={tmp_path / 'two'}", "train.steps=3", *engine])
    one_losses, one = one_process(tmp_path / "one", ["train.steps=3", *engine])
    assert losses(tmp_path / "two") == pytest.approx(one_losses, rel=RTOL)
    step = tmp_path / "two" / "checkpoints" / "step_3"
    assert_same_weights(one, sampling_weights(step)[0])
    resumed_losses, resumed = one_process(tmp_path / "resumed", ["train.steps=3", *engine,
                                                                 f"train.resume={step.with_name('step_2')}"])
    assert resumed_losses == pytest.approx(one_losses[2:], rel=RTOL)
    assert_same_weights(one, resumed)
