"""Quantized weights: the format is decided once, at load, and the model only calls ``forward``.

    --weights float32   every weight dequantized to the run dtype (the oneDNN / torch path)
    --weights native    a GGUF's Q8_0 / Q4_0 / Q4_1 tensors stay quantized (other GGUF types
                        are dequantized and re-quantized to int8); fp checkpoints stay fp
    --weights int8      every linear weight int8 per output channel (quantized at load)
    --weights auto      native for a GGUF on CPU with fp32 compute and working kernels,
                        else float32

A ``QuantWeight`` is the repacked form the kernels read (``model_runner/kernels/kernels.cpp``):

    q4  qs uint8 [N, KB * 16]   w = q * d + m   (Q4_1 as stored; Q4_0 has m = -8 d)
        d, m fp32 [N, KB]
    q8  qs int8  [N, KB * 32]   w = q * d       (Q8_0 per 32-block; int8 per row)
        d fp32 [N, KB]

with ``KB = ceil(K / 32)``; a K that is not a multiple of 32 is zero-padded. Scales are fp32
(GGUF's are fp16) so that row operations at load (fusing Q, K and V, folding the softmax scale
into Q) stay exact.

``QLinear`` has ``Linear``'s interface. Up to ``SKINNY_MAX_ROWS`` rows (decode, and short
prefill chunks) it runs the kernels: one or two rows with int16 activations, up to 8 rows with
weight blocks dequantized in registers and shared by the rows, more rows through a
register-blocked micro-kernel over dequantized chunks of weight rows. Above that (prefill) it
dequantizes the weight a panel at a time into a reused fp32 buffer and runs oneDNN's GEMM on
it, so prefill keeps BLAS speed and the weights stay 4-8x smaller in memory. The crossover
was measured on SmolLM2's 120 layer matrices, 2 threads: kernels 11.6 / 47.1 / 72.2 / 93.3 ms
against panels 39.9 / 52.1 / 71.3 / 79.3 ms at 8 / 32 / 48 / 64 rows.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from model_runner import kernels, onednn

logger = logging.getLogger(__name__)

WeightsMode = Literal["auto", "float32", "native", "int8"]
WEIGHT_MODES: tuple[str, ...] = ("auto", "float32", "native", "int8")
QK = 32
# GGUF tensor types kept as they are under --weights native.
NATIVE_GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0")
# Parameter names (Hugging Face's) of the matrices a weights mode may quantize.
MATRIX_SUFFIXES = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")
# Up to this many rows, the kernels; above, panel dequantization + torch GEMM.
SKINNY_MAX_ROWS = 40
# fp32 elements of the shared dequantization buffer (16 MiB): the LM head goes in panels.
PANEL_ELEMENTS = 1 << 22


@dataclass(slots=True)
class QuantWeight:
    """A quantized ``[out_features, in_features]`` weight in the kernels' layout."""

    fmt: Literal["q4", "q8"]
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    in_features: int
    source: str  # what it was: "Q4_1", "Q8_0", "int8", ...

    def __post_init__(self) -> None:
        kb = self.num_blocks
        per_block = QK // 2 if self.fmt == "q4" else QK
        if self.qs.shape != (self.out_features, kb * per_block) or self.d.shape != (
            self.out_features,
            kb,
        ):
            raise ValueError(
                f"{self.fmt} weight of {self.out_features}x{self.in_features}: qs "
                f"{tuple(self.qs.shape)}, d {tuple(self.d.shape)} do not fit"
            )
        if (self.fmt == "q4") != (self.m is not None):
            raise ValueError("q4 weights carry m, q8 weights do not")

    @property
    def out_features(self) -> int:
        return int(self.qs.shape[0])

    @property
    def num_blocks(self) -> int:
        return -(-self.in_features // QK)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        total = self.qs.nbytes + self.d.nbytes
        return total + (self.m.nbytes if self.m is not None else 0)

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """The rows ``index`` (a permutation or a selection), as a new weight."""
        m = self.m.index_select(0, index) if self.m is not None else None
        return QuantWeight(
            self.fmt,
            self.qs.index_select(0, index),
            self.d.index_select(0, index),
            m,
            self.in_features,
            self.source,
        )

    def scaled(self, factor: float) -> QuantWeight:
        """``factor * W`` (scales only, so exact up to fp32 rounding of the scales)."""
        m = self.m * factor if self.m is not None else None
        return QuantWeight(self.fmt, self.qs, self.d * factor, m, self.in_features, self.source)

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[N, K]``: the reference the kernels are tested against (pure torch)."""
        n, kb = self.out_features, self.num_blocks
        if self.fmt == "q4":
            assert self.m is not None
            packed = self.qs.view(n, kb, QK // 2)
            q = torch.cat([packed & 0x0F, packed >> 4], dim=2).float()
            w = q * self.d.unsqueeze(2) + self.m.unsqueeze(2)
        else:
            w = self.qs.view(n, kb, QK).float() * self.d.unsqueeze(2)
        return w.reshape(n, kb * QK)[:, : self.in_features].contiguous()


def cat_rows(weights: list[QuantWeight]) -> QuantWeight:
    """Stack weights of the same format and ``in_features`` (e.g. Q, K and V into one)."""
    first = weights[0]
    if any(w.fmt != first.fmt or w.in_features != first.in_features for w in weights):
        raise ValueError("cat_rows needs weights of one format and in_features")
    m = torch.cat([w.m for w in weights if w.m is not None]) if first.m is not None else None
    sources = "+".join(dict.fromkeys(w.source for w in weights))
    return QuantWeight(
        first.fmt,
        torch.cat([w.qs for w in weights]),
        torch.cat([w.d for w in weights]),
        m,
        first.in_features,
        sources,
    )


# ---------------------------------------------------------------------- making weights


def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantWeight:
    """Repack a GGUF Q8_0 / Q4_0 / Q4_1 tensor (raw block bytes, ``[N, bytes per row]``)."""
    n, k = shape
    if k % QK:
        raise ValueError(f"{type_name} rows of {k} values are not whole 32-blocks")
    kb = k // QK
    blocks = np.ascontiguousarray(raw).reshape(n, kb, -1)
    if type_name == "Q8_0":
        d = blocks[:, :, 0:2].copy().view(np.float16).reshape(n, kb)
        qs = blocks[:, :, 2:34].reshape(n, kb * QK).copy().view(np.int8)
        return QuantWeight("q8", torch.from_numpy(qs), _f32(d), None, k, type_name)
    if type_name == "Q4_0":
        d = blocks[:, :, 0:2].copy().view(np.float16).reshape(n, kb)
        qs = blocks[:, :, 2:18].reshape(n, kb * QK // 2).copy()
        scale = _f32(d)
        return QuantWeight("q4", torch.from_numpy(qs), scale, scale * -8.0, k, type_name)
    if type_name == "Q4_1":
        d = blocks[:, :, 0:2].copy().view(np.float16).reshape(n, kb)
        m = blocks[:, :, 2:4].copy().view(np.float16).reshape(n, kb)
        qs = blocks[:, :, 4:20].reshape(n, kb * QK // 2).copy()
        return QuantWeight("q4", torch.from_numpy(qs), _f32(d), _f32(m), k, type_name)
    raise ValueError(f"GGUF type {type_name} is not kept natively ({', '.join(NATIVE_GGUF_TYPES)})")


def _f32(half: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(half.astype(np.float32))


def quantize_int8(weight: torch.Tensor) -> QuantWeight:
    """Symmetric int8 per output channel: ``w[n, :] ~= q[n, :] * s[n]``, ``s = amax / 127``."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    kb = -(-k // QK)
    scale = w.abs().amax(dim=1) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(w * inv.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    padded = torch.zeros(n, kb * QK, dtype=torch.int8)
    padded[:, :k] = q
    d = scale.unsqueeze(1).expand(n, kb).contiguous()
    return QuantWeight("q8", padded, d, None, k, "int8")


def quantize_q4(weight: torch.Tensor) -> QuantWeight:
    """Asymmetric 4-bit per 32-block (Q4_1's rule: ``d = (max - min) / 15``, ``m = min``);
    used by the tests to make q4 weights of any shape."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    kb = -(-k // QK)
    padded = torch.zeros(n, kb * QK)
    padded[:, :k] = w
    blocks = padded.view(n, kb, QK)
    lo = blocks.amin(dim=2)
    hi = blocks.amax(dim=2)
    d = (hi - lo) / 15.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round((blocks - lo.unsqueeze(2)) * inv.unsqueeze(2)).clamp_(0, 15).to(torch.uint8)
    qs = (q[:, :, : QK // 2] | (q[:, :, QK // 2 :] << 4)).reshape(n, kb * QK // 2)
    # Padding beyond k dequantizes to whatever the block's rule gives: the kernels multiply it
    # by zero activations, and the m term uses the sum of the real activations only.
    return QuantWeight("q4", qs.contiguous(), d.contiguous(), lo.contiguous(), k, "q4")


def resolve_weights_mode(
    mode: str, is_gguf: bool, device: str | torch.device | None, dtype: torch.dtype
) -> str:
    """``--weights`` -> ``"float32"``, ``"native"`` or ``"int8"`` for this checkpoint and machine.

    The kernels run on CPU with fp32 compute. ``auto`` keeps a GGUF's quantization there and
    dequantizes elsewhere; an explicit ``native`` / ``int8`` elsewhere is a ``ValueError``.
    Without the kernels (no compiler), every mode serves fp32 weights (logged once)."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"unknown weights mode {mode!r}: use one of {', '.join(WEIGHT_MODES)}")
    if mode == "float32":
        return mode
    from model_runner.device import select_device

    runs_here = select_device(device).type == "cpu" and dtype == torch.float32
    if mode == "auto":
        if not (is_gguf and runs_here):
            return "float32"
        mode = "native"
    elif not runs_here:
        raise ValueError(
            f"--weights {mode} runs on the CPU kernels with float32 compute; this run is on "
            f"{device} with {dtype}: use --weights float32 (or auto), or --device cpu"
        )
    if not kernels.available():  # kernels.load() has logged why
        return "float32"
    return mode


def quantize_matrices(
    state_dict: Mapping[str, torch.Tensor | QuantWeight],
) -> dict[str, torch.Tensor | QuantWeight]:
    """``--weights int8``: every matrix (linear layers, embedding, LM head) int8 per row."""
    out: dict[str, torch.Tensor | QuantWeight] = {}
    for name, value in state_dict.items():
        if isinstance(value, QuantWeight):
            value = quantize_int8(value.dequantize())
        elif value.dim() == 2 and name.endswith(MATRIX_SUFFIXES):
            value = quantize_int8(value)
        out[name] = value
    return out


# ---------------------------------------------------------------------- running them


class _Panel(threading.local):
    """A reused fp32 buffer for dequantized weight panels (one per thread)."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0)

    def get(self, numel: int) -> torch.Tensor:
        if self.buffer.numel() < numel:
            self.buffer = torch.empty(numel)
        return self.buffer[:numel]


_panel = _Panel()


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


class QLinear:
    """``y = x @ W.T + b`` over a ``QuantWeight``, with ``Linear``'s fused epilogues.

    ``x`` is fp32 ``[M, K]`` with unit stride along K; results are fp32."""

    __slots__ = ("_args", "_fmt", "bias", "lib", "out_features", "weight")

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None) -> None:
        lib = kernels.load()
        if lib is None:
            raise RuntimeError(f"quantized kernels unavailable: {kernels.unavailable_reason()}")
        self.lib: Any = lib
        self.weight = weight
        self.out_features = weight.out_features
        self.bias = bias.to(torch.float32).contiguous() if bias is not None else None
        self._fmt = kernels.FMT_Q4 if weight.fmt == "q4" else kernels.FMT_Q8
        # Pointers fixed for the weight's lifetime (the tensors are held by self.weight).
        self._args = (
            self._fmt,
            weight.qs.data_ptr(),
            weight.d.data_ptr(),
            _ptr(weight.m),
            weight.out_features,
            weight.in_features,
        )

    def _gemm(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        epilogue: int,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = _rows(x, self.weight.in_features)
        m = x.shape[0]
        res_ld = residual.stride(0) if residual is not None else 0
        self.lib.kv_qgemm(
            *self._args,
            x.data_ptr(),
            m,
            x.stride(0),
            out.data_ptr(),
            out.stride(0),
            _ptr(self.bias),
            _ptr(residual),
            res_ld,
            epilogue,
            torch.get_num_threads(),
        )
        return out

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """Prefill: ``x @ W.T`` through panels of dequantized rows and a GEMM: oneDNN's on the
        plain panel where it works (about 2x torch.matmul's speed here), else torch's."""
        w = self.weight
        n, k = w.shape
        rows = max(1, min(n, PANEL_ELEMENTS // k))
        threads = torch.get_num_threads()
        use_onednn = onednn.plain_weights_work()
        if use_onednn:
            x = x.contiguous()
        out: torch.Tensor | None = None
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            panel = _panel.get((r1 - r0) * k).view(r1 - r0, k)
            self.lib.kv_dequant(
                self._fmt, w.qs.data_ptr(), w.d.data_ptr(), _ptr(w.m), k, None, r0, r1 - r0,
                panel.data_ptr(), k, threads,
            )  # fmt: skip
            part = onednn.linear(x, panel, None, "none", [], "") if use_onednn else x @ panel.t()
            if r0 == 0 and r1 == n:
                out = part
            else:
                if out is None:
                    out = torch.empty(x.shape[0], n, dtype=torch.float32)
                out[:, r0:r1] = part
        assert out is not None
        if self.bias is not None:
            out.add_(self.bias)
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > SKINNY_MAX_ROWS:
            return self._dense(x)
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        return self._gemm(x, out, kernels.EPI_NONE)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(linear(x))``."""
        return F.silu(self(x))

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """``linear(x) * other``."""
        return self(x).mul_(other)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + linear(x)`` (a new tensor; ``residual`` is not modified)."""
        if x.shape[0] > SKINNY_MAX_ROWS:
            return self._dense(x).add_(residual)
        residual = _rows(residual, self.out_features)
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        return self._gemm(x, out, kernels.EPI_ADD, residual)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x @ Wg.T) * (x @ Wu.T)`` for a weight holding gate rows then up rows."""
        inter = self.out_features // 2
        if x.shape[0] > SKINNY_MAX_ROWS:
            gu = self._dense(x)
            return F.silu(gu[:, :inter]).mul_(gu[:, inter:])
        out = torch.empty(x.shape[0], inter, dtype=torch.float32)
        return self._gemm(x, out, kernels.EPI_SILU_MUL)


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` as fp32 rows of ``width`` with unit stride (a copy only when it must)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != width or x.stride(1) != 1:
        x = x.reshape(-1, width).to(torch.float32).contiguous()
    return x


class QEmbedding:
    """Embedding lookup that dequantizes just the rows it is asked for."""

    __slots__ = ("lib", "weight")

    def __init__(self, weight: QuantWeight) -> None:
        self.lib: Any = kernels.load()
        self.weight = weight

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), w.in_features, dtype=torch.float32)
        self.lib.kv_dequant(
            kernels.FMT_Q4 if w.fmt == "q4" else kernels.FMT_Q8,
            w.qs.data_ptr(), w.d.data_ptr(), _ptr(w.m), w.in_features,
            ctypes.c_void_p(ids.data_ptr()), 0, ids.numel(), out.data_ptr(), w.in_features,
            torch.get_num_threads(),
        )  # fmt: skip
        return out
