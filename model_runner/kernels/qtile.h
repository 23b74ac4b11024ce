// Part 2 of the quantized matmul (see qmatmul.h, which includes it): the tiles that feed
// decoded records to the integer dot product, one weight pass for every activation column.

#if defined(KV_USE_AVX512) || defined(KV_USE_AVX2)


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
