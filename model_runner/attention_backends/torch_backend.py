"""The torch backend, the reference every backend is held to: the step's gathers and masks,
and the prefill and decode attention paths in plain tensor ops.

One step's tokens are laid out as one flat batch, prefill chunks first, then decode tokens::

    rows:  | chunk of req a (Ta) | chunk of req b (Tb) | dec 0 | dec 1 | ... | dec B-1 |
             prefill path, one attention call per chunk   decode path, one batched call
                                                          per group of similar lengths

Every index tensor (token ids, positions, KV slots, block gathers, masks) is built ONCE per
step in ``TorchAttention.build`` and shared by all layers; a layer only runs tensor ops.

Prefill attends causally over the chunk plus the request's cached prefix, which it gathers
from the pool (``| cached prefix (in pool) | this chunk |``). A chunk that starts at position
0 attends to its own keys and values directly (no gather, plain causal SDPA).

Decode gathers a group's blocks with one ``index_select`` into
``[2 * kvh, B, max_blocks * block_size, head_dim]`` (requests padded to the group's longest
context), and masks padding and out-of-window keys with an additive ``-inf`` mask. Requests
come in groups of similar context length (within 2x), so one long request does not make the
whole batch gather (and the workspace hold) B copies of its length.

With a sliding window W a query at position p sees keys k with ``p - W < k <= p`` (Hugging
Face's Mistral convention); gathers start at the first block that holds a visible key, so
blocks the cache manager released out of the window are never read. Positions the adaptive
KV strategy released (they point at the null block) are skipped the same way. Layers with
windows of their own (Gemma 3's sliding and global layers) get the gathers and masks of
their window, built once per window and step.

Attention sinks S (StreamingLLM) add the keys ``k < S``: the gather is the sink blocks, then
the window's blocks (``| sinks | window |``). StreamingLLM gives positions *within the cache*:
the sinks at 0..S-1, the window right after them, the query last. We keep every key rotated
at its absolute position in the pool and re-rotate on the fly instead. RoPE makes a score
depend only on ``q_pos - k_pos``; the window is contiguous and ends at the query, so its
distances in the cache equal the absolute ones. Only the sinks differ: the gap
``d = max(0, p - W + 1 - S)`` of evicted tokens lies between them and the query, so their
scores use the query rotated back by ``d`` (``R(-d) q``, the same as re-rotating the sink keys
forward by ``d``), which is exactly the query at its cache position ``p - d``. Why not
re-rotate the stored keys as Hugging Face's SinkCache does: the pool is paged and shared
(prefix cache, forks) and fp16/int8 keys would gather rounding error with every shift. Why
not store keys un-rotated: every path (SDPA prefill, the fused C++ decode) and every prefix
block shared with requests without sinks would change. Sink steps take the chunk path (one
attention call per sequence, decodes included).

The query projection carries the ``1/sqrt(head_dim)`` softmax scale (folded in at load
time), so attention here runs with scale 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model_runner.attention_backends.base import AttentionBackend, ForwardBatch, row_tensors
from model_runner.block_table import first_key_block
from model_runner.kv_pool import KVPool
from model_runner.step import StepRows
from scheduler.output import ScheduledSeq


def _sdpa_supports_gqa() -> bool:
    q = torch.zeros(2, 1, 1)
    kv = torch.zeros(1, 1, 1)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except TypeError:
        return False
    return True


_SDPA_GQA = _sdpa_supports_gqa()
# Decode contexts up to this many blocks are padded together whatever their spread: below
# it, one more group (a few ops per layer) costs more than the padding.
_MIN_SPLIT_BLOCKS = 8


@dataclass(slots=True)
class PrefillChunk:
    """One request's chunk: rows ``row_start:row_end`` of the flat batch, query
    positions ``start_pos ..``; keys ``key_start .. end_pos - 1`` (gathered from
    ``block_index``), or, when ``block_index`` is None, the chunk's own keys (causal).
    With attention sinks the keys are the sink blocks' then the window's, and
    ``sink_rotation`` (cos, sin ``[T, D/2]`` of ``-d`` per query, see the module docstring)
    scores the first ``num_sink_keys`` keys with the query at its cache position."""

    row_start: int
    row_end: int
    num_keys: int
    block_index: torch.Tensor | None
    mask: torch.Tensor | None  # bool [T, num_keys], True = attend; None = plain causal
    num_sink_keys: int = 0
    sink_rotation: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class DecodeBatch:
    """A group of decode rows ``row_start : row_start + num_seqs``, one query each, padded
    to the group's longest context."""

    row_start: int
    num_seqs: int
    context_len: int  # padded keys per request (max_blocks * block_size)
    block_index: torch.Tensor  # [num_seqs * max_blocks]
    mask: torch.Tensor  # additive [num_seqs, 1, context_len]: 0 = attend, -inf = masked


@dataclass(slots=True)
class GatherMetadata:
    """The torch backend's per-step data: the chunks (prefill and draft verification), then
    the one-row decodes in groups of similar context length. With per-layer windows
    (``AttentionSpec.layer_windows``) ``per_layer`` holds each layer's own (one per window,
    shared by its layers); this one is then the ``sliding_window``'s."""

    prefills: list[PrefillChunk]
    decodes: list[DecodeBatch]
    per_layer: tuple[GatherMetadata, ...] = ()


@dataclass(slots=True)
class _Plan:
    """One window's gathers of a step, on the host: what ``build`` copies to the device in
    one go (``gathers``, then ``dec_key_starts``) and how the tensors are cut from it."""

    window: int | None
    gathers: list[int]  # chunk gathers then the padded decode gathers
    # (start, end, key_start, gather start, gather end, sink blocks gathered apart,
    # first window block) per chunk
    chunk_info: list[tuple[int, int, int, int, int, int, int]]
    groups: list[tuple[int, int, int]]  # decode groups: (first seq, end seq, max blocks)
    dec_gather_starts: list[int]
    dec_key_starts: list[int]
    num_chunk_rows: int

    @property
    def extra(self) -> list[int]:
        return self.gathers + self.dec_key_starts


class TorchAttention(AttentionBackend[GatherMetadata]):
    """Gathers blocks into padded tensors, then SDPA (chunks) or batched matmuls (decodes)."""

    name = "torch"
    window_tables = True
    sinks = True
    yields_to_fused = True

    def build(self, step: StepRows) -> ForwardBatch[GatherMetadata]:
        """Index tensors for ``step``: its chunks, then its one-row decodes (with attention
        sinks every seq is a chunk), one set per window the layers attend within. Table
        positions at the null block are never gathered."""
        spec = self.spec
        # The top-level set: every layer's window, or (per-layer windows) sliding_window's.
        shared = spec.sliding_window if spec.layered else spec.window(0)
        windows = list(dict.fromkeys([shared, *self._layer_windows()]))
        plans = [self._plan(step, w) for w in windows]
        extra = [i for p in plans for i in p.extra]
        window_slots = step.window_slot_mapping if spec.window_tables else None
        ids_t, pos_t, slot_t, extra_t = row_tensors(step, spec.device, extra + (window_slots or []))
        metas: list[GatherMetadata] = []
        offset = 0
        for p in plans:
            metas.append(self._metadata(p, extra_t[offset : offset + len(p.extra)], pos_t))
            offset += len(p.extra)
        meta = metas[0]
        if spec.layered:
            meta.per_layer = tuple(metas[windows.index(w)] for w in self._layer_windows())
        batch = ForwardBatch(step.num_rows, ids_t, pos_t, slot_t, step.max_position, meta)
        if window_slots is not None:
            batch.window_slot_mapping = extra_t[offset:]
        return batch

    def _layer_windows(self) -> list[int | None]:
        """Each layer's window when they differ, else none."""
        spec = self.spec
        return [spec.window(i) for i in range(len(spec.layer_windows))] if spec.layered else []

    def _plan(self, step: StepRows, window: int | None) -> _Plan:
        """The host side of ``step``'s gathers for layers attending within ``window``."""
        spec = self.spec
        block_size, sinks = spec.block_size, spec.attention_sinks
        num_sink_blocks = -(-sinks // block_size)
        chunk_seqs, decode = step.chunks, step.plain_decodes
        if sinks:
            assert window is not None and spec.rope_inv_freq is not None
            chunk_seqs, decode = step.seqs, ()
        null_block_id = step.null_block_id
        # A sliding layers' window reads their own tables when they have them.
        own = spec.window_tables and window is not None
        gathers: list[int] = []
        chunk_info: list[tuple[int, int, int, int, int, int, int]] = []
        num_chunk_rows = 0
        for seq in chunk_seqs:
            start, end = seq.start_pos, seq.end_pos
            num_chunk_rows += end - start
            table = _table(seq, own)
            first = first_key_block(
                table, start, block_size, window, num_sink_blocks, null_block_id
            )
            if sinks and first <= num_sink_blocks:
                first = 0  # no gap yet: the sinks and the window are one run from 0
            num_apart = num_sink_blocks if first else 0
            gather_start = len(gathers)
            if start > 0:
                gathers.extend(table[:num_apart])
                gathers.extend(table[first : -(-end // block_size)])
            key_start = 0 if sinks else first * block_size
            chunk_info.append((start, end, key_start, gather_start, len(gathers), num_apart, first))

        # Decode groups: consecutive seqs whose contexts (in blocks) are within 2x of the
        # group's longest, so padding wastes at most half of a group's gather. Decodes come
        # longest first (``StepRows.of``), which makes the groups contiguous runs.
        groups: list[tuple[int, int, int]] = []
        dec_rows: list[list[int]] = []
        dec_key_starts: list[int] = []
        for i, seq in enumerate(decode):
            pos = seq.start_pos
            table = _table(seq, own)
            first = first_key_block(table, pos, block_size, window, 0, null_block_id)
            row_blocks = table[first : pos // block_size + 1]
            dec_rows.append(row_blocks)
            dec_key_starts.append(first * block_size)
            n = len(row_blocks)
            if groups and not (2 * n < groups[-1][2] and groups[-1][2] > _MIN_SPLIT_BLOCKS):
                g0, _, g_max = groups[-1]
                groups[-1] = (g0, i + 1, max(g_max, n))
            else:
                groups.append((i, i + 1, n))
        dec_gather_starts: list[int] = []
        for g0, g1, g_max in groups:
            dec_gather_starts.append(len(gathers))
            for r in dec_rows[g0:g1]:
                gathers.extend(r)
                # Pad with the row's own last block (masked out): never another request's
                # data, so non-finite KV elsewhere cannot leak into this row through 0 * NaN.
                gathers.extend([r[-1]] * (g_max - len(r)))
        return _Plan(
            window, gathers, chunk_info, groups, dec_gather_starts, dec_key_starts, num_chunk_rows
        )

    def _metadata(self, p: _Plan, extra_t: torch.Tensor, pos_t: torch.Tensor) -> GatherMetadata:
        """``p``'s chunks and decode groups on the device (``extra_t``: its ``extra``)."""
        spec = self.spec
        block_size, window, sinks = spec.block_size, p.window, spec.attention_sinks
        device = spec.device
        gather_t = extra_t[: len(p.gathers)]
        key_start_t = extra_t[len(p.gathers) :]
        chunks: list[PrefillChunk] = []
        row = 0
        for start, end, key_start, g0, g1, num_apart, first in p.chunk_info:
            n = end - start
            if start == 0 and (window is None or n <= window):
                chunks.append(PrefillChunk(row, row + n, n, None, None))
                row += n
                continue
            # start == 0 here means a window shorter than the chunk: keys are the chunk's.
            block_index = None if start == 0 else gather_t[g0:g1]
            q_pos = torch.arange(start, end, device=device).unsqueeze(1)
            k_pos = torch.arange(key_start, end, device=device)
            if num_apart:  # | sink blocks | window blocks |
                k_pos = torch.cat(
                    [
                        torch.arange(num_apart * block_size, device=device),
                        torch.arange(first * block_size, end, device=device),
                    ]
                )
            k_pos = k_pos.unsqueeze(0)
            mask = k_pos <= q_pos
            if window is not None:
                visible = k_pos > q_pos - window
                if sinks:
                    visible |= k_pos < sinks
                mask &= visible
            rotation = None
            if sinks and window is not None and end > window + sinks:
                assert spec.rope_inv_freq is not None
                gap = (q_pos.squeeze(1) - (window - 1 + sinks)).clamp_(min=0)
                angles = -gap.double().unsqueeze(1) * spec.rope_inv_freq.double().unsqueeze(0)
                rotation = (angles.cos().to(spec.dtype), angles.sin().to(spec.dtype))
            num_keys = k_pos.shape[1]
            chunks.append(PrefillChunk(row, row + n, num_keys, block_index, mask, sinks, rotation))
            row += n

        decodes: list[DecodeBatch] = []
        for (g0, g1, g_max), gather_start in zip(p.groups, p.dec_gather_starts, strict=True):
            context_len = g_max * block_size
            rows = slice(p.num_chunk_rows + g0, p.num_chunk_rows + g1)
            k_pos = key_start_t[g0:g1].unsqueeze(1) + torch.arange(context_len, device=device)
            q_pos = pos_t[rows].unsqueeze(1)
            visible = k_pos <= q_pos
            if window is not None:
                visible &= k_pos > q_pos - window
            mask = torch.zeros(g1 - g0, context_len, dtype=spec.dtype, device=device)
            mask.masked_fill_(~visible, float("-inf"))
            decodes.append(
                DecodeBatch(
                    row_start=p.num_chunk_rows + g0,
                    num_seqs=g1 - g0,
                    context_len=context_len,
                    block_index=gather_t[gather_start : gather_start + (g1 - g0) * g_max],
                    mask=mask.unsqueeze(1),
                )
            )
        return GatherMetadata(chunks, decodes)

    def attend(
        self, layer: int, qkv: torch.Tensor, meta: GatherMetadata, pool: KVPool, out: torch.Tensor
    ) -> None:
        """Each chunk through SDPA over its own or its gathered keys, each decode group
        through two batched matmuls over its padded gather (the layer's own window's)."""
        if meta.per_layer:
            meta = meta.per_layer[layer]
        num_heads, num_kv_heads = self.spec.num_heads, self.spec.num_kv_heads
        head_dim = qkv.shape[-1]
        for chunk in meta.prefills:
            r0, r1 = chunk.row_start, chunk.row_end
            q = qkv[r0:r1, :num_heads].transpose(0, 1)  # [H, T, D]
            if chunk.block_index is None:
                k = qkv[r0:r1, num_heads : num_heads + num_kv_heads].transpose(0, 1)
                v = qkv[r0:r1, num_heads + num_kv_heads :].transpose(0, 1)
            else:
                kv = pool.gather(layer, chunk.block_index)
                k = kv[:num_kv_heads, : chunk.num_keys]
                v = kv[num_kv_heads:, : chunk.num_keys]
            if chunk.num_sink_keys and chunk.mask is not None:
                o = _sink_attention(q, k, v, chunk, num_heads // num_kv_heads)
            else:
                o = _sdpa(q, k, v, chunk.mask, num_heads // num_kv_heads)
            out[r0:r1].view(r1 - r0, num_heads, head_dim).copy_(o.transpose(0, 1))
        group = num_heads // num_kv_heads
        for dec in meta.decodes:
            b, d0 = dec.num_seqs, dec.row_start
            kv = pool.gather(layer, dec.block_index).view(2 * num_kv_heads, b, -1, head_dim)
            q = qkv[d0 : d0 + b, :num_heads].reshape(b, num_kv_heads, group, head_dim)
            scores = torch.matmul(q.transpose(0, 1), kv[:num_kv_heads].transpose(-1, -2))
            scores += dec.mask  # [kvh, B, g, L] + [B, 1, L]
            if scores.dtype == torch.float32:
                probs = torch.softmax(scores, dim=-1)
            else:
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
            o = torch.matmul(probs, kv[num_kv_heads:])  # [kvh, B, g, D]
            out[d0 : d0 + b].view(b, num_kv_heads, group, head_dim).copy_(o.transpose(0, 1))


def _table(seq: ScheduledSeq, own: bool) -> list[int]:
    """The table ``seq``'s keys are read through: the sliding layers' own when ``own``."""
    if not own:
        return seq.block_ids
    assert seq.window_block_ids is not None, f"{seq.request_id}: no sliding-layer table"
    return seq.window_block_ids


def _sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: PrefillChunk, group: int
) -> torch.Tensor:
    """Attention of a chunk with attention sinks, [H, T, D] x [kvh, S, D] -> [H, T, D].

    The first ``num_sink_keys`` keys are scored with the query at its cache position (the
    query rotated back by the gap, see the module docstring), the rest with the query as
    is; then one masked softmax over both.
    """
    assert chunk.mask is not None
    num_heads, num_q, head_dim = q.shape
    num_kv_heads = k.shape[0]
    qg = q.reshape(num_kv_heads, group * num_q, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2))  # [kvh, g * T, L]
    if chunk.sink_rotation is not None:
        cos, sin = chunk.sink_rotation  # [T, D/2]
        pairs = q.unflatten(-1, (head_dim // 2, 2))
        x0, x1 = pairs[..., 0], pairs[..., 1]
        q_sink = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
        s = chunk.num_sink_keys
        q_sink = q_sink.reshape(num_kv_heads, group * num_q, head_dim)
        scores[..., :s] = torch.matmul(q_sink, k[:, :s].transpose(-1, -2))
    scores = scores.view(num_kv_heads, group, num_q, -1)
    scores = scores.masked_fill(~chunk.mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    o = torch.matmul(probs.view(num_kv_heads, group * num_q, -1), v)
    return o.view(num_heads, num_q, head_dim)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, group: int
) -> torch.Tensor:
    """Scaled-dot-product attention, scale 1 (Q is pre-scaled), [H, T, D] x [kvh, S, D].

    Inputs go in as 4-D ``[1, heads, len, dim]``: on CPU, 3-D inputs fall back to the math
    kernel (materialised scores, ~3x slower at 512 tokens) while 4-D ones take the flash kernel.
    """
    q4, k4, v4 = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    causal = mask is None
    if _SDPA_GQA:
        out = F.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=mask, is_causal=causal, scale=1.0, enable_gqa=group > 1
        )
    else:
        if group > 1:
            k4 = k4.repeat_interleave(group, dim=1)
            v4 = v4.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=mask, is_causal=causal, scale=1.0
        )
    return out[0]
