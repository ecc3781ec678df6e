// The blockwise-FP8 grouped GEMM of the core (sm_90a): E4M3 x E4M3 WGMMAs over the row
// table, DeepSeek-V3's recipe (docs/fp8.md). A (rows, K) carries one fp32 scale per row and
// 128 of K (1 x 128 groups), B (N, K) per expert one per 128 x 128 block.
//
//   BK = 128: one K tile is exactly one scale group of A and of B. Each K tile's four
//   m64n128k32 WGMMAs accumulate into a zeroed partial; the consumer then promotes it,
//   acc += part * s_a[row] * s_b[column block] (fp32 FMAs). The FP8 tensor core's limited
//   accumulation precision thus covers 128 products, never the whole K.
//   BN = 128: the partial and the accumulator are 64 registers each per thread (64 x 128
//   per warpgroup); at BN = 256 they would not fit beside the mainloop's.
//
// Everything else is the BF16 core's (tile.cuh): the producer warpgroup's TMA ring, the
// task decoding and counter scheduler, and the staged epilogues (kStore: bf16 out; kSwiGLU:
// the 128-column B tile is 64 gate rows + the 64 matching up rows, act and h in bf16;
// kSwiGLUBwd: d_h from d_act = the accumulators and h read from global memory, with the
// router weights, <acc, act> and w * act as the BF16 routed dgrad's). The
// producer also bulk-copies the 128 row scales of A's K tile into the stage (A's scales are
// stored transposed, [K / 128, rows], so they are one contiguous 512-byte run). A tile has
// one owner and a fixed K order: the same bits for any grid size or task order.
#pragma once

#include "gemm/tile.cuh"

namespace megatron_mok::gemm {

using fp8 = cute::float_e4m3_t;

// The operand ring (fp8), the epilogue's bf16 staging buffers, A's row scales per stage,
// the ring's barriers and the task queue (member names as TileStorage's: the shared pieces
// of tile.cuh use them).
template <int kElemsA, int kElemsB, int kEpiElems, int Stages, int kKeptWords = 1>
struct Fp8TileStorage {
  alignas(1024) fp8 a[kElemsA];
  alignas(1024) fp8 b[kElemsB];
  alignas(1024) bf16 epi[kEpiElems];
  alignas(16) float a_scale[Stages][128];
  // kQuantAct: the pair's first tile's act, [word][consumer thread] (no bank conflicts);
  // in registers it spilled (ptxas, 168 registers a thread).
  alignas(16) uint32_t act_kept[kKeptWords];
  alignas(8) uint64_t full[Stages];
  alignas(8) uint64_t empty[Stages];
  alignas(8) uint64_t task_full[2];
  alignas(8) uint64_t task_empty[2];
  int task_id[2];
};

// kCluster = 2: CTA pairs on neighbouring row tiles of one N tile multicast the B tile when
// both rows belong to one expert (each CTA loads half of it for both), as the BF16 core's
// MOK_GEMM_CLUSTER=2: L2->SM bytes per K tile 32 -> 24 KB.
//
// kOverlap (MOK_FP8_PROMOTION=overlap): two partials, so that K tile k's WGMMAs run while
// tile k - 1's partial is promoted (warpgroup_wait<1>) instead of the tensor core waiting
// for the FMAs; the promotions keep their order, so the bits are the serial loop's.
//
// kQuantAct (kSwiGLU only): act is quantised 1 x 128 in the epilogue instead of stored in
// bf16. A tile's 64 act columns are half a group, so a task is a pair of neighbouring N
// tiles run back to back by one CTA (kPairs = 2): the first tile's act waits in shared
// memory (bf16, 16 words a thread) until the second's completes its row groups.
template <Epi kEpi, int kStages = 5, int kCluster_ = 1, bool kOverlap_ = false,
          bool kQuantAct_ = false>
struct Fp8GemmConfig {
  static_assert(kEpi == Epi::kStore || kEpi == Epi::kSwiGLU || kEpi == Epi::kSwiGLUBwd,
                "FP8: fc1 + SwiGLU, plain rows and the fc2 dgrad + SwiGLU backward");
  static constexpr int BM = 128, BN = 128, BK = 128, Stages = kStages, kCluster = kCluster_;
  static constexpr bool kOverlap = kOverlap_;
  static_assert(!kQuantAct_ || kEpi == Epi::kSwiGLU, "kQuantAct: the fc1 + SwiGLU epilogue");
  static constexpr bool kQuantAct = kQuantAct_;
  static constexpr int kPairs = kQuantAct ? 2 : 1;  // N tiles per task
  static_assert(kCluster == 1 || kCluster == 2, "clusters of 1 or 2 CTAs");
  static constexpr bool kGlu = false;
  static constexpr int kAct = 0;
  // kSwiGLUBwd: the epilogue can also quantise d_h 1 x 128 for fc1's dgrad (GemmParams::dh_q).
  static constexpr bool kQuantDh = kEpi == Epi::kSwiGLUBwd;
  static constexpr Grouping group = Grouping::kRows;
  static constexpr Epi epi = kEpi;
  static constexpr int kSplit = kEpi == Epi::kSwiGLU ? 2 : 1;  // B boxes per tile
  static constexpr int kThreads = 384;
  using Out = __nv_bfloat16;

  // K-major, 128-byte rows (128 E4M3 values of K): one SW128 atom spans the K tile.
  using Atom = GMMA::Layout_K_SW128_Atom<fp8>;
  using SmemLayoutA = decltype(tile_to_shape(Atom{}, Shape<Int<BM>, Int<BK>, Int<Stages>>{}));
  using SmemLayoutB = decltype(tile_to_shape(Atom{}, Shape<Int<BN>, Int<BK>, Int<Stages>>{}));
  using SmemLayoutBBox = decltype(tile_to_shape(
      Atom{}, Shape<Int<BN / kSplit>, Int<BK>, Int<Stages * kSplit>>{}));
  using MmaOp = decltype(GMMA::ss_op_selector<fp8, fp8, float, Shape<_64, Int<BN>, Int<BK>>,
                                              GMMA::Major::K, GMMA::Major::K>());
  using TiledMma = decltype(make_tiled_mma(MmaOp{}, Layout<Shape<_2, _1, _1>>{}));
  using StrideA = Stride<int64_t, _1>;
  using StrideB = Stride<int64_t, _1, int64_t>;

  static constexpr int kScaleBytes = BM * int(sizeof(float));
  static constexpr int kTxBytes = (BM * BK + BN * BK) * int(sizeof(fp8)) + kScaleBytes;

  static constexpr int kChunkCols = 64;  // bf16 output: 128-byte chunk rows
  using EpiT = bf16;
  using EpiLayout = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<EpiT>{},
                                           Shape<_64, Int<kChunkCols>>{}));
  static constexpr int kChunkElems = 64 * kChunkCols;

  static constexpr int kKeptWords = kQuantAct ? BN / 8 * 256 : 1;  // 16 words a thread
  using SharedStorage = Fp8TileStorage<cosize_v<SmemLayoutA>, cosize_v<SmemLayoutB>,
                                       2 * 2 * kChunkElems, Stages, kKeptWords>;
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
};

// The scales of one FP8 GEMM. a_scale_t [K / 128, a_scale_ld]: A row r's scale of K tile k
// at a_scale_t[k * a_scale_ld + r] (a_scale_ld >= the row table's rows, a multiple of 4).
// b_scale [E, b_blocks_n, K / 128]: expert e's scale of B rows [128 j, 128 j + 128), K tile
// k at b_scale[(e * b_blocks_n + j) * k_blocks + k]; for kSwiGLU B is w1 [E, 2I, H], gate
// rows in blocks [0, I / 128), up rows after them (gate_blocks = I / 128).
struct Fp8Scales {
  const float* a_scale_t;
  int64_t a_scale_ld;
  const float* b_scale;
  int b_blocks_n, k_blocks, gate_blocks;
};

// One bulk copy (not a tensor map) of `bytes` from global into shared memory, completing
// on the stage's transaction barrier.
__device__ __forceinline__ void bulk_copy_g2s(void* smem_dst, const void* gmem_src, int bytes,
                                              uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(cute::cast_smem_ptr_to_uint(smem_dst)), "l"(gmem_src), "r"(bytes),
      "r"(cute::cast_smem_ptr_to_uint(bar))
      : "memory");
}

// Producer: one task's K tiles (A box, B boxes, A's 128 row scales) into the ring.
template <class Cfg, class Storage, class TmaA, class TmaB, class TmaBmc>
__device__ __forceinline__ void fp8_load_task(Storage& smem, const TmaA& tma_a, const TmaB& tma_b,
                                              const TmaBmc& tma_b_mc, const OperandShapes& shapes,
                                              const Fp8Scales& s, const Task& task, int rank,
                                              RingPos& ring) {
  using namespace cute;
  constexpr int BM = Cfg::BM, BK = Cfg::BK, kSplit = Cfg::kSplit, BNh = Cfg::BN / kSplit;
  constexpr int C = Cfg::kCluster;
  using FullBar = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBar = cutlass::arch::ClusterBarrier;
  Tensor sA = make_tensor(make_smem_ptr(smem.a), typename Cfg::SmemLayoutA{});
  Tensor sBbox = make_tensor(make_smem_ptr(smem.b), typename Cfg::SmemLayoutBBox{});
  Tensor mA = tma_a.get_tma_tensor(make_shape(shapes.a_rows, shapes.a_cols));
  Tensor mB = tma_b.get_tma_tensor(make_shape(shapes.b_n, shapes.b_k, shapes.b_q));
  Tensor gA = local_tile(mA, Shape<Int<BM>, Int<BK>>{}, make_coord(task.m_tile, _));
  auto [tAgA, tAsA] = tma_partition(tma_a, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sA),
                                    group_modes<0, 2>(gA));
  // A cluster's second row tile may lie past the table (its rows are zero-filled and never
  // stored): its scales are read from the last tile's, inside the allocation.
  const float* scale_src = s.a_scale_t + int64_t(min(task.m_tile, shapes.a_rows / BM - 1)) * BM;
  for (int k = task.k_begin; k < task.k_end; ++k) {
    EmptyBar::wait(&smem.empty[ring.stage], ring.phase ^ 1);
    FullBar::arrive_and_expect_tx(&smem.full[ring.stage], Cfg::kTxBytes);
    copy(tma_a.with(smem.full[ring.stage]), tAgA(_, k), tAsA(_, ring.stage));
    CUTE_UNROLL
    for (int h = 0; h < kSplit; ++h) {
      Tensor gB = local_tile(mB(_, _, task.expert * kSplit + h), Shape<Int<BNh>, Int<BK>>{},
                             make_coord(task.n_tile, _));
      if (C == 2 && task.share_b) {  // this CTA's half of the box, to both CTAs
        auto [tBgB, tBsB] = tma_partition(tma_b_mc, rank, Layout<Int<C>>{},
                                          group_modes<0, 2>(sBbox), group_modes<0, 2>(gB));
        copy(tma_b_mc.with(smem.full[ring.stage], uint16_t((1 << C) - 1)), tBgB(_, k),
             tBsB(_, ring.stage * kSplit + h));
      } else {
        auto [tBgB, tBsB] = tma_partition(tma_b, Int<0>{}, Layout<_1>{},
                                          group_modes<0, 2>(sBbox), group_modes<0, 2>(gB));
        copy(tma_b.with(smem.full[ring.stage]), tBgB(_, k), tBsB(_, ring.stage * kSplit + h));
      }
    }
    bulk_copy_g2s(smem.a_scale[ring.stage], scale_src + int64_t(k) * s.a_scale_ld,
                  Cfg::kScaleBytes, &smem.full[ring.stage]);
    ring.advance<Cfg::Stages>();
  }
}

// Hand a K tile's stage back to the producer(s) once its WGMMAs are complete.
template <class Cfg, class Storage>
__device__ __forceinline__ void fp8_release_stage(Storage& smem, int stage,
                                                  const EpilogueState& es) {
  using EmptyBar = cutlass::arch::ClusterBarrier;
  if constexpr (Cfg::kCluster == 1) {
    EmptyBar::arrive(&smem.empty[stage]);
  } else {  // one thread of this warpgroup per CTA of the cluster (both refill the stage)
    EmptyBar::arrive(&smem.empty[stage], uint32_t(es.wg_thread), es.wg_thread < Cfg::kCluster);
  }
}

// The K tiles of one task: each is issued into a partial, completed, its stage released
// and the partial promoted. Serial: one partial, each tile completed (wait<0>) before the
// next is issued. kOverlap (see Fp8GemmConfig): tiles alternate between `part` and
// `part2`; after issuing tile k, warpgroup_wait<1> completes tile k - 1, whose partial is
// promoted while tile k's WGMMAs run. The scales of a tile are read when it is issued
// (its stage, with A's scales, may be refilled once released).
template <class Cfg, class Storage, class Mma, class FragA, class FragB, class Acc>
__device__ __forceinline__ void fp8_mma_k_tiles(
    Storage& smem, Mma& tiled_mma, FragA& tCrA, FragB& tCrB, Acc& accum, Acc& part,
    Acc& part2, const float* sb_lo, const float* sb_hi, int row0, const Task& task,
    const EpilogueState& es, RingPos& ring) {
  using namespace cute;
  using FullBar = cutlass::arch::ClusterTransactionBarrier;
  constexpr int kAcc = Cfg::BN / 2;
  // Issue K tile k into P; sc = its (row lo, row hi) x (B block lo, hi) scales.
  auto issue = [&](Acc& P, int k, float (&sc)[4], int& stage) {
    const float b_lo = __ldg(sb_lo + k), b_hi = __ldg(sb_hi + k);
    FullBar::wait(&smem.full[ring.stage], ring.phase);
    compiler_fence();
    const float a0 = smem.a_scale[ring.stage][row0], a1 = smem.a_scale[ring.stage][row0 + 8];
    sc[0] = a0 * b_lo; sc[1] = a1 * b_lo; sc[2] = a0 * b_hi; sc[3] = a1 * b_hi;
    stage = ring.stage;
    warpgroup_fence_operand(P);
    warpgroup_arrive();
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    CUTE_UNROLL
    for (int kb = 0; kb < size<2>(tCrA); ++kb) {
      cute::gemm(tiled_mma, tCrA(_, _, kb, ring.stage), tCrB(_, _, kb, ring.stage), P);
      tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    ring.advance<Cfg::Stages>();
  };
  // Tile in P is complete (the caller waited): release its stage, promote it.
  auto retire = [&](Acc& P, const float (&sc)[4], int stage) {
    warpgroup_fence_operand(P);
    compiler_fence();
    fp8_release_stage<Cfg>(smem, stage, es);
    CUTE_UNROLL
    for (int i = 0; i < size(accum); ++i) {
      const float scale = i < kAcc / 2 ? sc[(i / 2) % 2] : sc[2 + (i / 2) % 2];
      accum(i) = fmaf(P(i), scale, accum(i));
    }
  };
  float sc0[4], sc1[4];
  int stage0 = 0, stage1 = 0;
  if constexpr (!Cfg::kOverlap) {
    for (int k = task.k_begin; k < task.k_end; ++k) {
      issue(part, k, sc0, stage0);
      warpgroup_wait<0>();
      retire(part, sc0, stage0);
    }
    return;
  }
  int k = task.k_begin;
  issue(part, k++, sc0, stage0);
  bool first_in_flight = true;  // the oldest tile in flight is in `part`
  while (k < task.k_end) {
    if (first_in_flight) {
      issue(part2, k++, sc1, stage1);
      warpgroup_wait<1>();
      retire(part, sc0, stage0);
    } else {
      issue(part, k++, sc0, stage0);
      warpgroup_wait<1>();
      retire(part2, sc1, stage1);
    }
    first_in_flight = !first_in_flight;
  }
  warpgroup_wait<0>();
  if (first_in_flight) retire(part, sc0, stage0); else retire(part2, sc1, stage1);
}

// Consumer warpgroup: K tiles [k_begin, k_end) of one task (fp8_mma_k_tiles). Per K tile
// the WGMMAs fill a partial from zero, and once they are complete (the stage is then
// handed back) the promotion adds part * s_a * s_b into accum, which starts at zero. Accumulator element i
// of a thread is row row_t + 8 * ((i / 2) % 2) of the warpgroup's slice (tile.cuh); with
// kSplit = 2 its first half is gate columns (B block gate_blocks's... see Fp8Scales), the
// second half up columns.
template <class Cfg, class Storage, class Mma, class FragA, class FragB, class Acc>
__device__ __forceinline__ void fp8_mma_task(Storage& smem, Mma& tiled_mma, FragA& tCrA,
                                             FragB& tCrB, Acc& accum, Acc& part, Acc& part2,
                                             const Fp8Scales& s, const Task& task,
                                             const EpilogueState& es, RingPos& ring) {
  using namespace cute;
  // B's scale rows of this tile: kStore one block (BN = 128 rows), kSwiGLU the gate block
  // and the up block of its 64 + 64 rows.
  const float* b_scale = s.b_scale + int64_t(task.expert) * s.b_blocks_n * s.k_blocks;
  const float* sb_lo;
  const float* sb_hi;
  if constexpr (Cfg::kSplit == 2) {
    const int blk = task.n_tile * (Cfg::BN / 2) / 128;
    sb_lo = b_scale + int64_t(blk) * s.k_blocks;
    sb_hi = b_scale + int64_t(s.gate_blocks + blk) * s.k_blocks;
  } else {
    sb_lo = sb_hi = b_scale + int64_t(task.n_tile) * s.k_blocks;
  }
  const int row0 = 64 * es.wg + es.row_t;
  CUTE_UNROLL
  for (int i = 0; i < size(accum); ++i) accum(i) = 0.f;
  fp8_mma_k_tiles<Cfg>(smem, tiled_mma, tCrA, tCrB, accum, part, part2, sb_lo, sb_hi, row0,
                       task, es, ring);
}

// N tile `sub` of a task's Cfg::kPairs neighbouring tiles (the task's n_tile counts pairs).
template <class Cfg>
__device__ __forceinline__ Task sub_task(const Task& task, int sub) {
  Task t = task;
  t.n_tile = task.n_tile * Cfg::kPairs + sub;
  return t;
}

// kQuantAct, after N tile `sub` (0, then 1) of a pair: act = SwiGLU(gate, up) of the
// accumulators, rounded to bf16 as the bf16 store would. Tile 0's values wait in shared
// memory (Fp8TileStorage::act_kept, this thread's column); at tile 1 each row's 1 x 128 group (64 columns of each tile, over the 4 threads of a
// quad: 16 + 16 values a thread) has its amax (fmaxf: exact, order-free), scale = amax / 448
// (1 for a zero group), q = rne_e4m3(v / scale) saturated: quantize_fp8_rows's bits over
// the bf16 act. Values go out as 2-byte pairs from registers, scales by the quad's first
// thread.
template <class Cfg, class Storage, class Acc>
__device__ __forceinline__ void quantize_act_pair(Storage& smem, const GemmParams& p,
                                                  const EpilogueState& es, const Task& st,
                                                  int sub, const Acc& accum) {
  constexpr int kAcc = Cfg::BN / 2, kVals = kAcc / 2;  // accumulators, act values a thread
  uint32_t* kept = smem.act_kept + 128 * es.wg + es.wg_thread;  // word w at kept[256 * w]
  auto act_pair = [&](int i) {  // values i, i + 1 (adjacent columns of one row)
    return __floats2bfloat162_rn(glu_forward<Cfg>(p, accum(i), accum(i + kVals)),
                                 glu_forward<Cfg>(p, accum(i + 1), accum(i + 1 + kVals)));
  };
  if (sub == 0) {
    CUTE_UNROLL
    for (int i = 0; i < kVals; i += 2) {
      const __nv_bfloat162 v = act_pair(i);
      kept[256 * (i / 2)] = *reinterpret_cast<const uint32_t*>(&v);
    }
    return;
  }
  __nv_bfloat162 vals[2][kVals / 2];  // [tile][pair]
  CUTE_UNROLL
  for (int i = 0; i < kVals; i += 2) {
    const uint32_t word = kept[256 * (i / 2)];
    vals[0][i / 2] = *reinterpret_cast<const __nv_bfloat162*>(&word);
    vals[1][i / 2] = act_pair(i);
  }
  // Pair i / 2 of a thread is row row_t + 8 * ((i / 2) % 2), columns 8 * (i / 4) + col_t + {0, 1}.
  float scale[2];
  CUTE_UNROLL
  for (int half = 0; half < 2; ++half) {
    float amax = 0.f;
    CUTE_UNROLL
    for (int tile = 0; tile < 2; ++tile) {
      CUTE_UNROLL
      for (int j = half; j < kVals / 2; j += 2) {
        const float2 v = __bfloat1622float2(vals[tile][j]);
        amax = fmaxf(amax, fmaxf(fabsf(v.x), fabsf(v.y)));
      }
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    scale[half] = amax > 0.f ? amax / 448.f : 1.f;
  }
  const int group = st.n_tile / 2;  // 128 act columns: this pair's
  const int m0 = st.m_tile * Cfg::BM;
  CUTE_UNROLL
  for (int half = 0; half < 2; ++half) {
    const int64_t r = m0 + 64 * es.wg + es.row_t + 8 * half;
    uint8_t* row_q = p.act_q + r * p.N + group * 128 + es.col_t;
    const float sc = scale[half];
    CUTE_UNROLL
    for (int tile = 0; tile < 2; ++tile) {
      CUTE_UNROLL
      for (int j = half; j < kVals / 2; j += 2) {
        const float2 v = __bfloat1622float2(vals[tile][j]);
        *reinterpret_cast<__nv_fp8x2_storage_t*>(row_q + tile * 64 + 8 * (j / 2)) =
            __nv_cvt_float2_to_fp8x2(make_float2(v.x / sc, v.y / sc), __NV_SATFINITE, __NV_E4M3);
      }
    }
    if (es.col_t == 0) p.act_scale_t[int64_t(group) * p.act_scale_ld + r] = sc;
  }
}

// The standalone FP8 grouped-GEMM kernel (kRows; clusters of 1). Tasks from the global
// counter (task_counter set) or static striding, as the BF16 kernel.
template <class Cfg, class TmaA, class TmaB, class TmaBmc, class TmaO>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
grouped_fp8_kernel(const __grid_constant__ GemmParams p, const __grid_constant__ Fp8Scales s,
                   const __grid_constant__ TmaA tma_a, const __grid_constant__ TmaB tma_b,
                   const __grid_constant__ TmaBmc tma_b_mc, const __grid_constant__ TmaO tma_o,
                   const __grid_constant__ TmaO tma_h, const OperandShapes shapes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using namespace cute;
  using Storage = typename Cfg::SharedStorage;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<Storage*>(smem_raw);
  constexpr int C = Cfg::kCluster;
  const int warpgroup = threadIdx.x / 128;
  const int rank = C == 1 ? 0 : int(cute::block_rank_in_cluster());
  const int cluster = blockIdx.x / C, num_clusters = gridDim.x / C;
  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(tma_a.get_tma_descriptor());
    prefetch_tma_descriptor(tma_b.get_tma_descriptor());
    if constexpr (C == 2) prefetch_tma_descriptor(tma_b_mc.get_tma_descriptor());
    prefetch_tma_descriptor(tma_o.get_tma_descriptor());
    prefetch_tma_descriptor(tma_h.get_tma_descriptor());
    init_tile_barriers<Cfg>(smem);
  }
  if constexpr (C == 1) {
    __syncthreads();
  } else {
    cute::cluster_arrive_relaxed();
    cute::cluster_wait();
  }
  const bool counter = C == 1 && p.task_counter != nullptr;
  TaskQueue<Storage> queue{smem};

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<56>();
    if (threadIdx.x == 0) {
      auto next_task = [&](int t_static) {
        if (!counter) return t_static;
        const int t = atomicAdd(p.task_counter, 1);
        queue.push(t);
        return t;
      };
      RingPos ring;
      for (int t = next_task(cluster); t < p.num_tasks; t = next_task(t + num_clusters)) {
        const Task task = decode_task<Cfg>(p, t, rank);
        if (task.skip || task.k_begin >= task.k_end) continue;
#pragma unroll 1
        for (int sub = 0; sub < Cfg::kPairs; ++sub) {
          fp8_load_task<Cfg>(smem, tma_a, tma_b, tma_b_mc, shapes, s, sub_task<Cfg>(task, sub),
                             rank, ring);
        }
      }
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<224>();
    const int ctid = threadIdx.x - 128;
    typename Cfg::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(ctid);
    Tensor sA = make_tensor(make_smem_ptr(smem.a), typename Cfg::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(smem.b), typename Cfg::SmemLayoutB{});
    Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));
    Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));
    Tensor accum = partition_fragment_C(tiled_mma, Shape<Int<Cfg::BM>, Int<Cfg::BN>>{});
    Tensor part = partition_fragment_C(tiled_mma, Shape<Int<Cfg::BM>, Int<Cfg::BN>>{});
    Tensor part2 = partition_fragment_C(tiled_mma, Shape<Int<Cfg::BM>, Int<Cfg::BN>>{});
    static_assert(decltype(size(accum))::value == Cfg::BN / 2,
                  "one 64 x BN WGMMA accumulator per consumer warpgroup");
    Tensor tCcD = thr_mma.partition_C(make_identity_tensor(Shape<Int<Cfg::BM>, Int<Cfg::BN>>{}));
    const int wg = warpgroup - 1;
    EpilogueState es{wg, ctid % 128, int(get<0>(tCcD(0))) - 64 * wg, int(get<1>(tCcD(0))), 0};
    auto next_task = [&](int t_static) { return counter ? queue.pop() : t_static; };
    RingPos ring;
    for (int t = next_task(cluster); t < p.num_tasks; t = next_task(t + num_clusters)) {
      const Task task = decode_task<Cfg>(p, t, rank);
      if (task.skip) continue;
      // kSwiGLUBwd reads h from global memory in the epilogue: ask L2 for it first.
      if constexpr (Cfg::epi == Epi::kSwiGLUBwd) prefetch_h<Cfg>(p, task, ctid);
      const bool has_k = task.k_begin < task.k_end;
#pragma unroll 1
      for (int sub = 0; sub < Cfg::kPairs; ++sub) {
        const Task st = sub_task<Cfg>(task, sub);
        if (has_k)
          fp8_mma_task<Cfg>(smem, tiled_mma, tCrA, tCrB, accum, part, part2, s, st, es, ring);
        if (task.store) {
          tile_epilogue<Cfg>(smem, es, p, st, accum, has_k, tma_o, tma_h);
          if constexpr (Cfg::kQuantAct) quantize_act_pair<Cfg>(smem, p, es, st, sub, accum);
        }
      }
    }
    if (es.wg_thread == 0) tma_store_wait<0>();
  }
  // A CTA of a cluster stays until its peer no longer multicasts into its shared memory or
  // arrives on its barriers.
  if constexpr (C == 2) {
    __syncwarp();
    cute::cluster_sync();
  }
#endif
}

}  // namespace megatron_mok::gemm
