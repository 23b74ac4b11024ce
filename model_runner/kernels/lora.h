// LoRA in the fused layer stack: each row's adapter update, added after the base matmul that
// ran once for every row of the step (kernels.cpp includes this inside each variant).
//
//   y[b, col0 + j] += s_b * sum_i T[b, i] * bt[i, j],   T[b, i] = sum_k a[i, k] * x[b, k]
//
// for the rows b whose adapter (LoraRows.row_slot) updates the target: a is the adapter's A
// ([rank, K], fp16), bt its (scaling * B)^T ([rank, N], fp16, rows already in the model's
// layout: model_runner/lora/layout.py), s_b the row's scale (llama.cpp's per-request scale).
// "shrink" computes T, "expand" adds the update; a barrier after each.
//
// Batch invariance: a row's T and update are computed by the same instructions in the same
// order whatever else the step holds. Rows of one adapter share each load of A in tiles of up
// to LORA_TILE rows, but every row keeps its own accumulators, so a tile of 4 and a row alone
// give the same bits; columns are split into fixed 64-wide chunks, so a column is always
// computed by the same code (the 8-wide body or the scalar tail).

// The targets an adapter may update, by index (an adapter's pair table holds one pair per
// layer and target): each one's name, the fused projection whose output columns it is a span
// of, and its output width. model_runner/lora/targets.py TARGETS is the same table; Python
// compares the two when the kernels load (kv_lora_target).
enum LoraProjection { LP_QKV = 0, LP_O = 1, LP_GATE_UP = 2, LP_DOWN = 3 };
enum LoraWidth { LW_HEADS = 0, LW_KV_HEADS = 1, LW_HIDDEN = 2, LW_INTERMEDIATE = 3 };
struct LoraTargetInfo {
  const char* name;
  int projection, width;
};
constexpr int LORA_NUM_TARGETS = 7;
constexpr LoraTargetInfo LORA_TARGETS[LORA_NUM_TARGETS] = {
    {"q", LP_QKV, LW_HEADS},         {"k", LP_QKV, LW_KV_HEADS},        {"v", LP_QKV, LW_KV_HEADS},
    {"o", LP_O, LW_HIDDEN},          {"gate", LP_GATE_UP, LW_INTERMEDIATE}, {"up", LP_GATE_UP, LW_INTERMEDIATE},
    {"down", LP_DOWN, LW_HIDDEN}};
constexpr int LORA_TILE = 4;   // rows of one adapter whose dot products share each load of A
constexpr int LORA_COLS = 64;  // output columns of one expand task

struct LoraSpan {
  int target, col0, n;  // a target's columns [col0, col0 + n) of the output
};

// The spans of `projection`'s targets in the table's order (at most 3), from the step's
// shape; returns how many.
inline int lora_spans(const StepArgs& st, int projection, LoraSpan* out) {
  const int widths[] = {st.num_heads * st.head_dim, st.num_kv_heads * st.head_dim, st.hidden_size, st.intermediate};
  int n = 0, col0 = 0;
  for (int t = 0; t < LORA_NUM_TARGETS; ++t) {
    if (LORA_TARGETS[t].projection != projection) continue;
    const int w = widths[LORA_TARGETS[t].width];
    out[n++] = LoraSpan{t, col0, w};
    col0 += w;
  }
  return n;
}

// out[r] = sum_k a[k] * x[r][k] for R rows: per row two 8-lane accumulators (blocks of 8 at
// even and odd offsets), the scalar tail, then the lanes in a fixed tree; the same for every R.
template <int R>
inline void lora_dots(const uint16_t* a, const float* const* x, int n, float* out) {
  int k = 0;
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) {
    acc0[r] = _mm256_setzero_ps();
    acc1[r] = _mm256_setzero_ps();
  }
  for (; k + 16 <= n; k += 16) {
    const __m256 w0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + k)));
    const __m256 w1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + k + 8)));
    for (int r = 0; r < R; ++r) {
      acc0[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x[r] + k), acc0[r]);
      acc1[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x[r] + k + 8), acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_add_ps(acc0[r], acc1[r]));
    float s = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for (int kk = k; kk < n; ++kk) s += h2f(a[kk]) * x[r][kk];
    out[r] = s;
  }
#else
  float acc[R][16];
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < 16; ++l) acc[r][l] = 0.f;
  for (; k + 16 <= n; k += 16) {
    float w[16];
    for (int l = 0; l < 16; ++l) w[l] = h2f(a[k + l]);
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < 16; ++l) acc[r][l] += w[l] * x[r][k + l];
  }
  for (int r = 0; r < R; ++r) {
    float lanes[8];
    for (int l = 0; l < 8; ++l) lanes[l] = acc[r][l] + acc[r][l + 8];
    float s = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
    for (int kk = k; kk < n; ++kk) s += h2f(a[kk]) * x[r][kk];
    out[r] = s;
  }
#endif
}

// y[j] += s * sum_i t[i] * bt[i * ldb + j] for j in [j0, j1) (j0 a multiple of 8): each column
// sums over i in order; 32 columns at a time (4 independent sums), then 8, then the tail.
inline void lora_expand_row(const uint16_t* bt, int ldb, const float* t, int rank, float s, float* y, int j0,
                            int j1) {
  int j = j0;
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  const __m256 vs = _mm256_set1_ps(s);
  auto col8 = [&](int i, int jj) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bt + (int64_t)i * ldb + jj)));
  };
  for (; j + 32 <= j1; j += 32) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int i = 0; i < rank; ++i) {
      const __m256 ti = _mm256_set1_ps(t[i]);
      a0 = _mm256_fmadd_ps(ti, col8(i, j), a0);
      a1 = _mm256_fmadd_ps(ti, col8(i, j + 8), a1);
      a2 = _mm256_fmadd_ps(ti, col8(i, j + 16), a2);
      a3 = _mm256_fmadd_ps(ti, col8(i, j + 24), a3);
    }
    _mm256_storeu_ps(y + j, _mm256_fmadd_ps(vs, a0, _mm256_loadu_ps(y + j)));
    _mm256_storeu_ps(y + j + 8, _mm256_fmadd_ps(vs, a1, _mm256_loadu_ps(y + j + 8)));
    _mm256_storeu_ps(y + j + 16, _mm256_fmadd_ps(vs, a2, _mm256_loadu_ps(y + j + 16)));
    _mm256_storeu_ps(y + j + 24, _mm256_fmadd_ps(vs, a3, _mm256_loadu_ps(y + j + 24)));
  }
  for (; j + 8 <= j1; j += 8) {
    __m256 a0 = _mm256_setzero_ps();
    for (int i = 0; i < rank; ++i) a0 = _mm256_fmadd_ps(_mm256_set1_ps(t[i]), col8(i, j), a0);
    _mm256_storeu_ps(y + j, _mm256_fmadd_ps(vs, a0, _mm256_loadu_ps(y + j)));
  }
#endif
  for (; j < j1; ++j) {
    float acc = 0.f;
    for (int i = 0; i < rank; ++i) acc += t[i] * h2f(bt[(int64_t)i * ldb + j]);
    y[j] += s * acc;
  }
}

inline const LoraPair& lora_pair(const LoraRows& lr, int slot, int layer, int target) {
  return lr.slots[slot][layer * LORA_NUM_TARGETS + target];
}

// Whether any adapter of the step updates one of `spans` in `layer` (the same on every thread).
inline bool lora_touches(const StepArgs& st, int layer, const LoraSpan* spans, int nspans) {
  const LoraRows* lr = st.lora;
  if (lr == nullptr) return false;
  for (int s = 0; s < lr->num_slots; ++s) {
    for (int i = 0; i < nspans; ++i) {
      if (lora_pair(*lr, s, layer, spans[i].target).a != nullptr) return true;
    }
  }
  return false;
}

// The updates of `spans` (targets that read x [B, K] and write y [B, ldy]) in `layer`, by
// every thread of the team; `tbuf` holds [B, nspans * max_rank] floats. A barrier after the
// shrink and after the expand; nothing (no barrier) when no adapter updates these targets.
void lora_apply(const StepArgs& st, int layer, const LoraSpan* spans, int nspans, const float* x, int K, float* y,
                int ldy, float* tbuf, int tid, int nth) {
  if (!lora_touches(st, layer, spans, nspans)) return;
  const LoraRows& lr = *st.lora;
  const int B = st.batch, R = lr.max_rank, ldt = nspans * R;
  int task = 0;
  for (int b0 = 0; b0 < B;) {
    const int slot = lr.row_slot[b0];
    int b1 = b0 + 1;
    while (b1 < B && b1 - b0 < LORA_TILE && lr.row_slot[b1] == slot) ++b1;
    for (int i = 0; slot >= 0 && i < nspans; ++i, ++task) {
      const LoraPair& p = lora_pair(lr, slot, layer, spans[i].target);
      if (task % nth != tid || p.a == nullptr) continue;
      const float* xr[LORA_TILE];
      float out[LORA_TILE];
      const int rows = b1 - b0;
      for (int q = 0; q < rows; ++q) xr[q] = x + (int64_t)(b0 + q) * K;
      for (int r = 0; r < p.rank; ++r) {
        const uint16_t* ar = p.a + (int64_t)r * K;
        if (rows == 1) lora_dots<1>(ar, xr, K, out);  // rows <= LORA_TILE = 4
        else if (rows == 2) lora_dots<2>(ar, xr, K, out);
        else if (rows == 3) lora_dots<3>(ar, xr, K, out);
        else lora_dots<4>(ar, xr, K, out);
        for (int q = 0; q < rows; ++q) tbuf[(int64_t)(b0 + q) * ldt + i * R + r] = out[q];
      }
    }
    b0 = b1;
  }
  if (nth > 1) {
#pragma omp barrier
  }
  task = 0;
  for (int i = 0; i < nspans; ++i) {
    const int n = spans[i].n;
    for (int j0 = 0; j0 < n; j0 += LORA_COLS, ++task) {
      if (task % nth != tid) continue;
      const int j1 = imin(n, j0 + LORA_COLS);
      for (int b = 0; b < B; ++b) {
        const int slot = lr.row_slot[b];
        if (slot < 0) continue;
        const LoraPair& p = lora_pair(lr, slot, layer, spans[i].target);
        if (p.a == nullptr) continue;
        lora_expand_row(p.bt, n, tbuf + (int64_t)b * ldt + i * R, p.rank, lr.row_scale[b],
                        y + (int64_t)b * ldy + spans[i].col0, j0, j1);
      }
    }
  }
  if (nth > 1) {
#pragma omp barrier
  }
}
