// Host side of the backward megakernel: argument checks, the TMA descriptors of fc2 dgrad
// (+ SwiGLU backward), fc1 dgrad and (optionally) the two weight gradients, one
// cooperative launch over every SM. Reads the row count and the expert offsets on the
// device: no host sync.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "gemm/host.cuh"
#include "megakernel/backward.cuh"
#include "megakernel/launch.cuh"

namespace megatron_mok {
namespace {

using namespace cute;
using namespace gemm_host;
using megakernel::BackwardParams;

using CfgD = CfgDgradSwiGLU<1>;  // the core's fc2 dgrad + SwiGLU backward tiles
using CfgX = CfgRowsNN<1>;       // the core's fc1 dgrad tiles (w1 read MN-major)

void check_wgrad_out(const at::Tensor& out, const char* name, int64_t E, int64_t M, int64_t N,
                     bool accumulate) {
  const auto dtype = accumulate ? at::kFloat : at::kBFloat16;
  const int64_t elem = accumulate ? 4 : 2;
  TORCH_CHECK(out.is_cuda() && out.scalar_type() == dtype && out.dim() == 3 &&
                  out.size(0) == E && out.size(1) == M && out.size(2) == N &&
                  out.stride(2) == 1 && out.stride(1) == N &&
                  (E == 1 || (out.stride(0) >= M * N && out.stride(0) * elem % 16 == 0)) &&
                  reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0,
              "megatron_mok: ", name, " must be a CUDA ", accumulate ? "float32" : "bfloat16",
              " [", E, ", ", M, ", ", N, "] tensor of dense planes, 16-byte aligned apart");
}

gemm::GemmParams wgrad_params(const at::Tensor& offsets, int64_t R, int64_t M, int64_t N,
                              bool reverse) {
  gemm::GemmParams p{};
  p.offsets = offsets.data_ptr<int>();
  p.num_experts = int(offsets.numel() - 1);
  p.rows_cap = int(R);
  p.M = int(M);
  p.N = int(N);
  p.K = int(R);
  p.m_tiles = int((M + 127) / 128);
  p.n_tiles = int((N + 255) / 256);
  p.num_tasks = p.num_experts * p.m_tiles * p.n_tiles;
  p.reverse_planes = reverse;
  return p;
}

OutView planes_view(const at::Tensor& out) {
  const int64_t E = out.size(0), M = out.size(1), N = out.size(2);
  return {out.data_ptr(), M, N, E, N, E == 1 ? M * N : out.stride(0)};
}

// dy_local / topk_w_local (EP = 1): this rank's; else the peers' arena at dy_offset /
// w_offset. scatter (EP > 1): dx rows into the owners' slots.
void moe_backward(const at::Tensor& peer_base, int64_t dy_offset, int64_t w_offset,
                  const std::optional<at::Tensor>& dy_local,
                  const std::optional<at::Tensor>& topk_w_local, int64_t topk,
                  const at::Tensor& peer_rank, const at::Tensor& peer_token,
                  const at::Tensor& peer_k, const at::Tensor& offsets, const at::Tensor& num_rows,
                  const at::Tensor& w1, const at::Tensor& w2, const at::Tensor& h,
                  const at::Tensor& dy_rows, const at::Tensor& row_w,
                  const at::Tensor& dots_part, const at::Tensor& act_scaled,
                  const at::Tensor& d_h, const std::optional<at::Tensor>& dx_rows_opt,
                  const at::Tensor& counters,
                  const at::Tensor& watchdog, int64_t timeout_ms, int64_t rank,
                  int64_t minibatch_rows, bool scatter, int64_t slots_offset,
                  int64_t hold_tile, const std::optional<at::Tensor>& x_rows,
                  const std::optional<at::Tensor>& dw2, const std::optional<at::Tensor>& dw1,
                  bool accumulate, bool reverse2, bool reverse1, bool glu, double glu_alpha,
                  double glu_limit, double glu_offset) {
  TORCH_CHECK(dy_local.has_value() == topk_w_local.has_value(),
              "megatron_mok: pass dy and topk_w both local (EP = 1) or both through the arena");
  TORCH_CHECK(dy_offset % 16 == 0 && w_offset % 4 == 0 && slots_offset % 16 == 0,
              "megatron_mok: symmetric offsets must be aligned (16 bytes for rows)");
  TORCH_CHECK(topk >= 1, "megatron_mok: topk must be positive");
  check_bf16_cuda(w1, "w1", 3);
  check_bf16_cuda(w2, "w2", 3);
  check_bf16_cuda(h, "h", 2);
  check_bf16_cuda(dy_rows, "dy_rows", 2);
  check_bf16_cuda(d_h, "d_h", 2);
  // dx_rows: the fc1 dgrad rows at EP = 1; when scattering they go to the owners' slots and
  // dy_rows (same shape) stands in for the unused TMA store view.
  TORCH_CHECK(dx_rows_opt.has_value() || scatter,
              "megatron_mok: dx_rows is required unless the dx rows are scattered (EP > 1)");
  const at::Tensor& dx_rows = dx_rows_opt.has_value() ? *dx_rows_opt : dy_rows;
  check_bf16_cuda(dx_rows, "dx_rows", 2);
  const int64_t R = dy_rows.size(0), H = dy_rows.size(1), E = w1.size(0), I = w1.size(1) / 2;
  if (dy_local.has_value()) {
    check_bf16_cuda(*dy_local, "dy", 2);
    TORCH_CHECK(dy_local->size(1) == H, "megatron_mok: dy must be [T, H]");
    const at::Tensor& w = *topk_w_local;
    TORCH_CHECK(w.is_cuda() && w.scalar_type() == at::kFloat && w.dim() == 2 &&
                    w.size(0) == dy_local->size(0) && w.size(1) == topk && w.is_contiguous(),
                "megatron_mok: topk_w must be a contiguous CUDA float32 [T, topk] tensor");
  }
  TORCH_CHECK(w1.size(1) == 2 * I && w1.size(2) == H, "megatron_mok: w1 must be [E, 2I, H]");
  TORCH_CHECK(w2.size(0) == E && w2.size(1) == H && w2.size(2) == I,
              "megatron_mok: w2 must be [E, H, I]");
  TORCH_CHECK(h.size(0) == R && h.size(1) == 2 * I && d_h.sizes() == h.sizes(),
              "megatron_mok: h and d_h must be [rows, 2I]");
  TORCH_CHECK(dx_rows.sizes() == dy_rows.sizes(), "megatron_mok: dx_rows must be [rows, H]");
  TORCH_CHECK(R % 128 == 0, "megatron_mok: the row table must hold a multiple of 128 rows");
  check_row_scale_outputs(row_w, dots_part, act_scaled, R, I, (I + CfgD::BN - 1) / CfgD::BN,
                          dy_rows.device());
  TORCH_CHECK(offsets.numel() == E + 1, "megatron_mok: expert_offsets must have E + 1 entries");
  for (auto [t, name] : {std::pair{&peer_rank, "peer_rank"}, {&peer_token, "peer_token"},
                         {&peer_k, "peer_k"}}) {
    megakernel::check_int32_table(*t, name, R);
  }
  const int64_t m_tiles = R / 128;
  megakernel::check_int32_table(counters, "counters",
                                megakernel::forward_counters_size(int(m_tiles)));
  megakernel::check_watchdog_and_peers(watchdog, peer_base);
  megakernel::check_minibatch_rows(minibatch_rows);
  const bool with_wgrad = x_rows.has_value();
  TORCH_CHECK(dw2.has_value() == with_wgrad && dw1.has_value() == with_wgrad,
              "megatron_mok: the weight gradients need x_rows, dw2 and dw1 together");
  TORCH_CHECK(with_wgrad || (!accumulate && !reverse2 && !reverse1),
              "megatron_mok: accumulate / reverse apply to the weight gradients only");
  TORCH_CHECK(!(reverse2 || reverse1) || accumulate,
              "megatron_mok: reversed planes need accumulate (main_grad)");
  if (with_wgrad) {
    check_bf16_cuda(*x_rows, "x_rows", 2);
    TORCH_CHECK(x_rows->size(0) == R && x_rows->size(1) == H,
                "megatron_mok: x_rows must be [rows, H]");
    check_wgrad_out(*dw2, "dw2", E, H, I, accumulate);
    check_wgrad_out(*dw1, "dw1", E, 2 * I, H, accumulate);
    for (const at::Tensor* t : {&*x_rows, &*dw2, &*dw1}) {
      TORCH_CHECK(t->device() == dy_rows.device(), "megatron_mok: operands must be on one device");
    }
  }
  c10::cuda::CUDAGuard guard(dy_rows.device());
  const int sms = num_sms(dy_rows.get_device());

  BackwardParams p{};
  p.dgrad = rows_params(offsets, num_rows, R, I, H, CfgD::BN);
  p.dgrad.h_in = reinterpret_cast<const __nv_bfloat16*>(h.data_ptr());
  p.dgrad.row_scale = row_w.data_ptr<float>();
  p.dgrad.dots_part = dots_part.data_ptr<float>();
  p.dgrad.act_scaled = reinterpret_cast<__nv_bfloat16*>(act_scaled.data_ptr());
  p.dx = rows_params(offsets, num_rows, R, H, 2 * I, CfgX::BN);
  p.dgrad_shapes = {int(R), int(H), int(I), int(H), int(E)};
  p.dx_shapes = {int(R), int(2 * I), int(H), int(2 * I), int(E)};
  p.mb_tiles = int(minibatch_rows / 128);
  p.counters = counters.data_ptr<int>();
  p.peer_rank = peer_rank.data_ptr<int>();
  p.peer_token = peer_token.data_ptr<int>();
  p.peer_k = peer_k.data_ptr<int>();
  p.dy = dy_local.has_value() ? reinterpret_cast<const uint4*>(dy_local->data_ptr()) : nullptr;
  p.topk_w = topk_w_local.has_value() ? topk_w_local->data_ptr<float>() : nullptr;
  p.peer_base = peer_base.data_ptr<int64_t>();
  p.dy_offset = dy_offset;
  p.w_offset = w_offset;
  p.scatter = scatter;
  p.slots_offset = slots_offset;
  p.dy_rows = reinterpret_cast<uint4*>(dy_rows.data_ptr());
  p.row_w = row_w.data_ptr<float>();
  p.topk = int(topk);
  p.row_vecs = int(H / 8);
  p.dog = {watchdog.data_ptr<int64_t>(), timeout_ms * 1000000, int(rank)};
  p.hold_tile = int(hold_tile);
  if (R == 0) {  // no rows: zero weight gradients (no TMA descriptor over an empty tensor)
    if (with_wgrad && !accumulate) {
      dw2->zero_();
      dw1->zero_();
    }
    return;
  }

  // The same operand views as the core's launches (grouped_gemm.cu): dgrad_swiglu and
  // rows_matmul(w_transposed=True).
  make_context_current(dy_rows);
  auto tma_dout = make_load_a<CfgD>(dy_rows, make_stride(H, _1{}), int(R), int(H));
  auto tma_w2 = make_load_b<CfgD>(w2, make_stride(_1{}, I, H * I), int(I), int(H), int(E));
  auto tma_dh = make_store_atom<CfgD>(rows_view(d_h));
  auto tma_dh_halves = make_store_atom<CfgD>(halves_view(d_h));
  auto tma_dh_in = make_load_a<CfgX>(d_h, make_stride(2 * I, _1{}), int(R), int(2 * I));
  auto tma_w1 = make_load_b<CfgX>(w1, make_stride(_1{}, H, 2 * I * H), int(H), int(2 * I),
                                  int(E));
  auto tma_dx = make_store_atom<CfgX>(rows_view(dx_rows));
  auto tma_h = make_load_h<CfgD>(h);
  // The dgrad tiles with the SwiGLU or the general GLU backward: the same shapes and boxes.
  const bool general_glu = set_glu(p.dgrad, glu, glu_alpha, glu_limit, glu_offset);
  auto launch_with = [&](auto cfg_w, auto wtmas) {
    using CfgW = decltype(cfg_w);
    auto run = [&](auto cfg_d) {
      using CfgG = decltype(cfg_d);
      static_assert(CfgG::kSmemBytes == CfgD::kSmemBytes && CfgG::BN == CfgD::BN);
      auto kernel = &megakernel::moe_backward_kernel<CfgG, CfgX, CfgW, decltype(wtmas),
                                                     decltype(tma_dout), decltype(tma_w2),
                                                     decltype(tma_dh), decltype(tma_dh_in),
                                                     decltype(tma_w1), decltype(tma_dx),
                                                     decltype(tma_h)>;
      megakernel::launch_cooperative(kernel, sms, CfgG::kThreads, CfgG::kSmemBytes, p, tma_dout,
                                     tma_w2, tma_dh, tma_dh_halves, tma_dh_in, tma_w1, tma_dx,
                                     tma_h, wtmas);
    };
    if (general_glu) {
      run(CfgDgradGlu{});
    } else {
      run(CfgD{});
    }
  };
  if (!with_wgrad) {
    launch_with(CfgWgradBf16<1>{}, megakernel::NoWgrad{});
    return;
  }
  // Phase 2: the core's wgrad operand views (grouped_gemm.cu, grouped_wgrad): A (M, rows)
  // and B (N, rows, 1), both MN-major.
  p.wgrad2 = wgrad_params(offsets, R, H, I, reverse2);
  p.wgrad1 = wgrad_params(offsets, R, 2 * I, H, reverse1);
  p.wgrad2_shapes = {int(H), int(R), int(I), int(R), 1};
  p.wgrad1_shapes = {int(2 * I), int(R), int(H), int(R), 1};
  auto with_cfg = [&](auto cfg_w, auto reduce) {
    using CfgW = decltype(cfg_w);
    constexpr bool kReduce = decltype(reduce)::value;
    auto a2 = make_load_a<CfgW>(dy_rows, make_stride(_1{}, H), int(H), int(R));
    auto a1 = make_load_a<CfgW>(d_h, make_stride(_1{}, 2 * I), int(2 * I), int(R));
    auto b2 = make_load_b<CfgW>(act_scaled, make_stride(_1{}, I, I * R), int(I), int(R), 1);
    auto b1 = make_load_b<CfgW>(*x_rows, make_stride(_1{}, H, H * R), int(H), int(R), 1);
    auto o2 = make_store_atom<CfgW, kReduce>(planes_view(*dw2));
    auto o1 = make_store_atom<CfgW, kReduce>(planes_view(*dw1));
    launch_with(cfg_w, megakernel::WgradTmas<decltype(a2), decltype(b2), decltype(o2)>{
                           {a2, a1}, {b2, b1}, {o2, o1}});
  };
  if (accumulate) {
    with_cfg(CfgWgradF32<1>{}, std::true_type{});
  } else {
    with_cfg(CfgWgradBf16<1>{}, std::false_type{});
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) { m.impl("moe_backward", &moe_backward); }

}  // namespace megatron_mok
