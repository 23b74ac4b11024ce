"""Quantized weights and kvserve's CPU kernels (model_runner/quant.py, model_runner/kernels).

Every GGUF format the kernels keep (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, and int8
per row) x both activation precisions (16: int8 plus a residual byte, 8: int8) x every ISA
family this CPU has (avx512, avx2, portable) x M = 1..64 rows x K and N tails x 1 and 2
threads, against the reference: the activations quantized per 32-block exactly as the kernels
do it (``act_reference``), times the dequantized weights, in float64. The integer dot products
are exact, so the kernels may differ from it by fp32 rounding of the scale products and sums
(measured ~3e-7 of max|y|) and, where the residual's rounding lands on a tie that fp32 breaks
the other way, by one residual unit of one value: |err| <= 5e-5 * max|y|.
Against the plain fp32 matmul (no activation quantization) the error is the rounding of the
activations: |err| <= 2e-2 * max|y| on random data for int8, 2e-4 with the residual.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import pytest
import torch

from benchmarks.tools import kquants
from model_runner import kernels, quant
from model_runner.config import RunnerOptions

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernels not built")


@pytest.fixture(params=list(reversed(kernels.ISAS)))
def isa(request: pytest.FixtureRequest) -> str:
    if request.param not in kernels.supported_isas():
        pytest.skip(f"this CPU cannot run the {request.param} kernels")
    before = kernels.isa()
    assert kernels.use_isa(request.param) == request.param
    yield request.param
    kernels.use_isa(before)


@pytest.fixture(params=[1, 2])
def threads(request: pytest.FixtureRequest) -> int:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def gguf_raw(type_name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF blocks of a random [n, k] weight (the gguf package's quantizer, or ours for
    the K-quants it lacks)."""
    rng = np.random.default_rng(seed)
    return kquants.quantize(rng.standard_normal((n, k)).astype(np.float32), type_name)


def make_weight(fmt: str, n: int, k: int, seed: int = 0) -> quant.QuantWeight:
    if fmt in quant.FORMATS:
        return quant.from_gguf_blocks(gguf_raw(fmt, n, k, seed), fmt, (n, k))
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return quant.quantize_int8(w) if fmt == "int8" else quant.quantize_q4(w)


def act_reference(x: torch.Tensor, bits: int = 16) -> torch.Tensor:
    """x as the kernels see it, per 32-block: d = amax / 127, a1 = round(x * (1 / d)) and, with
    16 bits, the residual's a2 = round((x - a1 * d) * (256 / d)) clamped to +-127 (round half
    to even, fp32 as the kernels compute it): x ~= d a1 + d / 256 a2."""
    m, k = x.shape
    kp = -(-k // 32) * 32
    padded = torch.zeros(m, kp)
    padded[:, :k] = x
    blocks = padded.view(m, kp // 32, 32)
    d = blocks.abs().amax(dim=2, keepdim=True) / 127.0
    inv = torch.where(d > 0, 1.0 / d, 0.0)
    a1 = torch.round(blocks * inv)
    if bits == 8:
        return (a1.double() * d.double()).view(m, kp)[:, :k]
    a2 = torch.round((blocks - a1 * d) * (256.0 * inv)).clamp_(-127, 127)
    unit = (d / 256.0).double()  # the kernels' unit, d / 256 in fp32
    return ((256.0 * a1 + a2).double() * unit).view(m, kp)[:, :k]


def reference(w: quant.QuantMatrix, x: torch.Tensor, bits: int = 16) -> torch.Tensor:
    """The kernels' quantized activations times the dequantized weights, in float64."""
    return act_reference(x, bits).double() @ w.dequantize().double().T


def assert_close(y: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    scale = ref.abs().max().item()
    err = (y.double() - ref.double()).abs().max().item()
    assert err <= rel * scale, f"max abs err {err:.3g} > {rel} * {scale:.3g}"


KERNEL_TOL = 5e-5
FORMATS = [*quant.FORMATS, "int8"]
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 16, 31, 40, 64]


def shapes(fmt: str) -> list[tuple[int, int]]:
    """N tails (7, 33: not whole 8-row records) and K tails: K-quants come in whole
    256-blocks, so their K tail is 768 (not a multiple of 512); 32-block formats go down to
    K = 32 and 160 (not a multiple of 64)."""
    if fmt in ("Q4_K", "Q5_K", "Q6_K"):
        return [(64, 256), (7, 768), (33, 512)]
    return [(64, 96), (7, 32), (33, 160)]


CASES = [(fmt, n, k) for fmt in FORMATS for n, k in shapes(fmt)]


@pytest.mark.parametrize("bits", quant.ACTIVATION_BITS)
@pytest.mark.parametrize("fmt, n, k", CASES)
def test_gemm_matches_the_reference(
    fmt: str, n: int, k: int, bits: int, isa: str, threads: int
) -> None:
    """y = x W^T for M = 1..64 rows (every column tile and tail; the fused step runs them up
    to its batch size) equals the quantized-activation reference to fp32 rounding."""
    w = make_weight(fmt, n, k)
    lin = quant.QLinear(w, None, bits)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = lin(x)
        assert y.shape == (m, n)
        assert_close(y, reference(w, x, bits), KERNEL_TOL)


@pytest.mark.parametrize("bits, tol", [(8, 2e-2), (16, 2e-4)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gemm_is_close_to_the_fp32_matmul(fmt: str, bits: int, tol: float) -> None:
    """Against x @ dequantize(W).T with fp32 activations the error is the activations'
    rounding: within 2e-2 of max|y| for int8, 2e-4 with the residual byte, and far from zero
    (the kernels do quantize)."""
    n, k = shapes(fmt)[0]
    w = make_weight(fmt, n, k, seed=4)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(8))
    y = quant.QLinear(w, None, bits)(x)
    exact = x.double() @ w.dequantize().double().T
    assert_close(y, exact, tol)
    assert (y.double() - exact).abs().max().item() > 1e-8 * exact.abs().max().item()


@pytest.mark.parametrize("bits", quant.ACTIVATION_BITS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_rows_result_does_not_depend_on_its_batch(fmt: str, bits: int, isa: str) -> None:
    """Bit for bit, each row of an M-row product (M = 64: eight full column tiles; 13: a
    tail) equals the same row computed alone: the column tiles run one arithmetic."""
    n, k = shapes(fmt)[2]
    lin = quant.QLinear(make_weight(fmt, n, k), None, bits)
    for m in (64, 13):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        together = lin(x)
        for i in (0, 5, m - 1):
            assert torch.equal(lin(x[i : i + 1]), together[i : i + 1]), (m, i)


@pytest.mark.parametrize("k", [45, 100, 33])
def test_int8_odd_k_is_zero_padded(k: int, isa: str, threads: int) -> None:
    """int8 per-channel weights with K not a multiple of 32 (padded blocks) give the
    reference's results for every row count."""
    w = make_weight("int8", 19, k, seed=k)
    assert w.records.shape == (3, w.num_blocks, 272) and w.dequantize().shape == (19, k)
    lin = quant.QLinear(w, None)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        assert_close(lin(x), reference(w, x), KERNEL_TOL)


def test_every_isa_family_gives_the_same_numbers() -> None:
    """The families compute the same integer dots with the same scales: results agree to
    fp32 summation order (1e-6 of max|y|), for every format."""
    families = kernels.supported_isas()
    before = kernels.isa()
    try:
        for fmt in FORMATS:
            n, k = shapes(fmt)[2]
            w = make_weight(fmt, n, k)
            x = torch.randn(9, k)
            results = []
            for family in families:
                kernels.use_isa(family)
                results.append(quant.QLinear(w, None)(x))
            for other in results[1:]:
                assert_close(other, results[0], 1e-6)
    finally:
        kernels.use_isa(before)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("m", [1, 5, 40, 70])
def test_fused_epilogues(fmt: str, m: int, isa: str) -> None:
    """add (residual + xW^T + b), silu_mul (silu(x Wg^T) * x Wu^T) and the GELU one (Gemma's
    GeGLU, the fused step's: tanh GELU of the gate) equal the unfused ops on the same kernel
    results."""
    n, k = 64, 256
    w = make_weight(fmt, n, k)
    bias = torch.randn(n)
    lin = quant.QLinear(w, bias)
    x = torch.randn(m, k)
    residual = torch.randn(m, n)
    plain = lin(x)
    res_copy = residual.clone()
    torch.testing.assert_close(lin.add(x, residual), plain + residual, rtol=1e-5, atol=1e-5)
    assert torch.equal(residual, res_copy), "add must not modify the residual"
    fused = lin.silu_mul(x)
    expected = torch.nn.functional.silu(plain[:, : n // 2]) * plain[:, n // 2 :]
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)
    gelu = lin._gemm(x, torch.empty(m, n // 2), kernels.EPI_GELU_MUL)
    gate = torch.nn.functional.gelu(plain[:, : n // 2], approximate="tanh")
    torch.testing.assert_close(gelu, gate * plain[:, n // 2 :], rtol=1e-5, atol=1e-5)
    assert (gelu - fused).abs().max() > 0.1, "the two activations differ at these values"


@pytest.mark.parametrize("fmt", quant.FORMATS)
def test_gguf_repack_dequantizes_like_gguf(fmt: str) -> None:
    """Our repacked blocks dequantize to exactly what the gguf package decodes, and so do
    the kernels' own rows (QEmbedding), for every native format."""
    n, k = 24, 512
    raw = gguf_raw(fmt, n, k, seed=1)
    ours = quant.from_gguf_blocks(raw, fmt, (n, k))
    qtype = getattr(gguf.GGMLQuantizationType, fmt)
    theirs = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32))
    torch.testing.assert_close(ours.dequantize(), theirs.reshape(n, k), rtol=0, atol=0)
    ids = torch.tensor([3, 0, 23, 3])
    torch.testing.assert_close(
        quant.QEmbedding(ours)(ids), theirs.reshape(n, k)[ids], rtol=0, atol=0
    )


@pytest.mark.parametrize("fmt", kquants.K_TYPES)
def test_reference_k_quantizer_is_close(fmt: str) -> None:
    """Our K-quant writer (the gguf package has none) round-trips through the gguf package's
    decoder to within the format's step: max error <= 1/levels of each 16/32-group's range."""
    rng = np.random.default_rng(2)
    w = rng.standard_normal((8, 512)).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, fmt)
    back = np.asarray(gguf.quants.dequantize(kquants.quantize(w, fmt), qtype)).reshape(8, 512)
    levels = {"Q4_K": 15, "Q5_K": 31, "Q6_K": 63}[fmt]
    # 6-bit / int8 scale rounding can add up to one more step.
    assert np.abs(back - w).max() <= 2.5 * (w.max() - w.min()) / levels


def test_row_operations_are_exact() -> None:
    """rows() permutes, scaled() multiplies, cat_rows() stacks: each commutes with
    dequantize() (what the model's Q/K interleave, softmax-scale fold and QKV fusion use),
    for 32-block and K-quant formats; mixed formats stack as a QuantStack."""
    for fmt, k in (("Q4_1", 64), ("Q4_K", 256), ("Q6_K", 256), ("Q5_0", 64)):
        a, b = make_weight(fmt, 16, k), make_weight(fmt, 8, k, seed=3)
        perm = torch.randperm(16)
        torch.testing.assert_close(a.rows(perm).dequantize(), a.dequantize()[perm])
        torch.testing.assert_close(a.scaled(0.125).dequantize(), a.dequantize() * 0.125)
        both = quant.cat_rows([a, b])
        assert isinstance(both, quant.QuantWeight) and both.source == fmt
        torch.testing.assert_close(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    q, kk, v = (
        make_weight("Q4_K", 16, 256),
        make_weight("Q4_K", 8, 256),
        make_weight("Q6_K", 8, 256),
    )
    stack = quant.cat_rows([q, kk, v])
    assert isinstance(stack, quant.QuantStack)
    assert [p.fmt for p in stack.parts] == ["Q4_K", "Q6_K"] and stack.out_features == 32
    with pytest.raises(ValueError, match="one in_features"):
        quant.cat_rows([q, make_weight("Q4_K", 8, 512)])


@pytest.mark.parametrize("m", [1, 6, 70])
def test_mixed_format_stack_runs_each_part_in_its_format(m: int, isa: str) -> None:
    """A QKV stack of Q4_K, Q4_K and Q6_K rows (as a Q4_K_M file has them) equals the
    reference, with every epilogue: the gate/up split falls inside the stack."""
    parts = [make_weight("Q4_K", 24, 256), make_weight("Q6_K", 16, 256, seed=1),
             make_weight("Q8_0", 8, 256, seed=2)]  # fmt: skip
    stack = quant.cat_rows(parts)
    lin = quant.QLinear(stack, None)
    x = torch.randn(m, 256)
    assert_close(lin(x), reference(stack, x), KERNEL_TOL)
    gu = lin(x)
    torch.testing.assert_close(lin.silu_mul(x), torch.nn.functional.silu(gu[:, :24]) * gu[:, 24:])


def test_embedding_rows_dequantize_exactly() -> None:
    """QEmbedding returns exactly the dequantized rows asked for, repeats included."""
    w = make_weight("Q8_0", 50, 64)
    ids = torch.tensor([3, 0, 49, 3])
    torch.testing.assert_close(quant.QEmbedding(w)(ids), w.dequantize()[ids], rtol=0, atol=0)


def test_weights_are_held_in_the_files_bytes() -> None:
    """Resident bytes equal GGUF's bytes on disk (records are the blocks' own bytes), plus
    the zero rows that fill a last record of fewer than 8 rows."""
    k = 512
    for fmt, spec in quant.FORMATS.items():
        for n in (64, 13):
            disk = -(-n // 8) * 8 * k // spec.block * spec.block_bytes
            assert make_weight(fmt, n, k).nbytes == disk, fmt


@pytest.mark.parametrize("fmt", quant.FORMATS)
@pytest.mark.parametrize("n", [8, 13, 40])
def test_interleaved_layout_round_trips_to_the_files_bytes(fmt: str, n: int) -> None:
    """Records give back the GGUF blocks byte for byte (arbitrary bytes, not only valid
    weights), for whole and partial 8-row groups."""
    spec = quant.FORMATS[fmt]
    k = 2 * spec.block * (3 if spec.block == 32 else 1)
    raw = np.random.default_rng(n).integers(0, 256, (n, k // spec.block * spec.block_bytes),
                                            dtype=np.uint8)  # fmt: skip
    w = quant.QuantWeight.from_blocks(raw, fmt, (n, k))
    assert np.array_equal(w.blocks(), raw)
    assert np.array_equal(w.rows(torch.arange(n - 1, -1, -1)).blocks(), raw[::-1])


def test_weights_mode_resolution() -> None:
    """auto keeps a GGUF quantized on CPU/fp32 only; explicit modes elsewhere are refused."""
    f32 = torch.float32
    assert quant.resolve_weights_mode("auto", True, "cpu", f32) == "native"
    assert quant.resolve_weights_mode("auto", False, "cpu", f32) == "float32"
    assert quant.resolve_weights_mode("auto", True, "cpu", torch.bfloat16) == "float32"
    assert quant.resolve_weights_mode("int8", False, "cpu", f32) == "int8"
    assert quant.resolve_weights_mode("float32", True, "cpu", f32) == "float32"
    with pytest.raises(ValueError, match="float32 compute"):
        quant.resolve_weights_mode("native", True, "cpu", torch.float16)
    with pytest.raises(ValueError, match="unknown weights mode"):
        quant.resolve_weights_mode("q4", True, "cpu", f32)


# ---------------------------------------------------------------------- the model on them


def quantized_pair(
    kind: str, fmt: str, hf_overrides: dict[str, object] | None = None, **kwargs: object
) -> tuple[object, torch.nn.Module]:
    """Our runner on quantized matrices, and transformers on exactly their dequantized values
    (``hf_overrides``: the tiny config's, as ``tiny_hf`` takes them)."""
    from model_runner.runner import TorchRunner
    from tests.model_runner.oracle import our_config, tiny_hf

    hf = tiny_hf(kind, **(hf_overrides or {}))
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    make = quant.quantize_int8 if fmt == "int8" else quant.quantize_q4
    weights: dict[str, torch.Tensor | quant.QuantWeight] = {}
    for name, value in state.items():
        is_matrix = value.dim() == 2 and name.endswith(quant.MATRIX_SUFFIXES)
        weights[name] = make(value) if is_matrix else value
    with torch.no_grad():
        for name, p in hf.named_parameters():
            w = weights.get(name)
            if isinstance(w, quant.QuantWeight):
                p.copy_(w.dequantize())
    kwargs.setdefault("kv_dtype", "float32")  # the oracle's: exact KV
    options = RunnerOptions(64, 4, dtype=torch.float32, device="cpu", **kwargs)
    runner = TorchRunner(our_config(hf), weights, options)
    return runner, hf


def hf_logits_quantized_acts(hf: torch.nn.Module, ids: list[int], bits: int) -> torch.Tensor:
    """transformers' logits with every Linear fed the kernels' quantized activations (per
    row, per 32-block), as the kernels run it."""
    from tests.model_runner.oracle import hf_logits

    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        flat = act_reference(x.reshape(-1, x.shape[-1]).float(), bits).to(x.dtype)
        return torch.nn.functional.linear(flat.view(x.shape), self.weight, self.bias)

    original = torch.nn.Linear.forward
    torch.nn.Linear.forward = forward  # type: ignore[method-assign]
    try:
        return hf_logits(hf, ids)
    finally:
        torch.nn.Linear.forward = original  # type: ignore[method-assign]


@pytest.mark.parametrize("bits, tol", [(16, 2e-3), (8, 5e-2)])
@pytest.mark.parametrize("kind", ["llama", "llama-gqa", "qwen2", "qwen3", "phi4-mini"])
@pytest.mark.parametrize("fmt", ["int8", "q4"])
def test_quantized_model_tracks_its_dequantized_reference(
    kind: str, fmt: str, bits: int, tol: float
) -> None:
    """Prefill and decode logits of the quantized model equal transformers' on the
    dequantized weights with the kernels' quantized activations: within 5e-2 of max|logit|
    for int8 activations (an activation on the other side of a rounding boundary, from fp32
    differences upstream, moves logits: measured up to 2.8 % on these tiny random models; a
    plumbing error is O(1)), 2e-3 with the residual byte (a boundary there is 256x finer)."""
    from tests.model_runner.oracle import plan, random_ids, seq

    runner, hf = quantized_pair(kind, fmt, activation_bits=bits)
    assert runner.info.weights in ("int8", "q4")
    ids = random_ids(80, seed=5)
    blocks = list(range(13))
    ref = hf_logits_quantized_acts(hf, ids, bits)
    short = runner.step_logits(plan(0, prefill=[seq("a", ids, 0, 20, blocks)]))["a"]
    assert_close(short, ref[:20], tol)
    for pos in range(20, 24):
        out = runner.step_logits(plan(pos, decode=[seq("a", ids, pos, pos + 1, blocks)]))["a"]
        assert_close(out, ref[pos : pos + 1], tol)
    long_blocks = list(range(20, 40))
    long = runner.step_logits(plan(9, prefill=[seq("b", ids, 0, 80, long_blocks)]))["b"]
    assert_close(long, ref, tol)


def decode_both(
    fused: Any, plain: Any, prompts: dict[str, list[int]], tables: dict[str, list[int]], steps: int
) -> None:
    """Prefill every prompt but its last token on both runners, then ``steps`` greedy decode
    steps of all of them together: the fused step's logits within 5e-2 of max|logit| of the
    torch path's (the two paths' attention sums in different fp32 orders, which can move an
    int8 activation across a rounding boundary)."""
    from tests.model_runner.oracle import plan, seq

    for runner in (fused, plain):
        chunks = [seq(r, ids, 0, len(ids) - 1, tables[r]) for r, ids in prompts.items()]
        runner.step_logits(plan(0, prefill=chunks))
    for step in range(steps):
        rows = [seq(r, ids, len(ids) - 1, len(ids), tables[r]) for r, ids in prompts.items()]
        got = fused.step_logits(plan(1 + step, decode=rows))
        want = plain.step_logits(plan(1 + step, decode=rows))
        for r in prompts:
            assert_close(got[r], want[r], 5e-2)
            prompts[r] = [*prompts[r], int(want[r][-1].argmax())]


@pytest.mark.parametrize("kind", ["llama", "llama-gqa", "qwen2", "mistral", "qwen3", "phi4-mini"])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
def test_fused_step_equals_the_torch_path(kind: str, kv_dtype: str, isa: str) -> None:
    """Decode steps through the fused kernel (norms, QKV, RoPE, paged KV write, attention,
    MLP in C++) give the torch path's logits and write the same KV, for batches of different
    context lengths (mistral: past its sliding window of 8). The two paths share the GEMM
    kernels and differ in attention's fp32 summation order, which can move an int8
    activation across a rounding boundary: logits within 5e-2 of max|logit| (as in the
    test above). The pools agree to fp32 rounding / one fp16 ulp / one int8 step."""
    from tests.model_runner.oracle import random_ids

    fused, _ = quantized_pair(kind, "q4", fused_step=True, kv_dtype=kv_dtype)
    plain, _ = quantized_pair(kind, "q4", fused_step=False, kv_dtype=kv_dtype)
    assert fused.info.extra["fused_step"] == "true"
    assert plain.info.extra["fused_step"] == "false"
    prompts = {f"r{i}": random_ids(n, seed=i) for i, n in enumerate((3, 11, 17))}
    tables = {"r0": [5, 9], "r1": [1, 30, 2, 40, 41], "r2": [7, 8, 3, 4, 50, 51, 52]}
    decode_both(fused, plain, prompts, tables, 4)
    # Layer 0's K/V: the two paths' RMS norms round differently in fp32, which can move one
    # activation by one residual unit (d / 256): within 1e-4; deeper layers' within 5e-2 of
    # max, as the logits.
    if kv_dtype == "int8":
        diff = (fused.pool.data[0].int() - plain.pool.data[0].int()).abs().max().item()
        assert diff <= 1
        torch.testing.assert_close(fused.pool.scales[0], plain.pool.scales[0], rtol=1e-5, atol=1e-7)
    else:
        atol = 1e-4 if kv_dtype == "float32" else 2e-3
        torch.testing.assert_close(
            fused.pool.data[0].float(), plain.pool.data[0].float(), rtol=0, atol=atol
        )

    def values(pool: object) -> torch.Tensor:
        data = pool.data.float()  # type: ignore[attr-defined]
        scales = pool.scales  # type: ignore[attr-defined]
        return data if scales is None else data * scales.unsqueeze(-1)

    assert_close(values(fused.pool), values(plain.pool), 5e-2)


@pytest.mark.parametrize("kind", ["llama-gqa", "mistral", "qwen3"])
@pytest.mark.parametrize("kv_dtype", ["float16", "int8"])
def test_fused_attention_over_many_chunks_equals_the_torch_path(
    kind: str, kv_dtype: str, isa: str
) -> None:
    """The fused step's attention takes 16 positions a chunk (vector lanes where the head
    size allows: head_dim 16 here, qwen3's 32): contexts of 45 and 90 positions over
    scattered blocks span several chunks, a partial last one, the running maximum rescaled
    between them, and (mistral) a sliding window of 8 that starts inside a chunk. Each decode
    step's logits equal the torch path's within 5e-2 of max|logit| (as above)."""
    from tests.model_runner.oracle import random_ids

    fused, _ = quantized_pair(kind, "q4", fused_step=True, kv_dtype=kv_dtype)
    plain, _ = quantized_pair(kind, "q4", fused_step=False, kv_dtype=kv_dtype)
    order = [int(b) for b in torch.randperm(64, generator=torch.Generator().manual_seed(3))]
    prompts = {"a": random_ids(45, seed=1), "b": random_ids(90, seed=2)}
    tables = {"a": order[:13], "b": order[13:37]}
    decode_both(fused, plain, prompts, tables, 3)


@pytest.mark.parametrize("kind", ["llama-gqa", "mistral"])
def test_mixed_steps_run_fused_and_equal_the_torch_path(kind: str, isa: str) -> None:
    """A step holding prefill chunks and decodes runs as ONE fused kernel call (rows
    flattened: a chunk is consecutive rows of one block table) and gives the torch path's
    logits and KV: a fresh prompt, a second chunk over a cached prefix, and decodes at
    other lengths, in one step; then a prefill-only step. Logits and deeper layers' KV within
    5e-2 of max (int8 activation boundaries, as above); layer 0's KV to fp32 rounding. With
    ``fused_max_rows=32`` a 40-row step takes the torch path, a 32-row one the fused step."""
    from model_runner.step import StepRows
    from tests.model_runner.oracle import plan, random_ids, seq

    fused, _ = quantized_pair(kind, "q4", fused_step=True)
    plain, _ = quantized_pair(kind, "q4", fused_step=False)
    calls = []
    lib = fused.paths.fused.kernel.lib  # type: ignore[attr-defined]
    original = lib.kv_step_layers

    def counting(*args: object) -> None:
        calls.append(1)
        original(*args)

    a, b, c = random_ids(23, seed=1), random_ids(30, seed=2), random_ids(12, seed=3)
    ta, tb, tc = [3, 9, 10, 11, 12, 13], [1, 30, 2, 40, 41, 42, 43, 44], [7, 8, 14]
    first = plan(0, prefill=[seq("a", a, 0, 22, ta), seq("b", b, 0, 10, tb)])
    second = plan(1, prefill=[seq("b", b, 10, 30, tb), seq("c", c, 0, 12, tc)],
                  decode=[seq("a", a, 22, 23, ta)])  # fmt: skip
    lib.kv_step_layers = counting
    try:
        for step in (first, second):
            got = fused.step_logits(step)
            want = plain.step_logits(step)
            assert got.keys() == want.keys()
            for r in got:
                assert got[r].shape == want[r].shape
                assert_close(got[r], want[r], 5e-2)
    finally:
        lib.kv_step_layers = original
    assert len(calls) == 2, "each mixed step is one kernel call"
    # Layer 0's K/V: fp32 rounding of the two RMS norms, at most one residual unit (above).
    torch.testing.assert_close(fused.pool.data[0], plain.pool.data[0], rtol=0, atol=1e-4)
    assert_close(fused.pool.data, plain.pool.data, 5e-2)
    # Over the fused path's row bound, a step takes the torch path.
    bounded, _ = quantized_pair(kind, "q4", fused_step=True, fused_max_rows=32)
    big = plan(2, prefill=[seq("z", random_ids(40, seed=9), 0, 40, list(range(50, 60)))])
    small = plan(2, prefill=[seq("z", random_ids(32, seed=9), 0, 32, list(range(50, 60)))])
    limits = bounded.limits  # type: ignore[attr-defined]
    assert bounded.paths.choose(StepRows.of(big, limits)).name == "eager"  # type: ignore[attr-defined]
    assert bounded.paths.choose(StepRows.of(small, limits)).name == "fused"  # type: ignore[attr-defined]


def test_a_rows_numbers_do_not_depend_on_its_batch(isa: str) -> None:
    """Batch invariance: on the fused integer path a request's logits are bit-identical
    whether its rows run alone or beside other requests' chunks and decodes (per-row
    activation scales, per-row attention, and sums whose order does not depend on M)."""
    from tests.model_runner.oracle import plan, random_ids, seq

    a, b, c = random_ids(30, seed=11), random_ids(17, seed=12), random_ids(9, seed=13)
    ta, tb, tc = list(range(1, 9)), list(range(10, 15)), list(range(20, 23))
    alone, _ = quantized_pair("llama-gqa", "q4")
    crowd, _ = quantized_pair("llama-gqa", "q4")
    want = alone.step_logits(plan(0, prefill=[seq("a", a, 0, 29, ta)]))["a"]
    crowd.step_logits(plan(0, prefill=[seq("b", b, 0, 16, tb)]))
    got = crowd.step_logits(plan(1, prefill=[seq("c", c, 0, 9, tc), seq("a", a, 0, 29, ta)],
                                 decode=[seq("b", b, 16, 17, tb)]))["a"]  # fmt: skip
    assert torch.equal(got, want)
    want = alone.step_logits(plan(2, decode=[seq("a", a, 29, 30, ta)]))["a"]
    got = crowd.step_logits(plan(2, decode=[seq("b", b, 16, 17, tb), seq("a", a, 29, 30, ta)]))["a"]
    assert torch.equal(got, want)
