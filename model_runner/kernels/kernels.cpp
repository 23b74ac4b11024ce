// kvserve CPU kernels over GGUF-quantized weights: GEMM for every batch shape (decode rows,
// prefill chunks, one flattened mixed step), dequantization (embedding rows, prefill panels),
// and the fused layer stack of a step.
//
// ONE source, compiled several times (model_runner/kernels/__init__.py builds them and links
// one library):
//   -DKV_VARIANT=portable   no ISA flags: plain C++ (any CPU)
//   -DKV_VARIANT=avx2       -mavx2 -mfma -mf16c: 256-bit integer dot products (Zen 3)
//   -DKV_VARIANT=avx512     + AVX-512 F/BW/VL/VNNI: vpdpbusd on zmm (Zen 4, Zen 5)
//   (no KV_VARIANT)         the dispatcher: cpuid, KVSERVE_ISA, and the C entry points
// A variant's code lives in its own namespace and uses no std:: templates, so no inline
// function compiled with AVX-512 can be picked by the linker for another variant's caller.
//
// Weight formats, repacked once at load by model_runner/quant.py. K is the row length; every
// per-row array is row-major, rows contiguous. Scales are fp32 (GGUF's are fp16) so that
// row operations at load (folding the softmax scale into Q) stay exact:
//
//   Q4_0  qs u8[KB*16]          d f32[KB]               w = d * (q - 8)
//   Q4_1  qs u8[KB*16]          d, m f32[KB]            w = d * q + m
//   Q5_0  qs u8[KB*16] qh u8[KB*4]  d f32[KB]           w = d * (q - 16), q = lo4 | hi1 << 4
//   Q5_1  qs u8[KB*16] qh u8[KB*4]  d, m f32[KB]        w = d * q + m
//   Q8_0  qs i8[KB*32]          d f32[KB]               w = d * q
//   Q4_K  qs u8[KS*128] sc u8[KS*16] d, m f32[KS]       w = d*sc[j] * q - m*mn[j]   (j: 32-sub-block)
//   Q5_K  + qh u8[KS*32]                                  q 5 bits
//   Q6_K  qs u8[KS*128] qh u8[KS*64] sc i8[KS*16] d f32[KS]   w = d*sc[g] * (q - 32) (g: 16-group)
//
// KB = ceil(K / 32) blocks of 32, KS = K / 256 super-blocks; nibble and high-bit orders are
// ggml's (see unpack_row). A K-quant Q4_K sub-block j holds sc[j] and its min mn[j] = sc[8 + j]
// (the 6-bit packing is unpacked at load).
//
// y = x W^T. Every format goes through one scheme, ggml's q8_0 activations plus a residual:
//   1. activations are quantized per 32-block to two int8s: x ~= d * a1 + d / 256 * a2, and
//      a = 256 * a1 + a2 is used as one integer of unit dx = d / 256 (about 15 bits)
//   2. a chunk of weight rows is unpacked to unsigned bytes q (L1/L2 resident) with, per
//      16-group g, a scale s[g] and an offset o[g]: w = s[g] * q + o[g]
//   3. dot(w, x) = sum_g s[g] * dx * (q . a)_g + sum_g o[g] * (dx * sum(a)_g)
//      The integer dots run 64 bytes at a time (AVX-512 VNNI vpdpbusd: one lane is a 4-byte
//      dot, four lanes a 16-group; twice, 256 (q . a1) + (q . a2)), 32 at a time on AVX2 (madd_epi16 on widened bytes: no
//      saturation), one at a time in the portable variant; the offset sum is a float dot of
//      length K / 16.
// Register blocking: 4 weight rows x up to 4 activation rows per micro-tile; a chunk of 16
// weight rows is unpacked once and every activation row passes over it, so weights are read
// from memory once per step whatever the batch.
//
// Threads: OpenMP with the caller's thread count. The library links libgomp.so.1, the soname
// torch's own OpenMP runtime has, so inside a process that imported torch the loader binds
// both to the one runtime and its one thread pool (a second pool cost 1.7x per step).

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace kv {
enum Format { Q4_0 = 0, Q4_1 = 1, Q5_0 = 2, Q5_1 = 3, Q8_0 = 4, Q4_K = 5, Q5_K = 6, Q6_K = 7, NUM_FORMATS = 8 };
enum Epilogue { EPI_NONE = 0, EPI_ADD = 1, EPI_SILU_MUL = 2 };
enum KVDtype { KV_F32 = 0, KV_F16 = 1, KV_I8 = 2 };
enum Isa { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
constexpr int MAX_PARTS = 4;
}  // namespace kv

extern "C" {

// Rows [row0, row0 + rows) of a weight in one format.
struct QPart {
  int32_t fmt, rows;
  const uint8_t* qs;
  const uint8_t* qh;
  const uint8_t* sc;
  const float* d;
  const float* m;
};

// A weight of n rows of k values: parts stacked by rows (Q, K and V of a fused projection may
// come in different formats, as Q4_K_M files have them).
struct QW {
  int32_t nparts, n, k, pad;
  QPart parts[kv::MAX_PARTS];
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
  const int64_t* positions;     // [B]: each row's position
  const int32_t* block_tables;  // [B, max_blocks]: each row's request's blocks
  const float* rope;            // [max_len, head_dim / 2, 2]: cos, sin
  int32_t batch, hidden_size, num_heads, num_kv_heads, head_dim, intermediate;
  int32_t kv_dtype, num_blocks, block_size, max_blocks, window, nthreads;
  float eps;
  int32_t pad;
};

}  // extern "C"

#ifdef KV_VARIANT

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KV_USE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define KV_USE_AVX2 1
#endif

namespace kv {
namespace KV_VARIANT {

// A growable scratch buffer (malloc'd, 64-byte aligned; no std:: templates in variants).
struct Buf {
  void* p = nullptr;
  size_t cap = 0;
  ~Buf() { std::free(p); }
  template <typename T>
  T* get(size_t count) {
    const size_t bytes = (count * sizeof(T) + 63) / 64 * 64;
    if (bytes > cap) {
      std::free(p);
      p = std::aligned_alloc(64, bytes);
      cap = bytes;
    }
    return static_cast<T*>(p);
  }
};

inline int imin(int a, int b) { return a < b ? a : b; }
inline int round64(int k) { return (k + 63) / 64 * 64; }

// ------------------------------------------------------------------ weights: unpacking

inline const QPart& part_of(const QW& w, int64_t& row) {
  int i = 0;
  while (i + 1 < w.nparts && row >= w.parts[i].rows) row -= w.parts[i++].rows;
  return w.parts[i];
}

// 16 bytes of nibbles -> 32 values: low nibbles are elements 0-15, high ones 16-31.
inline void split_nibbles16(const uint8_t* __restrict src, uint8_t* __restrict dst) {
#if defined(KV_USE_AVX512) || defined(KV_USE_AVX2)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  const __m128i mask = _mm_set1_epi8(0x0F);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_and_si128(v, mask));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm_and_si128(_mm_srli_epi16(v, 4), mask));
#else
  for (int j = 0; j < 16; ++j) {
    dst[j] = src[j] & 0x0F;
    dst[j + 16] = src[j] >> 4;
  }
#endif
}

// s[2b] = s[2b + 1] = scale * d[b], o[2b] = o[2b + 1] = m ? m[b] : low * d[b], b < n: each
// 32-block's scale and offset for its two 16-groups.
inline void block_scales(const float* __restrict d, const float* __restrict m, float low, int n,
                         float* __restrict s, float* __restrict o) {
  int b = 0;
#if defined(KV_USE_AVX512)
  const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  for (; b + 8 <= n; b += 8) {
    const __m512 dv = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(d + b)));
    _mm512_storeu_ps(s + 2 * b, dv);
    const __m512 ov = m ? _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(m + b)))
                        : _mm512_mul_ps(dv, _mm512_set1_ps(low));
    _mm512_storeu_ps(o + 2 * b, ov);
  }
#endif
  for (; b < n; ++b) {
    s[2 * b] = s[2 * b + 1] = d[b];
    o[2 * b] = o[2 * b + 1] = m ? m[b] : low * d[b];
  }
}

// Row `row` of w as unsigned bytes q[K64] plus, per 16-group, scale s[K64/16] and offset
// o[K64/16]: w[e] = s[e / 16] * q[e] + o[e / 16]. Past the stored blocks everything is 0.
void unpack_row(const QW& w, int64_t row, uint8_t* __restrict q, float* __restrict s, float* __restrict o) {
  const int K = w.k, K64 = round64(K);
  const QPart& p = part_of(w, row);
  const int KB = (K + 31) / 32, KS = K / 256;
  int done = 0;  // elements written
  switch (p.fmt) {
    case Q4_0:
    case Q4_1:
    case Q5_0:
    case Q5_1: {
      const bool five = p.fmt == Q5_0 || p.fmt == Q5_1, has_m = p.fmt == Q4_1 || p.fmt == Q5_1;
      const uint8_t* qs = p.qs + row * KB * 16;
      const float* d = p.d + row * KB;
      // Separate simple passes (nibbles, high bits, scales): each vectorizes on its own.
      for (int b = 0; b < KB; ++b) split_nibbles16(qs + 16 * b, q + 32 * b);
      if (five) {
        const uint8_t* qh = p.qh + row * KB * 4;
        for (int b = 0; b < KB; ++b) {
          uint32_t h;
          memcpy(&h, qh + 4 * b, 4);
          uint8_t* qb = q + 32 * b;
#if defined(KV_USE_AVX512)
          const __m256i bits = _mm256_maskz_mov_epi8((__mmask32)h, _mm256_set1_epi8(0x10));
          __m256i* dst = reinterpret_cast<__m256i*>(qb);
          _mm256_storeu_si256(dst, _mm256_or_si256(_mm256_loadu_si256(dst), bits));
#else
          for (int j = 0; j < 32; ++j) qb[j] |= (uint8_t)(((h >> j) & 1u) << 4);
#endif
        }
      }
      block_scales(d, has_m ? p.m + row * KB : nullptr, five ? -16.f : -8.f, KB, s, o);
      done = 32 * KB;
      break;
    }
    case Q8_0: {
      const uint8_t* qs = p.qs + row * KB * 32;
      const float* d = p.d + row * KB;
      for (int e = 0; e < 32 * KB; ++e) q[e] = qs[e] ^ 0x80;  // int8 -> q + 128
      block_scales(d, nullptr, -128.f, KB, s, o);
      done = 32 * KB;
      break;
    }
    case Q4_K:
    case Q5_K: {
      const uint8_t* qs = p.qs + row * KS * 128;
      const uint8_t* qh = p.fmt == Q5_K ? p.qh + row * KS * 32 : nullptr;
      const uint8_t* sc = p.sc + row * KS * 16;
      const float* d = p.d + row * KS;
      const float* m = p.m + row * KS;
      for (int sb = 0; sb < KS; ++sb) {
        uint8_t* qb = q + 256 * sb;
        const uint8_t* src = qs + 128 * sb;
        for (int j = 0; j < 4; ++j) {  // 64 values: low nibbles, then high nibbles
          for (int l = 0; l < 32; ++l) {
            qb[64 * j + l] = src[32 * j + l] & 0x0F;
            qb[64 * j + 32 + l] = src[32 * j + l] >> 4;
          }
        }
        if (qh != nullptr) {
          const uint8_t* h = qh + 32 * sb;
          for (int j = 0; j < 4; ++j) {
            for (int l = 0; l < 32; ++l) {
              qb[64 * j + l] |= ((h[l] >> (2 * j)) & 1) << 4;
              qb[64 * j + 32 + l] |= ((h[l] >> (2 * j + 1)) & 1) << 4;
            }
          }
        }
        const uint8_t* scb = sc + 16 * sb;
#if defined(KV_USE_AVX512)
        // Bytes 0..7 (scales) and 8..15 (mins), each twice: one per 16-group.
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(scb));
        const __m128i dup = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        const __m512 scv = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(raw, dup)));
        const __m512 mnv = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_srli_si128(raw, 8), dup)));
        _mm512_storeu_ps(s + 16 * sb, _mm512_mul_ps(scv, _mm512_set1_ps(d[sb])));
        _mm512_storeu_ps(o + 16 * sb, _mm512_mul_ps(mnv, _mm512_set1_ps(-m[sb])));
#else
        for (int j = 0; j < 8; ++j) {
          const float scale = d[sb] * scb[j], off = -m[sb] * scb[8 + j];
          s[16 * sb + 2 * j] = s[16 * sb + 2 * j + 1] = scale;
          o[16 * sb + 2 * j] = o[16 * sb + 2 * j + 1] = off;
        }
#endif
      }
      done = 256 * KS;
      break;
    }
    case Q6_K: {
      const uint8_t* ql = p.qs + row * KS * 128;
      const uint8_t* qh = p.qh + row * KS * 64;
      const int8_t* sc = reinterpret_cast<const int8_t*>(p.sc) + row * KS * 16;
      const float* d = p.d + row * KS;
      for (int sb = 0; sb < KS; ++sb) {
        for (int half = 0; half < 2; ++half) {
          uint8_t* qb = q + 256 * sb + 128 * half;
          const uint8_t* l8 = ql + 128 * sb + 64 * half;
          const uint8_t* h8 = qh + 64 * sb + 32 * half;
          for (int l = 0; l < 32; ++l) {
            qb[l] = (l8[l] & 0x0F) | ((h8[l] & 3) << 4);
            qb[l + 32] = (l8[l + 32] & 0x0F) | (((h8[l] >> 2) & 3) << 4);
            qb[l + 64] = (l8[l] >> 4) | (((h8[l] >> 4) & 3) << 4);
            qb[l + 96] = (l8[l + 32] >> 4) | (((h8[l] >> 6) & 3) << 4);
          }
        }
#if defined(KV_USE_AVX512)
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 16 * sb));
        const __m512 scale = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw)), _mm512_set1_ps(d[sb]));
        _mm512_storeu_ps(s + 16 * sb, scale);
        _mm512_storeu_ps(o + 16 * sb, _mm512_mul_ps(scale, _mm512_set1_ps(-32.f)));
#else
        for (int g = 0; g < 16; ++g) {
          const float scale = d[sb] * sc[16 * sb + g];
          s[16 * sb + g] = scale;
          o[16 * sb + g] = -32.f * scale;
        }
#endif
      }
      done = 256 * KS;
      break;
    }
    default:
      break;
  }
  for (int e = done; e < K64; ++e) q[e] = 0;
  for (int g = done / 16; g < K64 / 16; ++g) s[g] = o[g] = 0.f;
}

// ------------------------------------------------------------------ activations

// Act is what the micro-kernels read: int8 values (int16 on AVX2, widened once here instead
// of once per weight row). Each activation row is held as TWO int8 rows (ggml's q8_0 plus its
// residual): x ~= d * a1 + (d / 256) * a2, d = amax / 127 per 32-block, a1 = round(x / d),
// a2 = round(256 * (x - d * a1) / d). The dot products combine them exactly as the integer
// 256 * (w . a1) + (w . a2), so activations carry ~15 bits: int8 alone flipped SmolLM2's
// near-tied first token of "What is the capital of France?" ("L'" instead of "The").
#ifdef KV_USE_AVX2
typedef int16_t Act;
#else
typedef int8_t Act;
#endif

// x[M, ldx] (K valid columns) -> a[M, 2 * K64] (a1 then a2 per row), dx[M, K64/32] = d / 256
// (the unit of 256 * a1 + a2), xs[M, K64/16] = dx * sum(256 * a1 + a2) per 16-group.
// Rounding is nearbyint (ties to even), as the tests' reference does it.
void quantize_acts(const float* x, int M, int ldx, int K, Act* a, float* dx, float* xs) {
  const int K64 = round64(K), NB = K64 / 32;
  for (int i = 0; i < M; ++i) {
    const float* xr = x + (int64_t)i * ldx;
    Act* a1 = a + (int64_t)i * 2 * K64;
    Act* a2 = a1 + K64;
    for (int b = 0; b < NB; ++b) {
      const int k0 = 32 * b, cnt = K - k0 < 32 ? (K - k0 > 0 ? K - k0 : 0) : 32;
      float amax = 0.f;
      for (int j = 0; j < cnt; ++j) amax = std::fmax(amax, std::fabs(xr[k0 + j]));
      const float d = amax / 127.f;
      int sum[2] = {0, 0};
      for (int j = 0; j < 32; ++j) {
        int v1 = 0, v2 = 0;
        if (j < cnt && d > 0.f) {
          v1 = (int)std::nearbyintf(xr[k0 + j] / d);
          const float r = xr[k0 + j] - (float)v1 * d;
          v2 = (int)std::nearbyintf(r * 256.f / d);
          v2 = v2 > 127 ? 127 : (v2 < -127 ? -127 : v2);
        }
        a1[k0 + j] = (Act)v1;
        a2[k0 + j] = (Act)v2;
        sum[j / 16] += 256 * v1 + v2;
      }
      const float unit = d / 256.f;
      dx[(int64_t)i * NB + b] = unit;
      xs[(int64_t)i * 2 * NB + 2 * b] = unit * (float)sum[0];
      xs[(int64_t)i * 2 * NB + 2 * b + 1] = unit * (float)sum[1];
    }
  }
}

// ------------------------------------------------------------------ micro-kernels
//
// y[r * ldy + i] = sum_g s_r[g] * dx[g / 2] * (q_r . a)_g for 4 weight rows r (unpacked at
// wq + r * K64, ws + r * G) and activation rows i0 + i, i < RA. The offsets come after.

#if defined(KV_USE_AVX512)
template <int RA>
void tile(const uint8_t* wq, const float* ws, int K64, const Act* a, const float* dx, int i0, float* y, int ldy) {
  const int G = K64 / 16, NB = K64 / 32;
  __m512 acc[4][RA];
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < RA; ++i) acc[r][i] = _mm512_setzero_ps();
  const __m512i idx4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i idx2 = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int k = 0; k < K64; k += 64) {
    __m512i w[4];
    __m512 S[4];
    for (int r = 0; r < 4; ++r) {
      w[r] = _mm512_loadu_si512(wq + (int64_t)r * K64 + k);
      S[r] = _mm512_permutexvar_ps(idx4, _mm512_castps128_ps512(_mm_loadu_ps(ws + (int64_t)r * G + k / 16)));
    }
    for (int i = 0; i < RA; ++i) {
      const Act* ai = a + (int64_t)(i0 + i) * 2 * K64 + k;
      const __m512i av1 = _mm512_loadu_si512(ai);
      const __m512i av2 = _mm512_loadu_si512(ai + K64);
      const __m128 d2 = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(dx + (int64_t)(i0 + i) * NB + k / 32)));
      const __m512 D = _mm512_permutexvar_ps(idx2, _mm512_castps128_ps512(d2));
      for (int r = 0; r < 4; ++r) {
        const __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[r], av1);
        const __m512i p = _mm512_dpbusd_epi32(_mm512_slli_epi32(p1, 8), w[r], av2);  // 256 p1 + p2
        acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(S[r], D), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int i = 0; i < RA; ++i) y[(int64_t)r * ldy + i] = _mm512_reduce_add_ps(acc[r][i]);
}
#elif defined(KV_USE_AVX2)
inline float hsum256(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}

// Two weight rows at a time (16 ymm registers): bytes widened to int16, madd_epi16 (no
// saturation, unlike maddubs with 8-bit weights), hadd pairs the two 16-groups' lanes.
template <int RA>
void tile2(const uint8_t* wq, const float* ws, int K64, const Act* a, const float* dx, int i0, float* y, int ldy) {
  const int G = K64 / 16, NB = K64 / 32;
  __m256 acc[2][RA];
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < RA; ++i) acc[r][i] = _mm256_setzero_ps();
  const __m256i sidx = _mm256_setr_epi32(0, 0, 1, 1, 0, 0, 1, 1);
  for (int k = 0; k < K64; k += 32) {
    __m256i wl[2], wh[2];
    __m256 S[2];
    for (int r = 0; r < 2; ++r) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + (int64_t)r * K64 + k));
      wl[r] = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(v));
      wh[r] = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(v, 1));
      const __m128 s2 = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(ws + (int64_t)r * G + k / 16)));
      S[r] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s2), sidx);
    }
    for (int i = 0; i < RA; ++i) {
      const Act* ai = a + (int64_t)(i0 + i) * 2 * K64 + k;
      const __m256i al = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ai));
      const __m256i ah = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ai + 16));
      const __m256i bl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ai + K64));
      const __m256i bh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ai + K64 + 16));
      const __m256 D = _mm256_broadcast_ss(dx + (int64_t)(i0 + i) * NB + k / 32);
      for (int r = 0; r < 2; ++r) {
        const __m256i p1 = _mm256_hadd_epi32(_mm256_madd_epi16(wl[r], al), _mm256_madd_epi16(wh[r], ah));
        const __m256i p2 = _mm256_hadd_epi32(_mm256_madd_epi16(wl[r], bl), _mm256_madd_epi16(wh[r], bh));
        const __m256i p = _mm256_add_epi32(_mm256_slli_epi32(p1, 8), p2);  // 256 p1 + p2
        acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(S[r], D), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < RA; ++i) y[(int64_t)r * ldy + i] = hsum256(acc[r][i]);
}

template <int RA>
void tile(const uint8_t* wq, const float* ws, int K64, const Act* a, const float* dx, int i0, float* y, int ldy) {
  tile2<RA>(wq, ws, K64, a, dx, i0, y, ldy);
  tile2<RA>(wq + 2 * (int64_t)K64, ws + 2 * (int64_t)(K64 / 16), K64, a, dx, i0, y + 2 * (int64_t)ldy, ldy);
}
#else
template <int RA>
void tile(const uint8_t* wq, const float* ws, int K64, const Act* a, const float* dx, int i0, float* y, int ldy) {
  const int G = K64 / 16, NB = K64 / 32;
  for (int r = 0; r < 4; ++r) {
    const uint8_t* qr = wq + (int64_t)r * K64;
    for (int i = 0; i < RA; ++i) {
      const Act* ai = a + (int64_t)(i0 + i) * 2 * K64;
      const float* di = dx + (int64_t)(i0 + i) * NB;
      float acc = 0.f;
      for (int g = 0; g < G; ++g) {
        int32_t dot = 0;  // 256 (q . a1) + (q . a2), exact
        for (int e = 16 * g; e < 16 * g + 16; ++e) {
          dot += (int32_t)qr[e] * (256 * (int32_t)ai[e] + (int32_t)ai[K64 + e]);
        }
        acc += (float)dot * (ws[(int64_t)r * G + g] * di[g / 2]);
      }
      y[(int64_t)r * ldy + i] = acc;
    }
  }
}
#endif

// ------------------------------------------------------------------ the GEMM

constexpr int CHUNK = 16;  // weight rows unpacked together (a work item)
constexpr int RA_MAX = 4;  // activation rows per micro-tile

struct Acts {
  const Act* a;
  const float* dx;
  const float* xs;
  int M;
};

// y[r * M + i] = W[n0 + r] . x[i] for r < rows (rows <= CHUNK); wq/ws/wo: CHUNK unpacked rows.
void chunk_dot(const QW& w, int64_t n0, int rows, const Acts& x, uint8_t* wq, float* ws, float* wo, float* y) {
  const int K64 = round64(w.k), G = K64 / 16, M = x.M;
  const int groups = (rows + 3) / 4;
  for (int r = 0; r < 4 * groups; ++r) {
    if (r < rows) {
      unpack_row(w, n0 + r, wq + (int64_t)r * K64, ws + (int64_t)r * G, wo + (int64_t)r * G);
    } else {
      memset(wq + (int64_t)r * K64, 0, K64);
      for (int g = 0; g < G; ++g) ws[(int64_t)r * G + g] = wo[(int64_t)r * G + g] = 0.f;
    }
  }
  // Activation tiles outermost: a tile's rows stay in L1 across the chunk's weight groups.
  float ytile[4 * RA_MAX];
  for (int i0 = 0; i0 < M; i0 += RA_MAX) {
    const int ra = imin(RA_MAX, M - i0);
    for (int grp = 0; grp < groups; ++grp) {
      const uint8_t* gq = wq + (int64_t)4 * grp * K64;
      const float* gs = ws + (int64_t)4 * grp * G;
      switch (ra) {
        case 4: tile<4>(gq, gs, K64, x.a, x.dx, i0, ytile, RA_MAX); break;
        case 3: tile<3>(gq, gs, K64, x.a, x.dx, i0, ytile, RA_MAX); break;
        case 2: tile<2>(gq, gs, K64, x.a, x.dx, i0, ytile, RA_MAX); break;
        default: tile<1>(gq, gs, K64, x.a, x.dx, i0, ytile, RA_MAX); break;
      }
      for (int r = 0; r < 4 && 4 * grp + r < rows; ++r) {
        const float* wor = wo + (int64_t)(4 * grp + r) * G;
        for (int i = 0; i < ra; ++i) {
          const float* xsi = x.xs + (int64_t)(i0 + i) * G;
          float off = 0.f;
#pragma omp simd reduction(+ : off)
          for (int g = 0; g < G; ++g) off += wor[g] * xsi[g];
          y[(int64_t)(4 * grp + r) * M + i0 + i] = ytile[r * RA_MAX + i] + off;
        }
      }
    }
  }
}

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

// out[M, ldo] (epilogue) x[M, ldx] @ W^T; see kv_qgemm.
void qgemm(const QW& w, const float* x, int M, int ldx, float* out, int ldo, const float* bias, const float* res,
           int ldr, int epilogue, int nthreads) {
  const int K = w.k, K64 = round64(K), G = K64 / 16;
  static thread_local Buf abuf, dbuf, sbuf;
  Act* a = abuf.get<Act>((size_t)2 * M * K64);
  float* dx = dbuf.get<float>((size_t)M * (K64 / 32));
  float* xs = sbuf.get<float>((size_t)M * G);
  quantize_acts(x, M, ldx, K, a, dx, xs);
  const Acts acts{a, dx, xs, M};
  const int nout = epilogue == EPI_SILU_MUL ? w.n / 2 : w.n;
  const int chunks = (nout + CHUNK - 1) / CHUNK;
  const int nt = (int64_t)nout * K * M >= 32768 && chunks > 1 ? nthreads : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    static thread_local Buf qbuf, wsbuf, wobuf, ybuf;
    uint8_t* wq = qbuf.get<uint8_t>((size_t)CHUNK * K64);
    float* ws = wsbuf.get<float>((size_t)CHUNK * G);
    float* wo = wobuf.get<float>((size_t)CHUNK * G);
    float* y = ybuf.get<float>((size_t)2 * CHUNK * M);
#pragma omp for schedule(static)
    for (int c = 0; c < chunks; ++c) {
      const int n0 = c * CHUNK, rows = imin(CHUNK, nout - n0);
      float* yg = y;
      float* yu = y + (size_t)CHUNK * M;
      chunk_dot(w, n0, rows, acts, wq, ws, wo, yg);
      if (epilogue == EPI_SILU_MUL) chunk_dot(w, n0 + nout, rows, acts, wq, ws, wo, yu);
      for (int r = 0; r < rows; ++r) {
        const int n = n0 + r;
        const float* yn = yg + (int64_t)r * M;
        if (epilogue == EPI_SILU_MUL) {
          const float* un = yu + (int64_t)r * M;
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

// Rows of W as fp32: out[r, :K] = W[ids[r]] (ids == NULL: rows row0 .. row0 + nrows - 1).
void dequant(const QW& w, const int64_t* ids, int64_t row0, int nrows, float* out, int ldo, int nthreads) {
  const int K = w.k, K64 = round64(K), G = K64 / 16;
  const int nt = (int64_t)nrows * K >= 65536 ? nthreads : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    static thread_local Buf qbuf, sbuf, obuf;
    uint8_t* q = qbuf.get<uint8_t>(K64);
    float* s = sbuf.get<float>(G);
    float* o = obuf.get<float>(G);
#pragma omp for schedule(static)
    for (int r = 0; r < nrows; ++r) {
      unpack_row(w, ids ? ids[r] : row0 + r, q, s, o);
      float* dst = out + (int64_t)r * ldo;
      for (int e = 0; e < K; ++e) dst[e] = s[e / 16] * (float)q[e] + o[e / 16];
    }
  }
}

// ------------------------------------------------------------------ the fused layer stack
//
// One call runs every layer of a step on quantized weights: no Python, no tensor dispatch
// between the ops of a layer. Rows are tokens: one decode row per running request, several
// consecutive rows per prefill chunk, k + 1 rows per speculative verification. Each row has
// its position and its request's block table:
//
//   x = rms_norm(h) -> qkv = x Wqkv (+b) -> RoPE(q, k) -> every row's k, v into the paged pool
//     -> attention of each row over its request's positions <= its own (causal inside a
//        chunk, because all rows are written before any row attends)
//     -> h += attn Wo -> x = rms_norm(h) -> a = silu(x Wg) * (x Wu) -> h += a Wd
//
// The pool is model_runner.kv_pool's: per layer [2 * kvh, num_blocks, block_size, head_dim]
// (K heads, then V heads), stored as fp32, fp16 or int8 (with one fp32 scale per head and
// token slot, [2 * kvh, num_blocks, block_size]). Writes quantize exactly as KVPool.write.

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

// IEEE half <-> float, round to nearest even (what torch's .to(float16) does): F16C where the
// variant has it, else the same rounding in software.
inline uint16_t to_half(float f) {
#ifdef __F16C__
  return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
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
#endif
}

inline float from_half(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
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
#endif
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

// Keys/values of one head at one slot, as fp32 (a pointer into an fp32 pool, else into buf).
inline const float* kv_row(const DecodeStep& st, const DecodeLayer& L, int head, int64_t slot, float* buf) {
  const int D = st.head_dim;
  const int64_t idx = ((int64_t)head * st.num_blocks * st.block_size + slot) * D;
  if (st.kv_dtype == KV_F32) return static_cast<const float*>(L.kv) + idx;
  if (st.kv_dtype == KV_F16) {
    const uint16_t* p = static_cast<const uint16_t*>(L.kv) + idx;
    int i = 0;
#ifdef __F16C__
    for (; i + 8 <= D; i += 8) {
      _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
    }
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
#pragma omp simd reduction(+ : acc)
  for (int i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float a, const float* x, float* y, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

constexpr int MAX_GROUP = 64;  // query heads per KV head the attention loop takes

// out_j[D] = softmax(q_j . K[t0..pos]) V[t0..pos] for the G query heads j of one KV head g of
// one row: each key and value is read (and converted from fp16 / int8) once for the group.
// Online softmax, one pass over the positions, in order (the result does not depend on
// which other rows share the step).
void attend_group(const DecodeStep& st, const DecodeLayer& L, int b, int g, const float* q, int qstride,
                  float* out, float* kbuf) {
  const int D = st.head_dim, bs = st.block_size, G = st.num_heads / st.num_kv_heads;
  const int64_t pos = st.positions[b];
  const int64_t t0 = st.window > 0 && pos - st.window + 1 > 0 ? pos - st.window + 1 : 0;
  const int32_t* table = st.block_tables + (int64_t)b * st.max_blocks;
  float mx[MAX_GROUP], sum[MAX_GROUP], p[MAX_GROUP];
  for (int j = 0; j < G; ++j) {
    mx[j] = -INFINITY;
    sum[j] = 0.f;
    for (int i = 0; i < D; ++i) out[(int64_t)j * D + i] = 0.f;
  }
  for (int64_t t = t0; t <= pos; ++t) {
    const int64_t slot = (int64_t)table[t / bs] * bs + t % bs;
    const float* k = kv_row(st, L, g, slot, kbuf);
    for (int j = 0; j < G; ++j) {
      const float sc = dot(q + (int64_t)j * qstride, k, D);
      if (sc > mx[j]) {  // rescale what was summed so far
        const float c = std::exp(mx[j] - sc);
        sum[j] *= c;
        float* oj = out + (int64_t)j * D;
        for (int i = 0; i < D; ++i) oj[i] *= c;
        mx[j] = sc;
      }
      p[j] = std::exp(sc - mx[j]);
      sum[j] += p[j];
    }
    const float* v = kv_row(st, L, st.num_kv_heads + g, slot, kbuf);
    for (int j = 0; j < G; ++j) axpy(p[j], v, out + (int64_t)j * D, D);
  }
  for (int j = 0; j < G; ++j) {
    const float inv = 1.f / sum[j];
    for (int i = 0; i < D; ++i) out[(int64_t)j * D + i] *= inv;
  }
}

void decode_layer(const DecodeStep& st, const DecodeLayer& L, float* x, float* qkv, float* attn, float* act) {
  const int B = st.batch, Hd = st.hidden_size, D = st.head_dim;
  const int H = st.num_heads, KVH = st.num_kv_heads, nq = (H + 2 * KVH) * D;
  const int nt = st.nthreads;
  rms_norm(st.hidden, L.input_norm, st.eps, B, Hd, x);
  qgemm(L.qkv, x, B, Hd, qkv, nq, L.qkv_bias, nullptr, 0, EPI_NONE, nt);
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
  const int tasks = B * KVH, G = H / KVH;
#pragma omp parallel num_threads(tasks > 1 ? nt : 1) if (tasks > 1 && nt > 1)
  {
    float kbuf[512];
#pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < tasks; ++task) {
      const int b = task / KVH, g = task % KVH;
      attend_group(st, L, b, g, qkv + (int64_t)b * nq + g * G * D, D, attn + (int64_t)b * H * D + g * G * D, kbuf);
    }
  }
  qgemm(L.o, attn, B, H * D, st.hidden, Hd, nullptr, st.hidden, Hd, EPI_ADD, nt);
  rms_norm(st.hidden, L.post_norm, st.eps, B, Hd, x);
  qgemm(L.gate_up, x, B, Hd, act, st.intermediate, nullptr, nullptr, 0, EPI_SILU_MUL, nt);
  qgemm(L.down, act, B, st.intermediate, st.hidden, Hd, nullptr, st.hidden, Hd, EPI_ADD, nt);
}

void decode_layers(const DecodeLayer* layers, int num_layers, const DecodeStep* step) {
  const DecodeStep& st = *step;
  const int B = st.batch;
  Buf xb, qb, ab, mb;
  float* x = xb.get<float>((size_t)B * st.hidden_size);
  float* qkv = qb.get<float>((size_t)B * (st.num_heads + 2 * st.num_kv_heads) * st.head_dim);
  float* attn = ab.get<float>((size_t)B * st.num_heads * st.head_dim);
  float* act = mb.get<float>((size_t)B * st.intermediate);
  for (int i = 0; i < num_layers; ++i) decode_layer(st, layers[i], x, qkv, attn, act);
}

}  // namespace KV_VARIANT
}  // namespace kv

#else  // ------------------------------------------------------------------ the dispatcher

#define KV_DECLARE(ns)                                                                                          \
  namespace kv {                                                                                                \
  namespace ns {                                                                                                \
  void qgemm(const QW&, const float*, int, int, float*, int, const float*, const float*, int, int, int);        \
  void dequant(const QW&, const int64_t*, int64_t, int, float*, int, int);                                      \
  void decode_layers(const DecodeLayer*, int, const DecodeStep*);                                               \
  }                                                                                                             \
  }

KV_DECLARE(portable)
#if defined(__x86_64__) || defined(_M_X64)
#define KV_X86 1
KV_DECLARE(avx2)
KV_DECLARE(avx512)
#endif

namespace {

struct Table {
  void (*qgemm)(const QW&, const float*, int, int, float*, int, const float*, const float*, int, int, int);
  void (*dequant)(const QW&, const int64_t*, int64_t, int, float*, int, int);
  void (*decode_layers)(const DecodeLayer*, int, const DecodeStep*);
};

const Table kPortable{kv::portable::qgemm, kv::portable::dequant, kv::portable::decode_layers};
#if KV_X86
const Table kAvx2{kv::avx2::qgemm, kv::avx2::dequant, kv::avx2::decode_layers};
const Table kAvx512{kv::avx512::qgemm, kv::avx512::dequant, kv::avx512::decode_layers};
#endif

const Table* g_table = &kPortable;
int g_isa = kv::ISA_PORTABLE;

bool supported(int isa) {
  if (isa == kv::ISA_PORTABLE) return true;
#if KV_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == kv::ISA_AVX2) return avx2;
  if (isa == kv::ISA_AVX512) {
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  }
#endif
  return false;
}

inline int64_t check_sizes(const QW& w) {
  int64_t rows = 0;
  for (int i = 0; i < w.nparts; ++i) rows += w.parts[i].rows;
  return rows;
}

}  // namespace

extern "C" {

// 1 when this CPU can run ISA family `isa` (0 portable, 1 AVX2, 2 AVX-512 VNNI).
int kv_isa_supported(int isa) { return supported(isa) ? 1 : 0; }

// Use ISA family `isa` from now on (the best one the CPU has at or below it); returns it.
int kv_set_isa(int isa) {
  int chosen = isa > kv::ISA_AVX512 ? kv::ISA_AVX512 : isa;
  while (chosen > kv::ISA_PORTABLE && !supported(chosen)) --chosen;
#if KV_X86
  g_table = chosen == kv::ISA_AVX512 ? &kAvx512 : chosen == kv::ISA_AVX2 ? &kAvx2 : &kPortable;
#else
  chosen = kv::ISA_PORTABLE;
  g_table = &kPortable;
#endif
  g_isa = chosen;
  return g_isa;
}

int kv_omp_max_threads(void) { return omp_get_max_threads(); }

// Rows of the weight: -1 when its parts do not add up to n (a caller's bug).
int64_t kv_weight_rows(const QW* w) { return check_sizes(*w) == w->n ? w->n : -1; }

// out[M, ldo] (epilogue) x[M, ldx] @ W[N, K].T
//   EPI_NONE:     out = x W^T + bias
//   EPI_ADD:      out = res + x W^T + bias                (res may alias out)
//   EPI_SILU_MUL: W holds 2 * Nout rows, gate then up:
//                 out[:, n] = silu(x Wg[n]^T + bg) * (x Wu[n]^T + bu), n < Nout = N / 2
void kv_qgemm(const QW* w, const float* x, int M, int ldx, float* out, int ldo, const float* bias, const float* res,
              int ldr, int epilogue, int nthreads) {
  g_table->qgemm(*w, x, M, ldx, out, ldo, bias, res, ldr, epilogue, nthreads);
}

// Rows of W as fp32: out[r, :K] = W[ids[r]] (ids == NULL: rows row0 .. row0 + nrows - 1).
void kv_dequant(const QW* w, const int64_t* ids, int64_t row0, int nrows, float* out, int ldo, int nthreads) {
  g_table->dequant(*w, ids, row0, nrows, out, ldo, nthreads);
}

// Every layer of a step; see "the fused layer stack" above.
void kv_decode_layers(const DecodeLayer* layers, int num_layers, const DecodeStep* step) {
  g_table->decode_layers(layers, num_layers, step);
}

int kv_decode_struct_sizes(int which) {
  switch (which) {
    case 0: return (int)sizeof(QW);
    case 1: return (int)sizeof(DecodeLayer);
    case 2: return (int)sizeof(DecodeStep);
    default: return (int)sizeof(QPart);
  }
}

}  // extern "C"

#endif  // KV_VARIANT
