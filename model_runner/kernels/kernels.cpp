// kvserve CPU kernels over GGUF-quantized weights: the quantized matmul for every batch shape
// (decode rows, prefill chunks, one flattened mixed step), dequantization (embedding rows), and
// the fused layer stack of a step.
//
// ONE source (this file and the headers beside it), compiled once per ISA family into a family
// library, plus once more without a family into the dispatcher library
// (model_runner/kernels/build.py builds them, model_runner/kernels/__init__.py loads them):
//   -DKV_VARIANT=portable   no ISA flags: plain C++ (any CPU)
//   -DKV_VARIANT=avx2       -mavx2 -mfma -mf16c: 256-bit maddubs dot products (Zen 3)
//   -DKV_VARIANT=avx512     + AVX-512 F/BW/VL/VNNI: vpdpbusd on zmm (two records joined, 16
//                           rows a broadcast) and on ymm with 32 registers (Zen 4, 5)
//   -DKV_VARIANT=emu_*      tests only: the tiles' template over emulated lanes (qvec.h)
//   (no KV_VARIANT)         the dispatcher: cpuid, the families registered with it, and the C
//                           entry points, which call the family in use
// A family may be compiled as several objects run in parallel: -DKV_SPLIT_CORE (all but the
// tiles) and one -DKV_SPLIT_FORMAT=<format> per format (that format's tiles, qtile.h).
// A variant's code lives in its own namespace and uses no std:: templates, so no inline
// function compiled with AVX-512 can be picked by the linker for another variant's caller.
//
// Weights are GGUF blocks (the formats of KV_FORMATS below) at their own bits, rows
// interleaved 8 at a time at load (model_runner/interleave.py draws the records; the file's
// bytes come back exactly). qmatmul.h decodes them in registers and feeds vpdpbusd straight
// from there; its header says how every format reduces to one integer dot product.
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

// The weight formats, one row each: its name (the enum below; Python's name for it, read
// from the library at load and checked against interleave.GEOMETRY) and its decoder
// (qdecode.h), from which everything else per format is generated: the record sizes, the
// one switch over formats (with_decoder) and the tiles (qtile.h). docs/kernels.md, "Adding a
// format", lists the rest.
#define KV_FORMATS(X)                                                                        \
  X(Q4_0, DecQ4<false>) X(Q4_1, DecQ4<true>) X(Q5_0, DecQ5<false>) X(Q5_1, DecQ5<true>) \
  X(Q8_0, DecQ8_0) X(Q4_K, DecQK<false>) X(Q5_K, DecQK<true>) X(Q6_K, DecQ6_K)

namespace kv {
#define KV_ENUM(name, D) name,
enum Format : int32_t { KV_FORMATS(KV_ENUM) };
#undef KV_ENUM
#define KV_COUNT(name, D) +1
constexpr int NUM_FORMATS = 0 KV_FORMATS(KV_COUNT);
#undef KV_COUNT
#define KV_NAME(name, D) #name,
constexpr const char* FORMAT_NAMES[NUM_FORMATS] = {KV_FORMATS(KV_NAME)};
#undef KV_NAME
enum Epilogue { EPI_NONE = 0, EPI_ADD = 1, EPI_SILU_MUL = 2, EPI_GELU_MUL = 3 };
enum KVDtype { KV_F32 = 0, KV_F16 = 1, KV_I8 = 2 };
// The families the dispatcher takes, by code (kernels/build.py's FAMILIES): the three ISA
// families, then from NUM_ISAS on the emulated ones the tests register (room for MAX_FAMILIES).
enum Isa { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, NUM_ISAS = 3, MAX_FAMILIES = 16 };
constexpr int MAX_PARTS = 4;
}  // namespace kv

extern "C" {

// Rows [row0, row0 + rows) of a weight in one format: ceil(rows / 8) row groups of
// k / block records each (interleave.py), group after group, or panel after panel (qmatmul.h,
// group_records).
struct QPart {
  int32_t fmt, rows;
  const uint8_t* rec;
  int32_t panel, pad;  // records a panel (interleave.panel_cols columns), or 0: rows whole
};

// A weight of n rows of k values: parts stacked by rows (Q, K and V of a fused projection may
// come in different formats, as Q4_K_M files have them).
struct QW {
  int32_t nparts, n, k, pad;
  QPart parts[kv::MAX_PARTS];
};

struct StepLayer {
  const float* input_norm;
  const float* post_norm;
  const float* qkv_bias;  // or NULL
  // Per-head RMSNorm weights [head_dim] of Q and K before RoPE (QK-norm: Qwen3), or NULL.
  const float* q_norm;
  const float* k_norm;
  QW qkv, o, gate_up, down;
  void* kv;
  float* kv_scales;  // int8 pools, else NULL
  // A mixture-of-experts MLP in place of gate_up / down (moe_mlp), else NULL: the router
  // [num_experts, hidden] fp32 and each expert's gate-up [2 * I_e, hidden] and down
  // [hidden, I_e] (num_experts of each; I_e = StepArgs.expert_intermediate).
  const float* router;
  const QW* expert_gate_up;
  const QW* expert_down;
  // Gemma's sandwich norms: RMSNorm weights [hidden] of the attention's and the MLP's outputs
  // before their residual adds, else NULL.
  const float* attn_out_norm;
  const float* mlp_out_norm;
  const float* rope;  // this layer's RoPE table (Gemma 3's sliding layers), NULL: StepArgs.rope
  int32_t window;     // positions a query sees, itself included (0: all)
  int32_t own_table;  // 1: the layer's KV is in the sliding layers' pool (StepArgs.window_*)
};

// LoRA (lora.h): one adapter's pair for one target of one layer, fp16: a [rank, k] and
// bt = (scaling * B)^T [rank, n]; a == NULL where the adapter does not update the target.
struct LoraPair {
  const uint16_t* a;
  const uint16_t* bt;
  int32_t rank, pad;
};

// A step's adapters: each row's slot (-1: the base model) and scale; slots[s] points to the
// adapter's [num_layers * 7] pairs (targets q, k, v, o, gate, up, down).
struct LoraRows {
  const int32_t* row_slot;
  const float* row_scale;
  const LoraPair* const* slots;
  int32_t num_slots, max_rank;
};

// One step's rows and the model's shapes, for kv_step_layers.
struct StepArgs {
  float* hidden;                // [B, hidden], updated in place
  const int64_t* positions;     // [B]: each row's position
  const int32_t* block_tables;  // [B, max_blocks]: each row's request's blocks
  const float* rope;            // [max_len, head_dim / 2, 2]: cos, sin
  int32_t batch, hidden_size, num_heads, num_kv_heads, head_dim, intermediate;
  int32_t kv_dtype, num_blocks, block_size, max_blocks, nthreads;
  float eps;
  int32_t residual;  // activations with a residual byte (qmatmul.h's Acts), else int8
  const LoraRows* lora;  // the rows' adapters, or NULL (lora.h)
  // The mixture-of-experts layers' shape (StepLayer.router): experts, chosen per row, each
  // expert's MLP width, and whether the chosen weights are renormalized to sum to 1.
  int32_t num_experts, num_used, expert_intermediate, norm_topk;
  int32_t gelu;  // the gated MLP's activation: GELU (tanh) for Gemma, else SiLU
  // The sliding layers' own pool (cache_manager.hybrid), for layers with own_table: each
  // row's table [B, window_max_blocks] in that pool's ids, and its blocks; else unused.
  const int32_t* window_tables;
  int32_t window_max_blocks, window_num_blocks;
};

// What a family library gives the dispatcher (kv_family; the dispatcher's kv_register_family).
struct KvFamily {
  void (*qgemm)(const QW&, const float*, int, int, float*, int, const float*, const float*, int, int, int, int);
  void (*dequant)(const QW&, const int64_t*, int64_t, int, float*, int, int);
  void (*step_layers)(const StepLayer*, int, const StepArgs*);
};

#ifndef KV_SPLIT_FORMAT
// The sizes of the structs above (0 QW, 1 StepLayer, 2 StepArgs, 3 QPart, 4 LoraPair,
// 5 LoraRows; -1 past them), so Python can check its ctypes mirrors against every library
// it loads.
int kv_struct_sizes(int which) {
  const int sizes[] = {(int)sizeof(QW),    (int)sizeof(StepLayer), (int)sizeof(StepArgs),
                       (int)sizeof(QPart), (int)sizeof(LoraPair),  (int)sizeof(LoraRows)};
  return which >= 0 && which < 6 ? sizes[which] : -1;
}
#endif

}  // extern "C"

#ifdef KV_VARIANT

#if defined(KV_EMULATE)  // tests: plain C++ lanes (qvec.h), any CPU
#define KV_TILES 1
#define KV_PAIRS (KV_EMULATE == 16)
#elif defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KV_USE_AVX512 1
#define KV_TILES 1
#define KV_PAIRS 1
#define KV_EMULATE_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
#define KV_USE_AVX2 1
#define KV_TILES 1
#define KV_PAIRS 0
#define KV_EMULATE_VNNI 0
#else
#define KV_PAIRS 0
#define KV_EMULATE_VNNI 0
#endif
// KV_TILES: the SIMD tiles of qtile.h (else the portable family's scalar ones); KV_PAIRS: 16-row
// pairs; KV_EMULATE_VNNI: the dot product is vpdpbusd (u8 x s8, no saturation), else maddubs.

// The tile loops keep their vectors in registers only when every helper inlines into them.
#define KV_INLINE inline __attribute__((always_inline))

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
inline int imax(int a, int b) { return a > b ? a : b; }

#include "qmatmul.h"

#ifndef KV_SPLIT_FORMAT
Tuning g_tuning;  // the family's one copy (a split family's format objects link to it)
#endif

#ifndef KV_SPLIT_FORMAT  // the core object of a split family (see the top)
#include "lora.h"        // the fused step's adapters: the core's alone

// ------------------------------------------------------------------ the fused layer stack
//
// One call runs every layer of a step on quantized weights: no Python, no tensor dispatch
// between the ops of a layer. Rows are tokens: one decode row per running request, several
// consecutive rows per prefill chunk, k + 1 rows per speculative verification. Each row has
// its position and its request's block table:
//
//   x = rms_norm(h) -> qkv = x Wqkv (+b) -> (per-head rms_norm of q, k) -> RoPE(q, k)
//     -> every row's k, v into the paged pool
//     -> attention of each row over its request's positions <= its own (causal inside a
//        chunk, because all rows are written before any row attends)
//     -> h += attn Wo -> x = rms_norm(h) -> a = silu(x Wg) * (x Wu) -> h += a Wd
//        (or, on a mixture-of-experts layer, h += the chosen experts' weighted MLPs: moe_mlp)
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

void kv_store(const StepArgs& st, const StepLayer& L, int head, int64_t slot, const float* v) {
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

#include "attention.h"  // kv_row, attend_group: the core's alone

// Buffers of a step, shared by its team.
struct StepBufs {
  float* x;
  float* qkv;
  float* attn;
  float* act;
  ActBufs* acts;
  float* gate_up;  // [B, 2 * intermediate] with LoRA on gate or up, else NULL
  float* lora_t;   // [B, 3 * max_rank] with LoRA, else NULL (lora.h)
  struct MoeBufs* moe;  // with mixture-of-experts layers, else NULL
  float* y;             // [B, hidden]: a projection's output before its sandwich norm
};

// Sandwich norms (Gemma): h[b] += rms_norm(y[b]) * w, by rows; the norm rounds before the add,
// as the torch path's ``residual + rms_norm(y)``. The matmul that wrote y ended in a barrier,
// and the next op (the following norm) splits by the same rows: no barrier after.
void add_normed(const StepArgs& st, const float* w, const StepBufs& sb, int tid, int nth) {
  const int Hd = st.hidden_size;
  static thread_local Buf nb;
  float* normed = nb.get<float>(Hd);
  for (int b = tid; b < st.batch; b += nth) {
    float* h = st.hidden + (int64_t)b * Hd;
    rms_norm(sb.y + (int64_t)b * Hd, w, st.eps, 1, Hd, normed);
    for (int c = 0; c < Hd; ++c) h[c] = h[c] + normed[c];
  }
}

// ------------------------------------------------------------------ mixture of experts
//
// A layer's experts as model_runner/moe.py runs them, in one pass of the team: the router's
// logits (fp32), per row the softmax, the num_used highest (ties: the lower expert) and their
// weights (renormalized with norm_topk), then the (row, expert) pairs grouped by expert, and
// each chosen expert's gate-up (SiLU-gated) and down once over all its rows, so its weights
// are read once a step and an expert no row chose is not touched. The weighted outputs are
// summed into each row in ascending expert order (moe.py's index_add_ order, each product
// rounded before its add), then added to the residual.

struct MoeBufs {
  float* logits;    // [B, E]: the router's, then the softmax
  int32_t* chosen;  // [B, k]
  float* weights;   // [B, k]
  int32_t* start;   // [E + 1]: expert e's pairs are [start[e], start[e + 1])
  int32_t* rows;    // [B * k]: the pairs' rows, by expert, rows ascending
  float* scale;     // [B * k]: their weights
  float* xg;        // [B, hidden]: an expert's rows gathered
  float* y;         // [B, hidden]: its output
  float* acc;       // [B, hidden]: the weighted sum
};

// The router's dot product: 16 partial sums, so it vectorizes without reassociating a chain.
inline float dot16(const float* a, const float* b, int n) {
  float s[16] = {0.f};
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int l = 0; l < 16; ++l) s[l] += a[i + l] * b[i + l];
  }
  float t = 0.f;
  for (; i < n; ++i) t += a[i] * b[i];
  for (int l = 0; l < 16; ++l) t += s[l];
  return t;
}

// Row b's experts and weights from its logits (softmax in place; moe.py's MoeMlp.route).
void route_row(const StepArgs& st, MoeBufs& m, int b) {
  const int E = st.num_experts, K = st.num_used;
  float* p = m.logits + (int64_t)b * E;
  float mx = p[0];
  for (int e = 1; e < E; ++e) mx = p[e] > mx ? p[e] : mx;
  float sum = 0.f;
  for (int e = 0; e < E; ++e) {
    p[e] = std::exp(p[e] - mx);
    sum += p[e];
  }
  for (int e = 0; e < E; ++e) p[e] /= sum;
  int32_t* chosen = m.chosen + (int64_t)b * K;
  float* w = m.weights + (int64_t)b * K;
  float total = 0.f;
  for (int j = 0; j < K; ++j) {  // k passes: k is small (8 of 128)
    int best = -1;
    for (int e = 0; e < E; ++e) {
      bool taken = false;
      for (int i = 0; i < j; ++i) taken |= chosen[i] == e;
      if (!taken && (best < 0 || p[e] > p[best])) best = e;
    }
    chosen[j] = best;
    w[j] = p[best];
    total += w[j];
  }
  if (st.norm_topk) {
    for (int j = 0; j < K; ++j) w[j] /= total;
  }
}

void moe_mlp(const StepArgs& st, const StepLayer& L, const StepBufs& sb, int tid, int nth) {
  const int B = st.batch, Hd = st.hidden_size, E = st.num_experts, K = st.num_used;
  const int I = st.expert_intermediate;
  MoeBufs& m = *sb.moe;
  for (int e = E * tid / nth; e < E * (tid + 1) / nth; ++e) {
    const float* r = L.router + (int64_t)e * Hd;
    for (int b = 0; b < B; ++b) m.logits[(int64_t)b * E + e] = dot16(r, sb.x + (int64_t)b * Hd, Hd);
  }
  if (nth > 1) {
#pragma omp barrier
  }
  for (int b = tid; b < B; b += nth) route_row(st, m, b);
  if (nth > 1) {
#pragma omp barrier
  }
  if (tid == 0) {  // the pairs by expert, stable in the row: a counting sort
    for (int e = 0; e <= E; ++e) m.start[e] = 0;
    for (int i = 0; i < B * K; ++i) ++m.start[m.chosen[i] + 1];
    for (int e = 0; e < E; ++e) m.start[e + 1] += m.start[e];
    int32_t* next = m.start;  // filled in place, then shifted back
    for (int i = 0; i < B * K; ++i) {
      const int at = next[m.chosen[i]]++;
      m.rows[at] = i / K;
      m.scale[at] = m.weights[i];
    }
    for (int e = E; e > 0; --e) m.start[e] = m.start[e - 1];
    m.start[0] = 0;
  }
  // Each thread sums its own columns of every row: no barrier between the experts' sums.
  const int c0 = Hd * tid / nth, c1 = Hd * (tid + 1) / nth;
  for (int b = 0; b < B; ++b) memset(m.acc + (int64_t)b * Hd + c0, 0, sizeof(float) * (c1 - c0));
  if (nth > 1) {
#pragma omp barrier
  }
  ActBufs& ab = *sb.acts;
  for (int e = 0; e < E; ++e) {
    const int first = m.start[e], n = m.start[e + 1] - first;
    if (n == 0) continue;
    const float* xin = sb.x + (int64_t)m.rows[first] * Hd;
    if (n > 1) {  // the rows gathered (one row is read in place)
      for (int i = tid; i < n; i += nth) memcpy(m.xg + (int64_t)i * Hd, sb.x + (int64_t)m.rows[first + i] * Hd, sizeof(float) * Hd);
      xin = m.xg;
      if (nth > 1) {
#pragma omp barrier
      }
    }
    qgemm_team(L.expert_gate_up[e], xin, n, Hd, sb.act, I, nullptr, nullptr, 0, EPI_SILU_MUL, st.residual, ab, tid, nth);
    qgemm_team(L.expert_down[e], sb.act, n, I, m.y, Hd, nullptr, nullptr, 0, EPI_NONE, st.residual, ab, tid, nth);
    for (int i = 0; i < n; ++i) {
      float* acc = m.acc + (int64_t)m.rows[first + i] * Hd;
      const float* y = m.y + (int64_t)i * Hd;
      const float w = m.scale[first + i];
      for (int c = c0; c < c1; ++c) {
        const float t = y[c] * w;
        acc[c] += t;
      }
    }
  }
  for (int b = 0; b < B; ++b) {
    float* h = st.hidden + (int64_t)b * Hd;
    const float* acc = m.acc + (int64_t)b * Hd;
    for (int c = c0; c < c1; ++c) h[c] = h[c] + acc[c];
  }
  if (nth > 1) {
#pragma omp barrier
  }
}

// One layer, run by every thread of the step's team (tid of nth): the row-wise ops split by
// rows, the matmuls by row blocks, attention by (row, KV head) tasks, a barrier between ops.
void step_layer(const StepArgs& st, const StepLayer& L, int layer, const StepBufs& sb, int tid, int nth) {
  const int B = st.batch, Hd = st.hidden_size, D = st.head_dim;
  const int H = st.num_heads, KVH = st.num_kv_heads, nq = (H + 2 * KVH) * D;
  ActBufs& ab = *sb.acts;
  for (int b = tid; b < B; b += nth) rms_norm(st.hidden + (int64_t)b * Hd, L.input_norm, st.eps, 1, Hd, sb.x + (int64_t)b * Hd);
  if (nth > 1) {
#pragma omp barrier
  }
  qgemm_team(L.qkv, sb.x, B, Hd, sb.qkv, nq, L.qkv_bias, nullptr, 0, EPI_NONE, st.residual, ab, tid, nth);
  const int I = st.intermediate;
  LoraSpan qkv_spans[3], o_spans[3], gate_up_spans[3], down_spans[3];
  int n_qkv = 0, n_o = 0, n_gate_up = 0, n_down = 0;
  if (st.lora) {  // the target table's spans (lora.h), checked against Python's at load
    n_qkv = lora_spans(st, LP_QKV, qkv_spans);
    n_o = lora_spans(st, LP_O, o_spans);
    n_gate_up = lora_spans(st, LP_GATE_UP, gate_up_spans);
    n_down = lora_spans(st, LP_DOWN, down_spans);
    lora_apply(st, layer, qkv_spans, n_qkv, sb.x, Hd, sb.qkv, nq, sb.lora_t, tid, nth);
  }
  for (int b = tid; b < B; b += nth) {
    const int64_t pos = st.positions[b];
    const float* cs = (L.rope ? L.rope : st.rope) + pos * D;  // [D / 2] pairs of (cos, sin)
    float* row = sb.qkv + (int64_t)b * nq;
    if (L.q_norm) {  // in place: rms_norm reads a row's sum of squares before it writes
      for (int h = 0; h < H; ++h) rms_norm(row + h * D, L.q_norm, st.eps, 1, D, row + h * D);
      for (int h = H; h < H + KVH; ++h) rms_norm(row + h * D, L.k_norm, st.eps, 1, D, row + h * D);
    }
    for (int h = 0; h < H + KVH; ++h) rope(row + h * D, cs, D / 2);
    const int64_t slot = (int64_t)st.block_tables[(int64_t)b * st.max_blocks + pos / st.block_size] * st.block_size +
                         pos % st.block_size;
    for (int j = 0; j < KVH; ++j) {
      kv_store(st, L, j, slot, row + (H + j) * D);
      kv_store(st, L, KVH + j, slot, row + (H + KVH + j) * D);
    }
  }
  if (nth > 1) {
#pragma omp barrier
  }
  const int tasks = B * KVH, G = H / KVH;
  {
    float kbuf[512];
#pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < tasks; ++task) {
      const int b = task / KVH, g = task % KVH;
      attend_group(st, L, b, g, sb.qkv + (int64_t)b * nq + g * G * D, D, sb.attn + (int64_t)b * H * D + g * G * D,
                   kbuf);
    }
  }
  if (L.attn_out_norm) {  // h += rms_norm(attn Wo (+ the adapters' update))
    qgemm_team(L.o, sb.attn, B, H * D, sb.y, Hd, nullptr, nullptr, 0, EPI_NONE, st.residual, ab, tid, nth);
    if (st.lora) lora_apply(st, layer, o_spans, n_o, sb.attn, H * D, sb.y, Hd, sb.lora_t, tid, nth);
    add_normed(st, L.attn_out_norm, sb, tid, nth);
  } else {
    qgemm_team(L.o, sb.attn, B, H * D, st.hidden, Hd, nullptr, st.hidden, Hd, EPI_ADD, st.residual, ab, tid, nth);
    if (st.lora) lora_apply(st, layer, o_spans, n_o, sb.attn, H * D, st.hidden, Hd, sb.lora_t, tid, nth);
  }
  for (int b = tid; b < B; b += nth) rms_norm(st.hidden + (int64_t)b * Hd, L.post_norm, st.eps, 1, Hd, sb.x + (int64_t)b * Hd);
  if (nth > 1) {
#pragma omp barrier
  }
  if (L.router) {  // no adapters on experts: LoRA on a mixture-of-experts model is refused at load
    moe_mlp(st, L, sb, tid, nth);
    return;
  }
  if (lora_touches(st, layer, gate_up_spans, n_gate_up)) {
    // The update goes in before the SiLU: gate and up whole, then silu(gate) * up per row
    // (the fused epilogue's arithmetic, so the base rows' numbers do not change).
    qgemm_team(L.gate_up, sb.x, B, Hd, sb.gate_up, 2 * I, nullptr, nullptr, 0, EPI_NONE, st.residual, ab, tid, nth);
    lora_apply(st, layer, gate_up_spans, n_gate_up, sb.x, Hd, sb.gate_up, 2 * I, sb.lora_t, tid, nth);
    for (int b = tid; b < B; b += nth) {
      const float* gu = sb.gate_up + (int64_t)b * 2 * I;
      float* a = sb.act + (int64_t)b * I;
      for (int j = 0; j < I; ++j) a[j] = (st.gelu ? gelu_tanh(gu[j]) : silu(gu[j])) * gu[I + j];
    }
    if (nth > 1) {
#pragma omp barrier
    }
  } else {
    qgemm_team(L.gate_up, sb.x, B, Hd, sb.act, I, nullptr, nullptr, 0, st.gelu ? EPI_GELU_MUL : EPI_SILU_MUL,
               st.residual, ab, tid, nth);
  }
  if (L.mlp_out_norm) {  // h += rms_norm(a Wd (+ the adapters' update))
    qgemm_team(L.down, sb.act, B, I, sb.y, Hd, nullptr, nullptr, 0, EPI_NONE, st.residual, ab, tid, nth);
    if (st.lora) lora_apply(st, layer, down_spans, n_down, sb.act, I, sb.y, Hd, sb.lora_t, tid, nth);
    add_normed(st, L.mlp_out_norm, sb, tid, nth);
    return;
  }
  qgemm_team(L.down, sb.act, B, I, st.hidden, Hd, nullptr, st.hidden, Hd, EPI_ADD, st.residual, ab, tid, nth);
  if (st.lora) lora_apply(st, layer, down_spans, n_down, sb.act, I, st.hidden, Hd, sb.lora_t, tid, nth);
}

// Every layer in one OpenMP team: a barrier between ops instead of a team started per op
// (a fork and join costs more than a barrier, and a step of a small model runs ~150 of them).
void step_layers(const StepLayer* layers, int num_layers, const StepArgs* step) {
  const StepArgs& st = *step;
  const int B = st.batch;
  static thread_local Buf xb, qb, ab, mb, gb, tb, yb;
  static thread_local Buf moe_logits, moe_chosen, moe_weights, moe_start, moe_rows, moe_scale, moe_xg, moe_y, moe_acc;
  static thread_local ActBufs acts;
  static thread_local MoeBufs moe;
  const int inter = st.num_experts && st.expert_intermediate > st.intermediate ? st.expert_intermediate : st.intermediate;
  const int kmax = inter > st.hidden_size ? inter : st.hidden_size;
  acts.reserve(B, kmax > st.num_heads * st.head_dim ? kmax : st.num_heads * st.head_dim);
  if (st.num_experts) {
    const size_t E = st.num_experts, pairs = (size_t)B * st.num_used, rows = (size_t)B * st.hidden_size;
    moe = MoeBufs{moe_logits.get<float>(B * E),          moe_chosen.get<int32_t>(pairs), moe_weights.get<float>(pairs),
                  moe_start.get<int32_t>(E + 1),         moe_rows.get<int32_t>(pairs),   moe_scale.get<float>(pairs),
                  moe_xg.get<float>(rows),               moe_y.get<float>(rows),         moe_acc.get<float>(rows)};
  }
  const StepBufs sb{xb.get<float>((size_t)B * st.hidden_size),
                    qb.get<float>((size_t)B * (st.num_heads + 2 * st.num_kv_heads) * st.head_dim),
                    ab.get<float>((size_t)B * st.num_heads * st.head_dim), mb.get<float>((size_t)B * inter),
                    &acts,
                    st.lora ? gb.get<float>((size_t)B * 2 * st.intermediate) : nullptr,
                    st.lora ? tb.get<float>((size_t)B * 3 * (st.lora->max_rank > 0 ? st.lora->max_rank : 1)) : nullptr,
                    st.num_experts ? &moe : nullptr,
                    yb.get<float>((size_t)B * st.hidden_size)};
  const int nt = st.nthreads > 1 ? st.nthreads : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
    StepArgs own = st;  // the sliding layers' tables and pool, for layers with own_table
    own.block_tables = st.window_tables;
    own.max_blocks = st.window_max_blocks;
    own.num_blocks = st.window_num_blocks;
    for (int i = 0; i < num_layers; ++i) step_layer(layers[i].own_table ? own : st, layers[i], i, sb, tid, nth);
  }
}

#endif  // KV_SPLIT_FORMAT

}  // namespace KV_VARIANT
}  // namespace kv

#ifndef KV_SPLIT_FORMAT
extern "C" {

// This family's entry points, for the dispatcher's kv_register_family.
const KvFamily* kv_family(void) {
  static const KvFamily family{kv::KV_VARIANT::qgemm, kv::KV_VARIANT::dequant, kv::KV_VARIANT::step_layers};
  return &family;
}

// This family's tuning knob `key` (qvec.h, Tuning: 0 pair_min_mk, >= 1; 1 prefetch_ahead and
// 2 prefetch_head, bytes, a multiple of 64 in [0, 8192]) set to `value` where value >= 0;
// returns the knob's value, or -1 for an unknown key or a value out of range (then nothing
// changes). Results never depend on them. Set between calls, not during one.
int64_t kv_family_tune(int key, int64_t value) {
  kv::KV_VARIANT::Tuning& t = kv::KV_VARIANT::g_tuning;
  if (key < 0 || key > 2) return -1;
  if (value >= 0) {
    if (key == 0 ? value < 1 : value > 8192 || value % 64 != 0) return -1;
    if (key == 0) t.pair_min_mk = value;
    if (key == 1) t.prefetch_ahead = (int)value;
    if (key == 2) t.prefetch_head = (int)value;
  }
  return key == 0 ? t.pair_min_mk : key == 1 ? t.prefetch_ahead : t.prefetch_head;
}

// Format fmt's name, and its values per record and row and bytes per record (block, record):
// the library's format table, which Python checks against interleave.GEOMETRY. NULL past the
// last format.
const char* kv_format_info(int fmt, int* block, int* record) {
  if (fmt < 0 || fmt >= kv::NUM_FORMATS) return nullptr;
  const kv::KV_VARIANT::FormatInfo fi = kv::KV_VARIANT::format_info(fmt);
  *block = fi.block;
  *record = fi.record;
  return kv::FORMAT_NAMES[fmt];
}

// LoRA target t's name, projection and output width (lora.h LORA_TARGETS): the table Python
// checks against model_runner/lora/targets.py TARGETS. NULL past the last target.
const char* kv_lora_target(int t, int* projection, int* width) {
  if (t < 0 || t >= kv::KV_VARIANT::LORA_NUM_TARGETS) return nullptr;
  const kv::KV_VARIANT::LoraTargetInfo& info = kv::KV_VARIANT::LORA_TARGETS[t];
  *projection = info.projection;
  *width = info.width;
  return info.name;
}

}  // extern "C"
#endif  // KV_SPLIT_FORMAT

#else  // ------------------------------------------------------------------ the dispatcher

namespace {

const KvFamily* g_families[kv::MAX_FAMILIES] = {};  // registered by kernels/__init__.py
const KvFamily* g_table = nullptr;  // the family in use

bool supported(int isa) {
  if (isa == kv::ISA_PORTABLE) return true;
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == kv::ISA_AVX2) return avx2;
  if (isa == kv::ISA_AVX512) {
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  }
#endif
  return isa >= kv::NUM_ISAS && isa < kv::MAX_FAMILIES;  // emulated: plain C++
}

inline int64_t check_sizes(const QW& w) {
  int64_t rows = 0;
  for (int i = 0; i < w.nparts; ++i) rows += w.parts[i].rows;
  return rows;
}

}  // namespace

extern "C" {

// 1 when this CPU can run family `isa` (0 portable, 1 AVX2, 2 AVX-512 VNNI; 3.. emulated).
int kv_isa_supported(int isa) { return supported(isa) ? 1 : 0; }

// The best ISA family this CPU has at or below `isa` (the one kv_set_isa would want).
int kv_best_isa(int isa) {
  int chosen = isa >= kv::NUM_ISAS ? kv::NUM_ISAS - 1 : isa < 0 ? 0 : isa;
  while (chosen > kv::ISA_PORTABLE && !supported(chosen)) --chosen;
  return chosen;
}

// Family `isa`'s entry points (from its library's kv_family); 0, or -1 for a bad code.
int kv_register_family(int isa, const KvFamily* family) {
  if (isa < 0 || isa >= kv::MAX_FAMILIES || !family) return -1;
  g_families[isa] = family;
  return 0;
}

// Use family `isa` from now on: returns it, or -1 when it is not registered or the CPU cannot
// run it (the family in use stays).
int kv_set_isa(int isa) {
  if (isa < 0 || isa >= kv::MAX_FAMILIES || !g_families[isa] || !supported(isa)) return -1;
  g_table = g_families[isa];
  return isa;
}

int kv_omp_max_threads(void) { return omp_get_max_threads(); }

// Reads `bytes` (a multiple of 64) from p with `nthreads` threads, each a contiguous slice, and
// returns a checksum (so the reads cannot be optimized away): the read bandwidth a weight
// stream can reach, measured the way the kernels read (bench_kernels divides by the time).
uint64_t kv_stream_read(const void* p, int64_t bytes, int nthreads) {
  const uint64_t* w = static_cast<const uint64_t*>(p);
  const int64_t n = bytes / 8;
  uint64_t sum = 0;
#pragma omp parallel for num_threads(nthreads) schedule(static) reduction(^ : sum)
  for (int64_t i = 0; i < n; i += 8) {
    sum ^= (w[i] + w[i + 1]) ^ (w[i + 2] + w[i + 3]) ^ (w[i + 4] + w[i + 5]) ^ (w[i + 6] + w[i + 7]);
  }
  return sum;
}

// Rows of the weight: -1 when its parts do not add up to n (a caller's bug).
int64_t kv_weight_rows(const QW* w) { return check_sizes(*w) == w->n ? w->n : -1; }

// out[M, ldo] (epilogue) x[M, ldx] @ W[N, K].T, activations int8 or with a residual byte
// (residual != 0; see qmatmul.h):
//   EPI_NONE:     out = x W^T + bias
//   EPI_ADD:      out = res + x W^T + bias                (res may alias out)
//   EPI_SILU_MUL: W holds 2 * Nout rows, gate then up:
//                 out[:, n] = silu(x Wg[n]^T + bg) * (x Wu[n]^T + bu), n < Nout = N / 2
//   EPI_GELU_MUL: the same with GELU (tanh approximation) for silu (Gemma's GeGLU)
void kv_qgemm(const QW* w, const float* x, int M, int ldx, float* out, int ldo, const float* bias, const float* res,
              int ldr, int epilogue, int residual, int nthreads) {
  g_table->qgemm(*w, x, M, ldx, out, ldo, bias, res, ldr, epilogue, residual, nthreads);
}

// Rows of W as fp32: out[r, :K] = W[ids[r]] (ids == NULL: rows row0 .. row0 + nrows - 1).
void kv_dequant(const QW* w, const int64_t* ids, int64_t row0, int nrows, float* out, int ldo, int nthreads) {
  g_table->dequant(*w, ids, row0, nrows, out, ldo, nthreads);
}

// Every layer of a step; see "the fused layer stack" above.
void kv_step_layers(const StepLayer* layers, int num_layers, const StepArgs* step) {
  g_table->step_layers(layers, num_layers, step);
}

}  // extern "C"

#endif  // KV_VARIANT
