// Hopper grouped-GEMM core (sm_90a), the pieces of a tile task: configuration, shared
// memory, task decoding, the producer's TMA loads, the consumers' WGMMA mainloop and the
// fused epilogues. grouped_gemm.cuh assembles them into the standalone persistent kernel;
// the megakernel (csrc/megakernel/) runs fc1 and fc2 tasks of the same shape in one launch.
//
//   CTA = 3 warpgroups: WG0 is the producer (one thread issues TMA loads into a
//   kStages-deep shared-memory ring guarded by full/empty mbarriers), WG1 and WG2 are
//   consumers (each runs 64 x BN WGMMAs on its half of the 128-row tile, then the
//   epilogue straight from the accumulators). setmaxnreg moves registers from the
//   producer to the consumers.
//
//   Tile tasks come in a fixed order; CTA b takes tasks b, b + grid, ... Each output
//   tile has exactly one owner and a fixed K order (no split-K), so the result is
//   bitwise independent of the grid size and the task order.
//
// Two groupings:
//   kRows       D[rows of expert e] = A[rows of e] @ B_e   (fc1, fc2, dgrads). The row
//               table pads every expert segment to 128 rows, so an M tile never straddles
//               two experts; tiles past the device-side row count are skipped.
//   kTokensAsK  D_e = A[rows of e]^T @ B[rows of e]        (weight gradients). Tokens are
//               the K dimension, walked in row-table order; an expert with no rows gets
//               zeros.
//
// Epilogues: kStore (D = acc), kSwiGLU (B tile = gate rows + matching up rows, writes
// act = silu(gate) * up and optionally h = [gate, up] in bf16), kSwiGLUBwd (acc = d_act;
// reads h, writes d_h = [d_gate, d_up]). kGlu selects the general variants: the two GLU
// epilogues compute the general GLU of the spec (activations.py) instead of SwiGLU: act =
// g' sigmoid(alpha g') (u' + offset), g' = min(g, c), u' = clamp(u, -c, c) (GPT-OSS: alpha
// 1.702, c 7, offset 1; SwiGLU: 1, inf, 0), its parameters in GemmParams; kStore (rows
// grouping) and kSwiGLU add a per-expert bf16 column bias to the accumulators when
// GemmParams::col_bias is set (the experts' fc2 / fc1 biases). Compile-time variants, so
// that the plain kernels keep their code: the SwiGLU backward's epilogue is bound by
// instruction issue (a runtime branch there doubled its code, perf-notes core v5), and the
// untaken bias branches measured ~2 % on qwen3's forward (perf-notes, GLU epilogues; gone
// once they moved here, 55d1b22).
// Non-gated experts (fc1 is [I, H]: squared-ReLU, GeLU, ...): kAct (act = f(acc + bias),
// optionally h = acc + bias) and kActBwd (acc = d_act; reads h [rows, N]; d_h = w acc f'(h)
// into the output, with the routed dgrad's <acc, act> and w * act as kSwiGLUBwd), the
// function f a compile-time ActFn (GemmConfig's kAct): a runtime switch per value inlined
// every function into the unrolled epilogue (measured 0.33 of peak at qwen3-30b-a3b-relu2's
// forward, perf-notes).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>

#include <type_traits>

namespace megatron_mok::gemm {

using namespace cute;
using bf16 = cute::bfloat16_t;

enum class Grouping { kRows, kTokensAsK };

// GemmConfig::kGather bits: which weight-gradient operands the producer gathers.
constexpr int kGatherA = 1, kGatherB = 2;
enum class Epi { kStore, kSwiGLU, kSwiGLUBwd, kAct, kActBwd };

// The non-gated activations of kAct / kActBwd; the numbers are the ops' act_fn argument
// (megatron_mok.activations.KERNEL_ACT_FNS). kSigmoidGated: x sigmoid(alpha x) (silu:
// alpha 1, quick_gelu: 1.702).
enum ActFn : int { kRelu = 0, kSquaredRelu = 1, kGelu = 2, kGeluTanh = 3, kSigmoidGated = 4 };

// Shared memory of a CTA: the operand ring, the epilogue staging buffers
// ([warpgroup][buffer]), the ring's barriers and the task queue. It depends only on the
// tile shapes, so configurations that differ only in their epilogue (fc1 + SwiGLU and
// fc2 in the megakernel) share one layout.
template <int kElemsA, int kElemsB, class EpiT, int kEpiElems, int Stages>
struct TileStorage {
  alignas(1024) cute::bfloat16_t a[kElemsA];
  alignas(1024) cute::bfloat16_t b[kElemsB];
  alignas(1024) EpiT epi[kEpiElems];
  alignas(8) uint64_t full[Stages];
  alignas(8) uint64_t empty[Stages];
  alignas(8) uint64_t task_full[2];   // task queue: task ids, producer -> consumers
  alignas(8) uint64_t task_empty[2];
  alignas(8) uint64_t mma_turn[2];    // ping-pong: warpgroup w may start its next mainloop
  int task_id[2];
  int producer_task;  // megakernel: a task id broadcast to the whole producer warpgroup
  int gather_token[128];  // megakernel direct mode: source token of each row of the task
};

// kCluster = 2: CTA pairs in a cluster compute neighbouring row tiles of the same N tile and,
// when both rows belong to one expert, multicast the B tile (each CTA loads half of it for
// both), cutting L2->SM traffic by a third. Experimental (MOK_GEMM_CLUSTER=2); default 1.
template <bool kAKMajor, bool kBKMajor, Grouping kGroup, Epi kEpi, class OutT, int kCluster_ = 1,
          int kBN = 256, int kStages = 4, bool kGlu_ = false, int kAct_ = 0,
          int kGather_ = 0>
struct GemmConfig {
  static constexpr int BM = 128, BN = kBN, BK = 64, Stages = kStages, kCluster = kCluster_;
  static constexpr bool kGlu = kGlu_;  // the general variants: GLU parameters, biases
  static constexpr int kAct = kAct_;   // kAct / kActBwd: the ActFn
  // kGather (weight gradients at EP = 1), bits kGatherA / kGatherB: the producer warpgroup
  // gathers that operand's token rows itself (gather_produce_tasks), one 1 x 64 TMA box per
  // row piece, instead of one box over materialised rows.
  static constexpr int kGather = kGather_;
  static_assert(kGather == 0 || (!kAKMajor && !kBKMajor && kGroup == Grouping::kTokensAsK &&
                                 kCluster_ == 1 && kBN % 64 == 0),
                "gathered rows: the MN-major operands of the weight gradients, clusters of one CTA");
  static_assert(kCluster == 1 || kCluster == 2, "clusters of 1 or 2 CTAs");
  static constexpr Grouping group = kGroup;
  static constexpr Epi epi = kEpi;
  static constexpr int kSplit = kEpi == Epi::kSwiGLU ? 2 : 1;  // B boxes per tile
  static constexpr int kThreads = 384;
  using Out = OutT;

  static constexpr GMMA::Major MajorA = kAKMajor ? GMMA::Major::K : GMMA::Major::MN;
  static constexpr GMMA::Major MajorB = kBKMajor ? GMMA::Major::K : GMMA::Major::MN;
  using AtomA = std::conditional_t<kAKMajor, GMMA::Layout_K_SW128_Atom<bf16>,
                                   GMMA::Layout_MN_SW128_Atom<bf16>>;
  using AtomB = std::conditional_t<kBKMajor, GMMA::Layout_K_SW128_Atom<bf16>,
                                   GMMA::Layout_MN_SW128_Atom<bf16>>;
  // MN-major operands tile K before MN, so that one TMA box (64 MN x 64 K, 128B swizzle)
  // lands as a contiguous 8 KB block instead of 1 KB atoms.
  using StepA = std::conditional_t<kAKMajor, Step<_1, _2, _3>, Step<_2, _1, _3>>;
  using StepB = std::conditional_t<kBKMajor, Step<_1, _2, _3>, Step<_2, _1, _3>>;
  using SmemLayoutA =
      decltype(tile_to_shape(AtomA{}, Shape<Int<BM>, Int<BK>, Int<Stages>>{}, StepA{}));
  using SmemLayoutB =
      decltype(tile_to_shape(AtomB{}, Shape<Int<BN>, Int<BK>, Int<Stages>>{}, StepB{}));
  // The same B memory as kSplit boxes per stage (gate rows, then up rows): box q = s*kSplit+h.
  using SmemLayoutBBox = decltype(tile_to_shape(
      AtomB{}, Shape<Int<BN / kSplit>, Int<BK>, Int<Stages * kSplit>>{}, StepB{}));
  static_assert(kSplit == 1 || kBKMajor, "split B boxes need a K-major B");

  using MmaOp = decltype(GMMA::ss_op_selector<bf16, bf16, float, Shape<_64, Int<BN>, Int<BK>>,
                                              MajorA, MajorB>());
  using TiledMma = decltype(make_tiled_mma(MmaOp{}, Layout<Shape<_2, _1, _1>>{}));

  using StrideA = std::conditional_t<kAKMajor, Stride<int64_t, _1>, Stride<_1, int64_t>>;
  using StrideB = std::conditional_t<kBKMajor, Stride<int64_t, _1, int64_t>,
                                     Stride<_1, int64_t, int64_t>>;

  static constexpr int kTxBytes = (BM * BK + BN * BK) * int(sizeof(bf16));

  // Epilogue staging: a consumer warpgroup writes its 64 x BN accumulator slice in chunks of
  // 64 rows x 128 bytes (one 128B-swizzled TMA box) through two buffers of its own; a chunk's
  // TMA store drains while the next chunk is written and, for the last ones, while the next
  // tile's mainloop runs.
  static constexpr int kChunkCols = 128 / int(sizeof(OutT));
  using EpiT = std::conditional_t<std::is_same_v<OutT, float>, float, bf16>;  // CuTe's type
  using EpiLayout = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<EpiT>{},
                                           Shape<_64, Int<kChunkCols>>{}));
  static constexpr int kChunkElems = 64 * kChunkCols;

  // kSwiGLUBwd's h through the ring (HFromRing): one 64-column chunk of the tile's gate and
  // up (BM x BK each, as an A tile) per stage, gate in the stage's A space, up in the first
  // BM x BK of its B space.
  using SmemLayoutH = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16>{},
                                             Shape<Int<BM>, Int<BK>>{}));
  // kActBwd: h has one part (the non-gated pre-activations), the gate's place.
  static constexpr int kHParts = kEpi == Epi::kActBwd ? 1 : 2;
  static constexpr int kHTxBytes = kHParts * BM * BK * int(sizeof(bf16));

  using SharedStorage = TileStorage<cosize_v<SmemLayoutA>, cosize_v<SmemLayoutB>, EpiT,
                                    2 * 2 * kChunkElems, Stages>;
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
};

struct GemmParams {
  const int* offsets;     // [num_experts + 1] padded segment starts (row table)
  const int* num_rows;    // [1] rows in use (device); nullptr: all
  int num_experts;
  int rows_cap;           // rows of the row table (capacity)
  int M, N, K;            // kRows: M unused (rows), N = output columns of B (I for SwiGLU)
  int m_tiles, n_tiles, num_tasks;
  int* task_counter;      // zeroed [1]: tasks are taken from it in order; nullptr: static
                          // striding (CTA b takes b, b + grid, ...). Clusters use static.
  bool store_h;           // kSwiGLU: also store the pre-activations h (through tma_h)
  const __nv_bfloat16* h_in;  // kSwiGLUBwd: [rows, 2N]
  // kSwiGLUBwd with the router weights applied in the epilogue (all three, or none: A is
  // then already scaled): A holds unscaled dy rows, row_scale[r] is row r's router weight;
  // d_act = w * acc, dots_part[r * n_tiles + n] = <acc, act> over column tile n (act =
  // SwiGLU(h) recomputed), act_scaled[r, c] = w * act (dW2's operand).
  const float* row_scale;
  float* dots_part;
  __nv_bfloat16* act_scaled;
  bool reverse_planes;    // kTokensAsK: expert e's output is plane num_experts - 1 - e
                          // (Megatron's grad buffer holds the experts' main_grads backwards)
  // Cfg::kGlu: act = g' sigmoid(glu_alpha g') (u' + glu_offset), g' = min(g, glu_limit),
  // u' = clamp(u, -glu_limit, glu_limit) (glu_limit = inf: no clamp).
  float glu_alpha, glu_limit, glu_offset;
  // Cfg::kGlu, kStore (rows) / kSwiGLU: bf16 bias added to the fp32 accumulators before
  // anything else, expert e's at col_bias + e * bias_stride (kSwiGLU: gate columns, then up
  // at + N); nullptr: none.
  const __nv_bfloat16* col_bias;
  int64_t bias_stride;
  // kAct / kActBwd with kSigmoidGated: x sigmoid(act_alpha x); kActBwd's h_in is [rows, N].
  float act_alpha;
  // kSwiGLUBwd of a config with kQuantDh (the FP8 dgrad): d_h also quantised 1 x 128 along
  // its 2N columns from its bf16 rounding (the bits of quantising the stored d_h): E4M3
  // dh_q [rows, 2N] and scales dh_scale_t[g * dh_scale_ld + r], groups g < N / 128 the gate
  // columns, then the up columns. nullptr: not quantised.
  uint8_t* dh_q;
  float* dh_scale_t;
  int64_t dh_scale_ld;
  // kSwiGLU of a config with kQuantAct (the FP8 fc1): act quantised 1 x 128 along its N
  // columns from its bf16 rounding instead of stored in bf16 (fc2's A, the bits of
  // quantising the bf16 act): E4M3 act_q [rows, N], scales act_scale_t[g * act_scale_ld + r].
  uint8_t* act_q;
  float* act_scale_t;
  int64_t act_scale_ld;
  // Cfg::kGather: a gathered operand's row j (the row table's order) is row gather_token[j]
  // of the tensor behind its row map (a_row_map, b_row_map: 1 x 64 boxes, 128B swizzle), or
  // the out-of-bounds row gather_oob_row (zero-filled) where gather_rank[j] < 0 (padding):
  // x's or dy's rows without materialising them.
  const int* gather_rank;
  const int* gather_token;
  int gather_oob_row;
  cute::TmaDescriptor a_row_map;
  cute::TmaDescriptor b_row_map;
};

// Cfg::kQuantDh where a config defines it (the FP8 configs), else false.
template <class Cfg, class = void>
struct QuantizesDh : std::false_type {};
template <class Cfg>
struct QuantizesDh<Cfg, std::void_t<decltype(Cfg::kQuantDh)>>
    : std::bool_constant<Cfg::kQuantDh> {};

// Cfg::kQuantAct where a config defines it (the FP8 fc1 configs), else false.
template <class Cfg, class = void>
struct QuantizesAct : std::false_type {};
template <class Cfg>
struct QuantizesAct<Cfg, std::void_t<decltype(Cfg::kQuantAct)>>
    : std::bool_constant<Cfg::kQuantAct> {};

__device__ __forceinline__ int expert_of_row(const int* offsets, int num_experts, int row) {
  // Last e with offsets[e] <= row; empty experts (equal offsets) are skipped over.
  int lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(offsets + mid) <= row) lo = mid; else hi = mid - 1;
  }
  return lo;
}

struct Task {
  int m_tile, n_tile, expert, k_begin, k_end;  // k in BK tiles
  bool skip;     // nothing to do (every CTA of the cluster agrees)
  bool store;    // this CTA's rows exist (a cluster's second row tile may not)
  bool share_b;  // the cluster's row tiles use one expert's B: multicast it
};

// Task t -> (m tile, column group g) of an m_tiles x n_groups grid, walked in bands of kBand
// groups, row tiles fastest inside a band. The ~132 CTAs running at once then share a few B
// column tiles (kept in L2) over many row tiles, instead of all of B over one or two row
// tiles: per k step they read ~16 A and 8 B tiles instead of ~8 A and 16 B (A tiles are
// half the size), and B streams from DRAM once per band, not once per wave.
__device__ __forceinline__ void band_order(int t, int m_tiles, int n_groups, int& m, int& g) {
  constexpr int kBand = 8;
  const int band = t / (m_tiles * kBand);
  const int width = min(kBand, n_groups - band * kBand);
  const int local = t - band * m_tiles * kBand;
  m = local / width;
  g = band * kBand + local % width;
}

// Task t of a cluster covers kCluster neighbouring row tiles of one N tile; CTA `rank` takes
// the rank-th. Every CTA of a cluster walks the same stages in lockstep (the ring's empty
// barriers count both CTAs' consumers), so a row tile past the rows still runs its mainloop
// (on zeros or stale rows) and only skips the store.
template <class Cfg>
__device__ __forceinline__ Task decode_task(const GemmParams& p, int t, int rank) {
  constexpr int C = Cfg::kCluster, BM = Cfg::BM;
  const int m_groups = (p.m_tiles + C - 1) / C;
  Task task;
  int mg;
  if constexpr (Cfg::group == Grouping::kRows) {
    band_order(t, m_groups, p.n_tiles, mg, task.n_tile);
    task.m_tile = mg * C + rank;
    const int rows = p.num_rows ? min(__ldg(p.num_rows), p.rows_cap) : p.rows_cap;
    const int lead_m0 = mg * C * BM;
    task.skip = lead_m0 >= rows;
    task.store = !task.skip && task.m_tile * BM < rows;
    const int lead_e = task.skip ? 0 : expert_of_row(p.offsets, p.num_experts, lead_m0);
    int last_e = lead_e;  // C = 2: the second tile's expert (the lead's when it has no rows)
    if (C == 2 && lead_m0 + BM < rows) last_e = expert_of_row(p.offsets, p.num_experts, lead_m0 + BM);
    task.share_b = lead_e == last_e;
    task.expert = rank == 0 ? lead_e : last_e;
    task.k_begin = 0;
    task.k_end = (p.K + Cfg::BK - 1) / Cfg::BK;
  } else {
    const int per_expert = m_groups * p.n_tiles;
    task.expert = t / per_expert;
    band_order(t % per_expert, m_groups, p.n_tiles, mg, task.n_tile);
    task.m_tile = mg * C + rank;
    const int lo = min(__ldg(p.offsets + task.expert), p.rows_cap);
    const int hi = min(__ldg(p.offsets + task.expert + 1), p.rows_cap);
    task.k_begin = lo / Cfg::BK;  // segments start on 128-row boundaries
    task.k_end = (hi + Cfg::BK - 1) / Cfg::BK;
    task.skip = false;
    task.store = task.m_tile < p.m_tiles;
    task.share_b = true;
  }
  return task;
}

__device__ __forceinline__ float silu_f(float g) { return g / (1.f + __expf(-g)); }
// The SwiGLU backward's sigmoid: the approximate reciprocal (MUFU.RCP and a multiply)
// instead of the IEEE division's ~10 instructions and slow path; that epilogue is bound by
// instruction issue (perf-notes, core v5). 1 / inf = 0 for very negative g, as it should.
__device__ __forceinline__ float sigmoid_fast(float g) { return __fdividef(1.f, 1.f + __expf(-g)); }

// min(v, hi) and clamp(v, -hi, hi) that keep a NaN, as torch.clamp does (fminf / fmaxf
// would return the bound and hide a NaN from the loss and the gradient checks).
__device__ __forceinline__ float clamp_max_nan(float v, float hi) { return v > hi ? hi : v; }
__device__ __forceinline__ float clamp_abs_nan(float v, float hi) {
  return v > hi ? hi : (v < -hi ? -hi : v);
}

// The forward activation of one (gate, up) pair: SwiGLU, or with Cfg::kGlu the general GLU.
template <class Cfg>
__device__ __forceinline__ float glu_forward(const GemmParams& p, float g, float u) {
  if constexpr (!Cfg::kGlu) {
    return silu_f(g) * u;
  } else {
    const float gc = clamp_max_nan(g, p.glu_limit), uc = clamp_abs_nan(u, p.glu_limit);
    return gc / (1.f + __expf(-p.glu_alpha * gc)) * (uc + p.glu_offset);
  }
}

// The general GLU's backward of one value: d_act = w * acc -> d_gate, d_up into acc; returns
// act (recomputed: the routed dgrad's <acc, act> and w * act). Gradients pass where the
// clamp is the identity, bounds included (torch.clamp's backward).
__device__ __forceinline__ float glu_general_bwd_value(const GemmParams& p, float& acc,
                                                       float& d_gate, float w, float g, float u) {
  const float lim = p.glu_limit, alpha = p.glu_alpha;
  const float gc = clamp_max_nan(g, lim), uc = clamp_abs_nan(u, lim), lin = uc + p.glu_offset;
  const float sig = sigmoid_fast(alpha * gc);
  const float gate_act = gc * sig;
  const float d_act = w * acc;
  d_gate = g <= lim ? d_act * lin * sig * (1.f + alpha * gc * (1.f - sig)) : 0.f;
  acc = (u >= -lim && u <= lim) ? d_act * gate_act : 0.f;
  return gate_act * lin;
}

// kAct / kActBwd: f(x) and f'(x) of the non-gated activations, in fp32 as the spec's
// (activations.py; torch's erf-based GeLU, the tanh form for gelu_tanh). A NaN passes
// through relu and squared-ReLU as through torch; their f' is 0 there (torch's relu
// gradient; squared-ReLU's autograd would give NaN, but the forward is already NaN).
template <int kFn>
__device__ __forceinline__ float act_value(const GemmParams& p, float x) {
  switch (kFn) {
    case kRelu: return x > 0.f || x != x ? x : 0.f;
    case kSquaredRelu: { const float r = x > 0.f || x != x ? x : 0.f; return r * r; }
    case kGelu: return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
    case kGeluTanh: {
      const float u = 0.79788456080286536f * (x + 0.044715f * x * x * x);
      return 0.5f * x * (1.f + tanhf(u));
    }
    default: return x / (1.f + __expf(-p.act_alpha * x));
  }
}

template <int kFn>
__device__ __forceinline__ float act_grad(const GemmParams& p, float x) {
  switch (kFn) {
    case kRelu: return x > 0.f ? 1.f : 0.f;
    case kSquaredRelu: return x > 0.f ? 2.f * x : 0.f;
    case kGelu:
      return 0.5f * (1.f + erff(x * 0.70710678118654752f)) +
             x * 0.39894228040143268f * __expf(-0.5f * x * x);
    case kGeluTanh: {
      const float x2 = x * x, t = tanhf(0.79788456080286536f * (x + 0.044715f * x2 * x));
      return 0.5f * (1.f + t) + 0.5f * x * (1.f - t * t) * 0.79788456080286536f *
                                    (1.f + 3.f * 0.044715f * x2);
    }
    default: {
      const float s = sigmoid_fast(p.act_alpha * x);
      return s * (1.f + p.act_alpha * x * (1.f - s));
    }
  }
}

// Adds bias[c0 + column of accumulator i] (bf16) to accumulators [i0, i0 + kCount) of a
// thread (column of i: col_t + 8 * ((i - i0) / 4) + i % 2, see EpilogueState), columns past
// n untouched (their values are clipped by the stores).
template <int kCount, class Acc>
__device__ __forceinline__ void add_column_bias(Acc& accum, int i0, const __nv_bfloat16* bias,
                                                int c0, int n, int col_t) {
  CUTE_UNROLL
  for (int b = 0; b < kCount / 4; ++b) {
    const int c = c0 + col_t + 8 * b;
    if (c < n) {
      const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(bias + c));
      CUTE_UNROLL
      for (int half = 0; half < 2; ++half) {
        accum(i0 + 4 * b + 2 * half) += v.x;
        accum(i0 + 4 * b + 2 * half + 1) += v.y;
      }
    }
  }
}

// CUTLASS's mbarrier wait/arrive asm has no "memory" clobber: without this the compiler
// could move the task queue's plain smem access across them.
__device__ __forceinline__ void compiler_fence() { asm volatile("" ::: "memory"); }

// This thread's generic global writes -> later reads of them by the async proxy (TMA).
__device__ __forceinline__ void fence_generic_to_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

__device__ __forceinline__ void warpgroup_bar_sync(int id) {
  asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory");
}

// Barriers of the operand ring and the task queue; one thread, before the CTA (cluster) syncs.
// full_arrivals: arrivals that complete a stage besides its TMA bytes (1: the producer
// thread; the megakernel's gathering producer warpgroup: all 128 of its threads).
// stage_consumers (C = 1): the threads that read a stage, 256 (both consumer warpgroups
// on one tile) or 128 (ping-pong: one warpgroup per tile).
template <class Cfg, class Storage>
__device__ __forceinline__ void init_tile_barriers(Storage& smem, int full_arrivals = 1,
                                                   int stage_consumers = 256) {
  constexpr int C = Cfg::kCluster;
  for (int s = 0; s < Cfg::Stages; ++s) {
    cutlass::arch::ClusterTransactionBarrier::init(&smem.full[s], full_arrivals);
    // C = 1: every consumer thread arrives. C = 2: one thread per consumer warpgroup
    // per CTA of the cluster (a stage is refilled by both CTAs' multicast).
    cutlass::arch::ClusterBarrier::init(&smem.empty[s], C == 1 ? stage_consumers : 2 * C);
  }
  for (int s = 0; s < 2; ++s) {
    cutlass::arch::ClusterBarrier::init(&smem.task_full[s], 1);
    cutlass::arch::ClusterBarrier::init(&smem.task_empty[s], 256);
  }
  cutlass::arch::fence_barrier_init();
}

// Position in the operand ring; the producer and the consumers walk it in the same order.
struct RingPos {
  int stage = 0, phase = 0;
  template <int kStages>
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) { stage = 0; phase ^= 1; }
  }
};

// Task ids from the producer thread to the consumer warpgroups (a task drawn from a global
// counter must run on this CTA's consumers): a 2-slot queue in shared memory whose mbarrier
// arrive/wait order each slot's write and read.
template <class Storage>
struct TaskQueue {
  Storage& smem;
  int slot = 0, phase = 0;

  __device__ __forceinline__ void push(int task) {
    cutlass::arch::ClusterBarrier::wait(&smem.task_empty[slot], phase ^ 1);
    compiler_fence();
    smem.task_id[slot] = task;
    compiler_fence();
    cutlass::arch::ClusterBarrier::arrive(&smem.task_full[slot]);  // release: the id is visible
    advance();
  }
  __device__ __forceinline__ int pop() {
    cutlass::arch::ClusterBarrier::wait(&smem.task_full[slot], phase);
    compiler_fence();
    const int task = smem.task_id[slot];
    compiler_fence();
    cutlass::arch::ClusterBarrier::arrive(&smem.task_empty[slot]);
    advance();
    return task;
  }
  __device__ __forceinline__ void advance() {
    if (++slot == 2) { slot = 0; phase ^= 1; }
  }
};

// Global extents of the TMA load operands: A (rows, K), B (N, K, Q) boxes.
struct OperandShapes {
  int a_rows, a_cols, b_n, b_k, b_q;
};

// Producer: the TMA loads of one task's K range into the ring (one thread).
template <class Cfg, class Storage, class TmaA, class TmaB, class TmaBmc>
__device__ __forceinline__ void load_task(Storage& smem, const TmaA& tma_a, const TmaB& tma_b,
                                          const TmaBmc& tma_b_mc, const OperandShapes& shapes,
                                          const Task& task, int rank, RingPos& ring) {
  using namespace cute;
  constexpr int BM = Cfg::BM, BK = Cfg::BK, C = Cfg::kCluster, kSplit = Cfg::kSplit;
  constexpr int BNh = Cfg::BN / kSplit;
  using FullBar = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBar = cutlass::arch::ClusterBarrier;
  Tensor sA = make_tensor(make_smem_ptr(smem.a), typename Cfg::SmemLayoutA{});
  Tensor sBbox = make_tensor(make_smem_ptr(smem.b), typename Cfg::SmemLayoutBBox{});
  Tensor mA = tma_a.get_tma_tensor(make_shape(shapes.a_rows, shapes.a_cols));   // (M, K)
  Tensor mB = tma_b.get_tma_tensor(make_shape(shapes.b_n, shapes.b_k, shapes.b_q));  // (N, K, Q)
  Tensor gA = local_tile(mA, Shape<Int<BM>, Int<BK>>{}, make_coord(task.m_tile, _));
  auto [tAgA, tAsA] = tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA),
                                    group_modes<0, 2>(gA));
  for (int k = task.k_begin; k < task.k_end; ++k) {
    EmptyBar::wait(&smem.empty[ring.stage], ring.phase ^ 1);
    FullBar::arrive_and_expect_tx(&smem.full[ring.stage], Cfg::kTxBytes);
    copy(tma_a.with(smem.full[ring.stage]), tAgA(_, k), tAsA(_, ring.stage));
    CUTE_UNROLL
    for (int h = 0; h < kSplit; ++h) {
      const int q = Cfg::group == Grouping::kRows ? task.expert * kSplit + h : 0;
      Tensor gB = local_tile(mB(_, _, q), Shape<Int<BNh>, Int<BK>>{}, make_coord(task.n_tile, _));
      if (C == 2 && task.share_b) {  // this CTA's half of the box, to both CTAs
        auto [tBgB, tBsB] = tma_partition(tma_b_mc, rank, Layout<Int<C>>{},
                                          group_modes<0, 2>(sBbox), group_modes<0, 2>(gB));
        copy(tma_b_mc.with(smem.full[ring.stage], uint16_t((1 << C) - 1)), tBgB(_, k),
             tBsB(_, ring.stage * kSplit + h));
      } else {
        auto [tBgB, tBsB] = tma_partition(tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sBbox),
                                          group_modes<0, 2>(gB));
        copy(tma_b.with(smem.full[ring.stage]), tBgB(_, k), tBsB(_, ring.stage * kSplit + h));
      }
    }
    ring.advance<Cfg::Stages>();
  }
}

// kSwiGLUBwd: the 64-column chunks of a tile's epilogue that hold columns below N (the
// producer loads and the consumers read exactly these).
template <class Cfg>
__device__ __forceinline__ int h_chunks(const GemmParams& p, const Task& task) {
  constexpr int CW = Cfg::kChunkCols;
  const int left = p.N - task.n_tile * Cfg::BN;
  return max(0, min(Cfg::BN / CW, (left + CW - 1) / CW));
}

// Producer, kSwiGLUBwd with h through the ring: after a task's K stages, one stage per
// epilogue chunk holding that chunk's gate and up (BM rows x BK columns each) of h, viewed
// as (rows, N, 2) so that columns past N are zero-filled like the global path's zeros. The
// epilogue then reads h from shared memory: its loads are in flight during the last K
// stages instead of one L2 round trip per pair after the mainloop.
template <class Cfg, class Storage, class TmaH>
__device__ __forceinline__ void load_h_chunks(Storage& smem, const TmaH& tma_h_in,
                                              const GemmParams& p, const Task& task,
                                              RingPos& ring) {
  using namespace cute;
  constexpr int BM = Cfg::BM, BK = Cfg::BK, BN = Cfg::BN;
  static_assert(Cfg::kChunkCols == BK && Cfg::kCluster == 1 && BN >= BM,
                "h chunks are BK wide, single-CTA, and fit the stage's B space");
  using FullBar = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBar = cutlass::arch::ClusterBarrier;
  Tensor mH = tma_h_in.get_tma_tensor(make_shape(p.rows_cap, p.N, int(Cfg::kHParts)));
  const int nq = h_chunks<Cfg>(p, task);
  for (int q = 0; q < nq; ++q) {
    EmptyBar::wait(&smem.empty[ring.stage], ring.phase ^ 1);
    FullBar::arrive_and_expect_tx(&smem.full[ring.stage], Cfg::kHTxBytes);
    CUTE_UNROLL
    for (int plane = 0; plane < Cfg::kHParts; ++plane) {
      bf16* dst = plane == 0 ? smem.a + ring.stage * BM * BK : smem.b + ring.stage * BN * BK;
      Tensor sH = make_tensor(make_smem_ptr(dst), typename Cfg::SmemLayoutH{});
      Tensor gH = local_tile(mH(_, _, plane), Shape<Int<BM>, Int<BK>>{},
                             make_coord(task.m_tile, task.n_tile * (BN / BK) + q));
      auto [tHg, tHs] = tma_partition(tma_h_in, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sH),
                                      group_modes<0, 2>(gH));
      copy(tma_h_in.with(smem.full[ring.stage]), tHg, tHs);
    }
    ring.advance<Cfg::Stages>();
  }
}

// The producer thread of the standalone kernels (cooperative and ping-pong): takes tasks
// (static striding from `first` by `stride`, or the global counter, each id published to
// the consumers through the queue; an id past the last task tells them to stop) and loads
// every task with work into the ring: its K stages, then (kHRing) its h chunks.
template <class Cfg, bool kHRing, class Storage, class TmaA, class TmaB, class TmaBmc,
          class TmaHIn>
__device__ __forceinline__ void produce_tasks(Storage& smem, TaskQueue<Storage>& queue,
                                              const GemmParams& p, bool counter, int first,
                                              int stride, int rank, const TmaA& tma_a,
                                              const TmaB& tma_b, const TmaBmc& tma_b_mc,
                                              const TmaHIn& tma_h_in,
                                              const OperandShapes& shapes) {
  auto next_task = [&](int t_static) {
    if (!counter) return t_static;
    const int t = atomicAdd(p.task_counter, 1);
    queue.push(t);
    return t;
  };
  RingPos ring;
  for (int t = next_task(first); t < p.num_tasks; t = next_task(t + stride)) {
    const Task task = decode_task<Cfg>(p, t, rank);
    if (task.skip || task.k_begin >= task.k_end) continue;
    load_task<Cfg>(smem, tma_a, tma_b, tma_b_mc, shapes, task, rank, ring);
    // The consumers read these in the task's epilogue: for C = 1 a task loaded here is a
    // task they store (kRows: K > 0, and store = !skip).
    if constexpr (kHRing) load_h_chunks<Cfg>(smem, tma_h_in, p, task, ring);
  }
}

// One K step of a gathered operand (Cfg::kGather): its kRowsMN x BK tile as 1 x 64 row boxes
// (row kr of the K step, 64-column piece c) from row_map into the piece's line of the stage,
// 128 threads sharing the boxes. The MN-major SW128 stage layouts tile K first (GemmConfig):
// piece c of K row kr at byte c * (64 * BK * 2) + (kr / 8) * 1024 + (kr % 8) * 128, and TMA
// applies the swizzle from those address bits, so each line lands as a whole-tile box would
// put it (the forward megakernel's kGatherTma, for an MN-major operand).
template <class Cfg, int kRowsMN>
__device__ __forceinline__ void gather_rows_k_step(const GemmParams& p, const void* row_map,
                                                   uint32_t stage_base, int col0, int k,
                                                   uint32_t full, int ptid) {
  constexpr int BK = Cfg::BK, kBoxes = BK * (kRowsMN / 64);
  static_assert(kRowsMN % 64 == 0 && kBoxes % 128 == 0, "whole row boxes per producer thread");
  CUTE_UNROLL
  for (int box = ptid; box < kBoxes; box += 128) {
    const int kr = box % BK, piece = box / BK;
    const int64_t j = int64_t(k) * BK + kr;  // the row table's row
    const int row = __ldg(p.gather_rank + j) >= 0 ? __ldg(p.gather_token + j) : p.gather_oob_row;
    const uint32_t dst = stage_base + uint32_t(piece * (64 * BK * 2) + (kr / 8) * 1024 +
                                               (kr % 8) * 128);
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];"
        ::"r"(dst), "l"(row_map), "r"(col0 + piece * 64), "r"(row), "r"(full)
        : "memory");
  }
}

// Cfg::kGather, the whole producer warpgroup (ptid = its thread): per K step thread 0
// expects the stage's bytes and loads the operands that are not gathered as load_task does;
// every thread then loads its share of the gathered operands' row boxes
// (gather_rows_k_step) and arrives (thread 0's arrival is its expect). Writes come through
// the async proxy: no fence. Static striding only (every producer thread walks the same
// tasks).
template <class Cfg, class Storage, class TmaA, class TmaB>
__device__ __forceinline__ void gather_produce_tasks(Storage& smem, const GemmParams& p,
                                                     int first, int stride, const TmaA& tma_a,
                                                     const TmaB& tma_b,
                                                     const OperandShapes& shapes, int ptid) {
  using namespace cute;
  using FullBar = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBar = cutlass::arch::ClusterBarrier;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK;
  constexpr bool kA = Cfg::kGather & kGatherA, kB = Cfg::kGather & kGatherB;
  Tensor sA = make_tensor(make_smem_ptr(smem.a), typename Cfg::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem.b), typename Cfg::SmemLayoutBBox{});
  Tensor mA = tma_a.get_tma_tensor(make_shape(shapes.a_rows, shapes.a_cols));   // (M, K)
  Tensor mB = tma_b.get_tma_tensor(make_shape(shapes.b_n, shapes.b_k, shapes.b_q));  // (N, K, 1)
  const uint32_t a_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem.a));
  const uint32_t b_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem.b));
  RingPos ring;
  for (int t = first; t < p.num_tasks; t += stride) {
    const Task task = decode_task<Cfg>(p, t, 0);
    if (task.skip || task.k_begin >= task.k_end) continue;
    Tensor gA = local_tile(mA, Shape<Int<BM>, Int<BK>>{}, make_coord(task.m_tile, _));
    Tensor gB = local_tile(mB(_, _, 0), Shape<Int<BN>, Int<BK>>{}, make_coord(task.n_tile, _));
    auto [tAgA, tAsA] = tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA),
                                      group_modes<0, 2>(gA));
    auto [tBgB, tBsB] = tma_partition(tma_b, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sB),
                                      group_modes<0, 2>(gB));
    for (int k = task.k_begin; k < task.k_end; ++k) {
      EmptyBar::wait(&smem.empty[ring.stage], ring.phase ^ 1);
      const uint32_t full =
          static_cast<uint32_t>(__cvta_generic_to_shared(&smem.full[ring.stage]));
      if (ptid == 0) {
        FullBar::arrive_and_expect_tx(&smem.full[ring.stage], Cfg::kTxBytes);
        if constexpr (!kA) copy(tma_a.with(smem.full[ring.stage]), tAgA(_, k), tAsA(_, ring.stage));
        if constexpr (!kB) copy(tma_b.with(smem.full[ring.stage]), tBgB(_, k), tBsB(_, ring.stage));
      }
      if constexpr (kA) {
        gather_rows_k_step<Cfg, BM>(p, &p.a_row_map, a_base + uint32_t(ring.stage * (BM * BK * 2)),
                                    task.m_tile * BM, k, full, ptid);
      }
      if constexpr (kB) {
        gather_rows_k_step<Cfg, BN>(p, &p.b_row_map, b_base + uint32_t(ring.stage * (BN * BK * 2)),
                                    task.n_tile * BN, k, full, ptid);
      }
      if (ptid != 0) EmptyBar::arrive(&smem.full[ring.stage]);
      ring.advance<Cfg::Stages>();
    }
  }
}

// Consumer warpgroup: the WGMMAs of K tiles [k_begin, k_end) into accum, each stage handed
// back to the producer as soon as the WGMMAs reading it are done. Stages written through
// the generic proxy (cp.async gathers) must be fenced by their writers before the full
// barrier: a fence here would also wait for the previous stage's WGMMAs.
template <class Cfg, class Storage, class Mma, class FragA, class FragB, class Acc>
__device__ __forceinline__ void mma_task(Storage& smem, Mma& tiled_mma, FragA& tCrA, FragB& tCrB,
                                         Acc& accum, int k_begin, int k_end, RingPos& ring,
                                         int wg_thread) {
  using namespace cute;
  constexpr int C = Cfg::kCluster;
  using FullBar = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBar = cutlass::arch::ClusterBarrier;
  // Every thread (C = 1), or one thread of this warpgroup per CTA of the cluster (C = 2; the
  // warpgroup's WGMMAs are complete).
  auto release = [&](int s) {
    if constexpr (C == 1) {
      EmptyBar::arrive(&smem.empty[s]);
    } else {
      EmptyBar::arrive(&smem.empty[s], uint32_t(wg_thread), wg_thread < C);
    }
  };
  tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
  warpgroup_fence_operand(accum);
  int prev = -1;
  for (int k = k_begin; k < k_end; ++k) {
    FullBar::wait(&smem.full[ring.stage], ring.phase);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tCrA); ++kb) {
      cute::gemm(tiled_mma, tCrA(_, _, kb, ring.stage), tCrB(_, _, kb, ring.stage), accum);
      tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_wait<1>();  // the previous stage's WGMMAs are done: hand it back
    if (prev >= 0) release(prev);
    prev = ring.stage;
    ring.advance<Cfg::Stages>();
  }
  warpgroup_wait<0>();
  release(prev);
  warpgroup_fence_operand(accum);
}

// Byte offset of (row, byte column) in a tile of 128-byte rows under the 128-byte swizzle
// (TMA SWIZZLE_128B, CuTe's Layout_K_SW128_Atom): 16-byte unit c / 16 XOR row % 8. The
// same as CuTe's layouts for bf16 and fp32 (checked on the host for every element).
__device__ __forceinline__ uint32_t sw128_offset(int row, int byte_col) {
  return uint32_t(row * 128 + ((((byte_col >> 4) ^ (row & 7))) << 4) + (byte_col & 15));
}

// Staged epilogue of one consumer warpgroup. In the WGMMA accumulator layout, element i of
// a thread sits at row row_t + 8 * ((i / 2) % 2) and column col_t + 8 * (i / 4) + i % 2 of
// the warpgroup's 64 x BN slice. Chunks of 64 rows x 128 bytes (one 128B-swizzled TMA box)
// go through the warpgroup's two staging buffers; a chunk's TMA store drains while the next
// chunk is written and, for the last ones, while the next tile's mainloop runs. `buf`
// alternates across every chunk the warpgroup stores, whatever the epilogue kind.
struct EpilogueState {
  int wg, wg_thread, row_t, col_t, buf;
};

// Chunk `first_block / (CW / 8)` of the slice: values(i) gives elements i and i + 1 for the
// accumulator index i of the chunk's column blocks; stored at 64-row tile `row_tile`, chunk
// column `col_chunk` of plane `plane` of the view.
// after_stage(sE) runs on every thread of the warpgroup once the chunk is staged (the
// megakernel scatters rows from it); tma_store = false skips the TMA store.
struct NoAfterStage {
  template <class T>
  __device__ void operator()(const T&) const {}
};

template <class Cfg, class Storage, class Tma, class View, class Values,
          class AfterStage = NoAfterStage>
__device__ __forceinline__ void emit_chunk(Storage& smem, EpilogueState& es, const Tma& tma,
                                           const View& mView, int row_tile, int col_chunk,
                                           int plane, int first_block, Values&& values,
                                           AfterStage&& after_stage = {}, bool tma_store = true) {
  using namespace cute;
  using Out = typename Cfg::EpiT;
  constexpr int CW = Cfg::kChunkCols;
  const int buf = es.buf;
  es.buf ^= 1;
  Out* chunk = smem.epi + (es.wg * 2 + buf) * Cfg::kChunkElems;
  // This buffer's previous store has read it: with one bulk group per chunk, all but the
  // newest group. A chunk without a TMA store commits no group, so then drain them all.
  if (es.wg_thread == 0) {
    if (tma_store) {
      tma_store_wait<1>();
    } else {
      tma_store_wait<0>();
    }
  }
  warpgroup_bar_sync(1 + es.wg);
  Tensor sE = make_tensor(make_smem_ptr(chunk), typename Cfg::EpiLayout{});
  // st.shared at 32-bit shared addresses, the layout's swizzle by hand: through the CuTe
  // pointer the compiler emitted generic 64-bit stores with ~6 address instructions each
  // (perf-notes, core v5).
  const uint32_t chunk_base = cast_smem_ptr_to_uint(chunk);
  CUTE_UNROLL
  for (int jb = 0; jb < CW / 8; ++jb) {
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int i = 4 * (first_block + jb) + 2 * half;
      const float2 v = values(i);
      const uint32_t dst = chunk_base + sw128_offset(es.row_t + 8 * half,
                                                     (es.col_t + 8 * jb) * int(sizeof(Out)));
      if constexpr (std::is_same_v<Out, float>) {
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(dst), "f"(v.x), "f"(v.y)
                     : "memory");
      } else {
        const __nv_bfloat162 b = __floats2bfloat162_rn(v.x, v.y);
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(dst),
                     "r"(*reinterpret_cast<const uint32_t*>(&b))
                     : "memory");
      }
    }
  }
  tma_store_fence();  // generic-proxy smem writes -> the TMA (async proxy) reads them
  warpgroup_bar_sync(1 + es.wg);
  after_stage(sE);
  if (tma_store && es.wg_thread == 0) {
    Tensor gO = local_tile(mView(_, _, plane), Shape<_64, Int<CW>>{},
                           make_coord(row_tile, col_chunk));
    auto [tOgO, tOsO] = tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sE),
                                      group_modes<0, 2>(gO));
    copy(tma, tOsO, tOgO);
    tma_store_arrive();
  }
}

// kSwiGLUBwd: the epilogue reads this tile's h (gate and up: 128 rows x BN columns each)
// straight from global memory; ask L2 for it before the mainloop, so that those loads hit
// L2 instead of waiting on DRAM. ctid: the thread's index among the 256 consumer threads.
// kActBwd: h is [rows, N], one part.
template <class Cfg>
__device__ __forceinline__ void prefetch_h(const GemmParams& p, const Task& task, int ctid) {
  constexpr int BM = Cfg::BM, BN = Cfg::BN;
  constexpr int kParts = Cfg::epi == Epi::kActBwd ? 1 : 2;
  constexpr int kLines = BN * 2 / 128;  // 128-byte lines per row and part
  const int n0 = task.n_tile * BN;
#pragma unroll 1
  for (int line = ctid; line < BM * kParts * kLines; line += 256) {
    const int r = line / (kParts * kLines), part = (line / kLines) % kParts;
    const int c = n0 + (line % kLines) * 64;
    if (c < p.N) {
      const __nv_bfloat16* ptr =
          p.h_in + int64_t(task.m_tile * BM + r) * kParts * p.N + part * p.N + c;
      asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr));
    }
  }
}

// Where kSwiGLUBwd's epilogue reads h: load(rl, cl, r, c, g, u) gives the (gate, up) pairs
// at tile row rl / chunk column cl, i.e. global row r / column c (zeros past N); one chunk
// is read between begin_chunk() and end_chunk().
// HFromGlobal: 4-byte loads straight from global memory (MOK_DGRAD_H=global, clusters of 2).
struct HFromGlobal {
  const GemmParams& p;
  __device__ __forceinline__ void begin_chunk() {}
  __device__ __forceinline__ void end_chunk() {}
  __device__ __forceinline__ void load(int, int, int r, int c, float2& g, float2& u) const {
    g = make_float2(0.f, 0.f);
    u = g;
    if (c < p.N) {
      const __nv_bfloat16* h = p.h_in + int64_t(r) * 2 * p.N + c;
      g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(h));
      u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(h + p.N));
    }
  }
};

// kActBwd's h [rows, N] from global memory: load gives the pair at (r, c) as g (u unused).
struct HFromGlobalSingle {
  const GemmParams& p;
  __device__ __forceinline__ void begin_chunk() {}
  __device__ __forceinline__ void end_chunk() {}
  __device__ __forceinline__ void load(int, int, int r, int c, float2& g, float2& u) const {
    g = make_float2(0.f, 0.f);
    u = g;
    if (c < p.N) {
      g = __bfloat1622float2(
          *reinterpret_cast<const __nv_bfloat162*>(p.h_in + int64_t(r) * p.N + c));
    }
  }
};

// HFromRing: the ring stage that the producer filled with the chunk (load_h_chunks), read
// from shared memory (128B-swizzled: a warp's 8 rows x 16 bytes hit 32 distinct banks) and
// handed back once every consumer thread has its values.
template <class Cfg, class Storage>
struct HFromRing {
  Storage& smem;
  RingPos& ring;
  // The h reads are plain loads and CUTLASS's wait / arrive asm has no memory clobber:
  // compiler fences keep the reads after the wait and before the arrive.
  __device__ __forceinline__ void begin_chunk() {
    cutlass::arch::ClusterTransactionBarrier::wait(&smem.full[ring.stage], ring.phase);
    compiler_fence();
  }
  __device__ __forceinline__ void end_chunk() {
    compiler_fence();
    cutlass::arch::ClusterBarrier::arrive(&smem.empty[ring.stage]);
    ring.template advance<Cfg::Stages>();
  }
  // SmemLayoutH by hand (the TMA's 128-byte swizzle: 128-byte rows, 16-byte unit c / 8
  // XOR row % 8; checked equal to CuTe's layout): CuTe's per-access offsets were hoisted out
  // of the tile loop and spilled.
  __device__ __forceinline__ void load(int rl, int cl, int, int, float2& g, float2& u) const {
    constexpr int BM = Cfg::BM, BK = Cfg::BK, BN = Cfg::BN;
    const int off = int(sw128_offset(rl, cl * 2));
    const char* gate = reinterpret_cast<const char*>(smem.a + ring.stage * BM * BK);
    const char* up = reinterpret_cast<const char*>(smem.b + ring.stage * BN * BK);
    g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(gate + off));
    u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(up + off));
  }
};

// kSwiGLUBwd, chunk q of a thread's accumulators: for each pair of adjacent values
// (accumulator index i, chunk-local index l, half = which of the thread's two rows) the
// matching h pairs (gate g, up u; zeros past N) and the global row r and column c of its
// first value, handed to fn(i, l, half, r, c, g, u). N = I is a multiple of 8, so a pair
// starting below N is whole.
template <class Cfg, class HSrc, class Fn>
__device__ __forceinline__ void swiglu_bwd_chunk(const EpilogueState& es, const Task& task,
                                                 int m0, int q, const HSrc& hsrc, Fn&& fn) {
  constexpr int BN = Cfg::BN, CW = Cfg::kChunkCols;
  CUTE_UNROLL
  for (int jb = 0; jb < CW / 8; ++jb) {
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      const int i = 4 * (q * (CW / 8) + jb) + 2 * half, l = 4 * jb + 2 * half;
      const int rl = 64 * es.wg + es.row_t + 8 * half, cl = es.col_t + 8 * jb;
      const int c = task.n_tile * BN + q * CW + cl;
      float2 g, u;
      hsrc.load(rl, cl, m0 + rl, c, g, u);
      fn(i, l, half, m0 + rl, c, g, u);
    }
  }
}

// The SwiGLU backward of one value: d_act (unscaled accumulator times the row's weight w)
// -> d_gate, and d_up into the accumulator register it came from.
__device__ __forceinline__ void swiglu_bwd_value(float& acc, float& d_gate, float w, float g,
                                                 float u, float sig) {
  const float d_act = w * acc;
  d_gate = d_act * u * sig * (1.f + g * (1.f - sig));
  acc = d_act * g * sig;
}

// The routed dgrad epilogues (kSwiGLUBwd, kActBwd with row_scale): the router weights of a
// thread's two rows; the per-row <acc, act> partial of this column tile (the 4 threads of
// a quad hold a row's columns: a butterfly gives each the same sum, a + b == b + a, and
// one of them stores it); w * act for dW2, straight from registers (columns below N).
__device__ __forceinline__ void load_row_scales(const GemmParams& p, const EpilogueState& es,
                                                int m0, float (&w)[2]) {
  CUTE_UNROLL
  for (int half = 0; half < 2; ++half) {
    w[half] = __ldcg(p.row_scale + m0 + 64 * es.wg + es.row_t + 8 * half);
  }
}

__device__ __forceinline__ void store_row_dots(const GemmParams& p, const EpilogueState& es,
                                               int m0, const Task& task, const float (&dot)[2]) {
  CUTE_UNROLL
  for (int half = 0; half < 2; ++half) {
    float s = dot[half];
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if (es.wg_thread % 4 == 0) {
      const int r = m0 + 64 * es.wg + es.row_t + 8 * half;
      p.dots_part[int64_t(r) * p.n_tiles + task.n_tile] = s;
    }
  }
}

__device__ __forceinline__ void store_act_scaled(const GemmParams& p, int r, int c, float w,
                                                 float act0, float act1) {
  if (c < p.N) {
    *reinterpret_cast<__nv_bfloat162*>(p.act_scaled + int64_t(r) * p.N + c) =
        __floats2bfloat162_rn(w * act0, w * act1);
  }
}

// kQuantDh: this tile's d_h (128 rows x 128 columns of each of gate and up: exactly one
// 1 x 128 group per row and plane, BN = 128) quantised from the bf16 values the epilogue
// stored. Group amax: a thread's 32 values of a row, then the 4 threads of its quad (fmaxf
// is exact and order-free, so the scale is the row quantiser's); scale = amax / 448 (1 for
// a zero group), q = rne_e4m3(v / scale) saturated. Values go out as 2-byte pairs from
// registers (as act_scaled), the scales by the quad's first thread.
template <class Cfg, class Acc, int kKept, int kPer>
__device__ __forceinline__ void quantize_dh_tile(const GemmParams& p, const EpilogueState& es,
                                                 const Task& task, int m0, const Acc& accum,
                                                 const float (&dg)[kKept][kPer]) {
  constexpr int BN = Cfg::BN, CW = Cfg::kChunkCols;
  static_assert(BN == 128 && kKept == BN / CW, "one 1 x 128 group per row and plane");
  auto bf16_value = [](float v) { return __bfloat162float(__float2bfloat16_rn(v)); };
  // plane 0: d_gate (kept), plane 1: d_up (in the accumulators).
  auto value = [&](int plane, int q, int jb, int half, int e) {
    return plane == 0 ? bf16_value(dg[q][4 * jb + 2 * half + e])
                      : bf16_value(accum(4 * (q * (CW / 8) + jb) + 2 * half + e));
  };
  float scale[2][2];  // [plane][half]
  CUTE_UNROLL
  for (int plane = 0; plane < 2; ++plane) {
    CUTE_UNROLL
    for (int half = 0; half < 2; ++half) {
      float amax = 0.f;
      CUTE_UNROLL
      for (int q = 0; q < kKept; ++q) {
        CUTE_UNROLL
        for (int jb = 0; jb < CW / 8; ++jb) {
          amax = fmaxf(amax, fmaxf(fabsf(value(plane, q, jb, half, 0)),
                                   fabsf(value(plane, q, jb, half, 1))));
        }
      }
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
      scale[plane][half] = amax > 0.f ? amax / 448.f : 1.f;
    }
  }
  const int groups = p.N / 128;
  CUTE_UNROLL
  for (int half = 0; half < 2; ++half) {
    const int64_t r = m0 + 64 * es.wg + es.row_t + 8 * half;
    CUTE_UNROLL
    for (int plane = 0; plane < 2; ++plane) {
      uint8_t* row_q = p.dh_q + r * 2 * p.N + plane * p.N + task.n_tile * BN + es.col_t;
      const float sc = scale[plane][half];
      CUTE_UNROLL
      for (int q = 0; q < kKept; ++q) {
        CUTE_UNROLL
        for (int jb = 0; jb < CW / 8; ++jb) {
          const __nv_fp8x2_storage_t pair = __nv_cvt_float2_to_fp8x2(
              make_float2(value(plane, q, jb, half, 0) / sc, value(plane, q, jb, half, 1) / sc),
              __NV_SATFINITE, __NV_E4M3);
          *reinterpret_cast<__nv_fp8x2_storage_t*>(row_q + q * CW + 8 * jb) = pair;
        }
      }
      if (es.col_t == 0) {
        p.dh_scale_t[int64_t(plane * groups + task.n_tile) * p.dh_scale_ld + r] = sc;
      }
    }
  }
}

// The epilogue of one task for one consumer warpgroup, by Cfg::epi. Output views for the
// TMA stores are 3-D (rows, cols, planes): kRows out (rows, N, 1), kTokensAsK out (M, N, E);
// tma_h views [rows, 2I] as (rows, I, 2), gate and up as planes 0 and 1: the SwiGLU
// forward's h, the SwiGLU backward's d_h.
// hsrc (kSwiGLUBwd): where h is read, HFromGlobal or HFromRing.
template <class Cfg, class Storage, class Acc, class TmaO, class TmaH, class HSrc>
__device__ __forceinline__ void tile_epilogue(Storage& smem, EpilogueState& es, const GemmParams& p,
                                              const Task& task, Acc& accum, bool has_k,
                                              const TmaO& tma_o, const TmaH& tma_h, HSrc&& hsrc) {
  using namespace cute;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, CW = Cfg::kChunkCols;
  constexpr int BNh = BN / Cfg::kSplit;
  constexpr int kAcc = BN / 2;  // accumulator elements per thread (64 x BN per warpgroup)
  Tensor mO = tma_o.get_tma_tensor(make_shape(
      Cfg::group == Grouping::kRows ? p.rows_cap : p.M, p.N,
      Cfg::group == Grouping::kRows ? 1 : p.num_experts));
  Tensor mH = tma_h.get_tma_tensor(make_shape(p.rows_cap, p.N, Cfg::epi == Epi::kAct ? 1 : 2));
  const int m0 = task.m_tile * BM;
  const int row_tile = 2 * task.m_tile + es.wg;  // this warpgroup's 64 rows
  if constexpr (Cfg::epi == Epi::kStore) {
    if constexpr (Cfg::group == Grouping::kRows && Cfg::kGlu) {
      if (p.col_bias != nullptr && has_k) {
        add_column_bias<kAcc>(accum, 0, p.col_bias + task.expert * p.bias_stride,
                              task.n_tile * BN, p.N, es.col_t);
      }
    }
    const int plane = Cfg::group == Grouping::kRows ? 0
                      : p.reverse_planes             ? p.num_experts - 1 - task.expert
                                                     : task.expert;
    CUTE_UNROLL
    for (int q = 0; q < BN / CW; ++q) {
      if ((task.n_tile * BN + q * CW) < p.N) {  // a chunk past N is all clipped
        emit_chunk<Cfg>(smem, es, tma_o, mO, row_tile, task.n_tile * (BN / CW) + q, plane,
                        q * (CW / 8), [&](int i) {
                          return has_k ? make_float2(accum(i), accum(i + 1)) : make_float2(0.f, 0.f);
                        });
      }
    }
  } else if constexpr (Cfg::epi == Epi::kSwiGLU) {
    // Columns [0, BN/2) of the tile are gate, [BN/2, BN) the matching up columns: in the
    // accumulator a thread holds both, kAcc/2 apart.
    if (Cfg::kGlu && p.col_bias != nullptr) {
      const __nv_bfloat16* bias = p.col_bias + task.expert * p.bias_stride;
      add_column_bias<kAcc / 2>(accum, 0, bias, task.n_tile * BNh, p.N, es.col_t);
      add_column_bias<kAcc / 2>(accum, kAcc / 2, bias + p.N, task.n_tile * BNh, p.N, es.col_t);
    }
    CUTE_UNROLL
    for (int q = 0; q < BNh / CW; ++q) {
      if ((task.n_tile * BNh + q * CW) < p.N) {
        const int col_chunk = task.n_tile * (BNh / CW) + q;
        if constexpr (!QuantizesAct<Cfg>::value) {  // else act leaves quantised (fp8_tile.cuh)
          emit_chunk<Cfg>(smem, es, tma_o, mO, row_tile, col_chunk, 0, q * (CW / 8), [&](int i) {
            return make_float2(glu_forward<Cfg>(p, accum(i), accum(i + kAcc / 2)),
                               glu_forward<Cfg>(p, accum(i + 1), accum(i + 1 + kAcc / 2)));
          });
        }
        if (p.store_h) {
          CUTE_UNROLL
          for (int part = 0; part < 2; ++part) {  // gate, up
            emit_chunk<Cfg>(smem, es, tma_h, mH, row_tile, col_chunk, part, q * (CW / 8),
                            [&](int i) {
                              const int j = i + part * (kAcc / 2);
                              return make_float2(accum(j), accum(j + 1));
                            });
          }
        }
      }
    }
  } else if constexpr (Cfg::epi == Epi::kAct) {  // act = f(acc + bias) (+ h = acc + bias)
    if (p.col_bias != nullptr) {
      add_column_bias<kAcc>(accum, 0, p.col_bias + task.expert * p.bias_stride,
                            task.n_tile * BN, p.N, es.col_t);
    }
    CUTE_UNROLL
    for (int q = 0; q < BN / CW; ++q) {
      if ((task.n_tile * BN + q * CW) < p.N) {
        const int col_chunk = task.n_tile * (BN / CW) + q;
        emit_chunk<Cfg>(smem, es, tma_o, mO, row_tile, col_chunk, 0, q * (CW / 8), [&](int i) {
          return make_float2(act_value<Cfg::kAct>(p, accum(i)), act_value<Cfg::kAct>(p, accum(i + 1)));
        });
        if (p.store_h) {
          emit_chunk<Cfg>(smem, es, tma_h, mH, row_tile, col_chunk, 0, q * (CW / 8),
                          [&](int i) { return make_float2(accum(i), accum(i + 1)); });
        }
      }
    }
  } else if constexpr (Cfg::epi == Epi::kActBwd) {
    // d_h = w * acc * f'(h) into the accumulators, then stored as the output; with row_scale
    // also <acc, f(h)> per row and column tile and w * f(h), as kSwiGLUBwd below.
    const bool scaled = p.row_scale != nullptr;
    float w[2] = {1.f, 1.f}, dot[2] = {0.f, 0.f};
    if (scaled) load_row_scales(p, es, m0, w);
    CUTE_UNROLL
    for (int q = 0; q < BN / CW; ++q) {
      if (task.n_tile * BN + q * CW < p.N) {
        const int col_chunk = task.n_tile * (BN / CW) + q;
        hsrc.begin_chunk();
        swiglu_bwd_chunk<Cfg>(es, task, m0, q, hsrc,
                              [&](int i, int, int half, int r, int c, float2 hv, float2) {
          if (scaled) {
            const float act0 = act_value<Cfg::kAct>(p, hv.x), act1 = act_value<Cfg::kAct>(p, hv.y);
            dot[half] += accum(i) * act0;
            dot[half] += accum(i + 1) * act1;
            store_act_scaled(p, r, c, w[half], act0, act1);
          }
          accum(i) = w[half] * accum(i) * act_grad<Cfg::kAct>(p, hv.x);
          accum(i + 1) = w[half] * accum(i + 1) * act_grad<Cfg::kAct>(p, hv.y);
        });
        hsrc.end_chunk();
        emit_chunk<Cfg>(smem, es, tma_o, mO, row_tile, col_chunk, 0, q * (CW / 8),
                        [&](int i) { return make_float2(accum(i), accum(i + 1)); });
      }
    }
    if (scaled) store_row_dots(p, es, m0, task, dot);
  } else {  // kSwiGLUBwd: d_act = w * acc; d_h = [d_gate, d_up] (planes of the h view)
    // Per chunk: d_gate into registers and d_up into the accumulator it came from (d_act is
    // spent once both are computed), then both staged like the other outputs. 32 values
    // live next to the accumulators and one sigmoid per value; holding d_gate and d_up apart
    // (64) spilled, and computing them in two passes doubled the epilogue's code, which
    // then missed the instruction cache (perf-notes, core v5).
    // With row_scale (the router weights applied here, not in a pull of dy): the same pass
    // recomputes act = silu(g) * u, sums <acc, act> per row (d_topk_w: <dy, y_row> without
    // reading y rows) and stores w * act for dW2 straight from registers.
    constexpr int kPer = CW / 2;  // values of one chunk and plane held by a thread
    // kQuantDh keeps every chunk's d_gate (the FP8 consumers' promotion partial is dead
    // here, so the registers are there): the row's 128-column group amax needs them all.
    constexpr bool kQuant = QuantizesDh<Cfg>::value;
    constexpr int kKept = kQuant ? BN / CW : 1;
    const bool scaled = p.row_scale != nullptr;
    float w[2] = {1.f, 1.f}, dot[2] = {0.f, 0.f};
    if (scaled) load_row_scales(p, es, m0, w);
    float dg_kept[kKept][kPer];
    CUTE_UNROLL
    for (int q = 0; q < BN / CW; ++q) {
      if (task.n_tile * BN + q * CW < p.N) {
        const int col_chunk = task.n_tile * (BN / CW) + q, base = 4 * q * (CW / 8);
        float (&dg)[kPer] = dg_kept[kQuant ? q : 0];
        hsrc.begin_chunk();
        swiglu_bwd_chunk<Cfg>(es, task, m0, q, hsrc, [&](int i, int l, int half, int r, int c,
                                                         float2 g, float2 u) {
          if constexpr (Cfg::kGlu) {
            const float acc0 = accum(i), acc1 = accum(i + 1);
            const float act0 = glu_general_bwd_value(p, accum(i), dg[l], w[half], g.x, u.x);
            const float act1 = glu_general_bwd_value(p, accum(i + 1), dg[l + 1], w[half], g.y, u.y);
            if (scaled) {
              dot[half] += acc0 * act0;
              dot[half] += acc1 * act1;
              store_act_scaled(p, r, c, w[half], act0, act1);
            }
            return;
          }
          const float sig0 = sigmoid_fast(g.x), sig1 = sigmoid_fast(g.y);
          if (scaled) {
            const float act0 = g.x * sig0 * u.x, act1 = g.y * sig1 * u.y;
            dot[half] += accum(i) * act0;
            dot[half] += accum(i + 1) * act1;
            store_act_scaled(p, r, c, w[half], act0, act1);
          }
          swiglu_bwd_value(accum(i), dg[l], w[half], g.x, u.x, sig0);
          swiglu_bwd_value(accum(i + 1), dg[l + 1], w[half], g.y, u.y, sig1);
        });
        hsrc.end_chunk();
        // act_scaled's generic stores -> a later TMA read of it in the same launch (the
        // backward megakernel's dW2 tiles); ordered by emit_chunk's warpgroup barriers
        // before the tile is published.
        if (scaled) fence_generic_to_async_global();
        emit_chunk<Cfg>(smem, es, tma_h, mH, row_tile, col_chunk, 0, q * (CW / 8),
                        [&](int i) { return make_float2(dg[i - base], dg[i - base + 1]); });
        emit_chunk<Cfg>(smem, es, tma_h, mH, row_tile, col_chunk, 1, q * (CW / 8),
                        [&](int i) { return make_float2(accum(i), accum(i + 1)); });
      }
    }
    if (scaled) store_row_dots(p, es, m0, task, dot);
    if constexpr (kQuant) {
      if (p.dh_q != nullptr) quantize_dh_tile<Cfg>(p, es, task, m0, accum, dg_kept);
    }
  }
}

// The same, h (kSwiGLUBwd, kActBwd) read from global memory.
template <class Cfg, class Storage, class Acc, class TmaO, class TmaH>
__device__ __forceinline__ void tile_epilogue(Storage& smem, EpilogueState& es, const GemmParams& p,
                                              const Task& task, Acc& accum, bool has_k,
                                              const TmaO& tma_o, const TmaH& tma_h) {
  if constexpr (Cfg::epi == Epi::kActBwd) {
    tile_epilogue<Cfg>(smem, es, p, task, accum, has_k, tma_o, tma_h, HFromGlobalSingle{p});
  } else {
    tile_epilogue<Cfg>(smem, es, p, task, accum, has_k, tma_o, tma_h, HFromGlobal{p});
  }
}

}  // namespace megatron_mok::gemm
