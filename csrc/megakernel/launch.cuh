// Host side shared by the megakernels' launchers (forward.cu, backward.cu): the checks of
// the tables and buffers every megakernel takes, and the cooperative launch over every SM.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

namespace megatron_mok::megakernel {

// A row table column or the counter buffer.
inline void check_int32_table(const at::Tensor& t, const char* name, int64_t numel) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kInt && t.is_contiguous() &&
                  t.numel() == numel,
              "megatron_mok: ", name, " must be a contiguous CUDA int32 tensor of ", numel,
              " entries");
}

// The watchdog's record (comm/symmetric.cuh) and the peers' symmetric-memory bases.
inline void check_watchdog_and_peers(const at::Tensor& watchdog, const at::Tensor& peer_base) {
  TORCH_CHECK(watchdog.is_pinned() && watchdog.scalar_type() == at::kLong && watchdog.numel() >= 8,
              "megatron_mok: watchdog must be a pinned int64 tensor of 8 entries");
  TORCH_CHECK(peer_base.is_cuda() && peer_base.scalar_type() == at::kLong && peer_base.dim() == 1,
              "megatron_mok: peer_base must be a CUDA int64 vector");
}

inline void check_minibatch_rows(int64_t minibatch_rows) {
  TORCH_CHECK(minibatch_rows >= 128 && minibatch_rows % 128 == 0,
              "megatron_mok: minibatch_rows must be a positive multiple of 128");
}

// One CTA per SM on the current stream. Cooperative: every CTA is resident at once (their
// movers and tiles wait on each other through counters), or the launch fails instead of
// deadlocking.
template <typename Kernel, typename... Args>
void launch_cooperative(Kernel kernel, int ctas, int threads, int smem_bytes, const Args&... args) {
  C10_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(ctas);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = at::cuda::getCurrentCUDAStream();
  config.attrs = attr;
  config.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args...));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace megatron_mok::megakernel
