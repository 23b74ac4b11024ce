// kvserve CPU kernels over quantized weights: skinny GEMM for decode (M up to ~32 rows) and
// dequantization (prefill panels, embedding rows).
//
// Weight layouts (repacked once at load by model_runner/quant.py; K is padded to KB * 32):
//
//   q4: qs  uint8 [N, KB, 16]  two 4-bit values a byte, ggml order: byte j holds element j
//                              (low nibble) and element j + 16 (high nibble) of its block
//       d   fp32  [N, KB]      w = q * d + m          (GGUF Q4_1 as is; Q4_0: m = -8 d)
//       m   fp32  [N, KB]
//   q8: qs  int8  [N, KB * 32]
//       d   fp32  [N, KB]      w = q * d              (GGUF Q8_0; int8 per-channel: d per row)
//
// y = x @ W.T, three paths by the number of activation rows M (activations stay fp32 or go to
// int16; never int8 as in llama.cpp, which flipped greedy tokens of SmolLM2 on near-ties):
//   M <= 2:   activations quantized to int16 per 32-block, weights widened to int16 for
//             _mm256_madd_epi16 (|error| ~2e-5 relative; half the instructions of the others)
//   M <= 8:   each 32-value weight block dequantized in registers (4 x 8 fp32 lanes) and
//             multiplied into every row with FMAs: the dequantized-fp32 matmul up to order
//   M > 8:    chunks of 8 weight rows dequantized to fp32 (L1-resident), then a 4 x 16
//             register-blocked micro-kernel over the activations transposed to [K][M]
// Bandwidth: 0.75 bytes a weight (q4, with fp32 scales) instead of 4 (fp32).
//
// Threads: OpenMP with the caller's thread count. The library links libgomp.so.1, the soname
// torch's own OpenMP runtime has, so inside a process that imported torch the loader binds
// both to the one runtime and its one thread pool (a second pool cost 1.7x per step).

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KV_X86 1
#define KV_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define KV_X86 0
#endif

namespace {

constexpr int QK = 32;
enum Format { FMT_Q4 = 0, FMT_Q8 = 1 };
enum Epilogue { EPI_NONE = 0, EPI_ADD = 1, EPI_SILU_MUL = 2 };

bool g_use_avx2 = false;

struct Weights {
  int fmt;
  const uint8_t* qs;
  const float* d;
  const float* m;
  int K, KB;
};

struct Rows {
  const float* x;  // [M, ldx] fp32
  int M, ldx;
  // Set for M <= I16_MAX_ROWS on the SIMD path: x quantized to int16 per 32-block.
  const int16_t* q16 = nullptr;  // [M, KB * 32]
  const float* d16 = nullptr;    // [M, KB]: scale
  const float* s16 = nullptr;    // [M, KB]: scale * sum(q): the block sum of the values used
};

// One or two rows (decode at low batch) cannot share the cost of dequantizing a weight block
// to fp32 (~17 instructions per 32 weights); there the activations go to int16 per 32-block
// instead, and the weights only widen to int16 for _mm256_madd_epi16: half the instructions.
// int16 keeps 15 bits (|error| <= 1.5e-5 of the block's largest value), so results stay
// within 1e-4 of the fp32 path, unlike llama.cpp's int8 activations, which flipped greedy
// tokens of SmolLM2 on near-ties.
constexpr int I16_MAX_ROWS = 2;

// Element j of block b of row n, dequantized.
inline float weight_at(const Weights& w, int64_t n, int b, int j) {
  const int64_t blk = n * w.KB + b;
  if (w.fmt == FMT_Q4) {
    const uint8_t v = w.qs[blk * (QK / 2) + j % (QK / 2)];
    const int q = j < QK / 2 ? (v & 0x0F) : (v >> 4);
    return (float)q * w.d[blk] + w.m[blk];
  }
  return (float)reinterpret_cast<const int8_t*>(w.qs)[blk * QK + j] * w.d[blk];
}

// y[i] (+)= dot(W[n], x[i]) over blocks b0.. for every row i: the portable path, and the
// partial last block of the SIMD path.
void row_dot_scalar(const Weights& w, const Rows& a, int64_t n, int b0, float* y, bool add) {
  float wb[QK];
  if (!add) {
    for (int i = 0; i < a.M; ++i) y[i] = 0.f;
  }
  for (int b = b0; b < w.KB; ++b) {
    const int k0 = b * QK;
    const int cnt = w.K - k0 < QK ? w.K - k0 : QK;
    for (int j = 0; j < cnt; ++j) wb[j] = weight_at(w, n, b, j);
    for (int i = 0; i < a.M; ++i) {
      const float* x = a.x + (int64_t)i * a.ldx + k0;
      float acc = 0.f;
      for (int j = 0; j < cnt; ++j) acc += wb[j] * x[j];
      y[i] += acc;
    }
  }
}

#if KV_X86
KV_AVX2 inline float hsum_ps(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// Block blk (row-major block index) as 4 x 8 fp32: elements 0-7, 8-15, 16-23, 24-31.
KV_AVX2 inline void load_block(const Weights& w, int64_t blk, __m256 out[4]) {
  if (w.fmt == FMT_Q4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + blk * (QK / 2)));
    const __m128i nib = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(v, nib);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), nib);
    const __m256 d = _mm256_set1_ps(w.d[blk]), m = _mm256_set1_ps(w.m[blk]);
    out[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m);
    out[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m);
    out[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m);
    out[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m);
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(w.qs) + blk * QK;
    const __m256 d = _mm256_set1_ps(w.d[blk]);
    for (int v = 0; v < 4; ++v) {
      const __m128i b8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * v));
      out[v] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b8)), d);
    }
  }
}

// R activation rows share each dequantized block; A accumulators per row hide FMA latency.
template <int R, int A>
KV_AVX2 inline void tile(const Weights& w, const Rows& a, int64_t n, int i0, int nfull, float* y) {
  __m256 acc[R][A];
  const float* x[R];
  for (int r = 0; r < R; ++r) {
    x[r] = a.x + (int64_t)(i0 + r) * a.ldx;
    for (int c = 0; c < A; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  __m256 wv[4];
  for (int b = 0; b < nfull; ++b) {
    load_block(w, n * w.KB + b, wv);
    for (int r = 0; r < R; ++r) {
      const float* xb = x[r] + b * QK;
      for (int v = 0; v < 4; ++v) {
        acc[r][v % A] = _mm256_fmadd_ps(wv[v], _mm256_loadu_ps(xb + 8 * v), acc[r][v % A]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 sum = acc[r][0];
    for (int c = 1; c < A; ++c) sum = _mm256_add_ps(sum, acc[r][c]);
    y[i0 + r] = hsum_ps(sum);
  }
}

KV_AVX2 void quantize_row_i16(const float* x, int K, int16_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const int rnd = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int b = 0; b < K / QK; ++b) {
    const float* xb = x + b * QK;
    __m256 v[4];
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float dd = _mm_cvtss_f32(m4) / 32767.f;
    const __m256 id = _mm256_set1_ps(dd != 0.f ? 1.f / dd : 0.f);
    __m256i iv[4];
    __m256i isum = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      iv[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], id), rnd));
      isum = _mm256_add_epi32(isum, iv[i]);
    }
    // packs works per 128-bit lane; permute4x64 restores element order.
    const __m256i p0 = _mm256_permute4x64_epi64(_mm256_packs_epi32(iv[0], iv[1]), 0xD8);
    const __m256i p1 = _mm256_permute4x64_epi64(_mm256_packs_epi32(iv[2], iv[3]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QK), p0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QK + 16), p1);
    d[b] = dd;
    s[b] = dd * hsum_ps(_mm256_cvtepi32_ps(isum));
  }
}

// The weights of block blk widened to 2 x 16 int16 (elements 0-15, 16-31).
KV_AVX2 inline void load_block_i16(const Weights& w, int64_t blk, __m256i out[2]) {
  if (w.fmt == FMT_Q4) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + blk * (QK / 2)));
    const __m128i nib = _mm_set1_epi8(0x0F);
    out[0] = _mm256_cvtepu8_epi16(_mm_and_si128(v, nib));
    out[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), nib));
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(w.qs) + blk * QK;
    out[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    out[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
  }
}

// acc[r] += (W block b of row n) . (x block b of row i0 + r) for R rows, wv holding the block.
template <int R>
KV_AVX2 inline void block_i16(const Weights& w, const Rows& a, int i0, int b, float wdb,
                              const __m256i* wv, __m256* acc) {
  const int KB = w.KB;
  for (int r = 0; r < R; ++r) {
    const int16_t* xq = a.q16 + ((int64_t)(i0 + r) * KB + b) * QK;
    const __m256i p = _mm256_add_epi32(
        _mm256_madd_epi16(wv[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq))),
        _mm256_madd_epi16(wv[1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 16))));
    const __m256 scale = _mm256_set1_ps(wdb * a.d16[(int64_t)(i0 + r) * KB + b]);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r]);
  }
}

// Two accumulators a row, alternating blocks: one FMA a block would otherwise chain on the
// FMA latency (4 cycles), which is about the whole block's throughput cost.
template <int R>
KV_AVX2 inline void tile_i16(const Weights& w, const Rows& a, int64_t n, int i0, int nfull, float* y) {
  const int KB = w.KB;
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  __m256i wv[2];
  const float* wd = w.d + n * KB;
  int b = 0;
  for (; b + 2 <= nfull; b += 2) {
    load_block_i16(w, n * KB + b, wv);
    block_i16<R>(w, a, i0, b, wd[b], wv, acc0);
    load_block_i16(w, n * KB + b + 1, wv);
    block_i16<R>(w, a, i0, b + 1, wd[b + 1], wv, acc1);
  }
  for (; b < nfull; ++b) {
    load_block_i16(w, n * KB + b, wv);
    block_i16<R>(w, a, i0, b, wd[b], wv, acc0);
  }
  for (int r = 0; r < R; ++r) {
    float v = hsum_ps(_mm256_add_ps(acc0[r], acc1[r]));
    if (w.fmt == FMT_Q4) {  // + sum_b m[b] * s[b]
      const float* wm = w.m + n * KB;
      const float* xs = a.s16 + (int64_t)(i0 + r) * KB;
      for (int k = 0; k < nfull; ++k) v += wm[k] * xs[k];
    }
    y[i0 + r] = v;
  }
}

KV_AVX2 void row_dot_avx2(const Weights& w, const Rows& a, int64_t n, float* y) {
  const int nfull = w.K / QK;  // whole blocks; a partial last block goes the scalar way
  int i = 0;
  if (a.q16 != nullptr) {
    if (a.M == 2) tile_i16<2>(w, a, n, 0, nfull, y);
    if (a.M == 1) tile_i16<1>(w, a, n, 0, nfull, y);
    i = a.M;
  }
  for (; i + 8 <= a.M; i += 8) tile<8, 1>(w, a, n, i, nfull, y);
  for (; i + 4 <= a.M; i += 4) tile<4, 2>(w, a, n, i, nfull, y);
  switch (a.M - i) {
    case 3: tile<3, 2>(w, a, n, i, nfull, y); break;
    case 2: tile<2, 2>(w, a, n, i, nfull, y); break;
    case 1: tile<1, 4>(w, a, n, i, nfull, y); break;
    default: break;
  }
  if (nfull < w.KB) row_dot_scalar(w, a, n, nfull, y, true);
}

KV_AVX2 void dequant_blocks_avx2(const Weights& w, int64_t n, int nfull, float* out) {
  __m256 v[4];
  for (int b = 0; b < nfull; ++b) {
    load_block(w, n * w.KB + b, v);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + b * QK + 8 * i, v[i]);
  }
}
#endif

inline void row_dot(const Weights& w, const Rows& a, int64_t n, float* y) {
#if KV_X86
  if (g_use_avx2) {
    row_dot_avx2(w, a, n, y);
    return;
  }
#endif
  row_dot_scalar(w, a, n, 0, y, false);
}

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

#if KV_X86
// Many rows: dequantize a chunk of weight rows to fp32 once (L1-resident), then a
// register-blocked micro-kernel: 4 weight rows x 16 activation rows of accumulators, one
// broadcast weight times 8 activation rows (x transposed to [K][Mp]) per FMA. FMA-bound:
// 8 FMAs per 2 loads + 4 broadcasts per k.
// Named accumulators: GCC keeps an accumulator array of this size on the stack.
KV_AVX2 void micro4x16(const float* wb, int K, const float* xt, int mp, int m0, float* y) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00;
  __m256 c20 = c00, c21 = c00, c30 = c00, c31 = c00;
  const float *w0 = wb, *w1 = wb + K, *w2 = wb + 2 * K, *w3 = wb + 3 * K;
  const float* x = xt + m0;
  for (int k = 0; k < K; ++k, x += mp) {
    const __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8);
    __m256 w = _mm256_broadcast_ss(w0 + k);
    c00 = _mm256_fmadd_ps(w, x0, c00);
    c01 = _mm256_fmadd_ps(w, x1, c01);
    w = _mm256_broadcast_ss(w1 + k);
    c10 = _mm256_fmadd_ps(w, x0, c10);
    c11 = _mm256_fmadd_ps(w, x1, c11);
    w = _mm256_broadcast_ss(w2 + k);
    c20 = _mm256_fmadd_ps(w, x0, c20);
    c21 = _mm256_fmadd_ps(w, x1, c21);
    w = _mm256_broadcast_ss(w3 + k);
    c30 = _mm256_fmadd_ps(w, x0, c30);
    c31 = _mm256_fmadd_ps(w, x1, c31);
  }
  float* o = y + m0;
  _mm256_storeu_ps(o, c00);
  _mm256_storeu_ps(o + 8, c01);
  _mm256_storeu_ps(o + mp, c10);
  _mm256_storeu_ps(o + mp + 8, c11);
  _mm256_storeu_ps(o + 2 * mp, c20);
  _mm256_storeu_ps(o + 2 * mp + 8, c21);
  _mm256_storeu_ps(o + 3 * mp, c30);
  _mm256_storeu_ps(o + 3 * mp + 8, c31);
}

KV_AVX2 void micro4x8(const float* wb, int K, const float* xt, int mp, int m0, float* y) {
  __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
  const float *w0 = wb, *w1 = wb + K, *w2 = wb + 2 * K, *w3 = wb + 3 * K;
  const float* x = xt + m0;
  for (int k = 0; k < K; ++k, x += mp) {
    const __m256 x0 = _mm256_loadu_ps(x);
    c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(w0 + k), x0, c0);
    c1 = _mm256_fmadd_ps(_mm256_broadcast_ss(w1 + k), x0, c1);
    c2 = _mm256_fmadd_ps(_mm256_broadcast_ss(w2 + k), x0, c2);
    c3 = _mm256_fmadd_ps(_mm256_broadcast_ss(w3 + k), x0, c3);
  }
  float* o = y + m0;
  _mm256_storeu_ps(o, c0);
  _mm256_storeu_ps(o + mp, c1);
  _mm256_storeu_ps(o + 2 * mp, c2);
  _mm256_storeu_ps(o + 3 * mp, c3);
}

// y[r][m] (r < n1 - n0, m < Mp) = W[n0 + r] . x[m], weights dequantized into wb (rows past
// n1 are zero, so the micro-kernel always runs 4 rows; y has room for CHUNK rows).
KV_AVX2 void chunk_gemm(const Weights& w, int64_t n0, int n1, const float* xt, int mp, float* wb, float* y) {
  const int K = w.K, nfull = K / QK, rows = (int)(n1 - n0), padded = (rows + 3) / 4 * 4;
  for (int r = 0; r < padded; ++r) {
    float* dst = wb + (int64_t)r * K;
    if (r >= rows) {
      for (int k = 0; k < K; ++k) dst[k] = 0.f;
      continue;
    }
    dequant_blocks_avx2(w, n0 + r, nfull, dst);
    for (int b = nfull; b < w.KB; ++b) {
      const int cnt = K - b * QK;
      for (int j = 0; j < cnt; ++j) dst[b * QK + j] = weight_at(w, n0 + r, b, j);
    }
  }
  for (int r = 0; r < padded; r += 4) {
    int m0 = 0;
    for (; m0 + 16 <= mp; m0 += 16) micro4x16(wb + (int64_t)r * K, K, xt, mp, m0, y + (int64_t)r * mp);
    if (m0 < mp) micro4x8(wb + (int64_t)r * K, K, xt, mp, m0, y + (int64_t)r * mp);
  }
}
#endif

constexpr int CHUNK = 8;  // weight rows per work item
// Up to this many rows, row-at-a-time tiles (dequantized registers shared by the rows);
// above, chunk_gemm's micro-kernel, whose dequantization pays off across more rows.
constexpr int TILE_MAX_ROWS = 8;

void qgemm(const Weights& w, int N, const Rows& rows, float* out, int ldo, const float* bias,
           const float* res, int ldr, int epilogue, int nthreads) {
  const int M = rows.M, K = w.K;
  Rows a = rows;
  // Activations shared by every thread: int16 blocks (1-2 rows) or transposed fp32 (3+).
  static thread_local std::vector<int16_t> q16;
  static thread_local std::vector<float> d16, s16, xt;
  int mp = 0;
#if KV_X86
  if (g_use_avx2 && M <= I16_MAX_ROWS && K % QK == 0) {
    q16.resize((size_t)M * K);
    d16.resize((size_t)M * w.KB);
    s16.resize((size_t)M * w.KB);
    for (int i = 0; i < M; ++i) {
      quantize_row_i16(a.x + (int64_t)i * a.ldx, K, q16.data() + (int64_t)i * K, d16.data() + (int64_t)i * w.KB,
                       s16.data() + (int64_t)i * w.KB);
    }
    a.q16 = q16.data();
    a.d16 = d16.data();
    a.s16 = s16.data();
  } else if (g_use_avx2 && M > TILE_MAX_ROWS) {
    mp = (M + 7) / 8 * 8;
    xt.assign((size_t)K * mp, 0.f);
    for (int i = 0; i < M; ++i) {
      const float* xr = a.x + (int64_t)i * a.ldx;
      for (int k = 0; k < K; ++k) xt[(size_t)k * mp + i] = xr[k];
    }
  }
#endif
  const float* xtp = xt.data();
  const int nout = epilogue == EPI_SILU_MUL ? N / 2 : N;
  const int chunks = (nout + CHUNK - 1) / CHUNK;
  const int nt = (int64_t)nout * K * M >= 32768 ? nthreads : 1;
  const int ly = mp > 0 ? mp : M;  // row stride of y
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    std::vector<float> y(2 * (size_t)CHUNK * ly);
    std::vector<float> wb(mp > 0 ? (size_t)CHUNK * K : 0);
#pragma omp for schedule(static)
    for (int c = 0; c < chunks; ++c) {
      const int n0 = c * CHUNK, n1 = n0 + CHUNK < nout ? n0 + CHUNK : nout;
      float* yg = y.data();
      float* yu = y.data() + (size_t)CHUNK * ly;
      for (int half = 0; half < (epilogue == EPI_SILU_MUL ? 2 : 1); ++half) {
        const int off = half * nout;
        float* dst = half ? yu : yg;
#if KV_X86
        if (mp > 0) {
          chunk_gemm(w, n0 + off, n1 + off, xtp, mp, wb.data(), dst);
          continue;
        }
#endif
        for (int n = n0; n < n1; ++n) row_dot(w, a, n + off, dst + (int64_t)(n - n0) * ly);
      }
      for (int n = n0; n < n1; ++n) {
        const float* yn = yg + (int64_t)(n - n0) * ly;
        if (epilogue == EPI_SILU_MUL) {
          const float* un = yu + (int64_t)(n - n0) * ly;
          const float bg = bias ? bias[n] : 0.f, bu = bias ? bias[n + nout] : 0.f;
          for (int i = 0; i < M; ++i) out[(int64_t)i * ldo + n] = silu(yn[i] + bg) * (un[i] + bu);
        } else {
          const float bn = bias ? bias[n] : 0.f;
          if (epilogue == EPI_ADD) {
            for (int i = 0; i < M; ++i) out[(int64_t)i * ldo + n] = res[(int64_t)i * ldr + n] + yn[i] + bn;
          } else {
            for (int i = 0; i < M; ++i) out[(int64_t)i * ldo + n] = yn[i] + bn;
          }
        }
      }
    }
  }
}

}  // namespace

extern "C" {

// 1 when the AVX2 + FMA + F16C path is in use, 0 for the portable one.
int kv_init(int allow_simd) {
#if KV_X86
  __builtin_cpu_init();
  g_use_avx2 = allow_simd && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
#else
  (void)allow_simd;
#endif
  return g_use_avx2 ? 1 : 0;
}

int kv_omp_max_threads(void) { return omp_get_max_threads(); }

// out[M, ldo] (epilogue) x[M, ldx] @ W[N, K].T
//   EPI_NONE:     out = x W^T + bias
//   EPI_ADD:      out = res + x W^T + bias                (res may alias out)
//   EPI_SILU_MUL: W holds 2 * Nout rows, gate then up:
//                 out[:, n] = silu(x Wg[n]^T + bg) * (x Wu[n]^T + bu), n < Nout = N / 2
void kv_qgemm(int fmt, const uint8_t* qs, const float* wd, const float* wm, int N, int K,
              const float* x, int M, int ldx, float* out, int ldo, const float* bias,
              const float* res, int ldr, int epilogue, int nthreads) {
  const Weights w{fmt, qs, wd, wm, K, (K + QK - 1) / QK};
  qgemm(w, N, Rows{x, M, ldx}, out, ldo, bias, res, ldr, epilogue, nthreads);
}

// Rows of W as fp32: out[r, :K] = W[ids[r]] (ids == NULL: rows row0 .. row0 + nrows - 1).
void kv_dequant(int fmt, const uint8_t* qs, const float* wd, const float* wm, int K,
                const int64_t* ids, int64_t row0, int nrows, float* out, int ldo, int nthreads) {
  const Weights w{fmt, qs, wd, wm, K, (K + QK - 1) / QK};
  const int nt = (int64_t)nrows * K >= 65536 ? nthreads : 1;
#pragma omp parallel for num_threads(nt) schedule(static) if (nt > 1)
  for (int r = 0; r < nrows; ++r) {
    const int64_t n = ids ? ids[r] : row0 + r;
    float* o = out + (int64_t)r * ldo;
    int b = 0;
#if KV_X86
    if (g_use_avx2) {
      b = K / QK;
      dequant_blocks_avx2(w, n, b, o);
    }
#endif
    for (; b < w.KB; ++b) {
      const int cnt = K - b * QK < QK ? K - b * QK : QK;
      for (int j = 0; j < cnt; ++j) o[b * QK + j] = weight_at(w, n, b, j);
    }
  }
}

}  // extern "C"

// ------------------------------------------------------------------ the fused decode step
//
// One call runs every layer of a decode-only step (one new token per request) on quantized
// weights: no Python, no tensor dispatch between the ops of a layer:
//
//   x = rms_norm(h) -> qkv = x Wqkv (+b) -> RoPE(q, k) -> k, v into the paged pool
//     -> attention over the request's blocks -> h += attn Wo
//     -> x = rms_norm(h) -> a = silu(x Wg) * (x Wu) -> h += a Wd
//
// The pool is model_runner.kv_pool's: per layer [2 * kvh, num_blocks, block_size, head_dim]
// (K heads, then V heads), stored as fp32, fp16 or int8 (with one fp32 scale per head and
// token slot, [2 * kvh, num_blocks, block_size]). Writes quantize exactly as KVPool.write.

enum KVDtype { KV_F32 = 0, KV_F16 = 1, KV_I8 = 2 };

struct QW {
  int32_t fmt, n, k, pad;
  const uint8_t* qs;
  const float* d;
  const float* m;
};

struct DecodeLayer {
  const float* input_norm;
  const float* post_norm;
  const float* qkv_bias;  // or NULL
  QW qkv, o, gate_up, down;
  void* kv;
  float* kv_scales;  // int8 pools, else NULL
};

struct DecodeStep {
  float* hidden;                // [B, hidden], updated in place
  const int64_t* positions;     // [B]: the new token's position
  const int32_t* block_tables;  // [B, max_blocks]
  const float* rope;            // [max_len, head_dim / 2, 2]: cos, sin
  int32_t batch, hidden_size, num_heads, num_kv_heads, head_dim, intermediate;
  int32_t kv_dtype, num_blocks, block_size, max_blocks, window, nthreads;
  float eps;
  int32_t pad;
};

namespace {

inline Weights weights_of(const QW& q) { return Weights{q.fmt, q.qs, q.d, q.m, q.k, (q.k + QK - 1) / QK}; }

void rms_norm(const float* x, const float* w, float eps, int rows, int n, float* out) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + (int64_t)r * n;
    float ss = 0.f;
    for (int i = 0; i < n; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / n + eps);
    for (int i = 0; i < n; ++i) out[(int64_t)r * n + i] = xr[i] * inv * w[i];
  }
}

// In place: pairs (v[2i], v[2i+1]) rotated by the (cos, sin) of their frequency.
void rope(float* v, const float* cs, int half) {
  for (int i = 0; i < half; ++i) {
    const float a = v[2 * i], b = v[2 * i + 1], c = cs[2 * i], s = cs[2 * i + 1];
    v[2 * i] = a * c - b * s;
    v[2 * i + 1] = a * s + b * c;
  }
}

// IEEE half <-> float, round to nearest even (what torch's .to(float16) does); the F16C
// instructions where the CPU has them, else the same rounding in software.
uint16_t half_soft(float f) {
  uint32_t x;
  memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t mag = x & 0x7FFFFFFFu;
  if (mag >= 0x7F800000u) return (uint16_t)(sign | (mag > 0x7F800000u ? 0x7E00u : 0x7C00u));
  if (mag >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);  // rounds to >= 65520: inf
  if (mag < 0x38800000u) {                                    // subnormal half (or zero)
    const float a = std::fabs(f) * 16777216.f;                // 2^24: units of the half ulp
    return (uint16_t)(sign | (uint32_t)std::nearbyintf(a));
  }
  const uint32_t rounded = mag + 0x0FFFu + ((mag >> 13) & 1u);
  return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
}

float float_soft(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  float v;
  if (e == 0) {
    v = std::ldexp((float)m, -24);
  } else if (e == 31) {
    v = m ? NAN : INFINITY;
  } else {
    v = std::ldexp((float)(m | 0x400u), (int)e - 25);
  }
  uint32_t bits;
  memcpy(&bits, &v, 4);
  bits |= sign;
  memcpy(&v, &bits, 4);
  return v;
}

#if KV_X86
KV_AVX2 uint16_t half_f16c(float f) { return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
KV_AVX2 float float_f16c(uint16_t h) { return _cvtsh_ss(h); }
#endif

inline uint16_t to_half(float f) {
#if KV_X86
  if (g_use_avx2) return half_f16c(f);
#endif
  return half_soft(f);
}

inline float from_half(uint16_t h) {
#if KV_X86
  if (g_use_avx2) return float_f16c(h);
#endif
  return float_soft(h);
}

void kv_store(const DecodeStep& st, const DecodeLayer& L, int head, int64_t slot, const float* v) {
  const int D = st.head_dim;
  const int64_t idx = ((int64_t)head * st.num_blocks * st.block_size + slot) * D;
  if (st.kv_dtype == KV_F32) {
    memcpy(static_cast<float*>(L.kv) + idx, v, D * sizeof(float));
  } else if (st.kv_dtype == KV_F16) {
    uint16_t* o = static_cast<uint16_t*>(L.kv) + idx;
    for (int i = 0; i < D; ++i) o[i] = to_half(v[i]);
  } else {
    float amax = 0.f;
    for (int i = 0; i < D; ++i) amax = std::fmax(amax, std::fabs(v[i]));
    const float scale = std::fmax(amax, 1e-30f) * (float)(1.0 / 127.0);
    int8_t* o = static_cast<int8_t*>(L.kv) + idx;
    for (int i = 0; i < D; ++i) o[i] = (int8_t)std::nearbyintf(v[i] / scale);
    L.kv_scales[(int64_t)head * st.num_blocks * st.block_size + slot] = scale;
  }
}

#if KV_X86
KV_AVX2 int halves_to_floats_avx2(const uint16_t* p, int n, float* out) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
  }
  return i;
}
#endif

// Keys/values of one head at one slot, as fp32 into buf (int8: times its scale).
inline const float* kv_row(const DecodeStep& st, const DecodeLayer& L, int head, int64_t slot, float* buf) {
  const int D = st.head_dim;
  const int64_t idx = ((int64_t)head * st.num_blocks * st.block_size + slot) * D;
  if (st.kv_dtype == KV_F32) return static_cast<const float*>(L.kv) + idx;
  if (st.kv_dtype == KV_F16) {
    const uint16_t* p = static_cast<const uint16_t*>(L.kv) + idx;
    int i = 0;
#if KV_X86
    if (g_use_avx2) i = halves_to_floats_avx2(p, D, buf);
#endif
    for (; i < D; ++i) buf[i] = from_half(p[i]);
    return buf;
  }
  const int8_t* p = static_cast<const int8_t*>(L.kv) + idx;
  const float scale = L.kv_scales[(int64_t)head * st.num_blocks * st.block_size + slot];
  for (int i = 0; i < D; ++i) buf[i] = (float)p[i] * scale;
  return buf;
}

inline float dot(const float* a, const float* b, int n) {
  float acc = 0.f;
  for (int i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

#if KV_X86
KV_AVX2 float dot_avx2(const float* a, const float* b, int n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  float r = hsum_ps(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

KV_AVX2 void axpy_avx2(float a, const float* x, float* y, int n) {
  const __m256 va = _mm256_set1_ps(a);
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}
#endif

inline float vdot(const float* a, const float* b, int n) {
#if KV_X86
  if (g_use_avx2) return dot_avx2(a, b, n);
#endif
  return dot(a, b, n);
}

inline void axpy(float a, const float* x, float* y, int n) {
#if KV_X86
  if (g_use_avx2) {
    axpy_avx2(a, x, y, n);
    return;
  }
#endif
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

// out[D] = softmax(q . K[t0..pos]) V[t0..pos] for one (request, head).
void attend(const DecodeStep& st, const DecodeLayer& L, int b, int h, const float* q, float* out,
            std::vector<float>& scores, float* kbuf) {
  const int D = st.head_dim, bs = st.block_size;
  const int g = h / (st.num_heads / st.num_kv_heads);
  const int64_t pos = st.positions[b];
  const int64_t t0 = st.window > 0 && pos - st.window + 1 > 0 ? pos - st.window + 1 : 0;
  const int32_t* table = st.block_tables + (int64_t)b * st.max_blocks;
  scores.resize(pos - t0 + 1);
  float mx = -INFINITY;
  for (int64_t t = t0; t <= pos; ++t) {
    const int64_t slot = (int64_t)table[t / bs] * bs + t % bs;
    const float sc = vdot(q, kv_row(st, L, g, slot, kbuf), D);
    scores[t - t0] = sc;
    mx = sc > mx ? sc : mx;
  }
  float sum = 0.f;
  for (auto& sc : scores) {
    sc = std::exp(sc - mx);
    sum += sc;
  }
  for (int i = 0; i < D; ++i) out[i] = 0.f;
  const float inv = 1.f / sum;
  for (int64_t t = t0; t <= pos; ++t) {
    const int64_t slot = (int64_t)table[t / bs] * bs + t % bs;
    axpy(scores[t - t0] * inv, kv_row(st, L, st.num_kv_heads + g, slot, kbuf), out, D);
  }
}

void decode_layer(const DecodeStep& st, const DecodeLayer& L, float* x, float* qkv, float* attn, float* act) {
  const int B = st.batch, Hd = st.hidden_size, D = st.head_dim;
  const int H = st.num_heads, KVH = st.num_kv_heads, nq = (H + 2 * KVH) * D;
  const int nt = st.nthreads;
  rms_norm(st.hidden, L.input_norm, st.eps, B, Hd, x);
  qgemm(weights_of(L.qkv), L.qkv.n, Rows{x, B, Hd}, qkv, nq, L.qkv_bias, nullptr, 0, EPI_NONE, nt);
  for (int b = 0; b < B; ++b) {
    const int64_t pos = st.positions[b];
    const float* cs = st.rope + pos * D;  // [D / 2] pairs of (cos, sin)
    float* row = qkv + (int64_t)b * nq;
    for (int h = 0; h < H + KVH; ++h) rope(row + h * D, cs, D / 2);
    const int64_t slot = (int64_t)st.block_tables[(int64_t)b * st.max_blocks + pos / st.block_size] * st.block_size +
                         pos % st.block_size;
    for (int j = 0; j < KVH; ++j) {
      kv_store(st, L, j, slot, row + (H + j) * D);
      kv_store(st, L, KVH + j, slot, row + (H + KVH + j) * D);
    }
  }
  const int tasks = B * H;
#pragma omp parallel num_threads(tasks > 1 ? nt : 1) if (tasks > 1 && nt > 1)
  {
    std::vector<float> scores;
    std::vector<float> kbuf(D);
#pragma omp for schedule(static)
    for (int task = 0; task < tasks; ++task) {
      const int b = task / H, h = task % H;
      attend(st, L, b, h, qkv + (int64_t)b * nq + h * D, attn + (int64_t)b * H * D + h * D, scores, kbuf.data());
    }
  }
  qgemm(weights_of(L.o), L.o.n, Rows{attn, B, H * D}, st.hidden, Hd, nullptr, st.hidden, Hd, EPI_ADD, nt);
  rms_norm(st.hidden, L.post_norm, st.eps, B, Hd, x);
  qgemm(weights_of(L.gate_up), L.gate_up.n, Rows{x, B, Hd}, act, st.intermediate, nullptr, nullptr, 0,
        EPI_SILU_MUL, nt);
  qgemm(weights_of(L.down), L.down.n, Rows{act, B, st.intermediate}, st.hidden, Hd, nullptr, st.hidden, Hd,
        EPI_ADD, nt);
}

}  // namespace

extern "C" {

// Every layer of a decode-only step; see "the fused decode step" above.
void kv_decode_layers(const DecodeLayer* layers, int num_layers, const DecodeStep* step) {
  const DecodeStep& st = *step;
  const int B = st.batch;
  std::vector<float> x((size_t)B * st.hidden_size);
  std::vector<float> qkv((size_t)B * (st.num_heads + 2 * st.num_kv_heads) * st.head_dim);
  std::vector<float> attn((size_t)B * st.num_heads * st.head_dim);
  std::vector<float> act((size_t)B * st.intermediate);
  for (int i = 0; i < num_layers; ++i) decode_layer(st, layers[i], x.data(), qkv.data(), attn.data(), act.data());
}

int kv_decode_struct_sizes(int which) {
  return which == 0 ? (int)sizeof(QW) : which == 1 ? (int)sizeof(DecodeLayer) : (int)sizeof(DecodeStep);
}

}  // extern "C"
