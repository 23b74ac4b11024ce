// Part 1 of the quantized matmul (see qmatmul.h, which includes it): the register width. The
// tiles (qtile.h) are written once over a lane-traits struct, and these structs are the only
// place their intrinsics live:
//
//   I, F       int32 lanes (4 weight or activation bytes a lane, as the dot product reads
//              them) and float lanes; LANES of each
//   zero, bcast4 (4 activation bytes to every lane), dot4 (acc + w . a per 4-byte lane),
//   dots (acc + the G dot products of w[0..G) with G consecutive 4-byte activation words;
//   group(qmax) says how many one call may take), shl8, add; cvt (int32 -> float), set1,
//   mul, fmadd, load, store; join (two half-width vectors side by side, for the 16-lane pairs)
//
//   Y8         ymm: 8 lanes (the avx2 and avx512 families)
//   Z16        zmm: 16 lanes (the avx512 family's pairs of records)
//   Emu<N>     N lanes in plain arrays, each operation with exactly its intrinsic's semantics
//              (vpdpbusd or maddubs + madd, round to nearest, one rounding per fused
//              multiply-add). The emulated test families run the same tile template on it at 8
//              and 16 lanes on any CPU, and the tests compare them bit for bit with the real
//              families (tests/model_runner/test_kernel_emulation.py).

// maddubs families: how many weight vectors' int16 products (maddubs) may be summed in int16
// before one madd widens them. A maddubs lane is a pair of products, at most 2 * qmax * 128 in
// size, so G of them stay inside int16 while G * 256 * qmax <= 32767: quants of up to 5 bits
// take 4 (one madd and one add for 4 maddubs instead of 4 each), Q6_K's 6 bits 2. The sums
// are exact either way (no lane saturates or wraps), so results are the same bit for bit;
// vpdpbusd families take 1 (no madd to save).
constexpr int maddubs_group(int qmax) { return qmax <= 31 ? 4 : qmax <= 63 ? 2 : 1; }

// A row group's records are a stream of a few KB (K = 576: 2.9 KB of Q4_1) that ends where
// the next group's begins; the hardware prefetcher ramps up on each such stream too late
// (a 576-wide model streamed at 7 GB/s a core without this, measured). So each record asks
// for the bytes PREFETCH_AHEAD further on, which run into the next groups; and the GEMM asks
// for the first PREFETCH_AHEAD bytes of the stream it reads next (qmatmul.h, prefetch_head).
// 512, not 2048: on the Xeon model 167 VM, 2048 cost 7-20 % at the real shapes from DRAM (1B
// o 239 -> 213 us, Q6_K head rows 1426 -> 1152 us; 4096 and 8192 worse still), measured.
constexpr int PREFETCH_AHEAD = 512;

// A family's tuning (kv_family_tune; kernels/__init__.py's tune, cpu_tuning.py's table by
// CPU): when row groups go in pairs (where activation rows x row length, a panel's where rows
// are in panels, >= pair_min_mk) and
// how many bytes the software prefetches ask ahead (each record's and the next stream's head;
// 0 asks for none). None of them changes a result (a row's arithmetic is the same either
// way), only the speed, which differs by machine (docs/kernels.md, "Tuning").
struct Tuning {
  int64_t pair_min_mk = 1;
  int prefetch_ahead = PREFETCH_AHEAD;
  int prefetch_head = PREFETCH_AHEAD;
};
extern Tuning g_tuning;

#if defined(KV_USE_AVX512) || defined(KV_USE_AVX2)
KV_INLINE void prefetch_ahead(const uint8_t* rec, int bytes) {
  if (g_tuning.prefetch_ahead == 0) return;  // the loads that follow ask for these lines
  const uint8_t* ahead = rec + g_tuning.prefetch_ahead;
  for (int o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T0);
}

struct Y8 {
  typedef __m256i I;
  typedef __m256 F;
  static constexpr int LANES = 8;
  static KV_INLINE I zero() { return _mm256_setzero_si256(); }
  static KV_INLINE I bcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  // acc + (w . a) per 4-byte lane, w unsigned (SIGNED: signed; maddubs would saturate on
  // 255 * 127 * 2, so AVX2 takes the sign trick).
  template <bool SIGNED>
  static KV_INLINE I dot4(I acc, I w, I a) {
#if defined(KV_USE_AVX512)
    static_assert(!SIGNED, "vpdpbusd takes unsigned weights");
    return _mm256_dpbusd_epi32(acc, w, a);
#else
    const I one = _mm256_set1_epi16(1);
    if (SIGNED) return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w)), one));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), one));
#endif
  }
#if defined(KV_USE_AVX512)
  static constexpr int group(int) { return 1; }
#else
  static constexpr int group(int qmax) { return maddubs_group(qmax); }
#endif
#if defined(KV_USE_AVX512)
  // acc + w . (the 4 bytes at p, in every lane): vpdpbusd with the broadcast folded into its
  // memory operand (one fused load-op; GCC 12 emits a vpbroadcastd of its own before each).
  static KV_INLINE I dot4b(I acc, I w, const int8_t* p) {
    asm("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(p)));
    return acc;
  }
#endif
  template <bool SIGNED, int G>
  static KV_INLINE I dots(I acc, const I* w, const int8_t* a) {
#if defined(KV_USE_AVX512)
    static_assert(!SIGNED, "vpdpbusd takes unsigned weights");
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) acc = dot4b(acc, w[g], a + 4 * g);
    return acc;
#else
    if constexpr (SIGNED || G == 1) {
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) acc = dot4<SIGNED>(acc, w[g], bcast4(a + 4 * g));
      return acc;
    } else {
      I s = _mm256_maddubs_epi16(w[0], bcast4(a));
#pragma GCC unroll 4
      for (int g = 1; g < G; ++g) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[g], bcast4(a + 4 * g)));
      return _mm256_add_epi32(acc, _mm256_madd_epi16(s, _mm256_set1_epi16(1)));
    }
#endif
  }
  static KV_INLINE I shl8(I v) { return _mm256_slli_epi32(v, 8); }
  static KV_INLINE I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static KV_INLINE F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static KV_INLINE F set1(float v) { return _mm256_set1_ps(v); }
  static KV_INLINE F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static KV_INLINE F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static KV_INLINE F load(const float* p) { return _mm256_loadu_ps(p); }
  static KV_INLINE void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};
typedef Y8 W8;
#endif

#if defined(KV_USE_AVX512)
struct Z16 {
  typedef __m512i I;
  typedef __m512 F;
  static constexpr int LANES = 16;
  static KV_INLINE I zero() { return _mm512_setzero_si512(); }
  static KV_INLINE I bcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  template <bool SIGNED>
  static KV_INLINE I dot4(I acc, I w, I a) {
    static_assert(!SIGNED, "vpdpbusd takes unsigned weights");
    return _mm512_dpbusd_epi32(acc, w, a);
  }
  static constexpr int group(int) { return 1; }
  template <bool SIGNED, int G>
  static KV_INLINE I dots(I acc, const I* w, const int8_t* a) {
    static_assert(!SIGNED, "vpdpbusd takes unsigned weights");
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {  // the broadcast folded into the memory operand (see Y8)
      asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w[g]), "m"(*reinterpret_cast<const int32_t*>(a + 4 * g)));
    }
    return acc;
  }
  static KV_INLINE I shl8(I v) { return _mm512_slli_epi32(v, 8); }
  static KV_INLINE I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static KV_INLINE F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static KV_INLINE F set1(float v) { return _mm512_set1_ps(v); }
  static KV_INLINE F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static KV_INLINE F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static KV_INLINE F load(const float* p) { return _mm512_loadu_ps(p); }
  static KV_INLINE void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static KV_INLINE I join(Y8::I lo, Y8::I hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
  static KV_INLINE F join(Y8::F lo, Y8::F hi) { return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1); }
};
typedef Z16 W16;
#endif

#if defined(KV_EMULATE)
KV_INLINE void prefetch_ahead(const uint8_t*, int) {}

// N lanes in arrays; VNNI: dot4 is vpdpbusd's, else AVX2's maddubs + madd (with the sign
// trick for SIGNED). Integer lanes wrap as the instructions do (unsigned arithmetic).
template <int N, bool VNNI>
struct Emu {
  struct I {
    int32_t v[N];
  };
  struct F {
    float v[N];
  };
  static constexpr int LANES = N;
  static I zero() { return splat(0); }
  static I bcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return splat(v);
  }
  static int sat16(int v) { return v > 32767 ? 32767 : v < -32768 ? -32768 : v; }
  static int byte(int32_t lane, int t) { return (int)(((uint32_t)lane >> (8 * t)) & 255u); }
  static int sbyte(int32_t lane, int t) { return (int)(int8_t)byte(lane, t); }
  template <bool SIGNED>
  static I dot4(I acc, I w, I a) {
    static_assert(!(VNNI && SIGNED), "vpdpbusd takes unsigned weights");
    for (int l = 0; l < N; ++l) {
      int sum = 0;
      if (VNNI) {  // vpdpbusd: four u8 x s8 products and the lane, in int32
        for (int t = 0; t < 4; ++t) sum += byte(w.v[l], t) * sbyte(a.v[l], t);
      } else {  // maddubs (u8 x s8 pairs, saturated to int16), then madd with ones
        for (int h = 0; h < 2; ++h) {
          int pair = 0;
          for (int t = 2 * h; t < 2 * h + 2; ++t) {
            int wt = byte(w.v[l], t), at = sbyte(a.v[l], t);
            if (SIGNED) {  // sign_epi8(w, w) and sign_epi8(a, w)
              const int ws = sbyte(w.v[l], t);
              wt = (ws < 0 ? -ws : ws) & 255;
              at = ws < 0 ? (int)(int8_t)(-at) : ws == 0 ? 0 : at;
            }
            pair += wt * at;
          }
          sum += sat16(pair);
        }
      }
      acc.v[l] = (int32_t)((uint32_t)acc.v[l] + (uint32_t)sum);
    }
    return acc;
  }
  static constexpr int group(int qmax) { return VNNI ? 1 : maddubs_group(qmax); }
  // maddubs of G weight vectors summed with add_epi16 (int16 lanes wrap), then one madd.
  template <bool SIGNED, int G>
  static I dots(I acc, const I* w, const int8_t* a) {
    if constexpr (VNNI || SIGNED || G == 1) {
      for (int g = 0; g < G; ++g) acc = dot4<SIGNED>(acc, w[g], bcast4(a + 4 * g));
      return acc;
    } else {
      for (int l = 0; l < N; ++l) {
        int sum = 0;
        for (int h = 0; h < 2; ++h) {
          uint16_t s = 0;
          for (int g = 0; g < G; ++g) {
            const int32_t av = bcast4(a + 4 * g).v[0];
            int pair = 0;
            for (int t = 2 * h; t < 2 * h + 2; ++t) pair += byte(w[g].v[l], t) * sbyte(av, t);
            s = (uint16_t)(s + (uint16_t)sat16(pair));
          }
          sum += (int16_t)s;
        }
        acc.v[l] = (int32_t)((uint32_t)acc.v[l] + (uint32_t)sum);
      }
      return acc;
    }
  }
  static I shl8(I x) {
    for (int l = 0; l < N; ++l) x.v[l] = (int32_t)((uint32_t)x.v[l] << 8);
    return x;
  }
  static I add(I a, I b) {
    for (int l = 0; l < N; ++l) a.v[l] = (int32_t)((uint32_t)a.v[l] + (uint32_t)b.v[l]);
    return a;
  }
  static F cvt(I x) {
    F r;
    for (int l = 0; l < N; ++l) r.v[l] = (float)x.v[l];
    return r;
  }
  static F set1(float x) {
    F r;
    for (int l = 0; l < N; ++l) r.v[l] = x;
    return r;
  }
  static F mul(F a, F b) {
    for (int l = 0; l < N; ++l) a.v[l] *= b.v[l];
    return a;
  }
  static F fmadd(F a, F b, F c) {
    for (int l = 0; l < N; ++l) c.v[l] = std::fma(a.v[l], b.v[l], c.v[l]);
    return c;
  }
  static F load(const float* p) {
    F r;
    memcpy(r.v, p, sizeof(r.v));
    return r;
  }
  static void store(float* p, F x) { memcpy(p, x.v, sizeof(x.v)); }
  template <class H>  // H: Emu<N / 2>'s I or F
  static auto join(const H& lo, const H& hi) {
    return joined(lo.v, hi.v);
  }

 private:
  static I joined(const int32_t (&lo)[N / 2], const int32_t (&hi)[N / 2]) {
    I r;
    memcpy(r.v, lo, sizeof(lo));
    memcpy(r.v + N / 2, hi, sizeof(hi));
    return r;
  }
  static F joined(const float (&lo)[N / 2], const float (&hi)[N / 2]) {
    F r;
    memcpy(r.v, lo, sizeof(lo));
    memcpy(r.v + N / 2, hi, sizeof(hi));
    return r;
  }
  static I splat(int32_t v) {
    I r;
    for (int l = 0; l < N; ++l) r.v[l] = v;
    return r;
  }
};
typedef Emu<8, KV_EMULATE_VNNI> W8;
#if KV_PAIRS
typedef Emu<16, KV_EMULATE_VNNI> W16;
#endif
#endif
