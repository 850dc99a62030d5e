"""Every command README.md shows runs: the fenced ```bash blocks (continuation lines joined, shell
variables expanded, `&&` chains split) and the inline `python3 experiments/...` commands.

For each command of a Hydra script of experiments/:
1. Hydra parses it as written (`--cfg job`): every override names a key the script has;
2. where the script has a tiny size below (TINY), it runs to the end on this CPU machine at that
   size: the command's own overrides first, then CPU stand-ins for what only a GPU machine has
   (`device=cuda` -> cpu, `data.root` -> a folder of two tiny clips, `checkpoint` -> a tiny
   run's checkpoint), then the overrides that shrink it. So a combination the script refuses (a
   16-channel preset on RGB clips, an option that does not exist) fails here. torchrun commands and
   scripts without a tiny size get step 1 only.
argparse scripts (report.py, claims.py) run with their output redirected into a temporary folder;
any other module must at least be a command-line entry point (`--help` prints a usage). Installs, the test
suite itself and shell scripts (`bash experiments/gpu/*.sh`, tested in their own files) are skipped. W&B is disabled
and every output lands in a temporary folder.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from experiments.hydra_config import CONF_DIR
from megaslide.data.video_io import write_mp4
from megaslide.train.trainer import Trainer
from tests.helpers import tiny_data_cfg, tiny_model_cfg, tiny_train_cfg

REPO_ROOT = Path(__file__).resolve().parents[2]
README = REPO_ROOT / "README.md"

_SMALL_MODEL = ["model.depth=1", "model.dim=32", "model.num_heads=2", "model.ffn_dim=64", "model.text_dim=32"]
_SMALL_CLIP = ["data.frames=4", "data.height=16", "data.width=16"]
_SMALL_STUDY = ["train.steps=1", "train.batch_size=2", "train.sample_steps=1", "n_eval=1", "sample_batch=1",
                "seeds=[0]", "workers=1", "save_mp4=false", "data.num_videos=4", "data.shape_size=4", *_SMALL_CLIP]
# script -> overrides appended to shrink a README command of it to a CPU test size ({tmp}: a temporary folder)
TINY = {
    "train": ["train.steps=2", "train.batch_size=2", "train.sample_steps=1", "train.log_every=1",
              "sample_captions=[a red circle moving left]", *_SMALL_CLIP, *_SMALL_MODEL, "out_dir={tmp}/run"],
    "sample": ["steps=1", "out={tmp}/sample.mp4"],
    "ablate_offsets": [*_SMALL_STUDY, "out_dir={tmp}/run", "results_dir={tmp}/results"],
    "quality": [*_SMALL_STUDY, "clip_frames=[4]", "clip_batch_sizes=[]", "out_dir={tmp}/run",
                "results_dir={tmp}/results"],
    "plan": [],
    "mfu_overlap": ["tiny=true", "wandb.dir={tmp}/runs"],
}
# script -> where an argparse script's output goes instead of the repository's results/
SANDBOX = {"report": ["--results", "{tmp}/results"], "claims": ["--out", "{tmp}/README.md"]}
SKIP_MODULES = ("pip", "pytest")


@dataclass
class Command:
    text: str                        # as the README writes it (one line, variables expanded)
    argv: list[str]                  # launcher, options, script or -m module, arguments
    env: dict[str, str] = field(default_factory=dict)

    @property
    def torchrun(self) -> bool:
        return self.argv[0] == "torchrun"

    def target(self) -> tuple[str, list[str]]:
        """("experiments.train" / "megaslide.x" / "pip", arguments): the module it runs and its arguments."""
        i = next(i for i, a in enumerate(self.argv) if i > 0 and (a == "-m" or a.endswith(".py")))
        if self.argv[i] == "-m":
            return self.argv[i + 1], self.argv[i + 2:]
        return self.argv[i].removesuffix(".py").replace("/", "."), self.argv[i + 1:]


def _commands_of(line: str, variables: dict[str, str]) -> list[Command]:
    """The commands of one shell line; a line of assignments only sets `variables`."""
    line = re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), line)
    out = []
    for segment in " ".join(shlex.split(line, comments=True, posix=False)).split(" && "):
        words = shlex.split(segment)
        env = {}
        while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        if words:
            out.append(Command(segment.strip(), words, env))
        else:
            variables.update(env)
    return out


def readme_commands(text: str) -> list[Command]:
    found: list[Command] = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        variables: dict[str, str] = {}
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.strip().startswith("#"):
                found += _commands_of(line, variables)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in (" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose)):
        if re.match(r"(?:[A-Z_]+=\S+ )*(?:python3? |torchrun )", span):
            found += _commands_of(span, {})
        elif re.match(r"experiments/\w+\.py \S", span):
            found += _commands_of(f"python3 {span}", {})
    unique = {c.text: c for c in found}
    return [c for c in unique.values() if c.argv[0] != "bash" and c.target()[0] not in SKIP_MODULES]


COMMANDS = readme_commands(README.read_text())
WAN_RECIPE = "## Fine-tune Wan on your clips"


def recipe_block() -> str:
    """The bash block of the README's Wan recipe section."""
    text = README.read_text()
    section = text[text.index(WAN_RECIPE):]
    return re.search(r"```bash\n.*?```", section[:section.index("\n## ")], re.S).group(0)


RECIPE = {c.text for c in readme_commands(recipe_block())}
"""The Wan recipe's commands: parsed here, run end to end at a tiny size (on a tiny Wan checkpoint and latent
cache, which the stand-ins here are not) by test_wan_recipe.py."""


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory) -> dict[str, Path]:
    """What a GPU machine's command points at: a folder of two captioned RGB clips, a checkpoint."""
    root = tmp_path_factory.mktemp("standins")
    clips = root / "clips"
    for i, caption in enumerate(["a red circle moving left", "a blue square moving up"]):
        write_mp4(clips / f"{i}.mp4", torch.rand(3, 8, 16, 16) * 2 - 1)
        with open(clips / "captions.jsonl", "a") as f:
            f.write(f'{{"file": "{i}.mp4", "caption": "{caption}"}}\n')
    Trainer(tiny_model_cfg(), tiny_data_cfg(), tiny_train_cfg(steps=1), root / "run").fit()
    return {"clips": clips, "checkpoint": root / "run" / "checkpoints" / "step_1.pt"}


def _cpu_args(args: list[str], stand_ins: dict[str, Path]) -> list[str]:
    """The command's overrides with CPU stand-ins for what a GPU machine has."""
    swaps = [(r"((?:train\.)?device)=cuda", r"\1=cpu"), (r"data\.root=.*", f"data.root={stand_ins['clips']}"),
             (r"checkpoint=.*", f"checkpoint={stand_ins['checkpoint']}")]
    for pattern, repl in swaps:
        args = [re.sub(f"^{pattern}$", repl, a) for a in args]
    return args


def _run(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env, "WANDB_MODE": "disabled", "MEGASLIDE_RESULTS_DIR": str(cwd / "results")}
    full_env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=900)


def test_the_readme_shows_commands():
    names = {c.target()[0] for c in COMMANDS}
    assert {"experiments.train", "experiments.sample", "experiments.ablate_offsets"} <= names, names


@pytest.mark.parametrize("command", COMMANDS, ids=[c.text[:80] for c in COMMANDS])
def test_readme_command_runs(command: Command, tmp_path, stand_ins):
    module, args = command.target()
    name = module.removeprefix("experiments.")
    if module.startswith("experiments.") and (CONF_DIR / f"{name}.yaml").is_file():
        parsed = _run(["-m", module, *args, "--cfg", "job"], command.env, tmp_path)
        assert parsed.returncode == 0, f"{command.text}\nHydra does not parse it:\n{parsed.stderr}"
        if command.torchrun or name not in TINY or command.text in RECIPE:
            return
        argv = ["-m", module, *_cpu_args(args, stand_ins), *(a.format(tmp=tmp_path) for a in TINY[name])]
        done = _run(argv, command.env, tmp_path)
        planner_no = "check=true" in args and done.returncode == 1 and "does not fit" in done.stdout
        assert done.returncode == 0 or planner_no, f"{command.text}\nat tiny size ({shlex.join(argv)}):\n" \
                                                   f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    elif name in SANDBOX:
        shutil.copytree(REPO_ROOT / "results", tmp_path / "results")
        done = _run(["-m", module, *args, *(a.format(tmp=tmp_path) for a in SANDBOX[name])], command.env, tmp_path)
        assert done.returncode == 0, f"{command.text}\n{done.stderr[-4000:]}"
    else:
        done = _run(["-m", module, "--help"], command.env, tmp_path)
        assert done.returncode == 0 and "usage" in done.stdout.lower(), \
            f"{command.text}\n{module} is not a command-line entry point (no usage for --help):\n{done.stderr[-2000:]}"
