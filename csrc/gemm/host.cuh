// Host helpers of the grouped-GEMM core shared by its launchers (grouped_gemm.cu, the
// megakernels): argument checks, row-table parameters, TMA load and store atoms.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include "gemm/tile.cuh"

namespace megatron_mok::gemm_host {

using namespace cute;
using gemm::GemmParams;
using gemm::bf16;

// Configurations, by cluster size C (MOK_GEMM_CLUSTER; 1 unless set to 2).
// fc1 + SwiGLU: B = w1 viewed as (I, H, 2E) boxes (gate of e = 2e, up of e = 2e + 1).
template <int C>
using CfgFc1SwiGLU = gemm::GemmConfig<true, true, gemm::Grouping::kRows, gemm::Epi::kSwiGLU, __nv_bfloat16, C>;
// out = a @ w[e]^T, w [E, N, K] (fc2 forward).
template <int C>
using CfgRowsNT = gemm::GemmConfig<true, true, gemm::Grouping::kRows, gemm::Epi::kStore, __nv_bfloat16, C>;
// out = a @ w[e], w [E, K, N] (dgrad).
template <int C>
using CfgRowsNN = gemm::GemmConfig<true, false, gemm::Grouping::kRows, gemm::Epi::kStore, __nv_bfloat16, C>;
// d_h = SwiGLU'(h) * (d_out @ w2[e]), w2 [E, H, I] (fc2 dgrad fused with SwiGLU backward).
template <int C>
using CfgDgradSwiGLU =
    gemm::GemmConfig<true, false, gemm::Grouping::kRows, gemm::Epi::kSwiGLUBwd, __nv_bfloat16, C>;
// The general variants (kGlu; clusters of 1 only): the GLU epilogues with their parameters
// and the bias adds (fc1 + GLU + b1, fc2 + b2).
using CfgFc1Glu = gemm::GemmConfig<true, true, gemm::Grouping::kRows, gemm::Epi::kSwiGLU,
                                   __nv_bfloat16, 1, 256, 4, true>;
using CfgRowsNTBias = gemm::GemmConfig<true, true, gemm::Grouping::kRows, gemm::Epi::kStore,
                                       __nv_bfloat16, 1, 256, 4, true>;
using CfgDgradGlu = gemm::GemmConfig<true, false, gemm::Grouping::kRows, gemm::Epi::kSwiGLUBwd,
                                     __nv_bfloat16, 1, 256, 4, true>;
// Non-gated experts (grouped_act.cu): fc1 + activation (+ b1), w1 [E, I, H]; fc2 dgrad +
// the activation's backward, w2 [E, H, I].
template <int kFn>
using CfgFc1Act = gemm::GemmConfig<true, true, gemm::Grouping::kRows, gemm::Epi::kAct,
                                   __nv_bfloat16, 1, 256, 4, false, kFn>;
template <int kFn>
using CfgDgradAct = gemm::GemmConfig<true, false, gemm::Grouping::kRows, gemm::Epi::kActBwd,
                                     __nv_bfloat16, 1, 256, 4, false, kFn>;
// Core v6 ping-pong (MOK_GEMM_PINGPONG=1): 128 x 128 tiles per consumer warpgroup,
// 6 stages of 32 KB: fc2 / dgrad (store) and the fused dgrad + SwiGLU backward.
using CfgRowsNTPing = gemm::GemmConfig<true, true, gemm::Grouping::kRows, gemm::Epi::kStore, __nv_bfloat16, 1, 128, 6>;
using CfgRowsNNPing = gemm::GemmConfig<true, false, gemm::Grouping::kRows, gemm::Epi::kStore, __nv_bfloat16, 1, 128, 6>;
using CfgDgradSwiGLUPing =
    gemm::GemmConfig<true, false, gemm::Grouping::kRows, gemm::Epi::kSwiGLUBwd, __nv_bfloat16, 1, 128, 6>;
// out[e] = a[rows of e]^T @ b[rows of e] (weight gradients), bf16 or fp32 output.
template <int C>
using CfgWgradBf16 =
    gemm::GemmConfig<false, false, gemm::Grouping::kTokensAsK, gemm::Epi::kStore, __nv_bfloat16, C>;
template <int C>
using CfgWgradF32 = gemm::GemmConfig<false, false, gemm::Grouping::kTokensAsK, gemm::Epi::kStore, float, C>;
// The same with operand rows gathered by the producer from the tokens (EP = 1; clusters of
// 1); kGather: gemm::kGatherA | gemm::kGatherB bits.
template <class OutT, int kGather>
using CfgWgradGather = gemm::GemmConfig<false, false, gemm::Grouping::kTokensAsK, gemm::Epi::kStore,
                                        OutT, 1, 256, 4, false, 0, kGather>;

// x [T, H] bf16 as a TMA tensor map of 1 x 64 boxes (one 128-byte row piece), 128B swizzle:
// row gathers by TMA (the forward megakernel's direct mode, the gathered weight gradients).
// A box on row T (out of bounds) is zero-filled.
inline cute::TmaDescriptor row_box_map(const at::Tensor& x) {
  cute::TmaDescriptor map{};
  cuuint64_t dims[2] = {cuuint64_t(x.size(1)), cuuint64_t(x.size(0))};
  cuuint64_t strides[1] = {cuuint64_t(x.stride(0) * 2)};
  cuuint32_t box[2] = {64, 1};
  cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, x.data_ptr(), dims, strides, box, elem_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  TORCH_CHECK(r == CUDA_SUCCESS, "megatron_mok: cuTensorMapEncodeTiled failed for a row map (",
              int(r), ")");
  return map;
}

inline int num_sms(int device) {
  static int cached[64] = {0};
  if (cached[device] == 0) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    cached[device] = n;
  }
  return cached[device];
}

// The TMA descriptors are encoded through the driver API, which needs a current context. A
// thread whose first CUDA call is one of ours (autograd's device threads: the backward
// megakernel at EP = 1 issues nothing before it) has none, and c10's device guard does not
// make one current (it skips cudaSetDevice when the device is already selected); encoding
// then fails with CUDA_ERROR_INVALID_CONTEXT. cudaSetDevice initializes the primary context
// and makes it current.
inline void make_context_current(const at::Tensor& t) { C10_CUDA_CHECK(cudaSetDevice(t.get_device())); }

inline const bf16* as_bf16(const at::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); }

// A 3-D output view (rows, cols, planes) for the epilogue's TMA stores.
struct OutView {
  void* ptr;
  int64_t rows, cols, planes, ld, plane_stride;
};

inline OutView rows_view(const at::Tensor& t) { return {t.data_ptr(), t.size(0), t.size(1), 1, t.size(1), 0}; }

// [rows, 2I] as (rows, I, 2): gate and up halves as planes 0 and 1 (h, d_h).
inline OutView halves_view(const at::Tensor& t) {
  const int64_t half = t.size(1) / 2;
  return {t.data_ptr(), t.size(0), half, 2, t.size(1), half};
}

// kReduce: the TMA store adds into the output (fp32 accumulation) instead of writing it.
template <class Cfg, bool kReduce = false>
auto make_store_atom(const OutView& v) {
  using T = typename Cfg::EpiT;
  auto m = make_tensor(make_gmem_ptr(reinterpret_cast<T*>(v.ptr)),
                       make_shape(int(v.rows), int(v.cols), int(v.planes)),
                       make_stride(v.ld, _1{}, v.plane_stride));
  using StoreOp = std::conditional_t<kReduce, SM90_TMA_REDUCE_ADD, SM90_TMA_STORE>;
  return make_tma_atom(StoreOp{}, m, typename Cfg::EpiLayout{},
                       Shape<_64, Int<Cfg::kChunkCols>>{});
}

// TMA load atoms of a tile configuration: A (rows, K) in 128 x 64 boxes, B (N, K, Q) in
// BN / kSplit x 64 boxes.
template <class Cfg>
auto make_load_a(const at::Tensor& a, typename Cfg::StrideA stride, int rows, int cols) {
  auto m = make_tensor(make_gmem_ptr(as_bf16(a)), make_shape(rows, cols), stride);
  return make_tma_atom(SM90_TMA_LOAD{}, m, typename Cfg::SmemLayoutA{}(_, _, 0),
                       Shape<Int<Cfg::BM>, Int<Cfg::BK>>{});
}

template <class Cfg>
auto make_load_b(const at::Tensor& b, typename Cfg::StrideB stride, int n, int k, int q) {
  auto m = make_tensor(make_gmem_ptr(as_bf16(b)), make_shape(n, k, q), stride);
  return make_tma_atom(SM90_TMA_LOAD{}, m, typename Cfg::SmemLayoutBBox{}(_, _, 0),
                       Shape<Int<Cfg::BN / Cfg::kSplit>, Int<Cfg::BK>>{});
}

// h [rows, 2I] as (rows, I, 2) in BM x BK boxes (gate, up as planes) for the SwiGLU
// backward's epilogue chunks (kActBwd: h [rows, I] as (rows, I, 1)); columns past I are
// zero-filled.
template <class Cfg>
auto make_load_h(const at::Tensor& h) {
  constexpr int kParts = Cfg::kHParts;
  const int64_t part = h.size(1) / kParts;
  auto m = make_tensor(make_gmem_ptr(as_bf16(h)),
                       make_shape(int(h.size(0)), int(part), kParts),
                       make_stride(h.size(1), _1{}, part));
  return make_tma_atom(SM90_TMA_LOAD{}, m, typename Cfg::SmemLayoutH{},
                       Shape<Int<Cfg::BM>, Int<Cfg::BK>>{});
}

inline void check_bf16_cuda(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.is_cuda(), "megatron_mok: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, "megatron_mok: ", name, " must be bfloat16");
  TORCH_CHECK(t.dim() == dim, "megatron_mok: ", name, " must have ", dim, " dimensions");
  TORCH_CHECK(t.is_contiguous(), "megatron_mok: ", name, " must be contiguous");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "megatron_mok: ", name,
              " must be 16-byte aligned");
}

// The fused dgrad + SwiGLU backward with the router weights applied in its epilogue:
// row_w fp32 [rows], dots_part fp32 [rows, n_tiles] (one partial <d_act, act> per column
// tile), act_scaled bf16 [rows, I], all contiguous on the operands' device.
inline void check_row_scale_outputs(const at::Tensor& row_w, const at::Tensor& dots_part,
                                    const at::Tensor& act_scaled, int64_t rows, int64_t inter,
                                    int64_t n_tiles, const at::Device& device) {
  TORCH_CHECK(row_w.is_cuda() && row_w.scalar_type() == at::kFloat && row_w.is_contiguous() &&
                  row_w.numel() == rows && row_w.device() == device,
              "megatron_mok: row_w must be a contiguous float32 [rows] tensor on the operands' device");
  TORCH_CHECK(dots_part.is_cuda() && dots_part.scalar_type() == at::kFloat &&
                  dots_part.is_contiguous() && dots_part.dim() == 2 && dots_part.size(0) == rows &&
                  dots_part.size(1) == n_tiles && dots_part.device() == device,
              "megatron_mok: dots_part must be a contiguous float32 [rows, ", n_tiles,
              "] tensor on the operands' device");
  check_bf16_cuda(act_scaled, "act_scaled", 2);
  TORCH_CHECK(act_scaled.size(0) == rows && act_scaled.size(1) == inter &&
                  act_scaled.device() == device,
              "megatron_mok: act_scaled must be [rows, I] on the operands' device");
}

// An op's GLU arguments (glu: the general GLU, else SwiGLU) into the params; returns glu.
inline bool set_glu(GemmParams& p, bool glu, double alpha, double limit, double offset) {
  if (!glu) return false;
  TORCH_CHECK(limit > 0 && alpha > 0, "megatron_mok: the GLU needs alpha > 0 and a clamp "
              "limit > 0 (inf: no clamp), got alpha ", alpha, ", limit ", limit);
  p.glu_alpha = float(alpha);
  p.glu_limit = float(limit);
  p.glu_offset = float(offset);
  return true;
}

// The routed dgrad's router weights and outputs (all three, or none) into the params;
// returns whether they were given.
inline bool set_row_scale(GemmParams& p, const std::optional<at::Tensor>& row_w,
                          const std::optional<at::Tensor>& dots_part,
                          const std::optional<at::Tensor>& act_scaled, int64_t rows,
                          int64_t inter, const at::Device& device) {
  const bool scaled = row_w.has_value();
  TORCH_CHECK(dots_part.has_value() == scaled && act_scaled.has_value() == scaled,
              "megatron_mok: row_w, dots_part and act_scaled go together");
  if (scaled) {
    check_row_scale_outputs(*row_w, *dots_part, *act_scaled, rows, inter, p.n_tiles, device);
    p.row_scale = row_w->data_ptr<float>();
    p.dots_part = dots_part->data_ptr<float>();
    p.act_scaled = reinterpret_cast<__nv_bfloat16*>(act_scaled->data_ptr());
  }
  return scaled;
}

// A non-gated activation's alpha into the params; calls f(std::integral_constant<int,
// ActFn>) for act_fn (the epilogues' compile-time function).
template <class F>
void with_act(GemmParams& p, int64_t act_fn, double alpha, F&& f) {
  TORCH_CHECK(act_fn != gemm::kSigmoidGated || alpha > 0,
              "megatron_mok: x sigmoid(alpha x) needs alpha > 0, got ", alpha);
  p.act_alpha = float(alpha);
  switch (act_fn) {
    case gemm::kRelu: return f(std::integral_constant<int, gemm::kRelu>{});
    case gemm::kSquaredRelu: return f(std::integral_constant<int, gemm::kSquaredRelu>{});
    case gemm::kGelu: return f(std::integral_constant<int, gemm::kGelu>{});
    case gemm::kGeluTanh: return f(std::integral_constant<int, gemm::kGeluTanh>{});
    case gemm::kSigmoidGated: return f(std::integral_constant<int, gemm::kSigmoidGated>{});
    default: TORCH_CHECK(false, "megatron_mok: unknown non-gated activation code ", act_fn);
  }
}

// A per-expert bias [E, cols] bf16 (fc1's [E, 2I], fc2's [E, H]) into the params.
inline void set_col_bias(GemmParams& p, const std::optional<at::Tensor>& bias, int64_t experts,
                         int64_t cols, const at::Device& device, const char* name) {
  if (!bias.has_value()) return;
  TORCH_CHECK(bias->is_cuda() && bias->device() == device && bias->scalar_type() == at::kBFloat16 &&
                  bias->is_contiguous() && bias->dim() == 2 && bias->size(0) == experts &&
                  bias->size(1) == cols,
              "megatron_mok: ", name, " must be a contiguous bfloat16 [", experts, ", ", cols,
              "] on ", device);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(bias->data_ptr()) % 4 == 0,
              "megatron_mok: ", name, " must be 4-byte aligned (bf16 pairs are loaded)");
  p.col_bias = reinterpret_cast<const __nv_bfloat16*>(bias->data_ptr());
  p.bias_stride = cols;
}

inline GemmParams rows_params(const at::Tensor& offsets, const at::Tensor& num_rows, int64_t rows,
                       int64_t n, int64_t k, int n_tile) {
  TORCH_CHECK(offsets.is_cuda() && offsets.scalar_type() == at::kInt && offsets.dim() == 1 &&
                  offsets.is_contiguous(),
              "megatron_mok: expert_offsets must be a contiguous CUDA int32 vector");
  TORCH_CHECK(num_rows.is_cuda() && num_rows.scalar_type() == at::kInt && num_rows.numel() == 1,
              "megatron_mok: num_rows must be a CUDA int32 tensor with one element");
  TORCH_CHECK(rows % 128 == 0, "megatron_mok: the row table must hold a multiple of 128 rows");
  TORCH_CHECK(n > 0 && k > 0 && n % 8 == 0 && k % 8 == 0,
              "megatron_mok: GEMM sizes must be positive multiples of 8");
  GemmParams p{};
  p.offsets = offsets.data_ptr<int>();
  p.num_rows = num_rows.data_ptr<int>();
  p.num_experts = int(offsets.numel() - 1);
  p.rows_cap = int(rows);
  p.N = int(n);
  p.K = int(k);
  p.m_tiles = int(rows / 128);
  p.n_tiles = int((n + n_tile - 1) / n_tile);
  p.num_tasks = p.m_tiles * p.n_tiles;
  return p;
}

}  // namespace megatron_mok::gemm_host
