// The forward megakernel (DESIGN section 4, docs/megakernel.md): one persistent launch runs
// the routed expert pass of a layer: pull dispatch -> fc1 + SwiGLU -> fc2 -> push combine.
//
//   CTAs [0, num_comm)      comm: pull the rows of every 128-row tile of the row table into
//                           x_rows (from the peers' symmetric x, or the local x at EP = 1)
//                           and publish pulled[m]; then, tile by tile, wait for fc2_done[m]
//                           and push the finished rows into their owners' (token, k) slots.
//                           Rows move with TMA bulk copies through shared memory
//                           (row_mover.cuh).
//   CTAs [num_comm, grid)   compute: the grouped-GEMM core's CTA (producer warpgroup +
//                           two WGMMA consumer warpgroups) with a task counter over a fixed
//                           topological order: per minibatch of mb_tiles row tiles, its fc1
//                           tiles (banded), then, one minibatch later, its fc2 tiles
//                           (decode_forward_task). The producer waits (acquire)
//                           for the task's inputs before its first TMA load: pulled[m] for
//                           fc1, fc1_done[m] == 2 * fc1 column tiles for fc2. Each consumer
//                           warpgroup publishes its half of a tile once its TMA stores have
//                           completed.
//   Direct mode (EP = 1, num_comm = 0): no comm CTAs; fc1's producer warpgroup gathers its
//                           rows from x itself (gather_fc1_task) and fc2's epilogue writes
//                           the slots (scatter_rows_epilogue); only fc1 -> fc2 is waited on.
//
// Every output tile has one owner and a fixed K order and the copies move bytes unchanged,
// so the result is bitwise independent of num_comm, the minibatch and the grid. Tasks are
// drawn in order and only wait on earlier tasks or on the comm CTAs' pulls, which wait on
// nothing (with an x_rows ring: only on fc1 tasks of earlier minibatches), so the pass
// cannot deadlock while every CTA is resident (a cooperative launch guarantees that).
// Counters start at zero; the last CTA to leave zeroes them for the next launch (stream
// order), so the pass needs no memset and is CUDA-graph capturable.
#pragma once

#include "gemm/tile.cuh"
#include "megakernel/counters.cuh"
#include "megakernel/row_mover.cuh"

namespace megatron_mok::megakernel {

// Layout of the int32 counter buffer: a header, then one counter per row tile and kind.
enum CounterSlot : int { kTaskCounter = 0, kExitCounter = 1, kCounterHeader = 2 };

__host__ __device__ inline int forward_counters_size(int m_tiles) {
  return kCounterHeader + 3 * m_tiles;
}

// Called by every thread of every CTA as it leaves: the last CTA out zeroes the counters
// for the next launch (stream order), so a launch starts from zeros without a memset.
// `flag` is a shared-memory int the CTA no longer uses.
__device__ __forceinline__ void zero_counters_on_exit(int* counters, int m_tiles, int& flag) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    flag = atomicAdd(counters + kExitCounter, 1) == int(gridDim.x) - 1;
  }
  __syncthreads();
  if (flag) {
    __threadfence();
    const int n = forward_counters_size(m_tiles);
    for (int i = threadIdx.x; i < n; i += blockDim.x) counters[i] = 0;
  }
}

// Direct mode's fc1 gather (MOK_MEGAKERNEL_GATHER): one TMA box per row and K step; or
// 16-byte cp.async, each warp instruction reading four whole 128-byte lines or 32 rows.
enum GatherMode : int { kGatherTma = 0, kGatherLines = 1, kGatherRows = 2 };

// Cycle probes (benchmarks/probe_megakernel.py): SM clock cycles summed per CTA by the first
// consumer warpgroup's thread 0 (mainloop: from the task's arrival in the queue until its
// WGMMAs are done, including the wait for the first stage; epilogue: until its stores are
// issued and the tile published) and by the producer's thread 0 (dependency waits).
enum ProbeSlot : int {
  kProbeFc1 = 0,         // fc1: tasks, K steps, mainloop cycles, epilogue cycles
  kProbeFc2 = 4,         // fc2: the same four
  kProbeQueueWait = 8,   // consumer: cycles waiting for the next task id
  kProbeDepWait = 9,     // producer: cycles waiting for pulled[m] / fc1_done[m]
  kProbeScratch = 12,    // consumer's timestamps: end of the last task, queue pop, mainloop
  kProbeSlots = 16
};

struct ForwardParams {
  gemm::GemmParams fc1;   // N = I (act columns), K = H; SwiGLU epilogue
  gemm::GemmParams fc2;   // N = H, K = I
  gemm::OperandShapes fc1_shapes, fc2_shapes;
  int mb_tiles;           // row tiles per minibatch
  int ring_tiles;         // comm mode: x_rows holds this many row tiles, tile m in slot
                          // m % ring_tiles (0: every tile has its own rows)
  int mover_lag;          // rows in flight each way per mover warp (mover_lag())
  int mover_warps;        // row movers (warps) per comm CTA, 1..kMaxMoverWarps
  int num_comm;           // comm CTAs
  // Spread mode (no comm CTAs, rows still pulled into x_rows): producer warps 1-3 of every
  // CTA pull rows with register copies, one release per row (pull_target = 128 per tile);
  // comm mode's movers release once per warp and tile (pull_target = mover_warps).
  bool spread;
  int pull_target;
  int* counters;          // forward_counters_size(m_tiles) int32, zero at launch
  // Rows: row j of the table holds route (peer_rank[j], peer_token[j], peer_k[j]), -1: padding.
  const int* peer_rank;
  const int* peer_token;
  const int* peer_k;
  const int64_t* peer_base;  // symmetric buffers of the EP ranks
  int64_t x_offset;          // byte offset of x in them (pull source)
  int64_t slots_offset;      // byte offset of the (token, k) slots (push destination)
  const uint4* x_local;      // EP = 1: pull from this x instead of the peers
  int topk;
  int row_vecs;              // H / 8: 16-byte vectors per row
  uint4* x_rows;             // [rows_cap, H] pulled rows (fc1's A), or a ring of ring_tiles
  const uint4* y_rows;       // [rows_cap, H] fc2 output (pushed)
  // Direct mode (EP = 1, no comm CTAs): fc1's producer warpgroup gathers its A rows from
  // x_local itself and fc2's epilogue scatters finished rows straight into the slots.
  bool direct;
  int gather;                // direct mode: kGatherTma, kGatherLines or kGatherRows
  int num_tokens;            // rows of x_local
  // kGatherTma: x_local as a [num_tokens, H] bf16 tensor map with 1 x 64 boxes, 128B swizzle.
  cute::TmaDescriptor x_row_map;  // (CUtensorMap carries its own alignment)
  bool store_y;              // direct/spread: also store y_rows (the backward reads them)
  bool scatter;              // direct/spread: fc2 writes the (t, k) slots (else y_rows only,
                             // read in place by the combine: ops.combine_rows)
  Watchdog dog;
  int hold_tile;             // tests: the last mover warp (spread: the tile's last row)
                             // never publishes this tile's pull (-1: none)
  // Optional cycle probes (nullptr: off): kProbeSlots uint64 per CTA, see ProbeSlot.
  unsigned long long* probe;
};

__device__ __forceinline__ int* pulled_counter(const ForwardParams& p, int m) {
  return p.counters + kCounterHeader + m;
}
__device__ __forceinline__ int* fc1_counter(const ForwardParams& p, int m) {
  return p.counters + kCounterHeader + p.fc1.m_tiles + m;
}
__device__ __forceinline__ int* fc2_counter(const ForwardParams& p, int m) {
  return p.counters + kCounterHeader + 2 * p.fc1.m_tiles + m;
}

__device__ __forceinline__ long long* probe_slot(const ForwardParams& p, int slot) {
  return reinterpret_cast<long long*>(p.probe + blockIdx.x * kProbeSlots + slot);
}
__device__ __forceinline__ void probe_add(const ForwardParams& p, int slot, long long cycles) {
  atomicAdd(p.probe + blockIdx.x * kProbeSlots + slot, static_cast<unsigned long long>(cycles));
}
__device__ __forceinline__ void probe_stamp(const ForwardParams& p, int slot) {
  *probe_slot(p, slot) = clock64();
}
// The consumer's probe points; state between them stays in the scratch slots:
// [0] end of the last epilogue, [1] task start, [2] mainloop end, [3] the task's slot base.
__device__ __forceinline__ void probe_task_start(const ForwardParams& p) {
  long long* scratch = probe_slot(p, kProbeScratch);
  const long long now = clock64();
  probe_add(p, kProbeQueueWait, now - scratch[0]);
  scratch[1] = now;
}
__device__ __forceinline__ void probe_mainloop_end(const ForwardParams& p, int base, int k_steps) {
  long long* scratch = probe_slot(p, kProbeScratch);
  const long long now = clock64();
  probe_add(p, base, 1);
  probe_add(p, base + 1, k_steps);
  probe_add(p, base + 2, now - scratch[1]);
  scratch[2] = now;
  scratch[3] = base;
}
__device__ __forceinline__ void probe_epilogue_end(const ForwardParams& p) {
  long long* scratch = probe_slot(p, kProbeScratch);
  const long long now = clock64();
  probe_add(p, int(scratch[3]) + 3, now - scratch[2]);
  scratch[0] = now;
}

// Row tiles in use (the row count lives on the device; padded to whole tiles).
__device__ __forceinline__ int used_row_tiles(const gemm::GemmParams& p) {
  const int rows = min(__ldg(p.num_rows), p.rows_cap);
  return (rows + 127) / 128;
}

struct ForwardTask {
  bool fc2;        // false: fc1 + SwiGLU (generally: the second GEMM of the pair)
  gemm::Task tile;
};

// Task t of a pair of row-table GEMMs whose second reads the first's output of the same
// row tile (forward: fc1 then fc2; backward: fc2 dgrad then fc1 dgrad), in topological
// order skewed by one minibatch so that the second never waits on tasks drawn just before
// it: A(0), A(1), B(0), A(2), B(1), ..., B(nb - 1), where minibatch b holds row tiles
// [b * mb, b * mb + tiles) and each of its phases runs tiles x column tiles, banded. Every
// task comes after the tasks it waits on, so the persistent CTAs, drawing in order, cannot
// deadlock. Only the last minibatch is partial. k_first / k_second: K steps per task.
__device__ __forceinline__ ForwardTask decode_pair_task(const gemm::GemmParams& first,
                                                        const gemm::GemmParams& second, int mb,
                                                        int t, int used_tiles, int k_first,
                                                        int k_second) {
  const int n1 = first.n_tiles, n2 = second.n_tiles;
  const int nb = (used_tiles + mb - 1) / mb;
  auto tiles_of = [&](int b) { return min(mb, used_tiles - b * mb); };
  const int fc1_first = tiles_of(0) * n1;
  const int per_pair = mb * (n1 + n2);  // A(q + 1) then B(q), q < nb - 1
  const int pairs_end = nb == 1 ? fc1_first
                                : fc1_first + (nb - 2) * per_pair + tiles_of(nb - 1) * n1 + mb * n2;
  ForwardTask task;
  int b, local;
  if (t < fc1_first) {
    b = 0, local = t, task.fc2 = false;
  } else if (t >= pairs_end) {
    b = nb - 1, local = t - pairs_end, task.fc2 = true;
  } else {
    const int q = (t - fc1_first) / per_pair;
    const int r = t - fc1_first - q * per_pair, f = tiles_of(q + 1) * n1;
    task.fc2 = r >= f;
    b = task.fc2 ? q : q + 1;
    local = task.fc2 ? r - f : r;
  }
  const int first_tile = b * mb, tiles = tiles_of(b);
  int m;
  if (!task.fc2) {
    gemm::band_order(local, tiles, n1, m, task.tile.n_tile);
  } else {
    gemm::band_order(local, tiles, n2, m, task.tile.n_tile);
  }
  task.tile.m_tile = first_tile + m;
  task.tile.expert = gemm::expert_of_row(first.offsets, first.num_experts, task.tile.m_tile * 128);
  task.tile.k_begin = 0;
  task.tile.k_end = task.fc2 ? k_second : k_first;
  task.tile.skip = false;
  task.tile.store = true;
  task.tile.share_b = true;
  return task;
}

template <class Cfg1, class Cfg2>
__device__ __forceinline__ ForwardTask decode_forward_task(const ForwardParams& p, int t,
                                                           int used_tiles) {
  return decode_pair_task(p.fc1, p.fc2, p.mb_tiles, t, used_tiles,
                          (p.fc1.K + Cfg1::BK - 1) / Cfg1::BK, (p.fc2.K + Cfg2::BK - 1) / Cfg2::BK);
}

// Comm CTA: stream the rows of this CTA's tiles (m = blockIdx.x, + num_comm, ...) into
// x_rows, publishing pulled[m] once a tile's stores have completed; then stream them out of
// y_rows into their owners' slots, each tile once fc2 has finished it. Warps [0,
// mover_warps) each drive a row mover over every mover_warps-th row of the CTA's sequence
// (lane 0 issues the bulk copies) and publish their share of a tile, so pulled[m] counts
// to mover_warps; the other warps only help set up.
template <int kMoverLag>
__device__ __forceinline__ void forward_comm(const ForwardParams& p, int used_tiles,
                                             unsigned char* smem) {
  using Mover = RowMover<kMoverLag>;
  const int warp = threadIdx.x / 32, warps = p.mover_warps;
  Mover mover = Mover::setup(smem, p.row_vecs * 16, min(warp, warps - 1), warps);
  if (warp >= warps) return;
  const int first = blockIdx.x;
  const int my_tiles = used_tiles > first ? (used_tiles - 1 - first) / p.num_comm + 1 : 0;
  // This warp's q-th row is row i = warp + warps * q of the CTA's sequence (128 per tile).
  const int n = (my_tiles * 128 - warp + warps - 1) / warps;
  auto seq_of = [&](int q) { return warp + warps * q; };
  auto tile_of = [&](int q) { return first + (seq_of(q) / 128) * p.num_comm; };
  auto row_of = [&](int q) { return int64_t(tile_of(q)) * 128 + seq_of(q) % 128; };
  // The warp's last row of a tile (128 % warps == 0: every warp has rows in every tile).
  auto last_of_tile = [&](int q) { return seq_of(q) % 128 + warps >= 128; };
  auto first_of_tile = [&](int q) { return seq_of(q) % 128 < warps; };
  // Where the row lands in x_rows: its own row, or its tile's ring slot.
  auto x_row_of = [&](int q) {
    return p.ring_tiles > 0 ? int64_t(tile_of(q) % p.ring_tiles) * 128 + seq_of(q) % 128
                            : row_of(q);
  };

  // Pull. A tile is published kMoverLag groups after its last store was committed, when
  // wait_group<kMoverLag> says those stores completed without draining the pipeline.
  int pending = -1;
  int64_t pending_at = 0;
  auto publish = [&](int tile) {
    fence_proxy_async_global();  // the rows are read by fc1's TMA loads
    // hold_tile (tests): the last mover warp withholds its share, so the tile never
    // counts to mover_warps even if the others publish theirs.
    if (tile != p.hold_tile || warp != warps - 1) red_release_gpu_add(pulled_counter(p, tile), 1);
  };
  mover.run(
      n,
      [&](int i) -> RowJob {
        const int64_t j = row_of(i);
        void* dst = p.x_rows + x_row_of(i) * p.row_vecs;
        const int src_rank = __ldg(p.peer_rank + j);
        if (src_rank < 0) return {nullptr, dst};  // padding row: zeros for fc1
        const int64_t token = __ldg(p.peer_token + j);
        const uint4* src = p.x_local != nullptr
                               ? p.x_local
                               : peer_ptr<const uint4>(p.peer_base, src_rank, p.x_offset);
        return {src + token * p.row_vecs, dst};
      },
      [](int) {},
      [&](int i) {
        // Ring: before the first store into a slot, the slot's previous tile must have been
        // read by all of its fc1 tasks (they publish after their mainloops). Those come a
        // minibatch or more earlier in the task order (ring_tiles >= mb_tiles), so they are
        // never queued behind this pull. The wait sits on the store side (loads into smem
        // go on) and publishes the previous tile first, so pulled[m'] depends on no ring
        // wait but those of m' and the CTA's earlier tiles (waiting while the last tile
        // was unpublished deadlocked).
        const int m = tile_of(i);
        if (p.ring_tiles > 0 && first_of_tile(i) && m >= p.ring_tiles) {
          const int* done = fc1_counter(p, m - p.ring_tiles);
          const int target = 2 * p.fc1.n_tiles;
          if (ld_acquire_gpu(done) < target) {
            if (pending >= 0) {
              bulk_store_wait_all();
              publish(pending);
              pending = -1;
            }
            wait_counter(done, target, p.dog, kWaitRingFree, m - p.ring_tiles);
          }
          fence_proxy_async_global();  // fc1's TMA reads, then our bulk writes
        }
      },
      [&](int i) {
        if (pending >= 0 && mover.committed - pending_at >= kMoverLag) {
          asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kMoverLag) : "memory");
          publish(pending);
          pending = -1;
        }
        if (last_of_tile(i)) {
          pending = tile_of(i);
          pending_at = mover.committed;
        }
      });
  if (threadIdx.x % 32 == 0) {
    bulk_store_wait_all();
    if (pending >= 0) publish(pending);
  }

  // Push, tile by tile as fc2 finishes them.
  const int fc2_target = 2 * p.fc2.n_tiles;
  mover.run(
      n,
      [&](int i) -> RowJob {
        const int64_t j = row_of(i);
        const int dst_rank = __ldg(p.peer_rank + j);
        if (dst_rank < 0) return {nullptr, nullptr};
        const int64_t slot = int64_t(__ldg(p.peer_token + j)) * p.topk + __ldg(p.peer_k + j);
        return {p.y_rows + j * p.row_vecs,
                peer_ptr<uint4>(p.peer_base, dst_rank, p.slots_offset) + slot * p.row_vecs};
      },
      [&](int i) {
        if (first_of_tile(i)) {
          wait_counter(fc2_counter(p, tile_of(i)), fc2_target, p.dog, kWaitFc2Done, tile_of(i));
          fence_proxy_async_global();  // y rows were written by TMA stores: read them by TMA
        }
      },
      [](int) {}, [](int) {});
  if (threadIdx.x % 32 == 0) bulk_store_wait_all();  // smem must outlive the stores' reads
}

// Spread mode, producer warps 1..3 of every CTA: pull the table's rows into x_rows with
// register copies (16 bytes per lane, kSpreadUnroll per lane in flight), no shared
// memory (the GEMM stages hold it all). Global mover warp g of G takes rows g, g + G, ...
// in increasing order, so tiles complete in task order; each row is released on its own
// (pulled[m] counts to 128). Each row is read once and fc1's n tiles then load it by 2-D
// TMA, unlike direct mode's 128-byte gathers per (n tile, K step) that cap its fc1
// mainloop at 0.6 of the tensor rate (docs/perf-notes.md, v10 measured). The rate
// needed is small: every row feeds (I / 128) fc1 tiles of H / 64 K steps.
constexpr int kSpreadUnroll = 4;
__device__ __forceinline__ void spread_pull(const ForwardParams& p, int used_tiles, int mover,
                                            int movers_per_cta) {
  const int lane = threadIdx.x % 32;
  const int64_t movers = int64_t(gridDim.x) * movers_per_cta;
  const int64_t rows = int64_t(used_tiles) * 128;
  const int n = p.row_vecs;
  for (int64_t j = int64_t(blockIdx.x) * movers_per_cta + mover; j < rows; j += movers) {
    uint4* dst = p.x_rows + j * n;
    const int src_rank = __ldg(p.peer_rank + j);
    if (src_rank < 0) {  // padding row: zeros for fc1
      for (int v = lane; v < n; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
    } else {
      const uint4* src = (p.x_local != nullptr
                              ? p.x_local
                              : peer_ptr<const uint4>(p.peer_base, src_rank, p.x_offset)) +
                         int64_t(__ldg(p.peer_token + j)) * n;
      for (int v0 = lane; v0 < n; v0 += 32 * kSpreadUnroll) {
        uint4 r[kSpreadUnroll];
#pragma unroll
        for (int u = 0; u < kSpreadUnroll; ++u) {
          if (v0 + 32 * u < n) r[u] = __ldg(src + v0 + 32 * u);
        }
#pragma unroll
        for (int u = 0; u < kSpreadUnroll; ++u) {
          if (v0 + 32 * u < n) dst[v0 + 32 * u] = r[u];
        }
      }
    }
    fence_proxy_async_global();  // this lane's generic writes -> fc1's TMA reads
    __syncwarp();
    const int m = int(j / 128);
    if (lane == 0 && !(m == p.hold_tile && j % 128 == 127)) {
      red_release_gpu_add(pulled_counter(p, m), 1);
    }
  }
}

// Direct mode, producer warpgroup: the K steps of a fc1 task. The 128 threads gather the
// tile's 128 rows x 128 bytes per K step with 16-byte cp.async into the 128B-swizzled
// stage (chunk c of row r at c ^ (r % 8)), zero-filled for padding rows and columns past
// H; thread 0 also expects and issues the TMA loads of w1's gate and up boxes.
// cp.async writes are generic-proxy writes and WGMMA reads through the async proxy, so a
// proxy fence must separate them. The producer, not the consumers, pays for it: each
// thread commits a stage's copies as one group, and kGatherLag stages later waits for that
// group, fences and arrives on the stage's full barrier (128 arrivals). A fence in the
// consumers (before the stage's WGMMAs, 801ab71..06adf47) also waited for the previous
// stage's WGMMAs still in flight, serialising the tensor pipe.
//   kGatherLines: lane l of warp w copies chunk l % 8 of rows 16 i + 4 w + l / 8,
//     so one warp instruction reads four whole 128-byte lines (4 requests);
//   kGatherRows: thread r copies the 8 chunks of row r: 32 rows and 32 requests of 16 bytes
//     per warp instruction (801ab71, measured ~25 % slower than TMA in fc1).
constexpr int kGatherLag = 2;  // stages of gathered copies in flight before they are signalled

// This thread's gathered copies of a stage have landed: hand them to the async proxy, then
// arrive (release) on the stage's full barrier.
__device__ __forceinline__ void signal_gathered(uint64_t& full) {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  cutlass::arch::ClusterBarrier::arrive(&full);
}

// Direct mode, producer thread 0: the TMA loads of w1's gate and up boxes of K step k into
// `stage` (the caller has set the full barrier's expected bytes).
template <class Cfg, class Storage, class TmaB>
__device__ __forceinline__ void load_w1_boxes(Storage& smem, const ForwardParams& p,
                                              const TmaB& tma_w1, const gemm::Task& task, int k,
                                              int stage) {
  using namespace cute;
  constexpr int BK = Cfg::BK, kSplit = Cfg::kSplit, BNh = Cfg::BN / kSplit;
  Tensor sBbox = make_tensor(make_smem_ptr(smem.b), typename Cfg::SmemLayoutBBox{});
  Tensor mB = tma_w1.get_tma_tensor(
      make_shape(p.fc1_shapes.b_n, p.fc1_shapes.b_k, p.fc1_shapes.b_q));
  CUTE_UNROLL
  for (int h = 0; h < kSplit; ++h) {
    Tensor gB = local_tile(mB(_, _, task.expert * kSplit + h), Shape<Int<BNh>, Int<BK>>{},
                           make_coord(task.n_tile, _));
    auto [tBgB, tBsB] = tma_partition(tma_w1, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sBbox),
                                      group_modes<0, 2>(gB));
    copy(tma_w1.with(smem.full[stage]), tBgB(_, k), tBsB(_, stage * kSplit + h));
  }
}

// Direct mode, producer warpgroup, kGatherTma: thread r loads row r of every K step as one
// 1 x 64 TMA box (x_row_map) into its 128-byte line of the stage. TMA applies the 128B
// swizzle from the shared-memory address bits, so a row placed at line r of the
// 1024-aligned stage lands as a whole-tile box would put it; rows of padding (coordinate
// num_tokens) and columns past H are out of bounds and zero-filled. Writes come through
// the async proxy and complete on the full barrier: no fence, no lag. Thread 0 expects the
// bytes of all 128 rows and of w1's boxes with its arrival; the others arrive after issuing.
template <class Cfg, class Storage, class TmaB>
__device__ __forceinline__ void gather_fc1_task_tma(Storage& smem, const ForwardParams& p,
                                                    const TmaB& tma_w1, const gemm::Task& task,
                                                    gemm::RingPos& ring, int ptid) {
  using namespace cute;
  using FullBar = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBar = cutlass::arch::ClusterBarrier;
  constexpr int BM = Cfg::BM, BK = Cfg::BK, kSplit = Cfg::kSplit, BNh = Cfg::BN / kSplit;
  static_assert(BM == 128 && BK * 2 == 128, "one 128-byte line per row and K step");
  const int64_t j = int64_t(task.m_tile) * BM + ptid;
  const int row = __ldg(p.peer_rank + j) >= 0 ? __ldg(p.peer_token + j) : p.num_tokens;
  const uint32_t line0 =
      static_cast<uint32_t>(__cvta_generic_to_shared(smem.a)) + uint32_t(ptid) * 128;
  for (int k = task.k_begin; k < task.k_end; ++k) {
    EmptyBar::wait(&smem.empty[ring.stage], ring.phase ^ 1);
    const uint32_t full = static_cast<uint32_t>(__cvta_generic_to_shared(&smem.full[ring.stage]));
    if (ptid == 0) {
      FullBar::arrive_and_expect_tx(&smem.full[ring.stage], (BNh * kSplit + BM) * BK * 2);
      load_w1_boxes<Cfg>(smem, p, tma_w1, task, k, ring.stage);
    }
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];"
        ::"r"(line0 + ring.stage * (BM * BK * 2)), "l"(&p.x_row_map), "r"(k * BK), "r"(row),
          "r"(full)
        : "memory");
    if (ptid != 0) EmptyBar::arrive(&smem.full[ring.stage]);
    ring.advance<Cfg::Stages>();
  }
}

template <class Cfg, class Storage, class TmaB>
__device__ __forceinline__ void gather_fc1_task(Storage& smem, const ForwardParams& p,
                                                const TmaB& tma_w1, const gemm::Task& task,
                                                gemm::RingPos& ring, int ptid) {
  using namespace cute;
  using FullBar = cutlass::arch::ClusterTransactionBarrier;
  using EmptyBar = cutlass::arch::ClusterBarrier;
  constexpr int BM = Cfg::BM, BK = Cfg::BK, kSplit = Cfg::kSplit, BNh = Cfg::BN / kSplit;
  static_assert(BM == 128 && BK * 2 == 128, "one 128-byte line per row and K step");
  // Stage i is signalled at iteration i + L, which waits for stage i + L - S to be empty;
  // the consumers release a stage only after the next one is full, so L <= S - 2.
  static_assert(kGatherLag <= Cfg::Stages - 2,
                "a stage is signalled before the producer needs it again");
  const int lane = ptid & 31, warp = ptid >> 5;
  const bool lines = p.gather == kGatherLines;
  auto row_of = [&](int i) { return lines ? 16 * i + 4 * warp + (lane >> 3) : ptid; };
  auto chunk_of = [&](int i) { return lines ? (lane & 7) : i; };
  // Source token of every row of the tile (-1: padding), in shared memory: the producer's
  // 56 registers cannot hold eight per thread. The previous task's reads are done: every
  // thread passed the task broadcast's barriers since.
  const char* x = reinterpret_cast<const char*>(p.x_local);
  const int64_t row_bytes = int64_t(p.row_vecs) * 16;
  {
    const int64_t j = int64_t(task.m_tile) * BM + ptid;
    smem.gather_token[ptid] = __ldg(p.peer_rank + j) >= 0 ? __ldg(p.peer_token + j) : -1;
  }
  asm volatile("bar.sync 3, 128;" ::: "memory");
  const uint32_t stage0 = static_cast<uint32_t>(__cvta_generic_to_shared(smem.a));
  for (int k = task.k_begin; k < task.k_end; ++k) {
    EmptyBar::wait(&smem.empty[ring.stage], ring.phase ^ 1);
    if (ptid == 0) {
      FullBar::expect_transaction(&smem.full[ring.stage], BNh * kSplit * BK * 2);
      load_w1_boxes<Cfg>(smem, p, tma_w1, task, k, ring.stage);
    }
    const uint32_t stage = stage0 + ring.stage * (BM * BK * 2);
#pragma unroll 2  // more unrolling spills the producer's 56 registers
    for (int i = 0; i < 8; ++i) {
      const int r = row_of(i), c = chunk_of(i);
      const int token = smem.gather_token[r];
      // Columns past H are zero-filled (H % 8 == 0: a chunk is all in or all out).
      const bool in = token >= 0 && (k * BK + c * 8) < p.fc1.K;
      const char* src = in ? x + token * row_bytes + k * 128 + c * 16 : x;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                   ::"r"(stage + r * 128 + ((c ^ (r & 7)) << 4)), "l"(src), "r"(in ? 16u : 0u)
                   : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    if (k - task.k_begin >= kGatherLag) {
      asm volatile("cp.async.wait_group %0;" ::"n"(kGatherLag) : "memory");
      signal_gathered(smem.full[(ring.stage + Cfg::Stages - kGatherLag) % Cfg::Stages]);
    }
    ring.advance<Cfg::Stages>();
  }
  // The task's last stages (up to kGatherLag): all its copies, then their arrivals in order.
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  const int tail = min(kGatherLag, task.k_end - task.k_begin);
  for (int i = tail; i > 0; --i) {
    signal_gathered(smem.full[(ring.stage + Cfg::Stages - i) % Cfg::Stages]);
  }
}

// Direct mode, producer warpgroup: a TMA-loaded task's stages still need all 128 arrivals.
template <class Cfg, class Storage>
__device__ __forceinline__ void arrive_for_task(Storage& smem, const gemm::Task& task,
                                                gemm::RingPos& ring) {
  for (int k = task.k_begin; k < task.k_end; ++k) {
    cutlass::arch::ClusterBarrier::wait(&smem.empty[ring.stage], ring.phase ^ 1);
    cutlass::arch::ClusterBarrier::arrive(&smem.full[ring.stage]);
    ring.advance<Cfg::Stages>();
  }
}

// Direct/spread mode's fc2 epilogue (and the backward megakernel's fc1-dgrad one at
// EP > 1), one consumer warpgroup: each staged 64 x 64 chunk of output rows (GEMM g) goes
// straight from shared memory to the (token, k) slots of the rows' owners (16-byte stores;
// thread t copies column piece t % 8 of rows t / 8 + 16 i), and to the rows' buffer by TMA
// when store_rows (the backward needs them). P: the params with the row table
// (peer_rank, peer_token, peer_k), topk, peer_base and slots_offset.
template <class Cfg, class P, class Storage, class Acc, class TmaO>
__device__ __forceinline__ void scatter_rows_epilogue(Storage& smem, gemm::EpilogueState& es,
                                                      const P& p, const gemm::GemmParams& g,
                                                      const gemm::Task& task, Acc& accum,
                                                      const TmaO& tma_y, bool store_rows) {
  using namespace cute;
  constexpr int BN = Cfg::BN, CW = Cfg::kChunkCols;
  static_assert(CW == 64, "bf16 chunks of 64 columns: 8 pieces of 16 bytes per row");
  Tensor mO = tma_y.get_tma_tensor(make_shape(g.rows_cap, g.N, 1));
  if (Cfg::kGlu && g.col_bias != nullptr) {  // fc2's bias (the experts' b2)
    gemm::add_column_bias<BN / 2>(accum, 0, g.col_bias + task.expert * g.bias_stride,
                                  task.n_tile * BN, g.N, es.col_t);
  }
  const int piece = es.wg_thread % 8;
  const int64_t row0 = int64_t(task.m_tile) * 128 + 64 * es.wg + es.wg_thread / 8;
  CUTE_UNROLL
  for (int q = 0; q < BN / CW; ++q) {
    const int col0 = task.n_tile * BN + q * CW;
    if (col0 < g.N) {
      // The rows' slots are looked up per chunk (L1 hits after the first): holding four
      // destination pointers across the chunks spilled the consumer's registers.
      auto scatter = [=, &p](const auto& sE) {
        const int c = col0 + piece * 8;
        if (c >= g.N) return;
#pragma unroll 1  // one row at a time: the accumulators are live around this
        for (int i = 0; i < 4; ++i) {
          const int64_t j = row0 + 16 * i;
          const int rank = __ldg(p.peer_rank + j);
          if (rank < 0) continue;
          const int64_t slot = int64_t(__ldg(p.peer_token + j)) * p.topk + __ldg(p.peer_k + j);
          __nv_bfloat16* dst = peer_ptr<__nv_bfloat16>(p.peer_base, rank, p.slots_offset);
          *reinterpret_cast<uint4*>(dst + slot * g.N + c) =
              *reinterpret_cast<const uint4*>(&sE(es.wg_thread / 8 + 16 * i, piece * 8));
        }
      };
      gemm::emit_chunk<Cfg>(smem, es, tma_y, mO, 2 * task.m_tile + es.wg,
                            task.n_tile * (BN / CW) + q, 0, q * (CW / 8),
                            [&](int i) { return make_float2(accum(i), accum(i + 1)); }, scatter,
                            store_rows);
    }
  }
}

// Publish this warpgroup's half of a finished tile: its TMA stores complete, then release.
__device__ __forceinline__ void publish_tile(int* counter) {
  bulk_store_wait_all();
  fence_proxy_async_global();
  red_release_gpu_add(counter, 1);
}

template <class Cfg1, class Cfg2, class TmaA1, class TmaB1, class TmaO1, class TmaA2, class TmaB2,
          class TmaO2>
__global__ void __launch_bounds__(Cfg1::kThreads, 1)
moe_forward_kernel(const __grid_constant__ ForwardParams p, const __grid_constant__ TmaA1 tma_x,
                   const __grid_constant__ TmaB1 tma_w1, const __grid_constant__ TmaO1 tma_act,
                   const __grid_constant__ TmaO1 tma_h, const __grid_constant__ TmaA2 tma_act_in,
                   const __grid_constant__ TmaB2 tma_w2, const __grid_constant__ TmaO2 tma_y) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using namespace cute;
  using Storage = typename Cfg1::SharedStorage;
  static_assert(std::is_same_v<Storage, typename Cfg2::SharedStorage>,
                "fc1 and fc2 tiles share one shared-memory layout");
  static_assert(Cfg1::kCluster == 1 && Cfg2::kCluster == 1, "the megakernel runs 1-CTA clusters");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<Storage*>(smem_raw);
  const int used_tiles = used_row_tiles(p.fc1);
  const int num_tasks = used_tiles * (p.fc1.n_tiles + p.fc2.n_tiles);

  if (int(blockIdx.x) < p.num_comm) {
    if (p.mover_lag == 16) {
      forward_comm<16>(p, used_tiles, smem_raw);
    } else if (p.mover_lag == 12) {
      forward_comm<12>(p, used_tiles, smem_raw);
    } else if (p.mover_lag == 4) {
      forward_comm<4>(p, used_tiles, smem_raw);
    } else if (p.mover_lag == 2) {
      forward_comm<2>(p, used_tiles, smem_raw);
    } else if (p.mover_lag == 1) {
      forward_comm<1>(p, used_tiles, smem_raw);
    } else {
      forward_comm<6>(p, used_tiles, smem_raw);
    }
  } else {
    const int warpgroup = threadIdx.x / 128;
    if (threadIdx.x == 0) {
      prefetch_tma_descriptor(tma_x.get_tma_descriptor());
      prefetch_tma_descriptor(tma_w1.get_tma_descriptor());
      prefetch_tma_descriptor(tma_act.get_tma_descriptor());
      prefetch_tma_descriptor(tma_h.get_tma_descriptor());
      prefetch_tma_descriptor(tma_act_in.get_tma_descriptor());
      prefetch_tma_descriptor(tma_w2.get_tma_descriptor());
      prefetch_tma_descriptor(tma_y.get_tma_descriptor());
      gemm::init_tile_barriers<Cfg1>(smem, p.direct ? 128 : 1);
    }
    __syncthreads();
    gemm::TaskQueue<Storage> queue{smem};
    int* task_counter = p.counters + kTaskCounter;

    if (warpgroup == 0) {
      // ---------------- producer: dependency waits, then the loads ----------------
      // Thread 0 draws the tasks and issues the TMA loads; in direct mode the whole
      // warpgroup learns each task (fc1 rows are gathered by all 128 threads).
      cutlass::arch::warpgroup_reg_dealloc<56>();
      const int ptid = threadIdx.x;
      if (p.spread && ptid >= 32) {
        spread_pull(p, used_tiles, ptid / 32 - 1, 3);
      } else if (ptid == 0 || p.direct) {
        gemm::RingPos ring;
        const int fc1_target = 2 * p.fc1.n_tiles;
        while (true) {
          int t = 0;
          if (ptid == 0) {
            t = atomicAdd(task_counter, 1);
            queue.push(t);
          }
          if (p.direct) {
            if (ptid == 0) smem.producer_task = t;
            __syncwarp();  // bar.sync is .aligned: warp 0 reconverges after lane 0's work
            asm volatile("bar.sync 3, 128;" ::: "memory");
            t = smem.producer_task;
            asm volatile("bar.sync 3, 128;" ::: "memory");  // read before the next write
          }
          if (t >= num_tasks) break;
          const ForwardTask task = decode_forward_task<Cfg1, Cfg2>(p, t, used_tiles);
          const int m = task.tile.m_tile;
          if (!task.fc2) {
            if (p.direct) {
              if (p.gather == kGatherTma) {
                gather_fc1_task_tma<Cfg1>(smem, p, tma_w1, task.tile, ring, ptid);
              } else {
                gather_fc1_task<Cfg1>(smem, p, tma_w1, task.tile, ring, ptid);
              }
            } else {
              const long long w0 = p.probe != nullptr ? clock64() : 0;
              wait_counter(pulled_counter(p, m), p.pull_target, p.dog, kWaitRowsPulled, m);
              if (p.probe != nullptr) probe_add(p, kProbeDepWait, clock64() - w0);
              fence_proxy_async_global();
              gemm::Task a_task = task.tile;  // A from the tile's ring slot, if any
              if (p.ring_tiles > 0) a_task.m_tile = m % p.ring_tiles;
              gemm::load_task<Cfg1>(smem, tma_x, tma_w1, tma_w1, p.fc1_shapes, a_task, 0,
                                    ring);
            }
          } else if (ptid == 0) {
            const long long w0 = p.probe != nullptr ? clock64() : 0;
            wait_counter(fc1_counter(p, m), fc1_target, p.dog, kWaitFc1Done, m);
            if (p.probe != nullptr) probe_add(p, kProbeDepWait, clock64() - w0);
            fence_proxy_async_global();
            gemm::load_task<Cfg2>(smem, tma_act_in, tma_w2, tma_w2, p.fc2_shapes, task.tile, 0,
                                  ring);
          } else {  // direct mode: the full barriers count 128 arrivals, thread 0's is one
            arrive_for_task<Cfg2>(smem, task.tile, ring);
          }
        }
      }
    } else {
      // ---------------- consumers: WGMMA, epilogue, publish ----------------
      cutlass::arch::warpgroup_reg_alloc<224>();
      const int ctid = threadIdx.x - 128;
      typename Cfg1::TiledMma tiled_mma;
      auto thr_mma = tiled_mma.get_thread_slice(ctid);
      Tensor sA = make_tensor(make_smem_ptr(smem.a), typename Cfg1::SmemLayoutA{});
      Tensor sB = make_tensor(make_smem_ptr(smem.b), typename Cfg1::SmemLayoutB{});
      Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));
      Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));
      Tensor accum = partition_fragment_C(tiled_mma, Shape<Int<Cfg1::BM>, Int<Cfg1::BN>>{});
      Tensor tCcD =
          thr_mma.partition_C(make_identity_tensor(Shape<Int<Cfg1::BM>, Int<Cfg1::BN>>{}));
      const int wg = warpgroup - 1;
      gemm::EpilogueState es{wg, ctid % 128, int(get<0>(tCcD(0))) - 64 * wg,
                             int(get<1>(tCcD(0))), 0};
      gemm::RingPos ring;
      // fc2 tiles are published lazily (only the comm CTAs' pushes wait on them): before the
      // next epilogue, when their stores have long completed, or at the end.
      int pending_fc2 = -1;
      auto flush_fc2 = [&] {
        if (pending_fc2 >= 0 && es.wg_thread == 0) publish_tile(fc2_counter(p, pending_fc2));
        pending_fc2 = -1;
      };
      // Probe timestamps live in the probe buffer's scratch slots, not in registers (the
      // consumer spills with even three more live values). The first consumer thread probes.
      const auto probing = [&] { return p.probe != nullptr && threadIdx.x == 128; };
      if (probing()) probe_stamp(p, kProbeScratch);
      for (int t = queue.pop(); t < num_tasks; t = queue.pop()) {
        if (probing()) probe_task_start(p);
        const ForwardTask task = decode_forward_task<Cfg1, Cfg2>(p, t, used_tiles);
        gemm::mma_task<Cfg1>(smem, tiled_mma, tCrA, tCrB, accum, task.tile.k_begin,
                             task.tile.k_end, ring, es.wg_thread);
        if (probing()) {
          probe_mainloop_end(p, task.fc2 ? kProbeFc2 : kProbeFc1,
                             task.tile.k_end - task.tile.k_begin);
        }
        flush_fc2();
        if (!task.fc2) {
          gemm::tile_epilogue<Cfg1>(smem, es, p.fc1, task.tile, accum, true, tma_act, tma_h);
          if (es.wg_thread == 0) publish_tile(fc1_counter(p, task.tile.m_tile));
        } else if ((p.direct || p.spread) && p.scatter) {
          scatter_rows_epilogue<Cfg2>(smem, es, p, p.fc2, task.tile, accum, tma_y, p.store_y);
        } else {
          gemm::tile_epilogue<Cfg2>(smem, es, p.fc2, task.tile, accum, true, tma_y, tma_y);
          pending_fc2 = task.tile.m_tile;
        }
        if (probing()) probe_epilogue_end(p);
      }
      flush_fc2();
      if (es.wg_thread == 0) bulk_store_wait_all();
    }
  }

  // The flag reuses the task queue's slot, idle by now.
  zero_counters_on_exit(p.counters, p.fc1.m_tiles, smem.task_id[0]);
#endif
}

}  // namespace megatron_mok::megakernel
