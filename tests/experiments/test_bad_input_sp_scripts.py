"""Bad numeric config values of the sequence-parallel scripts (experiments/swiftfusion.py, sp_inference.py): each
is refused by the typed config's `validate()` (nested groups included) with the key as typed on the command line,
as `error: ...` with exit status 2, before any process group, model, W&B run or folder; and every default (and the
trial presets and documented commands) still validates."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

import experiments.sp_inference
import experiments.swiftfusion
from experiments.hydra_config import CONF_DIR, script_config, trial_preset
from tests.experiments.test_bad_input import run_main

SF, SP = experiments.swiftfusion, experiments.sp_inference

# (script, command-line arguments, what the message must say: the key as typed and its value)
BAD = [
    (SF, ["heads=0"], "heads=0 must be > 0"),
    (SF, ["head_dim=-8"], "head_dim=-8 must be > 0"),
    (SF, ["timeout_s=-1"], "timeout_s=-1.0 must be > 0 and finite"),
    (SF, ["timeout_s=inf"], "timeout_s=inf must be > 0 and finite"),
    (SF, ["seq_lens=[0]"], "seq_lens=[0]: [0] must be >= 1"),
    (SF, ["seq_lens=[]"], "seq_lens=[] must list at least one value"),
    (SF, ["intra_bw=nan"], "intra_bw=nan must be > 0 and finite"),
    (SF, ["inter_bw=0"], "inter_bw=0.0 must be > 0 and finite"),
    (SF, ["chunks=0"], "chunks=0 must be > 0"),
    (SF, ["repeats=0"], "repeats=0 must be > 0"),
    (SF, ["max_seconds=nan"], "max_seconds=nan must be > 0"),
    (SF, ["world_size=0"], "world_size=0 must be > 0"),
    (SF, ["a2a_bytes=0"], "a2a_bytes=0 must be > 0"),
    (SF, ["usp_ulysses=0"], "usp_ulysses=0 must be >= 1"),
    (SF, ["variants=[]"], "variants=[] times nothing"),
    (SF, ["world_size=4", "seq_lens=[2,64]"], "seq_lens=[2, 64]: each length must be >= world_size=4"),
    (SF, ["world_size=2", "check_seq_len=3"], "check_seq_len=3 must be a multiple of world_size=2"),
    (SF, ["sim.nodes=[]"], "sim.nodes=[] must list at least one value"),
    (SF, ["sim.seq_lens=[65536,-1]"], "sim.seq_lens=[65536, -1]: [-1] must be >= 1"),
    (SF, ["sim.gpus_per_node=0"], "sim.gpus_per_node=0 must be > 0"),
    (SF, ["step.frames=[0]"], "step.frames=[0]: [0] must be >= 1"),
    (SF, ["step.height=0"], "step.height=0 must be > 0"),
    (SF, ["step.width=5"], "step.width=5 is not divisible by the patch size 2"),
    (SF, ["step.max_seconds=-1"], "step.max_seconds=-1.0 must be > 0 and finite"),
    (SF, ["smoke=true", "chunks=0"], "chunks=0 must be > 0"),            # the preset's sizes are checked with it
    (SP, ["repeats=0"], "repeats=0 must be > 0"),
    (SP, ["warmup=-1"], "warmup=-1 must be >= 0"),
    (SP, ["matmul_n=0"], "matmul_n=0 must be > 0"),
    (SP, ["video.frames=0"], "video.frames=0 must be > 0"),
    (SP, ["video.height=-2"], "video.height=-2 must be > 0"),
    (SP, ["video.width=nan"], "video.width=nan must be an integer"),     # from_dict: the type, also named
    (SP, ["video.chunk_frames=0"], "video.chunk_frames=0 must be >= 1"),
    (SP, ["video.frames=20"], "video.frames=20 is not a multiple of video.chunk_frames=3"),
    (SP, ["video.height=7"], "video.height=7 is not divisible by the patch size 2"),
    (SP, ["tiny=true", "warmup=-1"], "warmup=-1 must be >= 0"),
]


def _id(value) -> str | None:
    """A test id: the script's short name and the arguments."""
    return value.__name__.rsplit(".", 1)[-1] if hasattr(value, "__name__") else " ".join(value) \
        if isinstance(value, list) else None


@pytest.mark.parametrize("script,args,message", BAD, ids=_id)
def test_sp_scripts_refuse_bad_numbers_first(script, args, message, tmp_path, monkeypatch, capsys):
    err = run_main(script, args, tmp_path, monkeypatch, capsys)
    assert message in err, err
    assert list(tmp_path.iterdir()) == []              # no results/, runs/, .hydra, *.log or wandb/


# each script's defaults, its trial preset and the commands of its docstring, README and docs
VALID = [
    (SF, "swiftfusion", SF.SwiftFusionConfig, [], {}),
    (SF, "swiftfusion", SF.SwiftFusionConfig, [], {"smoke": SF.SMOKE}),
    (SF, "swiftfusion", SF.SwiftFusionConfig, ["variants=[usp,torus]", "seq_lens=[65536]", "step.frames=[]"], {}),
    (SF, "swiftfusion", SF.SwiftFusionConfig, ["variants=[ring,ring_onesided,usp]", "timeout_s=600",
                                               "sim.nodes=[2]", "model=tiny"], {}),
    (SP, "sp_inference", SP.SPInferenceConfig, [], {}),
    (SP, "sp_inference", SP.SPInferenceConfig, [], {"tiny": SP.TINY}),
    (SP, "sp_inference", SP.SPInferenceConfig, ["model.num_heads=8", "ladder=false", "warmup=0", "repeats=1"], {}),
]


@pytest.mark.parametrize("script,name,cls,args,presets", VALID, ids=_id)
def test_defaults_and_documented_commands_still_validate(script, name, cls, args, presets):
    flag = next(iter(presets), None)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(name, overrides=[*args, *([f"{flag}=true"] if flag else [])])
    config = script_config(cls, cfg, trial_preset(cfg, **presets))   # runs validate(): raises if refused
    assert isinstance(config, cls) and (flag is None or getattr(config, flag) is True)
