"""kvserve's own CPU kernels (``kernels.cpp``): build, load, and a thin ctypes wrapper.

The library is plain C++ (no torch headers, so it compiles in seconds). One source is compiled
once per ISA family and linked into one library with a dispatcher:

    portable   plain C++, any CPU
    avx2       AVX2 + FMA + F16C (Zen 3 and the like)
    avx512     AVX-512 F/BW/VL + VNNI (Zen 4, Zen 5): vpdpbusd on ymm, 32 registers

The family is chosen at load from cpuid: the best the CPU has, or ``KVSERVE_ISA``
(``auto``, ``avx512``, ``avx2``, ``portable``; a family the CPU lacks falls back to the best
one below it, with a warning). ``use_isa`` switches at run time (how the tests cover every
family the machine has). ``make install`` builds it once (``python -m model_runner.kernels``);
a process that finds it missing or stale (the file name carries a hash of the source and
flags) builds it on first use. Without a working compiler ``load()`` returns None,
``unavailable_reason()`` says why, and the model runs fp32 weights.

Calls take raw pointers from contiguous tensors; the caller (``model_runner.quant``) checks
shapes, so this module only converts arguments.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.cpp")  # includes the headers beside it
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-fopenmp", "-fno-math-errno", "-ffp-contract=off")
# Per ISA family: the -m flags its object is compiled with (the dispatcher gets none).
VARIANT_FLAGS: dict[str, tuple[str, ...]] = {
    "portable": (),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx512": (
        "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
        "-mavx512vnni", "-mprefer-vector-width=512",
    ),
}  # fmt: skip
ISAS = ("portable", "avx2", "avx512")  # index = the library's ISA code

# Weight formats: the library's codes (kernels.cpp ``kv::Format``).
FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
FORMAT_CODES = {name: i for i, name in enumerate(FORMATS)}
EPI_NONE = 0
EPI_ADD = 1
EPI_SILU_MUL = 2
MAX_PARTS = 4

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None
_loaded = False
_isa = "portable"

_P = ctypes.c_void_p
_I = ctypes.c_int
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32

KV_F32 = 0
KV_F16 = 1
KV_I8 = 2


def _x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def variants() -> tuple[str, ...]:
    """The ISA families compiled into the library on this machine's architecture."""
    return ISAS if _x86() else ("portable",)


class QPart(ctypes.Structure):
    """Rows of a weight in one format (``model_runner.quant.QuantWeight``'s records)."""

    _fields_ = [("fmt", _I32), ("rows", _I32), ("rec", _P)]


class QW(ctypes.Structure):
    """A weight: up to ``MAX_PARTS`` parts stacked by rows (``quant.QuantWeight`` /
    ``quant.QuantStack``)."""

    _fields_ = [
        ("nparts", _I32),
        ("n", _I32),
        ("k", _I32),
        ("pad", _I32),
        ("parts", QPart * MAX_PARTS),
    ]


class StepLayer(ctypes.Structure):
    """One layer's weights and KV pool slice for ``kv_step_layers``."""

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


class LoraPair(ctypes.Structure):
    """One adapter's pair for one target of one layer (``kernels/lora.h``): fp16 ``a``
    ``[rank, k]`` and ``bt`` ``[rank, n]``; ``a`` NULL where the adapter leaves it."""

    _fields_ = [("a", _P), ("bt", _P), ("rank", _I32), ("pad", _I32)]


class LoraRows(ctypes.Structure):
    """A step's adapters: each row's slot (-1: the base) and scale, and per slot its
    ``[num_layers * 7]`` pairs (``model_runner.lora.native``)."""

    _fields_ = [
        ("row_slot", _P),
        ("row_scale", _P),
        ("slots", ctypes.POINTER(ctypes.POINTER(LoraPair))),
        ("num_slots", _I32),
        ("max_rank", _I32),
    ]


class StepRows(ctypes.Structure):
    """One step's rows for ``kv_step_layers``."""

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
        ("residual", _I32),
        ("lora", ctypes.POINTER(LoraRows)),
    ]


def _library_name() -> str:
    flags = " ".join(FLAGS) + repr(sorted(VARIANT_FLAGS.items())) + repr(variants())
    sources = b"".join(p.read_bytes() for p in _sources())
    digest = hashlib.sha256(sources + flags.encode()).hexdigest()[:12]
    return f"libkvserve_kernels-{digest}.so"


def _sources() -> list[Path]:
    """kernels.cpp and the headers it includes (all of them name the library)."""
    return [SOURCE, *sorted(SOURCE.parent.glob("*.h"))]


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
        try:
            _compile(compiler, tmp)
        except RuntimeError:
            os.unlink(tmp)
            raise
        os.replace(tmp, folder / name)
        return folder / name
    raise RuntimeError("no writable build folder: " + "; ".join(errors))


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"`{' '.join(cmd)}` failed: " + " | ".join(tail))


def _compile(compiler: str, output: str) -> None:
    """One object per ISA family and one for the dispatcher, linked into ``output``."""
    with tempfile.TemporaryDirectory() as scratch:
        objects = []
        for variant in (*variants(), None):
            obj = str(Path(scratch) / f"{variant or 'dispatch'}.o")
            defines = [f"-DKV_VARIANT={variant}", *VARIANT_FLAGS[variant]] if variant else []
            _run([compiler, *FLAGS, *defines, "-c", str(SOURCE), "-o", obj])
            objects.append(obj)
        _run([compiler, "-shared", "-fopenmp", *objects, "-o", output])


def load() -> ctypes.CDLL | None:
    """The kernels, built if needed; None (once logged) when they cannot be had.

    ``KVSERVE_KERNELS=0`` disables them; ``KVSERVE_ISA`` picks the ISA family (see above)."""
    global _lib, _reason, _loaded
    with _lock:
        if _loaded:
            return _lib
        _loaded = True
        mode = os.environ.get("KVSERVE_KERNELS", "auto").lower()
        if mode in ("0", "off", "false", "no"):
            _reason = "disabled by KVSERVE_KERNELS"
            return None
        wanted = os.environ.get("KVSERVE_ISA", "auto").lower()
        if mode == "portable":  # the older spelling of KVSERVE_ISA=portable
            wanted = "portable"
        if wanted not in ("auto", *ISAS):
            _reason = f"KVSERVE_ISA={wanted!r}: use auto, {', '.join(reversed(ISAS))}"
            logger.warning("quantized CPU kernels unusable (%s): fp32 weights instead", _reason)
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
        lib.kv_isa_supported.argtypes = [_I]
        lib.kv_isa_supported.restype = _I
        lib.kv_set_isa.argtypes = [_I]
        lib.kv_set_isa.restype = _I
        lib.kv_omp_max_threads.restype = _I
        lib.kv_stream_read.argtypes = [_P, _I64, _I]
        lib.kv_stream_read.restype = ctypes.c_uint64
        lib.kv_weight_rows.argtypes = [ctypes.POINTER(QW)]
        lib.kv_weight_rows.restype = _I64
        lib.kv_qgemm.argtypes = [_P, _P, _I, _I, _P, _I, _P, _P, _I, _I, _I, _I]
        lib.kv_qgemm.restype = None
        lib.kv_dequant.argtypes = [_P, _P, _I64, _I, _P, _I, _I]
        lib.kv_dequant.restype = None
        lib.kv_step_layers.argtypes = [ctypes.POINTER(StepLayer), _I, ctypes.POINTER(StepRows)]
        lib.kv_step_layers.restype = None
        lib.kv_decode_struct_sizes.argtypes = [_I]
        lib.kv_decode_struct_sizes.restype = _I
        sizes = [lib.kv_decode_struct_sizes(i) for i in range(6)]
        structs = (QW, StepLayer, StepRows, QPart, LoraPair, LoraRows)
        if sizes != [ctypes.sizeof(t) for t in structs]:
            _reason = f"kernel struct sizes {sizes} differ from the Python side's"
            logger.warning("quantized CPU kernels unusable (%s): fp32 weights instead", _reason)
            return None
        _lib = lib
        best = _set_isa(lib, "avx512" if wanted == "auto" else wanted)
        if wanted not in ("auto", best):
            logger.warning("KVSERVE_ISA=%s: this CPU lacks it; the kernels run %s", wanted, best)
        return _lib


def _set_isa(lib: ctypes.CDLL, name: str) -> str:
    global _isa
    _isa = ISAS[lib.kv_set_isa(ISAS.index(name))]
    return _isa


def supported_isas() -> list[str]:
    """The ISA families this CPU can run, best first (what the tests iterate over)."""
    lib = load()
    if lib is None:
        return []
    return [name for name in reversed(variants()) if lib.kv_isa_supported(ISAS.index(name))]


def use_isa(name: str) -> str:
    """Switch the kernels to ISA family ``name`` (or the best one below it the CPU has);
    returns the family now in use."""
    if name not in ISAS:
        raise ValueError(f"unknown ISA family {name!r}: use one of {', '.join(ISAS)}")
    lib = load()
    if lib is None:
        raise RuntimeError(f"kernels unavailable: {unavailable_reason()}")
    return _set_isa(lib, name)


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str | None:
    load()
    return _reason


def isa() -> str:
    """The ISA family the kernels run (``"avx512"``, ``"avx2"`` or ``"portable"``)."""
    load()
    return _isa


def main() -> int:
    """``python -m model_runner.kernels``: build at install time and report."""
    try:
        path = build()
    except RuntimeError as e:
        print(f"kvserve kernels not built ({e}); the server will run fp32 weights", file=sys.stderr)
        return 0
    print(f"kvserve kernels: {path} ({isa()})")
    return 0
