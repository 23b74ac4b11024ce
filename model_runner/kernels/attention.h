// The fused step's attention (kernels.cpp includes this inside each variant's core object):
// one row's query heads of one KV head over the positions of its block table, read from the
// paged KV pool (fp32, fp16 or int8 with a scale a row). The families with vector lanes
// (avx2: ymm, avx512: zmm) take it in chunks of positions, the others (portable, the
// emulated test families) one position at a time; the two agree to fp32 rounding, and
// neither depends on which other rows share the step.

// Keys/values of one head at one slot, as fp32 (a pointer into an fp32 pool, else into buf).
inline const float* kv_row(const StepArgs& st, const StepLayer& L, int head, int64_t slot, float* buf) {
  const int D = st.head_dim;
  const int64_t idx = ((int64_t)head * st.num_blocks * st.block_size + slot) * D;
  if (st.kv_dtype == KV_F32) return static_cast<const float*>(L.kv) + idx;
  if (st.kv_dtype == KV_F16) {
    const uint16_t* p = static_cast<const uint16_t*>(L.kv) + idx;
    int i = 0;
#ifdef KV_USE_AVX512
    for (; i + 16 <= D; i += 16) {
      _mm512_storeu_ps(buf + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i))));
    }
#endif
#ifdef __F16C__
    for (; i + 8 <= D; i += 8) {
      _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
    }
#endif
    for (; i < D; ++i) buf[i] = h2f(p[i]);
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
void attend_group_scalar(const StepArgs& st, const StepLayer& L, int b, int g, const float* q, int qstride,
                         float* out, float* kbuf) {
  const int D = st.head_dim, bs = st.block_size, G = st.num_heads / st.num_kv_heads;
  const int64_t pos = st.positions[b];
  const int64_t t0 = L.window > 0 && pos - L.window + 1 > 0 ? pos - L.window + 1 : 0;
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

#if defined(KV_USE_AVX512) || defined(KV_USE_AVX2)
// The attention loop's float lanes: the tiles' (qvec.h: load, store, set1, mul, fmadd) and
// what softmax adds, zmm in the avx512 family, ymm in avx2.
#ifdef KV_USE_AVX512
struct AttLanes : Z16 {
  static constexpr int N = LANES;
  static KV_INLINE F add(F a, F b) { return _mm512_add_ps(a, b); }
  static KV_INLINE F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static KV_INLINE F max(F a, F b) { return _mm512_max_ps(a, b); }  // b where either is NaN
  static KV_INLINE float first(F v) { return _mm512_cvtss_f32(v); }
  static KV_INLINE __m256 fold8(F v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }
  static KV_INLINE float hsum(F v) { return _mm512_reduce_add_ps(v); }
  static KV_INLINE float hmax(F v) { return _mm512_reduce_max_ps(v); }
  static KV_INLINE F round(F v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static KV_INLINE F pow2(F n) {  // 2^n for integral n in [-126, 127]
    const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  }
  static KV_INLINE F zero_below(F v, F x, float lim) {  // 0 where x < lim, else v (NaN x: v)
    return _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(x, _mm512_set1_ps(lim), _CMP_LT_OQ), _mm512_setzero_ps());
  }
#else
struct AttLanes : Y8 {
  static constexpr int N = LANES;
  static KV_INLINE F add(F a, F b) { return _mm256_add_ps(a, b); }
  static KV_INLINE F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static KV_INLINE F max(F a, F b) { return _mm256_max_ps(a, b); }  // b where either is NaN
  static KV_INLINE float first(F v) { return _mm256_cvtss_f32(v); }
  static KV_INLINE __m256 fold8(F v) { return v; }
  static KV_INLINE float hsum(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static KV_INLINE float hmax(F v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  static KV_INLINE F round(F v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static KV_INLINE F pow2(F n) {  // 2^n for integral n in [-126, 127]
    const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
  static KV_INLINE F zero_below(F v, F x, float lim) {  // 0 where x < lim, else v (NaN x: v)
    return _mm256_blendv_ps(v, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(lim), _CMP_LT_OQ));
  }
#endif
  // e^x for softmax terms (x = score - max <= 0): x = n ln2 + r with |r| <= ln2 / 2, Cephes'
  // degree-6 polynomial for e^r (within 2 ulp of expf), 2^n from its exponent bits; 0 below
  // -87.3 (where expf is subnormal; e^-inf = 0); NaN in, NaN out.
  static KV_INLINE F exp(F x) {
    const F xc = max(set1(-87.3f), x);
    const F n = round(mul(xc, set1(1.44269504088896341f)));
    F r = sub(xc, mul(n, set1(0.693359375f)));
    r = sub(r, mul(n, set1(-2.12194440e-4f)));
    F y = set1(1.9875691500e-4f);
    y = add(mul(y, r), set1(1.3981999507e-3f));
    y = add(mul(y, r), set1(8.3334519073e-3f));
    y = add(mul(y, r), set1(4.1665795894e-2f));
    y = add(mul(y, r), set1(1.6666665459e-1f));
    y = add(mul(y, r), set1(5.0000001201e-1f));
    y = add(add(mul(y, mul(r, r)), r), set1(1.f));
    return zero_below(mul(y, pow2(n)), x, -87.3f);
  }
};

// Positions whose scores are taken before their exponentials (a multiple of 8: sums8).
constexpr int ATT_CHUNK = 16;

// The 8 sums of v[0..8)'s lanes, in order, in one vector: a tree of horizontal adds, ~1 op a
// sum where each alone takes a chain of 5.
KV_INLINE __m256 sums8(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// o[c .. c + W lanes) += sum_i w[i] v[i][c ..): W vectors of the output kept in registers
// over a chunk's values.
template <int W>
KV_INLINE void add_weighted(float* o, const float* const* v, const float* w, int n, int c) {
  typedef AttLanes A;
  A::F acc[W];
  for (int k = 0; k < W; ++k) acc[k] = A::load(o + c + k * A::N);
  for (int i = 0; i < n; ++i) {
    const A::F wi = A::set1(w[i]);
    for (int k = 0; k < W; ++k) acc[k] = A::fmadd(wi, A::load(v[i] + c + k * A::N), acc[k]);
  }
  for (int k = 0; k < W; ++k) A::store(o + c + k * A::N, acc[k]);
}

// attend_group_scalar's result in vector lanes (the head size a multiple of the lanes): over
// chunks of ATT_CHUNK positions, the chunk's keys and values converted once, each head's
// scores (dot products in lanes, their lanes summed 8 scores at a time), the chunk's maximum
// (what was summed so far rescaled once when it rises), its exponentials in lanes, then the
// weighted values with the output in registers. Fused multiply-adds: the result differs from the scalar loop's by
// rounding (the tests' torch comparisons hold either way). The chunks follow the positions
// alone, so a row's result does not depend on the rows beside it.
void attend_group_lanes(const StepArgs& st, const StepLayer& L, int b, int g, const float* q, int qstride,
                        float* out) {
  typedef AttLanes A;
  const int D = st.head_dim, bs = st.block_size, G = st.num_heads / st.num_kv_heads;
  const int64_t pos = st.positions[b];
  const int64_t t0 = L.window > 0 && pos - L.window + 1 > 0 ? pos - L.window + 1 : 0;
  const int32_t* table = st.block_tables + (int64_t)b * st.max_blocks;
  static thread_local Buf chunk_buf;  // a chunk's keys then values as fp32 (fp16 / int8 pools)
  float* conv = chunk_buf.get<float>((size_t)2 * ATT_CHUNK * D);
  const float* keys[ATT_CHUNK];
  const float* vals[ATT_CHUNK];
  float mx[MAX_GROUP], sum[MAX_GROUP];
  alignas(64) float p[MAX_GROUP * ATT_CHUNK];  // p[j * ATT_CHUNK + i]: a score, then its e^
  for (int j = 0; j < G; ++j) {
    mx[j] = -INFINITY;
    sum[j] = 0.f;
    for (int i = 0; i < D; ++i) out[(int64_t)j * D + i] = 0.f;
  }
  for (int64_t c0 = t0; c0 <= pos; c0 += ATT_CHUNK) {
    const int n = pos + 1 - c0 < ATT_CHUNK ? (int)(pos + 1 - c0) : ATT_CHUNK;
    for (int i = 0; i < n; ++i) {
      const int64_t t = c0 + i, slot = (int64_t)table[t / bs] * bs + t % bs;
      keys[i] = kv_row(st, L, g, slot, conv + (int64_t)i * D);
      vals[i] = kv_row(st, L, st.num_kv_heads + g, slot, conv + (int64_t)(ATT_CHUNK + i) * D);
    }
    for (int j = 0; j < G; ++j) {
      const float* qj = q + (int64_t)j * qstride;
      float* pj = p + j * ATT_CHUNK;
      for (int i0 = 0; i0 < n; i0 += 8) {  // 8 scores at a time (past n: any key, masked below)
        __m256 part[8];
        for (int u = 0; u < 8; ++u) {
          const float* k = keys[i0 + u < n ? i0 + u : 0];
          A::F acc = A::mul(A::load(qj), A::load(k));
          for (int c = A::N; c < D; c += A::N) acc = A::fmadd(A::load(qj + c), A::load(k + c), acc);
          part[u] = A::fold8(acc);
        }
        _mm256_storeu_ps(pj + i0, sums8(part));
      }
      for (int i = n; i < ATT_CHUNK; ++i) pj[i] = -INFINITY;  // e^-inf = 0: no weight
      A::F m = A::load(pj);
      for (int c = A::N; c < ATT_CHUNK; c += A::N) m = A::max(m, A::load(pj + c));
      const float top = A::hmax(m);
      float* oj = out + (int64_t)j * D;
      if (top > mx[j]) {  // rescale what was summed so far
        const float c = A::first(A::exp(A::set1(mx[j] - top)));
        sum[j] *= c;
        for (int i = 0; i < D; ++i) oj[i] *= c;
        mx[j] = top;
      }
      const A::F shift = A::set1(mx[j]);
      A::F s = A::exp(A::sub(A::load(pj), shift));
      A::store(pj, s);
      for (int c = A::N; c < ATT_CHUNK; c += A::N) {
        const A::F e = A::exp(A::sub(A::load(pj + c), shift));
        A::store(pj + c, e);
        s = A::add(s, e);
      }
      sum[j] += A::hsum(s);
      int c = 0;
      for (; c + 4 * A::N <= D; c += 4 * A::N) add_weighted<4>(oj, vals, pj, n, c);
      const int rest = (D - c) / A::N;
      if (rest == 3) add_weighted<3>(oj, vals, pj, n, c);
      if (rest == 2) add_weighted<2>(oj, vals, pj, n, c);
      if (rest == 1) add_weighted<1>(oj, vals, pj, n, c);
    }
  }
  for (int j = 0; j < G; ++j) {
    const float inv = 1.f / sum[j];
    for (int i = 0; i < D; ++i) out[(int64_t)j * D + i] *= inv;
  }
}
#endif

// One row's attention for the G query heads of KV head g: in vector lanes where the family
// has them and the head size is a multiple of their width, else the scalar loop.
void attend_group(const StepArgs& st, const StepLayer& L, int b, int g, const float* q, int qstride,
                  float* out, float* kbuf) {
#if defined(KV_USE_AVX512) || defined(KV_USE_AVX2)
  if (st.head_dim % AttLanes::N == 0) return attend_group_lanes(st, L, b, g, q, qstride, out);
#endif
  attend_group_scalar(st, L, b, g, q, qstride, out, kbuf);
}
