"""The kernels' tuning knobs (model_runner/kernels/cpu_tuning.py, qvec.h ``Tuning``): they change
the speed only. Every knob setting gives the same numbers bit for bit (pairs of row groups or
one group at a time, any prefetch distance), for each format, both activation precisions,
the epilogues and M = 1..9, on every ISA family this CPU has; the table picks the values by
CPU, and ``KVSERVE_KERNEL_TUNING`` overrides or refuses with a line saying what it takes."""

from __future__ import annotations

import os

import pytest
import torch

from model_runner import kernels, quant
from model_runner.kernels import cpu_tuning as tuning
from tests.model_runner.test_quant import make_weight

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernels not built")

# Settings that take every path: pairs always, never, from M = 3 (768 x 3) and from M = 4; no
# prefetch, far prefetch.
SETTINGS = (
    dict(tuning.DEFAULTS),
    {"pair_min_mk": 1 << 40, "prefetch_ahead": 0, "prefetch_head": 0},
    {"pair_min_mk": 2304, "prefetch_ahead": 2048, "prefetch_head": 64},
    {"pair_min_mk": 2305, "prefetch_ahead": 0, "prefetch_head": 0},
)

ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC

processor\t: 1
vendor_id\t: GenuineIntel
"""
XEON = "vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 167\n"


@pytest.fixture
def restore_tuning():
    before = kernels.tuning()
    yield
    kernels.tune(**before)


@pytest.mark.parametrize("family", [f for f in reversed(kernels.ISAS)])
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_every_setting_gives_the_same_bits(family: str, fmt: str, restore_tuning: None) -> None:
    if family not in kernels.supported_isas():
        pytest.skip(f"this CPU cannot run the {family} kernels")
    before = kernels.isa()
    kernels.use_isa(family)
    try:
        n, k = 40, 768  # 5 row groups (a pair and a lone one), 3 K-quant records
        w = make_weight(fmt, n, k, seed=3)
        bias = torch.randn(n)
        x = torch.randn(9, k, generator=torch.Generator().manual_seed(1))
        res = torch.randn(9, n)
        runs = []
        for setting in SETTINGS:
            kernels.tune(**setting)
            outs = []
            for bits in (16, 8):
                lin = quant.QLinear(w, bias, activation_bits=bits)
                for m in (1, 2, 3, 4, 9):
                    outs += [lin(x[:m]), lin.add(x[:m], res[:m]), lin.silu_mul(x[:m])]
            runs.append(outs)
        for setting, outs in zip(SETTINGS[1:], runs[1:], strict=True):
            for got, want in zip(outs, runs[0], strict=True):
                assert torch.equal(got, want), f"{family} {fmt}: {setting} changed a result"
    finally:
        kernels.use_isa(before)


def test_tune_checks_every_knob_before_setting_any(restore_tuning: None) -> None:
    before = kernels.tuning()
    with pytest.raises(ValueError, match="prefetch_ahead is a multiple of 64"):
        kernels.tune(pair_min_mk=7, prefetch_ahead=100)
    with pytest.raises(ValueError, match="unknown kernel tuning knob 'pairs'"):
        kernels.tune(pairs=1)
    with pytest.raises(ValueError, match="pair_min_mk is an int >= 1"):
        kernels.tune(pair_min_mk=0)
    assert kernels.tuning() == before
    assert kernels.tune(pair_min_mk=1 << 40)["pair_min_mk"] == 1 << 40  # int64 through ctypes


def test_the_table_picks_by_cpu() -> None:
    zen4 = tuning.read_cpu(ZEN4)
    assert zen4 == tuning.Cpu("AuthenticAMD", 25, 17)  # the first processor's fields only
    knobs, source = tuning.for_cpu(zen4)
    assert knobs == {"pair_min_mk": 6144, "prefetch_ahead": 0, "prefetch_head": 0}
    assert "family 25 model 17" in source
    assert tuning.for_cpu(tuning.read_cpu(XEON)) == (
        tuning.DEFAULTS,
        "the defaults (no row for this CPU)",
    )
    assert tuning.read_cpu("Processor\t: ARMv8\n") is None
    assert tuning.for_cpu(None)[0] == tuning.DEFAULTS


def test_the_variable_overrides_or_says_what_it_takes() -> None:
    zen4 = tuning.read_cpu(ZEN4)
    assert tuning.parse("auto", zen4) == tuning.for_cpu(zen4)
    assert tuning.parse("default", zen4)[0] == tuning.DEFAULTS
    knobs, source = tuning.parse("pair_min_mk=1, prefetch_head=1024", zen4)
    assert knobs == {"pair_min_mk": 1, "prefetch_ahead": 0, "prefetch_head": 1024}
    assert source == "KVSERVE_KERNEL_TUNING=pair_min_mk=1, prefetch_head=1024"
    with pytest.raises(ValueError, match="use auto, default, or name=value pairs"):
        tuning.parse("pairs", zen4)
    with pytest.raises(ValueError, match="prefetch_ahead is a multiple of 64"):
        tuning.parse("prefetch_ahead=65", zen4)


def test_load_applies_the_machines_values() -> None:
    """What load() applied to the family in use is what the table (or the variable) says for
    this machine (the tests here restore what they tune)."""
    want, source = tuning.parse(os.environ.get("KVSERVE_KERNEL_TUNING", "auto"), tuning.read_cpu())
    assert kernels.tuning_source() == source
    assert kernels.tuning() == want
