"""Loom's C++ kernels (blocks.cpp: the block products; step.cpp: decode attention and the fused
operations; layers.cpp: a q4 decode step's layers in one call, in one parallel region; ops.h,
region.h, vec.h), built at first use on the machine that runs them.

torch's extension builder compiles them with the C++ compiler (`$CXX`, else `c++`: g++, for
`-fopenmp` to share torch's OpenMP runtime) and ninja into torch's extension cache
(`TORCH_EXTENSIONS_DIR`, else ~/.cache/torch_extensions), in a folder named by the digest of
what they are built from (`library_path`): the first use on a machine takes about 15 s on 2
cores; later ones load the library as it is, with no compiler or ninja needed. They need AVX2,
which every CPU this project runs on has. Building here rather than shipping a binary keeps one
source for every CPU and leaves no compiled artefact in the repository.

Where the CPU has AVX-512 VNNI (Zen 4, recent Xeons), the block products use its int8 and int16
dot products (`vpdpbusd`, `vpdpwssd`), two groups of 8 outputs in one 512-bit register; elsewhere
AVX2's multiply-adds. The library is named by that choice, so that a cache built on one CPU
(the image bakes one) is never loaded on a CPU without the instructions. `LOOM_KERNELS=avx2`
builds the AVX2 products on any CPU (the tests check both where they can).
`python -m loom.model.kernels` builds both libraries, loading neither.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

SOURCES = [Path(__file__).with_name(name) for name in ("blocks.cpp", "step.cpp", "layers.cpp")]
HEADERS = [
    Path(__file__).with_name(name) for name in ("activations.h", "ops.h", "region.h", "vec.h")
]
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off"]
VNNI_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mprefer-vector-width=256"]


def isa() -> str:
    """The instructions the block products use: vnni where the CPU has it, else (or where
    LOOM_KERNELS=avx2) avx2."""
    if os.environ.get("LOOM_KERNELS") == "avx2":
        return "avx2"
    try:
        cpu_flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "avx2"
    return "vnni" if {"avx512bw", "avx512vl", "avx512_vnni"} <= cpu_flags else "avx2"


def flags(chosen: str) -> list[str]:
    """The compiler's flags for the products `chosen` (isa())."""
    return [*FLAGS, *(VNNI_FLAGS if chosen == "vnni" else [])]


def library_path(chosen: str) -> Path:
    """Where the library built for `chosen` from these sources is: a folder of torch's extension
    cache named by the digest of the sources, the headers, the flags and torch's version. So a
    library once built is loaded as it is, with no compiler (an image bakes it), and a changed
    source or flag builds a new one instead of loading a stale one."""
    digest = hashlib.sha256(torch.__version__.encode())
    digest.update(" ".join(flags(chosen)).encode())
    for path in [*SOURCES, *HEADERS]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    folder = f"loom_kernels_{chosen}_{digest.hexdigest()[:16]}"
    return extensions_root() / folder / f"loom_kernels_{chosen}.so"


def extensions_root() -> Path:
    """torch's extension cache; its builder (and setuptools) imported only where it is unset."""
    if root := os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(root)
    from torch.utils import cpp_extension

    return Path(cpp_extension.get_default_build_root())


def built(path: Path) -> bool:
    """Whether the library at `path` is whole: there, and no build holding its folder's lock."""
    return path.exists() and not (path.parent / "lock").exists()


def unbuildable() -> str | None:
    """Why the kernels cannot be built here (no compiler or no ninja), or None."""
    scripts = Path(sys.executable).parent  # pip's ninja, in an environment not on PATH
    if shutil.which("ninja") is None and (scripts / "ninja").exists():
        os.environ["PATH"] = f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}"
    compiler = os.environ.get("CXX", "c++")  # what torch's builder runs
    missing = [tool for tool in (compiler, "ninja") if shutil.which(tool) is None]
    if missing:
        return f"building them needs {' and '.join(missing)} on PATH"
    return None


def choice() -> str:
    """The library to load: isa()'s, or the AVX2 one where isa()'s is neither built nor
    buildable and AVX2's is built (an image baked on a CPU without VNNI, run on one with it)."""
    preferred = isa()
    if preferred == "avx2" or built(library_path(preferred)):
        return preferred
    if built(library_path("avx2")) and unbuildable() is not None:
        return "avx2"
    return preferred


def unavailable() -> str | None:
    """Why the kernels cannot run here, or None when they can: built already, or buildable."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"they need a CPU with AVX2; this one offers {capability}"
    if built(library_path(choice())):
        return None
    return unbuildable()


@functools.cache
def load() -> None:
    """Load the kernels, `torch.ops.loom.*`, building them first where they are not built."""
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(f"Loom's CPU kernels cannot run here: {reason}")
    path = library_path(choice())
    if not built(path):
        build(choice())
    torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]


ISAS = ("vnni", "avx2")


def build(chosen: str) -> Path:
    """Build the library for `chosen` (one of ISAS) into its folder, without loading it: so a
    library for instructions this CPU lacks builds as well as any (the image bakes every one,
    whatever CPU builds it). One process builds while others wait on the folder's lock, as
    torch's `cpp_extension.load` does, with the builder that `load` calls (`builder`)."""
    from torch.utils.file_baton import FileBaton

    reason = unbuildable()
    if reason is not None:
        raise RuntimeError(f"Loom's CPU kernels cannot be built here: {reason}")
    path = library_path(chosen)
    path.parent.mkdir(parents=True, exist_ok=True)
    baton = FileBaton(str(path.parent / "lock"))
    if not baton.try_acquire():
        baton.wait()
        return path
    try:
        if not path.exists():
            builder()(**builder_arguments(chosen, path))
    finally:
        baton.release()
    return path


def builder() -> Any:
    """torch's builder of an extension's library (what `cpp_extension.load` runs before it
    loads the library), private to torch: tests/test_pins.py checks the call's shape."""
    from torch.utils import cpp_extension

    return cpp_extension._write_ninja_file_and_build_library


def builder_arguments(chosen: str, path: Path) -> dict[str, Any]:
    """The builder's arguments for the library at `path`: those this torch's builder takes
    (2.7 added SYCL's, which Loom leaves off)."""
    arguments = {
        "name": path.stem, "sources": [str(source) for source in SOURCES],
        "extra_cflags": flags(chosen), "extra_cuda_cflags": None, "extra_sycl_cflags": None,
        "extra_ldflags": ["-fopenmp"], "extra_include_paths": None,
        "build_directory": str(path.parent), "verbose": False, "with_cuda": False,
        "with_sycl": False,
    }  # fmt: skip
    accepted = inspect.signature(builder()).parameters
    return {name: value for name, value in arguments.items() if name in accepted}
