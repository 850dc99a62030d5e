"""Build a C++ source of this folder into a shared library at first use and load it with ctypes.

The kernels here take raw pointers through a plain C ABI, so they need no Python or torch
headers and no pybind11: one call of the system C++ compiler (`$CXX`, else `g++`, else `c++`)
builds them in about a second. This is sturdier than `torch.utils.cpp_extension.load`, which
requires ninja (absent on the CI image). The library is compiled with `-march=native`, so the
cache key holds the source, the compiler and its version, the flags and the CPU's feature
flags: a cache directory shared between machines never hands an AVX-512 build to a CPU
without AVX-512. Builds land in `$TORCH_EXTENSIONS_DIR/megaslide/`, else
`$XDG_CACHE_HOME/megaslide/extensions/` (default `~/.cache/megaslide/extensions/`; a temporary
folder if that cannot be created), and are
written to a temporary file and renamed, so concurrent processes never load a partial file.

CUDA sources (`load_cuda`, e.g. the DSA halo kernel) take the same cache and rename through `nvcc`: their
key holds the source, nvcc and its version, the flags and the target architecture (sm_XY) instead of the
CPU's feature flags.

OpenMP: the library links libgomp by its soname `libgomp.so.1`. torch's pip wheels ship and
load a `libgomp.so.1` first, so import torch before loading and both share one OpenMP runtime
(one thread pool, no oversubscription between torch ops and these kernels).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent


class BuildError(RuntimeError):
    """The compiler is missing, the compile failed, or the library did not load."""


def _compiler() -> str:
    for candidate in (os.environ.get("CXX"), "g++", "c++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    raise BuildError("no C++ compiler found: install g++ or set $CXX")


def compile_flags() -> list[str]:
    """-O3 and -march=native for the vector ISA of this CPU; -ffp-contract=off so the compiler
    adds no fused multiply-adds of its own (results then follow the source exactly);
    -fno-math-errno lets sqrt vectorise without changing its (correctly rounded) results."""
    flags = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off",
             "-std=c++17", "-fPIC", "-shared"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-mprefer-vector-width=512")  # GCC defaults to 256-bit vectors on Xeons
    return flags


def _cpu_identity() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _cache_root() -> Path:
    """The build cache; a per-user temporary folder when the usual one cannot be created."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        root = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "megaslide"
    else:
        cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        root = Path(cache) / "megaslide" / "extensions"
    try:
        root.mkdir(parents=True, exist_ok=True)
        return root
    except OSError:
        return Path(tempfile.gettempdir()) / f"megaslide-extensions-{os.getuid()}"


def _cached_path(source: Path, parts: list[str]) -> Path:
    """The cache entry of a build of `source` (a path) keyed by its bytes and `parts`."""
    key = hashlib.sha256()
    for part in (source.read_bytes(), *(p.encode() for p in parts)):
        key.update(part)
        key.update(b"\0")
    return _cache_root() / f"{source.stem}_{key.hexdigest()[:16]}" / f"lib{source.stem}.so"


def _build_and_load(path: Path, command: list[str], source: Path) -> ctypes.CDLL:
    """Run `command` + ["-o", tmp] unless `path` exists, rename tmp onto it, load it; BuildError on failure."""
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
            os.close(fd)
            cmd = [*command, "-o", tmp]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                os.unlink(tmp)
                raise BuildError(f"`{' '.join(cmd)}` failed:\n{done.stderr[-2000:]}")
            os.replace(tmp, path)
        return ctypes.CDLL(str(path))
    except OSError as err:
        raise BuildError(f"could not build or load {source.name}: {err}") from err


def _toolchain(compiler: str) -> list[str]:
    """A compiler's path and its `--version` text: part of every build's cache key."""
    return [compiler, subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout]


def library_path(source: str) -> Path:
    """Where the build of `source` (a file name in this folder) for this machine is cached."""
    return _cached_path(SOURCE_DIR / source, [*_toolchain(_compiler()), " ".join(compile_flags()), _cpu_identity()])


def load(source: str) -> ctypes.CDLL:
    """Compile `source` (a file name in this folder) unless a cached build exists; load it.

    Raises BuildError with the compiler's message when anything fails."""
    try:
        path = library_path(source)
    except OSError as err:
        raise BuildError(f"could not build or load {source}: {err}") from err
    return _build_and_load(path, [_compiler(), *compile_flags(), str(SOURCE_DIR / source)], SOURCE_DIR / source)


def nvcc() -> str:
    """The CUDA compiler: `$NVCC`, else `nvcc` on PATH, else /usr/local/cuda/bin/nvcc."""
    for candidate in (os.environ.get("NVCC"), "nvcc", "/usr/local/cuda/bin/nvcc"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    raise BuildError("no CUDA compiler found: install the CUDA toolkit (nvcc) or set $NVCC")


def cuda_compile_flags(arch: str) -> list[str]:
    """nvcc flags for a shared library of device code for `arch` ("90" for sm_90): -O3 without --use_fast_math
    (exp2f, log2f and division keep their full-precision forms and denormals are kept), -lineinfo for profilers;
    the CUDA runtime is linked statically (nvcc's default), so the library needs no libcudart on the loader's
    path."""
    return ["-O3", f"-arch=sm_{arch}", "-std=c++17", "-lineinfo", "-shared", "-Xcompiler", "-fPIC"]


def cuda_library_path(source: Path, arch: str) -> Path:
    """Where the build of the CUDA source `source` (a path) for sm_`arch` is cached."""
    return _cached_path(source, [*_toolchain(nvcc()), " ".join(cuda_compile_flags(arch)), f"sm_{arch}"])


def load_cuda(source: Path, arch: str) -> ctypes.CDLL:
    """Compile the CUDA source `source` (a path) for sm_`arch` with nvcc unless a cached build exists; load it.

    Raises BuildError with the compiler's message when anything fails."""
    try:
        path = cuda_library_path(source, arch)
    except OSError as err:
        raise BuildError(f"could not build or load {source.name}: {err}") from err
    return _build_and_load(path, [nvcc(), *cuda_compile_flags(arch), str(source)], source)
