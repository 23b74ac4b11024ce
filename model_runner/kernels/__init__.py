"""kvserve's own CPU kernels (``kernels.cpp``): build, load, and a thin ctypes wrapper.

The library is plain C++ (no torch headers, so it compiles in seconds) with AVX2/FMA/F16C code
chosen at run time and a portable fallback. ``make install`` builds it once
(``python -m model_runner.kernels``); a process that finds it missing or stale (the file name
carries a hash of the source and flags) builds it on first use. Without a working compiler
``load()`` returns None, ``unavailable_reason()`` says why, and the model runs fp32 weights.

Calls take raw pointers from contiguous fp32 tensors; the caller (``model_runner.quant``)
checks shapes, so this module only converts arguments.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.cpp")
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno")

FMT_Q4 = 0
FMT_Q8 = 1
EPI_NONE = 0
EPI_ADD = 1
EPI_SILU_MUL = 2

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None
_loaded = False
_simd = False

_P = ctypes.c_void_p
_I = ctypes.c_int
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32

KV_F32 = 0
KV_F16 = 1
KV_I8 = 2


class QW(ctypes.Structure):
    """One quantized matrix (``model_runner.quant.QuantWeight``'s tensors)."""

    _fields_ = [("fmt", _I32), ("n", _I32), ("k", _I32), ("pad", _I32)] + [
        (name, _P) for name in ("qs", "d", "m")
    ]


class DecodeLayer(ctypes.Structure):
    """One layer's weights and KV pool slice for ``kv_decode_layers``."""

    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        ("qkv_bias", _P),
        ("qkv", QW),
        ("o", QW),
        ("gate_up", QW),
        ("down", QW),
        ("kv", _P),
        ("kv_scales", _P),
    ]


class DecodeStep(ctypes.Structure):
    """One decode step's rows for ``kv_decode_layers``."""

    _fields_ = [
        ("hidden", _P),
        ("positions", _P),
        ("block_tables", _P),
        ("rope", _P),
        *[
            (name, _I32)
            for name in (
                "batch",
                "hidden_size",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "intermediate",
                "kv_dtype",
                "num_blocks",
                "block_size",
                "max_blocks",
                "window",
                "nthreads",
            )
        ],
        ("eps", ctypes.c_float),
        ("pad", _I32),
    ]


def _library_name() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:12]
    return f"libkvserve_kernels-{digest}.so"


def _build_dirs() -> list[Path]:
    """Where the library may live: beside the source (editable installs, ignored by git),
    then the user cache (read-only site-packages)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvserve" / "kernels"
    return [SOURCE.parent / "_build", cache]


def build(force: bool = False) -> Path:
    """Compile the library (if needed) and return its path; raises ``RuntimeError`` saying
    what failed. Safe against concurrent builds: each compiles to a temp name and renames."""
    name = _library_name()
    if not force:
        for folder in _build_dirs():
            if (folder / name).is_file():
                return folder / name
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++) on PATH")
    errors: list[str] = []
    for folder in _build_dirs():
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
        except OSError as e:
            errors.append(f"{folder}: {e}")
            continue
        cmd = [compiler, *FLAGS, str(SOURCE), "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            os.unlink(tmp)
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise RuntimeError(f"`{' '.join(cmd)}` failed: " + " | ".join(tail))
        os.replace(tmp, folder / name)
        return folder / name
    raise RuntimeError("no writable build folder: " + "; ".join(errors))


def load() -> ctypes.CDLL | None:
    """The kernels, built if needed; None (once logged) when they cannot be had.

    ``KVSERVE_KERNELS=0`` disables them; ``KVSERVE_KERNELS=portable`` keeps the library but
    not its SIMD path (how the tests cover the fallback)."""
    global _lib, _reason, _loaded, _simd
    with _lock:
        if _loaded:
            return _lib
        _loaded = True
        mode = os.environ.get("KVSERVE_KERNELS", "auto").lower()
        if mode in ("0", "off", "false", "no"):
            _reason = "disabled by KVSERVE_KERNELS"
            return None
        try:
            import torch  # noqa: F401  (torch's OpenMP runtime first: ours binds to it)

            path = build()
            lib = ctypes.CDLL(str(path))
        except (RuntimeError, OSError) as e:
            _reason = str(e)
            logger.warning(
                "quantized CPU kernels unavailable (%s): serving fp32 weights instead", e
            )
            return None
        lib.kv_init.argtypes = [_I]
        lib.kv_init.restype = _I
        lib.kv_omp_max_threads.restype = _I
        lib.kv_qgemm.argtypes = [_I, _P, _P, _P, _I, _I, _P, _I, _I, _P, _I, _P, _P, _I, _I, _I]
        lib.kv_qgemm.restype = None
        lib.kv_dequant.argtypes = [_I, _P, _P, _P, _I, _P, _I64, _I, _P, _I, _I]
        lib.kv_dequant.restype = None
        lib.kv_decode_layers.argtypes = [
            ctypes.POINTER(DecodeLayer),
            _I,
            ctypes.POINTER(DecodeStep),
        ]
        lib.kv_decode_layers.restype = None
        lib.kv_decode_struct_sizes.argtypes = [_I]
        lib.kv_decode_struct_sizes.restype = _I
        sizes = [lib.kv_decode_struct_sizes(i) for i in range(3)]
        if sizes != [ctypes.sizeof(t) for t in (QW, DecodeLayer, DecodeStep)]:
            _reason = f"kernel struct sizes {sizes} differ from the Python side's"
            logger.warning("quantized CPU kernels unusable (%s): fp32 weights instead", _reason)
            return None
        _simd = bool(lib.kv_init(0 if mode == "portable" else 1))
        _lib = lib
        return _lib


def use_simd(enabled: bool) -> bool:
    """Switch between the SIMD and the portable code path at run time (the tests cover both);
    returns whether SIMD is now in use (False where the CPU lacks AVX2 + FMA + F16C)."""
    global _simd
    lib = load()
    if lib is None:
        return False
    _simd = bool(lib.kv_init(1 if enabled else 0))
    return _simd


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str | None:
    load()
    return _reason


def isa() -> str:
    """``"avx2"`` or ``"portable"``: the code path the kernels run (after ``load()``)."""
    return "avx2" if load() is not None and _simd else "portable"


def main() -> int:
    """``python -m model_runner.kernels``: build at install time and report."""
    try:
        path = build()
    except RuntimeError as e:
        print(f"kvserve kernels not built ({e}); the server will run fp32 weights", file=sys.stderr)
        return 0
    print(f"kvserve kernels: {path} ({isa()})")
    return 0
