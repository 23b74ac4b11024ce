"""The kernels' tuning knobs and their values by CPU (``kernels.cpp`` ``kv_family_tune``).

A family library has three knobs (``qvec.h``, ``Tuning``); none of them changes a result (a
row's arithmetic is the same either way, tests/model_runner/test_kernel_tuning.py holds it bit
for bit), only the speed:

    pair_min_mk     row groups go in pairs (two 8-row records joined into zmm: 16 rows a
                    broadcast) where activation rows x row length (a panel's, for rows held
                    in panels: interleave.panel_cols) reaches this
    prefetch_ahead  the bytes each record's software prefetch asks ahead of it (0: none,
                    the record's own loads ask for its lines)
    prefetch_head   the bytes of the next record stream's head asked before it starts

Which values are fastest depends on the machine, not on the ISA name: on the Xeon model 167
the pairs win from one row and a 512-byte prefetch beats none and 2048; on the EPYC family 25
model 17 (Zen 4: its zmm is double-pumped) the pairs lose where M x K is under 6144 (one row of
up to 4096 values, two of 2048: 1.2-2.5x slower from DRAM, as a pair's two record streams
restart every two row groups where one group after another is one sequential stream), win
above it, and the software prefetches lose to the hardware's (docs/benchmarks.md, "Kernel
tuning by CPU"). So ``CPU_TABLE`` holds the measured machines' values, chosen at load from
``/proc/cpuinfo``, and everything else keeps the defaults; ``KVSERVE_KERNEL_TUNING``
overrides them:

    KVSERVE_KERNEL_TUNING=auto                       the table (the default)
    KVSERVE_KERNEL_TUNING=default                    the built-in defaults, whatever the CPU
    KVSERVE_KERNEL_TUNING=pair_min_mk=1,prefetch_ahead=512   these over the table's choice

``python -m benchmarks.bench_tuning`` measures the candidates on the machine at hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

KEYS = {"pair_min_mk": 0, "prefetch_ahead": 1, "prefetch_head": 2}
DEFAULTS = {"pair_min_mk": 1, "prefetch_ahead": 512, "prefetch_head": 512}


@dataclass(frozen=True, slots=True)
class Cpu:
    vendor: str  # cpuid's vendor string: GenuineIntel, AuthenticAMD
    family: int
    model: int


@dataclass(frozen=True, slots=True)
class Row:
    vendor: str
    family: int
    models: tuple[int, ...] | None  # None: every model of the family
    knobs: dict[str, int]
    measured: str  # the machine the values were measured on

    def matches(self, cpu: Cpu) -> bool:
        return (
            cpu.vendor == self.vendor
            and cpu.family == self.family
            and (self.models is None or cpu.model in self.models)
        )


# One row per machine type measured (docs/benchmarks.md, "Kernel tuning by CPU"). AMD family
# 25 is Zen 3 and Zen 4: Zen 3 runs the avx2 family (no pairs; the prefetch knobs apply).
CPU_TABLE = (
    Row(
        "AuthenticAMD", 25, None,
        {"pair_min_mk": 6144, "prefetch_ahead": 0, "prefetch_head": 0},
        "AMD EPYC family 25 model 17 (Zen 4), 2 vCPUs, 2026-12-04",
    ),
)  # fmt: skip


def check(name: str, value: object) -> int:
    """``value`` as knob ``name`` takes it; ValueError saying what it takes otherwise."""
    if name not in KEYS:
        raise ValueError(f"unknown kernel tuning knob {name!r}: use {', '.join(KEYS)}")
    pair = name == "pair_min_mk"
    ok = isinstance(value, int) and not isinstance(value, bool)
    ok = ok and (value >= 1 if pair else 0 <= value <= 8192 and value % 64 == 0)  # type: ignore[operator]
    if not ok:
        what = "an int >= 1" if pair else "a multiple of 64 in [0, 8192] (bytes)"
        raise ValueError(f"kernel tuning {name}={value!r}: {name} is {what}")
    return value  # type: ignore[return-value]


def read_cpu(cpuinfo: str | None = None) -> Cpu | None:
    """The first processor's vendor, family and model from ``/proc/cpuinfo`` (or the text
    given); None where they cannot be read (another OS, an ARM machine)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    try:
        return Cpu(fields["vendor_id"], int(fields["cpu family"]), int(fields["model"]))
    except (KeyError, ValueError):
        return None


def for_cpu(cpu: Cpu | None) -> tuple[dict[str, int], str]:
    """The knobs for ``cpu`` and where they come from (the table row's machine, or the
    defaults)."""
    for row in CPU_TABLE:
        if cpu is not None and row.matches(cpu):
            return DEFAULTS | row.knobs, f"measured on {row.measured}"
    return dict(DEFAULTS), "the defaults (no row for this CPU)"


def parse(spec: str, cpu: Cpu | None) -> tuple[dict[str, int], str]:
    """``KVSERVE_KERNEL_TUNING``'s value applied: the knobs and a line saying why."""
    spec = spec.strip().lower()
    if spec in ("", "auto"):
        return for_cpu(cpu)
    if spec == "default":
        return dict(DEFAULTS), "the defaults (KVSERVE_KERNEL_TUNING=default)"
    knobs, _ = for_cpu(cpu)
    for item in spec.split(","):
        name, sep, value = item.strip().partition("=")
        if not sep or not value.strip().isdigit():
            raise ValueError(
                f"KVSERVE_KERNEL_TUNING={spec!r}: use auto, default, or name=value pairs "
                f"joined by commas ({', '.join(KEYS)})"
            )
        knobs[name.strip()] = check(name.strip(), int(value))
    return knobs, f"KVSERVE_KERNEL_TUNING={spec}"
