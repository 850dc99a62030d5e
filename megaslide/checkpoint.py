"""Atomic checkpoints, in two formats under <out_dir>/checkpoints/:
- one file `step_N.pt` (the resident engine);
- a sharded folder `step_N/` of one file per block (`block_0000.pt`: master weights and AdamW
  moments, each one flat buffer, an 8-bit moment as its codes and scales) plus `state.pt` (the offload
  engine). `state.pt` records the flat layout of the block buffers under BLOCK_LAYOUT (`flat_layout`), so
  a reader cuts the shards into named parameters (`block_weights`) without the engine that wrote them. Sharded
  over P data-parallel ranks: one file per block and rank (`block_0000.rank1of2.pt`, that rank's equal part of
  the zero-padded flat buffers, an 8-bit moment's codes and the scales of their whole quantisation blocks), and
  state.pt records P (`SHARD_RANKS`); `read_block` joins the parts, so any P can read them.

A file is written to a temporary name in the same folder, fsynced, then renamed; a folder is
written as `.step_N.tmp/` with `state.pt` last and then renamed, so a reader sees a complete
checkpoint or none. Readers accept either format wherever a checkpoint path is taken (resume,
experiments/sample.py) and name a damaged file as such.
"""
from __future__ import annotations

import math
import os
import re
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from megaslide.config import DiTConfig, architecture_changes, from_dict

SHARDED_STATE = "state.pt"  # written last into a sharded folder: its presence marks a complete checkpoint
BLOCK_LAYOUT = "block_layout"  # key of state.pt: the flat layout of every block shard's buffers (`flat_layout`)
SHARD_RANKS = "shard_ranks"    # key of state.pt: the data-parallel ranks each block is split over (absent: 1)
_STEP_NAME = re.compile(r"step_(\d+)(\.pt)?")
_TEMP_NAME = re.compile(r"\.step_\d+(\.pt)?\.tmp")   # a save's temporary file or folder (save_checkpoint)


def checkpoint_path(folder: str | Path, step: int, *, sharded: bool) -> Path:
    return Path(folder) / (f"step_{step}" if sharded else f"step_{step}.pt")


def block_shard(folder: str | Path, index: int, rank: int = 0, ranks: int = 1) -> Path:
    """The file of block `index` in a sharded checkpoint folder; of a block split over `ranks` data-parallel
    ranks (`SHARD_RANKS`), the file of rank `rank`'s part."""
    return Path(folder) / (f"block_{index:04d}.pt" if ranks == 1 else f"block_{index:04d}.rank{rank}of{ranks}.pt")


def flat_layout(named_shapes: Iterable[tuple[str, Sequence[int]]], align: int) -> dict:
    """The layout of parameters packed in order into one flat buffer, each starting on an `align`-element
    boundary: {"names", "shapes", "offsets" (first element of each), "numel" (the buffer's length,
    padding included)}, plain Python values, as a sharded checkpoint records it."""
    names, shapes, offsets, end = [], [], [], 0
    for name, shape in named_shapes:
        names.append(name)
        shapes.append([int(n) for n in shape])
        offsets.append(end)
        end = (end + math.prod(shape) + align - 1) // align * align
    return {"names": names, "shapes": shapes, "offsets": offsets, "numel": end}


def read_block(folder: str | Path, index: int, ranks: int, numel: int, *, keys: Sequence[str] | None = None,
               moment_block: int | None = None) -> dict:
    """Block `index`'s state in a sharded checkpoint folder (master weights (numel,) fp32 or bf16, and moments,
    each (numel,) fp32 or an 8-bit moment {"codes": (numel,), "scales": one per `moment_block` elements}): the
    parts of its `ranks` ranks (equal, the block padded to whole parts) joined in rank order, the padding dropped;
    only `keys` when given. An 8-bit moment's parts join exactly when each holds whole quantisation blocks of
    `moment_block` elements (host_memory.MOMENT_BLOCK; the engine's shards do); otherwise, or without
    `moment_block`, it is a ValueError, as are parts of another model's size."""
    parts = [load_checkpoint(block_shard(folder, index, rank, ranks)) for rank in range(ranks)]
    files = str(block_shard(folder, index)) if ranks == 1 else f"{folder}/block_{index:04d}.rank*of{ranks}.pt"

    def join(key: str, values: list[torch.Tensor], length: int) -> torch.Tensor:
        sizes = {len(value) for value in values}
        whole = torch.cat(values)
        if len(sizes) > 1 or len(whole) < length or (ranks == 1 and len(whole) != length):
            raise ValueError(f"checkpoint file {files!r} holds {len(whole)} {key} elements (parts of "
                             f"{sorted(sizes)}), but its {BLOCK_LAYOUT} record places {length}; the folder mixes "
                             f"checkpoints of different models, use a complete one")
        return whole[:length]

    state = {}
    for key in keys or parts[0]:
        if not isinstance(parts[0][key], dict):
            state[key] = join(key, [part[key] for part in parts], numel)
            continue
        codes = [part[key]["codes"] for part in parts]   # an 8-bit moment
        if moment_block is None:
            raise ValueError(f"read_block: {files!r} holds an 8-bit {key}; pass moment_block "
                             f"(host_memory.MOMENT_BLOCK) to read it")
        if ranks > 1 and any(len(c) % moment_block for c in codes):
            raise ValueError(f"checkpoint file {files!r} holds 8-bit {key} split over {ranks} ranks in parts that "
                             f"are not whole quantisation blocks of {moment_block} elements, so they cannot be "
                             f"joined exactly; resume it with parallel.dp={ranks} (and the offload.moments it was "
                             f"saved with)")
        state[key] = {"codes": join(f"{key} codes", codes, numel),
                      "scales": join(f"{key} scales", [part[key]["scales"] for part in parts],
                                     math.ceil(numel / moment_block))}
    return state


def block_weights(folder: str | Path, layout: dict, depth: int, ranks: int = 1) -> dict[str, torch.Tensor]:
    """The master weights of blocks 0..depth-1 of a sharded checkpoint folder as fp32 (a bf16 master widened), by
    state-dict name (`blocks.{i}.{name}`), cut out of each block's flat buffer as `layout` (`flat_layout`) places
    them; `ranks`: the data-parallel ranks each block was split over (state.pt's `SHARD_RANKS`)."""
    weights = {}
    for index in range(depth):
        master = read_block(folder, index, ranks, layout["numel"], keys=("master",))["master"].float()
        for name, shape, offset in zip(layout["names"], layout["shapes"], layout["offsets"]):
            weights[f"blocks.{index}.{name}"] = master[offset:offset + math.prod(shape)].view(shape)
    return weights


def save_checkpoint(path: str | Path, state: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one, never half
    return path


def save_sharded_checkpoint(folder: str | Path, shards: Iterable[tuple[str, dict]], state: dict, *,
                            main: bool = True, barrier: Callable[[], None] = lambda: None) -> Path:
    """Write `folder`/<name>.pt for each (name, shard), then `folder`/state.pt; returns `folder`.

    Several writers (the ranks of a data-parallel run, each with its own shards) all call it, with `barrier`
    waiting for all of them: `main` (one writer) prepares the temporary folder, every writer writes its shards
    into it, and once all are written `main` writes state.pt and renames the folder into place."""
    folder = Path(folder)
    tmp = folder.with_name(f".{folder.name}.tmp")
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
    barrier()
    for name, shard in shards:
        save_checkpoint(tmp / f"{name}.pt", shard)
    barrier()
    if main:
        save_checkpoint(tmp / SHARDED_STATE, state)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    barrier()
    return folder


def load_checkpoint(path: str | Path, map_location="cpu", *, mmap: bool = False) -> dict:
    """One checkpoint file. A missing file, a folder, or a file torch cannot read (empty, truncated,
    not a checkpoint) is a ValueError naming the file."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"checkpoint {str(path)!r} is a folder; pass a checkpoint file, or a sharded "
                         f"checkpoint folder (step_N/ with {SHARDED_STATE}) where a checkpoint is expected")
    if not path.is_file():
        raise ValueError(f"checkpoint {str(path)!r} does not exist; pass the path of a checkpoint written by "
                         f"training (checkpoints/step_N.pt or checkpoints/step_N/)")
    try:
        return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    except torch.OutOfMemoryError:
        raise
    except Exception as err:  # torch.load fails in many ways on bad bytes (EOF, zip, pickle, decode errors)
        raise ValueError(f"checkpoint file {str(path)!r} is damaged ({path.stat().st_size} bytes; "
                         f"{type(err).__name__}: {err}); it is empty, truncated or not a torch checkpoint. "
                         f"Use another checkpoint (delete this one, and resume=auto takes the newest "
                         f"remaining)") from err


def read_state(path: str | Path) -> dict:
    """A checkpoint's run state without reading the block shards: `step` and the configs (`model_cfg`,
    `data_cfg`, `train_cfg` as dicts), for a step_N.pt file or a sharded step_N/ folder (its
    state.pt); a file is memory-mapped, not read whole."""
    path = Path(path)
    file = path / SHARDED_STATE if path.is_dir() else path
    if path.is_dir() and not file.is_file():
        raise ValueError(f"checkpoint folder {str(path)!r} has no {SHARDED_STATE}: it is not a complete sharded "
                         f"checkpoint (an interrupted write?); use another checkpoint")
    state = load_checkpoint(file, mmap=True)
    missing = [k for k in ("step", "model_cfg", "data_cfg") if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"checkpoint file {str(file)!r} lacks {missing}: it is not a checkpoint written by "
                         f"MegaSlide training (or it is damaged)")
    return state


def step_checkpoints(folder: str | Path, *, sharded: bool = False) -> dict[int, Path]:
    """step -> the complete `step_N.pt` in `folder` (with `sharded`: `step_N/` folder). Other names
    (step_best.pt, notes) are not training checkpoints and are skipped."""
    found = {}
    for p in Path(folder).glob("step_*"):
        match = _STEP_NAME.fullmatch(p.name)
        complete = (p / SHARDED_STATE).is_file() if sharded else p.is_file()
        if match and complete and bool(match.group(2)) != sharded:
            found[int(match.group(1))] = p
    return found


def latest_checkpoint(folder: str | Path, *, sharded: bool = False) -> Path | None:
    """The newest `step_N.pt` in `folder`, or with `sharded` the newest complete `step_N/`; None if none."""
    found = step_checkpoints(folder, sharded=sharded)
    return found[max(found)] if found else None


def prune_checkpoints(folder: str | Path, keep: int, *, sharded: bool = False) -> list[Path]:
    """Delete all but the newest `keep` training checkpoints of `folder` (keep >= 1); returns the deleted.
    Only complete checkpoints are counted, so a crash mid-save never leaves fewer than `keep` to resume."""
    found = step_checkpoints(folder, sharded=sharded)
    old = [found[step] for step in sorted(found)[:-keep]]
    for path in old:
        _remove(path)
    return old


def clear_checkpoints(folder: str | Path, *, keep: str | Path | None = None) -> list[Path]:
    """Delete every training checkpoint of `folder`, of both formats, except `keep` (a checkpoint a run starts
    from); returns the deleted: a fresh run into a used folder starts without another run's checkpoints, which a
    later resume would otherwise take as its own."""
    kept = Path(keep).absolute() if keep else None
    old = sorted(p for sharded in (False, True) for p in step_checkpoints(folder, sharded=sharded).values()
                 if p.absolute() != kept)
    for path in old:
        _remove(path)
    return old


def remove_stale_temps(folder: str | Path) -> list[Path]:
    """Delete what a killed save left in `folder`: `.step_N.pt.tmp` files and `.step_N.tmp/` folders, the
    temporary names of this module's saves and nothing else. Called when a run starts (`resume_point`), before
    it saves anything; returns the deleted paths."""
    stale = sorted(p for p in Path(folder).glob(".step_*.tmp") if _TEMP_NAME.fullmatch(p.name))
    for path in stale:
        _remove(path)
    return stale


def _remove(path: Path) -> None:
    """Delete a checkpoint: a sharded folder or a single file."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()


def check_fresh_folder(resume: str, folder: str | Path) -> None:
    """A fresh run (`resume` "") into a `folder` that holds an earlier run's checkpoints is refused (ValueError
    naming them and the fix): they would stay beside the new run's for a later "auto" to continue as its own.
    Read-only, so every rank of a data-parallel run can check at once and all refuse together."""
    if resume != "":
        return
    earlier = sorted({**step_checkpoints(folder), **step_checkpoints(folder, sharded=True)}.items())
    if earlier:
        names = ", ".join(p.name for _, p in earlier[:3]) + (", ..." if len(earlier) > 3 else "")
        raise ValueError(f"train.resume='' starts a fresh run, but {folder} holds {len(earlier)} checkpoint(s) "
                         f"of an earlier run ({names}): continue that run with train.resume=auto, or give this "
                         f"one another out_dir (or delete those checkpoints)")


def resume_point(resume: str, folder: str | Path, model_cfg: DiTConfig, *, sharded: bool) -> tuple[Path, int] | None:
    """Where train.resume says to continue: (checkpoint, step), or None to start fresh.

    `resume` is a checkpoint path, "auto" (the newest checkpoint in `folder`, if any) or "".
    `sharded` is the format the training engine reads. Refused with a ValueError before anything
    is built: a checkpoint of the other format, a damaged one, and one of another architecture
    (the error lists each differing field, saved vs now). A fresh run into a used `folder` is the caller's to
    refuse first (`check_fresh_folder`, on every rank). What a killed save left in `folder` is removed first
    (`remove_stale_temps`)."""
    remove_stale_temps(folder)
    if resume == "auto":  # the newest of the engine's format; one of the other format is refused below
        path = latest_checkpoint(folder, sharded=sharded) or latest_checkpoint(folder, sharded=not sharded)
    else:
        path = Path(resume) if resume else None
    if path is None:
        return None
    if path.is_dir() != sharded and path.exists():
        have, need = ("a sharded step_N/ folder of the offload engine", "offload=engine") if path.is_dir() else \
            ("a step_N.pt file of the resident engine", "offload=none")
        raise ValueError(f"train.resume={str(path)!r} is {have}; resume it with {need} (the engine that wrote it)")
    state = read_state(path)
    changes = architecture_changes(from_dict(DiTConfig, state["model_cfg"]), model_cfg)
    if changes:
        raise ValueError(f"train.resume={str(path)!r} holds another model than this run's: " + "; ".join(changes)
                         + ". Resume with the checkpoint's model settings, or start fresh (train.resume='' "
                         "and another out_dir)")
    return path, int(state["step"])
