// Host side of the non-gated experts' ops (squared-ReLU, GeLU, ...): fc1 with the
// activation (and fc1's bias) in its epilogue, fc2's dgrad with the activation's backward
// and the router weights in its epilogue. fc2 and fc1's dgrad are the plain row GEMMs of
// grouped_gemm.cu. Nothing here synchronises with the host.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "gemm/launch.cuh"

namespace megatron_mok {
namespace {

using namespace cute;
using gemm::GemmParams;
using namespace gemm_host;

void grouped_fc1_act_cuda(const at::Tensor& x_rows, const at::Tensor& w1,
                          const at::Tensor& offsets, const at::Tensor& num_rows,
                          const at::Tensor& act, const std::optional<at::Tensor>& h,
                          int64_t max_ctas, const std::optional<at::Tensor>& bias,
                          int64_t act_fn, double act_alpha) {
  check_bf16_cuda(x_rows, "x_rows", 2);
  check_bf16_cuda(w1, "w1", 3);
  check_bf16_cuda(act, "act", 2);
  const int64_t R = x_rows.size(0), H = x_rows.size(1), E = w1.size(0), I = w1.size(1);
  TORCH_CHECK(w1.size(2) == H, "megatron_mok: w1 must be [E, I, H]");
  TORCH_CHECK(offsets.numel() == E + 1, "megatron_mok: expert_offsets must have E + 1 entries");
  TORCH_CHECK(act.size(0) == R && act.size(1) == I, "megatron_mok: act must be [rows, I]");
  c10::cuda::CUDAGuard guard(x_rows.device());
  GemmParams p = rows_params(offsets, num_rows, R, I, H, CfgFc1Act<0>::BN);
  if (h.has_value()) {
    check_bf16_cuda(*h, "h", 2);
    TORCH_CHECK(h->sizes() == act.sizes(), "megatron_mok: h must be [rows, I]");
    p.store_h = true;
  }
  set_col_bias(p, bias, E, I, x_rows.device(), "b1");
  const OutView act_view = rows_view(act);
  with_act(p, act_fn, act_alpha, [&](auto fn) {
    launch<CfgFc1Act<decltype(fn)::value>>(p, x_rows, make_stride(H, _1{}), int(R), int(H), w1,
                                           make_stride(H, _1{}, I * H), int(I), int(H), int(E),
                                           act_view, h.has_value() ? rows_view(*h) : act_view,
                                           max_ctas);
  });
}

void grouped_dgrad_act_cuda(const at::Tensor& dy_rows, const at::Tensor& w2,
                            const at::Tensor& offsets, const at::Tensor& num_rows,
                            const at::Tensor& h, const at::Tensor& d_h, int64_t max_ctas,
                            const std::optional<at::Tensor>& row_w,
                            const std::optional<at::Tensor>& dots_part,
                            const std::optional<at::Tensor>& act_scaled, int64_t act_fn,
                            double act_alpha) {
  check_bf16_cuda(dy_rows, "dy_rows", 2);
  check_bf16_cuda(w2, "w2", 3);
  check_bf16_cuda(h, "h", 2);
  check_bf16_cuda(d_h, "d_h", 2);
  const int64_t R = dy_rows.size(0), H = dy_rows.size(1), E = w2.size(0), I = w2.size(2);
  TORCH_CHECK(w2.size(1) == H, "megatron_mok: w2 must be [E, H, I]");
  TORCH_CHECK(offsets.numel() == E + 1, "megatron_mok: expert_offsets must have E + 1 entries");
  TORCH_CHECK(h.size(0) == R && h.size(1) == I && d_h.sizes() == h.sizes(),
              "megatron_mok: h and d_h must be [rows, I]");
  c10::cuda::CUDAGuard guard(dy_rows.device());
  GemmParams p = rows_params(offsets, num_rows, R, I, H, CfgDgradAct<0>::BN);
  p.h_in = reinterpret_cast<const __nv_bfloat16*>(h.data_ptr());
  set_row_scale(p, row_w, dots_part, act_scaled, R, I, dy_rows.device());
  // h through the operand ring (default), or read by the epilogue from global memory
  // (MOK_DGRAD_H=global): the same bits.
  const bool ring = h_through_ring();
  with_act(p, act_fn, act_alpha, [&](auto fn) {
    using Cfg = CfgDgradAct<decltype(fn)::value>;
    if (ring) {
      launch<Cfg, false, true>(p, dy_rows, make_stride(H, _1{}), int(R), int(H), w2,
                               make_stride(_1{}, I, H * I), int(I), int(H), int(E),
                               rows_view(d_h), rows_view(d_h), max_ctas, &h);
    } else {
      launch<Cfg>(p, dy_rows, make_stride(H, _1{}), int(R), int(H), w2,
                  make_stride(_1{}, I, H * I), int(I), int(H), int(E), rows_view(d_h),
                  rows_view(d_h), max_ctas);
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) {
  m.impl("grouped_fc1_act", &grouped_fc1_act_cuda);
  m.impl("grouped_dgrad_act", &grouped_dgrad_act_cuda);
}

}  // namespace megatron_mok
