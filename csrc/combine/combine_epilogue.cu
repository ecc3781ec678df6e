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

// Routes of a token whose rows are loaded before any of them is summed. One token's
// routes are independent loads; the first version read route k + 1's index and row only
// after summing route k, two dependent round trips per route, and ran latency-bound at
// ~0.57 of DRAM bandwidth (qwen3-30b-a3b forward: 0.110 ms against a 0.063 ms floor).
constexpr int kBatch = 8;

template <typename T>
struct alignas(sizeof(T) * kVec) Vec {
  T v[kVec];
};

// kVec elements at p: one 16-byte (bf16) or two (fp32) vector accesses when aligned.
template <bool kAligned, typename T>
__device__ inline void load_vec(const T* p, T (&out)[kVec]) {
  if constexpr (kAligned) {
    const Vec<T> v = *reinterpret_cast<const Vec<T>*>(p);
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[i] = v.v[i];
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) out[i] = p[i];
  }
}

template <bool kAligned, typename T>
__device__ inline void store_vec(T* p, const float (&acc)[kVec]) {
  Vec<T> v;
#pragma unroll
  for (int i = 0; i < kVec; ++i) v.v[i] = from_float<T>(acc[i]);
  if constexpr (kAligned) {
    *reinterpret_cast<Vec<T>*>(p) = v;
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) p[i] = v.v[i];
  }
}

// The sum is acc = fma(w[t, k], row_k, acc) over k ascending from the shared row (or 0),
// whatever the batching: the loads are reordered, the arithmetic is not.
template <bool kAligned, typename T, class RowOf>
__global__ void combine_kernel(RowOf row_of, const float* __restrict__ w,
                               const T* __restrict__ shared, T* __restrict__ out, int64_t T_,
                               int K, int64_t H) {
  const int64_t vecs_per_row = H / kVec;
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < T_ * vecs_per_row;
       v += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = v / vecs_per_row, h0 = (v % vecs_per_row) * kVec;
    float acc[kVec];
    if (shared != nullptr) {
      T s[kVec];
      load_vec<kAligned>(shared + t * H + h0, s);
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[i] = to_float(s[i]);
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[i] = 0.f;
    }
    for (int k0 = 0; k0 < K; k0 += kBatch) {
      T x[kBatch][kVec];
      float wk[kBatch];
      bool routed[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {  // every load of the batch in flight at once
        const T* row = k0 + j < K ? row_of(t, k0 + j) : nullptr;
        routed[j] = row != nullptr;
        if (routed[j]) {
          wk[j] = w[t * K + k0 + j];
          load_vec<kAligned>(row + h0, x[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (!routed[j]) continue;
#pragma unroll
        for (int i = 0; i < kVec; ++i) acc[i] = fmaf(wk[j], to_float(x[j][i]), acc[i]);
      }
    }
    store_vec<kAligned>(out + t * H + h0, acc);
  }
}

// Vector accesses need every row start 16-byte (bf16) / 32-byte (fp32) aligned: H is a
// multiple of kVec, so the base pointers decide.
template <typename T>
bool vec_aligned(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs) {
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % sizeof(Vec<T>) != 0) return false;
  }
  return true;
}

template <typename T, class RowOf>
void launch_combine(int blocks, bool aligned, const RowOf& row_of, const float* w,
                    const T* shared, T* out, int64_t T_, int K, int64_t H) {
  constexpr int kThreads = 256;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (aligned) {
    combine_kernel<true, T><<<blocks, kThreads, 0, stream>>>(row_of, w, shared, out, T_, K, H);
  } else {
    combine_kernel<false, T><<<blocks, kThreads, 0, stream>>>(row_of, w, shared, out, T_, K, H);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  const Bf16* shared_ptr =
      shared.has_value() ? reinterpret_cast<const Bf16*>(shared->data_ptr()) : nullptr;
  auto* out_ptr = reinterpret_cast<Bf16*>(out.data_ptr());
  launch_combine(blocks, vec_aligned<Bf16>({rows.data_ptr(), shared_ptr, out_ptr}), row_of,
                 topk_w.data_ptr<float>(), shared_ptr, out_ptr, T_, K, H);
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
  const T* shared_ptr = shared.has_value() ? reinterpret_cast<const T*>(shared->data_ptr())
                                           : nullptr;
  auto* out_ptr = reinterpret_cast<T*>(out.data_ptr());
  launch_combine(blocks, vec_aligned<T>({slots.data_ptr(), shared_ptr, out_ptr}), row_of,
                 w.data_ptr<float>(), shared_ptr, out_ptr, T_, K, H);
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
