// The standalone grouped-GEMM kernel: one persistent launch runs every tile task of one
// GEMM (fc1 + SwiGLU, fc2, a dgrad or a weight gradient) on the pieces of tile.cuh.
//
// Scheduling. Static: CTA (cluster) b takes tasks b, b + grid, ... Counter: the producer
// takes the next task from a global counter (tasks start in index order, a CTA that drew
// short tiles takes more) and hands it to the consumers through the task queue. Either way
// a tile has one owner and a fixed K order, so the results are the same bits.
#pragma once

#include "gemm/tile.cuh"

namespace megatron_mok::gemm {

// tma_b_mc: B as halves multicast to both CTAs of a cluster (C = 2; with C = 1, tma_b again).
// kHRing (kSwiGLUBwd, C = 1): the producer loads the epilogue's h chunks through the ring
// with tma_h_in (h as (rows, N, 2)); otherwise the epilogue reads h from global memory and
// tma_h_in is unused.
template <class Cfg, bool kHRing, class TmaA, class TmaB, class TmaBmc, class TmaO, class TmaHIn>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
grouped_gemm_kernel(const __grid_constant__ GemmParams p, const __grid_constant__ TmaA tma_a,
                    const __grid_constant__ TmaB tma_b, const __grid_constant__ TmaBmc tma_b_mc,
                    const __grid_constant__ TmaO tma_o, const __grid_constant__ TmaO tma_h,
                    const __grid_constant__ TmaHIn tma_h_in, const OperandShapes shapes) {
  static_assert(!kHRing || ((Cfg::epi == Epi::kSwiGLUBwd || Cfg::epi == Epi::kActBwd) &&
                            Cfg::kCluster == 1 && Cfg::group == Grouping::kRows),
                "h through the ring: the activation backwards' single-CTA kernels only");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using namespace cute;
  using Storage = typename Cfg::SharedStorage;
  constexpr int C = Cfg::kCluster;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<Storage*>(smem_raw);

  const int warpgroup = threadIdx.x / 128;
  const int rank = C == 1 ? 0 : int(cute::block_rank_in_cluster());
  const int cluster = blockIdx.x / C, num_clusters = gridDim.x / C;
  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(tma_a.get_tma_descriptor());
    prefetch_tma_descriptor(tma_b.get_tma_descriptor());
    if constexpr (C == 2) prefetch_tma_descriptor(tma_b_mc.get_tma_descriptor());
    prefetch_tma_descriptor(tma_o.get_tma_descriptor());
    prefetch_tma_descriptor(tma_h.get_tma_descriptor());
    if constexpr (kHRing) prefetch_tma_descriptor(tma_h_in.get_tma_descriptor());
    if constexpr (Cfg::kGather & kGatherA) prefetch_tma_descriptor(&p.a_row_map);
    if constexpr (Cfg::kGather & kGatherB) prefetch_tma_descriptor(&p.b_row_map);
    // kGather: every producer thread arrives on a stage's full barrier (its row boxes).
    init_tile_barriers<Cfg>(smem, Cfg::kGather ? 128 : 1);
  }
  if constexpr (C == 1) {
    __syncthreads();
  } else {
    cute::cluster_arrive_relaxed();
    cute::cluster_wait();
  }

  const bool counter = C == 1 && p.task_counter != nullptr && !Cfg::kGather;
  TaskQueue<Storage> queue{smem};

  if (warpgroup == 0) {
    // ---------------- producer: one thread feeds the ring ----------------
    cutlass::arch::warpgroup_reg_dealloc<56>();
    if constexpr (Cfg::kGather) {  // the whole warpgroup gathers rows
      gather_produce_tasks<Cfg>(smem, p, cluster, num_clusters, tma_a, tma_b, shapes,
                                threadIdx.x);
    } else if (threadIdx.x == 0) {
      produce_tasks<Cfg, kHRing>(smem, queue, p, counter, cluster, num_clusters, rank, tma_a,
                                 tma_b, tma_b_mc, tma_h_in, shapes);
    }
  } else {
    // ---------------- consumers: WGMMA + epilogue ----------------
    cutlass::arch::warpgroup_reg_alloc<224>();
    const int ctid = threadIdx.x - 128;
    typename Cfg::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(ctid);
    Tensor sA = make_tensor(make_smem_ptr(smem.a), typename Cfg::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(smem.b), typename Cfg::SmemLayoutB{});
    Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));  // (MMA, M, K, S) descriptors
    Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));
    Tensor accum = partition_fragment_C(tiled_mma, Shape<Int<Cfg::BM>, Int<Cfg::BN>>{});
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
      if constexpr ((Cfg::epi == Epi::kSwiGLUBwd || Cfg::epi == Epi::kActBwd) && !kHRing) {
        prefetch_h<Cfg>(p, task, ctid);
      }
      const bool has_k = task.k_begin < task.k_end;
      if (has_k) {
        mma_task<Cfg>(smem, tiled_mma, tCrA, tCrB, accum, task.k_begin, task.k_end, ring,
                      es.wg_thread);
      }
      if (task.store) {
        if constexpr (kHRing) {
          tile_epilogue<Cfg>(smem, es, p, task, accum, has_k, tma_o, tma_h,
                             HFromRing<Cfg, Storage>{smem, ring});
        } else {
          tile_epilogue<Cfg>(smem, es, p, task, accum, has_k, tma_o, tma_h);
        }
      }
    }
    if (es.wg_thread == 0) tma_store_wait<0>();  // smem must outlive the stores' reads
  }
  // A CTA of a cluster stays until its peer no longer multicasts into its shared memory
  // or arrives on its barriers.
  if constexpr (C == 2) {
    __syncwarp();  // the producer warp diverged; cluster barriers are .aligned
    cute::cluster_sync();
  }
#endif
}

}  // namespace megatron_mok::gemm
