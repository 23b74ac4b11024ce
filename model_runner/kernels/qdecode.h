// Part 2 of the quantized matmul (see qmatmul.h, which includes it): activations quantized
// per 32-block, and the formats' decoders (each with the scalar reference every SIMD decoder
// agrees with), from which the one switch over the formats is generated.

constexpr int ROWS = 8;  // rows per record

inline float h2f(uint16_t h) {
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

inline uint16_t rd16(const uint8_t* p) {
  uint16_t v;
  memcpy(&v, p, 2);
  return v;
}

inline uint32_t rd32(const uint8_t* p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}

// ------------------------------------------------------------------ activations

// x[M, ldx] (K valid columns) quantized per 32-block, d = amax / 127, in one of two precisions:
//   int8      a = round(x / d): q[i] holds a (K32 bytes a row), unit d
//   residual  a1 = round(x / d), a2 = round(256 (x - d a1) / d) clamped to +-127 (ggml's q8_0
//             plus a second byte for what it rounded away): each 32-block's 64 bytes hold
//             its a1 then its a2 (one cache line: the two planes are one stream, not two
//             K32 apart) and the pair stands for the integer A = 256 a1 + a2, unit d / 256
//             (~15 bits: the dot products run twice as many vpdpbusd)
// u[i, b] is the unit, s[i, b] = unit * sum(A) over block b, s16[i, 2b + h] over its 16-half
// h. K32 = 32 KB >= K (zero padded); lda = bytes from one row's q to the next (K32, or 2 K32).
struct Acts {
  const int8_t* q;
  const float* u;
  const float* s;
  const float* s16;
  int plane, bs, KB, lda;  // a2 at q + plane in a block of bs bytes (residual: 32, 64; int8: 0, 32)
  bool residual;
};

// Rounding: round(x * (1 / d)) in fp32, ties to even, d = amax / 127 (and r = x - a1 * d, two
// roundings, for the residual): the tests' reference computes them the same way.
#ifndef KV_SPLIT_FORMAT  // the core object of a split family (kernels.cpp)
void quantize_row(const float* __restrict x, int K, bool residual, int8_t* __restrict q, float* __restrict u,
                  float* __restrict s, float* __restrict s16) {
  const int KB = (K + 31) / 32;
  for (int b = 0; b < KB; ++b) {
    const int k0 = 32 * b, cnt = K - k0 < 32 ? K - k0 : 32;
    const float* xb = x + k0;
    int8_t* q1 = q + (residual ? 64 : 32) * b;  // a block's a1 and a2 side by side: one line
    int8_t* q2 = q1 + 32;
    int sum[2] = {0, 0};
    float db;
#if defined(KV_USE_AVX512) || defined(KV_USE_AVX2)
    if (cnt == 32) {
      const __m256 sign = _mm256_set1_ps(-0.f);
      __m256 m = _mm256_setzero_ps();
      for (int j = 0; j < 32; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + j)));
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      h = _mm_max_ss(h, _mm_movehdup_ps(h));
      db = _mm_cvtss_f32(h) / 127.f;
      const float id = db > 0.f ? 1.f / db : 0.f;
      const __m256 iv = _mm256_set1_ps(id), iv256 = _mm256_set1_ps(256.f * id), dv = _mm256_set1_ps(db);
      __m256i v1[4], v2[4];
      for (int j = 0; j < 4; ++j) {
        const __m256 xv = _mm256_loadu_ps(xb + 8 * j);
        v1[j] = _mm256_cvtps_epi32(_mm256_mul_ps(xv, iv));
        if (residual) {
          const __m256 r = _mm256_sub_ps(xv, _mm256_mul_ps(_mm256_cvtepi32_ps(v1[j]), dv));
          const __m256i lim = _mm256_set1_epi32(127);
          v2[j] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(r, iv256)), lim),
                                   _mm256_sub_epi32(_mm256_setzero_si256(), lim));
        }
      }
      // int32 -> int8 (values within +-127): packs keep lane order 0 2 1 3; a permute fixes it.
      auto pack = [](const __m256i* v, int8_t* dst) {
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), p);
      };
      auto halves = [](const __m256i* v, int* out) {  // sums of elements 0..15 and 16..31
        const __m256i t = _mm256_hadd_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
        alignas(32) int w[8];  // lo0+lo1 lo2+lo3 hi0+hi1 hi2+hi3 | lo4+lo5 lo6+lo7 hi4+hi5 hi6+hi7
        _mm256_store_si256(reinterpret_cast<__m256i*>(w), t);
        out[0] += w[0] + w[1] + w[4] + w[5];
        out[1] += w[2] + w[3] + w[6] + w[7];
      };
      pack(v1, q1);
      int s1[2] = {0, 0};
      halves(v1, s1);
      if (residual) {
        pack(v2, q2);
        int s2[2] = {0, 0};
        halves(v2, s2);
        sum[0] = 256 * s1[0] + s2[0];
        sum[1] = 256 * s1[1] + s2[1];
      } else {
        sum[0] = s1[0];
        sum[1] = s1[1];
      }
    } else
#endif
    {
      float amax = 0.f;
      for (int i = 0; i < cnt; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
      db = amax / 127.f;
      const float id = db > 0.f ? 1.f / db : 0.f, id256 = 256.f * id;
      for (int i = 0; i < 32; ++i) {
        const int v1 = i < cnt ? (int)std::nearbyintf(xb[i] * id) : 0;
        q1[i] = (int8_t)v1;
        int v = v1;
        if (residual) {
          int v2 = 0;
          if (i < cnt) {
            const float r = xb[i] - (float)v1 * db;
            v2 = (int)std::nearbyintf(r * id256);
            v2 = v2 > 127 ? 127 : (v2 < -127 ? -127 : v2);
          }
          q2[i] = (int8_t)v2;
          v = 256 * v1 + v2;
        }
        sum[i / 16] += v;
      }
    }
    const float unit = residual ? db / 256.f : db;
    u[b] = unit;
    s16[2 * b] = unit * (float)sum[0];
    s16[2 * b + 1] = unit * (float)sum[1];
    s[b] = unit * (float)(sum[0] + sum[1]);
  }
}

#endif  // KV_SPLIT_FORMAT

// ------------------------------------------------------------------ the formats' decoders
//
// A decoder is what the kernels know of one format's record (8 rows; interleave.py draws it):
//   BLOCK, RECORD, SUBS  values a record covers per row, its bytes, its 32-blocks
//   HALVES               one scale and offset per 16-half (Q6_K), else per 32-block
//   SIGNED               the SIMD quants are signed bytes (Q8_0 without VNNI)
//   QMAX                 the largest unsigned quant (how many maddubs may sum in int16)
//   row(rec, r, sub, q, S, O)   the scalar reference: row r of 32-block sub as unsigned
//                        quants q[32] and, per 16-half h, S[h] and O[h] (w = S q + O); the
//                        portable family's and dequant's decoder, which every SIMD one agrees with
//   SIMD families: D(rec), unpack(sub, w) puts the quants in w[0..7] (w[i] lane r = quants
//   4i .. 4i + 3 of row r), scales(sub, S, O) (or scales16(sub, S0, O0, S1, O1) with HALVES)
//   the per-row scale and offset, in registers.
// KV_FORMATS (kernels.cpp) names one decoder per format; with_decoder (the end of this file)
// is the one switch over formats.

// The scalar pieces: q[4i + t] (and q[16 + 4i + t]) = the low (high) nibble of byte t of row r
// in `loads` loads of 8 x 4 bytes.
inline void row_nibbles(const uint8_t* qs, int r, int loads, uint8_t* q) {
  for (int i = 0; i < loads; ++i)
    for (int t = 0; t < 4; ++t) {
      const uint8_t b = qs[32 * i + 4 * r + t];
      q[4 * i + t] = b & 15;
      q[16 + 4 * i + t] = b >> 4;
    }
}

// Mask words: bit 4r + t of word i -> the 5th bit of q[4i + t].
inline void row_high_bits(const uint8_t* words, int r, uint8_t* q) {
  for (int i = 0; i < 8; ++i) {
    const uint32_t w = rd32(words + 4 * i);
    for (int t = 0; t < 4; ++t) q[4 * i + t] |= ((w >> (4 * r + t)) & 1u) << 4;
  }
}

inline float row_d(const uint8_t* rec, int at, int r) { return h2f(rd16(rec + at + 2 * r)); }

// One scale and offset for both 16-halves (every format but Q6_K).
inline void both_halves(float* S, float* O, float s, float o) {
  S[0] = S[1] = s;
  O[0] = O[1] = o;
}

// A decoder's record, as the SIMD decoders hold it.
struct Rec {
  const uint8_t* r;
  explicit Rec(const uint8_t* rec) : r(rec) {}
};

#if defined(KV_USE_AVX512) || defined(KV_USE_AVX2)
typedef __m256i V;
typedef __m256 F;

inline V ld(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline F ld_h8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline V low4(V v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline V high4(V v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }

// Each byte's bits from .. from + 1 moved to to .. to + 1 (a 16-bit shift: the callers mask
// the bits they keep, which never cross a byte for from, to <= 7).
KV_INLINE V move_bits(V v, int from, int to) {
  return to > from ? _mm256_slli_epi16(v, to - from) : to < from ? _mm256_srli_epi16(v, from - to) : v;
}

// w[i] += 16 where bit 4r + t of mask word `word` is set (lane r, byte t).
KV_INLINE V add_high_bit(V w, uint32_t word) {
#if defined(KV_USE_AVX512)
  return _mm256_mask_add_epi8(w, (__mmask32)word, w, _mm256_set1_epi8(16));
#else
  const V rep = _mm256_shuffle_epi8(_mm256_set1_epi32((int)word),
                                    _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2,
                                                     2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const V bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ull);
  const V on = _mm256_cmpeq_epi8(_mm256_and_si256(rep, bit), bit);
  return _mm256_or_si256(w, _mm256_and_si256(on, _mm256_set1_epi8(16)));
#endif
}
#define KV_SIMD_DECODERS 1
#endif

// The 32-blocks of 4 or 5 bits: Q4_0 (w = d q - 8 d), Q4_1 (w = d q + m), Q5_0 (w = d q - 16 d),
// Q5_1 (w = d q + m). A record: d | m (HAS_M) | 8 mask words (FIVE) | 4 loads of nibble pairs.
template <bool FIVE, bool HAS_M>
struct DecQ32 : Rec {
  static constexpr int BLOCK = 32, SUBS = 1, RECORD = 144 + (HAS_M ? 16 : 0) + (FIVE ? 32 : 0), QMAX = FIVE ? 31 : 15;
  static constexpr int QH = HAS_M ? 32 : 16, QS = FIVE ? QH + 32 : QH;
  static constexpr bool HALVES = false, SIGNED = false;
  static constexpr float OFFSET = FIVE ? -16.f : -8.f;  // without m: O = OFFSET d
  static void row(const uint8_t* rec, int r, int, uint8_t* q, float* S, float* O) {
    row_nibbles(rec + QS, r, 4, q);
    if (FIVE) row_high_bits(rec + QH, r, q);
    const float d = row_d(rec, 0, r);
    both_halves(S, O, d, HAS_M ? row_d(rec, 16, r) : OFFSET * d);
  }
#ifdef KV_SIMD_DECODERS
  using Rec::Rec;
  KV_INLINE void unpack(int, V* w) const {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const V v = ld(r + QS + 32 * i);
      w[i] = low4(v);
      w[4 + i] = high4(v);
      if (FIVE) {
        w[i] = add_high_bit(w[i], rd32(r + QH + 4 * i));
        w[4 + i] = add_high_bit(w[4 + i], rd32(r + QH + 16 + 4 * i));
      }
    }
  }
  KV_INLINE void scales(int, F& S, F& O) const {
    S = ld_h8(r);
    O = HAS_M ? ld_h8(r + 16) : _mm256_mul_ps(S, _mm256_set1_ps(OFFSET));
  }
#endif
};
template <bool HAS_M>
using DecQ4 = DecQ32<false, HAS_M>;
template <bool HAS_M>
using DecQ5 = DecQ32<true, HAS_M>;

// Q8_0 (w = d q - 128 d, quants stored XOR 0x80): d | 8 loads of bytes.
struct DecQ8_0 : Rec {
  static constexpr int BLOCK = 32, SUBS = 1, RECORD = 272, QMAX = 255;
  static constexpr bool HALVES = false, SIGNED = !KV_EMULATE_VNNI;  // maddubs would saturate on 255 * 127 * 2
  static void row(const uint8_t* rec, int r, int, uint8_t* q, float* S, float* O) {
    for (int i = 0; i < 8; ++i)
      for (int t = 0; t < 4; ++t) q[4 * i + t] = rec[16 + 32 * i + 4 * r + t];
    const float d = row_d(rec, 0, r);
    both_halves(S, O, d, -128.f * d);
  }
#ifdef KV_SIMD_DECODERS
  using Rec::Rec;
  KV_INLINE void unpack(int, V* w) const {
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      w[i] = ld(r + 16 + 32 * i);
      if (SIGNED) w[i] = _mm256_xor_si256(w[i], _mm256_set1_epi8((char)0x80));
    }
  }
  KV_INLINE void scales(int, F& S, F& O) const {
    S = ld_h8(r);
    O = SIGNED ? _mm256_setzero_ps() : _mm256_mul_ps(S, _mm256_set1_ps(-128.f));
  }
#endif
};

// Q4_K, Q5_K (w = d sc q - dmin mn per 32-block): d | dmin | 6-bit scales as a nibble plane
// and a 2-bit plane (96 B) | Q5_K: 8 loads of 5th-bit bytes (bit sub: 32-block sub's) | 4
// chunks of 8 loads of nibble pairs.
template <bool FIVE>
struct DecQK : Rec {
  static constexpr int BLOCK = 256, SUBS = 8, RECORD = FIVE ? 1408 : 1152, QS = FIVE ? 384 : 128;
  static constexpr int QMAX = FIVE ? 31 : 15;
  static constexpr bool HALVES = false, SIGNED = false;
  static void row(const uint8_t* rec, int r, int sub, uint8_t* q, float* S, float* O) {
    const uint8_t* c = rec + QS + 256 * (sub >> 1);  // chunk sub / 2, low or high nibbles
    for (int i = 0; i < 8; ++i)
      for (int t = 0; t < 4; ++t) {
        const uint8_t b = c[32 * i + 4 * r + t];
        q[4 * i + t] = sub & 1 ? b >> 4 : b & 15;
      }
    if (FIVE) {
      for (int i = 0; i < 8; ++i)
        for (int t = 0; t < 4; ++t) q[4 * i + t] |= ((rec[128 + 32 * i + 4 * r + t] >> sub) & 1) << 4;
    }
    const uint8_t lo = rec[32 + 8 * sub + r], hi = (rec[96 + 8 * (sub >> 1) + r] >> (4 * (sub & 1))) & 15;
    const int sc = (lo & 15) | (hi & 3) << 4, mn = (lo >> 4) | (hi >> 2) << 4;
    both_halves(S, O, row_d(rec, 0, r) * (float)sc, -row_d(rec, 16, r) * (float)mn);
  }
#ifdef KV_SIMD_DECODERS
  F d, nmin;
  // The 6-bit scales and mins of all 8 sub-blocks, decoded once a record (a 32-block's 8
  // bytes: its rows'): sc[h] and mn[h] hold sub-blocks 4h .. 4h + 3. Per 32-block this left a
  // byte widening, a convert and a multiply each, not the ~16 ops of a decode per 32-block.
  V sc[2], mn[2];
  explicit DecQK(const uint8_t* rec) : Rec(rec), d(ld_h8(rec)), nmin(_mm256_sub_ps(_mm256_setzero_ps(), ld_h8(rec + 16))) {
    const V hi = ld(rec + 96), m3 = _mm256_set1_epi8(3), m15 = _mm256_set1_epi8(15);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const V lo = ld(rec + 32 + 32 * h);  // byte 8 sub + r: row r's low bits of sub-block sub
      // the 2-bit plane's byte 8 (sub / 2) + r for each byte 8 sub + r, shifted right by 4 for
      // odd sub-blocks (qword lanes: the bits a byte keeps are its own)
      const V hs = _mm256_srlv_epi64(h ? _mm256_permute4x64_epi64(hi, 0xFA) : _mm256_permute4x64_epi64(hi, 0x50),
                                     _mm256_setr_epi64x(0, 4, 0, 4));
      sc[h] = _mm256_or_si256(_mm256_and_si256(lo, m15), _mm256_slli_epi16(_mm256_and_si256(hs, m3), 4));
      mn[h] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo, 4), m15),
                              _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hs, 2), m3), 4));
    }
  }
  // Bytes 8 (sub & 3) .. + 7 of v, widened to 8 int32 lanes.
  static KV_INLINE V widen(V v, int sub) {
    const __m128i half = (sub & 2) ? _mm256_extracti128_si256(v, 1) : _mm256_castsi256_si128(v);
    return _mm256_cvtepu8_epi32((sub & 1) ? _mm_unpackhi_epi64(half, half) : half);
  }
  KV_INLINE void unpack(int sub, V* w) const {
    const uint8_t* c = r + QS + 256 * (sub >> 1);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const V v = ld(c + 32 * i);
      w[i] = sub & 1 ? high4(v) : low4(v);
      if (FIVE) w[i] = _mm256_or_si256(w[i], _mm256_and_si256(move_bits(ld(r + 128 + 32 * i), sub, 4), _mm256_set1_epi8(16)));
    }
  }
  KV_INLINE void scales(int sub, F& S, F& O) const {
    S = _mm256_mul_ps(d, _mm256_cvtepi32_ps(widen(sc[sub >> 2], sub)));
    O = _mm256_mul_ps(nmin, _mm256_cvtepi32_ps(widen(mn[sub >> 2], sub)));
  }
#endif
};

// Q6_K (w = d sc (q - 32) per 16-half): d | int8 scales, 16 groups x 8 rows | qh: 2 x 8 loads
// of 2-bit quads | ql: 4 x 8 loads of nibble pairs.
struct DecQ6_K : Rec {
  static constexpr int BLOCK = 256, SUBS = 8, RECORD = 1680, QMAX = 63;
  static constexpr bool HALVES = true, SIGNED = false;
  static void row(const uint8_t* rec, int r, int sub, uint8_t* q, float* S, float* O) {
    const int h = sub >> 2, qq = sub & 3, c = qq & 1, hi = qq >> 1;
    const uint8_t* ql = rec + 656 + 256 * (2 * h + c);
    const uint8_t* qh = rec + 144 + 256 * h;
    for (int i = 0; i < 8; ++i)
      for (int t = 0; t < 4; ++t) {
        const uint8_t l = ql[32 * i + 4 * r + t];
        q[4 * i + t] = (uint8_t)((hi ? l >> 4 : l & 15) | ((qh[32 * i + 4 * r + t] >> (2 * qq)) & 3) << 4);
      }
    const float d = row_d(rec, 0, r);
    for (int g = 0; g < 2; ++g) {
      S[g] = d * (float)(int8_t)rec[16 + 8 * (2 * sub + g) + r];
      O[g] = -32.f * S[g];
    }
  }
#ifdef KV_SIMD_DECODERS
  F d;
  explicit DecQ6_K(const uint8_t* rec) : Rec(rec), d(ld_h8(rec)) {}
  KV_INLINE void unpack(int sub, V* w) const {
    const int h = sub >> 2, qq = sub & 3;
    const uint8_t* ql = r + 656 + 256 * (2 * h + (qq & 1));
    const uint8_t* qh = r + 144 + 256 * h;
    const V m30 = _mm256_set1_epi8(0x30);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const V l = ld(ql + 32 * i), hb = ld(qh + 32 * i);
      // bits 2 qq, 2 qq + 1 of each byte, moved to bits 4, 5
      w[i] = _mm256_or_si256(qq >> 1 ? high4(l) : low4(l), _mm256_and_si256(move_bits(hb, 2 * qq, 4), m30));
    }
  }
  KV_INLINE void scales16(int sub, F& S0, F& O0, F& S1, F& O1) const {
    const uint8_t* sc = r + 16 + 16 * sub;
    S0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)))));
    S1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8)))));
    O0 = _mm256_mul_ps(S0, _mm256_set1_ps(-32.f));
    O1 = _mm256_mul_ps(S1, _mm256_set1_ps(-32.f));
  }
#endif
};

#if defined(KV_EMULATE)
// The emulated families' decoder: 8 lanes from the scalar reference (the SIMD decoders compute
// the same S and O with the same fp32 operations, and the same quants: Q8_0's signed when
// SIGNED), so the emulated tiles see what the real ones see.
template <class D>
struct Emulated : Rec {
  static constexpr int BLOCK = D::BLOCK, SUBS = D::SUBS, RECORD = D::RECORD, QMAX = D::QMAX;
  static constexpr bool HALVES = D::HALVES, SIGNED = D::SIGNED;
  using Rec::Rec;
  void unpack(int sub, W8::I* w) const {
    for (int row = 0; row < 8; ++row) {
      uint8_t q[32];
      float S[2], O[2];
      D::row(r, row, sub, q, S, O);
      for (int i = 0; i < 8; ++i) {
        uint32_t word = (uint32_t)q[4 * i] | (uint32_t)q[4 * i + 1] << 8 | (uint32_t)q[4 * i + 2] << 16 |
                        (uint32_t)q[4 * i + 3] << 24;
        w[i].v[row] = (int32_t)(SIGNED ? word ^ 0x80808080u : word);
      }
    }
  }
  void scales16(int sub, W8::F& S0, W8::F& O0, W8::F& S1, W8::F& O1) const {
    for (int row = 0; row < 8; ++row) {
      uint8_t q[32];
      float S[2], O[2];
      D::row(r, row, sub, q, S, O);
      S0.v[row] = S[0];
      S1.v[row] = S[1];
      O0.v[row] = SIGNED ? 0.f : O[0];  // the signed quants carry Q8_0's -128
      O1.v[row] = SIGNED ? 0.f : O[1];
    }
  }
  void scales(int sub, W8::F& S, W8::F& O) const {
    W8::F S1, O1;
    scales16(sub, S, O, S1, O1);
  }
};
template <class D>
using Simd = Emulated<D>;
#else
template <class D>
using Simd = D;  // the tiles' decoder of format D
#endif

#if defined(KV_USE_AVX512)
// Two records' scales for a 16-lane pair: by default each record's 8 lanes, joined; K-quants
// decode both records' 6-bit scales in one xmm of bytes (half the work of two ymm decodes).
template <class D>
struct PairScales {
  PairScales(const D&, const D&) {}
  KV_INLINE void scales(const D& a, const D& b, int sub, W16::F& S, W16::F& O) const {
    F sa, oa, sb, ob;
    a.scales(sub, sa, oa);
    b.scales(sub, sb, ob);
    S = W16::join(sa, sb);
    O = W16::join(oa, ob);
  }
};

template <bool FIVE>
struct PairScales<DecQK<FIVE>> {
  __m512 d, nmin;
  PairScales(const DecQK<FIVE>& x, const DecQK<FIVE>& y) : d(W16::join(x.d, y.d)), nmin(W16::join(x.nmin, y.nmin)) {}
  KV_INLINE void scales(const DecQK<FIVE>& a, const DecQK<FIVE>& b, int sub, __m512& S, __m512& O) const {
    int64_t l0, l1, h0, h1;
    memcpy(&l0, a.r + 32 + 8 * sub, 8);
    memcpy(&l1, b.r + 32 + 8 * sub, 8);
    memcpy(&h0, a.r + 96 + 8 * (sub >> 1), 8);
    memcpy(&h1, b.r + 96 + 8 * (sub >> 1), 8);
    const __m128i lo = _mm_set_epi64x(l1, l0);  // byte r: lane r (rec a's rows, then b's)
    __m128i hi = _mm_set_epi64x(h1, h0);
    const __m128i m3 = _mm_set1_epi8(3), m15 = _mm_set1_epi8(15);
    if (sub & 1) hi = _mm_and_si128(_mm_srli_epi16(hi, 4), m15);
    const __m128i sc = _mm_or_si128(_mm_and_si128(lo, m15), _mm_slli_epi16(_mm_and_si128(hi, m3), 4));
    const __m128i mn = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(lo, 4), m15),
                                    _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hi, 2), m3), 4));
    S = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
    O = _mm512_mul_ps(nmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)));
  }
};
#elif KV_PAIRS
template <class D>
struct PairScales {  // emulated pairs: each record's 8 lanes, joined
  PairScales(const D&, const D&) {}
  void scales(const D& a, const D& b, int sub, W16::F& S, W16::F& O) const {
    W8::F sa, oa, sb, ob;
    a.scales(sub, sa, oa);
    b.scales(sub, sb, ob);
    S = W16::join(sa, sb);
    O = W16::join(oa, ob);
  }
};
#endif

// ------------------------------------------------------------------ the one switch over formats

template <class D>
struct Tag {
  typedef D type;
};
template <int FMT>
struct DecoderOf;
#define KV_DECODER_OF(name, D) \
  template <>                  \
  struct DecoderOf<name> {     \
    typedef D type;            \
  };
KV_FORMATS(KV_DECODER_OF)
#undef KV_DECODER_OF

// f(Tag<D>()) for format fmt's decoder D. A code past the list aborts (Python checks codes at
// load); a format missing here does not compile (-Werror=switch).
template <class Fn>
KV_INLINE decltype(auto) with_decoder(int fmt, Fn&& f) {
  switch ((Format)fmt) {
#define KV_CASE(name, D) \
  case name:             \
    return f(Tag<D>());
    KV_FORMATS(KV_CASE)
#undef KV_CASE
  }
  std::abort();
}

struct FormatInfo {
  int block, record;  // values per record and row, bytes per record (8 rows)
  bool halves;        // scales per 16-half
};

inline FormatInfo format_info(int fmt) {
  return with_decoder(fmt, [](auto d) {
    typedef typename decltype(d)::type D;
    return FormatInfo{D::BLOCK, D::RECORD, D::HALVES};
  });
}
