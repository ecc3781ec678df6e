// The backward megakernel, dgrad half (issue 6; docs/megakernel.md, "Backward megakernel"):
// one persistent launch runs the routed experts' data gradients of a layer at EP = 1:
//
//   pull dy rows scaled by their router weight (+ <dy, y_row> per route, for d_topk_w)
//     -> fc2 dgrad with the SwiGLU backward in its epilogue (d_h, from the saved h)
//     -> fc1 dgrad (dx rows, read in place by the combine)
//
// Same machinery as the forward's spread mode (forward.cuh): producer warps 1..3 of every
// CTA are row movers; thread 0 draws tasks of a skewed topological order
// (decode_pair_task: dgrad(0), dgrad(1), dx(0), ...) and waits (acquire) for pulled[m] ==
// 128 before a dgrad tile and dh_done[m] == 2 * dgrad column tiles before a dx tile; the
// consumer warpgroups run the grouped-GEMM core's CfgDgradSwiGLU and CfgRowsNN tiles
// (one shared-memory layout: A K-major, B MN-major, BN = 256) and publish d_h halves.
// With kWgrad, the weight gradients follow in the same launch (phase 2): once every dgrad
// task has been drawn, the task counter hands out the core's wgrad tiles (dW2[e] = d_out_e^T
// act_e, then dW1[e] = d_h_e^T x_rows_e), each waiting (acquire) only for its expert's row
// tiles: pulled (dW2) or d_h finished (dW1). They run on the same ring and barriers (the
// wgrad configuration's shared memory has the same byte layout), stored as bf16 or added
// into fp32 planes (Megatron's main_grad) by TMA reduce-add, one owner per tile and the
// row-table order as K: the bits of the core's wgrad launches.
//
// Every output has one owner and a fixed order: the pulled rows and the dots are computed
// exactly as ops.pull_rows computes them (comm/row_math.cuh's scale8 and dot8, and 256
// virtual threads' partial sums reduced in its order), the tiles as the core's launches
// compute them, so d_out, dots, d_h and dx rows are bitwise those of the launch chain and
// independent of the minibatch and the grid. Counters start at zero and the last CTA
// zeroes them (stream order).
#pragma once

#include "comm/row_math.cuh"
#include "gemm/tile.cuh"
#include "megakernel/counters.cuh"
#include "megakernel/forward.cuh"

namespace megatron_mok::megakernel {

struct BackwardParams {
  gemm::GemmParams dgrad;  // d_h = SwiGLU'(h) * (d_out @ w2[e]): N = I, K = H (h_in = h)
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
  // scatter (EP > 1): dx rows and dots go to their owners' (token, k) slots and d_topk_w
  // slots, as push_rows does; otherwise dx rows stay in place (EP = 1 combine_rows).
  bool scatter;
  int64_t slots_offset, dtopk_offset;
  const uint4* y_rows;     // [rows, H] the forward's expert rows (dots)
  uint4* d_out;            // [rows, H] dy rows scaled by their router weight (A of fc2 dgrad)
  float* dots;             // [rows] <dy[token], y_rows[j]>
  int topk;
  int row_vecs;            // H / 8
  Watchdog dog;
  int hold_tile;           // tests: the tile's last row is never published (-1: none)
  // Phase 2 (kWgrad): dW2 = d_out^T act (M = H, N = I), dW1 = d_h^T x_rows (M = 2I, N = H),
  // tokens as K; num_tasks 0 when the launch has no phase 2.
  gemm::GemmParams wgrad2, wgrad1;
  gemm::OperandShapes wgrad2_shapes, wgrad1_shapes;
};

// Phase 2's TMA atoms: [0] dW2 (A = d_out, B = act), [1] dW1 (A = d_h, B = x_rows), both
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

// pull_rows runs a row on 256 threads: thread i sums the dots of vectors i, i + 256, ...
// in order, each warp reduces with an xor butterfly and thread 0 adds the 8 warp sums in
// order. One warp reproduces that, kVirtualGroup virtual warps q at a time: lane l sums the
// vectors of virtual thread 32 q + l in order (their loads issued together), the butterfly
// leaves the same bits in every lane (a + b == b + a), and the 8 sums are added in order.
// Each vector is read once and its scaled copy written in the same pass. (Eight partial
// sums at once, or four with their loads, spill the producer's 56 registers; two do not.)
constexpr int kPullVirtualWarps = 8;  // pull_rows' 256 threads
constexpr int kVirtualGroup = 2;      // virtual warps per pass: 2 dy + 2 y vectors in flight

__device__ __forceinline__ void backward_pull_row(const BackwardParams& p, int64_t j, int lane) {
  const int n = p.row_vecs;
  uint4* dst = p.d_out + j * n;
  const int rank = __ldg(p.peer_rank + j);
  if (rank < 0) {  // padding row: zeros for the GEMMs, dot 0
    for (int v = lane; v < n; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
    if (lane == 0) p.dots[j] = 0.f;
    return;
  }
  const int64_t token = __ldg(p.peer_token + j);
  const int64_t route = token * p.topk + __ldg(p.peer_k + j);
  const float w = p.topk_w != nullptr ? __ldg(p.topk_w + route)
                                      : peer_ptr<const float>(p.peer_base, rank, p.w_offset)[route];
  const uint4* src = (p.dy != nullptr ? p.dy
                                      : peer_ptr<const uint4>(p.peer_base, rank, p.dy_offset)) +
                     token * n;
  const uint4* saved = p.y_rows + j * n;
  constexpr int kStride = 32 * kPullVirtualWarps;  // pull_rows' thread count
  float total = 0.f;
#pragma unroll 1
  for (int q0 = 0; q0 < kPullVirtualWarps; q0 += kVirtualGroup) {
    float part[kVirtualGroup];
#pragma unroll
    for (int g = 0; g < kVirtualGroup; ++g) part[g] = 0.f;
#pragma unroll 1
    for (int base = 32 * q0 + lane; base < n; base += kStride) {
      uint4 a[kVirtualGroup], b[kVirtualGroup];
#pragma unroll
      for (int g = 0; g < kVirtualGroup; ++g) {
        const int v = base + 32 * g;
        if (v < n) {
          a[g] = __ldg(src + v);
          b[g] = __ldg(saved + v);
        }
      }
#pragma unroll
      for (int g = 0; g < kVirtualGroup; ++g) {
        const int v = base + 32 * g;
        if (v < n) {
          part[g] += row_math::dot8(a[g], b[g]);
          dst[v] = row_math::scale8(a[g], w);
        }
      }
    }
#pragma unroll
    for (int g = 0; g < kVirtualGroup; ++g) {
      float s = part[g];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
      total += s;
    }
  }
  if (lane == 0) {
    p.dots[j] = total;
    // EP > 1: into the owner's d_topk_w slot, as push_rows' scalars (read after the barrier).
    if (p.scatter) peer_ptr<float>(p.peer_base, rank, p.dtopk_offset)[route] = total;
  }
}

// Producer warps 1..3 of every CTA: rows g, g + G, ... of the table (G = 3 x #CTAs), each
// published on its own once its stores are fenced for the TMA loads of fc2 dgrad.
//
// A mover warp keeps only 2 dy and 2 y vectors per lane in flight (56 registers), so
// without help each row costs ~6 dependent DRAM round trips (table entries, router
// weight, four passes of loads): measured at 1792cfb, the layer backward was 21 % slower
// than the launch chain on qwen3-30b-a3b. So while row j is worked on, lane 0 asks L2 for
// the next row's dy and y rows (bulk prefetch: no data registers held; the next token is
// carried across iterations) and loads the table entries of the row after it; the row's
// loads then hit L2. The data and the order of the
// arithmetic are untouched: the same bits.
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
        bulk_prefetch_l2(p.y_rows + (j + movers) * p.row_vecs, uint32_t(p.row_vecs) * 16u);
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
            // The expert's row tiles (segments start on 128-row boundaries): d_out rows
            // pulled for dW2, d_h finished for dW1. Every dgrad task has been drawn by now,
            // by CTAs that finish it without waiting on phase 2: no deadlock. Tasks come
            // expert by expert, so this thread checks an expert once: the acquire loads
            // are serial L2 round trips (16 per deepseek-v3 expert) that would otherwise
            // stall the ring before every tile (measured: the wgrad tiles ran 9-15 %
            // slower in here than in their own launch at 925ccb4).
            if (task.expert != ready_expert[second]) {
              const int m_end = (task.k_end * CfgW::BK + 127) / 128;
              for (int m = task.k_begin * CfgW::BK / 128; m < m_end; ++m) {
                if (second) {
                  wait_counter(dh_counter(p, m), dh_target, p.dog, kWaitDhDone, m);
                } else {
                  wait_counter(bwd_pulled_counter(p, m), 128, p.dog, kWaitDyPulled, m);
                }
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
