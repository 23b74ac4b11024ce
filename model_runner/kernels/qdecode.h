// Part 1 of the quantized matmul (see qmatmul.h, which includes it): activations quantized
// per 32-block, the scalar decoder every SIMD one agrees with, and the SIMD decoders.

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
#endif  // AVX-512 or AVX2: the decoders
