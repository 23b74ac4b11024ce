"""The SIMD tiles' one template, run over emulated lanes and compared bit for bit with the real
families (model_runner/kernels/qvec.h's ``Emu``; ``kernels.EMULATED``).

The emulated families compile the same qtile.h over plain-C++ lanes with each intrinsic's
exact semantics, fed by the scalar reference decoders:

    emu_avx2    8 lanes, maddubs + madd (Q8_0 by the sign trick): the avx2 family's tiles
    emu_vnni8   8 lanes, vpdpbusd: the avx512 family's ymm tiles (no pairs)
    emu_vnni16  8 and 16 lanes, vpdpbusd: the avx512 family as it runs (zmm pairs of records
                from M = 1, the L1-unpacked chunks from M = 32)

So on any CPU: emu_avx2 must equal the real avx2 family bit for bit (the emulation is
faithful); emu_vnni8 must equal emu_vnni16 bit for bit (the ymm and zmm tiles compute the same
per-lane arithmetic); emu_vnni16 must equal the avx2 family wherever their integer sums agree
(every format but Q8_0, which avx2 takes signed); and where the CPU has AVX-512 VNNI (CI may),
emu_vnni16 must equal the real avx512 family bit for bit, every format.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from model_runner import kernels, quant
from tests.model_runner.test_quant import KERNEL_TOL, assert_close, make_weight, reference

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernels not built")


def shapes(fmt: str) -> list[tuple[int, int]]:
    """test_quant's N and K tails per format: K-quants past one 512-column chunk (768), the
    32-block formats at 96 and 160 (and Q4_1 past a chunk, 1056)."""
    if quant.FORMATS[fmt].block == quant.QK_K:
        return [(7, 768), (33, 512)]
    return [(64, 96), (33, 160), *([(16, 1056)] if fmt == "Q4_1" else [])]


# Every format (and int8 per row, held as Q8_0), and a stack of three formats whose 8-row
# groups pair across a format boundary.
CASES = [
    *[
        (fmt, n, k)
        for fmt in (*quant.FORMATS, "int8")
        for n, k in shapes("Q8_0" if fmt == "int8" else fmt)
    ],
    ("stack", 56, 256),
]
ROWS = (1, 2, 3, 4, 5, 8, 9, 13, 32, 40, 70)


@functools.cache
def weight(fmt: str, n: int, k: int) -> quant.QuantMatrix:
    if fmt == "stack":
        parts = [
            make_weight("Q4_K", 24, k),
            make_weight("Q6_K", 16, k, seed=1),
            make_weight("Q8_0", 16, k, seed=2),
        ]
        return quant.cat_rows(parts)
    return make_weight(fmt, n, k)


@contextmanager
def running(family: str) -> Iterator[None]:
    before = kernels.isa()
    assert kernels.use_isa(family) == family
    try:
        yield
    finally:
        kernels.use_isa(before)


@functools.cache
def outputs(family: str) -> dict[tuple[str, int, int, int, int], np.ndarray]:
    """y = x W^T (and the fused silu_mul) of every case, both activation precisions, every M."""
    out = {}
    with running(family):
        for fmt, n, k in CASES:
            for bits in quant.ACTIVATION_BITS:
                lin = quant.QLinear(weight(fmt, n, k), None, bits)
                for m in ROWS:
                    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                    out[(fmt, k, bits, m, 0)] = lin(x).numpy()
                    out[(fmt, k, bits, m, 1)] = lin.silu_mul(x).numpy()
    return out


def differing(a: str, b: str, skip: tuple[str, ...] = ()) -> list[tuple[str, int, int, int, int]]:
    """The cases whose results are not bit-identical between families a and b."""
    ya, yb = outputs(a), outputs(b)
    assert ya.keys() == yb.keys()
    keys = [key for key in ya if key[0] not in skip]
    assert keys
    return [key for key in keys if ya[key].tobytes() != yb[key].tobytes()]


def needs(isa: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        isa not in kernels.supported_isas(), reason=f"this CPU cannot run the {isa} kernels"
    )


def test_emulated_families_match_the_reference() -> None:
    """Each emulated family computes y = x W^T: the quantized-activation reference to fp32
    rounding, every format and M (the comparisons below then pin them bit for bit)."""
    for family in kernels.EMULATED:
        with running(family):
            for fmt, n, k in CASES[::3]:
                w = weight(fmt, n, k)
                for m in (1, 9, 40):
                    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                    assert_close(quant.QLinear(w, None)(x), reference(w, x), KERNEL_TOL)


@needs("avx2")
def test_the_emulated_avx2_tiles_equal_the_avx2_family_bit_for_bit() -> None:
    """emu_avx2 (the tile template on emulated maddubs lanes) and the avx2 family give the
    same bits for every case: the emulation does what the intrinsics do."""
    assert differing("emu_avx2", "avx2") == []


def test_the_ymm_and_zmm_tiles_agree_bit_for_bit_in_emulation() -> None:
    """The avx512 family's two widths, emulated: 8-lane tiles alone (emu_vnni8) and 16-lane
    pairs with the L1-unpacked chunks (emu_vnni16) give the same bits for every case, so a
    row's result does not depend on which tile computed it."""
    assert differing("emu_vnni8", "emu_vnni16") == []


def test_a_rows_result_does_not_depend_on_its_batch_in_emulation() -> None:
    """In emu_vnni16, each row of a 70-row product (pairs, unpacked chunks, column tiles)
    equals the same row computed alone, bit for bit."""
    ys = outputs("emu_vnni16")
    with running("emu_vnni16"):
        for fmt, n, k in CASES:
            lin = quant.QLinear(weight(fmt, n, k), None, 16)
            x = torch.randn(70, k, generator=torch.Generator().manual_seed(70))
            for i in (0, 33, 69):
                assert np.array_equal(
                    lin(x[i : i + 1]).numpy(), ys[(fmt, k, 16, 70, 0)][i : i + 1]
                ), (fmt, i)


@needs("avx2")
def test_the_emulated_vnni_tiles_equal_the_avx2_family_where_the_integers_agree() -> None:
    """vpdpbusd (emulated, 8 and 16 lanes) and the avx2 family's maddubs sum the same exact
    integers for every unsigned format, so the results are the same bits; Q8_0 (and the stack
    holding it) differs, as avx2 takes its quants signed."""
    skip = ("Q8_0", "int8", "stack")
    assert differing("emu_vnni16", "avx2", skip) == []
    assert differing("emu_vnni8", "avx2", skip) == []


@needs("avx512")
def test_the_emulated_vnni_tiles_equal_the_avx512_family_bit_for_bit() -> None:
    """Where the CPU has AVX-512 VNNI: the real ymm / zmm tiles give emu_vnni16's bits for every
    case (every format, pairs across a format boundary, unpacked chunks)."""
    assert differing("emu_vnni16", "avx512") == []


def extreme_weight(fmt: str, n: int, k: int) -> quant.QuantWeight:
    """Every quant at its format's largest unsigned value (all bits set; Q8_0's +127, which its
    records hold as 255) and every fp16 scale a valid 0.01: the largest integer products."""
    spec = quant.FORMATS[fmt]
    raw = np.full((n, k // spec.block, spec.block_bytes), 0x7F if fmt == "Q8_0" else 0xFF, np.uint8)
    for lo in quant._SCALE_OFFSETS[fmt]:
        raw[..., lo : lo + 2] = np.array([0.01], np.float16).view(np.uint8)
    return quant.QuantWeight.from_blocks(raw.reshape(n, -1), fmt, (n, k))


def test_the_largest_quants_and_activations_do_not_overflow_the_dot_products() -> None:
    """With every quant at its maximum and activations at +-127 (whole rows of +1 or -1), each
    family (real and emulated) gives the reference's result, and a row alone equals the same row
    inside a 64-row product bit for bit: the maddubs families sum up to 4 (Q6_K: 2) weight
    vectors' int16 products before widening, and no lane saturates or wraps."""
    m, k = 64, 512
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    x[0::4] = 1.0
    x[1::4] = -1.0
    for family in (*kernels.supported_isas(), *kernels.EMULATED):
        with running(family):
            for fmt in quant.FORMATS:
                w = extreme_weight(fmt, 24, k)
                for bits in quant.ACTIVATION_BITS:
                    lin = quant.QLinear(w, None, bits)
                    together = lin(x)
                    assert_close(together, reference(w, x, bits), KERNEL_TOL)
                    for i in (0, 1, 2, 63):
                        alone = lin(x[i : i + 1])
                        assert torch.equal(alone, together[i : i + 1]), (family, fmt, bits, i)
