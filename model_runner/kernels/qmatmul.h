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
// Registers: ymm everywhere (AVX-512VL gives 32 of them and VNNI on ymm; ik_llama.cpp
// measured zmm slower at one column on Zen 4, and the measurement here agrees, see the README).
// AVX2 (no VNNI) replaces vpdpbusd by maddubs + madd (no saturation: quants <= 63, and Q8_0
// takes the sign trick on its signed bytes); the portable variant decodes one row at a time.

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
//             plus a second byte for what it rounded away): q[i] holds a1 then a2 (2 K32
//             bytes a row) and the pair stands for the integer A = 256 a1 + a2, unit d / 256
//             (~15 bits: the dot products run twice as many vpdpbusd)
// u[i, b] is the unit, s[i, b] = unit * sum(A) over block b, s16[i, 2b + h] over its 16-half
// h. K32 = 32 KB >= K (zero padded); lda = bytes from one row's q to the next.
struct Acts {
  const int8_t* q;
  const float* u;
  const float* s;
  const float* s16;
  int K32, KB, lda;
  bool residual;
};

// Rounding: round(x * (1 / d)) in fp32, ties to even, d = amax / 127 (and r = x - a1 * d, two
// roundings, for the residual): the tests' reference computes them the same way.
void quantize_row(const float* __restrict x, int K, bool residual, int8_t* __restrict q, float* __restrict u,
                  float* __restrict s, float* __restrict s16) {
  const int KB = (K + 31) / 32, K32 = 32 * KB;
  for (int b = 0; b < KB; ++b) {
    const int k0 = 32 * b, cnt = K - k0 < 32 ? K - k0 : 32;
    const float* xb = x + k0;
    int8_t* q1 = q + k0;
    int8_t* q2 = q + K32 + k0;
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

// ------------------------------------------------------------------ one row of a record, scalar

// Row r of 32-block `sub` of a record: unsigned quants q[32] and, per 16-half h, scale S[h]
// and offset O[h] (w = S * q + O). The reference every SIMD decoder below agrees with, and the
// portable variant's and dequant's decoder.
void decode_row(int fmt, const uint8_t* rec, int r, int sub, uint8_t* q, float* S, float* O) {
  auto nibbles = [&](const uint8_t* qs, int loads) {  // loads of 8 x 4 bytes, low then high
    for (int i = 0; i < loads; ++i)
      for (int t = 0; t < 4; ++t) {
        const uint8_t b = qs[32 * i + 4 * r + t];
        q[4 * i + t] = b & 15;
        q[16 + 4 * i + t] = b >> 4;
      }
  };
  auto high_bits = [&](const uint8_t* words) {  // mask words: bit 4r + t of word i -> q[4i + t]
    for (int i = 0; i < 8; ++i) {
      const uint32_t w = rd32(words + 4 * i);
      for (int t = 0; t < 4; ++t) q[4 * i + t] |= ((w >> (4 * r + t)) & 1u) << 4;
    }
  };
  auto k_nibbles = [&](const uint8_t* qs) {  // chunk sub / 2 of a K-quant, low or high nibbles
    const uint8_t* c = qs + 256 * (sub >> 1);
    for (int i = 0; i < 8; ++i)
      for (int t = 0; t < 4; ++t) {
        const uint8_t b = c[32 * i + 4 * r + t];
        q[4 * i + t] = sub & 1 ? b >> 4 : b & 15;
      }
  };
  const float d = h2f(rd16(rec + 2 * r));
  switch (fmt) {
    case Q4_0: nibbles(rec + 16, 4); S[0] = d; O[0] = -8.f * d; break;
    case Q4_1: nibbles(rec + 32, 4); S[0] = d; O[0] = h2f(rd16(rec + 16 + 2 * r)); break;
    case Q5_0: nibbles(rec + 48, 4); high_bits(rec + 16); S[0] = d; O[0] = -16.f * d; break;
    case Q5_1: nibbles(rec + 64, 4); high_bits(rec + 32); S[0] = d; O[0] = h2f(rd16(rec + 16 + 2 * r)); break;
    case Q8_0:
      for (int i = 0; i < 8; ++i)
        for (int t = 0; t < 4; ++t) q[4 * i + t] = rec[16 + 32 * i + 4 * r + t];
      S[0] = d;
      O[0] = -128.f * d;
      break;
    case Q4_K:
    case Q5_K: {
      k_nibbles(rec + (fmt == Q4_K ? 128 : 384));
      if (fmt == Q5_K) high_bits(rec + 128 + 32 * sub);
      const uint8_t lo = rec[32 + 8 * sub + r], hi = (rec[96 + 8 * (sub >> 1) + r] >> (4 * (sub & 1))) & 15;
      const int sc = (lo & 15) | (hi & 3) << 4, mn = (lo >> 4) | (hi >> 2) << 4;
      S[0] = d * (float)sc;
      O[0] = -h2f(rd16(rec + 16 + 2 * r)) * (float)mn;
      break;
    }
    case Q6_K: {
      const int h = sub >> 2, qq = sub & 3, c = qq & 1, hi = qq >> 1;
      const uint8_t* ql = rec + 656 + 256 * (2 * h + c);
      const uint8_t* qh = rec + 144 + 256 * h;
      for (int i = 0; i < 8; ++i)
        for (int t = 0; t < 4; ++t) {
          const uint8_t l = ql[32 * i + 4 * r + t];
          q[4 * i + t] = (uint8_t)((hi ? l >> 4 : l & 15) | ((qh[32 * i + 4 * r + t] >> (2 * qq)) & 3) << 4);
        }
      for (int g = 0; g < 2; ++g) {
        S[g] = d * (float)(int8_t)rec[16 + 8 * (2 * sub + g) + r];
        O[g] = -32.f * S[g];
      }
      return;
    }
    default: break;
  }
  S[1] = S[0];
  O[1] = O[0];
}

struct FormatInfo {
  int block, record;  // values per record and row, bytes per record (8 rows)
};

inline FormatInfo format_info(int fmt) {
  switch (fmt) {
    case Q4_0: return {32, 144};
    case Q4_1: return {32, 160};
    case Q5_0: return {32, 176};
    case Q5_1: return {32, 192};
    case Q8_0: return {32, 272};
    case Q4_K: return {256, 1152};
    case Q5_K: return {256, 1408};
    default: return {256, 1680};  // Q6_K
  }
}

// ------------------------------------------------------------------ SIMD decoders

// The tile loops keep their vectors in registers only when every helper inlines into them.
#define KV_INLINE inline __attribute__((always_inline))

#if defined(KV_USE_AVX512) || defined(KV_USE_AVX2)
typedef __m256i V;
typedef __m256 F;

// A row group's records are a stream of a few KB (K = 576: 2.9 KB of Q4_1) that ends where
// the next group's begins; the hardware prefetcher ramps up on each such stream too late
// (a 576-wide model streamed at 7 GB/s a core without this, measured). So each record asks
// for the bytes PREFETCH_AHEAD further on, which run into the next groups.
constexpr int PREFETCH_AHEAD = 2048;
KV_INLINE void prefetch_ahead(const uint8_t* rec, int bytes) {
  for (int o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(rec + PREFETCH_AHEAD + o), _MM_HINT_T0);
}

inline V ld(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline F ld_h8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline V low4(V v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline V high4(V v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }

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

// A decoder: `unpack(sub, w)` puts the 32-block's quants in w[0..7] (w[i] lane r = quants
// 4i .. 4i + 3 of row r, unsigned unless SIGNED), `scales(sub, S, O)` its per-row scale and
// offset (HALVES: one pair per 16-half).
struct DecQ4_0 {
  static constexpr int SUBS = 1, RECORD = 144;
  static constexpr bool HALVES = false, SIGNED = false;
  const uint8_t* r;
  explicit DecQ4_0(const uint8_t* rec) : r(rec) {}
  KV_INLINE void unpack(int, V* w) const {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const V v = ld(r + 16 + 32 * i);
      w[i] = low4(v);
      w[4 + i] = high4(v);
    }
  }
  KV_INLINE void scales(int, F& S, F& O) const {
    S = ld_h8(r);
    O = _mm256_mul_ps(S, _mm256_set1_ps(-8.f));
  }
};

struct DecQ4_1 {
  static constexpr int SUBS = 1, RECORD = 160;
  static constexpr bool HALVES = false, SIGNED = false;
  const uint8_t* r;
  explicit DecQ4_1(const uint8_t* rec) : r(rec) {}
  KV_INLINE void unpack(int, V* w) const {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const V v = ld(r + 32 + 32 * i);
      w[i] = low4(v);
      w[4 + i] = high4(v);
    }
  }
  KV_INLINE void scales(int, F& S, F& O) const {
    S = ld_h8(r);
    O = ld_h8(r + 16);
  }
};

template <bool HAS_M>
struct DecQ5 {
  static constexpr int SUBS = 1, RECORD = HAS_M ? 192 : 176;
  static constexpr bool HALVES = false, SIGNED = false;
  static constexpr int QH = HAS_M ? 32 : 16, QS = QH + 32;
  const uint8_t* r;
  explicit DecQ5(const uint8_t* rec) : r(rec) {}
  KV_INLINE void unpack(int, V* w) const {
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const V v = ld(r + QS + 32 * i);
      w[i] = add_high_bit(low4(v), rd32(r + QH + 4 * i));
      w[4 + i] = add_high_bit(high4(v), rd32(r + QH + 16 + 4 * i));
    }
  }
  KV_INLINE void scales(int, F& S, F& O) const {
    S = ld_h8(r);
    O = HAS_M ? ld_h8(r + 16) : _mm256_mul_ps(S, _mm256_set1_ps(-16.f));
  }
};

struct DecQ8_0 {
  static constexpr int SUBS = 1, RECORD = 272;
#if defined(KV_USE_AVX512)
  static constexpr bool SIGNED = false;
#else
  static constexpr bool SIGNED = true;  // maddubs would saturate on 255 * 127 * 2
#endif
  static constexpr bool HALVES = false;
  const uint8_t* r;
  explicit DecQ8_0(const uint8_t* rec) : r(rec) {}
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
};

template <bool FIVE>
struct DecQK {  // Q4_K, Q5_K
  static constexpr int SUBS = 8, RECORD = FIVE ? 1408 : 1152, QS = FIVE ? 384 : 128;
  static constexpr bool HALVES = false, SIGNED = false;
  const uint8_t* r;
  F d, nmin;
  explicit DecQK(const uint8_t* rec) : r(rec), d(ld_h8(rec)), nmin(_mm256_sub_ps(_mm256_setzero_ps(), ld_h8(rec + 16))) {}
  KV_INLINE void unpack(int sub, V* w) const {
    const uint8_t* c = r + QS + 256 * (sub >> 1);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const V v = ld(c + 32 * i);
      w[i] = sub & 1 ? high4(v) : low4(v);
      if (FIVE) w[i] = add_high_bit(w[i], rd32(r + 128 + 32 * sub + 4 * i));
    }
  }
  KV_INLINE void scales(int sub, F& S, F& O) const {
    const V lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + 32 + 8 * sub)));
    V hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + 96 + 8 * (sub >> 1))));
    if (sub & 1) hi = _mm256_srli_epi32(hi, 4);
    const V three = _mm256_set1_epi32(3), fifteen = _mm256_set1_epi32(15);
    const V sc = _mm256_or_si256(_mm256_and_si256(lo, fifteen), _mm256_slli_epi32(_mm256_and_si256(hi, three), 4));
    const V mn = _mm256_or_si256(_mm256_srli_epi32(lo, 4),
                                 _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hi, 2), three), 4));
    S = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
    O = _mm256_mul_ps(nmin, _mm256_cvtepi32_ps(mn));
  }
};

struct DecQ6_K {
  static constexpr int SUBS = 8, RECORD = 1680;
  static constexpr bool HALVES = true, SIGNED = false;
  const uint8_t* r;
  F d;
  explicit DecQ6_K(const uint8_t* rec) : r(rec), d(ld_h8(rec)) {}
  KV_INLINE void unpack(int sub, V* w) const {
    const int h = sub >> 2, qq = sub & 3;
    const uint8_t* ql = r + 656 + 256 * (2 * h + (qq & 1));
    const uint8_t* qh = r + 144 + 256 * h;
    const V m30 = _mm256_set1_epi8(0x30);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const V l = ld(ql + 32 * i), hb = ld(qh + 32 * i);
      V bits;  // bits 2 qq, 2 qq + 1 of each byte, moved to bits 4, 5
      switch (qq) {
        case 0: bits = _mm256_slli_epi16(hb, 4); break;
        case 1: bits = _mm256_slli_epi16(hb, 2); break;
        case 2: bits = hb; break;
        default: bits = _mm256_srli_epi16(hb, 2); break;
      }
      w[i] = _mm256_or_si256(qq >> 1 ? high4(l) : low4(l), _mm256_and_si256(bits, m30));
    }
  }
  KV_INLINE void scales16(int sub, F& S0, F& O0, F& S1, F& O1) const {
    const uint8_t* sc = r + 16 + 16 * sub;
    S0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)))));
    S1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8)))));
    O0 = _mm256_mul_ps(S0, _mm256_set1_ps(-32.f));
    O1 = _mm256_mul_ps(S1, _mm256_set1_ps(-32.f));
  }
  KV_INLINE void scales(int, F&, F&) const {}
};

KV_INLINE V bcast4(const int8_t* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// acc + (w . a) per 4-byte lane.
template <bool SIGNED>
KV_INLINE V dot4(V acc, V w, V a) {
#if defined(KV_USE_AVX512)
  return _mm256_dpbusd_epi32(acc, w, a);
#else
  const V one = _mm256_set1_epi16(1);
  if (SIGNED) return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w)), one));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), one));
#endif
}

// out[c] = sum over i in [I0, I0 + N) of w[i] . (activation bytes 4i .. 4i + 3 of column c),
// per lane, for int8 activations; for residual ones 256 (w . a1) + (w . a2). The loop runs the
// columns innermost, so consecutive vpdpbusd are independent (a chain of them waits ~4 cycles
// each, and the scheduler cannot look far enough ahead to overlap whole columns); a lone
// column splits its sum into CH chains. Integer sums: exact, the same for every NC and CH.
template <bool SIGNED, bool RES, int NC, int I0, int N>
KV_INLINE void col_dots(const V* w, const int8_t* ap, int64_t lda, int plane, V* out) {
  constexpr int CH = NC >= 4 ? 1 : NC >= 2 ? 2 : 4;
  // Few columns: the planes a1 and a2 sum apart (no chain runs through both); more columns
  // have parallelism enough, and registers for one accumulator each: a1, shift, then a2.
  constexpr int P = RES && NC < 4 ? 2 : 1;
  V part[P][NC * CH];
#pragma GCC unroll 2
  for (int pl = 0; pl < P; ++pl) {
#pragma GCC unroll 16
    for (int j = 0; j < NC * CH; ++j) part[pl][j] = _mm256_setzero_si256();
  }
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) {
#pragma GCC unroll 2
    for (int pl = 0; pl < P; ++pl) {
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        V& p = part[pl][c * CH + i % CH];
        p = dot4<SIGNED>(p, w[I0 + i], bcast4(ap + pl * plane + c * lda + 4 * (I0 + i)));
      }
    }
  }
  if (RES && P == 1) {
#pragma GCC unroll 16
    for (int j = 0; j < NC * CH; ++j) part[0][j] = _mm256_slli_epi32(part[0][j], 8);
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) {
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        V& p = part[0][c * CH + i % CH];
        p = dot4<SIGNED>(p, w[I0 + i], bcast4(ap + plane + c * lda + 4 * (I0 + i)));
      }
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) {
    V t[P];
#pragma GCC unroll 2
    for (int pl = 0; pl < P; ++pl) {
      t[pl] = part[pl][c * CH];
      if (CH == 4)
        t[pl] = _mm256_add_epi32(_mm256_add_epi32(t[pl], part[pl][c * CH + 1]),
                                 _mm256_add_epi32(part[pl][c * CH + 2], part[pl][c * CH + 3]));
      if (CH == 2) t[pl] = _mm256_add_epi32(t[pl], part[pl][c * CH + 1]);
    }
    out[c] = P == 2 ? _mm256_add_epi32(_mm256_slli_epi32(t[0], 8), t[P - 1]) : t[0];
  }
}

// acc[8 c + r] += dot(W row r of the group, x row c0 + c) over nrec records, r < 8, c < NC.
// The float arithmetic of one (row, column) is the same sequence for every NC (and RES only
// changes the integers; a K range split across calls continues the same sum), so a row's
// result does not depend on its batch.
template <class D, bool RES, int NC>
void tile(const uint8_t* rec, int nrec, const Acts& a, int c0, float* acc_io, int ldc) {
  F acc[NC];  // the column loops unroll fully so that acc stays in registers
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) acc[c] = _mm256_loadu_ps(acc_io + ldc * c);
  const int8_t* aq = a.q + (int64_t)c0 * a.lda;
  const float* au = a.u + (int64_t)c0 * a.KB;
  for (int b = 0; b < nrec; ++b, rec += D::RECORD) {
    prefetch_ahead(rec, D::RECORD);
    const D dec(rec);
#pragma GCC unroll 8
    for (int sub = 0; sub < D::SUBS; ++sub) {  // unrolled: each sub-block's decode is static
      V w[8];
      dec.unpack(sub, w);
      const int kb = b * D::SUBS + sub;
      const int8_t* ap = aq + 32 * kb;
      if constexpr (D::HALVES) {
        F S0, O0, S1, O1;
        dec.scales16(sub, S0, O0, S1, O1);
        V i0[NC], i1[NC];
        col_dots<D::SIGNED, RES, NC, 0, 4>(w, ap, a.lda, a.K32, i0);
        col_dots<D::SIGNED, RES, NC, 4, 4>(w, ap, a.lda, a.K32, i1);
        const float* as = a.s16 + (int64_t)c0 * 2 * a.KB + 2 * kb;
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) {
          const F du = _mm256_set1_ps(au[(int64_t)c * a.KB + kb]);
          acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0[c]), _mm256_mul_ps(S0, du), acc[c]);
          acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1[c]), _mm256_mul_ps(S1, du), acc[c]);
          acc[c] = _mm256_fmadd_ps(O0, _mm256_set1_ps(as[(int64_t)c * 2 * a.KB]), acc[c]);
          acc[c] = _mm256_fmadd_ps(O1, _mm256_set1_ps(as[(int64_t)c * 2 * a.KB + 1]), acc[c]);
        }
      } else {
        F S, O;
        dec.scales(sub, S, O);
        V isum[NC];
        col_dots<D::SIGNED, RES, NC, 0, 8>(w, ap, a.lda, a.K32, isum);
        const float* as = a.s + (int64_t)c0 * a.KB + kb;
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) {
          const F du = _mm256_set1_ps(au[(int64_t)c * a.KB + kb]);
          acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[c]), _mm256_mul_ps(S, du), acc[c]);
          acc[c] = _mm256_fmadd_ps(O, _mm256_set1_ps(as[(int64_t)c * a.KB]), acc[c]);
        }
      }
    }
  }
  for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc_io + ldc * c, acc[c]);
}

template <class D, bool RES>
void tiles_of(const uint8_t* rec, int nrec, const Acts& a, int c0, int nc, float* acc, int ldc) {
  switch (nc) {
    case 8: tile<D, RES, 8>(rec, nrec, a, c0, acc, ldc); break;
    case 7: tile<D, RES, 7>(rec, nrec, a, c0, acc, ldc); break;
    case 6: tile<D, RES, 6>(rec, nrec, a, c0, acc, ldc); break;
    case 5: tile<D, RES, 5>(rec, nrec, a, c0, acc, ldc); break;
    case 4: tile<D, RES, 4>(rec, nrec, a, c0, acc, ldc); break;
    case 3: tile<D, RES, 3>(rec, nrec, a, c0, acc, ldc); break;
    case 2: tile<D, RES, 2>(rec, nrec, a, c0, acc, ldc); break;
    default: tile<D, RES, 1>(rec, nrec, a, c0, acc, ldc); break;
  }
}

template <class D>
void tiles(const uint8_t* rec, int nrec, const Acts& a, int c0, int nc, float* acc, int ldc) {
  if (a.residual) {
    tiles_of<D, true>(rec, nrec, a, c0, nc, acc, ldc);
  } else {
    tiles_of<D, false>(rec, nrec, a, c0, nc, acc, ldc);
  }
}

// acc[ldc c + r] += the 8 rows of a record run times activation rows c0 .. c0 + nc - 1.
void group_tile(int fmt, const uint8_t* rec, int nrec, const Acts& a, int c0, int nc, float* acc, int ldc) {
  switch (fmt) {
    case Q4_0: tiles<DecQ4_0>(rec, nrec, a, c0, nc, acc, ldc); break;
    case Q4_1: tiles<DecQ4_1>(rec, nrec, a, c0, nc, acc, ldc); break;
    case Q5_0: tiles<DecQ5<false>>(rec, nrec, a, c0, nc, acc, ldc); break;
    case Q5_1: tiles<DecQ5<true>>(rec, nrec, a, c0, nc, acc, ldc); break;
    case Q8_0: tiles<DecQ8_0>(rec, nrec, a, c0, nc, acc, ldc); break;
    case Q4_K: tiles<DecQK<false>>(rec, nrec, a, c0, nc, acc, ldc); break;
    case Q5_K: tiles<DecQK<true>>(rec, nrec, a, c0, nc, acc, ldc); break;
    default: tiles<DecQ6_K>(rec, nrec, a, c0, nc, acc, ldc); break;
  }
}

#if defined(KV_USE_AVX512)
// 16 rows in zmm: two records (row groups g and g + 1) decoded as above and joined lane-wise,
// so each 4-byte activation broadcast feeds 16 rows: on Zen 4 a vpdpbusd with a broadcast
// operand runs at 1.3 a cycle on ymm (42 MACs) and 1 a cycle on zmm (64 MACs), measured.
// Lane for lane the same operations as `tile`: the same results, bit for bit.
typedef __m512i Z;
typedef __m512 FZ;

inline Z join(V lo, V hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
inline FZ join(F lo, F hi) { return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1); }

// Two records' scales for 16 lanes: by default each record's 8 lanes, joined; K-quants
// decode both records' 6-bit scales in one xmm of bytes (half the work of two ymm decodes).
template <class D>
struct PairScales {
  const D& a;
  const D& b;
  KV_INLINE void scales(int sub, FZ& S, FZ& O) const {
    F sa, oa, sb, ob;
    a.scales(sub, sa, oa);
    b.scales(sub, sb, ob);
    S = join(sa, sb);
    O = join(oa, ob);
  }
};

template <bool FIVE>
struct PairScales<DecQK<FIVE>> {
  const DecQK<FIVE>& a;
  const DecQK<FIVE>& b;
  FZ d, nmin;
  PairScales(const DecQK<FIVE>& x, const DecQK<FIVE>& y) : a(x), b(y), d(join(x.d, y.d)), nmin(join(x.nmin, y.nmin)) {}
  KV_INLINE void scales(int sub, FZ& S, FZ& O) const {
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

template <bool RES, int NC, int I0, int N>
KV_INLINE void col_dots16(const Z* w, const int8_t* ap, int64_t lda, int plane, Z* out) {
  constexpr int CH = NC >= 4 ? 1 : NC >= 2 ? 2 : 4;  // chains and planes as col_dots
  constexpr int P = RES && NC < 4 ? 2 : 1;
  Z part[P][NC * CH];
#pragma GCC unroll 2
  for (int pl = 0; pl < P; ++pl) {
#pragma GCC unroll 16
    for (int j = 0; j < NC * CH; ++j) part[pl][j] = _mm512_setzero_si512();
  }
#pragma GCC unroll 8
  for (int i = 0; i < N; ++i) {
#pragma GCC unroll 2
    for (int pl = 0; pl < P; ++pl) {
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        int32_t v;
        memcpy(&v, ap + pl * plane + c * lda + 4 * (I0 + i), 4);
        Z& p = part[pl][c * CH + i % CH];
        p = _mm512_dpbusd_epi32(p, w[I0 + i], _mm512_set1_epi32(v));
      }
    }
  }
  if (RES && P == 1) {
#pragma GCC unroll 16
    for (int j = 0; j < NC * CH; ++j) part[0][j] = _mm512_slli_epi32(part[0][j], 8);
#pragma GCC unroll 8
    for (int i = 0; i < N; ++i) {
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        int32_t v;
        memcpy(&v, ap + plane + c * lda + 4 * (I0 + i), 4);
        Z& p = part[0][c * CH + i % CH];
        p = _mm512_dpbusd_epi32(p, w[I0 + i], _mm512_set1_epi32(v));
      }
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) {
    Z t[P];
#pragma GCC unroll 2
    for (int pl = 0; pl < P; ++pl) {
      t[pl] = part[pl][c * CH];
      if (CH == 4)
        t[pl] = _mm512_add_epi32(_mm512_add_epi32(t[pl], part[pl][c * CH + 1]),
                                 _mm512_add_epi32(part[pl][c * CH + 2], part[pl][c * CH + 3]));
      if (CH == 2) t[pl] = _mm512_add_epi32(t[pl], part[pl][c * CH + 1]);
    }
    out[c] = P == 2 ? _mm512_add_epi32(_mm512_slli_epi32(t[0], 8), t[P - 1]) : t[0];
  }
}

// acc[16 c + r] += ..., r < 16: rows of rec0 then rec1 (the same format), c < NC.
template <class D, bool RES, int NC>
void tile16(const uint8_t* rec0, const uint8_t* rec1, int nrec, const Acts& a, int c0, float* acc_io) {
  FZ acc[NC];
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) acc[c] = _mm512_loadu_ps(acc_io + 16 * c);
  const int8_t* aq = a.q + (int64_t)c0 * a.lda;
  const float* au = a.u + (int64_t)c0 * a.KB;
  for (int b = 0; b < nrec; ++b, rec0 += D::RECORD, rec1 += D::RECORD) {
    prefetch_ahead(rec0, D::RECORD);
    prefetch_ahead(rec1, D::RECORD);
    const D d0(rec0), d1(rec1);
    const PairScales<D> ps{d0, d1};
#pragma GCC unroll 8
    for (int sub = 0; sub < D::SUBS; ++sub) {  // unrolled: each sub-block's decode is static
      Z w[8];
      {
        V lo[8], hi[8];
        d0.unpack(sub, lo);
        d1.unpack(sub, hi);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) w[i] = join(lo[i], hi[i]);
      }
      const int kb = b * D::SUBS + sub;
      const int8_t* ap = aq + 32 * kb;
      if constexpr (D::HALVES) {
        F s0a, o0a, s1a, o1a, s0b, o0b, s1b, o1b;
        d0.scales16(sub, s0a, o0a, s1a, o1a);
        d1.scales16(sub, s0b, o0b, s1b, o1b);
        const FZ S0 = join(s0a, s0b), O0 = join(o0a, o0b), S1 = join(s1a, s1b), O1 = join(o1a, o1b);
        Z i0[NC], i1[NC];
        col_dots16<RES, NC, 0, 4>(w, ap, a.lda, a.K32, i0);
        col_dots16<RES, NC, 4, 4>(w, ap, a.lda, a.K32, i1);
        const float* as = a.s16 + (int64_t)c0 * 2 * a.KB + 2 * kb;
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) {
          const FZ du = _mm512_set1_ps(au[(int64_t)c * a.KB + kb]);
          acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0[c]), _mm512_mul_ps(S0, du), acc[c]);
          acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1[c]), _mm512_mul_ps(S1, du), acc[c]);
          acc[c] = _mm512_fmadd_ps(O0, _mm512_set1_ps(as[(int64_t)c * 2 * a.KB]), acc[c]);
          acc[c] = _mm512_fmadd_ps(O1, _mm512_set1_ps(as[(int64_t)c * 2 * a.KB + 1]), acc[c]);
        }
      } else {
        FZ S, O;
        ps.scales(sub, S, O);
        Z isum[NC];
        col_dots16<RES, NC, 0, 8>(w, ap, a.lda, a.K32, isum);
        const float* as = a.s + (int64_t)c0 * a.KB + kb;
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) {
          const FZ du = _mm512_set1_ps(au[(int64_t)c * a.KB + kb]);
          acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[c]), _mm512_mul_ps(S, du), acc[c]);
          acc[c] = _mm512_fmadd_ps(O, _mm512_set1_ps(as[(int64_t)c * a.KB]), acc[c]);
        }
      }
    }
  }
  for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc_io + 16 * c, acc[c]);
}

// Large M: a row block's K chunk decoded once into an L1 buffer (one 32-block of 16 rows per
// entry), then every column tile reads it back; the same per-lane arithmetic as tile16.
struct Unpacked {
  Z w[8];
  FZ S0, O0, S1, O1;  // S1 / O1: the second 16-half's (Q6_K), else unused
};

template <class D>
void unpack16(const uint8_t* rec0, const uint8_t* rec1, int nrec, Unpacked* out) {
  for (int b = 0; b < nrec; ++b, rec0 += D::RECORD, rec1 += D::RECORD) {
    const D d0(rec0), d1(rec1);
    const PairScales<D> ps{d0, d1};
    for (int sub = 0; sub < D::SUBS; ++sub, ++out) {
      V lo[8], hi[8];
      d0.unpack(sub, lo);
      d1.unpack(sub, hi);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) out->w[i] = join(lo[i], hi[i]);
      if constexpr (D::HALVES) {
        F s0a, o0a, s1a, o1a, s0b, o0b, s1b, o1b;
        d0.scales16(sub, s0a, o0a, s1a, o1a);
        d1.scales16(sub, s0b, o0b, s1b, o1b);
        out->S0 = join(s0a, s0b);
        out->O0 = join(o0a, o0b);
        out->S1 = join(s1a, s1b);
        out->O1 = join(o1a, o1b);
      } else {
        ps.scales(sub, out->S0, out->O0);
      }
    }
  }
}

template <bool RES, bool HALVES, int NC>
void tile16u(const Unpacked* u, int nsub, const Acts& a, int c0, float* acc_io) {
  FZ acc[NC];
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) acc[c] = _mm512_loadu_ps(acc_io + 16 * c);
  const int8_t* aq = a.q + (int64_t)c0 * a.lda;
  const float* au = a.u + (int64_t)c0 * a.KB;
  for (int kb = 0; kb < nsub; ++kb, ++u) {
    const int8_t* ap = aq + 32 * kb;
    if constexpr (HALVES) {
      Z i0[NC], i1[NC];
      col_dots16<RES, NC, 0, 4>(u->w, ap, a.lda, a.K32, i0);
      col_dots16<RES, NC, 4, 4>(u->w, ap, a.lda, a.K32, i1);
      const float* as = a.s16 + (int64_t)c0 * 2 * a.KB + 2 * kb;
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        const FZ du = _mm512_set1_ps(au[(int64_t)c * a.KB + kb]);
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0[c]), _mm512_mul_ps(u->S0, du), acc[c]);
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1[c]), _mm512_mul_ps(u->S1, du), acc[c]);
        acc[c] = _mm512_fmadd_ps(u->O0, _mm512_set1_ps(as[(int64_t)c * 2 * a.KB]), acc[c]);
        acc[c] = _mm512_fmadd_ps(u->O1, _mm512_set1_ps(as[(int64_t)c * 2 * a.KB + 1]), acc[c]);
      }
    } else {
      Z isum[NC];
      col_dots16<RES, NC, 0, 8>(u->w, ap, a.lda, a.K32, isum);
      const float* as = a.s + (int64_t)c0 * a.KB + kb;
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        const FZ du = _mm512_set1_ps(au[(int64_t)c * a.KB + kb]);
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[c]), _mm512_mul_ps(u->S0, du), acc[c]);
        acc[c] = _mm512_fmadd_ps(u->O0, _mm512_set1_ps(as[(int64_t)c * a.KB]), acc[c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc_io + 16 * c, acc[c]);
}

template <bool RES, bool HALVES>
void tiles16u_of(const Unpacked* u, int nsub, const Acts& a, int c0, int nc, float* acc) {
  switch (nc) {
    case 8: tile16u<RES, HALVES, 8>(u, nsub, a, c0, acc); break;
    case 7: tile16u<RES, HALVES, 7>(u, nsub, a, c0, acc); break;
    case 6: tile16u<RES, HALVES, 6>(u, nsub, a, c0, acc); break;
    case 5: tile16u<RES, HALVES, 5>(u, nsub, a, c0, acc); break;
    case 4: tile16u<RES, HALVES, 4>(u, nsub, a, c0, acc); break;
    case 3: tile16u<RES, HALVES, 3>(u, nsub, a, c0, acc); break;
    case 2: tile16u<RES, HALVES, 2>(u, nsub, a, c0, acc); break;
    default: tile16u<RES, HALVES, 1>(u, nsub, a, c0, acc); break;
  }
}

// Decode a pair's records [.., nrec) into u (returns false where this variant has no zmm path).
bool unpack_pair(int fmt, const uint8_t* r0, const uint8_t* r1, int nrec, Unpacked* u) {
  switch (fmt) {
    case Q4_0: unpack16<DecQ4_0>(r0, r1, nrec, u); break;
    case Q4_1: unpack16<DecQ4_1>(r0, r1, nrec, u); break;
    case Q5_0: unpack16<DecQ5<false>>(r0, r1, nrec, u); break;
    case Q5_1: unpack16<DecQ5<true>>(r0, r1, nrec, u); break;
    case Q8_0: unpack16<DecQ8_0>(r0, r1, nrec, u); break;
    case Q4_K: unpack16<DecQK<false>>(r0, r1, nrec, u); break;
    case Q5_K: unpack16<DecQK<true>>(r0, r1, nrec, u); break;
    default: unpack16<DecQ6_K>(r0, r1, nrec, u); break;
  }
  return true;
}

void unpacked_tiles(const Unpacked* u, int nsub, bool halves, const Acts& a, int c0, int nc, float* acc) {
  if (a.residual) {
    if (halves) tiles16u_of<true, true>(u, nsub, a, c0, nc, acc); else tiles16u_of<true, false>(u, nsub, a, c0, nc, acc);
  } else {
    if (halves) tiles16u_of<false, true>(u, nsub, a, c0, nc, acc); else tiles16u_of<false, false>(u, nsub, a, c0, nc, acc);
  }
}
constexpr bool HAS_UNPACKED = true;

template <class D, bool RES>
void tiles16_of(const uint8_t* r0, const uint8_t* r1, int nrec, const Acts& a, int c0, int nc, float* acc) {
  switch (nc) {
    case 8: tile16<D, RES, 8>(r0, r1, nrec, a, c0, acc); break;
    case 7: tile16<D, RES, 7>(r0, r1, nrec, a, c0, acc); break;
    case 6: tile16<D, RES, 6>(r0, r1, nrec, a, c0, acc); break;
    case 5: tile16<D, RES, 5>(r0, r1, nrec, a, c0, acc); break;
    case 4: tile16<D, RES, 4>(r0, r1, nrec, a, c0, acc); break;
    case 3: tile16<D, RES, 3>(r0, r1, nrec, a, c0, acc); break;
    case 2: tile16<D, RES, 2>(r0, r1, nrec, a, c0, acc); break;
    default: tile16<D, RES, 1>(r0, r1, nrec, a, c0, acc); break;
  }
}

template <class D>
void tiles16(const uint8_t* r0, const uint8_t* r1, int nrec, const Acts& a, int c0, int nc, float* acc) {
  if (a.residual) {
    tiles16_of<D, true>(r0, r1, nrec, a, c0, nc, acc);
  } else {
    tiles16_of<D, false>(r0, r1, nrec, a, c0, nc, acc);
  }
}

// Two row groups of one format in zmm (see tile16); true when this variant has the path.
bool pair_tile(int fmt, const uint8_t* r0, const uint8_t* r1, int nrec, const Acts& a, int c0, int nc, float* acc) {
  switch (fmt) {
    case Q4_0: tiles16<DecQ4_0>(r0, r1, nrec, a, c0, nc, acc); break;
    case Q4_1: tiles16<DecQ4_1>(r0, r1, nrec, a, c0, nc, acc); break;
    case Q5_0: tiles16<DecQ5<false>>(r0, r1, nrec, a, c0, nc, acc); break;
    case Q5_1: tiles16<DecQ5<true>>(r0, r1, nrec, a, c0, nc, acc); break;
    case Q8_0: tiles16<DecQ8_0>(r0, r1, nrec, a, c0, nc, acc); break;
    case Q4_K: tiles16<DecQK<false>>(r0, r1, nrec, a, c0, nc, acc); break;
    case Q5_K: tiles16<DecQK<true>>(r0, r1, nrec, a, c0, nc, acc); break;
    default: tiles16<DecQ6_K>(r0, r1, nrec, a, c0, nc, acc); break;
  }
  return true;
}
#else
bool pair_tile(int, const uint8_t*, const uint8_t*, int, const Acts&, int, int, float*) { return false; }
struct Unpacked {};
bool unpack_pair(int, const uint8_t*, const uint8_t*, int, Unpacked*) { return false; }
void unpacked_tiles(const Unpacked*, int, bool, const Acts&, int, int, float*) {}
constexpr bool HAS_UNPACKED = false;
#endif

#else  // portable: one row at a time through decode_row

void group_tile(int fmt, const uint8_t* rec, int nrec, const Acts& a, int c0, int nc, float* acc_io, int ldc) {
  const FormatInfo fi = format_info(fmt);
  const int subs = fi.block / 32;
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < nc; ++c) {
      const int64_t row = c0 + c;
      float acc = acc_io[ldc * c + r];
      for (int b = 0; b < nrec; ++b) {
        for (int sub = 0; sub < subs; ++sub) {
          uint8_t q[32];
          float S[2], O[2];
          decode_row(fmt, rec + (int64_t)b * fi.record, r, sub, q, S, O);
          const int kb = b * subs + sub;
          const int8_t* ap = a.q + row * a.lda + 32 * kb;
          const float da = a.u[row * a.KB + kb];
          int32_t A[32];  // the activation integers
          for (int e = 0; e < 32; ++e) A[e] = a.residual ? 256 * ap[e] + ap[a.K32 + e] : ap[e];
          if (fmt == Q6_K) {
            int32_t i0 = 0, i1 = 0;
            for (int e = 0; e < 16; ++e) i0 += (int32_t)q[e] * A[e];
            for (int e = 16; e < 32; ++e) i1 += (int32_t)q[e] * A[e];
            acc += (float)i0 * (S[0] * da);
            acc += (float)i1 * (S[1] * da);
            acc += O[0] * a.s16[row * 2 * a.KB + 2 * kb];
            acc += O[1] * a.s16[row * 2 * a.KB + 2 * kb + 1];
          } else {
            int32_t isum = 0;
            for (int e = 0; e < 32; ++e) isum += (int32_t)q[e] * A[e];
            acc += (float)isum * (S[0] * da);
            acc += O[0] * a.s[row * a.KB + kb];
          }
        }
      }
      acc_io[ldc * c + r] = acc;
    }
  }
}

bool pair_tile(int, const uint8_t*, const uint8_t*, int, const Acts&, int, int, float*) { return false; }
struct Unpacked {};
bool unpack_pair(int, const uint8_t*, const uint8_t*, int, Unpacked*) { return false; }
void unpacked_tiles(const Unpacked*, int, bool, const Acts&, int, int, float*) {}
constexpr bool HAS_UNPACKED = false;
#endif



// ------------------------------------------------------------------ the GEMM

// Where row group g (rows 8g .. 8g + 7) of w lives: its part's records.
inline const uint8_t* group_records(const QW& w, int64_t g, int& fmt, int& nrec) {
  int i = 0;
  while (i + 1 < w.nparts && g >= w.parts[i].rows / ROWS) g -= w.parts[i++].rows / ROWS;
  const QPart& p = w.parts[i];
  const FormatInfo fi = format_info(p.fmt);
  fmt = p.fmt;
  nrec = (w.k + fi.block - 1) / fi.block;  // only int8 rows (Q8_0) end in a partial block
  return p.rec + g * nrec * fi.record;
}

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

// From this many activation rows, row blocks of 2 groups in zmm (where the variant has them):
// from 1, as the M = 1 stream reads faster with 16 rows a broadcast too (measured).
constexpr int PAIR_MIN_M = 1;

// The activations of columns [k0, ...) only: the same rows, their blocks from k0 / 32 on.
inline Acts from_column(const Acts& a, int k0) {
  const int kb = k0 / 32;
  return Acts{a.q + 32 * kb, a.u + kb, a.s + kb, a.s16 + 2 * kb, a.K32, a.KB, a.lda, a.residual};
}

// acc[ldc c + r] += rows 8 g .. 8 (g + ng) - 1 (ng = 1 or 2, ldc = 8 ng) times activation rows
// c0 .. c0 + nc - 1, over the weight columns [k0, k1) (k0 a multiple of 256, or 0).
void run_rows(const QW& w, int g, int ng, const Acts& a, int k0, int k1, int c0, int nc, float* acc) {
  const Acts ak = from_column(a, k0);
  int fmt, all;
  const uint8_t* rec = group_records(w, g, fmt, all);
  const FormatInfo fi = format_info(fmt);
  const int nrec = (k1 - k0 + fi.block - 1) / fi.block;
  rec += (int64_t)(k0 / fi.block) * fi.record;
  if (ng == 2) {
    int fmt1;
    const uint8_t* rec1 = group_records(w, g + 1, fmt1, all);
    const FormatInfo f1 = format_info(fmt1);
    rec1 += (int64_t)(k0 / f1.block) * f1.record;
    if (fmt1 == fmt && pair_tile(fmt, rec, rec1, nrec, ak, c0, nc, acc)) return;
    group_tile(fmt, rec, nrec, ak, c0, nc, acc, 16);
    group_tile(fmt1, rec1, (k1 - k0 + f1.block - 1) / f1.block, ak, c0, nc, acc + ROWS, 16);
    return;
  }
  group_tile(fmt, rec, nrec, ak, c0, nc, acc, 8);
}

// Past this many activation rows the K range goes in chunks of K_CHUNK columns: the chunk's
// activations of every row stay in L2 while each row block's weights pass over them (from L1),
// instead of every row block streaming all M rows' activations from L3.
constexpr int CHUNK_MIN_M = 32, K_CHUNK = 512, UNPACK_MIN_M = 32;

// Decodes rows 8 gg .. 8 gg + 15 (one format) over columns [k0, k1) into ub; false when the
// pair spans two formats (a QuantStack's parts) or the variant has no zmm path.
bool unpack_chunk(const QW& w, int gg, const Acts&, int k0, int k1, Unpacked* ub) {
  int fmt, fmt1, all;
  const uint8_t* r0 = group_records(w, gg, fmt, all);
  const uint8_t* r1 = group_records(w, gg + 1, fmt1, all);
  if (fmt != fmt1) return false;
  const FormatInfo fi = format_info(fmt);
  const int64_t skip = (int64_t)(k0 / fi.block) * fi.record;
  return unpack_pair(fmt, r0 + skip, r1 + skip, (k1 - k0 + fi.block - 1) / fi.block, ub);
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
  const Acts acts{q, u, s, s16, K32, KB, lda, residual != 0};
  const int nout = epilogue == EPI_SILU_MUL ? w.n / 2 : w.n;
  const int groups = (nout + ROWS - 1) / ROWS, up = nout / ROWS;
  // Row blocks of 2 groups (zmm, where the variant has it) from PAIR_MIN_M activation rows.
  const int per = M >= PAIR_MIN_M ? 2 : 1, blocks = (groups + per - 1) / per, rb = per * ROWS;
  // Columns a tile takes: 8, or 4 with the residual (8 would spill its twice as many sums).
  const int cols = residual ? 4 : 8;
  const int kc = M >= CHUNK_MIN_M && K > K_CHUNK ? K_CHUNK : K;
  static thread_local Buf gbuf, ubuf2, unbuf;
  float* yg = gbuf.get<float>((size_t)M * rb);  // [M][rb]: the running sums, column-major
  float* yu = epilogue == EPI_SILU_MUL ? ubuf2.get<float>((size_t)M * rb) : nullptr;
  // Past UNPACK_MIN_M rows a chunk of a row pair is decoded once for all column tiles.
  Unpacked* ub = HAS_UNPACKED && M >= UNPACK_MIN_M ? unbuf.get<Unpacked>((size_t)(kc + 31) / 32) : nullptr;
  const int b0 = (int)((int64_t)blocks * tid / nth), b1 = (int)((int64_t)blocks * (tid + 1) / nth);
  for (int blk = b0; blk < b1; ++blk) {
    const int g = blk * per, ng = imin(per, groups - g), ldc = ng * ROWS;
    const int rows = imin(ldc, nout - ROWS * g);
    memset(yg, 0, sizeof(float) * (size_t)M * ldc);
    if (yu) memset(yu, 0, sizeof(float) * (size_t)M * ldc);
    for (int k0 = 0; k0 < K; k0 += kc) {
      const int k1 = imin(K, k0 + kc);
      for (int half = 0; half < (yu ? 2 : 1); ++half) {
        const int gg = half ? g + up : g;
        float* y = half ? yu : yg;
        if (ub && ng == 2 && unpack_chunk(w, gg, acts, k0, k1, ub)) {
          const Acts ak = from_column(acts, k0);
          int fmt, all;
          group_records(w, gg, fmt, all);
          // 8 columns (the weights come from L1), but 4 where Q6_K's two sums per column and
          // the residual's would spill.
          const int uc = fmt == Q6_K && residual ? 4 : 8;
          for (int c0 = 0; c0 < M; c0 += uc) {
            unpacked_tiles(ub, (k1 - k0 + 31) / 32, fmt == Q6_K, ak, c0, imin(uc, M - c0), y + (int64_t)c0 * ldc);
          }
          continue;
        }
        for (int c0 = 0; c0 < M; c0 += cols) {
          run_rows(w, gg, ng, acts, k0, k1, c0, imin(cols, M - c0), y + (int64_t)c0 * ldc);
        }
      }
    }
    for (int c = 0; c < M; ++c) {
      float* o = out + (int64_t)c * ldo + ROWS * g;
      const float* yc = yg + (int64_t)c * ldc;
      for (int r = 0; r < rows; ++r) {
        const int n = ROWS * g + r;
        const float v = yc[r] + (bias ? bias[n] : 0.f);
        if (epilogue == EPI_SILU_MUL) {
          o[r] = silu(v) * (yu[(int64_t)c * ldc + r] + (bias ? bias[n + nout] : 0.f));
        } else if (epilogue == EPI_ADD) {
          o[r] = res[(int64_t)c * ldr + n] + v;
        } else {
          o[r] = v;
        }
      }
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
    int fmt, nrec;
    const uint8_t* rec = group_records(w, row / ROWS, fmt, nrec);
    const FormatInfo fi = format_info(fmt);
    const int subs = fi.block / 32;
    float* dst = out + (int64_t)i * ldo;
    for (int b = 0; b < nrec; ++b) {
      for (int sub = 0; sub < subs; ++sub) {
        uint8_t q[32];
        float S[2], O[2];
        decode_row(fmt, rec + (int64_t)b * fi.record, (int)(row % ROWS), sub, q, S, O);
        const int k0 = b * fi.block + 32 * sub;
        for (int e = 0; e < 32 && k0 + e < K; ++e) dst[k0 + e] = S[e / 16] * (float)q[e] + O[e / 16];
      }
    }
  }
}
