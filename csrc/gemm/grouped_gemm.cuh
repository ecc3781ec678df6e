// Hopper grouped-GEMM core (sm_90a): a persistent, warp-specialised tile kernel over the
// row table of the MoE schedule.
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
// reads h, writes d_h = [d_gate, d_up]).
#pragma once

#include <cuda_bf16.h>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>

namespace megatron_mok::gemm {

using namespace cute;
using bf16 = cute::bfloat16_t;

enum class Grouping { kRows, kTokensAsK };
enum class Epi { kStore, kSwiGLU, kSwiGLUBwd };

// kCluster = 2: CTA pairs in a cluster compute neighbouring row tiles of the same N tile and,
// when both rows belong to one expert, multicast the B tile (each CTA loads half of it for
// both), cutting L2->SM traffic by a third. Experimental (MOK_GEMM_CLUSTER=2); default 1.
template <bool kAKMajor, bool kBKMajor, Grouping kGroup, Epi kEpi, class OutT, int kCluster_ = 1,
          int kBN = 256, int kStages = 4>
struct GemmConfig {
  static constexpr int BM = 128, BN = kBN, BK = 64, Stages = kStages, kCluster = kCluster_;
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

  struct SharedStorage {
    alignas(1024) bf16 a[cosize_v<SmemLayoutA>];
    alignas(1024) bf16 b[cosize_v<SmemLayoutB>];
    alignas(1024) EpiT epi[2 * 2 * kChunkElems];  // [warpgroup][buffer]
    alignas(8) uint64_t full[Stages];
    alignas(8) uint64_t empty[Stages];
    alignas(8) uint64_t task_full[2];   // counter scheduler: task ids, producer -> consumers
    alignas(8) uint64_t task_empty[2];
    int task_id[2];
  };
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
};

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

// CUTLASS's mbarrier wait/arrive asm has no "memory" clobber: without this the compiler
// could move the task queue's plain smem access across them.
__device__ __forceinline__ void compiler_fence() { asm volatile("" ::: "memory"); }

__device__ __forceinline__ void warpgroup_bar_sync(int id) {
  asm volatile("bar.sync %0, 128;" ::"r"(id) : "memory");
}

// Output views for the TMA stores, all 3-D (rows, cols, planes): kRows out (rows, N, 1),
// kTokensAsK out (M, N, E); tma_h views [rows, 2I] as (rows, I, 2), gate and up as planes 0
// and 1: the SwiGLU forward's h, the SwiGLU backward's d_h.
// tma_b_mc: B as halves multicast to both CTAs of a cluster (C = 2; with C = 1, tma_b again).
template <class Cfg, class TmaA, class TmaB, class TmaBmc, class TmaO>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
grouped_gemm_kernel(const __grid_constant__ GemmParams p, const __grid_constant__ TmaA tma_a,
                    const __grid_constant__ TmaB tma_b, const __grid_constant__ TmaBmc tma_b_mc,
                    const __grid_constant__ TmaO tma_o,
                    const __grid_constant__ TmaO tma_h, int a_rows, int a_cols, int b_n, int b_k,
                    int b_q) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using namespace cute;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK, S = Cfg::Stages;
  constexpr int kSplit = Cfg::kSplit, BNh = BN / kSplit;
  using FullBar = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBar = cutlass::arch::ClusterBarrier;

  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<typename Cfg::SharedStorage*>(smem_raw);
  Tensor sA = make_tensor(make_smem_ptr(smem.a), typename Cfg::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem.b), typename Cfg::SmemLayoutB{});
  Tensor sBbox = make_tensor(make_smem_ptr(smem.b), typename Cfg::SmemLayoutBBox{});

  constexpr int C = Cfg::kCluster;
  const int warpgroup = threadIdx.x / 128;
  const int rank = C == 1 ? 0 : int(cute::block_rank_in_cluster());
  const int cluster = blockIdx.x / C, num_clusters = gridDim.x / C;
  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(tma_a.get_tma_descriptor());
    prefetch_tma_descriptor(tma_b.get_tma_descriptor());
    if constexpr (Cfg::kCluster == 2) prefetch_tma_descriptor(tma_b_mc.get_tma_descriptor());
    prefetch_tma_descriptor(tma_o.get_tma_descriptor());
    prefetch_tma_descriptor(tma_h.get_tma_descriptor());
    for (int s = 0; s < S; ++s) {
      FullBar::init(&smem.full[s], 1);
      // C = 1: every consumer thread arrives. C = 2: one thread per consumer warpgroup
      // per CTA of the cluster (a stage is refilled by both CTAs' multicast).
      EmptyBar::init(&smem.empty[s], C == 1 ? 256 : 2 * C);
    }
    for (int s = 0; s < 2; ++s) {
      EmptyBar::init(&smem.task_full[s], 1);
      EmptyBar::init(&smem.task_empty[s], 256);
    }
    cutlass::arch::fence_barrier_init();
  }
  if constexpr (C == 1) {
    __syncthreads();
  } else {
    cute::cluster_arrive_relaxed();
    cute::cluster_wait();
  }

  // Task scheduling. Static: CTA (cluster) b takes tasks b, b + grid, ... Counter: the
  // producer takes the next task from a global counter (tasks start in index order, a CTA
  // that drew short tiles takes more) and hands it to the consumers through a 2-slot queue
  // in shared memory (mbarrier arrive/wait order the slot's write and read). Either way a
  // tile has one owner and a fixed K order, so the results are the same bits.
  const bool counter = C == 1 && p.task_counter != nullptr;
  int queue_slot = 0, queue_phase = 0;

  if (warpgroup == 0) {
    // ---------------- producer: one thread feeds the ring ----------------
    cutlass::arch::warpgroup_reg_dealloc<56>();
    if (threadIdx.x == 0) {
    Tensor mA = tma_a.get_tma_tensor(make_shape(a_rows, a_cols));   // (M, K)
    Tensor mB = tma_b.get_tma_tensor(make_shape(b_n, b_k, b_q));    // (N, K, Q)
    // The next task: t_static, or the counter's next value, published to the consumers
    // (a value past the last task tells them to stop).
    auto next_task = [&](int t_static) {
      if (!counter) return t_static;
      const int t = atomicAdd(p.task_counter, 1);
      EmptyBar::wait(&smem.task_empty[queue_slot], queue_phase ^ 1);
      compiler_fence();
      smem.task_id[queue_slot] = t;
      compiler_fence();
      EmptyBar::arrive(&smem.task_full[queue_slot]);  // release: the id is visible
      if (++queue_slot == 2) { queue_slot = 0; queue_phase ^= 1; }
      return t;
    };
    int stage = 0, phase = 0;
    for (int t = next_task(cluster); t < p.num_tasks; t = next_task(t + num_clusters)) {
      const Task task = decode_task<Cfg>(p, t, rank);
      if (task.skip || task.k_begin >= task.k_end) continue;
      Tensor gA = local_tile(mA, Shape<Int<BM>, Int<BK>>{}, make_coord(task.m_tile, _));
      auto [tAgA, tAsA] = tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA),
                                        group_modes<0, 2>(gA));
      for (int k = task.k_begin; k < task.k_end; ++k) {
        EmptyBar::wait(&smem.empty[stage], phase ^ 1);
        FullBar::arrive_and_expect_tx(&smem.full[stage], Cfg::kTxBytes);
        copy(tma_a.with(smem.full[stage]), tAgA(_, k), tAsA(_, stage));
        CUTE_UNROLL
        for (int h = 0; h < kSplit; ++h) {
          const int q = Cfg::group == Grouping::kRows ? task.expert * kSplit + h : 0;
          Tensor gB = local_tile(mB(_, _, q), Shape<Int<BNh>, Int<BK>>{},
                                 make_coord(task.n_tile, _));
          if (C == 2 && task.share_b) {  // this CTA's half of the box, to both CTAs
            auto [tBgB, tBsB] = tma_partition(tma_b_mc, rank, Layout<Int<C>>{},
                                              group_modes<0, 2>(sBbox), group_modes<0, 2>(gB));
            copy(tma_b_mc.with(smem.full[stage], uint16_t((1 << C) - 1)), tBgB(_, k),
                 tBsB(_, stage * kSplit + h));
          } else {
            auto [tBgB, tBsB] = tma_partition(tma_b, Int<0>{}, Layout<_1>{},
                                              group_modes<0, 2>(sBbox), group_modes<0, 2>(gB));
            copy(tma_b.with(smem.full[stage]), tBgB(_, k), tBsB(_, stage * kSplit + h));
          }
        }
        if (++stage == S) { stage = 0; phase ^= 1; }
      }
    }
    }  // threadIdx.x == 0
  } else {
  // ---------------- consumers: WGMMA + epilogue ----------------
  cutlass::arch::warpgroup_reg_alloc<224>();
  const int ctid = threadIdx.x - 128;
  typename Cfg::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(ctid);
  Tensor tCsA = thr_mma.partition_A(sA);
  Tensor tCsB = thr_mma.partition_B(sB);
  Tensor tCrA = thr_mma.make_fragment_A(tCsA);  // (MMA, MMA_M, MMA_K, S) descriptors
  Tensor tCrB = thr_mma.make_fragment_B(tCsB);
  Tensor accum = partition_fragment_C(tiled_mma, Shape<Int<BM>, Int<BN>>{});
  Tensor tCcD = thr_mma.partition_C(make_identity_tensor(Shape<Int<BM>, Int<BN>>{}));
  constexpr int kAcc = decltype(size(accum))::value;

  using Out = typename Cfg::Out;
  // Hands stage s back to its producers: every thread (C = 1), or one thread of this
  // warpgroup per CTA of the cluster (C = 2; the warpgroup's WGMMAs are complete).
  const int wg_thread = ctid % 128;
  auto release = [&](int s) {
    if constexpr (C == 1) {
      EmptyBar::arrive(&smem.empty[s]);
    } else {
      EmptyBar::arrive(&smem.empty[s], uint32_t(wg_thread), wg_thread < C);
    }
  };
  // Staged epilogue. In the WGMMA accumulator layout, element i of a thread sits at row
  // row_t + 8 * ((i / 2) % 2) and column col_t + 8 * (i / 4) + i % 2 of the warpgroup's slice.
  static_assert(kAcc == BN / 2, "one 64 x BN WGMMA accumulator per consumer warpgroup");
  constexpr int CW = Cfg::kChunkCols;
  const int wg = warpgroup - 1;
  const int row_t = get<0>(tCcD(0)) - 64 * wg, col_t = get<1>(tCcD(0));
  int epi_buf = 0;
  Tensor mO = tma_o.get_tma_tensor(make_shape(
      Cfg::group == Grouping::kRows ? p.rows_cap : p.M, p.N,
      Cfg::group == Grouping::kRows ? 1 : p.num_experts));
  Tensor mH = tma_h.get_tma_tensor(make_shape(p.rows_cap, p.N, 2));
  // Chunk `first_block / (CW / 8)` of the slice: values(i) gives elements i and i + 1 for the
  // accumulator index i of the chunk's column blocks; stored at 64-row tile `row_tile`, chunk
  // column `col_chunk` of plane `plane` of the view.
  auto emit_chunk = [&](auto const& tma, auto const& mView, int row_tile, int col_chunk,
                        int plane, int first_block, auto&& values) {
    using Out = typename Cfg::EpiT;
    const int buf = epi_buf;
    epi_buf ^= 1;
    Out* chunk = smem.epi + (wg * 2 + buf) * Cfg::kChunkElems;
    if (wg_thread == 0) tma_store_wait<1>();  // this buffer's previous store has read it
    warpgroup_bar_sync(1 + wg);
    Tensor sE = make_tensor(make_smem_ptr(chunk), typename Cfg::EpiLayout{});
    CUTE_UNROLL
    for (int jb = 0; jb < CW / 8; ++jb) {
      CUTE_UNROLL
      for (int half = 0; half < 2; ++half) {
        const int i = 4 * (first_block + jb) + 2 * half;
        const float2 v = values(i);
        Out* dst = &sE(row_t + 8 * half, col_t + 8 * jb);
        if constexpr (std::is_same_v<Out, float>) {
          *reinterpret_cast<float2*>(dst) = v;
        } else {
          *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(v.x, v.y);
        }
      }
    }
    tma_store_fence();  // generic-proxy smem writes -> the TMA (async proxy) reads them
    warpgroup_bar_sync(1 + wg);
    if (wg_thread == 0) {
      Tensor gO = local_tile(mView(_, _, plane), Shape<_64, Int<CW>>{},
                             make_coord(row_tile, col_chunk));
      auto [tOgO, tOsO] = tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sE),
                                        group_modes<0, 2>(gO));
      copy(tma, tOsO, tOgO);
      tma_store_arrive();
    }
  };

  auto next_task = [&](int t_static) {
    if (!counter) return t_static;
    EmptyBar::wait(&smem.task_full[queue_slot], queue_phase);
    compiler_fence();
    const int t = smem.task_id[queue_slot];
    compiler_fence();
    EmptyBar::arrive(&smem.task_empty[queue_slot]);
    if (++queue_slot == 2) { queue_slot = 0; queue_phase ^= 1; }
    return t;
  };
  int stage = 0, phase = 0;
  for (int t = next_task(cluster); t < p.num_tasks; t = next_task(t + num_clusters)) {
    const Task task = decode_task<Cfg>(p, t, rank);
    if (task.skip) continue;
    if constexpr (Cfg::epi == Epi::kSwiGLUBwd) {
      // The epilogue reads this tile's h (gate and up: 128 rows x BN columns each) straight
      // from global memory, 16 bytes of a row per thread; ask L2 for it now, so that after
      // the mainloop those loads hit L2 instead of waiting on DRAM.
      constexpr int kLines = BN * 2 / 128;  // 128-byte lines per row and part
      const int n0 = task.n_tile * BN;
#pragma unroll 1
      for (int line = ctid; line < BM * 2 * kLines; line += 256) {
        const int r = line / (2 * kLines), part = (line / kLines) % 2, c = n0 + (line % kLines) * 64;
        if (c < p.N) {
          const __nv_bfloat16* ptr =
              p.h_in + int64_t(task.m_tile * BM + r) * 2 * p.N + part * p.N + c;
          asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr));
        }
      }
    }
    const bool has_k = task.k_begin < task.k_end;
    if (has_k) {
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(accum);
      int prev = -1;
      for (int k = task.k_begin; k < task.k_end; ++k) {
        FullBar::wait(&smem.full[stage], phase);
        warpgroup_arrive();
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(tCrA); ++kb) {
          cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), accum);
          tiled_mma.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
        warpgroup_wait<1>();  // the previous stage's WGMMAs are done: hand it back
        if (prev >= 0) release(prev);
        prev = stage;
        if (++stage == S) { stage = 0; phase ^= 1; }
      }
      warpgroup_wait<0>();
      release(prev);
      warpgroup_fence_operand(accum);
    }
    if (!task.store) continue;

    // ---------------- epilogue ----------------
    const int m0 = task.m_tile * BM;
    const int row_tile = 2 * task.m_tile + wg;  // this warpgroup's 64 rows
    if constexpr (Cfg::epi == Epi::kStore) {
      const int plane = Cfg::group == Grouping::kRows ? 0 : task.expert;
      CUTE_UNROLL
      for (int q = 0; q < BN / CW; ++q) {
        if ((task.n_tile * BN + q * CW) < p.N) {  // a chunk past N is all clipped
          emit_chunk(tma_o, mO, row_tile, task.n_tile * (BN / CW) + q, plane, q * (CW / 8),
                     [&](int i) {
                       return has_k ? make_float2(accum(i), accum(i + 1)) : make_float2(0.f, 0.f);
                     });
        }
      }
    } else if constexpr (Cfg::epi == Epi::kSwiGLU) {
      // Columns [0, BN/2) of the tile are gate, [BN/2, BN) the matching up columns: in the
      // accumulator a thread holds both, kAcc/2 apart.
      CUTE_UNROLL
      for (int q = 0; q < BNh / CW; ++q) {
        if ((task.n_tile * BNh + q * CW) < p.N) {
          const int col_chunk = task.n_tile * (BNh / CW) + q;
          emit_chunk(tma_o, mO, row_tile, col_chunk, 0, q * (CW / 8), [&](int i) {
            return make_float2(silu_f(accum(i)) * accum(i + kAcc / 2),
                               silu_f(accum(i + 1)) * accum(i + 1 + kAcc / 2));
          });
          if (p.store_h) {
            CUTE_UNROLL
            for (int part = 0; part < 2; ++part) {  // gate, up
              emit_chunk(tma_h, mH, row_tile, col_chunk, part, q * (CW / 8), [&](int i) {
                const int j = i + part * (kAcc / 2);
                return make_float2(accum(j), accum(j + 1));
              });
            }
          }
        }
      }
    } else {  // kSwiGLUBwd: acc = d_act; d_h = [d_gate, d_up] (planes of the h view)
      // Per chunk: read the matching h pairs, compute both halves of d_h in registers,
      // then stage d_gate and d_up like the other outputs. N = I is a multiple of 8, so a
      // column pair starting below N is whole.
      constexpr int kPer = CW / 2;  // values of one chunk held by a thread
      CUTE_UNROLL
      for (int q = 0; q < BN / CW; ++q) {
        if (task.n_tile * BN + q * CW < p.N) {
          float dg[kPer], du[kPer];
          CUTE_UNROLL
          for (int jb = 0; jb < CW / 8; ++jb) {
            CUTE_UNROLL
            for (int half = 0; half < 2; ++half) {
              const int i = 4 * (q * (CW / 8) + jb) + 2 * half, l = 4 * jb + 2 * half;
              const int r = m0 + get<0>(tCcD(i)), c = task.n_tile * BN + get<1>(tCcD(i));
              float2 g = make_float2(0.f, 0.f), u = g;
              if (c < p.N) {
                const __nv_bfloat16* h = p.h_in + int64_t(r) * 2 * p.N + c;
                g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(h));
                u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(h + p.N));
              }
              const float gs[2] = {g.x, g.y}, us[2] = {u.x, u.y};
              CUTE_UNROLL
              for (int j = 0; j < 2; ++j) {
                const float d = accum(i + j);
                const float sig = 1.f / (1.f + __expf(-gs[j]));
                dg[l + j] = d * us[j] * sig * (1.f + gs[j] * (1.f - sig));
                du[l + j] = d * gs[j] * sig;
              }
            }
          }
          const int col_chunk = task.n_tile * (BN / CW) + q, base = 4 * q * (CW / 8);
          emit_chunk(tma_h, mH, row_tile, col_chunk, 0, q * (CW / 8), [&](int i) {
            return make_float2(dg[i - base], dg[i - base + 1]);
          });
          emit_chunk(tma_h, mH, row_tile, col_chunk, 1, q * (CW / 8), [&](int i) {
            return make_float2(du[i - base], du[i - base + 1]);
          });
        }
      }
    }
  }
  if (wg_thread == 0) tma_store_wait<0>();  // smem must outlive the stores' reads
  }  // consumers
  // A CTA of a cluster stays until its peer no longer multicasts into its shared memory
  // or arrives on its barriers.
  if constexpr (C == 2) {
    __syncwarp();  // the producer warp diverged; cluster barriers are .aligned
    cute::cluster_sync();
  }
#endif
}

}  // namespace megatron_mok::gemm
