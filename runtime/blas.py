"""Runs MLX over an optimized BLAS on Linux. Imports no MLX: it must act before MLX loads.

MLX's Linux CPU wheel links the reference (netlib) BLAS, 9-18x slower at float32 GEMM than
OpenBLAS here (ADR 0007). libmlx imports its BLAS and LAPACK functions by their standard names
(`cblas_sgemm`, `sgesdd_`, ...) and the dynamic linker looks them up in the process's global
scope before libmlx's own dependencies, so a library loaded with RTLD_GLOBAL before libmlx binds
them takes their place. The OpenBLAS we install (the `scipy-openblas32` wheel) prefixes its
names with `scipy_`; a shim of one jump per name libmlx imports, assembled once with the C
compiler and cached, gives them their standard names.

`runtime/__init__.py` calls `load_blas()`, so importing anything from `runtime` first is
enough. $FAIRTICK_BLAS (or `fairtick serve --blas`): `auto` (default: OpenBLAS when it can be
had, else the reference BLAS with the reason), `reference` (MLX's bundled BLAS, nothing
loaded), or the path of a shared library exporting the standard CBLAS names (e.g. Debian's
`/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0`).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from runtime.cachedir import default_cache_dir

BLAS_ENV = "FAIRTICK_BLAS"
SETTINGS = ("auto", "reference")
PROBE_SYMBOL = "cblas_sgemm"  # what MLX's float32 matmul calls
THREADS_ENV = "OPENBLAS_NUM_THREADS"
# Unless $OPENBLAS_NUM_THREADS says otherwise. On 2 shared cores, OpenBLAS's second thread
# waits for a core the engine and HTTP threads also need: forwards measured up to 30x slower
# with 2 threads than with 1, never faster (docs/benchmark_results/2026-11-30-blas.md).
DEFAULT_THREADS = 1
_PREFIX = "scipy_"
# One jump per forwarded name: the callee sees the caller's registers and stack unchanged.
_JUMPS = {"x86_64": "{name}: jmp {target}@PLT", "aarch64": "{name}: b {target}"}


@dataclass(frozen=True)
class BlasInfo:
    """Which BLAS MLX's calls bind to; `library` None: MLX's own (on Linux the reference one)."""

    setting: str  # what was asked for: 'auto', 'reference' or a path
    library: Path | None
    config: str  # the library's own description (OpenBLAS: version, kernels, threads)
    reason: str  # why this one: the setting, or why the optimized one could not be had
    unavailable: bool = False  # 'auto' found no way to the optimized BLAS on this machine
    # The file loaded in front of MLX's BLAS: LD_PRELOAD it to give another MLX program the same.
    preload: Path | None = None

    @property
    def optimized(self) -> bool:
        return self.library is not None

    def describe(self) -> str:
        """One line for a start-up message."""
        if self.library is None:
            return f"MLX's own BLAS ({self.reason})"
        return f"{self.config} ({self.library}; {self.reason})"


class BlasUnavailable(Exception):
    """The optimized BLAS cannot be had here; the message says why."""


def parse_setting(text: str) -> str:
    """A validated $FAIRTICK_BLAS / --blas value; ValueError names the allowed values."""
    if text in SETTINGS or Path(text).is_file():
        return text
    raise ValueError(f"{BLAS_ENV} (--blas) must be 'auto', 'reference' or the path of a shared "
                     f"library exporting the CBLAS names ({PROBE_SYMBOL}), got {text!r}")


_active: BlasInfo | None = None


def load_blas() -> BlasInfo:
    """Load the BLAS that $FAIRTICK_BLAS names (default 'auto') into the process's global
    scope, once per process; later calls return the first answer. ValueError for a bad value."""
    global _active
    if _active is None:
        _active = _load(parse_setting(os.environ.get(BLAS_ENV) or "auto"))
    return _active


def _load(setting: str) -> BlasInfo:
    if sys.platform != "linux":
        return BlasInfo(setting, None, "", "not Linux: MLX links the platform's BLAS")
    if setting == "reference":
        return BlasInfo(setting, None, "", f"the bundled reference BLAS: {BLAS_ENV}=reference")
    if "mlx.core" in sys.modules:
        # libmlx's lookup scope was fixed when it was loaded: a later library is never seen.
        return BlasInfo(setting, None, "", "the bundled reference BLAS: mlx was imported "
                        "before runtime; import runtime first")
    try:
        library, preload, handle, config = _open_auto() if setting == "auto" else _open(setting)
    except BlasUnavailable as exc:
        return BlasInfo(setting, None, "", f"the bundled reference BLAS: {exc}", True)
    reason = "default" if setting == "auto" else f"{BLAS_ENV}={setting}"
    # What the dynamic linker now finds first under the standard name is what libmlx binds.
    found = ctypes.cast(getattr(ctypes.CDLL(None), PROBE_SYMBOL), ctypes.c_void_p).value
    if found != ctypes.cast(getattr(handle, PROBE_SYMBOL), ctypes.c_void_p).value:
        return BlasInfo(setting, None, "", f"another library's {PROBE_SYMBOL} is found first")
    return BlasInfo(setting, library, config, reason, preload=preload)


def _open_auto() -> tuple[Path, Path, ctypes.CDLL, str]:
    """(library, shim, the shim's handle, config) of the wheel's OpenBLAS, loaded globally."""
    try:
        library = _scipy_openblas_path()
        shim = _shim_for(library)
        handle = ctypes.CDLL(str(shim), mode=ctypes.RTLD_GLOBAL)
        return library, shim, handle, _config(ctypes.CDLL(str(library)), _PREFIX)
    except (OSError, subprocess.SubprocessError) as exc:  # e.g. an unwritable cache
        raise BlasUnavailable(f"{type(exc).__name__}: {exc}") from exc


def _open(setting: str) -> tuple[Path, Path, ctypes.CDLL, str]:
    """The same for a library named by path; ValueError if it is no CBLAS library."""
    try:
        handle = ctypes.CDLL(setting, mode=ctypes.RTLD_GLOBAL)
        getattr(handle, PROBE_SYMBOL)
    except (OSError, AttributeError) as exc:
        raise ValueError(f"{BLAS_ENV}: {setting} is not a loadable library exporting "
                         f"{PROBE_SYMBOL}: {exc}") from exc
    return Path(setting), Path(setting), handle, _config(handle, "")


def _config(lib: ctypes.CDLL, prefix: str) -> str:
    """OpenBLAS's own description (version, kernels) and its thread count, which is set to
    DEFAULT_THREADS unless $OPENBLAS_NUM_THREADS is set."""
    get_config = getattr(lib, f"{prefix}openblas_get_config", None)
    if get_config is None:
        return "BLAS"
    if not os.environ.get(THREADS_ENV):
        getattr(lib, f"{prefix}openblas_set_num_threads")(DEFAULT_THREADS)
    get_config.restype = ctypes.c_char_p
    threads = getattr(lib, f"{prefix}openblas_get_num_threads")()
    return f"{get_config().decode()}, {threads} thread{'s' if threads != 1 else ''}"


def _scipy_openblas_path() -> Path:
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or spec.origin is None:
        raise BlasUnavailable("the scipy-openblas32 package is not installed")
    found = sorted((Path(spec.origin).parent / "lib").glob("libscipy_openblas*.so"))
    if not found:
        raise BlasUnavailable(f"no libscipy_openblas*.so in {Path(spec.origin).parent / 'lib'}")
    return found[0]


def installed_mlx() -> Path | str:
    """The directory of the installed MLX package (its lib/libmlx.so, include/), found without
    importing MLX; else why not. `mlx` is a namespace package: any directory named mlx on
    sys.path before the installed one (a checkout of MLX's sources in the working directory)
    is a part of it too, so it is the first part that holds the library."""
    spec = importlib.util.find_spec("mlx")
    if spec is None or not spec.submodule_search_locations:
        return "mlx is not installed"
    parts = [Path(p) for p in spec.submodule_search_locations]
    for part in parts:
        if (part / "lib" / "libmlx.so").is_file():
            return part
    return f"lib/libmlx.so not found in {', '.join(str(p) for p in parts)}"


def _mlx_library() -> Path:
    found = installed_mlx()
    if isinstance(found, str):
        raise BlasUnavailable(found)
    return found / "lib" / "libmlx.so"


def _dynamic_symbols(path: Path, undefined: bool) -> set[str]:
    nm = shutil.which("nm")
    if nm is None:
        raise BlasUnavailable("`nm` (binutils) is not installed")
    flag = "--undefined-only" if undefined else "--defined-only"
    out = subprocess.run([nm, "-D", flag, str(path)], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}


def _shim_source(lib: Path) -> str:
    """Assembly for one jump per BLAS/LAPACK name libmlx imports and OpenBLAS exports."""
    jump = _JUMPS.get(platform.machine())
    if jump is None:
        raise BlasUnavailable(f"no shim for the {platform.machine()} architecture")
    exported = _dynamic_symbols(lib, undefined=False)
    names = sorted(n for n in _dynamic_symbols(_mlx_library(), undefined=True)
                   if _PREFIX + n in exported)
    if PROBE_SYMBOL not in names:
        raise BlasUnavailable(f"libmlx does not import {PROBE_SYMBOL} from {lib.name}")
    lines = [".text"]
    for name in names:
        lines += [f".globl {name}", f".type {name}, %function",
                  jump.format(name=name, target=_PREFIX + name)]
    return "\n".join([*lines, '.section .note.GNU-stack,"",%progbits', ""])


def _shim_for(lib: Path) -> Path:
    """The shim library for `lib`, built once into the cache: named by what it is built from
    (both libraries' identities, this module's source), written atomically."""
    inputs = [lib, _mlx_library()]
    key = "\n".join(f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in inputs)
    key += f"\n{platform.machine()}\n{hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}"
    path = default_cache_dir() / f"blas-shim-{hashlib.sha256(key.encode()).hexdigest()[:12]}.so"
    if path.is_file():
        return path
    source = _shim_source(lib)
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise BlasUnavailable("no C compiler (`cc`) to assemble the CBLAS shim")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".tmp-blas-") as tmp:
        (Path(tmp) / "shim.S").write_text(source)
        built = Path(tmp) / "shim.so"
        cmd = [cc, "-shared", "-o", str(built), str(Path(tmp) / "shim.S"),
               f"-L{lib.parent}", f"-l:{lib.name}", f"-Wl,-rpath,{lib.parent}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise BlasUnavailable(f"building the CBLAS shim failed: {done.stderr.strip()}")
        os.replace(built, path)
    return path
