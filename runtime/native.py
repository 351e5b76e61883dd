"""A prompt slice's attention as one MLX primitive, built from C++ on the machine that runs it
(with the decode rows' attention, the MLP's activation, the rope's rotation and RMSNorm).

On MLX's CPU a prompt slice's attention is ~15 ops per key head (two products for the scores,
their maxima, the exponentials, the sums, two products for the values: runtime/attention.py),
each dispatched on its own and each a pass over a (keys x slice) block of scores, which at a
long context outgrows the caches: a 512-token chunk at 9,000 keys writes and reads ~37 MB of
scores a head. `native_kernels.cpp` computes the same attention in one primitive, key block by
key block with a running maximum (the online softmax of FlashAttention): the scores of 64 keys
stay in registers and the first level cache, the exponential is runtime/attention.py's
polynomial (its error against float64 is held to the ops' tolerance: tests/runtime/
test_native.py), and each key's 32 products for 8 or 16 query rows at once are one vector
instruction each. One layer's attention (4 query heads, 2 key heads) at 9,000 keys: 0.37x the
ops' time for a 4-token slice, 0.31x for 16, 0.18x for 512 (the ops with the fast softmax;
`.venv/bin/python scripts/bench_attention_cpu.py --contexts 1000,5000,9000 --tokens
4,16,64,512`: 0.17-0.43x over those shapes).

The same extension holds the decode rows' attention (`rows_attention`: one query token a row,
row b attending its keys from starts[b] on, a batch cache's left padding), each key's dot
product over the head dimension 8 floats at once: a 4-row decode step's forward 0.86x the ops'
time at context 600, 0.68-0.71x at 4,000-9,000 (ADR 0015 revision 1).

And it holds the MLP's activation (`swiglu`: silu(gate) * up, as mlx-lm's llama and qwen2
compute it), whose exponentials MLX's CPU build takes one float at a time: the kernel takes 16
at once (exp by range reduction and a degree-7 polynomial; within 2e-6 of float64, MLX's own
within 3.6e-6). A 512-token chunk's forward 0.69x the time at context 1,000, 0.88x at 5,000; a
64-token slice's 0.74-0.98x; a decode step's 0.93-0.99x (ADR 0015 revision 2).

And a rope's rotation (`rotate_halves`: the pairs (x[i], x[i + D/2]) by a segment's cosines and
sines, `runtime/rope_table.py` `RopeTable`), one op where MLX's fallback is six, each product
and sum rounded alone as the fallback rounds them (the compiler may not contract them into FMAs
there), so bit for bit: a 4-row decode step's forward 0.95-0.98x, with a 1-token slice 0.88-0.97x.

And an RMSNorm in float32 (`rms_norm`), the floats MLX's fallback computes in its order (the
squares summed one at a time from 0, as MLX's CPU reduction sums them where its vectors are
one float wide, as on x86-64; the tail rounded product by product), so bit for bit: one op for
the compiled fallback's four (runtime/kernels.py), nine times a 4-layer step.

It is an MLX extension (a C++ `Primitive` whose `eval_cpu` queues the work on the stream, as
MLX's own ops do), compiled with `g++ -O3 -march=native` against the installed MLX's headers
and library and nanobind's sources (the `nanobind` package, whose version must share its
internals with the one MLX was built with: a probe call at load checks it), once per machine
into the cache directory (~10 s), named by everything it is built from (a new build deletes
the ones no process has loaded for 30 days). Where it cannot be had (no g++, a failed build, a
nanobind MLX does not share, not the CPU, $FAIRTICK_SOFTMAX=exact, or
$FAIRTICK_ATTENTION_KERNEL=off), `reason()` says why and attention, the activation, the
rotation and the norms run MLX's ops.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from runtime.blas import installed_mlx
from runtime.cachedir import default_cache_dir

KERNEL_ENV = "FAIRTICK_ATTENTION_KERNEL"
KERNEL_SETTINGS = ("auto", "off")
SOURCE = Path(__file__).with_name("native_kernels.cpp")
MODULE = "_fairtick_native"
# MLX's Python module registers its array type in nanobind's domain "mlx"; an extension that
# takes MLX arrays must share it.
_NB_DOMAIN = "mlx"
_FLAGS = ["-O3", "-march=native", "-std=c++20", "-fPIC", "-shared", "-fvisibility=hidden",
          "-DNDEBUG", f"-DNB_DOMAIN={_NB_DOMAIN}"]

_BUILD_PREFIX = "native-kernels-"
# Builds named before the source held more than a slice's attention: pruned alike.
_OLD_BUILD_PREFIXES = ("slice-attention-",)
_UNUSED_BUILD_S = 30 * 24 * 3600.0  # a build no process loaded for this long is deleted

_lock = threading.Lock()
_state: dict[str, Any] = {}  # "module" or "reason", once tried


def setting() -> str:
    """$FAIRTICK_ATTENTION_KERNEL: `auto` (default) or `off`; ValueError otherwise."""
    value = os.environ.get(KERNEL_ENV, "auto")
    if value not in KERNEL_SETTINGS:
        raise ValueError(f"${KERNEL_ENV}={value!r}: expected one of {KERNEL_SETTINGS}")
    return value


def slice_attention() -> Any | None:
    """The kernel (`f(queries, keys, values, length)`), built and loaded on first call; None
    where it cannot be had (`reason()` says why)."""
    return _kernel("slice_attention")


def rows_attention() -> Any | None:
    """The decode rows' kernel (`f(queries, keys, values, starts)`: one query token a row,
    row b attending its keys from starts[b] on), where the slice kernel is had; else None."""
    return _kernel("rows_attention")


def swiglu() -> Any | None:
    """The MLP's activation (`f(gate, up)`: silu(gate) * up, float32), where the slice kernel
    is had; else None."""
    return _kernel("swiglu")


def rotate_halves() -> Any | None:
    """A rope's rotation of the pairs (x[i], x[i + D/2]) (`f(x, cos, sin)`, float32, bit for
    bit as MLX's fallback rotates them), where the slice kernel is had; else None."""
    return _kernel("rotate_halves")


def rms_norm() -> Any | None:
    """An RMSNorm (`f(x, weight, eps)`, float32, bit for bit as MLX's fallback computes it),
    where the slice kernel is had; else None."""
    return _kernel("rms_norm")


def _kernel(name: str) -> Any | None:
    # The extension's function `name`; None where the extension cannot be had.
    module = _module()
    return None if module is None else getattr(module, name)


def _module() -> ModuleType | None:
    # The extension, built and loaded on first call; None where it cannot be had.
    if "module" not in _state and "reason" not in _state:
        with _lock:
            if "module" not in _state and "reason" not in _state:
                _try_load()
    return _state.get("module")


def reason() -> str | None:
    """Why the kernel is not used (None: it is); builds it first if not yet tried."""
    slice_attention()
    return _state.get("reason")


def _try_load() -> None:
    try:
        _state["module"] = _load()
    except _Unavailable as exc:
        _state["reason"] = str(exc)


class _Unavailable(Exception):
    pass


def _load() -> ModuleType:
    import mlx.core as mx

    from runtime import attention

    if setting() == "off":
        raise _Unavailable(f"${KERNEL_ENV}=off")
    if not attention.FAST_SOFTMAX:
        raise _Unavailable(f"MLX's softmax runs ({attention.fast_softmax_reason()})")
    if mx.default_device() != mx.cpu:
        raise _Unavailable("not on the CPU")
    module = _import(_built())
    _probe(module)
    return module


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, path, loader=loader)
    if spec is None:
        raise _Unavailable(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(module)
    except ImportError as exc:
        raise _Unavailable(f"loading {path.name} failed: {exc}") from exc
    return module


def _probe(module: ModuleType) -> None:
    # One call on MLX arrays: a nanobind that does not share MLX's internals refuses the type.
    import mlx.core as mx

    q, k = mx.ones((1, 1, 2, 4)), mx.ones((1, 1, 3, 4))
    try:
        out = module.slice_attention(q, k, k, 2)
        mx.eval(out)
    except TypeError as exc:
        raise _Unavailable("the kernel's nanobind does not share MLX's (an MLX array is "
                           f"not taken): {exc}") from exc
    if not mx.allclose(out, mx.ones_like(out)).item():
        raise _Unavailable("the kernel's probe computed a wrong result")


def _built() -> Path:
    """The built extension in the cache, building it if missing."""
    import nanobind

    mlx_dir = installed_mlx()
    if isinstance(mlx_dir, str):
        raise _Unavailable(mlx_dir)
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None:
        raise _Unavailable("no C++ compiler (`g++`, or $CXX) to build it")
    key = "\n".join([SOURCE.read_text(), str(mlx_dir), _version("mlx"), nanobind.__version__,
                     suffix, cxx, " ".join(_FLAGS), platform.machine(), _cpu_flags()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    path = default_cache_dir() / f"{_BUILD_PREFIX}{digest}{suffix}"
    if path.is_file():
        with contextlib.suppress(OSError):
            os.utime(path)  # in use: kept by `_prune_builds`
        return path
    source_dir = Path(nanobind.source_dir())
    includes = [mlx_dir / "include", Path(nanobind.include_dir()),
                source_dir.parent / "ext" / "robin_map" / "include",
                Path(sysconfig.get_paths()["include"])]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".tmp-kernel-") as tmp:
            built = Path(tmp) / path.name
            cmd = [cxx, *_FLAGS, *(f"-I{p}" for p in includes), str(SOURCE),
                   str(source_dir / "nb_combined.cpp"), "-o", str(built),
                   f"-L{mlx_dir / 'lib'}", "-lmlx", f"-Wl,-rpath,{mlx_dir / 'lib'}"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                tail = "\n".join(done.stderr.strip().splitlines()[-5:])
                raise _Unavailable(f"building {SOURCE.name} failed: {tail}")
            os.replace(built, path)
    except OSError as exc:
        raise _Unavailable(f"building {SOURCE.name} failed: {exc}") from exc
    _prune_builds(path)
    return path


def _prune_builds(kept: Path, unused_s: float = _UNUSED_BUILD_S) -> None:
    """Delete the builds beside `kept` that no process has loaded for `unused_s` (each source,
    MLX, nanobind or compiler change makes a new one; a cache shared by several checkouts or
    CPUs keeps each one's in use)."""
    now = time.time()
    for prefix in (_BUILD_PREFIX, *_OLD_BUILD_PREFIXES):
        for old in kept.parent.glob(f"{prefix}*{kept.suffix}"):
            with contextlib.suppress(OSError):
                if old != kept and now - old.stat().st_mtime > unused_s:
                    old.unlink()


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def _cpu_flags() -> str:
    # -march=native: a cache shared by machines of other CPUs keeps one build per CPU.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or sys.platform
