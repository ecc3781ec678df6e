// EP-group barrier over symmetric memory, sync-free and CUDA-graph capturable.
//
// Every rank owns a row of 64-bit flags (one per peer) in its symmetric buffer and a
// local epoch counter in device memory. Barrier number n (n = epoch + 1) writes n
// into flags[me] of every peer with a system-scope release, then waits until every
// flags[p] of its own row reaches n with system-scope acquires. Flags only grow, so
// nothing is ever reset; the epoch lives on the device, so a captured graph that
// replays the barrier advances it too. A wait past the timeout fills the watchdog
// record and traps: a dead peer becomes an error, never a hang.

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "comm/symmetric.cuh"

namespace megatron_mok {
namespace {

constexpr int kMaxRanks = 64;

__global__ void ep_barrier_kernel(const int64_t* __restrict__ peer_base, int64_t flag_offset,
                                  int64_t* __restrict__ epoch, int rank, int world,
                                  int64_t timeout_ns, int64_t* __restrict__ record) {
  const uint64_t target = static_cast<uint64_t>(epoch[0]) + 1;
  const int p = threadIdx.x;
  if (p < world) {
    // Writes of earlier kernels on this stream (pushes into peers) must be visible
    // system-wide before any peer can observe this arrival.
    __threadfence_system();
    st_release_sys(peer_ptr<uint64_t>(peer_base, p, flag_offset) + rank, target);
    const uint64_t* mine = peer_ptr<uint64_t>(peer_base, rank, flag_offset) + p;
    const uint64_t start = global_timer_ns();
    uint64_t seen;
    while ((seen = ld_acquire_sys(mine)) < target) {
      const uint64_t waited = global_timer_ns() - start;
      if (timeout_ns > 0 && waited > static_cast<uint64_t>(timeout_ns)) {
        watchdog_trap(record, kWatchdogBarrier, rank, p, target, seen, waited);
      }
      __nanosleep(256);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) epoch[0] = static_cast<int64_t>(target);
}

void ep_barrier(const at::Tensor& peer_base, int64_t flag_offset, const at::Tensor& epoch,
                int64_t rank, const at::Tensor& watchdog, int64_t timeout_ms) {
  TORCH_CHECK_VALUE(peer_base.is_cuda() && peer_base.scalar_type() == at::kLong &&
                        peer_base.dim() == 1 && peer_base.numel() <= kMaxRanks,
                    "peer_base must be a CUDA int64 vector of at most ", kMaxRanks, " ranks");
  TORCH_CHECK_VALUE(epoch.is_cuda() && epoch.scalar_type() == at::kLong && epoch.numel() == 1,
                    "epoch must be a one-element CUDA int64 tensor");
  TORCH_CHECK_VALUE(watchdog.is_pinned() && watchdog.scalar_type() == at::kLong &&
                        watchdog.numel() >= 8,
                    "watchdog must be a pinned int64 tensor of 8 entries");
  TORCH_CHECK_VALUE(flag_offset % 8 == 0, "flag_offset must be 8-byte aligned");
  const int world = static_cast<int>(peer_base.numel());
  TORCH_CHECK_VALUE(rank >= 0 && rank < world, "rank out of range");
  const c10::cuda::CUDAGuard guard(peer_base.device());
  ep_barrier_kernel<<<1, kMaxRanks, 0, at::cuda::getCurrentCUDAStream()>>>(
      peer_base.data_ptr<int64_t>(), flag_offset, epoch.data_ptr<int64_t>(),
      static_cast<int>(rank), world, timeout_ms * 1000000, watchdog.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) { m.impl("ep_barrier", &ep_barrier); }

}  // namespace megatron_mok
