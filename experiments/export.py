"""Export a training checkpoint of a Wan model to the diffusers format.

    python experiments/export.py checkpoint=runs/wan/checkpoints/step_200 out=/ckpt/my-wan/transformer

Either checkpoint format (a step_N.pt file, EMA weights when the run kept them, or a sharded step_N/ folder of
the offload engine). The folder holds config.json and the weights as `VideoDiT.save_pretrained` writes them:
diffusers' `WanTransformer3DModel.from_pretrained(out)` loads it (a DSA offset net is kept under its MegaSlide
name, which diffusers ignores), and so does `model.pretrained=<out>` of experiments/train.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from experiments.hydra_config import script_config, script_main
from experiments.results_io import check_writable_folder
from megaslide.config import DiTConfig, from_dict
from megaslide.extras import require
from megaslide.inference.weights import sampling_weights
from megaslide.models.dit import VideoDiT
from megaslide.models.pretrained import shard_bytes
from megaslide.models.wan import diffusers_config


@dataclass
class ExportConfig:
    """The keys of experiments/conf/export.yaml."""

    checkpoint: str
    out: str
    max_shard_size: str

    def validate(self) -> None:
        if not Path(self.checkpoint).exists():
            raise ValueError(f"checkpoint={self.checkpoint!r} does not exist; pass a checkpoint of "
                             f"experiments/train.py (checkpoints/step_N.pt or checkpoints/step_N/)")
        if Path(self.out).is_file():
            raise ValueError(f"out={self.out!r} is a file; give a folder to write the diffusers model into")
        check_writable_folder(self.out, "out")   # a folder under a file, or not writable: before the weights load
        shard_bytes(self.max_shard_size)


@script_main("export")
def main(hydra_cfg: DictConfig) -> None:
    cfg = script_config(ExportConfig, hydra_cfg)
    require("safetensors", "experiments/export.py")   # before the checkpoint is read
    weights, state = sampling_weights(cfg.checkpoint)
    model_cfg = from_dict(DiTConfig, state["model_cfg"])
    diffusers_config(model_cfg)            # a model of another block family is refused before it is built
    model = VideoDiT(model_cfg)
    model.load_state_dict(weights)
    model.save_pretrained(cfg.out, max_shard_size=cfg.max_shard_size)
    print(f"wrote {cfg.out} (diffusers WanTransformer3DModel, step {state['step']})")


if __name__ == "__main__":
    main()
