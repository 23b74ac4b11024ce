"""Quantized weights: the format is decided once, at load, and the model only calls ``forward``.

    --weights float32   every weight dequantized to the run dtype (the oneDNN / torch path)
    --weights native    a GGUF's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K
                        tensors stay quantized with their own bits (other GGUF types, IQ*,
                        Q2_K, Q3_K, are dequantized and re-quantized to int8 per row, and the
                        banner says so); fp checkpoints stay fp
    --weights int8      every linear weight int8 per output channel (quantized at load)
    --weights auto      native for a GGUF on CPU with fp32 compute and working kernels,
                        else float32

``FORMATS`` is the one table of how each GGUF type is held: its block geometry and the
tensors its repacked form has. A ``QuantWeight`` is one matrix in one format, in the layout
``model_runner/kernels/kernels.cpp`` reads (its header comment draws every layout); a
``QuantStack`` stacks the rows of several (Q, K and V of a Q4_K_M file come as Q4_K, Q4_K and
Q6_K). Scales are fp32 (GGUF's are fp16) so that row operations at load (folding the softmax
scale into Q) stay exact; the 6-bit packed scales of Q4_K / Q5_K are unpacked to bytes. A
Q4_K_M file's weights are held in about 1.05x its bytes on disk.

``QLinear`` has ``Linear``'s interface. It runs the kernels' integer GEMM (activations
quantized to int8 per 32-block, as ggml's q8_0; weights unpacked a chunk of rows at a time and
read once for every row) for every batch shape. Above ``SKINNY_MAX_ROWS`` rows (unbounded by
default) it would instead dequantize the weight a panel at a time into a reused fp32 buffer
and run oneDNN's GEMM on it.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from model_runner import kernels, onednn

logger = logging.getLogger(__name__)

WeightsMode = Literal["auto", "float32", "native", "int8"]
WEIGHT_MODES: tuple[str, ...] = ("auto", "float32", "native", "int8")
QK = 32
QK_K = 256


class Format(NamedTuple):
    """How one GGUF type is held: ``block`` values per block, ``block_bytes`` on disk, and
    the repacked tensors' bytes per block (``qs``, ``qh``, ``sc``; fp32 ``d`` and ``m``)."""

    block: int
    block_bytes: int
    qs: int
    qh: int = 0
    sc: int = 0
    has_m: bool = False


# The one table: a GGUF type is kept natively iff it is here (plus its kernels' case).
FORMATS: dict[str, Format] = {
    "Q4_0": Format(QK, 18, 16),
    "Q4_1": Format(QK, 20, 16, has_m=True),
    "Q5_0": Format(QK, 22, 16, qh=4),
    "Q5_1": Format(QK, 24, 16, qh=4, has_m=True),
    "Q8_0": Format(QK, 34, 32),
    "Q4_K": Format(QK_K, 144, 128, sc=16, has_m=True),
    "Q5_K": Format(QK_K, 176, 128, qh=32, sc=16, has_m=True),
    "Q6_K": Format(QK_K, 210, 128, qh=64, sc=16),
}
NATIVE_GGUF_TYPES = tuple(FORMATS)
# Parameter names (Hugging Face's) of the matrices a weights mode may quantize.
MATRIX_SUFFIXES = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")
# Up to this many rows, the integer kernels; above, panel dequantization + oneDNN's GEMM.
# No bound by default: the integer GEMM is about as fast as the panels from 64 rows up, and
# one arithmetic for every batch shape keeps a row's results independent of its batch. The
# panel path stays for measurements (``bench_model_runner --panels``) and the tests.
SKINNY_MAX_ROWS = 1 << 30
# fp32 elements of the shared dequantization buffer (16 MiB): the LM head goes in panels.
PANEL_ELEMENTS = 1 << 22


@dataclass(slots=True)
class QuantWeight:
    """A quantized ``[out_features, in_features]`` weight in one of ``FORMATS``."""

    fmt: str
    qs: torch.Tensor  # uint8 [N, blocks * qs]
    d: torch.Tensor  # fp32 [N, blocks]
    in_features: int
    source: str  # what it was: "Q4_K", "Q8_0", "int8", ...
    qh: torch.Tensor | None = None  # uint8 [N, blocks * qh]
    sc: torch.Tensor | None = None  # uint8 (int8 for Q6_K) [N, blocks * sc]
    m: torch.Tensor | None = None  # fp32 [N, blocks]: Q4_1/Q5_1 mins, K-quant dmin

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown weight format {self.fmt!r}")
        spec = FORMATS[self.fmt]
        if spec.block == QK_K and self.in_features % QK_K:
            raise ValueError(
                f"{self.fmt} rows of {self.in_features} values are not whole 256-blocks"
            )
        n, nb = self.out_features, self.num_blocks
        for name, per_block in (("qs", spec.qs), ("qh", spec.qh), ("sc", spec.sc)):
            t = getattr(self, name)
            if (t is None) != (per_block == 0) or (
                t is not None and t.shape != (n, nb * per_block)
            ):
                shape = None if t is None else tuple(t.shape)
                raise ValueError(
                    f"{self.fmt} weight of {n}x{self.in_features}: {name} {shape} does not fit"
                )
        if self.d.shape != (n, nb) or (self.m is not None) != spec.has_m:
            raise ValueError(f"{self.fmt} weight of {n}x{self.in_features}: scales do not fit")

    @property
    def out_features(self) -> int:
        return int(self.qs.shape[0])

    @property
    def num_blocks(self) -> int:
        return -(-self.in_features // FORMATS[self.fmt].block)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qs, self.qh, self.sc, self.d, self.m) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())

    def _replace(self, **changes: Any) -> QuantWeight:
        fields = {
            f: getattr(self, f)
            for f in ("fmt", "qs", "d", "in_features", "source", "qh", "sc", "m")
        }
        return QuantWeight(**{**fields, **changes})

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """The rows ``index`` (a permutation or a selection), as a new weight."""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return t.index_select(0, index) if t is not None else None

        return self._replace(
            qs=pick(self.qs), d=pick(self.d), qh=pick(self.qh), sc=pick(self.sc), m=pick(self.m)
        )

    def scaled(self, factor: float) -> QuantWeight:
        """``factor * W`` (scales only, so exact up to fp32 rounding of the scales)."""
        m = self.m * factor if self.m is not None else None
        return self._replace(d=self.d * factor, m=m)

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[N, K]``: the reference the kernels are tested against (pure torch)."""
        n, nb = self.out_features, self.num_blocks
        spec = FORMATS[self.fmt]
        qs = self.qs.view(n, nb, spec.qs)
        if self.fmt in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
            q = torch.cat([qs & 0x0F, qs >> 4], dim=2).to(torch.int32)
            if self.qh is not None:
                h = self.qh.view(n, nb, 4).to(torch.int64)
                bits = h[..., 0] | h[..., 1] << 8 | h[..., 2] << 16 | h[..., 3] << 24
                q = q | (((bits.unsqueeze(2) >> torch.arange(32)) & 1) << 4).to(torch.int32)
            d = self.d.unsqueeze(2)
            if self.m is not None:
                w = q.float() * d + self.m.unsqueeze(2)
            else:
                w = (q - (16 if self.qh is not None else 8)).float() * d
        elif self.fmt == "Q8_0":
            w = qs.view(torch.int8).float() * self.d.unsqueeze(2)
        elif self.fmt in ("Q4_K", "Q5_K"):
            # [n, nb, 4 chunks, 2 halves, 32]: low nibbles are sub-block 2j, high ones 2j + 1.
            chunks = qs.view(n, nb, 4, 32)
            q = torch.stack([chunks & 0x0F, chunks >> 4], dim=3).to(torch.int32)
            if self.qh is not None:
                h = self.qh.view(n, nb, 1, 1, 32).to(torch.int32)
                shift = torch.arange(8, dtype=torch.int32).view(1, 1, 4, 2, 1)
                q = q | (((h >> shift) & 1) << 4)
            assert self.sc is not None and self.m is not None
            sc = self.sc.view(n, nb, 16).float()
            scale = (self.d.unsqueeze(2) * sc[..., :8]).view(n, nb, 4, 2, 1)
            low = (self.m.unsqueeze(2) * sc[..., 8:]).view(n, nb, 4, 2, 1)
            w = q.float() * scale - low
        else:  # Q6_K: element 128 half + 32 c + l; low nibbles of ql[64 half + 32 (c % 2) + l]
            assert self.qh is not None and self.sc is not None  # (c < 2) or high (c >= 2),
            ql = qs.view(n, nb, 2, 2, 32).to(torch.int32)  # bits 2c, 2c + 1 of qh[32 half + l]
            lo = torch.stack([ql & 0x0F, ql >> 4], dim=3).reshape(n, nb, 2, 4, 32)
            qh = self.qh.view(n, nb, 2, 1, 32).to(torch.int32)
            hi = (qh >> (2 * torch.arange(4, dtype=torch.int32)).view(1, 1, 1, 4, 1)) & 3
            q = ((lo | hi << 4) - 32).view(n, nb, 2, 4, 2, 16).float()
            sc = self.sc.view(torch.int8).view(n, nb, 2, 4, 2, 1).float()  # one per 16 values
            w = q * sc * self.d.view(n, nb, 1, 1, 1, 1)
        return w.reshape(n, nb * spec.block)[:, : self.in_features].contiguous()


@dataclass(slots=True)
class QuantStack:
    """Rows of several ``QuantWeight``s of one ``in_features`` and different formats,
    stacked (the kernels take up to ``kernels.MAX_PARTS``)."""

    parts: tuple[QuantWeight, ...]

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def source(self) -> str:
        return "+".join(dict.fromkeys(p.source for p in self.parts))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def tensors(self) -> list[torch.Tensor]:
        return [t for p in self.parts for t in p.tensors()]

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


QuantMatrix = QuantWeight | QuantStack


def cat_rows(weights: list[QuantWeight]) -> QuantMatrix:
    """Stack weights of one ``in_features`` (Q, K and V into one): a ``QuantWeight`` when
    they share a format, else a ``QuantStack`` of runs of one format."""
    first = weights[0]
    if any(w.in_features != first.in_features for w in weights):
        raise ValueError("cat_rows needs weights of one in_features")
    runs: list[list[QuantWeight]] = []
    for w in weights:
        if runs and runs[-1][0].fmt == w.fmt:
            runs[-1].append(w)
        else:
            runs.append([w])
    merged = [_cat_same(run) for run in runs]
    if len(merged) > kernels.MAX_PARTS:
        raise ValueError(f"{len(merged)} format runs: the kernels take {kernels.MAX_PARTS}")
    return merged[0] if len(merged) == 1 else QuantStack(tuple(merged))


def _cat_same(weights: list[QuantWeight]) -> QuantWeight:
    if len(weights) == 1:
        return weights[0]

    def cat(name: str) -> torch.Tensor | None:
        ts = [getattr(w, name) for w in weights]
        return torch.cat(ts) if ts[0] is not None else None

    sources = "+".join(dict.fromkeys(w.source for w in weights))
    return weights[0]._replace(
        qs=cat("qs"), d=cat("d"), qh=cat("qh"), sc=cat("sc"), m=cat("m"), source=sources
    )


# ---------------------------------------------------------------------- making weights


def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantWeight:
    """Repack a GGUF tensor of a ``FORMATS`` type (raw block bytes, ``[N, bytes per row]``)."""
    if type_name not in FORMATS:
        raise ValueError(f"GGUF type {type_name} is not kept natively ({', '.join(FORMATS)})")
    n, k = shape
    spec = FORMATS[type_name]
    if k % spec.block:
        raise ValueError(f"{type_name} rows of {k} values are not whole {spec.block}-blocks")
    nb = k // spec.block
    blocks = np.ascontiguousarray(raw).reshape(n, nb, spec.block_bytes)

    def half(lo: int) -> torch.Tensor:
        return torch.from_numpy(
            blocks[:, :, lo : lo + 2].copy().view(np.float16).reshape(n, nb).astype(np.float32)
        )

    def take(lo: int, width: int) -> torch.Tensor:
        return torch.from_numpy(blocks[:, :, lo : lo + width].reshape(n, nb * width).copy())

    if type_name == "Q8_0":
        return QuantWeight(type_name, take(2, 32), half(0), k, type_name)
    if type_name == "Q4_0":
        return QuantWeight(type_name, take(2, 16), half(0), k, type_name)
    if type_name == "Q4_1":
        return QuantWeight(type_name, take(4, 16), half(0), k, type_name, m=half(2))
    if type_name == "Q5_0":
        return QuantWeight(type_name, take(6, 16), half(0), k, type_name, qh=take(2, 4))
    if type_name == "Q5_1":
        return QuantWeight(type_name, take(8, 16), half(0), k, type_name, qh=take(4, 4), m=half(2))
    if type_name == "Q6_K":
        return QuantWeight(
            type_name, take(0, 128), half(208), k, type_name, qh=take(128, 64), sc=take(192, 16)
        )
    sc = torch.from_numpy(unpack_k_scales(blocks[:, :, 4:16]).reshape(n, nb * 16))
    if type_name == "Q4_K":
        return QuantWeight(type_name, take(16, 128), half(0), k, type_name, sc=sc, m=half(2))
    return QuantWeight(
        type_name, take(48, 128), half(0), k, type_name, qh=take(16, 32), sc=sc, m=half(2)
    )


def unpack_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins (``[..., 12]``) -> ``[..., 16]`` bytes:
    the 8 sub-block scales, then the 8 mins (ggml's ``get_scale_min_k4``)."""
    q = packed.astype(np.uint8)
    sc = np.empty((*q.shape[:-1], 16), dtype=np.uint8)
    sc[..., 0:4] = q[..., 0:4] & 63
    sc[..., 8:12] = q[..., 4:8] & 63
    sc[..., 4:8] = (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)
    sc[..., 12:16] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return sc


def quantize_int8(weight: torch.Tensor) -> QuantWeight:
    """Symmetric int8 per output channel: ``w[n, :] ~= q[n, :] * s[n]``, ``s = amax / 127``,
    held as Q8_0 blocks that all carry the row's scale."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    kb = -(-k // QK)
    scale = w.abs().amax(dim=1) / 127.0
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(w * inv.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    padded = torch.zeros(n, kb * QK, dtype=torch.int8)
    padded[:, :k] = q
    d = scale.unsqueeze(1).expand(n, kb).contiguous()
    return QuantWeight("Q8_0", padded.view(torch.uint8), d, k, "int8")


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
    return QuantWeight("Q4_1", qs.contiguous(), d.contiguous(), k, "q4", m=lo.contiguous())


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


def describe(weight: QuantMatrix) -> kernels.QW:
    """The kernels' view of a weight (pointers into its tensors: keep the weight alive)."""
    parts = weight.parts if isinstance(weight, QuantStack) else (weight,)
    qw = kernels.QW(len(parts), weight.out_features, weight.in_features, 0)
    for i, p in enumerate(parts):
        qw.parts[i] = kernels.QPart(
            kernels.FORMAT_CODES[p.fmt], p.out_features,
            *(_ptr(t) for t in (p.qs, p.qh, p.sc, p.d, p.m)),
        )  # fmt: skip
    return qw


class QLinear:
    """``y = x @ W.T + b`` over a ``QuantWeight`` / ``QuantStack``, with ``Linear``'s fused
    epilogues. ``x`` is fp32 ``[M, K]`` with unit stride along K; results are fp32."""

    __slots__ = ("_qw", "bias", "lib", "out_features", "weight")

    def __init__(self, weight: QuantMatrix, bias: torch.Tensor | None) -> None:
        lib = kernels.load()
        if lib is None:
            raise RuntimeError(f"quantized kernels unavailable: {kernels.unavailable_reason()}")
        self.lib: Any = lib
        self.weight = weight
        self.out_features = weight.out_features
        self.bias = bias.to(torch.float32).contiguous() if bias is not None else None
        # Pointers fixed for the weight's lifetime (the tensors are held by self.weight).
        self._qw = describe(weight)
        if lib.kv_weight_rows(ctypes.byref(self._qw)) != weight.out_features:
            raise ValueError(f"weight parts do not add up to {weight.out_features} rows")

    def _gemm(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        epilogue: int,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = _rows(x, self.weight.in_features)
        res_ld = residual.stride(0) if residual is not None else 0
        self.lib.kv_qgemm(
            ctypes.byref(self._qw), x.data_ptr(), x.shape[0], x.stride(0), out.data_ptr(),
            out.stride(0), _ptr(self.bias), _ptr(residual), res_ld, epilogue,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """Prefill: ``x @ W.T`` through panels of dequantized rows and a GEMM: oneDNN's on the
        plain panel where it works (about 2x torch.matmul's speed here), else torch's."""
        n, k = self.weight.shape
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
                ctypes.byref(self._qw), None, r0, r1 - r0, panel.data_ptr(), k, threads
            )
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

    __slots__ = ("_qw", "lib", "weight")

    def __init__(self, weight: QuantMatrix) -> None:
        self.lib: Any = kernels.load()
        self.weight = weight
        self._qw = describe(weight)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), w.in_features, dtype=torch.float32)
        self.lib.kv_dequant(
            ctypes.byref(self._qw), ctypes.c_void_p(ids.data_ptr()), 0, ids.numel(),
            out.data_ptr(), w.in_features, torch.get_num_threads(),
        )  # fmt: skip
        return out
