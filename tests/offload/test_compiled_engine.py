"""train.compile under the offload engine: the compiled blocks train as the eager ones, with and without
activation offload, and one fixed set of graphs serves every block, slice and step (Inductor on the CPU)."""
import pytest
import torch
from torch._dynamo.utils import counters

from megaslide.config import ExecutionConfig, OffloadConfig, RunConfig, TrainConfig
from megaslide.train.trainer import Trainer
from tests.helpers import needs_inductor, tiny_data_cfg, tiny_model_cfg, tiny_train_cfg

pytestmark = pytest.mark.usefixtures("torch_adamw")


def _trainer(tmp_path, name, *, compile: bool, activation_offload: bool):
    model_cfg = tiny_model_cfg("dsa", max_offset=1.5)
    offload = OffloadConfig(enabled=True, activation_offload=activation_offload)
    return Trainer(model_cfg, tiny_data_cfg(), tiny_train_cfg(steps=2, weight_decay=0.01, compile=compile),
                   tmp_path / name, offload_cfg=offload, execution=ExecutionConfig(chunk_tokens=40))


@needs_inductor
@pytest.mark.slow
def test_compiled_offload_engine_trains_as_the_eager_one(tmp_path):
    """256 tokens in slices of 40 (six of 40, one of 16), two DSA blocks, fp32: losses, gradient norms and
    weights after two steps agree with the eager engine to fp32 rounding (Inductor may reorder the norms'
    sums; AdamW's first steps move each weight by about lr whatever the gradient's scale, so weights get
    a looser bound than losses). Six graphs: per compiled function, the no-grad streamed forward's for the
    first slice length and a symbolic one, then the recompute's with grad (symbolic from the start); none
    after the first step, nor for the engine with parked inputs."""
    torch._dynamo.reset()
    counters.clear()
    for parked in (False, True):
        eager = _trainer(tmp_path, f"eager{parked}", compile=False, activation_offload=parked)
        compiled = _trainer(tmp_path, f"compiled{parked}", compile=True, activation_offload=parked)
        assert compiled.engine.model.runner.compiled and not eager.engine.model.runner.compiled
        for _ in range(2):
            a, b = eager.train_step(), compiled.train_step()
            torch.testing.assert_close(b["loss"], a["loss"], rtol=1e-5, atol=0)
            torch.testing.assert_close(b["grad_norm"], a["grad_norm"], rtol=1e-4, atol=0)
            assert counters["stats"]["unique_graphs"] == 6
        theirs, mine = eager.engine.model_state_dict(), compiled.engine.model_state_dict()
        for name, p in theirs.items():
            torch.testing.assert_close(mine[name], p, rtol=1e-4, atol=1e-6, msg=name)
    torch._dynamo.reset()


def test_compile_with_offload_is_applied(tmp_path):
    """train.compile=true is accepted with the offload engine and reaches its block runner (and the
    resident engine's), keeping how the blocks run."""
    RunConfig(model=tiny_model_cfg(), train=TrainConfig(compile=True), offload=OffloadConfig(enabled=True)).validate()
    for offload in (OffloadConfig(enabled=True), OffloadConfig()):
        trainer = Trainer(tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(compile=True), tmp_path / str(offload),
                          offload_cfg=offload, execution=ExecutionConfig(chunk_tokens=40))
        runner = trainer.engine.model.runner
        assert runner.compiled and runner.execution == ExecutionConfig(chunk_tokens=40)
