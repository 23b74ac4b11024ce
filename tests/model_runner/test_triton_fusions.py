"""The layer fusions (``model_runner.triton_fusions``) against the torch ops they replace, in
Triton's interpreter on CPU (compiled where there is a GPU), and compiled for sm_90."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from model_runner import triton_fusions as tf
from model_runner.config import RunnerOptions
from model_runner.kv_pool import KVPool
from model_runner.model import fusions_default
from model_runner.rope import RopeRows
from model_runner.runner import TorchRunner
from model_runner.step import StepRows
from model_runner.weights import onednn_works
from scheduler.output import ScheduledSeq
from scheduler.request import LoraRef
from tests.model_runner.lora_oracle import peft_adapter, with_lora
from tests.model_runner.oracle import our_config, plan, random_ids, seq, tiny_hf
from tests.model_runner.sm90 import compiled_counts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _tol(dtype: torch.dtype) -> float:
    """One rounding of the dtype at magnitudes up to ~4 (the interpreter's bf16 conversion
    truncates, so bf16 gets two ulps)."""
    return {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 6e-2}[dtype]


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_add_rms_norm_adds_into_the_residual_and_normalizes_it(
    dtype: torch.dtype, hidden: int
) -> None:
    """``residual += x`` in place (the dtype's rounding of the fp32 sum), and the output
    equals ``F.rms_norm`` of the new residual; without ``x`` the residual is left as is.
    A width that is not a power of two (96) is masked."""
    x = _randn(5, hidden, dtype=dtype, seed=1)
    residual = _randn(5, hidden, dtype=dtype, seed=2)
    weight = _randn(hidden, dtype=dtype, seed=3)
    added = (residual.float() + x.float()).to(dtype)
    ref = F.rms_norm(added.float(), (hidden,), weight.float(), 1e-5)
    out = tf.add_rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual.float(), added.float(), atol=_tol(dtype), rtol=0)
    torch.testing.assert_close(out.float(), ref, atol=_tol(dtype), rtol=_tol(dtype))
    assert out.dtype == dtype and out.shape == (5, hidden)
    before = residual.clone()
    norm_only = tf.add_rms_norm(None, residual, weight, 1e-5)
    assert torch.equal(residual, before)
    torch.testing.assert_close(norm_only, out, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_silu_of_the_gate_times_up(dtype: torch.dtype) -> None:
    """``silu(gate) * up`` of a [T, 2 I] row block, I not a power of two (48), and rows
    with a stride past their width (a view)."""
    wide = _randn(4, 2 * 48 + 8, dtype=dtype, seed=4)
    gate_up = wide[:, : 2 * 48]
    ref = F.silu(gate_up[:, :48].float()) * gate_up[:, 48:].float()
    out = tf.silu_mul(gate_up)
    assert out.shape == (4, 48) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=_tol(dtype), rtol=_tol(dtype))


def _rope_reference(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, n_rot: int
) -> None:
    """The model's half-precision RoPE in place (``rope.RopeRows``, the interleaved pairs)."""
    d = qkv.shape[-1]
    rot = qkv[:, :n_rot].unflatten(-1, (d // 2, 2))
    RopeRows(cos=cos[positions].unsqueeze(1), sin=sin[positions].unsqueeze(1)).rotate_(rot)


@pytest.mark.parametrize("pool_dtype", [None, torch.float32])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2), (6, 2)])
def test_rope_kv_write_rotates_q_and_k_and_writes_the_pool(
    dtype: torch.dtype, pool_dtype: torch.dtype | None, heads: tuple[int, int]
) -> None:
    """Q and K rotated in place as ``rope.RopeRows`` does, V untouched; rotated K and V
    of each row land in its slot of a ``KVPool`` layer exactly as ``KVPool.write`` puts
    them (other slots and layers untouched), in the pool's dtype (the compute dtype, or
    fp32). 6 query heads pad to 8 (masked)."""
    num_heads, kvh = heads
    d, rows, max_len = 16, 5, 32
    qkv = _randn(rows, num_heads + 2 * kvh, d, dtype=dtype, seed=5)
    angles = torch.outer(torch.arange(max_len).float(), torch.rand(d // 2) + 0.1)
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    positions = torch.tensor([0, 3, 31, 7, 7], device=DEVICE)
    slots = torch.tensor([9, 0, 23, 4, 17], device=DEVICE)
    store = pool_dtype or dtype
    ours = KVPool(2, kvh, d, 6, 4, store, DEVICE, compute_dtype=dtype)
    ref_pool = KVPool(2, kvh, d, 6, 4, store, DEVICE, compute_dtype=dtype)
    ref = qkv.clone()
    _rope_reference(ref, cos, sin, positions, num_heads + kvh)
    ref_pool.write(1, ref[:, num_heads:], slots)

    tf.rope_kv_write(qkv, cos, sin, positions, slots, ours.data[1], num_heads)
    tol = _tol(dtype)
    torch.testing.assert_close(qkv.float(), ref.float(), atol=tol, rtol=tol)
    assert torch.equal(qkv[:, num_heads + kvh :], ref[:, num_heads + kvh :])  # V as it was
    torch.testing.assert_close(ours.data.float(), ref_pool.data.float(), atol=tol, rtol=tol)
    assert ours.data.dtype == store and not ours.data[0].any()
    written = ours.data[1].flatten(1, 2)  # [2 * kvh, slots, d]
    untouched = [s for s in range(24) if s not in slots.tolist()]
    assert not written[:, untouched].any()


def test_rope_kv_write_reads_fp32_tables_with_a_stride() -> None:
    """The fp32 model's complex table viewed as (cos, sin) with element stride 2
    (``torch.view_as_real``) rotates as the complex multiply does."""
    num_heads, kvh, d = 4, 2, 16
    angles = torch.outer(torch.arange(16).float(), torch.rand(d // 2) + 0.1).to(DEVICE)
    cis = torch.polar(torch.ones_like(angles), angles)
    pairs = torch.view_as_real(cis)
    qkv = _randn(3, num_heads + 2 * kvh, d, dtype=torch.float32, seed=6)
    positions = torch.tensor([1, 15, 4], device=DEVICE)
    ref = qkv.clone()
    rot = torch.view_as_complex(ref[:, : num_heads + kvh].unflatten(-1, (d // 2, 2)))
    rot.mul_(cis[positions].unsqueeze(1))
    pool = KVPool(1, kvh, d, 2, 4, torch.float32, DEVICE)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    tf.rope_kv_write(qkv, pairs[..., 0], pairs[..., 1], positions, slots, pool.data[0], num_heads)
    torch.testing.assert_close(qkv, ref, atol=1e-5, rtol=1e-5)


def test_the_fusions_refuse_what_they_cannot_run() -> None:
    """A head_dim that is not a power of two, a pool layer of another shape, an odd
    gate_up width: ``ValueError`` naming the problem."""
    qkv = torch.zeros(2, 8, 12)
    pool = KVPool(1, 2, 12, 2, 4, torch.float32)
    table = torch.zeros(8, 6)
    with pytest.raises(ValueError, match="power of two"):
        tf.rope_kv_write(qkv, table, table, torch.zeros(2), torch.zeros(2), pool.data[0], 4)
    with pytest.raises(ValueError, match="does not hold"):
        tf.rope_kv_write(torch.zeros(2, 8, 16), table, table, torch.zeros(2), torch.zeros(2),
                         pool.data[0], 2)  # fmt: skip
    with pytest.raises(ValueError, match="even"):
        tf.silu_mul(torch.zeros(2, 7))


def test_fusions_compile_to_16_byte_accesses_without_spills_for_sm90() -> None:
    """At Llama-3-8B's shapes in bf16 (hidden 4096, 32 / 8 heads of 128, MLP 14336): every
    load and store of a row moves 16 bytes (``v4.b32``), RoPE's tables 8 (``v2.b32``), the
    position and slot one int64 each; nothing is spilled to local memory."""
    counts = compiled_counts("tests.model_runner.fusions_codegen")
    allowed = {
        "add_rms_norm": {"ld.global.v4.b32", "st.global.v4.b32"},
        "silu_mul": {"ld.global.v4.b32", "st.global.v4.b32"},
        "rope_kv_write": {"ld.global.v4.b32", "st.global.v4.b32", "ld.global.v2.b32",
                          "ld.global.b64"},
    }  # fmt: skip
    for name, ops in allowed.items():
        c = counts[name]
        assert c.pop(".local") == 0, (name, counts)
        assert set(c) == ops, (name, counts)
        assert c["ld.global.v4.b32"] > 0 and c["st.global.v4.b32"] > 0, (name, counts)
    assert counts["rope_kv_write"]["ld.global.b64"] == 2, counts  # the position and the slot


def _steps(
    runner: TorchRunner, fusions: bool, lora: LoraRef | None = None
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Logits of a prefill step (two chunks, one over a cached prefix) then two decode
    steps, and the pool after them, with the model's fusions on or off; request "a" runs
    with adapter ``lora``."""
    runner.model.fusions = fusions
    runner.pool.data.zero_()
    a, b = random_ids(12, seed=7), random_ids(11, seed=8)
    ta, tb = [0, 1, 5], [2, 3, 4]

    def on_a(start: int, end: int, table: list[int]) -> ScheduledSeq:
        return with_lora(seq("a", a, start, end, table), lora)

    steps = [
        plan(0, prefill=[on_a(0, 8, ta[:2]), seq("b", b, 0, 9, tb)]),
        plan(1, prefill=[on_a(8, 11, ta)], decode=[seq("b", b, 9, 10, tb)]),
        plan(2, decode=[on_a(11, 12, ta), seq("b", b, 10, 11, tb)]),
    ]
    logits = [torch.cat(list(runner.step_logits(p).values())) for p in steps]
    return logits, runner.pool.data.clone()


@pytest.mark.parametrize(
    ("backend", "dtype", "tol"),
    [("torch", "float32", 1e-4), ("triton", "float32", 1e-4), ("torch", "bfloat16", 0.2)],
)
@pytest.mark.parametrize("kind", ["llama-gqa", "qwen3", "phi4-mini"])
def test_the_fused_forward_equals_the_torch_forward(
    backend: str, dtype: str, tol: float, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny GQA model's logits and pool over prefill chunks (one attending to a cached
    prefix), a mixed step and a decode step: the same with the fusions as without, on both
    attention backends (bf16: within its rounding); the fused forward calls each fusion
    once per layer (the first norm once per step). Qwen3: its QK-norm before the fused
    RoPE + KV write."""
    hf = tiny_hf(kind)
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    options = RunnerOptions(
        num_blocks=8, block_size=4, kv_dtype=dtype, dtype=dtype, device=DEVICE, use_onednn=False,
        attention_backend=backend, cuda_graphs=False,
    )  # fmt: skip
    runner = TorchRunner(our_config(hf), state, options)
    ref_logits, ref_pool = _steps(runner, fusions=False)
    calls: dict[str, int] = {}
    for name in ("add_rms_norm", "rope_kv_write", "silu_mul"):
        real = getattr(tf, name)

        def counted(*args: object, _real: object = real, _name: str = name) -> object:
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args)  # type: ignore[operator]

        monkeypatch.setattr(tf, name, counted)
    logits, pool = _steps(runner, fusions=True)
    layers = runner.config.num_layers
    assert calls == {"add_rms_norm": 3 * 2 * layers, "rope_kv_write": 3 * layers,
                     "silu_mul": 3 * layers}  # fmt: skip
    for ours, ref in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=0)
    torch.testing.assert_close(pool.float(), ref_pool.float(), atol=tol, rtol=0)
    if dtype == "float32":  # greedy tokens too
        assert [x.argmax(-1).tolist() for x in logits] == [
            x.argmax(-1).tolist() for x in ref_logits
        ]


def test_the_fused_forward_adds_a_steps_adapters_as_the_torch_forward(tmp_path: Path) -> None:
    """The step's adapter updates (``ForwardBatch.adapters``) go in after each projection
    on the fused forward as on the torch forward: the same logits and pool for a step of an
    adapter's rows beside base rows, and the adapter's rows unlike the base model's."""
    hf = tiny_hf("llama-gqa")
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    options = RunnerOptions(
        num_blocks=8, block_size=4, dtype="float32", device=DEVICE, use_onednn=False,
        cuda_graphs=False,
    )  # fmt: skip
    runner = TorchRunner(our_config(hf), state, options)
    peft_adapter(hf, tmp_path / "x", r=4, seed=3)
    runner.lora.load("x", tmp_path / "x")
    ref = runner.lora.resolve("x")
    base, _ = _steps(runner, fusions=False)
    want, want_pool = _steps(runner, fusions=False, lora=ref)
    got, pool = _steps(runner, fusions=True, lora=ref)
    for ours, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    # The pool holds the default KV dtype (fp16 on CPU): the two forwards' fp32 K and V differ
    # in their last bits, so a value on a rounding boundary may land one fp16 step (2^-10 of
    # it) apart (the EPYC family 25 model 17: one of 4096, 2.4e-4 at 0.46).
    assert pool.dtype == torch.float16
    torch.testing.assert_close(pool.float(), want_pool.float(), atol=1e-4, rtol=2**-10)
    assert (want[0][:8] - base[0][:8]).abs().max() > 1e-2  # "a"'s rows: the adapter's
    torch.testing.assert_close(want[0][8:], base[0][8:], atol=1e-5, rtol=0)  # "b": the base


def test_the_fusions_stay_off_where_they_do_not_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off on CPU by default, and on a CUDA model with ``KVSERVE_FUSIONS=0``; off with
    oneDNN-packed layers, an int8 pool, or positions past the RoPE table (attention sinks):
    the torch forward."""
    hf = tiny_hf("llama-gqa")
    state = {k: v.detach().cpu() for k, v in hf.state_dict().items()}
    config = our_config(hf)
    options = RunnerOptions(
        num_blocks=8, block_size=4, dtype="float32", device="cpu", use_onednn=False
    )
    runner = TorchRunner(config, state, options)
    step = StepRows.of(plan(0, prefill=[seq("a", [5, 6], 0, 2, [0])]), runner.limits)
    batch = runner.attention.build(step)
    model, pool = runner.model, runner.pool
    assert not model.fusions and model._fusion_ops(batch, pool) is None  # a CPU model: off
    assert fusions_default(torch.device("cuda")) and not fusions_default(torch.device("cpu"))
    monkeypatch.setenv("KVSERVE_FUSIONS", "0")
    assert not fusions_default(torch.device("cuda"))
    model.fusions = True
    assert model._fusion_ops(batch, pool) is tf
    batch.max_position = model.max_model_len
    assert model._fusion_ops(batch, pool) is None
    batch.max_position = 1
    int8 = TorchRunner(config, state, replace(options, kv_dtype="int8"))
    int8.model.fusions = True
    assert int8.model._fusion_ops(batch, int8.pool) is None
    if onednn_works(torch.float32):
        packed = TorchRunner(config, state, replace(options, use_onednn=True))
        packed.model.fusions = True
        assert packed.model._fusion_ops(batch, packed.pool) is None
