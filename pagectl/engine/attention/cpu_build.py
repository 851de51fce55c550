"""Builds the C++ CPU kernels (``csrc/paged_attention_cpu.cpp``, the paged decode attention;
``csrc/skinny_linear_cpu.cpp``, the few-row matmul; ``csrc/packed_linear_cpu.cpp``, the
matmul over a packed weight on AVX-512 CPUs;
``csrc/decode_ops_cpu.cpp``, a layer's fused elementwise ops; ``csrc/decode_layers_cpu.cpp``,
a decode step's layers chained in one op) once, into one library, and loads it.

The source is compiled with the machine's C++ compiler against the running torch (its
headers and libraries; no Python headers, no ninja) into a shared library that registers
``torch.ops.pagectl_cpu``. The library is cached on disk under a key hashing everything the
binary depends on: the source, the compiler and its flags, torch's version and ABI, the
Python tag and the CPU's instruction set, so a changed source or a different torch builds
a new one and never loads a stale one.

Cache directory: ``$PAGECTL_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/pagectl/kernels``, else
``~/.cache/pagectl/kernels``.

Several processes may start at once (tensor-parallel ranks, test workers): the build runs
under an exclusive ``fcntl`` lock on ``<key>.lock``, and each process re-checks for the
library once it holds the lock, so exactly one compiles. The compiler writes to a private
temporary name that is renamed into place, so a library is either complete or absent; a
process killed mid-build leaves its lock released by the OS and no partial library.

Failure is never fatal: without a compiler, when compiling fails or takes longer than
``BUILD_TIMEOUT_S``, or when the library does not load, ``load_cpu_ops()`` returns None
(``failure_reason()`` says why; the backend selection logs it once). A compile error is also recorded beside the
cache (``<key>.failed``) so later processes do not spend the compile time again; delete the
file to retry.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention_cpu.cpp"
# Every source compiled into the library: the attention kernel, the skinny matmul, the
# fused elementwise ops and the chained decode layers; and the headers they include (part
# of the cache key).
SOURCES = (
    SOURCE,
    SOURCE.parent / "skinny_linear_cpu.cpp",
    SOURCE.parent / "packed_linear_cpu.cpp",
    SOURCE.parent / "decode_ops_cpu.cpp",
    SOURCE.parent / "decode_layers_cpu.cpp",
    SOURCE.parent / "prefill_attention_cpu.cpp",
)
HEADERS = (SOURCE.parent / "cpu_vec_math.h", SOURCE.parent / "cpu_kernels.h")
LIBRARY_NAME = "pagectl_cpu_attention"
# A build that takes longer is abandoned (the torch backend is used instead). The four
# sources take about 50 s on an idle 2-core machine; under load, several times that.
BUILD_TIMEOUT_S = 300.0

# Instruction-set flags per CPU capability torch detected (x86-64 only). The binary is
# cached per capability, so it never runs on a CPU that lacks what it was built for.
_ISA_FLAGS = {
    "AVX512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}

_lock = threading.Lock()
# None: not tried yet in this process; then the loaded ops namespace, or False on failure.
_state: Any = None
# Why the last attempt failed (for error messages of an explicit backend choice).
_failure: str | None = None


class KernelBuildError(RuntimeError):
    """The kernel could not be built or loaded (the message says why)."""


def cache_root() -> Path:
    env = os.environ.get("PAGECTL_KERNEL_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "pagectl" / "kernels"


def find_compiler() -> str | None:
    """``$CXX`` if set, else the first of g++, c++, clang++ on PATH."""
    env = os.environ.get("CXX")
    if env:
        return shutil.which(env) or env
    for name in ("g++", "c++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def isa_flags() -> list[str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    capability = torch.backends.cpu.get_cpu_capability()
    flags = list(_ISA_FLAGS.get(capability, []))
    if capability == "AVX512" and _cpu_probe("_is_avx512_bf16_supported"):
        flags.append("-mavx512bf16")  # packed_linear_cpu.cpp's bfloat16 dot products
    return flags


def has_bf16_instructions() -> bool:
    """Whether this CPU multiplies bfloat16 natively: AVX512-BF16 (``vdpbf16ps``) or AMX
    tiles, as torch detects them (cpuinfo). On such a CPU the project's bfloat16 matmul
    takes bfloat16 dot products and ``--dtype auto`` picks bfloat16 for a half-precision
    checkpoint (``loader.resolve_dtype``)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return _cpu_probe("_is_avx512_bf16_supported") or _cpu_probe("_is_amx_tile_supported")


def _cpu_probe(name: str) -> bool:
    """torch.cpu's ``name()`` (a cpuinfo feature test); False where torch lacks it."""
    fn = getattr(torch.cpu, name, None)
    try:
        return bool(fn()) if fn is not None else False
    except RuntimeError:  # cpuinfo could not read the CPU
        return False


def compile_command(compiler: str, output: Path) -> list[str]:
    """The compiler invocation that builds ``output`` from ``SOURCES``."""
    torch_dir = Path(torch.__file__).resolve().parent
    lib_dir = torch_dir / "lib"
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return [
        compiler,
        "-O3",
        "-std=c++20",
        "-shared",
        "-fPIC",
        "-fopenmp",
        "-DNDEBUG",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *isa_flags(),
        "-I",
        str(torch_dir / "include"),
        *(str(src) for src in SOURCES),
        "-o",
        str(output),
        f"-L{lib_dir}",
        f"-Wl,-rpath,{lib_dir}",
        "-lc10",
        "-ltorch_cpu",
    ]


def build_key(compiler: str) -> str:
    """A hash of everything the built library depends on."""
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        h.update(src.read_bytes())
    for part in (
        " ".join(compile_command(compiler, Path("out"))),
        _compiler_version(compiler),
        torch.__version__,
        sys.implementation.cache_tag or "",
        platform.machine(),
        torch.backends.cpu.get_cpu_capability(),
    ):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:20]


def _compiler_version(compiler: str) -> str:
    try:
        out = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.splitlines()[0] if out.stdout else "unknown"


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def build_library(timeout_s: float = BUILD_TIMEOUT_S) -> Path:
    """The path of the built library, compiling it first if this machine has none yet.

    Raises ``KernelBuildError`` with the reason when it cannot be built.
    """
    compiler = find_compiler()
    if compiler is None:
        raise KernelBuildError("no C++ compiler found (set CXX, or install g++)")
    for src in (*SOURCES, *HEADERS):
        if not src.is_file():
            raise KernelBuildError(f"kernel source {src} is missing from the installation")
    root = cache_root()
    key = build_key(compiler)
    lib = root / key / f"{LIBRARY_NAME}.so"
    failed = root / f"{key}.failed"
    if lib.is_file():
        return lib
    with _exclusive(root / f"{key}.lock"):
        if lib.is_file():  # another process built it while this one waited
            return lib
        if failed.is_file():
            raise KernelBuildError(f"an earlier build failed (see {failed}; delete it to retry)")
        lib.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_name(f".{LIBRARY_NAME}.{os.getpid()}.tmp.so")
        cmd = compile_command(compiler, tmp)
        log.info("compiling the CPU kernels (once per machine and torch) into %s", lib)
        t0 = time.monotonic()
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired as e:
            tmp.unlink(missing_ok=True)
            raise KernelBuildError(f"compiling took longer than {timeout_s:.0f} s") from e
        except OSError as e:
            raise KernelBuildError(f"cannot run {compiler}: {e}") from e
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            failed.write_text(" ".join(cmd) + "\n\n" + proc.stderr)
            first = next((ln for ln in proc.stderr.splitlines() if "error" in ln), "")
            raise KernelBuildError(f"compiling failed: {first.strip() or proc.returncode}")
        os.replace(tmp, lib)
        log.info("built the CPU kernels in %.1f s: %s", time.monotonic() - t0, lib)
    return lib


def load_cpu_ops() -> Any | None:
    """``torch.ops.pagectl_cpu`` with the kernel loaded, or None if it cannot be had.

    The first call in a process builds (or finds) and loads the library; a failure is
    remembered, so later calls return None at once.
    """
    global _state, _failure
    with _lock:
        if _state is None:
            try:
                torch.ops.load_library(str(build_library()))
                ops = torch.ops.pagectl_cpu
                ops.paged_decode  # noqa: B018 (raises if the library registered nothing)
                ops.skinny_linear  # noqa: B018
                ops.add_rms_norm_  # noqa: B018
                _state = ops
            except Exception as e:  # any failure means "use the torch backend"
                _state = False
                _failure = str(e) or type(e).__name__
        return _state or None


def failure_reason() -> str | None:
    """Why ``load_cpu_ops`` returned None in this process (None if it has not failed)."""
    return _failure
