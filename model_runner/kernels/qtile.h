// Part 3 of the quantized matmul (see qmatmul.h, which includes it): the tiles that feed
// decoded records to the integer dot product, one weight pass for every activation column.
// Written once over the register width (qvec.h: 8 lanes in ymm, 16 in zmm, or emulated);
// where the weights come from is a source: one record stream (8 rows), two joined (16 rows),
// or 16-row blocks decoded before into an L1 buffer.

#if KV_TILES

// The independent sums col_dots keeps per column and plane (n: the weight vectors a call
// sums). Several columns are independent chains already: one each. A lone column: 2, but
// with both planes (the 16-bit residual) only where a call sums 8 vectors, not Q6_K's halves
// of 4, and on vpdpbusd (maddubs families: 1). On the Zen 4, M = 1 from L3 at 1 thread, 2
// chains a plane (was 1) took the 1B's Q4_K o / gate_up / down from 21.9 / 24.0 / 26.9 to
// 25.4 / 26.5 / 29.0 GB/s (best of 3, each process alternated; Q4_0, Q4_1, Q5_0, Q5_K 2-10 %
// faster), 4 gained no more, Q6_K's halves were the same or slower, and so were the avx2
// family's maddubs tiles (run on the same Zen 4).
constexpr int chains(int nc, int planes, int n, bool vnni) {
  return nc >= 2 ? 1 : planes == 2 && (n <= 4 || !vnni) ? 1 : 2;
}

// A 32-block of W::LANES weight rows, decoded: w[i] lane r = quants 4i .. 4i + 3 of row r, and
// per lane the scale and offset (S1, O1: the second 16-half's, with HALVES; else unused).
template <class W>
struct Block {
  typename W::I w[8];
  typename W::F S0, O0, S1, O1;
};

// out[c] = sum over i in [I0, I0 + N) of w[i] . (activation bytes 4i .. 4i + 3 of column c),
// per lane, for int8 activations; for residual ones 256 (w . a1) + (w . a2). The loop runs the
// columns innermost, so consecutive dot products are independent (a chain of them waits ~4
// cycles each, and the scheduler cannot look far enough ahead to overlap whole columns); a
// lone column splits its sum into CH chains. Each step takes G weight vectors (W::dots: on
// maddubs families their int16 products are summed before one madd). Integer sums: exact, the
// same for every NC, CH and G.
template <class W, bool SIGNED, int G, bool RES, int NC, int I0, int N>
KV_INLINE void col_dots(const typename W::I* w, const int8_t* ap, int64_t lda, int plane, typename W::I* out) {
  typedef typename W::I I;
  static_assert(N % G == 0, "a step takes G whole weight vectors");
  constexpr int P = RES && NC < 4 ? 2 : 1;
  // vnni: a family whose dots take one weight vector a step even for 4-bit quants (vpdpbusd)
  constexpr int CH0 = chains(NC, P, N, W::group(15) == 1), CH = CH0 < N / G ? CH0 : N / G;
  // Few columns: the planes a1 and a2 sum apart (no chain runs through both); more columns
  // have parallelism enough, and registers for one accumulator each: a1, shift, then a2.
  I part[P][NC * CH];
#pragma GCC unroll 2
  for (int pl = 0; pl < P; ++pl) {
#pragma GCC unroll 16
    for (int j = 0; j < NC * CH; ++j) part[pl][j] = W::zero();
  }
#pragma GCC unroll 8
  for (int i = 0; i < N; i += G) {
#pragma GCC unroll 2
    for (int pl = 0; pl < P; ++pl) {
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        I& p = part[pl][c * CH + (i / G) % CH];
        p = W::template dots<SIGNED, G>(p, w + I0 + i, ap + pl * plane + c * lda + 4 * (I0 + i));
      }
    }
  }
  if (RES && P == 1) {
#pragma GCC unroll 16
    for (int j = 0; j < NC * CH; ++j) part[0][j] = W::shl8(part[0][j]);
#pragma GCC unroll 8
    for (int i = 0; i < N; i += G) {
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        I& p = part[0][c * CH + (i / G) % CH];
        p = W::template dots<SIGNED, G>(p, w + I0 + i, ap + plane + c * lda + 4 * (I0 + i));
      }
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) {
    I t[P];
#pragma GCC unroll 2
    for (int pl = 0; pl < P; ++pl) {
      t[pl] = part[pl][c * CH];
      if (CH == 4) t[pl] = W::add(W::add(t[pl], part[pl][c * CH + 1]), W::add(part[pl][c * CH + 2], part[pl][c * CH + 3]));
      if (CH == 2) t[pl] = W::add(t[pl], part[pl][c * CH + 1]);
    }
    out[c] = P == 2 ? W::add(W::shl8(t[0]), t[P - 1]) : t[0];
  }
}

// acc[c] += block k (32-block kb) times activation row c0 + c, c < NC: per 32-block (per 16-half
// with HALVES) one integer dot product and two FMAs. The float arithmetic of one (row, column)
// is this same sequence for every NC, width and source (RES only changes the integers; a K
// range split across calls continues the same sum), so a row's result does not depend on its
// batch.
template <class W, bool HALVES, bool SIGNED, int G, bool RES, int NC>
KV_INLINE void block_fma(const Block<W>& k, const int8_t* ap, const Acts& a, const float* au, int c0, int kb,
                         typename W::F* acc) {
  typedef typename W::F F;
  if constexpr (HALVES) {
    typename W::I i0[NC], i1[NC];
    col_dots<W, SIGNED, G, RES, NC, 0, 4>(k.w, ap, a.lda, RES ? 32 : 0, i0);
    col_dots<W, SIGNED, G, RES, NC, 4, 4>(k.w, ap, a.lda, RES ? 32 : 0, i1);
    const float* as = a.s16 + (int64_t)c0 * 2 * a.KB + 2 * kb;
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      const F du = W::set1(au[(int64_t)c * a.KB + kb]);
      acc[c] = W::fmadd(W::cvt(i0[c]), W::mul(k.S0, du), acc[c]);
      acc[c] = W::fmadd(W::cvt(i1[c]), W::mul(k.S1, du), acc[c]);
      acc[c] = W::fmadd(k.O0, W::set1(as[(int64_t)c * 2 * a.KB]), acc[c]);
      acc[c] = W::fmadd(k.O1, W::set1(as[(int64_t)c * 2 * a.KB + 1]), acc[c]);
    }
  } else {
    typename W::I isum[NC];
    col_dots<W, SIGNED, G, RES, NC, 0, 8>(k.w, ap, a.lda, RES ? 32 : 0, isum);
    const float* as = a.s + (int64_t)c0 * a.KB + kb;
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      const F du = W::set1(au[(int64_t)c * a.KB + kb]);
      acc[c] = W::fmadd(W::cvt(isum[c]), W::mul(k.S0, du), acc[c]);
      acc[c] = W::fmadd(k.O0, W::set1(as[(int64_t)c * a.KB]), acc[c]);
    }
  }
}

// Sources: a tile's weights, record after record, as Blocks of W::LANES rows. `at(b)` opens
// record b (and prefetches ahead), `block(opened, sub, scratch)` gives its 32-block sub.
//
// 8 rows: one record stream, decoder D.
template <class D>
struct One {
  typedef W8 W;
  static constexpr int SUBS = D::SUBS, RES_COLS = 4, QMAX = D::QMAX;
  static constexpr bool HALVES = D::HALVES, SIGNED = D::SIGNED;
  const uint8_t* rec;
  KV_INLINE D at(int b) const {
    const uint8_t* r = rec + (int64_t)b * D::RECORD;
    prefetch_ahead(r, D::RECORD);
    return D(r);
  }
  static KV_INLINE const Block<W>& block(const D& d, int sub, Block<W>& k) {
    d.unpack(sub, k.w);
    if constexpr (HALVES) {
      d.scales16(sub, k.S0, k.O0, k.S1, k.O1);
    } else {
      d.scales(sub, k.S0, k.O0);
    }
    return k;
  }
};

#if KV_PAIRS
// 16 rows: two records of one format (row groups g and g + 1) decoded as above and joined
// lane-wise, so each 4-byte activation broadcast feeds 16 rows: on Zen 4 a vpdpbusd with a
// broadcast operand runs at 1.3 a cycle on ymm (42 MACs) and 1 a cycle on zmm (64), measured.
// Lane for lane the same operations as One: the same results, bit for bit. With the residual
// 8 columns a tile where one sum a column fits the 32 registers (not Q6_K's halves): each
// record decoded once for 8 columns, not twice (M = 8 at 1 thread, Zen 4: the 1B's gate_up
// 4.33 -> 3.78 ms, down 2.01 -> 1.80).
template <class D>
struct Two {
  typedef W16 W;
  static constexpr int SUBS = D::SUBS, RES_COLS = D::HALVES ? 4 : 8, QMAX = D::QMAX;
  static constexpr bool HALVES = D::HALVES, SIGNED = D::SIGNED;
  struct Opened {
    D a, b;
    PairScales<D> ps;
    Opened(const uint8_t* r0, const uint8_t* r1) : a(r0), b(r1), ps(a, b) {}
  };
  const uint8_t* rec0;
  const uint8_t* rec1;
  KV_INLINE Opened at(int b) const {
    const uint8_t* r0 = rec0 + (int64_t)b * D::RECORD;
    const uint8_t* r1 = rec1 + (int64_t)b * D::RECORD;
    prefetch_ahead(r0, D::RECORD);
    prefetch_ahead(r1, D::RECORD);
    return Opened(r0, r1);
  }
  static KV_INLINE const Block<W>& block(const Opened& p, int sub, Block<W>& k) {
    {
      typename W8::I lo[8], hi[8];
      p.a.unpack(sub, lo);
      p.b.unpack(sub, hi);
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) k.w[i] = W::join(lo[i], hi[i]);
    }
    if constexpr (HALVES) {
      typename W8::F s0a, o0a, s1a, o1a, s0b, o0b, s1b, o1b;
      p.a.scales16(sub, s0a, o0a, s1a, o1a);
      p.b.scales16(sub, s0b, o0b, s1b, o1b);
      k.S0 = W::join(s0a, s0b);
      k.O0 = W::join(o0a, o0b);
      k.S1 = W::join(s1a, s1b);
      k.O1 = W::join(o1a, o1b);
    } else {
      p.ps.scales(p.a, p.b, sub, k.S0, k.O0);
    }
    return k;
  }
};

#endif  // KV_PAIRS

// Large M: a row pair's K chunk decoded once into an L1 buffer, then every column tile reads
// it back: the same per-lane arithmetic (the Block a source would have given the tile). An
// entry is one 32-block of the rows one vector holds: 16 (Two::block) where the family has
// pairs, else 8 (One::block), the pair's second group UNPACK_SETS - 1 = 1 buffer further on.
#if KV_PAIRS
typedef W16 UW;
#else
typedef W8 UW;
#endif
typedef Block<UW> Unpacked;
constexpr int UNPACK_SETS = 16 / UW::LANES;
template <class D>
struct Buffered {
  typedef UW W;
  // The weights come from L1: 8 columns a tile, but 4 where two sums per column (Q6_K's
  // halves, or the residual on 16 registers) would spill.
  static constexpr int SUBS = 1, RES_COLS = D::HALVES || UW::LANES == 8 ? 4 : 8, QMAX = D::QMAX;
  static constexpr bool HALVES = D::HALVES, SIGNED = D::SIGNED;
  const Unpacked* u;
  KV_INLINE const Unpacked* at(int b) const { return u + b; }
  static KV_INLINE const Unpacked& block(const Unpacked* p, int, Unpacked&) { return *p; }
};

// acc[ldc c + lane] += src's rows over records [0, nrec) times activation rows c0 + c, c < NC.
template <class Src, bool RES, int NC>
void tile(const Src& src, int nrec, const Acts& a, int c0, float* acc_io, int ldc) {
  typedef typename Src::W W;
  typename W::F acc[NC];  // the column loops unroll fully so that acc stays in registers
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) acc[c] = W::load(acc_io + ldc * c);
  const int8_t* aq = a.q + (int64_t)c0 * a.lda;
  const float* au = a.u + (int64_t)c0 * a.KB;
  for (int b = 0; b < nrec; ++b) {
    const auto opened = src.at(b);
#pragma GCC unroll 8
    for (int sub = 0; sub < Src::SUBS; ++sub) {  // unrolled: each sub-block's decode is static
      Block<W> scratch;
      const Block<W>& k = Src::block(opened, sub, scratch);
      const int kb = b * Src::SUBS + sub;
      block_fma<W, Src::HALVES, Src::SIGNED, W::group(Src::QMAX), RES, NC>(k, aq + (RES ? 64 : 32) * kb, a, au, c0, kb, acc);
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) W::store(acc_io + ldc * c, acc[c]);
}

template <int N>
struct Int {
  static constexpr int value = N;
};
template <bool B>
struct Bool {
  static constexpr bool value = B;
};

// f(Int<nc>()), nc in 1 .. N: the one dispatch over a tile's column count.
template <int N, class Fn>
KV_INLINE void with_nc(int nc, Fn&& f) {
  if constexpr (N > 1) {
    if (nc < N) return with_nc<N - 1>(nc, f);
  }
  f(Int<N>());
}

template <class Fn>
KV_INLINE void with_flag(bool on, Fn&& f) {
  if (on) {
    f(Bool<true>());
  } else {
    f(Bool<false>());
  }
}

// The tiles of activation rows c0 .. c0 + nc - 1 over src's records: the one residual
// dispatch. Tiles are compiled up to 8 columns, or Src::RES_COLS with the residual (where
// twice the sums would spill), and wider asks take more tiles over the same records.
template <class Src>
void run_tiles(const Src& src, int nrec, const Acts& a, int c0, int nc, float* acc, int ldc) {
  with_flag(a.residual, [&](auto res) {
    constexpr bool RES = decltype(res)::value;
    constexpr int MAX = RES ? Src::RES_COLS : 8;
    for (int c = 0; c < nc; c += MAX) {
      with_nc<MAX>(imin(MAX, nc - c), [&](auto n) {
        tile<Src, RES, decltype(n)::value>(src, nrec, a, c0 + c, acc + (int64_t)ldc * c, ldc);
      });
    }
  });
}

#endif  // KV_TILES

#if !KV_TILES  // portable: no SIMD tiles
struct Unpacked {};
constexpr int UNPACK_SETS = 1;
#endif

// A format's tiles (a split family compiles each format's in its own object, kernels.cpp):
// group: 8 rows of a record stream; pair and unpack: two row groups in 16 lanes (see Two).
template <class D>
struct FormatTiles {
  static void group(const uint8_t* rec, int nrec, const Acts& a, int c0, int nc, float* acc, int ldc);
  static void pair(const uint8_t* r0, const uint8_t* r1, int nrec, const Acts& a, int c0, int nc, float* acc);
  static void unpack(const uint8_t* r0, const uint8_t* r1, int nrec, Unpacked* out);
  static void unpacked(const Unpacked* u, int nsub, const Acts& a, int c0, int nc, float* acc);
};

#ifndef KV_SPLIT_CORE
#if KV_TILES
template <class D>
void FormatTiles<D>::group(const uint8_t* rec, int nrec, const Acts& a, int c0, int nc, float* acc, int ldc) {
  run_tiles(One<Simd<D>>{rec}, nrec, a, c0, nc, acc, ldc);
}
#else  // portable: one row at a time through the scalar decoder
template <class D>
void FormatTiles<D>::group(const uint8_t* rec, int nrec, const Acts& a, int c0, int nc, float* acc_io, int ldc) {
  for (int r = 0; r < ROWS; ++r) {
    for (int c = 0; c < nc; ++c) {
      const int64_t row = c0 + c;
      float acc = acc_io[ldc * c + r];
      for (int b = 0; b < nrec; ++b) {
        for (int sub = 0; sub < D::SUBS; ++sub) {
          uint8_t q[32];
          float S[2], O[2];
          D::row(rec + (int64_t)b * D::RECORD, r, sub, q, S, O);
          const int kb = b * D::SUBS + sub;
          const int8_t* ap = a.q + row * a.lda + a.bs * kb;
          const float da = a.u[row * a.KB + kb];
          int32_t A[32];  // the activation integers
          for (int e = 0; e < 32; ++e) A[e] = a.residual ? 256 * ap[e] + ap[a.plane + e] : ap[e];
          if (D::HALVES) {
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
#endif  // KV_TILES

#if KV_PAIRS
template <class D>
void FormatTiles<D>::pair(const uint8_t* r0, const uint8_t* r1, int nrec, const Acts& a, int c0, int nc, float* acc) {
  run_tiles(Two<Simd<D>>{r0, r1}, nrec, a, c0, nc, acc, 16);
}

#endif  // KV_PAIRS

#if KV_TILES
template <class D>
void FormatTiles<D>::unpack(const uint8_t* r0, const uint8_t* r1, int nrec, Unpacked* out) {
  for (int b = 0; b < nrec; ++b) {
    const uint8_t* a = r0 + (int64_t)b * D::RECORD;
    const uint8_t* c = r1 + (int64_t)b * D::RECORD;
#if KV_PAIRS
    const typename Two<Simd<D>>::Opened p(a, c);
    for (int sub = 0; sub < D::SUBS; ++sub, ++out) Two<Simd<D>>::block(p, sub, *out);
#else  // group r0's entries, then r1's, nrec * SUBS apart
    const Simd<D> da(a), dc(c);
    for (int sub = 0; sub < D::SUBS; ++sub, ++out) {
      One<Simd<D>>::block(da, sub, *out);
      One<Simd<D>>::block(dc, sub, out[nrec * D::SUBS]);
    }
#endif
  }
}

template <class D>
void FormatTiles<D>::unpacked(const Unpacked* u, int nsub, const Acts& a, int c0, int nc, float* acc) {
  for (int set = 0; set < UNPACK_SETS; ++set) {
    run_tiles(Buffered<Simd<D>>{u + (int64_t)set * nsub}, nsub, a, c0, nc, acc + set * UW::LANES, 16);
  }
}
#endif  // KV_TILES
#endif  // KV_SPLIT_CORE

#ifdef KV_SPLIT_FORMAT  // this object is one format's tiles
template struct FormatTiles<DecoderOf<KV_SPLIT_FORMAT>::type>;
#else
// acc[ldc c + r] += the 8 rows of a record run times activation rows c0 .. c0 + nc - 1.
void group_tile(int fmt, const uint8_t* rec, int nrec, const Acts& a, int c0, int nc, float* acc, int ldc) {
  with_decoder(fmt, [&](auto d) { FormatTiles<typename decltype(d)::type>::group(rec, nrec, a, c0, nc, acc, ldc); });
}

#if KV_PAIRS
// Two row groups of one format in 16 lanes (see Two); true where this family has the path.
bool pair_tile(int fmt, const uint8_t* r0, const uint8_t* r1, int nrec, const Acts& a, int c0, int nc, float* acc) {
  with_decoder(fmt, [&](auto d) { FormatTiles<typename decltype(d)::type>::pair(r0, r1, nrec, a, c0, nc, acc); });
  return true;
}
#else
bool pair_tile(int, const uint8_t*, const uint8_t*, int, const Acts&, int, int, float*) { return false; }
#endif  // KV_PAIRS

#if KV_TILES
constexpr bool HAS_UNPACKED = true;

// Decode a pair's records [.., nrec) into u (false where this family has no tiles to read it).
bool unpack_pair(int fmt, const uint8_t* r0, const uint8_t* r1, int nrec, Unpacked* u) {
  with_decoder(fmt, [&](auto d) { FormatTiles<typename decltype(d)::type>::unpack(r0, r1, nrec, u); });
  return true;
}

// acc[16 c + r] += the unpacked pair (nsub 32-blocks of format fmt) times activation rows c0 + c.
void unpacked_tiles(int fmt, const Unpacked* u, int nsub, const Acts& a, int c0, int nc, float* acc) {
  with_decoder(fmt, [&](auto d) { FormatTiles<typename decltype(d)::type>::unpacked(u, nsub, a, c0, nc, acc); });
}
#else
constexpr bool HAS_UNPACKED = false;
bool unpack_pair(int, const uint8_t*, const uint8_t*, int, Unpacked*) { return false; }
void unpacked_tiles(int, const Unpacked*, int, const Acts&, int, int, float*) {}
#endif  // KV_TILES
#endif  // KV_SPLIT_FORMAT
