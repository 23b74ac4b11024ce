"""Reference quantizers for the GGUF K-quants the ``gguf`` package cannot write (Q4_K, Q5_K,
Q6_K), so tests and benchmarks can build K-quant files and weights on the fly.

They produce valid GGUF blocks (ggml's byte layout, checked against ``gguf.quants.dequantize``
by the tests), with the searches llama.cpp's own reference quantizers run per sub-block: a
scale and a min for Q4_K / Q5_K (``_fit_scale_min``: ggml's ``make_qkx2_quants``), a signed
scale for Q6_K (``_fit_symmetric``: ``make_qx_quants``), each candidate refitted by least
squares and the smallest squared error kept (no importance weights, so not bit for bit
llama-quantize's output). ``quantize`` also covers the types the ``gguf`` package does write,
by delegating to it.
"""

from __future__ import annotations

import gguf
import numpy as np

K_TYPES = ("Q4_K", "Q5_K", "Q6_K")


def quantize(weights: np.ndarray, type_name: str) -> np.ndarray:
    """``weights`` ``[N, K]`` as raw GGUF blocks of ``type_name``, ``[N, bytes per row]``."""
    w = np.ascontiguousarray(weights, dtype=np.float32)
    if type_name not in K_TYPES:
        return np.asarray(gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, type_name)))
    n, k = w.shape
    if k % 256:
        raise ValueError(f"{type_name} rows of {k} values are not whole 256-blocks")
    blocks = w.reshape(n * k // 256, 256)
    out = (
        _q6_k(blocks) if type_name == "Q6_K" else _q45_k(blocks, 31 if type_name == "Q5_K" else 15)
    )
    return out.reshape(n, -1)


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _fit_scale_min(sub: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block (rows of ``sub``) a scale and a min (>= 0) with w ~= scale * q - min,
    q in 0..levels: ggml's ``make_qkx2_quants`` search. Candidate inverse scales around
    levels / (max - min); each candidate's q is refitted by least squares (weights 1),
    and the one with the smallest squared error is kept."""
    lo = np.minimum(sub.min(axis=1), 0.0)
    hi = sub.max(axis=1)
    span = np.where(hi > lo, hi - lo, 1.0)
    best_scale = (hi - lo) / levels
    best_min = -lo
    step0 = np.where(best_scale > 0, best_scale, 1)[:, None]
    q0 = np.clip(np.rint((sub - lo[:, None]) / step0), 0, levels)
    best_err = ((best_scale[:, None] * q0 + lo[:, None] - sub) ** 2).sum(axis=1)
    n = sub.shape[1]
    sum_x = sub.sum(axis=1)
    for step in range(21):
        iscale = (levels - 1.0 + 0.1 * step) / span
        q = np.clip(np.rint(iscale[:, None] * (sub - lo[:, None])), 0, levels)
        sq, sqq, sqx = q.sum(axis=1), (q * q).sum(axis=1), (q * sub).sum(axis=1)
        det = n * sqq - sq * sq
        ok = det > 0
        safe = np.where(ok, det, 1.0)
        scale = np.where(ok, (n * sqx - sq * sum_x) / safe, best_scale)
        offset = np.where(ok, (sqq * sum_x - sq * sqx) / safe, lo)  # w ~= scale * q + offset
        offset = np.minimum(offset, 0.0)  # the format's min is subtracted: offset <= 0
        err = ((scale[:, None] * q + offset[:, None] - sub) ** 2).sum(axis=1)
        better = ok & (scale > 0) & (err < best_err)
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, scale, best_scale)
        best_min = np.where(better, -offset, best_min)
    return best_scale, best_min


def _q45_k(blocks: np.ndarray, levels: int) -> np.ndarray:
    """Q4_K (levels 15) / Q5_K (levels 31): 8 sub-blocks of 32, 6-bit scales and mins."""
    nb = blocks.shape[0]
    sub = blocks.reshape(nb, 8, 32)
    scale, low = _fit_scale_min(sub.reshape(nb * 8, 32), levels)
    scale, lo = scale.reshape(nb, 8), -low.reshape(nb, 8)
    d = scale.max(axis=1) / 63.0
    dmin = -lo.min(axis=1) / 63.0
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    d, dmin = d16.astype(np.float32), dmin16.astype(np.float32)
    sc = np.where(d[:, None] > 0, np.rint(scale / np.where(d > 0, d, 1)[:, None]), 0)
    mn = np.where(dmin[:, None] > 0, np.rint(-lo / np.where(dmin > 0, dmin, 1)[:, None]), 0)
    sc = np.clip(sc, 0, 63).astype(np.uint8)
    mn = np.clip(mn, 0, 63).astype(np.uint8)
    step = d[:, None] * sc
    offset = dmin[:, None] * mn
    q = np.where(
        step[:, :, None] > 0,
        np.rint((sub + offset[:, :, None]) / np.where(step > 0, step, 1)[:, :, None]),
        0,
    )
    q = np.clip(q, 0, levels).astype(np.uint8).reshape(nb, 4, 2, 32)  # [chunk j, half, l]
    packed = np.empty((nb, 12), dtype=np.uint8)  # the inverse of get_scale_min_k4
    packed[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    qs = ((q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)).reshape(nb, 128)
    parts = [_f16(d16).reshape(nb, 2), _f16(dmin16).reshape(nb, 2), packed]
    if levels == 31:
        bits = (q >> 4).reshape(nb, 8, 32)  # sub-block 2j + half -> bit 2j + half of qh[l]
        qh = np.zeros((nb, 32), dtype=np.uint8)
        for b in range(8):
            qh |= (bits[:, b] << b).astype(np.uint8)
        parts.append(qh)
    parts.append(qs)
    return np.concatenate(parts, axis=1)


def _fit_symmetric(groups: np.ndarray, nmax: int) -> np.ndarray:
    """Per group (rows) a scale with w ~= scale * q, q in -nmax..nmax-1: ggml's
    ``make_qx_quants`` search (candidates around -nmax / the signed extreme, each refitted by
    least squares, the smallest squared error kept). The sign follows the extreme value, so
    the asymmetric range's extra negative level lands on it."""
    idx = np.abs(groups).argmax(axis=1)
    extreme = groups[np.arange(groups.shape[0]), idx]
    safe = np.where(extreme != 0, extreme, 1.0)
    best_scale = np.where(extreme != 0, -extreme / nmax, 0.0)
    best_err = np.full(groups.shape[0], np.inf)
    for step in range(-9, 10):
        iscale = -(nmax + 0.1 * step) / safe
        q = np.clip(np.rint(iscale[:, None] * groups), -nmax, nmax - 1)
        sqq, sqx = (q * q).sum(axis=1), (q * groups).sum(axis=1)
        scale = np.where(sqq > 0, sqx / np.where(sqq > 0, sqq, 1.0), 0.0)
        err = ((scale[:, None] * q - groups) ** 2).sum(axis=1)
        better = (extreme != 0) & (err < best_err)
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, scale, best_scale)
    return best_scale


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K: 16 groups of 16 with int8 scales, 6-bit values offset by 32."""
    nb = blocks.shape[0]
    grp = blocks.reshape(nb, 16, 16)
    scale = _fit_symmetric(grp.reshape(nb * 16, 16), 32).reshape(nb, 16)
    d = np.abs(scale).max(axis=1) / 127.0
    d16 = d.astype(np.float16)
    d = d16.astype(np.float32)
    sc = np.where(d[:, None] > 0, np.rint(scale / np.where(d > 0, d, 1)[:, None]), 0)
    sc = np.clip(sc, -128, 127).astype(np.int8)
    step = d[:, None] * sc
    q = np.where(step[:, :, None] != 0, np.rint(grp / np.where(step != 0, step, 1)[:, :, None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(nb, 2, 4, 32)  # [half, c, l]
    ql = np.empty((nb, 2, 2, 32), dtype=np.uint8)  # [half, c % 2, l]
    ql[:, :, 0] = (q[:, :, 0] & 0x0F) | ((q[:, :, 2] & 0x0F) << 4)
    ql[:, :, 1] = (q[:, :, 1] & 0x0F) | ((q[:, :, 3] & 0x0F) << 4)
    qh = np.zeros((nb, 2, 32), dtype=np.uint8)
    for c in range(4):
        qh |= ((q[:, :, c] >> 4) << (2 * c)).astype(np.uint8)
    return np.concatenate(
        [ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8), _f16(d16).reshape(nb, 2)],
        axis=1,
    )


# ---------------------------------------------------------------------- whole files

# GGUF's file_type codes for the schemes ``requantize_gguf`` writes (llama.cpp's LLAMA_FTYPE_*).
FILE_TYPES = {"Q4_K_M": 15, "Q4_0": 2, "Q8_0": 7}
# A K-quant needs rows of whole 256-blocks; llama.cpp falls back per tensor like this.
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth, and every third between."""
    return (
        layer < num_layers // 8
        or layer >= 7 * num_layers // 8
        or (layer - num_layers // 8) % 3 == 2
    )


def scheme_type(name: str, scheme: str, num_layers: int, row_length: int, has_output: bool) -> str:
    """The type ``name`` gets under ``scheme`` (Q4_K_M: llama.cpp's rules, simplified to the
    LLaMA tensors and the expert stacks): the output Q6_K, attn_v and ffn_down (the experts'
    stack too) Q6_K in the ``_more_bits`` layers, every other matrix Q4_K; a row length that is
    not whole 256-blocks falls back."""
    if scheme != "Q4_K_M":
        return scheme
    if name == "output.weight" or (name == "token_embd.weight" and not has_output):
        chosen = "Q6_K"
    elif name.endswith(("attn_v.weight", "ffn_down.weight", "ffn_down_exps.weight")):
        layer = int(name.split(".")[1])
        chosen = "Q6_K" if _more_bits(layer, num_layers) else "Q4_K"
    else:
        chosen = "Q4_K"
    return _FALLBACK[chosen] if row_length % 256 else chosen


def requantize_gguf(src: str, dst: str, scheme: str = "Q4_K_M") -> dict[str, str]:
    """Write ``src`` (any GGUF this package decodes) to ``dst`` with its matrices requantized
    under ``scheme``: metadata copied, 1-D tensors (norms) as F32. Returns each tensor's new
    type. Our quantizers (``quantize``), not llama-quantize's search: for tests and benchmarks
    that need a K-quant file where no llama.cpp build is at hand."""
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(src)
    arch = str(reader.fields["general.architecture"].contents())
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    names = {t.name for t in reader.tensors}
    writer = gguf.GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name in ("general.architecture", "general.file_type") or field.name.startswith(
            "GGUF."
        ):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    writer.add_file_type(FILE_TYPES.get(scheme, 0))
    chosen: dict[str, str] = {}
    for tensor in reader.tensors:
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        shape = [int(d) for d in reversed(tensor.shape.tolist())]  # [rows, row length]
        values = values.reshape(shape)
        if values.ndim != 2:
            writer.add_tensor(tensor.name, values)
            chosen[tensor.name] = "F32"
            continue
        kind = scheme_type(tensor.name, scheme, layers, shape[1], "output.weight" in names)
        raw = quantize(values, kind)
        writer.add_tensor(tensor.name, raw, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
        chosen[tensor.name] = kind
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return chosen
