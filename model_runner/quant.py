"""Quantized weights: the format is decided once, at load, and the model only calls ``forward``.

    --weights float32   every weight dequantized to the run dtype (the oneDNN / torch path)
    --weights native    a GGUF's Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K
                        tensors stay quantized with their own bits (other GGUF types, IQ*,
                        Q2_K, Q3_K, are dequantized and re-quantized to int8 per row, and the
                        banner says so); fp checkpoints stay fp
    --weights int8      every linear weight int8 per output channel (quantized at load)
    --weights auto      native for a GGUF on CPU with fp32 compute and working kernels,
                        else float32

``FORMATS`` is the one table of how each GGUF type is held. A ``QuantWeight`` is one matrix in
one format, held as the file's own blocks with rows interleaved 8 at a time
(``model_runner/interleave.py`` draws the records; ``blocks()`` gives the file's bytes back);
a ``QuantStack`` stacks the rows of several (Q, K and V of a Q4_K_M file come as Q4_K, Q4_K
and Q6_K). A file's weights are held in its own bytes on disk.

``QLinear`` has ``Linear``'s interface. It runs the kernels' quantized matmul for every batch
shape: activations quantized to int8 per 32-block, weights decoded in registers 8 rows at a
time and read once per step whatever the batch (``kernels/qmatmul.h``).
"""

from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from model_runner import interleave, kernels
from model_runner.config import ACTIVATION_BITS, WEIGHT_MODES

logger = logging.getLogger(__name__)

QK = 32
QK_K = 256


class Format(NamedTuple):
    """How one GGUF type is held: ``block`` values per block, ``block_bytes`` per block and
    row (on disk and in memory: records are the file's bytes, rows interleaved)."""

    block: int
    block_bytes: int


# The one table: a GGUF type is kept natively iff it is here (plus its kernels' decoder).
FORMATS: dict[str, Format] = {
    name: Format(block, size) for name, (block, size) in interleave.GEOMETRY.items()
}
NATIVE_GGUF_TYPES = tuple(FORMATS)
# Parameter names (Hugging Face's) of the matrices a weights mode may quantize.
MATRIX_SUFFIXES = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")


@dataclass(slots=True)
class QuantWeight:
    """A quantized ``[out_features, in_features]`` weight in one of ``FORMATS``, held as
    ``interleave``'s 8-row records (``[ceil(out / 8), blocks, record bytes]``, uint8): the
    GGUF blocks' own bytes, moved so the kernels decode 8 rows in one pass. Rows that
    ``interleave.panel_cols`` puts in panels (longer than 1024) hold them flat (1-D), panel
    after panel (``in_panels``, as ``from_blocks`` makes them; ``grouped`` gives the 3-D
    records); 3-D records of such rows run as whole rows."""

    fmt: str
    records: torch.Tensor
    out_features: int
    in_features: int
    source: str  # what it was: "Q4_K", "Q8_0", "int8", ...

    def __post_init__(self) -> None:
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown weight format {self.fmt!r}")
        spec = FORMATS[self.fmt]
        if spec.block == QK_K and self.in_features % QK_K:
            raise ValueError(
                f"{self.fmt} rows of {self.in_features} values are not whole 256-blocks"
            )
        want: tuple[int, ...] = (-(-self.out_features // interleave.ROWS), self.num_blocks,
                                 interleave.record_bytes(self.fmt))  # fmt: skip
        if self.records.dim() == 1 and interleave.panel_blocks(self.fmt, self.in_features):
            want = (math.prod(want),)
        if tuple(self.records.shape) != want or self.records.dtype != torch.uint8:
            raise ValueError(
                f"{self.fmt} weight of {self.out_features}x{self.in_features}: records "
                f"{tuple(self.records.shape)} {self.records.dtype}, want {want} uint8"
            )

    @classmethod
    def from_blocks(
        cls, raw: np.ndarray, fmt: str, shape: tuple[int, int], source: str = ""
    ) -> QuantWeight:
        """From GGUF block bytes ``[n, blocks * block_bytes]`` of an ``[n, k]`` weight
        (``k`` rounded up to whole blocks for Q8_0 rows of int8)."""
        n, k = shape
        spec = FORMATS[fmt]
        records = interleave.to_records(raw, fmt, n, -(-k // spec.block) * spec.block)
        per = interleave.panel_blocks(fmt, k)
        return cls(fmt, in_panels(torch.from_numpy(records), per), n, k, source or fmt)

    def blocks(self) -> np.ndarray:
        """The GGUF block bytes (``[out, blocks * block_bytes]``): the file's bytes."""
        return interleave.to_blocks(self.grouped().numpy(), self.fmt, self.out_features)

    @property
    def panel(self) -> int:
        """Blocks a panel holds, or 0: the records are whole rows, group after group."""
        return interleave.panel_blocks(self.fmt, self.in_features) if self.records.dim() == 1 else 0

    def grouped(self) -> torch.Tensor:
        """The records ``[groups, blocks, record bytes]`` (a copy where they are in panels)."""
        if not self.panel:
            return self.records
        groups = -(-self.out_features // interleave.ROWS)
        size = interleave.record_bytes(self.fmt)
        runs, at = [], 0
        for lo in range(0, self.num_blocks, self.panel):
            n = groups * min(self.panel, self.num_blocks - lo) * size
            runs.append(self.records[at : at + n].view(groups, -1, size))
            at += n
        return torch.cat(runs, dim=1)

    @property
    def num_blocks(self) -> int:
        return -(-self.in_features // FORMATS[self.fmt].block)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    def tensors(self) -> list[torch.Tensor]:
        return [self.records]

    @property
    def nbytes(self) -> int:
        return self.records.nbytes

    def _with_blocks(self, raw: np.ndarray, rows: int) -> QuantWeight:
        return QuantWeight.from_blocks(raw, self.fmt, (rows, self.in_features), self.source)

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """The rows ``index`` (a permutation or a selection), as a new weight."""
        picked = self.blocks()[index.cpu().numpy()]
        return self._with_blocks(picked, len(picked))

    def scaled(self, factor: float) -> QuantWeight:
        """``factor * W``: the fp16 block scales (and mins) times ``factor``, rounded to fp16
        (exact for a power of two, such as a 64-wide head's softmax scale)."""
        raw = self.blocks().reshape(self.out_features, self.num_blocks, -1).copy()
        for lo in _SCALE_OFFSETS[self.fmt]:
            half = raw[..., lo : lo + 2].copy().view(np.float16)
            scaled = (half.astype(np.float32) * np.float32(factor)).astype(np.float16)
            raw[..., lo : lo + 2] = scaled.view(np.uint8)
        return self._with_blocks(raw.reshape(self.out_features, -1), self.out_features)

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[N, K]`` by gguf-py's numpy dequantizer (the file format's reference, not
        our code): what the kernels are tested against."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(self.blocks(), GGMLQuantizationType[self.fmt])
        values = np.asarray(values, dtype=np.float32).reshape(self.out_features, -1)
        return torch.from_numpy(np.ascontiguousarray(values[:, : self.in_features]))


# Byte offsets of each format's fp16 scales (and mins) inside a block.
_SCALE_OFFSETS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}  # fmt: skip


@dataclass(slots=True)
class QuantStack:
    """Rows of several ``QuantWeight``s of one ``in_features`` and different formats,
    stacked (the kernels take up to ``kernels.MAX_PARTS``; every part but the last has whole
    8-row groups)."""

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
    if any(p.out_features % interleave.ROWS for p in merged[:-1]):
        raise ValueError(
            "stacked formats need whole 8-row groups before the last part: "
            + ", ".join(f"{p.fmt} x {p.out_features}" for p in merged)
        )
    return merged[0] if len(merged) == 1 else QuantStack(tuple(merged))


def _cat_same(weights: list[QuantWeight]) -> QuantWeight:
    if len(weights) == 1:
        return weights[0]
    sources = "+".join(dict.fromkeys(w.source for w in weights))
    rows = sum(w.out_features for w in weights)
    if all(w.out_features % interleave.ROWS == 0 for w in weights[:-1]):
        records = torch.cat([w.grouped() for w in weights])  # whole groups: records concatenate
        per = interleave.panel_blocks(weights[0].fmt, weights[0].in_features)
        return QuantWeight(
            weights[0].fmt, in_panels(records, per), rows, weights[0].in_features, sources
        )
    raw = np.concatenate([w.blocks() for w in weights])
    return QuantWeight.from_blocks(raw, weights[0].fmt, (rows, weights[0].in_features), sources)


# ---------------------------------------------------------------------- making weights


def in_panels(records: torch.Tensor, per: int) -> torch.Tensor:
    """Records ``[groups, blocks, bytes]`` flat, panel after panel of ``per`` blocks (the
    last one shorter where they do not divide), each panel's groups in turn; ``per`` 0: as
    they are."""
    if not per:
        return records
    return torch.cat(
        [records[:, lo : lo + per].reshape(-1) for lo in range(0, records.shape[1], per)]
    )


def from_gguf_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantWeight:
    """A GGUF tensor of a ``FORMATS`` type (raw block bytes, ``[N, bytes per row]``)."""
    if type_name not in FORMATS:
        raise ValueError(f"GGUF type {type_name} is not kept natively ({', '.join(FORMATS)})")
    k = shape[1]
    spec = FORMATS[type_name]
    if k % spec.block:
        raise ValueError(f"{type_name} rows of {k} values are not whole {spec.block}-blocks")
    return QuantWeight.from_blocks(raw, type_name, shape)


def quantize_int8(weight: torch.Tensor) -> QuantWeight:
    """Symmetric int8 per output channel: ``w[n, :] ~= q[n, :] * s[n]``, ``s = amax / 127``
    (fp16, as Q8_0 holds it), held as Q8_0 blocks that all carry the row's scale."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    kb = -(-k // QK)
    scale = (w.abs().amax(dim=1) / 127.0).to(torch.float16)
    s32 = scale.to(torch.float32)
    inv = torch.where(s32 > 0, 1.0 / s32, torch.zeros_like(s32))
    q = torch.zeros(n, kb * QK, dtype=torch.int8)
    q[:, :k] = torch.round(w * inv.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    raw = np.empty((n, kb, 34), dtype=np.uint8)
    raw[:, :, 0:2] = scale.numpy().view(np.uint8).reshape(n, 1, 2)
    raw[:, :, 2:] = q.view(torch.uint8).numpy().reshape(n, kb, 32)
    return QuantWeight.from_blocks(raw.reshape(n, -1), "Q8_0", (n, k), "int8")


def quantize_q4(weight: torch.Tensor) -> QuantWeight:
    """Asymmetric 4-bit per 32-block (Q4_1's rule: ``d = (max - min) / 15``, ``m = min``, both
    fp16); used by the tests to make q4 weights of any shape (``k`` a multiple of 32)."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    if k % QK:
        raise ValueError(f"quantize_q4 needs rows of whole 32-blocks, got {k}")
    blocks = w.view(n, k // QK, QK)
    lo = blocks.amin(dim=2).to(torch.float16)
    d = ((blocks.amax(dim=2) - lo.float()) / 15.0).to(torch.float16)
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros(d.shape))
    q = torch.round((blocks - lo.float().unsqueeze(2)) * inv.unsqueeze(2)).clamp_(0, 15)
    q = q.to(torch.uint8)
    raw = np.empty((n, k // QK, 20), dtype=np.uint8)
    raw[..., 0:2] = d.numpy().view(np.uint8).reshape(n, -1, 2)
    raw[..., 2:4] = lo.numpy().view(np.uint8).reshape(n, -1, 2)
    raw[..., 4:] = (q[:, :, : QK // 2] | (q[:, :, QK // 2 :] << 4)).numpy()
    return QuantWeight.from_blocks(raw.reshape(n, -1), "Q4_1", (n, k), "q4")


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


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def describe(weight: QuantMatrix) -> kernels.QW:
    """The kernels' view of a weight (pointers into its records: keep the weight alive)."""
    parts = weight.parts if isinstance(weight, QuantStack) else (weight,)
    qw = kernels.QW(len(parts), weight.out_features, weight.in_features, 0)
    for i, p in enumerate(parts):
        qw.parts[i] = kernels.QPart(
            kernels.format_code(p.fmt), p.out_features, p.records.data_ptr(), p.panel
        )
    return qw


class QLinear:
    """``y = x @ W.T + b`` over a ``QuantWeight`` / ``QuantStack``, with ``Linear``'s fused
    epilogues. ``x`` is fp32 ``[M, K]`` with unit stride along K; results are fp32.
    ``activation_bits``: see ``ACTIVATION_BITS``."""

    __slots__ = ("_qw", "bias", "lib", "out_features", "residual", "weight")

    def __init__(
        self, weight: QuantMatrix, bias: torch.Tensor | None, activation_bits: int = 16
    ) -> None:
        if activation_bits not in ACTIVATION_BITS:
            raise ValueError(f"activation_bits {activation_bits}: use 16 or 8")
        self.residual = activation_bits == 16
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
            int(self.residual), torch.get_num_threads(),
        )  # fmt: skip
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
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
        residual = _rows(residual, self.out_features)
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        return self._gemm(x, out, kernels.EPI_ADD, residual)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x @ Wg.T) * (x @ Wu.T)`` for a weight holding gate rows then up rows."""
        inter = self.out_features // 2
        out = torch.empty(x.shape[0], inter, dtype=torch.float32)
        return self._gemm(x, out, kernels.EPI_SILU_MUL)

    def tensors(self) -> list[torch.Tensor]:
        return self.weight.tensors() if self.bias is None else [*self.weight.tensors(), self.bias]


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

    def tensors(self) -> list[torch.Tensor]:
        return self.weight.tensors()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight
        ids = ids.to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), w.in_features, dtype=torch.float32)
        self.lib.kv_dequant(
            ctypes.byref(self._qw), ctypes.c_void_p(ids.data_ptr()), 0, ids.numel(),
            out.data_ptr(), w.in_features, torch.get_num_threads(),
        )  # fmt: skip
        return out
