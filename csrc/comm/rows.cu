// Row movement over NVLink between EP ranks (DESIGN section 4): gather the routing
// of every peer, pull token rows into this rank's row table order (dispatch), and
// push finished rows into the owners' (token, k) slots (combine). Peer memory is
// read and written directly through symmetric-memory addresses with 16-byte
// vector accesses; row j of the table is owned by one CTA, so every destination has
// exactly one writer and all reductions run in a fixed order (deterministic).

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <torch/library.h>

#include <cute/tensor.hpp>

#include "comm/symmetric.cuh"

namespace megatron_mok {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // bf16 per 16-byte vector


// out[j] = src_rank[j].rows[token[j]]; with row_w, row_w[j] = that rank's router weight
// w[token, k] (the rows stay unscaled: the dgrad epilogue applies it); padding rows (rank
// -1) become zeros, weight 0.
__global__ void __launch_bounds__(kThreads)
pull_rows_kernel(const int64_t* __restrict__ peer_base, int64_t src_offset,
                 const int* __restrict__ peer_rank, const int* __restrict__ peer_token,
                 const int* __restrict__ peer_k, const int* __restrict__ num_rows,
                 int topk, int64_t w_offset, uint4* __restrict__ out,
                 float* __restrict__ row_w, int64_t capacity, int64_t vecs_per_row) {
  const int64_t rows = min(static_cast<int64_t>(num_rows[0]), capacity);
  for (int64_t j = blockIdx.x; j < rows; j += gridDim.x) {
    const int r = peer_rank[j];
    uint4* dst = out + j * vecs_per_row;
    if (r < 0) {
      for (int64_t v = threadIdx.x; v < vecs_per_row; v += kThreads) dst[v] = make_uint4(0, 0, 0, 0);
      if (row_w != nullptr && threadIdx.x == 0) row_w[j] = 0.f;
      continue;
    }
    const int64_t t = peer_token[j];
    const uint4* src = peer_ptr<const uint4>(peer_base, r, src_offset) + t * vecs_per_row;
    if (row_w != nullptr && threadIdx.x == 0) {
      row_w[j] = peer_ptr<const float>(peer_base, r, w_offset)[t * topk + peer_k[j]];
    }
    for (int64_t v = threadIdx.x; v < vecs_per_row; v += kThreads) dst[v] = src[v];
  }
}

// rows[j] -> slot (token[j] * topk + k[j]) of rank[j]'s destination buffer (unless rows_in
// is null), and scalars[j] -> the same slot of its scalar buffer.
__global__ void __launch_bounds__(kThreads)
push_rows_kernel(const uint4* __restrict__ rows_in, const int64_t* __restrict__ peer_base,
                 int64_t dst_offset, const int* __restrict__ peer_rank,
                 const int* __restrict__ peer_token, const int* __restrict__ peer_k,
                 const int* __restrict__ num_rows, int topk, const float* __restrict__ scalars,
                 int64_t scalar_offset, int64_t capacity, int64_t vecs_per_row) {
  const int64_t rows = min(static_cast<int64_t>(num_rows[0]), capacity);
  for (int64_t j = blockIdx.x; j < rows; j += gridDim.x) {
    const int r = peer_rank[j];
    if (r < 0) continue;
    const int64_t slot = static_cast<int64_t>(peer_token[j]) * topk + peer_k[j];
    uint4* dst = peer_ptr<uint4>(peer_base, r, dst_offset) + slot * vecs_per_row;
    if (rows_in != nullptr) {
      const uint4* src = rows_in + j * vecs_per_row;
      for (int64_t v = threadIdx.x; v < vecs_per_row; v += kThreads) dst[v] = src[v];
    }
    if (scalars != nullptr && threadIdx.x == 0) {
      peer_ptr<float>(peer_base, r, scalar_offset)[slot] = scalars[j];
    }
  }
}

// The routes the row table dropped (dropped[0] of them in dropped[1..], flat route ids
// of topk_idx_all [P, T, K]): their slot row and scalar on the source rank become zero,
// so the source's combine adds nothing for them instead of a stale row of another pass.
// Nothing to do (dropped[0] == 0) is the normal case: the CTAs return at once.
__global__ void __launch_bounds__(kThreads)
zero_dropped_routes_kernel(const int64_t* __restrict__ peer_base, int64_t slots_offset,
                           int64_t scalar_offset, const int* __restrict__ dropped,
                           int64_t routes_per_rank, int64_t vecs_per_row) {
  const int count = dropped[0];
  for (int i = blockIdx.x; i < count; i += gridDim.x) {
    const int64_t route = dropped[1 + i];
    const int rank = static_cast<int>(route / routes_per_rank);
    const int64_t slot = route % routes_per_rank;  // token * K + k on that rank
    uint4* dst = peer_ptr<uint4>(peer_base, rank, slots_offset) + slot * vecs_per_row;
    for (int64_t v = threadIdx.x; v < vecs_per_row; v += kThreads) dst[v] = make_uint4(0, 0, 0, 0);
    if (threadIdx.x == 0) peer_ptr<float>(peer_base, rank, scalar_offset)[slot] = 0.f;
  }
}

// out[p] = the bytes at peer p's buffer + offset, for every rank p.
__global__ void gather_from_peers_kernel(const int64_t* __restrict__ peer_base, int64_t offset,
                                         int32_t* __restrict__ out, int64_t words_per_rank,
                                         int world) {
  const int64_t total = words_per_rank * world;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int p = static_cast<int>(i / words_per_rank);
    out[i] = peer_ptr<const int32_t>(peer_base, p, offset)[i % words_per_rank];
  }
}

void check_table(const at::Tensor& peer_base, const at::Tensor& peer_rank,
                 const at::Tensor& peer_token, const at::Tensor& peer_k,
                 const at::Tensor& num_rows) {
  TORCH_CHECK_VALUE(peer_base.is_cuda() && peer_base.scalar_type() == at::kLong &&
                        peer_base.dim() == 1,
                    "peer_base must be a CUDA int64 vector");
  for (const at::Tensor* t : {&peer_rank, &peer_token, &peer_k, &num_rows}) {
    TORCH_CHECK_VALUE(t->is_cuda() && t->scalar_type() == at::kInt && t->is_contiguous(),
                      "row-table tensors must be contiguous CUDA int32");
  }
  TORCH_CHECK_VALUE(peer_token.numel() == peer_rank.numel() && peer_k.numel() == peer_rank.numel(),
                    "peer_rank, peer_token and peer_k must have the same length");
}

int grid_for(int64_t capacity) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(capacity, int64_t(sms) * 8)));
}

void pull_rows(const at::Tensor& peer_base, int64_t src_offset, const at::Tensor& peer_rank,
               const at::Tensor& peer_token, const at::Tensor& peer_k, const at::Tensor& num_rows,
               int64_t topk, int64_t w_offset, const at::Tensor& out,
               const std::optional<at::Tensor>& row_w) {
  check_table(peer_base, peer_rank, peer_token, peer_k, num_rows);
  TORCH_CHECK_VALUE(out.is_cuda() && out.scalar_type() == at::kBFloat16 && out.dim() == 2 &&
                        out.is_contiguous() && out.size(0) == peer_rank.numel() &&
                        out.size(1) % kVec == 0,
                    "out must be a contiguous CUDA bf16 [capacity, H] tensor, H % 8 == 0");
  TORCH_CHECK_VALUE(src_offset % 16 == 0 && (w_offset < 0 || w_offset % 4 == 0),
                    "symmetric offsets must be aligned");
  TORCH_CHECK_VALUE((w_offset >= 0) == row_w.has_value(), "w_offset and row_w go together");
  if (row_w.has_value()) {
    TORCH_CHECK_VALUE(row_w->is_cuda() && row_w->scalar_type() == at::kFloat &&
                          row_w->numel() == out.size(0) && row_w->is_contiguous(),
                      "row_w must be contiguous CUDA fp32 [capacity]");
  }
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t capacity = out.size(0);
  pull_rows_kernel<<<grid_for(capacity), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      peer_base.data_ptr<int64_t>(), src_offset, peer_rank.data_ptr<int>(),
      peer_token.data_ptr<int>(), peer_k.data_ptr<int>(), num_rows.data_ptr<int>(),
      static_cast<int>(topk), w_offset, reinterpret_cast<uint4*>(out.data_ptr()),
      row_w.has_value() ? row_w->data_ptr<float>() : nullptr, capacity, out.size(1) / kVec);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void push_rows(const std::optional<at::Tensor>& rows, const at::Tensor& peer_base,
               int64_t dst_offset, const at::Tensor& peer_rank, const at::Tensor& peer_token,
               const at::Tensor& peer_k, const at::Tensor& num_rows, int64_t topk,
               const std::optional<at::Tensor>& scalars, int64_t scalar_offset) {
  check_table(peer_base, peer_rank, peer_token, peer_k, num_rows);
  TORCH_CHECK_VALUE(rows.has_value() || scalars.has_value(), "push_rows needs rows or scalars");
  int64_t vecs_per_row = 0;
  if (rows.has_value()) {
    TORCH_CHECK_VALUE(rows->is_cuda() && rows->scalar_type() == at::kBFloat16 &&
                          rows->dim() == 2 && rows->is_contiguous() &&
                          rows->size(0) == peer_rank.numel() && rows->size(1) % kVec == 0,
                      "rows must be a contiguous CUDA bf16 [capacity, H] tensor, H % 8 == 0");
    TORCH_CHECK_VALUE(dst_offset % 16 == 0, "symmetric offsets must be aligned");
    vecs_per_row = rows->size(1) / kVec;
  }
  if (scalars.has_value()) {
    TORCH_CHECK_VALUE(scalar_offset % 4 == 0, "symmetric offsets must be aligned");
    TORCH_CHECK_VALUE(scalars->is_cuda() && scalars->scalar_type() == at::kFloat &&
                          scalars->numel() == peer_rank.numel() && scalars->is_contiguous(),
                      "scalars must be fp32 [capacity]");
  }
  const c10::cuda::CUDAGuard guard(peer_rank.device());
  const int64_t capacity = peer_rank.numel();
  push_rows_kernel<<<grid_for(capacity), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      rows.has_value() ? reinterpret_cast<const uint4*>(rows->data_ptr()) : nullptr,
      peer_base.data_ptr<int64_t>(), dst_offset, peer_rank.data_ptr<int>(),
      peer_token.data_ptr<int>(), peer_k.data_ptr<int>(), num_rows.data_ptr<int>(),
      static_cast<int>(topk), scalars.has_value() ? scalars->data_ptr<float>() : nullptr,
      scalar_offset, capacity, vecs_per_row);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void zero_dropped_routes(const at::Tensor& peer_base, int64_t slots_offset,
                         int64_t scalar_offset, const at::Tensor& dropped, int64_t num_tokens,
                         int64_t topk, int64_t hidden) {
  TORCH_CHECK_VALUE(peer_base.is_cuda() && peer_base.scalar_type() == at::kLong,
                    "peer_base must be a CUDA int64 vector");
  TORCH_CHECK_VALUE(dropped.is_cuda() && dropped.scalar_type() == at::kInt &&
                        dropped.is_contiguous() &&
                        dropped.numel() == 1 + peer_base.numel() * num_tokens * topk,
                    "dropped must be a contiguous CUDA int32 [1 + P * T * K] tensor");
  TORCH_CHECK_VALUE(hidden % kVec == 0 && slots_offset % 16 == 0 && scalar_offset % 4 == 0,
                    "H % 8 == 0 and aligned symmetric offsets");
  const c10::cuda::CUDAGuard guard(dropped.device());
  zero_dropped_routes_kernel<<<64, kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      peer_base.data_ptr<int64_t>(), slots_offset, scalar_offset, dropped.data_ptr<int>(),
      num_tokens * topk, hidden / kVec);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void gather_from_peers(const at::Tensor& peer_base, int64_t offset, const at::Tensor& out) {
  TORCH_CHECK_VALUE(peer_base.is_cuda() && peer_base.scalar_type() == at::kLong,
                    "peer_base must be a CUDA int64 vector");
  const int world = static_cast<int>(peer_base.numel());
  TORCH_CHECK_VALUE(out.is_cuda() && out.is_contiguous() && out.size(0) == world,
                    "out must be a contiguous CUDA tensor [world, ...]");
  const int64_t bytes_per_rank = out.nbytes() / world;
  TORCH_CHECK_VALUE(bytes_per_rank % 4 == 0 && offset % 4 == 0,
                    "gathered chunks must be whole 32-bit words");
  const c10::cuda::CUDAGuard guard(out.device());
  const int64_t words = bytes_per_rank / 4;
  const int blocks = static_cast<int>(std::min<int64_t>(cute::ceil_div(words * world, int64_t(256)), 1024));
  if (blocks == 0) return;
  gather_from_peers_kernel<<<blocks, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      peer_base.data_ptr<int64_t>(), offset, reinterpret_cast<int32_t*>(out.data_ptr()), words,
      world);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) {
  m.impl("pull_rows", &pull_rows);
  m.impl("push_rows", &push_rows);
  m.impl("gather_from_peers", &gather_from_peers);
  m.impl("zero_dropped_routes", &zero_dropped_routes);
}

}  // namespace megatron_mok
