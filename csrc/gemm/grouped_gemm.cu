// Host side of the grouped-GEMM core: TMA descriptors, launch shapes and the torch ops.
// Every op writes into caller-provided outputs and reads the row count and the expert
// offsets on the device, so nothing here synchronises with the host.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "gemm/launch.cuh"

namespace megatron_mok {
namespace {

using namespace cute;
using gemm::Epi;
using gemm::GemmConfig;
using gemm::GemmParams;
using gemm::Grouping;
using gemm::bf16;
using namespace gemm_host;

void grouped_fc1_swiglu_cuda(const at::Tensor& x_rows, const at::Tensor& w1,
                             const at::Tensor& offsets, const at::Tensor& num_rows,
                             const at::Tensor& act, const std::optional<at::Tensor>& h,
                             int64_t max_ctas, const std::optional<at::Tensor>& bias, bool glu,
                             double glu_alpha, double glu_limit, double glu_offset) {
  check_bf16_cuda(x_rows, "x_rows", 2);
  check_bf16_cuda(w1, "w1", 3);
  check_bf16_cuda(act, "act", 2);
  const int64_t R = x_rows.size(0), H = x_rows.size(1), E = w1.size(0), I = w1.size(1) / 2;
  TORCH_CHECK(w1.size(1) == 2 * I && w1.size(2) == H, "megatron_mok: w1 must be [E, 2I, H]");
  TORCH_CHECK(offsets.numel() == E + 1, "megatron_mok: expert_offsets must have E + 1 entries");
  TORCH_CHECK(act.size(0) == R && act.size(1) == I, "megatron_mok: act must be [rows, I]");
  c10::cuda::CUDAGuard guard(x_rows.device());
  GemmParams p = rows_params(offsets, num_rows, R, I, H, CfgFc1SwiGLU<1>::BN / 2);
  if (h.has_value()) {
    check_bf16_cuda(*h, "h", 2);
    TORCH_CHECK(h->size(0) == R && h->size(1) == 2 * I, "megatron_mok: h must be [rows, 2I]");
    p.store_h = true;
  }
  set_col_bias(p, bias, E, 2 * I, x_rows.device(), "b1");
  TORCH_CHECK(!bias.has_value() || glu, "megatron_mok: fc1's bias runs in the general GLU "
              "epilogue: pass glu (SwiGLU: alpha 1, limit inf, offset 0)");
  const OutView act_view = rows_view(act);
  const OutView h_view = h.has_value() ? halves_view(*h) : act_view;
  auto run = [&](auto cfg) {
    launch<decltype(cfg)>(p, x_rows, make_stride(H, _1{}), int(R), int(H), w1,
                          make_stride(H, _1{}, I * H), int(I), int(H), int(2 * E), act_view,
                          h_view, max_ctas);
  };
  if (set_glu(p, glu, glu_alpha, glu_limit, glu_offset)) {
    run(CfgFc1Glu{});  // clusters of 1 only
  } else {
    with_cluster<CfgFc1SwiGLU>(run);
  }
}

void grouped_gemm_rows_cuda(const at::Tensor& a, const at::Tensor& w, const at::Tensor& offsets,
                            const at::Tensor& num_rows, bool w_transposed, const at::Tensor& out,
                            int64_t max_ctas, const std::optional<at::Tensor>& bias) {
  check_bf16_cuda(a, "a", 2);
  check_bf16_cuda(w, "w", 3);
  check_bf16_cuda(out, "out", 2);
  const int64_t R = a.size(0), K = a.size(1), E = w.size(0);
  // w_transposed: w is [E, K, N] and out = a @ w[e]; otherwise w is [E, N, K], out = a @ w[e]^T.
  const int64_t N = w_transposed ? w.size(2) : w.size(1);
  TORCH_CHECK((w_transposed ? w.size(1) : w.size(2)) == K,
              "megatron_mok: w's reduction dimension must match a's columns");
  TORCH_CHECK(offsets.numel() == E + 1, "megatron_mok: expert_offsets must have E + 1 entries");
  TORCH_CHECK(out.size(0) == R && out.size(1) == N, "megatron_mok: out must be [rows, N]");
  c10::cuda::CUDAGuard guard(a.device());
  if (bias.has_value()) {  // the general kStore tiles (clusters of 1, cooperative)
    TORCH_CHECK(!w_transposed, "megatron_mok: a bias is fc2's: w [E, N, K], not transposed");
    GemmParams p = rows_params(offsets, num_rows, R, N, K, CfgRowsNTBias::BN);
    set_col_bias(p, bias, E, N, a.device(), "bias");
    launch<CfgRowsNTBias>(p, a, make_stride(K, _1{}), int(R), int(K), w,
                          make_stride(K, _1{}, N * K), int(N), int(K), int(E), rows_view(out),
                          rows_view(out), max_ctas);
    return;
  }
  if (pingpong() && cluster_size() == 1) {
    if (w_transposed) {
      GemmParams p = rows_params(offsets, num_rows, R, N, K, CfgRowsNNPing::BN);
      launch<CfgRowsNNPing, false, false, true>(p, a, make_stride(K, _1{}), int(R), int(K), w,
                                                make_stride(_1{}, N, K * N), int(N), int(K),
                                                int(E), rows_view(out), rows_view(out), max_ctas);
    } else {
      GemmParams p = rows_params(offsets, num_rows, R, N, K, CfgRowsNTPing::BN);
      launch<CfgRowsNTPing, false, false, true>(p, a, make_stride(K, _1{}), int(R), int(K), w,
                                                make_stride(K, _1{}, N * K), int(N), int(K),
                                                int(E), rows_view(out), rows_view(out), max_ctas);
    }
    return;
  }
  if (w_transposed) {
    GemmParams p = rows_params(offsets, num_rows, R, N, K, CfgRowsNN<1>::BN);
    with_cluster<CfgRowsNN>([&](auto cfg) {
      launch<decltype(cfg)>(p, a, make_stride(K, _1{}), int(R), int(K), w,
                            make_stride(_1{}, N, K * N), int(N), int(K), int(E),
                            rows_view(out), rows_view(out), max_ctas);
    });
  } else {
    GemmParams p = rows_params(offsets, num_rows, R, N, K, CfgRowsNT<1>::BN);
    with_cluster<CfgRowsNT>([&](auto cfg) {
      launch<decltype(cfg)>(p, a, make_stride(K, _1{}), int(R), int(K), w,
                            make_stride(K, _1{}, N * K), int(N), int(K), int(E),
                            rows_view(out), rows_view(out), max_ctas);
    });
  }
}

void grouped_dgrad_swiglu_cuda(const at::Tensor& dy_rows, const at::Tensor& w2,
                               const at::Tensor& offsets, const at::Tensor& num_rows,
                               const at::Tensor& h, const at::Tensor& d_h, int64_t max_ctas,
                               const std::optional<at::Tensor>& row_w,
                               const std::optional<at::Tensor>& dots_part,
                               const std::optional<at::Tensor>& act_scaled, bool glu,
                               double glu_alpha, double glu_limit, double glu_offset) {
  check_bf16_cuda(dy_rows, "dy_rows", 2);
  check_bf16_cuda(w2, "w2", 3);
  check_bf16_cuda(h, "h", 2);
  check_bf16_cuda(d_h, "d_h", 2);
  const int64_t R = dy_rows.size(0), H = dy_rows.size(1), E = w2.size(0), I = w2.size(2);
  TORCH_CHECK(w2.size(1) == H, "megatron_mok: w2 must be [E, H, I]");
  TORCH_CHECK(offsets.numel() == E + 1, "megatron_mok: expert_offsets must have E + 1 entries");
  TORCH_CHECK(h.size(0) == R && h.size(1) == 2 * I && d_h.sizes() == h.sizes(),
              "megatron_mok: h and d_h must be [rows, 2I]");
  c10::cuda::CUDAGuard guard(dy_rows.device());
  GemmParams p = rows_params(offsets, num_rows, R, I, H, CfgDgradSwiGLU<1>::BN);
  p.h_in = reinterpret_cast<const __nv_bfloat16*>(h.data_ptr());
  const bool scaled =
      set_row_scale(p, row_w, dots_part, act_scaled, R, I, dy_rows.device());
  // The general GLU: cooperative tiles, clusters of 1, h through the ring or from global.
  if (set_glu(p, glu, glu_alpha, glu_limit, glu_offset)) {
    if (h_through_ring()) {
      launch<CfgDgradGlu, false, true>(p, dy_rows, make_stride(H, _1{}), int(R), int(H), w2,
                                       make_stride(_1{}, I, H * I), int(I), int(H), int(E),
                                       rows_view(d_h), halves_view(d_h), max_ctas, &h);
    } else {
      launch<CfgDgradGlu>(p, dy_rows, make_stride(H, _1{}), int(R), int(H), w2,
                          make_stride(_1{}, I, H * I), int(I), int(H), int(E), rows_view(d_h),
                          halves_view(d_h), max_ctas);
    }
    return;
  }
  // h through the operand ring (default), or read by the epilogue from global memory
  // (MOK_DGRAD_H=global, and always for clusters of 2): the same bits.
  if (cluster_size() == 1 && h_through_ring() && pingpong() && !scaled) {  // opt-in, unscaled
    GemmParams pp = rows_params(offsets, num_rows, R, I, H, CfgDgradSwiGLUPing::BN);
    pp.h_in = p.h_in;
    launch<CfgDgradSwiGLUPing, false, true, true>(pp, dy_rows, make_stride(H, _1{}), int(R),
                                                  int(H), w2, make_stride(_1{}, I, H * I), int(I),
                                                  int(H), int(E), rows_view(d_h),
                                                  halves_view(d_h), max_ctas, &h);
    return;
  }
  if (cluster_size() == 1 && h_through_ring()) {
    launch<CfgDgradSwiGLU<1>, false, true>(p, dy_rows, make_stride(H, _1{}), int(R), int(H), w2,
                                           make_stride(_1{}, I, H * I), int(I), int(H), int(E),
                                           rows_view(d_h), halves_view(d_h), max_ctas, &h);
    return;
  }
  with_cluster<CfgDgradSwiGLU>([&](auto cfg) {
    launch<decltype(cfg)>(p, dy_rows, make_stride(H, _1{}), int(R), int(H), w2,
                          make_stride(_1{}, I, H * I), int(I), int(H), int(E), rows_view(d_h),
                          halves_view(d_h), max_ctas);
  });
}

// gather_rank / gather_token (together, int32 [rows]) with gather_operands (bits: 1 = a,
// 2 = b): that operand holds the tokens [T, M or N] and its row j is token gather_token[j]
// (zeros where gather_rank[j] < 0), gathered by the producer.
void grouped_wgrad_cuda(const at::Tensor& a, const at::Tensor& b, const at::Tensor& offsets,
                        const at::Tensor& out, bool accumulate, int64_t max_ctas,
                        bool reverse_experts, const std::optional<at::Tensor>& gather_rank,
                        const std::optional<at::Tensor>& gather_token, int64_t gather_operands) {
  check_bf16_cuda(a, "a", 2);
  check_bf16_cuda(b, "b", 2);
  // Planes (experts) may lie apart, each one dense [M, N]: a view of per-expert buffers.
  const int64_t elem = out.element_size();
  TORCH_CHECK(out.is_cuda() && out.dim() == 3 &&
                  (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat) &&
                  out.stride(2) == 1 && out.stride(1) == out.size(2) &&
                  (out.size(0) == 1 || (out.stride(0) >= out.size(1) * out.size(2) &&
                                        out.stride(0) * elem % 16 == 0)),
              "megatron_mok: out must be a CUDA [E, M, N] bf16 or fp32 tensor of dense [M, N] "
              "planes, 16-byte aligned apart");
  const bool gather = gather_rank.has_value();
  TORCH_CHECK(gather == gather_token.has_value(),
              "megatron_mok: gather_rank and gather_token go together");
  TORCH_CHECK(!gather || (gather_operands >= 1 && gather_operands <= 3),
              "megatron_mok: gather_operands must be 1 (a), 2 (b) or 3 (both)");
  const bool gather_a = gather && (gather_operands & 1), gather_b = gather && (gather_operands & 2);
  const int64_t R = gather ? gather_rank->numel() : a.size(0);  // the row table's rows
  const int64_t M = a.size(1), N = b.size(1), E = out.size(0);
  TORCH_CHECK(gather_a || a.size(0) == R, "megatron_mok: a must have the row table's rows");
  TORCH_CHECK(gather_b || b.size(0) == R,
              gather ? "megatron_mok: b must have the row table's rows"
                     : "megatron_mok: a and b must have the same rows");
  TORCH_CHECK(!(gather_a && gather_b) || a.size(0) == b.size(0),
              "megatron_mok: gathered a and b must hold the same tokens");
  if (gather) {
    for (const at::Tensor* t : {&*gather_rank, &*gather_token}) {
      TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kInt && t->is_contiguous() &&
                      t->numel() == R && t->device() == a.device(),
                  "megatron_mok: the gather table must be contiguous CUDA int32 [rows] on a's "
                  "device");
    }
    TORCH_CHECK(!gather_a || (a.size(0) > 0 && M % 64 == 0),
                "megatron_mok: a gathered operand needs its columns a multiple of 64 (row "
                "boxes) and at least one token");
    TORCH_CHECK(!gather_b || (b.size(0) > 0 && N % 64 == 0),
                "megatron_mok: a gathered operand needs its columns a multiple of 64 (row "
                "boxes) and at least one token");
  }
  TORCH_CHECK(out.size(1) == M && out.size(2) == N, "megatron_mok: out must be [E, M, N]");
  TORCH_CHECK(offsets.is_cuda() && offsets.scalar_type() == at::kInt && offsets.numel() == E + 1 &&
                  offsets.is_contiguous(),
              "megatron_mok: expert_offsets must be a contiguous CUDA int32 vector of E + 1 entries");
  TORCH_CHECK(R % 128 == 0 && M > 0 && N > 0 && M % 8 == 0 && N % 8 == 0,
              "megatron_mok: rows must be a multiple of 128, M and N positive multiples of 8");
  TORCH_CHECK(b.device() == a.device() && out.device() == a.device() &&
                  offsets.device() == a.device(),
              "megatron_mok: wgrad operands must be on one device");
  TORCH_CHECK(!accumulate || out.scalar_type() == at::kFloat,
              "megatron_mok: wgrad accumulates into fp32 only");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0,
              "megatron_mok: wgrad's output must be 16-byte aligned (TMA stores)");
  c10::cuda::CUDAGuard guard(a.device());
  if (R == 0) {  // no tokens: zero gradients (no TMA descriptor over an empty tensor)
    if (!accumulate) out.zero_();
    return;
  }
  GemmParams p{};
  p.offsets = offsets.data_ptr<int>();
  p.num_rows = nullptr;
  p.num_experts = int(E);
  p.rows_cap = int(R);
  p.M = int(M);
  p.N = int(N);
  p.K = int(R);
  p.m_tiles = int((M + 127) / 128);
  p.n_tiles = int((N + CfgWgradBf16<1>::BN - 1) / CfgWgradBf16<1>::BN);
  p.num_tasks = int(E) * p.m_tiles * p.n_tiles;
  p.reverse_planes = reverse_experts;
  const OutView out_view{out.data_ptr(), M, N, E, N, E == 1 ? M * N : out.stride(0)};
  const int64_t a_rows = a.size(0), b_rows = b.size(0);  // R, or the tokens when gathered
  auto launch_as = [&](auto cfg, auto reduce) {
    launch<decltype(cfg), decltype(reduce)::value>(p, a, make_stride(_1{}, M), int(M),
                                                   int(a_rows), b,
                                                   make_stride(_1{}, N, N * b_rows), int(N),
                                                   int(b_rows), 1, out_view, out_view, max_ctas);
  };
  auto run = [&](auto cfg) { launch_as(cfg, std::false_type{}); };
  if (gather) {  // a gathered operand's TMA map (over the tokens) goes unused
    make_context_current(a);  // before the row maps' encode
    p.gather_rank = gather_rank->data_ptr<int>();
    p.gather_token = gather_token->data_ptr<int>();
    p.gather_oob_row = int(gather_a ? a_rows : b_rows);
    if (gather_a) p.a_row_map = row_box_map(a);
    if (gather_b) p.b_row_map = row_box_map(b);
    auto by_output = [&](auto kind) {
      constexpr int kG = decltype(kind)::value;
      if (accumulate) {
        launch_as(CfgWgradGather<float, kG>{}, std::true_type{});
      } else if (out.scalar_type() == at::kFloat) {
        run(CfgWgradGather<float, kG>{});
      } else {
        run(CfgWgradGather<__nv_bfloat16, kG>{});
      }
    };
    if (gather_a && gather_b) {
      by_output(std::integral_constant<int, gemm::kGatherA | gemm::kGatherB>{});
    } else if (gather_a) {
      by_output(std::integral_constant<int, gemm::kGatherA>{});
    } else {
      by_output(std::integral_constant<int, gemm::kGatherB>{});
    }
    return;
  }
  if (accumulate) {
    with_cluster<CfgWgradF32>([&](auto cfg) { launch_as(cfg, std::true_type{}); });
  } else if (out.scalar_type() == at::kFloat) {
    with_cluster<CfgWgradF32>(run);
  } else {
    with_cluster<CfgWgradBf16>(run);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) {
  m.impl("grouped_fc1_swiglu", &grouped_fc1_swiglu_cuda);
  m.impl("grouped_gemm_rows", &grouped_gemm_rows_cuda);
  m.impl("grouped_dgrad_swiglu", &grouped_dgrad_swiglu_cuda);
  m.impl("grouped_wgrad", &grouped_wgrad_cuda);
}

}  // namespace megatron_mok
