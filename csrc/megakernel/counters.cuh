// Readiness counters of the megakernel: device-scope release/acquire on int32 counters in
// global memory, the proxy fences between generic-proxy accesses and TMA (async proxy)
// accesses of the same rows, and a spin-wait that becomes a watchdog trap with a record
// of where it was stuck instead of a hang.
//
// Protocol (docs/megakernel.md): a writer makes its rows complete (generic stores, or TMA
// stores waited with cp.async.bulk.wait_group 0), fences the async proxy and adds to the
// counter with release semantics; a reader spins with acquire loads until the counter
// reaches its target and fences the async proxy before its TMA loads read the rows.
#pragma once

#include <cstdint>

#include "comm/symmetric.cuh"

namespace megatron_mok::megakernel {

__device__ __forceinline__ int ld_acquire_gpu(const int* addr) {
  int value;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(addr) : "memory");
  return value;
}

__device__ __forceinline__ void red_release_gpu_add(int* addr, int value) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(addr), "r"(value) : "memory");
}

// Orders this thread's generic-proxy accesses of global memory with its async-proxy ones.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Asks L2 for `bytes` (a multiple of 16) at a 16-byte aligned global address: one TMA
// instruction, no registers held, no completion to wait for.
__device__ __forceinline__ void bulk_prefetch_l2(const void* ptr, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(ptr), "r"(bytes) : "memory");
}

// Every TMA store this thread committed has completed (its writes are done, not only its
// shared-memory reads as in cp.async.bulk.wait_group.read).
__device__ __forceinline__ void bulk_store_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// What a watchdog record says was waited on (record[1]); record[3] is the 128-row tile.
enum WaitWhat : int64_t {
  kWaitRowsPulled = 2, kWaitFc1Done = 3, kWaitFc2Done = 4,
  kWaitRingFree = 5,  // a comm CTA's pull: the ring tile's previous rows not yet read by fc1
  kWaitDyPulled = 6,  // backward: a fc2-dgrad tile waits for its dy rows
  kWaitDhDone = 7     // backward: a fc1-dgrad tile waits for its row tile's d_h
};

struct Watchdog {
  int64_t* record;     // pinned host memory, see comm/symmetric.cuh
  int64_t timeout_ns;  // <= 0: wait forever
  int rank;
};

// Spin until *counter >= target (acquire). Past the timeout: fill the record and trap.
__device__ __forceinline__ void wait_counter(const int* counter, int target, const Watchdog& dog,
                                             WaitWhat what, int index) {
  int seen = ld_acquire_gpu(counter);
  if (seen >= target) return;
  const uint64_t start = global_timer_ns();
  while ((seen = ld_acquire_gpu(counter)) < target) {
    const uint64_t waited = global_timer_ns() - start;
    if (dog.timeout_ns > 0 && waited > uint64_t(dog.timeout_ns)) {
      watchdog_trap(dog.record, what, dog.rank, index, target, seen, int64_t(waited));
    }
    __nanosleep(32);
  }
}

}  // namespace megatron_mok::megakernel
