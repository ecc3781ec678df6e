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

// Where route (t, k)'s row is, or nullptr if the route is not routed.
// Slots: pushed into slot (t, k) of [T, K, H]; skipped where topk_idx < 0.
template <typename T, typename Idx>
struct SlotRows {
  const T* slots;
  const Idx* idx;
  int K;
  int64_t H;
  __device__ const T* operator()(int64_t t, int k) const {
    return idx[t * K + k] < 0 ? nullptr : slots + (t * K + k) * H;
  }
};

// In place (EP = 1): row route_row[t, k] of the expert output rows, -1 if not routed, so no
// push copies them into slots first. Same values in the same order: bit-equal to slots.
template <typename T>
struct RoutedRows {
  const T* rows;
  const int* route_row;
  int K;
  int64_t H;
  __device__ const T* operator()(int64_t t, int k) const {
    const int64_t r = route_row[t * K + k];
    return r < 0 ? nullptr : rows + r * H;
  }
};

template <typename T, class RowOf>
__global__ void combine_kernel(RowOf row_of, const float* __restrict__ w,
                               const T* __restrict__ shared, T* __restrict__ out, int64_t T_,
                               int K, int64_t H) {
  const int64_t vecs_per_row = H / kVec;
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < T_ * vecs_per_row;
       v += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = v / vecs_per_row, h0 = (v % vecs_per_row) * kVec;
    float acc[kVec];
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i] = shared ? to_float(shared[t * H + h0 + i]) : 0.f;
    for (int k = 0; k < K; ++k) {
      const T* row = row_of(t, k);
      if (row == nullptr) continue;
      const float wk = w[t * K + k];
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[i] += wk * to_float(row[h0 + i]);
    }
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[t * H + h0 + i] = from_float<T>(acc[i]);
  }
}

int grid_for(int64_t work, int threads) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<int>(std::min<int64_t>(cute::ceil_div(work, int64_t(threads)),
                                            int64_t(sms) * 8));
}

at::Tensor combine_rows_cuda(const at::Tensor& rows, const at::Tensor& route_row,
                             const at::Tensor& topk_w, const std::optional<at::Tensor>& shared) {
  TORCH_CHECK_VALUE(rows.is_cuda() && rows.dim() == 2 && rows.scalar_type() == at::kBFloat16 &&
                        rows.is_contiguous(),
                    "megatron_mok: rows must be a contiguous CUDA bf16 [R, H] tensor");
  TORCH_CHECK_VALUE(route_row.dim() == 2 && route_row.scalar_type() == at::kInt &&
                        route_row.is_contiguous() && route_row.device() == rows.device(),
                    "megatron_mok: route_row must be a contiguous int32 [T, K] tensor on rows' "
                    "device");
  TORCH_CHECK_VALUE(topk_w.sizes() == route_row.sizes() && topk_w.scalar_type() == at::kFloat &&
                        topk_w.is_contiguous() && topk_w.device() == rows.device(),
                    "megatron_mok: topk_w must be a contiguous fp32 tensor shaped like route_row");
  const int64_t T_ = route_row.size(0), H = rows.size(1);
  const int K = static_cast<int>(route_row.size(1));
  TORCH_CHECK_VALUE(H % kVec == 0, "megatron_mok: hidden size must be a multiple of ", kVec);
  if (shared.has_value()) {
    TORCH_CHECK_VALUE(shared->sizes() == at::IntArrayRef({T_, H}) && shared->is_contiguous() &&
                          shared->scalar_type() == at::kBFloat16 &&
                          shared->device() == rows.device(),
                      "megatron_mok: shared must be a contiguous bf16 [T, H] tensor");
  }
  const c10::cuda::CUDAGuard guard(rows.device());
  auto out = at::empty({T_, H}, rows.options());
  constexpr int kThreads = 256;
  const int blocks = grid_for(T_ * (H / kVec), kThreads);
  if (blocks == 0) return out;
  using Bf16 = __nv_bfloat16;
  const RoutedRows<Bf16> row_of{reinterpret_cast<const Bf16*>(rows.data_ptr()),
                                route_row.data_ptr<int>(), K, H};
  combine_kernel<Bf16><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      row_of, topk_w.data_ptr<float>(),
      shared.has_value() ? reinterpret_cast<const Bf16*>(shared->data_ptr()) : nullptr,
      reinterpret_cast<Bf16*>(out.data_ptr()), T_, K, H);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

template <typename T, typename Idx>
void launch(const at::Tensor& slots, const at::Tensor& idx, const at::Tensor& w,
            const std::optional<at::Tensor>& shared, at::Tensor& out) {
  const int64_t T_ = slots.size(0), H = slots.size(2);
  const int K = static_cast<int>(slots.size(1));
  constexpr int kThreads = 256;
  const int blocks = grid_for(T_ * (H / kVec), kThreads);
  if (blocks == 0) return;
  const SlotRows<T, Idx> row_of{reinterpret_cast<const T*>(slots.data_ptr()), idx.data_ptr<Idx>(),
                                K, H};
  combine_kernel<T><<<blocks, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      row_of, w.data_ptr<float>(),
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
  m.impl("combine_rows", &combine_rows_cuda);
}

}  // namespace megatron_mok
