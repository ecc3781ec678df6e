// Forward combine epilogue on the GPU (DESIGN section 4, step 5):
// y[t] = shared[t] + sum_k w[t,k] * slots[t,k], fp32 accumulation, k ascending,
// rounded once. One thread owns 8 consecutive hidden elements (one 16-byte bf16
// vector) of one token, so every output element has exactly one writer and a
// fixed summation order: bitwise deterministic for any grid size.

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include <cute/tensor.hpp>

#include "combine_epilogue.h"

namespace megatron_mok {
namespace {

constexpr int kVec = 8;  // elements per thread: 16 bytes of bf16

template <typename T>
__device__ inline float to_float(T v) { return static_cast<float>(v); }
template <>
__device__ inline float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ inline T from_float(float v) { return static_cast<T>(v); }
template <>
__device__ inline __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }

template <typename T, typename Idx>
__global__ void combine_epilogue_kernel(const T* __restrict__ slots, const Idx* __restrict__ idx,
                                        const float* __restrict__ w, const T* __restrict__ shared,
                                        T* __restrict__ out, int64_t T_, int K, int64_t H) {
  const int64_t vecs_per_row = H / kVec;
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < T_ * vecs_per_row;
       v += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = v / vecs_per_row, h0 = (v % vecs_per_row) * kVec;
    float acc[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] = shared ? to_float(shared[t * H + h0 + i]) : 0.f;
    for (int k = 0; k < K; ++k) {
      if (idx[t * K + k] < 0) continue;
      const float wk = w[t * K + k];
      const T* row = slots + (t * K + k) * H + h0;
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[i] += wk * to_float(row[i]);
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[t * H + h0 + i] = from_float<T>(acc[i]);
  }
}

template <typename T, typename Idx>
void launch(const at::Tensor& slots, const at::Tensor& idx, const at::Tensor& w,
            const std::optional<at::Tensor>& shared, at::Tensor& out) {
  const int64_t T_ = slots.size(0), H = slots.size(2);
  const int K = static_cast<int>(slots.size(1));
  constexpr int kThreads = 256;
  const int64_t work = T_ * (H / kVec);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int blocks = static_cast<int>(std::min<int64_t>(cute::ceil_div(work, int64_t(kThreads)),
                                                        int64_t(sms) * 8));
  if (blocks == 0) return;
  combine_epilogue_kernel<T, Idx><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const T*>(slots.data_ptr()), idx.data_ptr<Idx>(), w.data_ptr<float>(),
      shared.has_value() ? reinterpret_cast<const T*>(shared->data_ptr()) : nullptr,
      reinterpret_cast<T*>(out.data_ptr()), T_, K, H);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor combine_epilogue_cuda(const at::Tensor& slots, const at::Tensor& topk_idx,
                                 const at::Tensor& topk_w,
                                 const std::optional<at::Tensor>& shared) {
  check_combine_epilogue_args(slots, topk_idx, topk_w, shared, at::kCUDA);
  TORCH_CHECK_VALUE(slots.size(2) % kVec == 0, "hidden size must be a multiple of ", kVec);
  const c10::cuda::CUDAGuard guard(slots.device());
  auto out = at::empty({slots.size(0), slots.size(2)}, slots.options());
  const bool bf16 = slots.scalar_type() == at::kBFloat16;
  const bool i32 = topk_idx.scalar_type() == at::kInt;
  if (bf16 && i32) launch<__nv_bfloat16, int32_t>(slots, topk_idx, topk_w, shared, out);
  else if (bf16) launch<__nv_bfloat16, int64_t>(slots, topk_idx, topk_w, shared, out);
  else if (i32) launch<float, int32_t>(slots, topk_idx, topk_w, shared, out);
  else launch<float, int64_t>(slots, topk_idx, topk_w, shared, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) {
  m.impl("combine_epilogue", &combine_epilogue_cuda);
}

}  // namespace megatron_mok
