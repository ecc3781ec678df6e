// Core v6 (opt-in, MOK_GEMM_PINGPONG=1): the standalone grouped-GEMM kernel with ping-pong
// consumers. Each consumer warpgroup owns whole 128 x 128 tiles (two 64 x 128 WGMMA atoms,
// 128 fp32 accumulators per thread, as in the cooperative kernel) and the two warpgroups
// take the tiles in turn, so that one's epilogue runs while the other's WGMMAs keep the
// tensor cores busy. In the cooperative kernel (grouped_gemm.cuh) both warpgroups share a
// 128 x 256 tile and the tensor cores idle during every epilogue: 0.58-0.76 of the peak on
// the fused dgrad + SwiGLU backward, whose epilogue is ~6 500 instructions per thread.
//
// The producer is the cooperative kernel's: it loads every task's K stages (and, for the
// SwiGLU backward, its h chunks) into the ring in task order. Both warpgroups read every
// task id from the queue; the n-th task that has work belongs to warpgroup n % 2, and the
// other warpgroup steps its ring position over that task's stages. A stage is read by one
// warpgroup, so its empty barrier counts 128 arrivals. Cost against the cooperative tile:
// 32 KB of A + B per 2.1 MFLOP instead of 48 KB per 4.2 MFLOP (1.33x the L2->SM bytes).
// Every output element keeps one owner and the same K order: deterministic, independent of
// the grid size.
#pragma once

#include "gemm/tile.cuh"

namespace megatron_mok::gemm {

// The epilogue of one 128 x BN tile by its warpgroup: its two 64-row WGMMA atoms in turn,
// each written like the cooperative kernel's 64-row slice (atom m holds accumulator
// elements [64 m, 64 m + 64), rows 64 m + row_t + 8 * half). kSwiGLUBwd reads each h
// chunk (128 rows) once for both atoms.
template <class Cfg, class Storage, class Acc, class TmaO, class TmaH, class HSrc>
__device__ __forceinline__ void pingpong_epilogue(Storage& smem, EpilogueState& es,
                                                  const GemmParams& p, const Task& task,
                                                  Acc& accum, const TmaO& tma_o,
                                                  const TmaH& tma_h, HSrc&& hsrc) {
  using namespace cute;
  constexpr int BM = Cfg::BM, BN = Cfg::BN, CW = Cfg::kChunkCols;
  constexpr int kAtom = BN / 2;  // accumulator elements per thread and 64-row atom
  static_assert(Cfg::group == Grouping::kRows && Cfg::epi != Epi::kSwiGLU,
                "ping-pong: row-table GEMMs with a plain or SwiGLU-backward epilogue");
  const int m0 = task.m_tile * BM;
  if constexpr (Cfg::epi == Epi::kStore) {
    Tensor mO = tma_o.get_tma_tensor(make_shape(p.rows_cap, p.N, 1));
    CUTE_UNROLL
    for (int m = 0; m < 2; ++m) {
      CUTE_UNROLL
      for (int q = 0; q < BN / CW; ++q) {
        if (task.n_tile * BN + q * CW < p.N) {
          emit_chunk<Cfg>(smem, es, tma_o, mO, 2 * task.m_tile + m,
                          task.n_tile * (BN / CW) + q, 0, q * (CW / 8), [&](int i) {
                            return make_float2(accum(i + kAtom * m), accum(i + 1 + kAtom * m));
                          });
        }
      }
    }
  } else {  // kSwiGLUBwd: acc = d_act (A already scaled: no row_scale here); d_h = [d_gate,
            // d_up] as planes of the h view
    Tensor mH = tma_h.get_tma_tensor(make_shape(p.rows_cap, p.N, 2));
    constexpr int kPer = CW / 2;
    CUTE_UNROLL
    for (int q = 0; q < BN / CW; ++q) {
      if (task.n_tile * BN + q * CW < p.N) {
        const int col_chunk = task.n_tile * (BN / CW) + q, base = 4 * q * (CW / 8);
        hsrc.begin_chunk();
        CUTE_UNROLL
        for (int m = 0; m < 2; ++m) {
          // d_gate into registers, d_up into the accumulator it came from (as the
          // cooperative epilogue does; the same arithmetic per value).
          float dg[kPer];
          CUTE_UNROLL
          for (int jb = 0; jb < CW / 8; ++jb) {
            CUTE_UNROLL
            for (int half = 0; half < 2; ++half) {
              const int i = 4 * (q * (CW / 8) + jb) + 2 * half, l = 4 * jb + 2 * half;
              const int rl = 64 * m + es.row_t + 8 * half, cl = es.col_t + 8 * jb;
              float2 g2, u2;
              hsrc.load(rl, cl, m0 + rl, task.n_tile * BN + q * CW + cl, g2, u2);
              const float gs[2] = {g2.x, g2.y}, us[2] = {u2.x, u2.y};
              CUTE_UNROLL
              for (int j = 0; j < 2; ++j) {
                swiglu_bwd_value(accum(i + j + kAtom * m), dg[l + j], 1.f, gs[j], us[j],
                                 sigmoid_fast(gs[j]));
              }
            }
          }
          emit_chunk<Cfg>(smem, es, tma_h, mH, 2 * task.m_tile + m, col_chunk, 0, q * (CW / 8),
                          [&](int i) { return make_float2(dg[i - base], dg[i - base + 1]); });
          emit_chunk<Cfg>(smem, es, tma_h, mH, 2 * task.m_tile + m, col_chunk, 1, q * (CW / 8),
                          [&](int i) {
                            return make_float2(accum(i + kAtom * m), accum(i + 1 + kAtom * m));
                          });
        }
        hsrc.end_chunk();
      }
    }
  }
}

// Same parameters as grouped_gemm_kernel (tma_b_mc unused: single-CTA only).
template <class Cfg, bool kHRing, class TmaA, class TmaB, class TmaBmc, class TmaO, class TmaHIn>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
grouped_gemm_pingpong_kernel(const __grid_constant__ GemmParams p,
                             const __grid_constant__ TmaA tma_a, const __grid_constant__ TmaB tma_b,
                             const __grid_constant__ TmaBmc tma_b_mc,
                             const __grid_constant__ TmaO tma_o, const __grid_constant__ TmaO tma_h,
                             const __grid_constant__ TmaHIn tma_h_in, const OperandShapes shapes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using namespace cute;
  using Storage = typename Cfg::SharedStorage;
  static_assert(Cfg::kCluster == 1 && Cfg::group == Grouping::kRows && Cfg::BN == 128,
                "ping-pong: single-CTA row-table GEMMs on 128 x 128 tiles");
  static_assert(kHRing == (Cfg::epi == Epi::kSwiGLUBwd),
                "ping-pong's SwiGLU backward reads h through the ring");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<Storage*>(smem_raw);
  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(tma_a.get_tma_descriptor());
    prefetch_tma_descriptor(tma_b.get_tma_descriptor());
    prefetch_tma_descriptor(tma_o.get_tma_descriptor());
    prefetch_tma_descriptor(tma_h.get_tma_descriptor());
    if constexpr (kHRing) prefetch_tma_descriptor(tma_h_in.get_tma_descriptor());
    init_tile_barriers<Cfg>(smem, 1, 128);
    for (int w = 0; w < 2; ++w) cutlass::arch::ClusterBarrier::init(&smem.mma_turn[w], 1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const bool counter = p.task_counter != nullptr;
  TaskQueue<Storage> queue{smem};

  if (warpgroup == 0) {
    // ---------------- producer: the cooperative kernel's (produce_tasks) ----------------
    cutlass::arch::warpgroup_reg_dealloc<56>();
    if (threadIdx.x == 0) {
      produce_tasks<Cfg, kHRing>(smem, queue, p, counter, blockIdx.x, gridDim.x, 0, tma_a,
                                 tma_b, tma_b, tma_h_in, shapes);
    }
  } else {
    // ---------------- consumers: alternate tiles ----------------
    cutlass::arch::warpgroup_reg_alloc<224>();
    const int wg = warpgroup - 1, wg_thread = threadIdx.x % 128;
    auto tiled_mma = make_tiled_mma(typename Cfg::MmaOp{}, Layout<Shape<_1, _1, _1>>{});
    auto thr_mma = tiled_mma.get_thread_slice(wg_thread);
    Tensor sA = make_tensor(make_smem_ptr(smem.a), typename Cfg::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(smem.b), typename Cfg::SmemLayoutB{});
    Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));
    Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));
    Tensor accum = partition_fragment_C(tiled_mma, Shape<Int<Cfg::BM>, Int<Cfg::BN>>{});
    static_assert(decltype(size(accum))::value == Cfg::BM * Cfg::BN / 128,
                  "one warpgroup holds the whole tile");
    Tensor tCcD = thr_mma.partition_C(make_identity_tensor(Shape<Int<Cfg::BM>, Int<Cfg::BN>>{}));
    EpilogueState es{wg, wg_thread, int(get<0>(tCcD(0))), int(get<1>(tCcD(0))), 0};

    auto next_task = [&](int t_static) { return counter ? queue.pop() : t_static; };
    RingPos ring;
    int turn = 0;  // tasks with work seen so far; task n belongs to warpgroup n % 2
    // The mainloops take turns (v6.1): a warpgroup starts a tile's WGMMAs only once the
    // other has issued and finished its previous tile's, so one's epilogue lines up with
    // the other's mainloop instead of the two drifting into step (v6 measured slower
    // without this). Warpgroup 0's first tile does not wait. The turn is also what keeps
    // the step-over safe: a full-barrier wait tells laps apart only by parity, so a
    // warpgroup must not wait on a stage two laps ahead of the producer. After the turn
    // the other warpgroup's K stages are all filled, and the stage's previous fill (6
    // positions back, at most 2 h chunks in between) is done. v6 without the turn relied
    // on the task queue for this, which the static scheduler does not give (review of
    // 13c3e55).
    int turn_phase = 0, my_tiles = 0;
    for (int t = next_task(blockIdx.x); t < p.num_tasks; t = next_task(t + gridDim.x)) {
      const Task task = decode_task<Cfg>(p, t, 0);
      if (task.skip || task.k_begin >= task.k_end) continue;
      if ((turn++ & 1) != wg) {  // the other warpgroup's: step over its stages
        int stages = task.k_end - task.k_begin;
        if constexpr (kHRing) stages += h_chunks<Cfg>(p, task);
        for (int s = 0; s < stages; ++s) ring.advance<Cfg::Stages>();
        continue;
      }
      if (wg == 1 || my_tiles > 0) {
        cutlass::arch::ClusterBarrier::wait(&smem.mma_turn[wg], turn_phase);
        turn_phase ^= 1;
      }
      ++my_tiles;
      mma_task<Cfg>(smem, tiled_mma, tCrA, tCrB, accum, task.k_begin, task.k_end, ring,
                    wg_thread);
      // The other warpgroup's turn (an arrival nobody waits for at the end is harmless).
      if (wg_thread == 0) cutlass::arch::ClusterBarrier::arrive(&smem.mma_turn[wg ^ 1]);
      if constexpr (kHRing) {
        pingpong_epilogue<Cfg>(smem, es, p, task, accum, tma_o, tma_h,
                               HFromRing<Cfg, Storage>{smem, ring});
      } else {
        pingpong_epilogue<Cfg>(smem, es, p, task, accum, tma_o, tma_h, HFromGlobal{p});
      }
    }
    if (es.wg_thread == 0) tma_store_wait<0>();  // smem must outlive the stores' reads
  }
#endif
}

}  // namespace megatron_mok::gemm
