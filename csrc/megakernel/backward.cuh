// The backward megakernel, dgrad half (issue 6; docs/megakernel.md, "Backward megakernel"):
// one persistent launch runs the routed experts' data gradients of a layer at EP = 1:
//
//   pull dy rows and their router weights
//     -> fc2 dgrad with the router weight and the SwiGLU backward in its epilogue (d_h from
//        the saved h; the partial <dy, y_row> per column tile for d_topk_w and w * act for
//        dW2, from act recomputed there)
//     -> fc1 dgrad (dx rows, read in place by the combine)
//
// Same machinery as the forward's spread mode (forward.cuh): producer warps 1..3 of every
// CTA are row movers; thread 0 draws tasks of a skewed topological order
// (decode_pair_task: dgrad(0), dgrad(1), dx(0), ...) and waits (acquire) for pulled[m] ==
// 128 before a dgrad tile and dh_done[m] == 2 * dgrad column tiles before a dx tile; the
// consumer warpgroups run the grouped-GEMM core's CfgDgradSwiGLU and CfgRowsNN tiles
// (one shared-memory layout: A K-major, B MN-major, BN = 256) and publish d_h halves.
// With kWgrad, the weight gradients follow in the same launch (phase 2): once every dgrad
// task has been drawn, the task counter hands out the core's wgrad tiles (dW2[e] =
// dy_rows_e^T act_scaled_e, then dW1[e] = d_h_e^T x_rows_e), each waiting (acquire) only for
// its expert's row tiles' fc2-dgrad epilogues (they write d_h and act_scaled). They run on the same ring and barriers (the
// wgrad configuration's shared memory has the same byte layout), stored as bf16 or added
// into fp32 planes (Megatron's main_grad) by TMA reduce-add, one owner per tile and the
// row-table order as K: the bits of the core's wgrad launches.
//
// Every output has one owner and a fixed order: the pulled rows and weights are copies (as
// ops.pull_rows makes them), the tiles are computed as the core's launches compute them, so
// dy_rows, row_w, dots_part, act_scaled, d_h and dx rows are bitwise those of the launch
// chain and independent of the minibatch and the grid. Counters start at zero and the last CTA
// zeroes them (stream order).
#pragma once

#include "gemm/tile.cuh"
#include "megakernel/counters.cuh"
#include "megakernel/forward.cuh"

namespace megatron_mok::megakernel {

struct BackwardParams {
  gemm::GemmParams dgrad;  // d_h = SwiGLU'(h) * w * (dy_rows @ w2[e]): N = I, K = H (h_in = h,
                           // row_scale = row_w, dots_part, act_scaled)
  gemm::GemmParams dx;     // dx_rows = d_h @ w1[e]: N = H, K = 2I
  gemm::OperandShapes dgrad_shapes, dx_shapes;
  int mb_tiles;            // row tiles per minibatch
  // forward_counters_size(m_tiles): pulled[m], dh_done[m], (unused). The workspace's
  // forward counters: the two megakernels must not overlap (they run on one stream).
  int* counters;
  // Row j of the table holds route (peer_rank[j], peer_token[j], peer_k[j]), -1: padding.
  const int* peer_rank;
  const int* peer_token;
  const int* peer_k;
  // dy rows and router weights: this rank's (EP = 1), or the peers' published arena
  // "dy" / "topk_w" through the symmetric-memory bases (EP > 1; dy, topk_w nullptr).
  const uint4* dy;         // [T, H] bf16
  const float* topk_w;     // [T, topk]
  const int64_t* peer_base;
  int64_t dy_offset, w_offset;
  // scatter (EP > 1): dx rows go to their owners' (token, k) slots, as push_rows does
  // (d_topk_w follows from dots_part after the launch); otherwise dx rows stay in place
  // (EP = 1 combine_rows).
  bool scatter;
  int64_t slots_offset;
  uint4* dy_rows;          // [rows, H] dy rows, unscaled (A of fc2 dgrad, of dW2)
  float* row_w;            // [rows] their router weights (0: padding)
  int topk;
  int row_vecs;            // H / 8
  Watchdog dog;
  int hold_tile;           // tests: the tile's last row is never published (-1: none)
  // Phase 2 (kWgrad): dW2 = dy_rows^T act_scaled (M = H, N = I), dW1 = d_h^T x_rows (M = 2I, N = H),
  // tokens as K; num_tasks 0 when the launch has no phase 2.
  gemm::GemmParams wgrad2, wgrad1;
  gemm::OperandShapes wgrad2_shapes, wgrad1_shapes;
};

// Phase 2's TMA atoms: [0] dW2 (A = dy_rows, B = act_scaled), [1] dW1 (A = d_h, B = x_rows), both
// operands MN-major; the two GEMMs' atoms have one type each.
template <class TmaA, class TmaB, class TmaO>
struct WgradTmas {
  TmaA a[2];
  TmaB b[2];
  TmaO out[2];
};
struct NoWgrad {};

__device__ __forceinline__ int* bwd_pulled_counter(const BackwardParams& p, int m) {
  return p.counters + kCounterHeader + m;
}
__device__ __forceinline__ int* dh_counter(const BackwardParams& p, int m) {
  return p.counters + kCounterHeader + p.dgrad.m_tiles + m;
}

// One row of the table by one warp: the dy row copied (zeros for padding) and its router
// weight (0 for padding), as ops.pull_rows writes them.
__device__ __forceinline__ void backward_pull_row(const BackwardParams& p, int64_t j, int lane) {
  const int n = p.row_vecs;
  uint4* dst = p.dy_rows + j * n;
  const int rank = __ldg(p.peer_rank + j);
  if (rank < 0) {
    for (int v = lane; v < n; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
    if (lane == 0) p.row_w[j] = 0.f;
    return;
  }
  const int64_t token = __ldg(p.peer_token + j);
  const int64_t route = token * p.topk + __ldg(p.peer_k + j);
  const uint4* src = (p.dy != nullptr ? p.dy
                                      : peer_ptr<const uint4>(p.peer_base, rank, p.dy_offset)) +
                     token * n;
  if (lane == 0) {
    p.row_w[j] = p.topk_w != nullptr ? __ldg(p.topk_w + route)
                                     : peer_ptr<const float>(p.peer_base, rank, p.w_offset)[route];
  }
  constexpr int kInFlight = 4;  // 16-byte vectors per lane in flight
#pragma unroll 1
  for (int base = lane; base < n; base += 32 * kInFlight) {
    uint4 v[kInFlight];
#pragma unroll
    for (int g = 0; g < kInFlight; ++g) {
      if (base + 32 * g < n) v[g] = __ldg(src + base + 32 * g);
    }
#pragma unroll
    for (int g = 0; g < kInFlight; ++g) {
      if (base + 32 * g < n) dst[base + 32 * g] = v[g];
    }
  }
}

// Producer warps 1..3 of every CTA: rows g, g + G, ... of the table (G = 3 x #CTAs), each
// published on its own once its stores are fenced for the TMA loads of fc2 dgrad.
//
// A mover warp keeps few vectors per lane in flight (56 registers), so without help each
// row costs several dependent DRAM round trips (table entries, router weight, passes of
// loads): measured at 1792cfb, the layer backward was 21 % slower than the launch chain on
// qwen3-30b-a3b. So while row j is worked on, lane 0 asks L2 for the next row's dy row
// (bulk prefetch: no data registers held; the next token is carried across iterations)
// and loads the table entries of the row after it; the row's loads then hit L2.
__device__ __forceinline__ void backward_pull(const BackwardParams& p, int used_tiles,
                                              int mover, int movers_per_cta) {
  const int lane = threadIdx.x % 32;
  const int64_t movers = int64_t(gridDim.x) * movers_per_cta;
  const int64_t rows = int64_t(used_tiles) * 128;
  const int64_t first = int64_t(blockIdx.x) * movers_per_cta + mover;
  // Table entries of the next row this warp pulls (lane 0; token < 0: padding or none).
  int next_token = -1;
  if (lane == 0 && first + movers < rows && __ldg(p.peer_rank + first + movers) >= 0) {
    next_token = __ldg(p.peer_token + first + movers);
  }
  for (int64_t j = first; j < rows; j += movers) {
    if (lane == 0 && j + movers < rows) {
      if (next_token >= 0) {  // padding rows read nothing
        // EP = 1 only: the peers' dy is read over NVLink, not through this L2.
        if (p.dy != nullptr) {
          bulk_prefetch_l2(p.dy + int64_t(next_token) * p.row_vecs, uint32_t(p.row_vecs) * 16u);
        }
      }
      const int64_t after = j + 2 * movers;  // loads in flight while row j is pulled
      next_token = after < rows && __ldg(p.peer_rank + after) >= 0 ? __ldg(p.peer_token + after)
                                                                    : -1;
    }
    backward_pull_row(p, j, lane);
    fence_proxy_async_global();  // this lane's generic writes -> the dgrad tiles' TMA reads
    __syncwarp();
    const int m = int(j / 128);
    if (lane == 0 && !(m == p.hold_tile && j % 128 == 127)) {
      red_release_gpu_add(bwd_pulled_counter(p, m), 1);
    }
  }
}

// A phase-2 task u (u < wgrad2.num_tasks: dW2, else dW1) as the core's wgrad launch decodes it.
template <class CfgW>
__device__ __forceinline__ gemm::Task decode_wgrad_task(const BackwardParams& p, int u,
                                                        bool& second) {
  second = u >= p.wgrad2.num_tasks;
  return gemm::decode_task<CfgW>(second ? p.wgrad1 : p.wgrad2,
                                 second ? u - p.wgrad2.num_tasks : u, 0);
}

// tma_h: h as (rows, I, 2) boxes, loaded through the ring for the fc2-dgrad tiles' SwiGLU
// backward (core v5, as the standalone dgrad launch does).
// kWgrad: CfgW is the core's wgrad configuration (bf16 store or fp32 reduce-add) and WTmas
// a WgradTmas; otherwise NoWgrad.
template <class CfgD, class CfgX, class CfgW, class WTmas, class TmaAD, class TmaBD, class TmaOD,
          class TmaAX, class TmaBX, class TmaOX, class TmaH>
__global__ void __launch_bounds__(CfgD::kThreads, 1)
moe_backward_kernel(const __grid_constant__ BackwardParams p,
                    const __grid_constant__ TmaAD tma_dout, const __grid_constant__ TmaBD tma_w2,
                    const __grid_constant__ TmaOD tma_dh, const __grid_constant__ TmaOD tma_dh_halves,
                    const __grid_constant__ TmaAX tma_dh_in, const __grid_constant__ TmaBX tma_w1,
                    const __grid_constant__ TmaOX tma_dx, const __grid_constant__ TmaH tma_h,
                    const __grid_constant__ WTmas wgrad) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using namespace cute;
  using Storage = typename CfgD::SharedStorage;
  static_assert(std::is_same_v<Storage, typename CfgX::SharedStorage>,
                "fc2-dgrad and fc1-dgrad tiles share one shared-memory layout");
  static_assert(std::is_same_v<typename CfgD::TiledMma, typename CfgX::TiledMma>,
                "fc2-dgrad and fc1-dgrad tiles run the same WGMMA");
  static_assert(CfgD::kCluster == 1 && CfgX::kCluster == 1, "the megakernel runs 1-CTA clusters");
  constexpr bool kWgrad = !std::is_same_v<WTmas, NoWgrad>;
  // Phase 2 reads the same shared memory as its own storage type: the ring, the barriers
  // and the task queue must lie at the same offsets (the epilogue buffers differ in
  // element type only).
  using StorageW = typename CfgW::SharedStorage;
  static_assert(!kWgrad || (sizeof(StorageW) == sizeof(Storage) && CfgW::Stages == CfgD::Stages &&
                            offsetof(StorageW, a) == offsetof(Storage, a) &&
                            offsetof(StorageW, b) == offsetof(Storage, b) &&
                            offsetof(StorageW, epi) == offsetof(Storage, epi) &&
                            offsetof(StorageW, full) == offsetof(Storage, full) &&
                            offsetof(StorageW, empty) == offsetof(Storage, empty) &&
                            offsetof(StorageW, task_full) == offsetof(Storage, task_full) &&
                            offsetof(StorageW, task_id) == offsetof(Storage, task_id)),
                "the wgrad tiles run on the dgrad tiles' ring");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<Storage*>(smem_raw);
  auto& smem_w = *reinterpret_cast<StorageW*>(smem_raw);
  const int used_tiles = used_row_tiles(p.dgrad);
  const int num_tasks = used_tiles * (p.dgrad.n_tiles + p.dx.n_tiles);
  const int all_tasks = num_tasks + (kWgrad ? p.wgrad2.num_tasks + p.wgrad1.num_tasks : 0);
  const int k_dgrad = (p.dgrad.K + CfgD::BK - 1) / CfgD::BK;
  const int k_dx = (p.dx.K + CfgX::BK - 1) / CfgX::BK;

  const int warpgroup = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    prefetch_tma_descriptor(tma_dout.get_tma_descriptor());
    prefetch_tma_descriptor(tma_w2.get_tma_descriptor());
    prefetch_tma_descriptor(tma_dh.get_tma_descriptor());
    prefetch_tma_descriptor(tma_dh_halves.get_tma_descriptor());
    prefetch_tma_descriptor(tma_dh_in.get_tma_descriptor());
    prefetch_tma_descriptor(tma_w1.get_tma_descriptor());
    prefetch_tma_descriptor(tma_dx.get_tma_descriptor());
    prefetch_tma_descriptor(tma_h.get_tma_descriptor());
    if constexpr (kWgrad) {
      for (int g = 0; g < 2; ++g) {
        prefetch_tma_descriptor(wgrad.a[g].get_tma_descriptor());
        prefetch_tma_descriptor(wgrad.b[g].get_tma_descriptor());
        prefetch_tma_descriptor(wgrad.out[g].get_tma_descriptor());
      }
    }
    gemm::init_tile_barriers<CfgD>(smem, 1);
  }
  __syncthreads();
  gemm::TaskQueue<Storage> queue{smem};
  int* task_counter = p.counters + kTaskCounter;

  if (warpgroup == 0) {
    // ---------------- producer: warps 1..3 pull, thread 0 loads ----------------
    cutlass::arch::warpgroup_reg_dealloc<56>();
    const int ptid = threadIdx.x;
    if (ptid >= 32) {
      backward_pull(p, used_tiles, ptid / 32 - 1, 3);
    } else if (ptid == 0) {
      gemm::RingPos ring;
      const int dh_target = 2 * p.dgrad.n_tiles;
      int ready_expert[2] = {-1, -1};  // phase 2: the last expert checked, per weight
      while (true) {
        const int t = atomicAdd(task_counter, 1);
        queue.push(t);
        if (t >= all_tasks) break;
        if (t >= num_tasks) {
          if constexpr (kWgrad) {  // phase 2: a weight-gradient tile of one expert
            bool second;
            const gemm::Task task = decode_wgrad_task<CfgW>(p, t - num_tasks, second);
            if (task.k_begin >= task.k_end) continue;  // no rows: the epilogue stores zeros
            // The expert's row tiles (segments start on 128-row boundaries): their fc2-dgrad
            // epilogues done (d_h for dW1, act_scaled for dW2, whose dy rows were pulled
            // before them). Every dgrad task has been drawn by now,
            // by CTAs that finish it without waiting on phase 2: no deadlock. Tasks come
            // expert by expert, so this thread checks an expert once: the acquire loads
            // are serial L2 round trips (16 per deepseek-v3 expert) that would otherwise
            // stall the ring before every tile (measured: the wgrad tiles ran 9-15 %
            // slower in here than in their own launch at 925ccb4).
            if (task.expert != ready_expert[second]) {
              const int m_end = (task.k_end * CfgW::BK + 127) / 128;
              for (int m = task.k_begin * CfgW::BK / 128; m < m_end; ++m) {
                wait_counter(dh_counter(p, m), dh_target, p.dog, kWaitDhDone, m);
              }
              fence_proxy_async_global();
              ready_expert[second] = task.expert;
            }
            gemm::load_task<CfgW>(smem_w, wgrad.a[second], wgrad.b[second], wgrad.b[second],
                                  second ? p.wgrad1_shapes : p.wgrad2_shapes, task, 0, ring);
          }
          continue;
        }
        const ForwardTask task =
            decode_pair_task(p.dgrad, p.dx, p.mb_tiles, t, used_tiles, k_dgrad, k_dx);
        const int m = task.tile.m_tile;
        if (!task.fc2) {  // fc2 dgrad: its dy rows pulled
          wait_counter(bwd_pulled_counter(p, m), 128, p.dog, kWaitDyPulled, m);
          fence_proxy_async_global();
          gemm::load_task<CfgD>(smem, tma_dout, tma_w2, tma_w2, p.dgrad_shapes, task.tile, 0,
                                ring);
          gemm::load_h_chunks<CfgD>(smem, tma_h, p.dgrad, task.tile, ring);
        } else {  // fc1 dgrad: both halves of every d_h column tile of the row tile
          wait_counter(dh_counter(p, m), dh_target, p.dog, kWaitDhDone, m);
          fence_proxy_async_global();
          gemm::load_task<CfgX>(smem, tma_dh_in, tma_w1, tma_w1, p.dx_shapes, task.tile, 0,
                                ring);
        }
      }
    }
  } else {
    // ---------------- consumers: WGMMA, epilogue, publish ----------------
    cutlass::arch::warpgroup_reg_alloc<224>();
    const int ctid = threadIdx.x - 128;
    typename CfgD::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(ctid);
    Tensor sA = make_tensor(make_smem_ptr(smem.a), typename CfgD::SmemLayoutA{});
    Tensor sB = make_tensor(make_smem_ptr(smem.b), typename CfgD::SmemLayoutB{});
    Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));
    Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));
    Tensor accum = partition_fragment_C(tiled_mma, Shape<Int<CfgD::BM>, Int<CfgD::BN>>{});
    Tensor tCcD =
        thr_mma.partition_C(make_identity_tensor(Shape<Int<CfgD::BM>, Int<CfgD::BN>>{}));
    const int wg = warpgroup - 1;
    gemm::EpilogueState es{wg, ctid % 128, int(get<0>(tCcD(0))) - 64 * wg,
                           int(get<1>(tCcD(0))), 0};
    gemm::RingPos ring;
    for (int t = queue.pop(); t < all_tasks; t = queue.pop()) {
      if (t >= num_tasks) {
        if constexpr (kWgrad) {
          // Phase 2: the wgrad tiles' WGMMAs read both operands MN-major from the same
          // stages; their accumulator has the dgrad tiles' layout (same 64 x 256 atoms).
          typename CfgW::TiledMma mma_w;
          auto thr_w = mma_w.get_thread_slice(ctid);
          Tensor tCrAw = thr_w.make_fragment_A(thr_w.partition_A(
              make_tensor(make_smem_ptr(smem_w.a), typename CfgW::SmemLayoutA{})));
          Tensor tCrBw = thr_w.make_fragment_B(thr_w.partition_B(
              make_tensor(make_smem_ptr(smem_w.b), typename CfgW::SmemLayoutB{})));
          static_assert(std::is_same_v<decltype(partition_fragment_C(
                                           mma_w, Shape<Int<CfgW::BM>, Int<CfgW::BN>>{})),
                                       decltype(accum)>,
                        "the wgrad tiles reuse the dgrad tiles' accumulator");
          bool second;
          const gemm::Task task = decode_wgrad_task<CfgW>(p, t - num_tasks, second);
          const bool has_k = task.k_begin < task.k_end;
          if (has_k) {
            gemm::mma_task<CfgW>(smem_w, mma_w, tCrAw, tCrBw, accum, task.k_begin, task.k_end,
                                 ring, es.wg_thread);
          }
          gemm::tile_epilogue<CfgW>(smem_w, es, second ? p.wgrad1 : p.wgrad2, task, accum,
                                    has_k, wgrad.out[second], wgrad.out[second]);
        }
        continue;
      }
      const ForwardTask task =
          decode_pair_task(p.dgrad, p.dx, p.mb_tiles, t, used_tiles, k_dgrad, k_dx);
      gemm::mma_task<CfgD>(smem, tiled_mma, tCrA, tCrB, accum, task.tile.k_begin,
                           task.tile.k_end, ring, es.wg_thread);
      if (!task.fc2) {
        gemm::tile_epilogue<CfgD>(smem, es, p.dgrad, task.tile, accum, true, tma_dh,
                                  tma_dh_halves, gemm::HFromRing<CfgD, Storage>{smem, ring});
        if (es.wg_thread == 0) publish_tile(dh_counter(p, task.tile.m_tile));
      } else if (p.scatter) {  // EP > 1: dx rows into their owners' slots
        scatter_rows_epilogue<CfgX>(smem, es, p, p.dx, task.tile, accum, tma_dx, false);
      } else {
        gemm::tile_epilogue<CfgX>(smem, es, p.dx, task.tile, accum, true, tma_dx, tma_dx);
      }
    }
    if (es.wg_thread == 0) bulk_store_wait_all();
  }

  zero_counters_on_exit(p.counters, p.dgrad.m_tiles, smem.task_id[0]);
#endif
}

}  // namespace megatron_mok::megakernel
