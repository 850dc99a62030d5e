"""Small builders shared by tests: tiny configs that train in seconds on CPU."""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megaslide.config import AttentionConfig, DataConfig, TrainConfig
from megaslide.models.dit import DIT_PRESETS

# torch.compile's default backend on CPU generates C++ and builds it with g++ (torch._inductor.config.cpp.cxx)
needs_inductor = pytest.mark.skipif(shutil.which("g++") is None,
                                    reason="Inductor's CPU backend needs a C++ compiler (g++), none is installed")


def _ffmpeg_found() -> bool:
    try:
        import imageio_ffmpeg
        return bool(imageio_ffmpeg.get_ffmpeg_exe())
    except (ImportError, RuntimeError):  # RuntimeError: imageio-ffmpeg found no binary
        return False


# write_mp4 runs the ffmpeg binary of imageio-ffmpeg (bundled with its wheel, or FFMPEG_BINARY)
needs_ffmpeg = pytest.mark.skipif(not _ffmpeg_found(), reason="writing an mp4 needs an ffmpeg binary: install "
                                                              "imageio-ffmpeg or set FFMPEG_BINARY")


def tiny_model_cfg(attention: str = "dense", **kw):
    cfg = DIT_PRESETS["tiny"]
    return dataclasses.replace(cfg, attention=AttentionConfig(attention, kw))


def tiny_data_cfg(**kw) -> DataConfig:
    return DataConfig(**{"frames": 4, "height": 16, "width": 16, "num_videos": 32, "shape_size": 6, **kw})


def tiny_train_cfg(**kw) -> TrainConfig:
    return TrainConfig(**{"steps": 4, "batch_size": 2, "lr": 1e-3, "warmup_steps": 1, "device": "cpu",
                          "log_every": 1, "ckpt_every": 1000, "sample_steps": 2, **kw})


SM90_BUILD = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def build(fn, signature, constexprs, num_warps, aligned_ints=()):
    sig = {**signature, **{name: "constexpr" for name in constexprs}}
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr")] + list(aligned_ints)  # 16-aligned, as torch allocates
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    assert compiled.asm["cubin"], fn
    print(fn.__name__, "ok")
    return compiled
"""


def builds_for_sm90(script: str) -> int:
    """Run `script`, which calls `build(fn, signature, constexprs, num_warps, aligned_ints=())` for
    each Triton kernel (signature: each runtime argument's Triton type, "*bf16", "i32", "fp32"; its
    pointers and the ints named in aligned_ints are declared 16-aligned; it returns the compiled kernel,
    whose asm["ptx"] a script may inspect), in a process without
    TRITON_INTERPRET: each kernel is built to sm_90 SASS with Triton's bundled ptxas (no GPU needed),
    which catches the GPU lowering errors the interpreter cannot. Returns how many were built."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", SM90_BUILD + textwrap.dedent(script)], env=env,
                            capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.count(" ok")
