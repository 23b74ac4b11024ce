"""GGUF blocks <-> kvserve's row-interleaved records (numpy, at load; exact both ways).

The kernels (``kernels/qmatmul.h``) read a weight 8 rows at a time: rows ``8g .. 8g + 7`` of
block ``b`` are one record, and the records of a row group follow each other, so a thread
streams its rows as one sequential read. Inside a record the bytes of the 8 rows are
interleaved 4 at a time: one 32-byte load holds 4 consecutive quants (or nibble pairs) of each
row, so one broadcast of 4 activation bytes feeds all 8 rows in one ``vpdpbusd``. A record
has exactly the 8 rows' GGUF bytes, moved (and, for Q8_0, XOR 0x80 so the quants are
unsigned); ``to_blocks`` gives the file's bytes back.

Rows longer than 1024 values are held in panels (``panel_cols``: 2048 columns, or 1024 for
rows of up to 2048; the last panel shorter where they do not divide): the records of panel
0 of every group, then panel 1's, and so on (``quant.in_panels``). At a few activation rows
the kernels pass over one panel of all their groups before the next: one stream still, and
the panel's activations (2-4 KB at 16 bits) stay in L1 from group to group, where an
8192-long row's 16 KB were evicted by the 36 KB of weights each group streams in between
(docs/kernels.md, "What the code does").

Records (``d``, ``m``, ``dmin``: fp16 x 8 rows; "8 x 4B" = rows r = 0..7, 4 bytes each)::

    Q4_0  d | qs: 4 loads of 8 x 4B (bytes 4i..4i+3 of each row's 16)          144 B
    Q4_1  d | m | qs                                                         160 B
    Q5_0  d | qh: 8 mask words | qs                                          176 B
    Q5_1  d | m | qh | qs                                                    192 B
    Q8_0  d | qs: 8 loads of 8 x 4B, each byte XOR 0x80                       272 B
    Q4_K  d | dmin | scales 96 B | qs: 4 chunks x 8 loads of 8 x 4B          1152 B
    Q5_K  d | dmin | scales | qh: 8 loads of 8 x 4B | qs                   1408 B
    Q6_K  d | sc: 16 groups x 8 rows (int8) | qh: 2 x 8 loads | ql: 4 x 8 loads   1680 B

Mask words (Q5_0): word i holds, at bits 4r .. 4r + 3, the high bits of the 4 quants that
load i's lane r carries: bits 4i .. 4i + 3 of row r's 32-bit ``qh`` (quants 4i .. 4i + 3).
Q5_K's ``qh`` stays GGUF's bytes, interleaved like the quants: bit s of row r's byte l is the
5th bit of quant l of 32-block s, so one load of 8 x 4 bytes holds the 5th bits of all 8
32-blocks, and the kernel reads it once a record and shifts bit s into place.

Q4_K / Q5_K scales: GGUF packs 8 six-bit scales and 8 six-bit mins in 12 bytes; a record
keeps the same 96 bits a row as ``lo[s][r] = sc & 15 | (mn & 15) << 4`` (64 B) and
``hi[s // 2][r]``, nibble ``s % 2`` = ``sc >> 4 | (mn >> 4) << 2`` (32 B).
"""

from __future__ import annotations

import numpy as np

ROWS = 8  # rows per record
PANEL_COLS = 2048  # columns a panel holds (half that for rows of up to PANEL_COLS)

# Per GGUF type: (values per block, bytes per block and row).
GEOMETRY: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}


def panel_cols(k: int) -> int:
    """Columns a panel of rows of ``k`` values holds, or 0: the rows are whole. Measured at
    M = 1 on a Zen 4 (docs/benchmarks.md, "Panels"): 2048 is best for long rows; rows of 2048
    gain from two panels of 1024 through the whole model (the Q6_K head most; o and gate_up
    alone read slower), and rows of up to 1024 gain nothing."""
    if k <= PANEL_COLS // 2:
        return 0
    return PANEL_COLS if k > PANEL_COLS else PANEL_COLS // 2


def panel_blocks(fmt: str, k: int) -> int:
    """Blocks a panel of ``fmt`` rows of ``k`` values holds, or 0: the rows are whole."""
    return panel_cols(k) // GEOMETRY[fmt][0]


def record_bytes(fmt: str) -> int:
    return ROWS * GEOMETRY[fmt][1]


def _rows_minor(x: np.ndarray) -> np.ndarray:
    """``[G, 8, nb, n]`` -> ``[G, nb, n, 8]`` (one value of 8 rows side by side)."""
    return x.transpose(0, 2, 3, 1)


def _rows_major(x: np.ndarray) -> np.ndarray:
    return x.transpose(0, 3, 1, 2)


def _nibble_words(bits: np.ndarray) -> np.ndarray:
    """``bits [G, nb, W, 8]`` (one 4-bit value per word and row) -> uint32 words ``[G, nb, W]``
    with row r's value at bits 4r .. 4r + 3."""
    shifts = (4 * np.arange(ROWS, dtype=np.uint32)).reshape(1, 1, 1, ROWS)
    words: np.ndarray = (bits.astype(np.uint32) << shifts).sum(axis=3, dtype=np.uint32)
    return words


def _word_nibbles(words: np.ndarray) -> np.ndarray:
    shifts = (4 * np.arange(ROWS, dtype=np.uint32)).reshape(1, 1, 1, ROWS)
    return ((words[..., None] >> shifts) & 0xF).astype(np.uint8)


def _q5_0_masks(qh: np.ndarray) -> np.ndarray:
    """Row-major ``qh [G, 8, nb, 4]`` -> mask words ``[G, nb, 8]`` as bytes ``[G, nb, 32]``."""
    word = qh.copy().view("<u4")[..., 0]  # [G, 8, nb]
    i = np.arange(8, dtype=np.uint32).reshape(1, 1, 1, 8)
    nib = (word[..., None] >> (4 * i)) & 0xF  # [G, 8, nb, 8 words]
    groups, _, nb = word.shape
    return _nibble_words(nib.transpose(0, 2, 3, 1)).view(np.uint8).reshape(groups, nb, 32)


def _q5_0_unmask(masks: np.ndarray) -> np.ndarray:
    g, nb, _ = masks.shape
    nib = _word_nibbles(masks.copy().view("<u4"))  # [G, nb, 8 words, 8 rows]
    i = np.arange(8, dtype=np.uint32).reshape(1, 1, 8, 1)
    word: np.ndarray = (nib.astype(np.uint32) << (4 * i)).sum(axis=2, dtype=np.uint32)  # [G, nb, 8]
    return word.transpose(0, 2, 1).copy().view(np.uint8).reshape(g, ROWS, nb, 4)


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


def _k_scales(packed: np.ndarray) -> np.ndarray:
    """GGUF's 12 bytes ``[G, 8, nb, 12]`` -> the record's 96 bytes ``[G, nb, 96]``."""
    sc = unpack_k_scales(packed)  # [G, 8, nb, 16]: 8 scales, 8 mins
    s, m = _rows_minor(sc[..., :8]), _rows_minor(sc[..., 8:])  # [G, nb, 8 sub, 8 rows]
    lo = (s & 15) | ((m & 15) << 4)
    h = (s >> 4) | ((m >> 4) << 2)  # 4 bits
    hi = h[:, :, 0::2] | (h[:, :, 1::2] << 4)  # [G, nb, 4, 8]
    g, nb = lo.shape[:2]
    return np.concatenate([lo.reshape(g, nb, 64), hi.reshape(g, nb, 32)], axis=2)


def _k_unscales(rec: np.ndarray) -> np.ndarray:
    g, nb, _ = rec.shape
    lo = rec[..., :64].reshape(g, nb, 8, ROWS)
    hi = rec[..., 64:].reshape(g, nb, 4, ROWS)
    h = np.empty_like(lo)
    h[:, :, 0::2] = hi & 15
    h[:, :, 1::2] = hi >> 4
    s = (lo & 15) | ((h & 3) << 4)
    m = (lo >> 4) | ((h >> 2) << 4)
    sc = np.concatenate([_rows_major(s), _rows_major(m)], axis=3)  # [G, 8, nb, 16]
    return pack_k_scales(sc)


def pack_k_scales(sc: np.ndarray) -> np.ndarray:
    """The inverse of ``unpack_k_scales``: ``[..., 16]`` six-bit values -> 12 bytes."""
    s, m = sc[..., :8].astype(np.uint8), sc[..., 8:].astype(np.uint8)
    out = np.empty((*sc.shape[:-1], 12), dtype=np.uint8)
    out[..., 0:4] = (s[..., 0:4] & 63) | ((s[..., 4:8] >> 4) << 6)
    out[..., 4:8] = (m[..., 0:4] & 63) | ((m[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (s[..., 4:8] & 15) | ((m[..., 4:8] & 15) << 4)
    return out


def to_records(raw: np.ndarray, fmt: str, n: int, k: int) -> np.ndarray:
    """GGUF bytes of an ``[n, k]`` weight (``[n, k // block * block_bytes]``) -> records
    ``[ceil(n / 8), blocks, record_bytes]`` (rows past ``n`` are zero)."""
    block, size = GEOMETRY[fmt]
    nb = k // block
    groups = -(-n // ROWS)
    x: np.ndarray = np.zeros((groups * ROWS, nb, size), dtype=np.uint8)
    x[:n] = np.ascontiguousarray(raw).reshape(n, nb, size)
    x = x.reshape(groups, ROWS, nb, size)

    def half(lo: int) -> np.ndarray:  # one fp16 of each of the 8 rows: [G, nb, 16]
        return x[..., lo : lo + 2].transpose(0, 2, 1, 3).reshape(groups, nb, 16)

    def lanes(lo: int, width: int) -> np.ndarray:
        return _chunks(x[..., lo : lo + width])

    if fmt == "Q4_0":
        parts = [half(0), lanes(2, 16)]
    elif fmt == "Q4_1":
        parts = [half(0), half(2), lanes(4, 16)]
    elif fmt == "Q5_0":
        parts = [half(0), _q5_0_masks(x[..., 2:6]), lanes(6, 16)]
    elif fmt == "Q5_1":
        parts = [half(0), half(2), _q5_0_masks(x[..., 4:8]), lanes(8, 16)]
    elif fmt == "Q8_0":
        parts = [half(0), lanes(2, 32) ^ np.uint8(0x80)]
    elif fmt == "Q4_K":
        parts = [half(0), half(2), _k_scales(x[..., 4:16]), _chunks(x[..., 16:144])]
    elif fmt == "Q5_K":
        qh = _chunks(x[..., 16:48])
        parts = [half(0), half(2), _k_scales(x[..., 4:16]), qh, _chunks(x[..., 48:176])]
    elif fmt == "Q6_K":
        sc = _rows_minor(x[..., 192:208]).reshape(groups, nb, 128)
        parts = [half(208), sc, _chunks(x[..., 128:192]), _chunks(x[..., 0:128])]
    else:
        raise ValueError(f"no interleaved layout for {fmt}")
    out = np.concatenate(parts, axis=2)
    assert out.shape[2] == record_bytes(fmt)
    return out


def _chunks(x: np.ndarray) -> np.ndarray:
    """``[G, 8, nb, n]`` bytes a row -> ``[G, nb, 8 n]``: each 32-byte chunk of the rows (or
    the one shorter chunk) as loads of 8 x 4 bytes, load i = bytes 4i .. 4i + 3 of each row."""
    g, _, nb, n = x.shape
    loads = min(8, n // 4)
    lanes = x.reshape(g, ROWS, nb, n // (4 * loads), loads, 4).transpose(0, 2, 3, 4, 1, 5)
    return lanes.reshape(g, nb, ROWS * n)


def _unchunks(x: np.ndarray, n: int) -> np.ndarray:
    """The inverse of ``_chunks`` for ``n`` bytes a row."""
    g, nb, _ = x.shape
    loads = min(8, n // 4)
    lanes = x.reshape(g, nb, n // (4 * loads), loads, ROWS, 4).transpose(0, 4, 1, 2, 3, 5)
    return lanes.reshape(g, ROWS, nb, n)


def to_blocks(records: np.ndarray, fmt: str, n: int) -> np.ndarray:
    """The inverse of ``to_records``: GGUF bytes ``[n, blocks * block_bytes]``."""
    _, size = GEOMETRY[fmt]
    groups, nb, _ = records.shape
    rec = records
    x = np.empty((groups, ROWS, nb, size), dtype=np.uint8)
    pos = 0

    def take(width: int) -> np.ndarray:
        nonlocal pos
        part = rec[..., pos : pos + width]
        pos += width
        return part

    def half() -> np.ndarray:
        return take(16).reshape(groups, nb, ROWS, 2).transpose(0, 2, 1, 3)

    def lanes(width: int) -> np.ndarray:
        return _unchunks(take(ROWS * width), width)

    if fmt in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        x[..., 0:2] = half()
        at = 2
        if fmt in ("Q4_1", "Q5_1"):
            x[..., 2:4] = half()
            at = 4
        if fmt in ("Q5_0", "Q5_1"):
            x[..., at : at + 4] = _q5_0_unmask(take(32))
            at += 4
        x[..., at : at + 16] = lanes(16)
    elif fmt == "Q8_0":
        x[..., 0:2] = half()
        x[..., 2:34] = lanes(32) ^ np.uint8(0x80)
    elif fmt in ("Q4_K", "Q5_K"):
        x[..., 0:2] = half()
        x[..., 2:4] = half()
        x[..., 4:16] = _k_unscales(take(96))
        if fmt == "Q5_K":
            x[..., 16:48] = _unchunks(take(256), 32)
            x[..., 48:176] = _unchunks(take(1024), 128)
        else:
            x[..., 16:144] = _unchunks(take(1024), 128)
    elif fmt == "Q6_K":
        x[..., 208:210] = half()
        x[..., 192:208] = _rows_major(take(128).reshape(groups, nb, 16, ROWS))
        x[..., 128:192] = _unchunks(take(512), 64)
        x[..., 0:128] = _unchunks(take(1024), 128)
    else:
        raise ValueError(f"no interleaved layout for {fmt}")
    return x.reshape(groups * ROWS, nb * size)[:n]
