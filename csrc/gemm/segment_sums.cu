// The experts' bias gradients: per-expert column sums over the rows of the row table,
//   out[e, c] = sum over rows r of segment e (r < num_rows) of scale[r] * rows[r, c]
// in fp32 (scale optional: the router weights for fc2's bias, none for fc1's). Two launches:
// each expert's rows are cut into kSplits fixed slices, one thread sums 8 columns (16-byte
// loads) of one slice in row order into a partial; then the kSplits partials are added in
// slice order. Every value has one writer and a fixed order: bitwise deterministic for any
// grid. (One pass with a thread per column and expert left too few loads in flight where
// experts are few and long.) Reads the row count and the offsets on the device (no host
// sync); padding rows are zero rows and add nothing.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <torch/library.h>

namespace megatron_mok {
namespace {

constexpr int kThreads = 128;
constexpr int kSplits = 8;  // row slices per expert (a constant: the bits do not depend on it)

__device__ __forceinline__ void add_row(float (&acc)[8], const uint4& v, float w) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(p[i]);
    acc[2 * i] = fmaf(w, f.x, acc[2 * i]);
    acc[2 * i + 1] = fmaf(w, f.y, acc[2 * i + 1]);
  }
}

// partial[(s * E + e) * N + 8 j ..] = the sum over slice s of expert e's rows, columns 8 j...
__global__ void __launch_bounds__(kThreads)
segment_column_partials(const uint4* __restrict__ rows, const float* __restrict__ scale,
                        const int* __restrict__ offsets, const int* __restrict__ num_rows,
                        int rows_cap, int64_t groups, float4* __restrict__ partial) {
  const int e = blockIdx.y, s = blockIdx.z, E = gridDim.y;
  const int64_t j = int64_t(blockIdx.x) * kThreads + threadIdx.x;  // group of 8 columns
  if (j >= groups) return;
  const int used = min(__ldg(num_rows), rows_cap);
  const int lo = min(__ldg(offsets + e), used), hi = min(__ldg(offsets + e + 1), used);
  const int per = (hi - lo + kSplits - 1) / kSplits;
  const int r0 = min(lo + s * per, hi), r1 = min(r0 + per, hi);
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  // Unrolled so that several rows' loads are in flight; the adds stay in row order.
#pragma unroll 4
  for (int r = r0; r < r1; ++r) {
    add_row(acc, __ldg(rows + int64_t(r) * groups + j), scale != nullptr ? __ldg(scale + r) : 1.f);
  }
  float4* out = partial + (int64_t(s) * E + e) * groups * 2 + 2 * j;
  out[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  out[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
}

// out[i] = partial[0][i] + partial[1][i] + ... in slice order (i over E * N values).
__global__ void __launch_bounds__(kThreads)
sum_partials(const float* __restrict__ partial, int64_t count, float* __restrict__ out) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= count) return;
  float total = 0.f;
#pragma unroll
  for (int s = 0; s < kSplits; ++s) total += partial[s * count + i];
  out[i] = total;
}

// out[r] = <rows[r], vecs[e(r)]> in fp32 for the rows below num_rows (e(r): the segment of
// row r), 0 past them. One warp per row, a fixed butterfly: deterministic.
__global__ void __launch_bounds__(kThreads)
segment_row_dots_kernel(const uint4* __restrict__ rows, const uint4* __restrict__ vecs,
                        const int* __restrict__ offsets, int num_experts,
                        const int* __restrict__ num_rows, int64_t groups, int64_t count,
                        float* __restrict__ out) {
  const int64_t r = int64_t(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= count) return;
  if (r >= __ldg(num_rows)) {  // (r < count: past the table is never read)
    if (lane == 0) out[r] = 0.f;
    return;
  }
  int lo = 0, hi = num_experts - 1;  // the last e with offsets[e] <= r
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (__ldg(offsets + mid) <= r) lo = mid; else hi = mid - 1;
  }
  float acc = 0.f;
  for (int64_t j = lane; j < groups; j += 32) {
    const uint4 a = __ldg(rows + r * groups + j), b = __ldg(vecs + lo * groups + j);
    const __nv_bfloat162* pa = reinterpret_cast<const __nv_bfloat162*>(&a);
    const __nv_bfloat162* pb = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 fa = __bfloat1622float2(pa[i]), fb = __bfloat1622float2(pb[i]);
      acc = fmaf(fa.x, fb.x, acc);
      acc = fmaf(fa.y, fb.y, acc);
    }
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if (lane == 0) out[r] = acc;
}

// The checks both ops share: bf16 rows [R, N] (N a multiple of 8, 16-byte aligned for the
// row loads), the row table's expert_offsets [E + 1] and num_rows on rows' device.
void check_segment_rows(const at::Tensor& rows, const at::Tensor& offsets,
                        const at::Tensor& num_rows) {
  TORCH_CHECK(rows.is_cuda() && rows.scalar_type() == at::kBFloat16 && rows.dim() == 2 &&
                  rows.is_contiguous() && rows.size(1) % 8 == 0,
              "megatron_mok: rows must be a contiguous bfloat16 [rows, N] CUDA tensor, N a "
              "multiple of 8");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(rows.data_ptr()) % 16 == 0,
              "megatron_mok: rows must be 16-byte aligned (16-byte loads)");
  TORCH_CHECK(offsets.is_cuda() && offsets.scalar_type() == at::kInt && offsets.dim() == 1 &&
                  offsets.is_contiguous() && offsets.numel() >= 2,
              "megatron_mok: expert_offsets must be a contiguous CUDA int32 [E + 1]");
  TORCH_CHECK(num_rows.is_cuda() && num_rows.scalar_type() == at::kInt && num_rows.numel() == 1,
              "megatron_mok: num_rows must be a CUDA int32 tensor with one element");
  TORCH_CHECK(offsets.device() == rows.device() && num_rows.device() == rows.device(),
              "megatron_mok: expert_offsets and num_rows must be on rows' device");
}

void segment_row_dots_cuda(const at::Tensor& rows, const at::Tensor& vecs,
                           const at::Tensor& offsets, const at::Tensor& num_rows,
                           const at::Tensor& out) {
  check_segment_rows(rows, offsets, num_rows);
  const int64_t R = rows.size(0), N = rows.size(1), E = offsets.numel() - 1;
  TORCH_CHECK(vecs.is_cuda() && vecs.device() == rows.device() &&
                  vecs.scalar_type() == at::kBFloat16 && vecs.is_contiguous() &&
                  vecs.dim() == 2 && vecs.size(0) == E && vecs.size(1) == N &&
                  reinterpret_cast<uintptr_t>(vecs.data_ptr()) % 16 == 0,
              "megatron_mok: vecs must be a contiguous, 16-byte aligned bfloat16 [", E, ", ", N,
              "] on rows' device");
  TORCH_CHECK(out.is_cuda() && out.device() == rows.device() &&
                  out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == R,
              "megatron_mok: out must be a contiguous float32 [", R, "] on rows' device");
  c10::cuda::CUDAGuard guard(rows.device());
  if (R == 0) return;
  constexpr int kRowsPerBlock = kThreads / 32;
  segment_row_dots_kernel<<<unsigned((R + kRowsPerBlock - 1) / kRowsPerBlock), kThreads, 0,
                            at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint4*>(rows.data_ptr()),
      reinterpret_cast<const uint4*>(vecs.data_ptr()), offsets.data_ptr<int>(), int(E),
      num_rows.data_ptr<int>(), N / 8, R, out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void segment_column_sums_cuda(const at::Tensor& rows, const at::Tensor& offsets,
                              const at::Tensor& num_rows, const std::optional<at::Tensor>& scale,
                              const at::Tensor& out) {
  check_segment_rows(rows, offsets, num_rows);
  const int64_t R = rows.size(0), N = rows.size(1), E = offsets.numel() - 1;
  TORCH_CHECK(E < 65536, "megatron_mok: segment_column_sums takes fewer than 65536 experts");
  TORCH_CHECK(out.is_cuda() && out.device() == rows.device() &&
                  out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == E && out.size(1) == N,
              "megatron_mok: out must be a contiguous float32 [", E, ", ", N, "] on rows' device");
  if (scale.has_value()) {
    TORCH_CHECK(scale->is_cuda() && scale->device() == rows.device() &&
                    scale->scalar_type() == at::kFloat && scale->dim() == 1 &&
                    scale->is_contiguous() && scale->size(0) == R,
                "megatron_mok: scale must be a contiguous float32 [", R, "] on rows' device");
  }
  c10::cuda::CUDAGuard guard(rows.device());
  const int64_t groups = N / 8;
  if (groups == 0) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  at::Tensor partial = at::empty({kSplits, E, N}, out.options());
  const dim3 grid(unsigned((groups + kThreads - 1) / kThreads), unsigned(E), kSplits);
  segment_column_partials<<<grid, kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(rows.data_ptr()),
      scale.has_value() ? scale->data_ptr<float>() : nullptr, offsets.data_ptr<int>(),
      num_rows.data_ptr<int>(), int(R), groups,
      reinterpret_cast<float4*>(partial.data_ptr<float>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t count = E * N;
  sum_partials<<<unsigned((count + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      partial.data_ptr<float>(), count, out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) {
  m.impl("segment_column_sums", &segment_column_sums_cuda);
  m.impl("segment_row_dots", &segment_row_dots_cuda);
}

}  // namespace megatron_mok
