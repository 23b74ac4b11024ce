// The quantized matmul of one ISA family (included by kernels.cpp inside its variant's
// namespace): y = x W^T for a weight held as 8-row interleaved records (model_runner/
// interleave.py draws them), activations quantized to int8 per 32-block.
//
//   1. x is quantized once per call, per row and 32-block: q = round(x / d), d = amax / 127,
//      with s = d * sum(q) per block and per 16-half (Acts).
//   2. A record is decoded in registers, never stored: one 32-byte load (plus an and, or a
//      shift and an and) gives 4 unsigned quants of each of 8 rows, and one 4-byte broadcast of
//      the activations feeds all 8 rows in one vpdpbusd (u8 x s8 -> int32 lanes = rows).
//   3. Every format is w = S * q + O per 32-block (per 16-half for Q6_K) with q unsigned:
//      Q4_0 O = -8 d, Q5_0 -16 d, Q8_0 -128 d (quants stored XOR 0x80), Q4_1 / Q5_1 O = m,
//      Q4_K / Q5_K S = d sc, O = -dmin mn, Q6_K S = d sc, O = -32 S; so
//          dot(w_row, x) = sum_b  S_b * d_b * (q . a)_b  +  O_b * s_b
//      one integer dot product and two FMAs a block, for every format.
//   4. A tile is 8 weight rows x NC <= 8 activation rows: each record is decoded once and
//      serves all NC columns. Rows past 8 columns take further tiles over the same records
//      (from L1/L2), so any M runs the same per-(row, column) arithmetic: a row's result does
//      not depend on its batch.
//
// Registers: on the AVX-512 family a tile is 8 rows in ymm (NC activation columns) or two
// records joined lane-wise into zmm (16 rows a broadcast), from one column up: on Zen 4 a
// vpdpbusd with a broadcast operand runs 42 multiply-adds a cycle on ymm and 64 on zmm
// (measured; docs/kernels.md). AVX2 (no VNNI) replaces vpdpbusd by maddubs + madd (no
// saturation: quants <= 63, and Q8_0 takes the sign trick on its signed bytes); the portable
// variant decodes one row at a time.
//
// The code is in four parts, included in this order inside the variant's namespace:
//   qvec.h     the register width: 8 lanes (ymm), 16 (zmm), or emulated ones (tests)
//   qdecode.h  activations, the formats' decoders (each with its scalar reference), the one
//              switch over the formats (with_decoder)
//   qtile.h    the tiles, written once over the width: 8 rows (one record), 16 rows (two
//              records joined), the L1-unpacked K chunk
//   qmatmul.h  (this file) the GEMM: row groups over threads, K chunks, the OpenMP team

#include "qvec.h"
#include "qdecode.h"
#include "qtile.h"

#ifndef KV_SPLIT_FORMAT  // the core object of a split family (kernels.cpp)
// ------------------------------------------------------------------ the GEMM

// Where row group g (rows 8g .. 8g + 7) of w lives: its part's records, `nrec` a row. A part
// holds them group after group, or where its rows are longer than a panel (QPart.panel
// records, interleave.panel_cols columns; the last panel shorter where they do not divide)
// panel after panel, each panel's groups in turn: a pass over one panel's groups is one
// stream whose activations stay in L1.
struct GroupRecs {
  const uint8_t* base;  // the part's records
  int64_t g, groups;    // the group in its part, the part's groups
  int fmt, nrec, panel, record;  // panel: records a panel (nrec where the part has none)
  // Record b; records b .. up to the end of b's panel follow it.
  KV_INLINE const uint8_t* at(int b) const {
    const int c = b / panel, len = imin(panel, nrec - c * panel);  // panel c's records a row
    return base + record * ((int64_t)c * panel * groups + g * len + b % panel);
  }
};

inline GroupRecs group_records(const QW& w, int64_t g) {
  int i = 0;
  while (i + 1 < w.nparts && g >= w.parts[i].rows / ROWS) g -= w.parts[i++].rows / ROWS;
  const QPart& p = w.parts[i];
  const FormatInfo fi = format_info(p.fmt);
  const int nrec = (w.k + fi.block - 1) / fi.block;  // only int8 rows (Q8_0) end in a partial block
  return GroupRecs{p.rec, g, (p.rows + ROWS - 1) / ROWS, p.fmt, nrec, p.panel > 0 ? p.panel : nrec, fi.record};
}

// The columns a panel of w holds (K where it has none): every part's are the same.
inline int panel_cols(const QW& w) {
  const QPart& p = w.parts[0];
  return p.panel > 0 ? imin(w.k, p.panel * format_info(p.fmt).block) : w.k;
}

// e^x for the gated epilogues: Cephes' expf (x = n ln 2 + r, |r| <= ln 2 / 2, a degree-5
// polynomial; ~1 ulp), in plain arithmetic the compiler vectorizes: std::exp is a call per
// element, and a 1B model's decode step takes 131k of them (a 512-token prefill 67M).
KV_INLINE float exp_approx(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);  // 2^n stays a normal float
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f - n * -2.12194440e-4f;  // ln 2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * (r * r) + r + 1.f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

KV_INLINE float silu(float v) { return v / (1.f + exp_approx(-v)); }
// torch's gelu(approximate="tanh"), 0.5 x (1 + tanh(u)) with u = sqrt(2 / pi) (x + 0.044715 x^3),
// as x / (1 + e^(-2u)) (the same value: 1 + tanh(u) = 2 / (1 + e^(-2u))).
KV_INLINE float gelu_tanh(float v) {
  return v / (1.f + exp_approx(-1.5957691216057308f * (v + 0.044715f * v * v * v)));
}

// Asks for the first PREFETCH_AHEAD bytes of row groups g .. g + ng - 1 (each its own record
// stream). A tile's records prefetch PREFETCH_AHEAD ahead of themselves, so the stream a tile
// starts would come from DRAM on demand, a latency every few lines: on short rows (K = 2048,
// 9 KB of Q4_K a group, a pair's second group and gate_up's up half each start cold) that
// stall is a fixed cost per 16 rows that long rows hide. The GEMM calls this one stream
// ahead of the tile it runs, so the heads arrive while that tile computes.
inline void prefetch_head(const QW& w, int g, int ng) {
  for (int i = 0; i < ng; ++i) {
    const GroupRecs gr = group_records(w, g + i);
    const uint8_t* rec = gr.at(0);
    const int64_t bytes = (int64_t)imin(gr.panel, gr.nrec) * gr.record;
    for (int64_t o = 0; o < bytes && o < g_tuning.prefetch_head; o += 64) __builtin_prefetch(rec + o, 0, 3);
  }
}

// The activations of columns [k0, ...) only: the same rows, their blocks from k0 / 32 on.
inline Acts from_column(const Acts& a, int k0) {
  const int kb = k0 / 32;
  return Acts{a.q + a.bs * kb, a.u + kb, a.s + kb, a.s16 + 2 * kb, a.plane, a.bs, a.KB, a.lda, a.residual};
}

// acc[ldc c + r] += rows 8 g .. 8 (g + ng) - 1 (ng = 1 or 2, ldc = 8 ng) times activation rows
// c0 .. c0 + nc - 1, over the weight columns [k0, k1) (k0 a multiple of 256, or 0; within
// one panel).
void run_rows(const QW& w, int g, int ng, const Acts& a, int k0, int k1, int c0, int nc, float* acc) {
  const Acts ak = from_column(a, k0);
  const GroupRecs g0 = group_records(w, g);
  const FormatInfo fi = format_info(g0.fmt);
  const int nrec = (k1 - k0 + fi.block - 1) / fi.block;
  const uint8_t* rec = g0.at(k0 / fi.block);
  if (ng == 2) {
    const GroupRecs g1 = group_records(w, g + 1);
    const FormatInfo f1 = format_info(g1.fmt);
    const uint8_t* rec1 = g1.at(k0 / f1.block);
    if (g1.fmt == g0.fmt && pair_tile(g0.fmt, rec, rec1, nrec, ak, c0, nc, acc)) return;
    group_tile(g0.fmt, rec, nrec, ak, c0, nc, acc, 16);
    group_tile(g1.fmt, rec1, (k1 - k0 + f1.block - 1) / f1.block, ak, c0, nc, acc + ROWS, 16);
    return;
  }
  group_tile(g0.fmt, rec, nrec, ak, c0, nc, acc, 8);
}

// Past this many activation rows the K range goes in chunks of K_CHUNK columns: the chunk's
// activations of every row stay in L2 while each row block's weights pass over them (from L1),
// instead of every row block streaming all M rows' activations from L3.
constexpr int CHUNK_MIN_M = 32, K_CHUNK = 512, UNPACK_MIN_M = 32;
// The bytes of running sums the panel order holds at once (qgemm_team).
constexpr size_t PANEL_SUMS = 64 << 10;

// Decodes rows 8 gg .. 8 gg + 15 (one format) over columns [k0, k1) into ub; false when the
// pair spans two formats (a QuantStack's parts) or the family has no 16-row path.
bool unpack_chunk(const QW& w, int gg, int k0, int k1, Unpacked* ub) {
  const GroupRecs r0 = group_records(w, gg), r1 = group_records(w, gg + 1);
  if (r0.fmt != r1.fmt) return false;
  const FormatInfo fi = format_info(r0.fmt);
  return unpack_pair(r0.fmt, r0.at(k0 / fi.block), r1.at(k0 / fi.block), (k1 - k0 + fi.block - 1) / fi.block, ub);
}

// The activation buffers of one matmul, shared by the team that runs it (sized by `reserve`
// before the team starts: the team never allocates).
struct ActBufs {
  Buf q, u, s, s16;
  void reserve(int M, int K) {
    const int KB = (K + 31) / 32;
    q.get<int8_t>((size_t)M * 2 * 32 * KB);
    u.get<float>((size_t)M * KB);
    s.get<float>((size_t)M * KB);
    s16.get<float>((size_t)M * 2 * KB);
  }
};

// out[M, ldo] (epilogue) x[M, ldx] @ W^T (see kv_qgemm), run by thread `tid` of a team of
// `nth` that all call it: the rows' quantization and then the row blocks are split across
// the team, with a barrier after each (the caller reads `out` after it returns). `bufs` is
// shared and reserved for (M, K).
void qgemm_team(const QW& w, const float* x, int M, int ldx, float* out, int ldo, const float* bias,
                const float* res, int ldr, int epilogue, int residual, ActBufs& bufs, int tid, int nth) {
  const int K = w.k, KB = (K + 31) / 32, K32 = 32 * KB, lda = residual ? 2 * K32 : K32;
  int8_t* q = static_cast<int8_t*>(bufs.q.p);
  float* u = static_cast<float*>(bufs.u.p);
  float* s = static_cast<float*>(bufs.s.p);
  float* s16 = static_cast<float*>(bufs.s16.p);
  for (int i = tid; i < M; i += nth) {
    quantize_row(x + (int64_t)i * ldx, K, residual != 0, q + (int64_t)i * lda, u + (int64_t)i * KB,
                 s + (int64_t)i * KB, s16 + (int64_t)i * 2 * KB);
  }
  if (nth > 1) {
#pragma omp barrier
  }
  const Acts acts{q, u, s, s16, residual ? 32 : 0, residual ? 64 : 32, KB, lda, residual != 0};
  const bool gated = epilogue == EPI_SILU_MUL || epilogue == EPI_GELU_MUL;  // gate rows, then up rows
  const int nout = gated ? w.n / 2 : w.n;
  const int groups = (nout + ROWS - 1) / ROWS, up = nout / ROWS;
  // Row blocks of 2 groups (zmm, where the variant has it) where M x K (K: a panel's) reaches
  // g_tuning.pair_min_mk (qvec.h, Tuning): by default always, as on the Xeon model 167 the
  // M = 1 stream reads faster with 16 rows a broadcast too (measured).
  const int pcols = panel_cols(w);
  const bool pairs = (int64_t)M * pcols >= g_tuning.pair_min_mk;
  const int per = pairs ? 2 : 1, blocks = (groups + per - 1) / per, rb = per * ROWS;
  // Columns a call takes: 8 (the residual's tiles take 4 where 8 would spill: run_tiles).
  const int cols = 8;
  // K in chunks: K_CHUNK columns past CHUNK_MIN_M rows, and never across a panel (a chunk
  // ends at the panel's end: next_k).
  const int kc = imin(M >= CHUNK_MIN_M && K > K_CHUNK ? K_CHUNK : K, pcols);
  auto next_k = [&](int k0) { return imin(imin(K, k0 + kc), (k0 / pcols + 1) * pcols); };
  // Few rows over a paneled weight: panel after panel, each over a window of this thread's
  // row blocks (one stream, the panel's activations in L1), the blocks' sums held across
  // panels.
  const bool panel_order = kc < K && M < CHUNK_MIN_M;
  const int b0 = (int)((int64_t)blocks * tid / nth), b1 = (int)((int64_t)blocks * (tid + 1) / nth);
  // The blocks whose sums the panel order holds at once: PANEL_SUMS bytes (the 1B's head at
  // M = 8 held 4 MB of them, read and written back from L3 every panel).
  const size_t per_blk = (size_t)M * rb, sums_blk = per_blk * sizeof(float) * (gated ? 2 : 1);
  const size_t held = panel_order ? (size_t)imax(1, imin(b1 - b0, (int)(PANEL_SUMS / sums_blk))) : 1;
  static thread_local Buf gbuf, ubuf2, unbuf;
  float* ygs = gbuf.get<float>(per_blk * held);  // [M][rb] a block: the running sums, column-major
  float* yus = gated ? ubuf2.get<float>(per_blk * held) : nullptr;
  // Past UNPACK_MIN_M rows a chunk of a row pair is decoded once for all column tiles.
  Unpacked* ub = HAS_UNPACKED && M >= UNPACK_MIN_M ? unbuf.get<Unpacked>((size_t)UNPACK_SETS * ((kc + 31) / 32)) : nullptr;
  if (b0 < b1 && kc == K) prefetch_head(w, b0 * per, imin(per, groups - b0 * per));
  // Block blk's sums over the columns [k0, k1), added into yg (and yu).
  auto pass = [&](int blk, int k0, int k1, float* yg, float* yu) {
    const int g = blk * per, ng = imin(per, groups - g), ldc = ng * ROWS;
    for (int half = 0; half < (yu ? 2 : 1); ++half) {
      const int gg = half ? g + up : g;
      float* y = half ? yu : yg;
      if (kc == K) {  // one pass over each stream: the next one's head (up half, next block)
        if (yu && half == 0) {
          prefetch_head(w, g + up, ng);
        } else if (blk + 1 < b1) {
          prefetch_head(w, g + per, imin(per, groups - g - per));
        }
      }
      if (ub && ng == 2 && unpack_chunk(w, gg, k0, k1, ub)) {
        const Acts ak = from_column(acts, k0);
        const int fmt = group_records(w, gg).fmt;
        // 8 columns at a time (the tiles take 4 where more would spill), both 8-row sets
        // of a family without pairs while the columns' activations are in L1.
        for (int c0 = 0; c0 < M; c0 += 8) {
          unpacked_tiles(fmt, ub, (k1 - k0 + 31) / 32, ak, c0, imin(8, M - c0), y + (int64_t)c0 * ldc);
        }
        continue;
      }
      for (int c0 = 0; c0 < M; c0 += cols) {
        run_rows(w, gg, ng, acts, k0, k1, c0, imin(cols, M - c0), y + (int64_t)c0 * ldc);
      }
    }
  };
  // Block blk's outputs from its sums.
  auto finish = [&](int blk, const float* yg, const float* yu) {
    const int g = blk * per, ldc = imin(per, groups - g) * ROWS;
    const int rows = imin(ldc, nout - ROWS * g);
    for (int c = 0; c < M; ++c) {
      float* o = out + (int64_t)c * ldo + ROWS * g;
      const float* yc = yg + (int64_t)c * ldc;
      const float* b = bias ? bias + ROWS * g : nullptr;
      // One loop per epilogue, no branch inside: each vectorizes (the activations too).
      if (gated) {
        const float* uc = yu + (int64_t)c * ldc;
        float gate[2 * ROWS], upv[2 * ROWS];
        for (int r = 0; r < rows; ++r) {
          gate[r] = yc[r] + (b ? b[r] : 0.f);
          upv[r] = uc[r] + (b ? b[nout + r] : 0.f);
        }
        if (epilogue == EPI_SILU_MUL) {
          for (int r = 0; r < rows; ++r) o[r] = silu(gate[r]) * upv[r];
        } else {
          for (int r = 0; r < rows; ++r) o[r] = gelu_tanh(gate[r]) * upv[r];
        }
      } else if (epilogue == EPI_ADD) {
        const float* rc = res + (int64_t)c * ldr + ROWS * g;
        for (int r = 0; r < rows; ++r) o[r] = rc[r] + (yc[r] + (b ? b[r] : 0.f));
      } else {
        for (int r = 0; r < rows; ++r) o[r] = yc[r] + (b ? b[r] : 0.f);
      }
    }
  };
  if (panel_order) {  // windows of blocks whose sums stay in L2, each panel by panel
    for (int w0 = b0; w0 < b1; w0 += (int)held) {
      const int w1 = imin(b1, w0 + (int)held);
      memset(ygs, 0, sizeof(float) * per_blk * (w1 - w0));
      if (yus) memset(yus, 0, sizeof(float) * per_blk * (w1 - w0));
      for (int k0 = 0; k0 < K; k0 = next_k(k0)) {
        for (int blk = w0; blk < w1; ++blk) {
          const size_t at = per_blk * (blk - w0);
          pass(blk, k0, next_k(k0), ygs + at, yus ? yus + at : nullptr);
        }
      }
      for (int blk = w0; blk < w1; ++blk) {
        const size_t at = per_blk * (blk - w0);
        finish(blk, ygs + at, yus ? yus + at : nullptr);
      }
    }
  } else {
    for (int blk = b0; blk < b1; ++blk) {
      memset(ygs, 0, sizeof(float) * per_blk);
      if (yus) memset(yus, 0, sizeof(float) * per_blk);
      for (int k0 = 0; k0 < K; k0 = next_k(k0)) pass(blk, k0, next_k(k0), ygs, yus);
      finish(blk, ygs, yus);
    }
  }
  if (nth > 1) {
#pragma omp barrier
  }
}

// The team a matmul of this size is worth: small ones run on the calling thread alone.
inline int team_size(const QW& w, int M, int nthreads) {
  return (int64_t)w.n * w.k * M >= 32768 && w.n > 2 * ROWS ? nthreads : 1;
}

// out[M, ldo] (epilogue) x[M, ldx] @ W^T; see kv_qgemm.
void qgemm(const QW& w, const float* x, int M, int ldx, float* out, int ldo, const float* bias, const float* res,
           int ldr, int epilogue, int residual, int nthreads) {
  static thread_local ActBufs bufs;
  bufs.reserve(M, w.k);
  ActBufs* shared = &bufs;  // the calling thread's, taken here: inside the team each thread
                            // would name its own thread_local
  const int nt = team_size(w, M, nthreads);
#pragma omp parallel num_threads(nt) if (nt > 1)
  qgemm_team(w, x, M, ldx, out, ldo, bias, res, ldr, epilogue, residual, *shared, omp_get_thread_num(),
             omp_get_num_threads());
}

// Rows of W as fp32: out[r, :K] = W[ids[r]] (ids == NULL: rows row0 .. row0 + nrows - 1).
void dequant(const QW& w, const int64_t* ids, int64_t row0, int nrows, float* out, int ldo, int nthreads) {
  const int K = w.k;
  const int nt = (int64_t)nrows * K >= 65536 ? nthreads : 1;
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
  for (int i = 0; i < nrows; ++i) {
    const int64_t row = ids ? ids[i] : row0 + i;
    const GroupRecs gr = group_records(w, row / ROWS);
    float* dst = out + (int64_t)i * ldo;
    with_decoder(gr.fmt, [&](auto d) {
      typedef typename decltype(d)::type D;
      for (int b = 0; b < gr.nrec; ++b) {
        for (int sub = 0; sub < D::SUBS; ++sub) {
          uint8_t q[32];
          float S[2], O[2];
          D::row(gr.at(b), (int)(row % ROWS), sub, q, S, O);
          const int k0 = b * D::BLOCK + 32 * sub;
          for (int e = 0; e < 32 && k0 + e < K; ++e) dst[k0 + e] = S[e / 16] * (float)q[e] + O[e / 16];
        }
      }
    });
  }
}
#endif  // KV_SPLIT_FORMAT
