// Device helpers for memory shared across the EP group (PyTorch symmetric memory):
// peer addressing, system-scope release/acquire, and the watchdog record.
#pragma once

#include <cstdint>

namespace megatron_mok {

// Base address of rank `peer`'s buffer + a byte offset, as a typed pointer.
template <typename T>
__device__ __forceinline__ T* peer_ptr(const int64_t* peer_base, int peer, int64_t byte_offset) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(peer_base[peer] + byte_offset));
}

__device__ __forceinline__ void st_release_sys(uint64_t* addr, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(value) : "memory");
}

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* addr) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(addr) : "memory");
  return value;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Watchdog record, in pinned host memory so it survives the trap that follows.
// Layout (int64): [0] state (0 ok, 1 stuck), [1] what (1 = EP barrier), [2] rank,
// [3] peer waited on, [4] expected value, [5] value seen, [6] waited ns, [7] block.
enum WatchdogWhat : int64_t { kWatchdogBarrier = 1 };

__device__ __forceinline__ void watchdog_trap(int64_t* record, int64_t what, int64_t rank,
                                              int64_t peer, int64_t expected, int64_t seen,
                                              int64_t waited_ns) {
  if (atomicCAS(reinterpret_cast<unsigned long long*>(record), 0ull, 1ull) == 0ull) {
    record[1] = what;
    record[2] = rank;
    record[3] = peer;
    record[4] = expected;
    record[5] = seen;
    record[6] = waited_ns;
    record[7] = blockIdx.x;
  }
  __threadfence_system();
  asm volatile("trap;");
}

}  // namespace megatron_mok
