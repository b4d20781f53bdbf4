"""Loom's C++ kernels (blocks.cpp: the block products; step.cpp: decode attention and the fused
operations; vec.h), built at first use on the machine that runs them.

torch's extension builder compiles them with the C++ compiler (`$CXX`, else `c++`: g++, for
`-fopenmp` to share torch's OpenMP runtime) and ninja into torch's extension cache
(`TORCH_EXTENSIONS_DIR`, else ~/.cache/torch_extensions), keyed by the source: the first use on
a machine takes about 15 s on 2 cores, later ones load the library. They need AVX2, which every
CPU this project runs on has. Building here rather than shipping a binary keeps one source for
every CPU and leaves no compiled artefact in the repository.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path

import torch

SOURCES = [Path(__file__).with_name(name) for name in ("blocks.cpp", "step.cpp")]
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off"]


def unavailable() -> str | None:
    """Why the kernels cannot run here, or None when they can."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"they need a CPU with AVX2; this one offers {capability}"
    scripts = Path(sys.executable).parent  # pip's ninja, in an environment not on PATH
    if shutil.which("ninja") is None and (scripts / "ninja").exists():
        os.environ["PATH"] = f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}"
    compiler = os.environ.get("CXX", "c++")  # what torch's builder runs
    missing = [tool for tool in (compiler, "ninja") if shutil.which(tool) is None]
    if missing:
        return f"building them needs {' and '.join(missing)} on PATH"
    return None


@functools.cache
def load() -> None:
    """Build (once per machine) and load the kernels: `torch.ops.loom.*`."""
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(f"Loom's CPU kernels cannot run here: {reason}")
    from torch.utils import cpp_extension

    cpp_extension.load(
        name="loom_kernels",
        sources=[str(path) for path in SOURCES],
        extra_cflags=FLAGS,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
    )
