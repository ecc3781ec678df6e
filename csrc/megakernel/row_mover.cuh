// Row mover of the megakernel's comm CTAs: one warp streams whole rows (H bf16, up to
// 16 KB) through shared memory with 1-D TMA bulk copies, global -> smem (mbarrier
// complete_tx) and smem -> global (bulk groups), kLag loads and kLag stores in flight.
// A plain register copy keeps only 16 bytes per thread in flight and reached ~13 GB/s
// per SM (benchmarks/results/2026-12-03-h200-megakernel-fwd-281f69d.json); the bulk
// copies keep up to ~100 KB in flight per SM.
//
// Iteration i loads row i into slot i % kSlots and stores row i - kLag (kSlots = 2 kLag).
// Every iteration commits exactly one bulk group (empty for a skipped row), so before slot
// i % kSlots is reloaded, wait_group.read<kLag - 1> guarantees that the store of row
// i - kSlots (kLag groups back) has read it. The lag is the largest whose slots fit.
// Measured: ~0.4 us per row per comm SM whatever the row size and the lag (6 or 16), so
// slot occupancy is not the limit (docs/perf-notes.md, megakernel v4). If the limit is the
// one issuing lane's chain of waits, more warps per CTA, each a mover with its own slots
// and every warps-th row, multiply the rate: `warps` movers share the shared memory
// (MOK_MOVER_WARPS, megakernel v10).
#pragma once

#include <cutlass/arch/barrier.h>

#include <cstdint>

namespace megatron_mok::megakernel {

constexpr int kMaxMoverWarps = 8;
// The mbarriers (up to 32 per warp) come first, then the slots: 1 KB for up to 4 warps (as
// before 8 were allowed, so their lags are unchanged), 2 KB for 8.
__host__ __device__ constexpr int mover_header_bytes(int warps) {
  return warps <= 4 ? 1024 : 2048;
}
// Rows in flight each way per warp: as many as shared memory holds (warps x 2 lag slots +
// one zero row); the lags compiled are 16, 12, 6, 4, 2 and 1.

__host__ __device__ constexpr int mover_smem_bytes(int lag, int row_bytes, int warps = 1) {
  return mover_header_bytes(warps) + (warps * 2 * lag + 1) * row_bytes;
}

// The largest lag whose slots fit in smem_bytes, or 0 if none does.
__host__ __device__ constexpr int mover_lag(int row_bytes, int smem_bytes, int warps = 1) {
  constexpr int kLags[] = {16, 12, 6, 4, 2, 1};
  for (int lag : kLags) {
    if (mover_smem_bytes(lag, row_bytes, warps) <= smem_bytes) return lag;
  }
  return 0;
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One row to move: src == nullptr stores zeros (a padding row of the table); dst ==
// nullptr moves nothing (a padding row that has no destination).
struct RowJob {
  const void* src;
  void* dst;
};

template <int kMoverLag>
struct RowMover {
  static constexpr int kMoverSlots = 2 * kMoverLag;
  static_assert(kMoverSlots <= 32, "slot phases live in a 32-bit mask");
  uint64_t* bars;      // kMoverSlots mbarriers
  char* slots;         // this mover's kMoverSlots rows
  int row_bytes;
  uint32_t phases;     // bit s: parity of slot s's next completion
  int64_t committed;   // bulk groups committed so far (lane 0)
  char* zero_row;      // one row of zeros, shared by the movers

  // All threads of the CTA: the barriers and slots of mover `warp` of `warps`, and the
  // zero row after every mover's slots. Ends with __syncthreads().
  __device__ static RowMover setup(unsigned char* smem, int row_bytes, int warp, int warps) {
    static_assert(kMoverSlots * kMaxMoverWarps * 8 <= mover_header_bytes(kMaxMoverWarps),
                  "mbarriers fit");
    char* slots0 = reinterpret_cast<char*>(smem) + mover_header_bytes(warps);
    RowMover m{reinterpret_cast<uint64_t*>(smem) + warp * kMoverSlots,
               slots0 + int64_t(warp) * kMoverSlots * row_bytes, row_bytes, 0u, 0,
               slots0 + int64_t(warps) * kMoverSlots * row_bytes};
    uint4* zero = reinterpret_cast<uint4*>(m.zero_row);
    for (int v = threadIdx.x; v < row_bytes / 16; v += blockDim.x) zero[v] = make_uint4(0, 0, 0, 0);
    if (threadIdx.x == 0) {
      uint64_t* bars = reinterpret_cast<uint64_t*>(smem);
      for (int s = 0; s < warps * kMoverSlots; ++s) {
        cutlass::arch::ClusterTransactionBarrier::init(&bars[s], 1);
      }
      cutlass::arch::fence_barrier_init();
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // zeros -> bulk stores
    __syncthreads();
    return m;
  }

  __device__ char* slot(int s) { return slots + int64_t(s) * row_bytes; }

  __device__ void load(int s, const void* src) {
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&bars[s], row_bytes);
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(smem_addr(slot(s))), "l"(src), "r"(row_bytes), "r"(smem_addr(&bars[s]))
        : "memory");
  }

  __device__ void store(void* dst, const void* smem_src) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                 ::"l"(dst), "r"(smem_addr(smem_src)), "r"(row_bytes)
                 : "memory");
  }

  __device__ void commit() {
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    ++committed;
  }

  // Streams rows [0, n); called by every lane of one warp. job(i) -> RowJob (row
  // metadata: the lanes fetch 32 rows' worth at once, so the global-load latency of the
  // row table is paid once per 32 rows, not per row); lane 0 alone issues the copies and
  // runs before_load(i) before row i is read (a dependency wait), before_store(i) before
  // row i is written (a wait for its destination to be free) and after_commit(i) once row
  // i's store is committed (publishing).
  template <class Job, class BeforeLoad, class BeforeStore, class AfterCommit>
  __device__ void run(int n, Job&& job, BeforeLoad&& before_load, BeforeStore&& before_store,
                      AfterCommit&& after_commit) {
    static_assert(kMoverLag < 32, "a stored row is in the current or the previous batch");
    const int lane = threadIdx.x % 32;
    RowJob batch{nullptr, nullptr}, last_batch{nullptr, nullptr};  // rows (i / 32) * 32 + lane
    auto row_job = [&](const RowJob& from, int i) {
      return RowJob{reinterpret_cast<const void*>(__shfl_sync(~0u, (long long)from.src, i % 32)),
                    reinterpret_cast<void*>(__shfl_sync(~0u, (long long)from.dst, i % 32))};
    };
    for (int i = 0; i < n + kMoverLag; ++i) {
      if (i % 32 == 0) {
        last_batch = batch;
        batch = i + lane < n ? job(i + lane) : RowJob{nullptr, nullptr};
      }
      if (i < n) {
        const RowJob r = row_job(batch, i);
        if (lane == 0) {
          before_load(i);
          if (r.src != nullptr && r.dst != nullptr) {
            if (i >= kMoverSlots) {
              asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kMoverLag - 1) : "memory");
            }
            load(i % kMoverSlots, r.src);
          }
        }
      }
      const int j = i - kMoverLag;
      if (j >= 0) {
        const RowJob r = row_job(j / 32 == i / 32 ? batch : last_batch, j);
        if (lane == 0) {
          before_store(j);
          if (r.dst != nullptr) {
            if (r.src != nullptr) {
              const int s = j % kMoverSlots;
              cutlass::arch::ClusterTransactionBarrier::wait(&bars[s], (phases >> s) & 1u);
              phases ^= 1u << s;
              store(r.dst, slot(s));
            } else {
              store(r.dst, zero_row);
            }
          }
          commit();
          after_commit(j);
        }
      }
      __syncwarp();
    }
  }
};

}  // namespace megatron_mok::megakernel
