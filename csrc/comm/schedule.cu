// The row table (megatron_mok/schedule.py, build_row_table) in three launches instead of
// ~60 small tensor ops: the same table, bit for bit (integers only), with no host sync.
//
//   1. count:  CTA c counts the local routes of its chunk of kChunk routes per expert,
//              and flags expert ids outside [-1, num_experts);
//   2. offsets (one CTA): per expert, an exclusive scan over the chunks, the padded
//              segment starts, num_rows and the overflow flag (the table was set to -1
//              by memsets before);
//   3. place:  CTA c places each local route of its chunk at
//              offsets[e] + (routes of e in earlier chunks) + (routes of e earlier in this
//              chunk), the stable (expert, route id) order of build_row_table, dropping
//              rows past the capacity; at EP = 1 it also writes the inverse map,
//              route_row[t, k] = the row of route (t, k) (-1: dropped or no route), which
//              the in-place combine reads (one table per layer instead of ~10 tensor ops
//              per forward).
// Routes are the flat index r of topk_idx_all [P, T, K]: rank r / (T K), token r / K % T,
// k r % K.
//
// Errors never pass silently (docs/reliability.md): the offsets kernel latches the first
// overflow and the first invalid expert id into the device's sticky status word
// (routing_status.h), which the host reads without a sync; a route dropped for lack of
// room is listed in `dropped` (EP > 1) so every pass can zero its slot on the source rank
// (zero_dropped_routes in rows.cu) and the combine never reads a stale row.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "comm/routing_status.h"

namespace megatron_mok {
namespace {

constexpr int kChunk = 1024;      // routes per CTA (one per thread)
constexpr int kMaxLocalExperts = 512;
constexpr int kTile = 128;        // TILE_M: segments are padded to whole GEMM tiles

__device__ __forceinline__ int local_expert(int id, int first, int num_local) {
  const int e = id - first;
  return id >= 0 && e >= 0 && e < num_local ? e : -1;
}

// counts [num_chunks, E_loc]
__global__ void __launch_bounds__(kChunk)
schedule_count_kernel(const int* __restrict__ ids, int64_t num_routes, int first, int num_local,
                      int num_experts, int* __restrict__ counts, int* __restrict__ invalid,
                      int* __restrict__ invalid_stats) {
  __shared__ int hist[kMaxLocalExperts];
  for (int e = threadIdx.x; e < num_local; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t r = int64_t(blockIdx.x) * kChunk + threadIdx.x;
  if (r < num_routes) {
    const int id = ids[r];
    if (id < -1 || id >= num_experts) {  // [0] how many, [1] the first (lowest route)
      atomicOr(invalid, 1);
      atomicAdd(&invalid_stats[0], 1);
      atomicMin(&invalid_stats[1], int(r));
    }
    const int e = local_expert(id, first, num_local);
    if (e >= 0) atomicAdd(&hist[e], 1);  // a count: the order of the adds does not matter
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_local; e += blockDim.x) {
    counts[int64_t(blockIdx.x) * num_local + e] = hist[e];
  }
}

// One thread: record this pass's overflow / invalid ids in the sticky status word, the
// details only when that error is the first since the host last cleared it.
__device__ void latch_errors(int rows_needed, int capacity, int num_local, const int* padded,
                             const int* routed, const int* __restrict__ ids,
                             const int* __restrict__ invalid_stats, int ep_size, int ep_rank,
                             int num_tokens, int topk, int* __restrict__ status) {
  namespace rs = routing_status;
  if (rows_needed > capacity) {
    int start = 0, dropped = 0, busiest = 0;
    for (int e = 0; e < num_local; ++e) {  // rows of e past the capacity are dropped
      const int kept = min(max(capacity - start, 0), routed[e]);
      dropped += routed[e] - kept;
      if (routed[e] > routed[busiest]) busiest = e;
      start += padded[e];
    }
    if (!(status[rs::kBits] & rs::kOverflow)) {
      status[rs::kOverflowRank] = ep_rank;
      status[rs::kRowsNeeded] = rows_needed;
      status[rs::kCapacity] = capacity;
      status[rs::kBusiestExpert] = ep_rank * num_local + busiest;
      status[rs::kBusiestRows] = routed[busiest];
      status[rs::kDroppedRoutes] = dropped;
      status[rs::kEpSize] = ep_size;
      status[rs::kTokens] = num_tokens;
      status[rs::kTopk] = topk;
      status[rs::kLocalExperts] = num_local;
    }
    status[rs::kBits] |= rs::kOverflow;
  }
  if (invalid_stats[0] > 0) {
    if (!(status[rs::kBits] & rs::kInvalidIds)) {
      const int r = invalid_stats[1], per_rank = num_tokens * topk;
      status[rs::kInvalidRank] = r / per_rank;
      status[rs::kInvalidToken] = r / topk % num_tokens;
      status[rs::kInvalidK] = r % topk;
      status[rs::kInvalidValue] = ids[r];
      status[rs::kInvalidCount] = invalid_stats[0];
    }
    status[rs::kBits] |= rs::kInvalidIds;
  }
}

// One CTA: chunk_base [num_chunks, E_loc] (exclusive over chunks), tokens_per_expert,
// expert_offsets [E_loc + 1] (padded), num_rows, overflow.
__global__ void __launch_bounds__(1024)
schedule_offsets_kernel(const int* __restrict__ counts, int num_chunks, int num_local,
                        int capacity, int* __restrict__ chunk_base,
                        int* __restrict__ tokens_per_expert, int* __restrict__ offsets,
                        int* __restrict__ num_rows, int* __restrict__ overflow,
                        const int* __restrict__ ids, const int* __restrict__ invalid_stats,
                        int ep_size, int ep_rank, int num_tokens, int topk,
                        int* __restrict__ status) {
  __shared__ int padded[kMaxLocalExperts];
  __shared__ int routed[kMaxLocalExperts];
  for (int e = threadIdx.x; e < num_local; e += blockDim.x) {
    int total = 0;
    // One thread per expert walks the chunks (64 at T K = 65 k routes); unrolled so the
    // loads overlap. A tree scan would serve the EP = 8 sizes (1 k chunks) better.
#pragma unroll 8
    for (int c = 0; c < num_chunks; ++c) {
      chunk_base[int64_t(c) * num_local + e] = total;
      total += counts[int64_t(c) * num_local + e];
    }
    tokens_per_expert[e] = total;
    routed[e] = total;
    padded[e] = (total + kTile - 1) / kTile * kTile;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int sum = 0;
    offsets[0] = 0;
    for (int e = 0; e < num_local; ++e) {
      sum += padded[e];
      offsets[e + 1] = sum;
    }
    num_rows[0] = sum;
    overflow[0] = sum > capacity ? 1 : 0;
    latch_errors(sum, capacity, num_local, padded, routed, ids, invalid_stats, ep_size,
                 ep_rank, num_tokens, topk, status);
  }
}

// Rank of this thread's route among the chunk's earlier routes of the same expert: within
// the warp by matching lanes, across warps by per-warp counts in shared memory.
__global__ void __launch_bounds__(kChunk)
schedule_place_kernel(const int* __restrict__ ids, int64_t num_routes, int first, int num_local,
                      int num_tokens, int topk, int capacity, const int* __restrict__ chunk_base,
                      const int* __restrict__ offsets, int* __restrict__ peer_rank,
                      int* __restrict__ peer_token, int* __restrict__ peer_k,
                      int* __restrict__ route_row, int* __restrict__ dropped) {
  constexpr int kWarps = kChunk / 32;
  __shared__ int warp_count[kWarps][64];  // per warp, per expert of the current group of 64
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t r = int64_t(blockIdx.x) * kChunk + threadIdx.x;
  const int e = r < num_routes ? local_expert(ids[r], first, num_local) : -1;
  const unsigned same = __match_any_sync(0xffffffffu, e);
  const int in_warp = __popc(same & ((1u << lane) - 1));
  int before = 0;  // routes of e in earlier warps of this chunk
  // Experts in groups of 64 so that the counts fit in shared memory at any E_loc.
  for (int g0 = 0; g0 < num_local; g0 += 64) {
    for (int i = threadIdx.x; i < kWarps * 64; i += blockDim.x) warp_count[i / 64][i % 64] = 0;
    __syncthreads();
    // The lowest lane of each group of equal experts writes the group's size.
    if (e >= g0 && e < g0 + 64 && in_warp == 0) warp_count[warp][e - g0] = __popc(same);
    __syncthreads();
    if (e >= g0 && e < g0 + 64) {
      for (int w = 0; w < warp; ++w) before += warp_count[w][e - g0];
    }
    __syncthreads();
  }
  if (e < 0) return;
  const int64_t row = int64_t(offsets[e]) + chunk_base[int64_t(blockIdx.x) * num_local + e] +
                      before + in_warp;
  if (row >= capacity) {  // dropped: the table is full (overflow is latched)
    // dropped[0] routes follow in dropped[1..] (any order: zeroing their slots is idempotent)
    if (dropped != nullptr) dropped[1 + atomicAdd(&dropped[0], 1)] = int(r);
    return;
  }
  const int64_t per_rank = int64_t(num_tokens) * topk;
  peer_rank[row] = int(r / per_rank);
  peer_token[row] = int(r / topk % num_tokens);
  peer_k[row] = int(r % topk);
  if (route_row != nullptr) route_row[r] = int(row);  // EP = 1: r is (t, k) of this rank
}

void build_row_table_cuda(const at::Tensor& topk_idx_all, int64_t ep_rank,
                          int64_t num_local_experts, int64_t num_experts,
                          const at::Tensor& peer_rank, const at::Tensor& peer_token,
                          const at::Tensor& peer_k, const at::Tensor& tokens_per_expert,
                          const at::Tensor& expert_offsets, const at::Tensor& num_rows,
                          const at::Tensor& overflow, const at::Tensor& invalid_ids,
                          const std::optional<at::Tensor>& route_row, const at::Tensor& status,
                          const std::optional<at::Tensor>& dropped) {
  TORCH_CHECK(topk_idx_all.is_cuda() && topk_idx_all.scalar_type() == at::kInt &&
                  topk_idx_all.dim() == 3 && topk_idx_all.is_contiguous(),
              "megatron_mok: topk_idx_all must be a contiguous CUDA int32 [P, T, K] tensor");
  TORCH_CHECK(num_local_experts >= 1 && num_local_experts <= kMaxLocalExperts,
              "megatron_mok: the GPU schedule supports 1 to ", kMaxLocalExperts,
              " local experts, got ", num_local_experts);
  const int64_t capacity = peer_rank.numel();
  auto check = [&](const at::Tensor& t, const char* name, int64_t numel) {
    TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kInt && t.is_contiguous() &&
                    t.numel() == numel && t.device() == topk_idx_all.device(),
                "megatron_mok: ", name, " must be a contiguous CUDA int32 tensor of ", numel,
                " entries on topk_idx_all's device");
  };
  check(peer_rank, "peer_rank", capacity);
  check(peer_token, "peer_token", capacity);
  check(peer_k, "peer_k", capacity);
  check(tokens_per_expert, "tokens_per_expert", num_local_experts);
  check(expert_offsets, "expert_offsets", num_local_experts + 1);
  check(num_rows, "num_rows", 1);
  check(overflow, "overflow", 1);
  check(invalid_ids, "invalid_ids", 1);
  if (route_row.has_value()) {
    TORCH_CHECK(topk_idx_all.size(0) == 1,
                "megatron_mok: route_row (the inverse map of the row table) exists at EP = 1 only");
    check(*route_row, "route_row", topk_idx_all.numel());
  }
  check(status, "status", routing_status::kSize);
  if (dropped.has_value()) check(*dropped, "dropped", 1 + topk_idx_all.numel());
  TORCH_CHECK(capacity % kTile == 0, "megatron_mok: the row table holds whole 128-row tiles");
  c10::cuda::CUDAGuard guard(topk_idx_all.device());
  const int64_t num_routes = topk_idx_all.numel();
  const int num_tokens = int(topk_idx_all.size(1)), topk = int(topk_idx_all.size(2));
  const int num_chunks = int(std::max<int64_t>(1, (num_routes + kChunk - 1) / kChunk));
  const int first = int(ep_rank * num_local_experts), num_local = int(num_local_experts);
  auto scratch = at::empty({2 * int64_t(num_chunks) * num_local + 2}, topk_idx_all.options());
  int* counts = scratch.data_ptr<int>();
  int* chunk_base = counts + int64_t(num_chunks) * num_local;
  int* invalid_stats = chunk_base + int64_t(num_chunks) * num_local;  // count, first route
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(cudaMemsetAsync(invalid_ids.data_ptr(), 0, sizeof(int), stream));
  C10_CUDA_CHECK(cudaMemsetAsync(invalid_stats, 0, sizeof(int), stream));
  C10_CUDA_CHECK(cudaMemsetAsync(invalid_stats + 1, 0x7F, sizeof(int), stream));  // > any route
  int* dropped_ptr = nullptr;
  if (dropped.has_value()) {
    dropped_ptr = dropped->data_ptr<int>();
    C10_CUDA_CHECK(cudaMemsetAsync(dropped_ptr, 0, sizeof(int), stream));
  }
  for (const at::Tensor* t : {&peer_rank, &peer_token, &peer_k}) {  // -1: unused rows
    C10_CUDA_CHECK(cudaMemsetAsync(t->data_ptr(), 0xFF, capacity * sizeof(int), stream));
  }
  int* route_row_ptr = nullptr;
  if (route_row.has_value()) {  // -1: routes without a row (dropped, id -1)
    route_row_ptr = route_row->data_ptr<int>();
    C10_CUDA_CHECK(cudaMemsetAsync(route_row_ptr, 0xFF, num_routes * sizeof(int), stream));
  }
  const int* ids = topk_idx_all.data_ptr<int>();
  schedule_count_kernel<<<num_chunks, kChunk, 0, stream>>>(
      ids, num_routes, first, num_local, int(num_experts), counts, invalid_ids.data_ptr<int>(),
      invalid_stats);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  schedule_offsets_kernel<<<1, 1024, 0, stream>>>(
      counts, num_chunks, num_local, int(capacity), chunk_base,
      tokens_per_expert.data_ptr<int>(), expert_offsets.data_ptr<int>(),
      num_rows.data_ptr<int>(), overflow.data_ptr<int>(), ids, invalid_stats,
      int(topk_idx_all.size(0)), int(ep_rank), num_tokens, topk, status.data_ptr<int>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  schedule_place_kernel<<<num_chunks, kChunk, 0, stream>>>(
      ids, num_routes, first, num_local, num_tokens, topk, int(capacity), chunk_base,
      expert_offsets.data_ptr<int>(), peer_rank.data_ptr<int>(), peer_token.data_ptr<int>(),
      peer_k.data_ptr<int>(), route_row_ptr, dropped_ptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) { m.impl("build_row_table", &build_row_table_cuda); }

}  // namespace megatron_mok
