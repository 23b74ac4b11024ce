"""kvserve's own CPU kernels (``kernels.cpp``): load, and a thin ctypes wrapper.

The library is plain C++ (no torch headers). One source is compiled once per ISA family, each
family into its own library, plus a small dispatcher library that the callers hold and that
calls the family in use (``build.py`` compiles them):

    portable   plain C++, any CPU
    avx2       AVX2 + FMA + F16C (Zen 3 and the like): maddubs dot products on ymm
    avx512     AVX-512 F/BW/VL + VNNI (Zen 4, Zen 5): vpdpbusd on zmm (two records joined, 16
               rows a broadcast) and on ymm, 32 registers

The family is chosen at load from cpuid: the best the CPU has, or ``KVSERVE_ISA``
(``auto``, ``avx512``, ``avx2``, ``portable``; a family the CPU lacks falls back to the best
one below it, with a warning). ``use_isa`` switches at run time (how the tests cover every
family the machine has; they also run ``EMULATED`` families, the SIMD tiles over lanes in
plain C++). ``make install`` builds the dispatcher and this CPU's family
(``python -m model_runner.kernels``); a family that is missing or stale (the file names carry
a hash of the source and flags) is built the first time it is wanted. Without a working
compiler ``load()`` returns None, ``unavailable_reason()`` says why, and the model runs fp32
weights.

At load the library's own tables are checked against the Python side: its struct sizes
against the ctypes mirrors below, its format table (names, values per record, record
bytes: ``kv_format_info``) against ``interleave.GEOMETRY``, and its LoRA target table (name,
projection, output width: ``kv_lora_target``) against ``lora.targets.TARGETS``.

Calls take raw pointers from contiguous tensors; the caller (``model_runner.quant``) checks
shapes, so this module only converts arguments.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import sys
import threading

from model_runner import interleave
from model_runner.environment import switch
from model_runner.kernels import build
from model_runner.kernels import cpu_tuning as tuning_table
from model_runner.lora import targets

logger = logging.getLogger(__name__)

ISAS = ("portable", "avx2", "avx512")  # the real families, by rising code
EMULATED = tuple(name for name in build.FAMILIES if name not in ISAS)  # the tests' families
EPI_NONE = 0
EPI_ADD = 1
EPI_SILU_MUL = 2
EPI_GELU_MUL = 3
MAX_PARTS = 4

_lock = threading.RLock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None
_loaded = False
_isa = "portable"
_families: dict[str, ctypes.CDLL] = {}  # the family libraries registered with the dispatcher
_tuning: dict[str, int] = dict(tuning_table.DEFAULTS)  # applied to each family as it registers
_tuning_source = "the defaults"
_format_codes: dict[str, int] = {}  # the library's format table: name -> its code

_P = ctypes.c_void_p
_I = ctypes.c_int
_I64 = ctypes.c_int64
_I32 = ctypes.c_int32

KV_F32 = 0
KV_F16 = 1
KV_I8 = 2


class QPart(ctypes.Structure):
    """Rows of a weight in one format (``model_runner.quant.QuantWeight``'s records);
    ``panel``: records a panel where the rows are held in panels, else 0."""

    _fields_ = [("fmt", _I32), ("rows", _I32), ("rec", _P), ("panel", _I32), ("pad", _I32)]


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
        ("q_norm", _P),
        ("k_norm", _P),
        ("qkv", QW),
        ("o", QW),
        ("gate_up", QW),
        ("down", QW),
        ("kv", _P),
        ("kv_scales", _P),
        ("router", _P),  # a mixture-of-experts layer's (fp32 [E, hidden]), else NULL
        ("expert_gate_up", ctypes.POINTER(QW)),  # [E] each expert's, else NULL
        ("expert_down", ctypes.POINTER(QW)),
        ("attn_out_norm", _P),  # Gemma's sandwich norms, else NULL
        ("mlp_out_norm", _P),
        ("rope", _P),  # the layer's own RoPE table, else NULL (StepArgs.rope)
        ("window", _I32),  # 0: every position
        ("own_table", _I32),  # 1: KV in the sliding layers' pool (StepArgs.window_tables)
    ]


class LoraPair(ctypes.Structure):
    """One adapter's pair for one target of one layer (``kernels/lora.h``): fp16 ``a``
    ``[rank, k]`` and ``bt`` ``[rank, n]``; ``a`` NULL where the adapter leaves it."""

    _fields_ = [("a", _P), ("bt", _P), ("rank", _I32), ("pad", _I32)]


class LoraRows(ctypes.Structure):
    """A step's adapters: each row's slot (-1: the base) and scale, and per slot its
    ``[num_layers * len(lora.targets.TARGETS)]`` pairs (``model_runner.lora.native``)."""

    _fields_ = [
        ("row_slot", _P),
        ("row_scale", _P),
        ("slots", ctypes.POINTER(ctypes.POINTER(LoraPair))),
        ("num_slots", _I32),
        ("max_rank", _I32),
    ]


class StepArgs(ctypes.Structure):
    """One step's rows and the model's shapes, for ``kv_step_layers`` (``kernels.cpp``'s
    ``StepArgs``)."""

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
                "nthreads",
            )
        ],
        ("eps", ctypes.c_float),
        ("residual", _I32),
        ("lora", ctypes.POINTER(LoraRows)),
        ("num_experts", _I32),
        ("num_used", _I32),
        ("expert_intermediate", _I32),
        ("norm_topk", _I32),
        ("gelu", _I32),
        ("window_tables", _P),  # the sliding layers' own tables (cache_manager.hybrid)
        ("window_max_blocks", _I32),
        ("window_num_blocks", _I32),
    ]


_STRUCTS = (QW, StepLayer, StepArgs, QPart, LoraPair, LoraRows)  # kv_struct_sizes' order


def _struct_mismatch(lib: ctypes.CDLL) -> str | None:
    lib.kv_struct_sizes.argtypes = [_I]
    lib.kv_struct_sizes.restype = _I
    sizes = [lib.kv_struct_sizes(i) for i in range(len(_STRUCTS))]
    want = [ctypes.sizeof(t) for t in _STRUCTS]
    if sizes == want:
        return None
    return f"kernel struct sizes {sizes} differ from the Python side's {want}"


def format_table(family: ctypes.CDLL) -> dict[str, tuple[int, int, int]]:
    """A family library's formats: {name: (code, values per record and row, record bytes)}."""
    family.kv_format_info.argtypes = [_I, ctypes.POINTER(_I), ctypes.POINTER(_I)]
    family.kv_format_info.restype = ctypes.c_char_p
    table: dict[str, tuple[int, int, int]] = {}
    block, record = _I(), _I()
    while (
        name := family.kv_format_info(len(table), ctypes.byref(block), ctypes.byref(record))
    ) is not None:
        table[name.decode()] = (len(table), block.value, record.value)
    return table


def lora_target_table(family: ctypes.CDLL) -> list[tuple[str, int, int]]:
    """A family library's LoRA targets (``kernels/lora.h``): per index, ``(name, projection,
    output width)``."""
    family.kv_lora_target.argtypes = [_I, ctypes.POINTER(_I), ctypes.POINTER(_I)]
    family.kv_lora_target.restype = ctypes.c_char_p
    rows: list[tuple[str, int, int]] = []
    projection, width = _I(), _I()
    while (
        name := family.kv_lora_target(len(rows), ctypes.byref(projection), ctypes.byref(width))
    ) is not None:
        rows.append((name.decode(), projection.value, width.value))
    return rows


def _format_mismatch(table: dict[str, tuple[int, int, int]]) -> str | None:
    """Why the library's format table and ``interleave.GEOMETRY`` disagree, or None."""
    ours = {
        name: (block, interleave.record_bytes(name))
        for name, (block, _) in interleave.GEOMETRY.items()
    }
    theirs = {name: (block, record) for name, (_, block, record) in table.items()}
    if ours == theirs:
        return None
    diff = sorted(set(ours.items()) ^ set(theirs.items()))
    return f"the kernels' formats differ from interleave.GEOMETRY's: {diff} (name, (block, bytes))"


def _bind(lib: ctypes.CDLL) -> None:
    lib.kv_isa_supported.argtypes = [_I]
    lib.kv_isa_supported.restype = _I
    lib.kv_best_isa.argtypes = [_I]
    lib.kv_best_isa.restype = _I
    lib.kv_register_family.argtypes = [_I, _P]
    lib.kv_register_family.restype = _I
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
    lib.kv_step_layers.argtypes = [ctypes.POINTER(StepLayer), _I, ctypes.POINTER(StepArgs)]
    lib.kv_step_layers.restype = None


def load() -> ctypes.CDLL | None:
    """The kernels, built if needed; None (once logged) when they cannot be had.

    ``KVSERVE_KERNELS=0`` disables them; ``KVSERVE_ISA`` picks the ISA family (see above)."""
    global _lib, _reason, _loaded, _tuning, _tuning_source
    with _lock:
        if _loaded:
            return _lib
        _loaded = True
        mode = switch("kernels", "auto").lower()
        if mode in ("0", "off", "false", "no"):
            _reason = "disabled by KVSERVE_KERNELS"
            return None
        wanted = switch("isa", "auto").lower()
        if mode == "portable":  # the older spelling of KVSERVE_ISA=portable
            wanted = "portable"
        if wanted not in ("auto", *ISAS):
            _reason = f"KVSERVE_ISA={wanted!r}: use auto, {', '.join(reversed(ISAS))}"
            logger.warning("quantized CPU kernels unusable (%s): fp32 weights instead", _reason)
            return None
        try:
            _tuning, _tuning_source = tuning_table.parse(
                switch("kernel_tuning", "auto"), tuning_table.read_cpu()
            )
        except ValueError as e:
            _reason = str(e)
            logger.warning("quantized CPU kernels unusable (%s): fp32 weights instead", _reason)
            return None
        try:
            import torch  # noqa: F401  (torch's OpenMP runtime first: ours binds to it)

            lib = ctypes.CDLL(str(build.build(None)))
            _bind(lib)
            mismatch = _struct_mismatch(lib)
            if mismatch is not None:
                raise RuntimeError(mismatch)
            best = _set_isa(lib, "avx512" if wanted == "auto" else wanted)
        except (RuntimeError, OSError) as e:
            _reason = str(e)
            logger.warning(
                "quantized CPU kernels unavailable (%s): serving fp32 weights instead", e
            )
            return None
        _lib = lib
        if wanted not in ("auto", best):
            logger.warning("KVSERVE_ISA=%s: this CPU lacks it; the kernels run %s", wanted, best)
        return _lib


def _family(lib: ctypes.CDLL, name: str) -> None:
    """Family ``name``'s library registered with the dispatcher, built first if need be."""
    if name in _families:
        return
    if build.built(name) is None:
        logger.warning("compiling the %s kernels (first use of this family: a minute or two)", name)
    family = ctypes.CDLL(str(build.build(name)))
    mismatch = _struct_mismatch(family)
    table = format_table(family)
    mismatch = mismatch or _format_mismatch(table)
    mismatch = mismatch or targets.check_kernel_table(lora_target_table(family))
    if mismatch is not None:
        raise RuntimeError(f"{name} kernels: {mismatch}")
    family.kv_family.restype = _P
    family.kv_family_tune.argtypes = [_I, _I64]
    family.kv_family_tune.restype = _I64
    for knob, value in _tuning.items():  # the machine's values (cpu_tuning.py), every family
        family.kv_family_tune(tuning_table.KEYS[knob], value)
    if lib.kv_register_family(build.FAMILIES[name].code, family.kv_family()) != 0:
        raise RuntimeError(f"the dispatcher refused the {name} kernels")
    _families[name] = family  # kept loaded: the dispatcher holds its entry points
    _format_codes.update({fmt: code for fmt, (code, _, _) in table.items()})


def _set_isa(lib: ctypes.CDLL, name: str) -> str:
    """Switch to ``name`` (an emulated family as is; an ISA family or the best one below it
    the CPU has and can build), building and registering it first; returns the family now in
    use."""
    global _isa
    with _lock:
        candidates = [name]
        if name in ISAS:
            candidates = list(reversed(ISAS[: lib.kv_best_isa(build.FAMILIES[name].code) + 1]))
        for i, candidate in enumerate(candidates):
            try:
                _family(lib, candidate)
            except RuntimeError as e:
                if i + 1 == len(candidates):
                    raise
                logger.warning(
                    "the %s kernels are unusable (%s): trying %s", candidate, e, candidates[i + 1]
                )
                continue
            code = build.FAMILIES[candidate].code
            if lib.kv_set_isa(code) != code:
                raise RuntimeError(f"the dispatcher cannot run the {candidate} kernels on this CPU")
            _isa = candidate
            break
        return _isa


def supported_isas() -> list[str]:
    """The ISA families this CPU can run, best first (what the tests iterate over)."""
    lib = load()
    if lib is None:
        return []
    return [name for name in reversed(ISAS) if lib.kv_isa_supported(build.FAMILIES[name].code)]


def use_isa(name: str) -> str:
    """Switch the kernels to ISA family ``name`` (or the best one below it the CPU has), or to
    an ``EMULATED`` family (tests); returns the family now in use."""
    if name not in build.FAMILIES:
        raise ValueError(f"unknown ISA family {name!r}: use one of {', '.join(build.FAMILIES)}")
    lib = load()
    if lib is None:
        raise RuntimeError(f"kernels unavailable: {unavailable_reason()}")
    return _set_isa(lib, name)


def format_code(name: str) -> int:
    """The library's code for weight format ``name`` (its ``KV_FORMATS`` order)."""
    if load() is None:
        raise RuntimeError(f"kernels unavailable: {unavailable_reason()}")
    return _format_codes[name]


def available() -> bool:
    return load() is not None


def unavailable_reason() -> str | None:
    load()
    return _reason


def isa() -> str:
    """The family the kernels run (``"avx512"``, ``"avx2"``, ``"portable"``, or an emulated
    one while a test runs it)."""
    load()
    return _isa


def _family_lib() -> ctypes.CDLL:
    if load() is None:
        raise RuntimeError(f"kernels unavailable: {unavailable_reason()}")
    return _families[_isa]


def tuning() -> dict[str, int]:
    """The family in use's tuning knobs (``cpu_tuning.KEYS``; none changes a result) and values."""
    lib = _family_lib()
    return {name: lib.kv_family_tune(key, -1) for name, key in tuning_table.KEYS.items()}


def tuning_source() -> str:
    """Where the knobs at load came from (the CPU table's row, the defaults, the variable)."""
    load()
    return _tuning_source


def tune(**knobs: int) -> dict[str, int]:
    """Set the family in use's tuning knobs (``cpu_tuning.KEYS``); returns all of them. A bad
    name or value raises ValueError and changes nothing."""
    lib = _family_lib()
    checked = {name: tuning_table.check(name, value) for name, value in knobs.items()}
    for name, value in checked.items():
        lib.kv_family_tune(tuning_table.KEYS[name], value)
    return tuning()


def main(argv: list[str] | None = None) -> int:
    """``python -m model_runner.kernels``: build the dispatcher and this CPU's family at
    install time (``--all``: every family) and report."""
    parser = argparse.ArgumentParser(
        prog="python -m model_runner.kernels", description=main.__doc__
    )
    parser.add_argument(
        "--all", action="store_true", help="build every family this machine can, now"
    )
    args = parser.parse_args(argv)
    say = build.printer()
    try:
        lib = ctypes.CDLL(str(build.build(None, say)))
        _bind(lib)
        family = ISAS[lib.kv_best_isa(len(ISAS) - 1)]
        build.build(family, say)
    except RuntimeError as e:
        print(f"kvserve kernels not built ({e}); the server will run fp32 weights", file=sys.stderr)
        return 0
    if args.all:
        for name, result in build.build_all(build.buildable(), say).items():
            if not isinstance(result, os.PathLike):
                print(f"kvserve kernels: {name} not built: {result}", file=sys.stderr)
    print(f"kvserve kernels: {family} ({build.built(family)}); other families build on first use")
    return 0
