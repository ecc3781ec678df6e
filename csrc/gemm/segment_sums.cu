// The experts' bias gradients: per-expert column sums over the rows of the row table,
//   out[e, c] = sum over rows r of segment e (r < num_rows) of scale[r] * rows[r, c]
// in fp32 (scale optional: the router weights for fc2's bias, none for fc1's). One thread
// owns a column pair of one expert and adds its rows in row order, so every output has one
// writer and a fixed order: bitwise deterministic for any grid. Reads the row count and the
// offsets on the device (no host sync); padding rows are zero rows and add nothing.

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <torch/library.h>

namespace megatron_mok {
namespace {

constexpr int kThreads = 128;

__global__ void __launch_bounds__(kThreads)
segment_column_sums_kernel(const __nv_bfloat162* __restrict__ rows, const float* __restrict__ scale,
                           const int* __restrict__ offsets, const int* __restrict__ num_rows,
                           int64_t pairs, float2* __restrict__ out) {
  const int e = blockIdx.y;
  const int64_t j = int64_t(blockIdx.x) * kThreads + threadIdx.x;  // column pair
  if (j >= pairs) return;
  const int used = __ldg(num_rows);
  const int lo = min(__ldg(offsets + e), used), hi = min(__ldg(offsets + e + 1), used);
  float2 s = make_float2(0.f, 0.f);
  // Unrolled so that several rows' loads are in flight; the adds stay in row order.
#pragma unroll 8
  for (int r = lo; r < hi; ++r) {
    const float2 v = __bfloat1622float2(rows[int64_t(r) * pairs + j]);
    const float w = scale != nullptr ? __ldg(scale + r) : 1.f;
    s.x = fmaf(w, v.x, s.x);
    s.y = fmaf(w, v.y, s.y);
  }
  out[int64_t(e) * pairs + j] = s;
}

void segment_column_sums_cuda(const at::Tensor& rows, const at::Tensor& offsets,
                              const at::Tensor& num_rows, const std::optional<at::Tensor>& scale,
                              const at::Tensor& out) {
  TORCH_CHECK(rows.is_cuda() && rows.scalar_type() == at::kBFloat16 && rows.dim() == 2 &&
                  rows.is_contiguous() && rows.size(1) % 2 == 0,
              "megatron_mok: rows must be a contiguous bfloat16 [rows, N] CUDA tensor, N even");
  const int64_t R = rows.size(0), N = rows.size(1), E = offsets.numel() - 1;
  TORCH_CHECK(offsets.is_cuda() && offsets.scalar_type() == at::kInt && offsets.dim() == 1 &&
                  offsets.is_contiguous() && E >= 1,
              "megatron_mok: expert_offsets must be a contiguous CUDA int32 [E + 1]");
  TORCH_CHECK(num_rows.is_cuda() && num_rows.scalar_type() == at::kInt && num_rows.numel() == 1,
              "megatron_mok: num_rows must be a CUDA int32 tensor with one element");
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kFloat && out.is_contiguous() &&
                  out.dim() == 2 && out.size(0) == E && out.size(1) == N,
              "megatron_mok: out must be a contiguous float32 [", E, ", ", N, "]");
  if (scale.has_value()) {
    TORCH_CHECK(scale->is_cuda() && scale->scalar_type() == at::kFloat && scale->dim() == 1 &&
                    scale->is_contiguous() && scale->size(0) == R,
                "megatron_mok: scale must be a contiguous float32 [", R, "]");
  }
  for (const at::Tensor* t : {&offsets, &num_rows, &out}) {
    TORCH_CHECK(t->device() == rows.device(), "megatron_mok: segment_column_sums' tensors must "
                "be on one device");
  }
  TORCH_CHECK(!scale.has_value() || scale->device() == rows.device(),
              "megatron_mok: scale must be on rows' device");
  c10::cuda::CUDAGuard guard(rows.device());
  const int64_t pairs = N / 2;
  if (pairs == 0) return;
  const dim3 grid(unsigned((pairs + kThreads - 1) / kThreads), unsigned(E));
  segment_column_sums_kernel<<<grid, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const __nv_bfloat162*>(rows.data_ptr()),
      scale.has_value() ? scale->data_ptr<float>() : nullptr, offsets.data_ptr<int>(),
      num_rows.data_ptr<int>(), pairs, reinterpret_cast<float2*>(out.data_ptr<float>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) {
  m.impl("segment_column_sums", &segment_column_sums_cuda);
}

}  // namespace megatron_mok
