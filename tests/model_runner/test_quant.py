"""Quantized weights and kvserve's CPU kernels (model_runner/quant.py, model_runner/kernels).

The reference for every format is dequantize-then-matmul (float64). From 3 rows up the kernels
dequantize each weight block in registers and keep activations fp32: they may differ from the
reference only by fp32 summation order, |err| <= 1e-5 * max|y|. One or two rows (low-batch
decode) quantize activations to int16 per 32-block: |err| <= 1e-4 * max|y| (measured ~2.5e-5).
The panel path (above ``SKINNY_MAX_ROWS`` rows: dequantized panels + oneDNN's GEMM, or torch's
where oneDNN is missing) meets the fp32 bound.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from model_runner import kernels, quant

pytestmark = pytest.mark.skipif(not kernels.available(), reason="kernels not built")

ISAS = ["avx2", "portable"]


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest) -> str:
    wanted = request.param == "avx2"
    if kernels.use_simd(wanted) != wanted:
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    yield request.param
    kernels.use_simd(True)


@pytest.fixture(params=[1, 2])
def threads(request: pytest.FixtureRequest) -> int:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def gguf_weight(type_name: str, n: int, k: int, seed: int = 0) -> quant.QuantWeight:
    """A random [n, k] weight quantized by the gguf package, repacked by ours."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    raw = gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, type_name))
    return quant.from_gguf_blocks(raw, type_name, (n, k))


def make_weight(fmt: str, n: int, k: int, seed: int = 0) -> quant.QuantWeight:
    if fmt in quant.NATIVE_GGUF_TYPES:
        return gguf_weight(fmt, n, k, seed)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return quant.quantize_int8(w) if fmt == "int8" else quant.quantize_q4(w)


def reference(w: quant.QuantWeight, x: torch.Tensor) -> torch.Tensor:
    """x @ dequantize(W).T in float64: the kernels keep activations fp32 and dequantize the
    weights exactly, so they may differ from this only by fp32 summation order."""
    return x.double() @ w.dequantize().double().T


def tolerance(rows: int, k: int) -> float:
    """1e-4 where activations go int16 (SIMD, 1-2 rows, whole blocks), else 1e-5."""
    int16 = rows <= 2 and k % quant.QK == 0 and kernels.isa() == "avx2"
    return 1e-4 if int16 else 1e-5


def assert_close(y: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    scale = ref.abs().max().item()
    err = (y.double() - ref.double()).abs().max().item()
    assert err <= rel * scale, f"max abs err {err:.3g} > {rel} * {scale:.3g}"


FORMATS = ["Q4_0", "Q4_1", "Q8_0", "int8"]
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 16, 31, 40, 64]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n, k", [(64, 96), (7, 32), (33, 160)])
def test_skinny_gemm_matches_both_references(
    fmt: str, n: int, k: int, isa: str, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """y = x W^T for M = 1..64 rows (every kernel path, tile and tail: the fused decode runs
    them up to its batch size, past QLinear's own SKINNY_MAX_ROWS) and N tails (7, 33) equals
    the dequantized matmul within the stated tolerances."""
    monkeypatch.setattr(quant, "SKINNY_MAX_ROWS", max(ROWS))
    w = make_weight(fmt, n, k)
    lin = quant.QLinear(w, None)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = lin(x)
        assert y.shape == (m, n)
        assert_close(y, reference(w, x), tolerance(m, k))


@pytest.mark.parametrize("k", [45, 100, 33])
def test_int8_odd_k_is_zero_padded(k: int, isa: str, threads: int) -> None:
    """int8 per-channel weights with K not a multiple of 32 (padded blocks) give the same
    results as an unpadded fp32 matmul, for every row count."""
    w = make_weight("int8", 19, k, seed=k)
    assert w.qs.shape == (19, w.num_blocks * 32) and w.dequantize().shape == (19, k)
    lin = quant.QLinear(w, None)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        assert_close(lin(x), reference(w, x), tolerance(m, k))


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_rows_use_panels_and_match_dequantized(fmt: str, threads: int) -> None:
    """Above SKINNY_MAX_ROWS (and with the LM head split into several panels) QLinear equals
    x @ dequantize(W).T to fp32 rounding."""
    w = make_weight(fmt, 40, 64)
    lin = quant.QLinear(w, torch.randn(40))
    for m in (quant.SKINNY_MAX_ROWS + 1, 64, 100):
        x = torch.randn(m, 64)
        assert_close(lin(x), x @ w.dequantize().T + lin.bias, 1e-5)
    old = quant.PANEL_ELEMENTS
    quant.PANEL_ELEMENTS = 64 * 7  # 7-row panels: 40 rows = 5 full panels + a tail of 5
    try:
        x = torch.randn(50, 64)
        assert_close(lin(x), x @ w.dequantize().T + lin.bias, 1e-5)
    finally:
        quant.PANEL_ELEMENTS = old


def test_panels_fall_back_to_torch_matmul_without_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where oneDNN cannot run a plain weight, the panel path uses torch.matmul: same result."""
    from model_runner import onednn

    w = make_weight("Q4_1", 40, 64)
    lin = quant.QLinear(w, torch.randn(40))
    x = torch.randn(100, 64)
    fast = lin(x)
    monkeypatch.setattr(onednn, "plain_weights_work", lambda: False)
    slow = lin(x)
    assert_close(slow, x @ w.dequantize().T + lin.bias, 1e-5)
    assert_close(fast, slow, 1e-5)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_fused_epilogues(fmt: str, m: int, isa: str) -> None:
    """add (residual + xW^T + b) and silu_mul (silu(x Wg^T) * x Wu^T) equal the unfused ops on
    the same kernel results, on the skinny and the panel path."""
    w = make_weight(fmt, 64, 96)
    bias = torch.randn(64)
    lin = quant.QLinear(w, bias)
    x = torch.randn(m, 96)
    residual = torch.randn(m, 64)
    plain = lin(x)
    res_copy = residual.clone()
    torch.testing.assert_close(lin.add(x, residual), plain + residual, rtol=1e-5, atol=1e-5)
    assert torch.equal(residual, res_copy), "add must not modify the residual"
    fused = lin.silu_mul(x)
    expected = torch.nn.functional.silu(plain[:, :32]) * plain[:, 32:]
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)


def test_avx2_and_portable_paths_agree() -> None:
    """The SIMD and the portable code agree to fp32 summation-order rounding."""
    if not kernels.use_simd(True):
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    try:
        for fmt in FORMATS:
            w = make_weight(fmt, 48, 128)
            x = torch.randn(9, 128)
            simd = quant.QLinear(w, None)(x)
            kernels.use_simd(False)
            portable = quant.QLinear(w, None)(x)
            kernels.use_simd(True)
            torch.testing.assert_close(simd, portable, rtol=1e-5, atol=1e-4)
    finally:
        kernels.use_simd(True)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_repack_dequantizes_like_gguf(fmt: str) -> None:
    """Our repacked blocks dequantize to exactly what the gguf package decodes."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((24, 96)).astype(np.float32)
    qtype = getattr(gguf.GGMLQuantizationType, fmt)
    raw = gguf.quants.quantize(w, qtype)
    ours = quant.from_gguf_blocks(raw, fmt, (24, 96)).dequantize()
    theirs = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32))
    torch.testing.assert_close(ours, theirs.reshape(24, 96), rtol=0, atol=1e-6)


def test_row_operations_are_exact() -> None:
    """rows() permutes, scaled() multiplies, cat_rows() stacks: each commutes with
    dequantize() (what the model's Q/K interleave, softmax-scale fold and QKV fusion use)."""
    a, b = make_weight("Q4_1", 16, 64), make_weight("Q4_1", 8, 64, seed=3)
    perm = torch.randperm(16)
    torch.testing.assert_close(a.rows(perm).dequantize(), a.dequantize()[perm])
    torch.testing.assert_close(a.scaled(0.125).dequantize(), a.dequantize() * 0.125)
    both = quant.cat_rows([a, b])
    torch.testing.assert_close(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    assert both.source == "Q4_1"
    with pytest.raises(ValueError, match="one format"):
        quant.cat_rows([a, make_weight("Q8_0", 8, 64)])


def test_embedding_rows_dequantize_exactly() -> None:
    """QEmbedding returns exactly the dequantized rows asked for, repeats included."""
    w = make_weight("Q8_0", 50, 64)
    ids = torch.tensor([3, 0, 49, 3])
    torch.testing.assert_close(quant.QEmbedding(w)(ids), w.dequantize()[ids], rtol=0, atol=0)


def test_nbytes_counts_the_compressed_form() -> None:
    """A Q4 weight holds 0.5 byte per value plus two fp32 scales per 32-block; Q8 1 + 4/32."""
    n, k = 64, 256
    q4, q8 = make_weight("Q4_1", n, k), make_weight("Q8_0", n, k)
    assert q4.nbytes == n * k // 2 + 2 * 4 * n * k // 32
    assert q8.nbytes == n * k + 4 * n * k // 32


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


def quantized_pair(kind: str, fmt: str, **kwargs: object) -> tuple[object, torch.nn.Module]:
    """Our runner on quantized matrices, and transformers on exactly their dequantized values."""
    from model_runner.runner import TorchRunner
    from tests.model_runner.oracle import our_config, tiny_hf

    hf = tiny_hf(kind)
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
    runner = TorchRunner(our_config(hf), weights, 64, 4, torch.float32, "cpu", **kwargs)
    return runner, hf


@pytest.mark.parametrize("kind", ["llama", "llama-gqa", "qwen2"])
@pytest.mark.parametrize("fmt", ["int8", "q4"])
def test_quantized_model_tracks_its_dequantized_reference(kind: str, fmt: str) -> None:
    """Prefill (kernel rows and panel rows) and decode logits of the quantized model equal
    transformers' on the dequantized weights: atol 1e-4 (the fp32 oracle's) where
    activations stay fp32, 1e-3 for single-row decode steps (int16 activations, ~5e-4)."""
    from tests.model_runner.oracle import hf_logits, plan, random_ids, seq

    runner, hf = quantized_pair(kind, fmt)
    assert runner.info.extra["weights"] in ("int8", "q4")
    ids = random_ids(50, seed=5)
    ref = hf_logits(hf, ids)
    blocks = list(range(13))
    short = runner.step_logits(plan(0, prefill=[seq("a", ids, 0, 20, blocks)]))["a"]
    torch.testing.assert_close(short, ref[:20], rtol=0, atol=1e-4)
    for pos in range(20, 24):
        out = runner.step_logits(plan(pos, decode=[seq("a", ids, pos, pos + 1, blocks)]))["a"]
        torch.testing.assert_close(out, ref[pos : pos + 1], rtol=0, atol=1e-3)
    long_blocks = list(range(20, 33))
    long = runner.step_logits(plan(9, prefill=[seq("b", ids, 0, 50, long_blocks)]))["b"]
    torch.testing.assert_close(long, ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "llama-gqa", "qwen2", "mistral"])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
def test_fused_decode_equals_the_torch_path(kind: str, kv_dtype: str, isa: str) -> None:
    """Decode steps through the fused kernel (norms, QKV, RoPE, paged KV write, attention,
    MLP in C++) give the torch path's logits and write the same KV, for batches of different
    context lengths (mistral: past its sliding window of 8). Logits: atol 1e-4 on an fp32
    pool; 5e-4 on fp16 / int8 pools, where the two paths may round a stored K/V value one
    step apart (the pools themselves agree to one fp16 ulp / one int8 quantization step)."""
    from tests.model_runner.oracle import plan, random_ids, seq

    fused, _ = quantized_pair(kind, "q4", fused_decode=True, kv_dtype=kv_dtype)
    plain, _ = quantized_pair(kind, "q4", fused_decode=False, kv_dtype=kv_dtype)
    assert fused.info.extra["fused_decode"] == "true"
    assert plain.info.extra["fused_decode"] == "false"
    prompts = {f"r{i}": random_ids(n, seed=i) for i, n in enumerate((3, 11, 17))}
    tables = {"r0": [5, 9], "r1": [1, 30, 2, 40, 41], "r2": [7, 8, 3, 4, 50, 51, 52]}
    for runner in (fused, plain):
        chunks = [seq(r, ids, 0, len(ids) - 1, tables[r]) for r, ids in prompts.items()]
        runner.step_logits(plan(0, prefill=chunks))
    for step in range(4):
        rows = [seq(r, ids, len(ids) - 1, len(ids), tables[r]) for r, ids in prompts.items()]
        got = fused.step_logits(plan(1 + step, decode=rows))
        want = plain.step_logits(plan(1 + step, decode=rows))
        logit_atol = 1e-4 if kv_dtype == "float32" else 5e-4
        for r in prompts:
            torch.testing.assert_close(got[r], want[r], rtol=0, atol=logit_atol)
            prompts[r] = [*prompts[r], int(want[r][-1].argmax())]
    if kv_dtype == "int8":
        diff = (fused.pool.data.int() - plain.pool.data.int()).abs().max().item()
        assert diff <= 1
        torch.testing.assert_close(fused.pool.scales, plain.pool.scales, rtol=1e-5, atol=1e-7)
    else:
        atol = 1e-5 if kv_dtype == "float32" else 2e-3
        torch.testing.assert_close(
            fused.pool.data.float(), plain.pool.data.float(), rtol=0, atol=atol
        )
