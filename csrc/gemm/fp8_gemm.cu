// Host side of the blockwise-FP8 grouped GEMMs (fp8_tile.cuh) and the 1 x 128 row
// quantiser that feeds them. Like the BF16 ops: outputs are caller-provided, the row count
// and the expert offsets are read on the device, nothing synchronises with the host.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_fp8.h>
#include <torch/library.h>

#include "gemm/fp8_tile.cuh"
#include "gemm/host.cuh"
#include "gemm/launch.cuh"

namespace megatron_mok {
namespace {

using namespace cute;
using gemm::Epi;
using gemm::Fp8GemmConfig;
using gemm::Fp8Scales;
using gemm::GemmParams;
using gemm::fp8;
using namespace gemm_host;

// By cluster size (MOK_GEMM_CLUSTER: 1, or 2 for B multicast across CTA pairs) and
// promotion (MOK_FP8_PROMOTION: serial, or overlap with the next K tile's WGMMAs).
template <int C, bool O = false>
using CfgFp8Rows = Fp8GemmConfig<Epi::kStore, 5, C, O>;
template <int C, bool O = false>
using CfgFp8Fc1SwiGLU = Fp8GemmConfig<Epi::kSwiGLU, 5, C, O>;
template <int C, bool O = false>
using CfgFp8Fc1SwiGLUQuantAct = Fp8GemmConfig<Epi::kSwiGLU, 5, C, O, true>;
template <int C, bool O = false>
using CfgFp8DgradSwiGLU = Fp8GemmConfig<Epi::kSwiGLUBwd, 5, C, O>;

constexpr int kGroup = 128;  // the recipe's group: 1 x 128 (activations), 128 x 128 (weights)

void check_fp8_cuda(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.is_cuda(), "megatron_mok: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat8_e4m3fn, "megatron_mok: ", name,
              " must be float8_e4m3fn");
  TORCH_CHECK(t.dim() == dim, "megatron_mok: ", name, " must have ", dim, " dimensions");
  TORCH_CHECK(t.is_contiguous(), "megatron_mok: ", name, " must be contiguous");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "megatron_mok: ", name,
              " must be 16-byte aligned");
}

void check_f32_cuda(const at::Tensor& t, const char* name, at::IntArrayRef shape) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              "megatron_mok: ", name, " must be a contiguous CUDA float32 tensor");
  TORCH_CHECK(t.sizes() == shape, "megatron_mok: ", name, " must have shape ", shape, ", got ",
              t.sizes());
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "megatron_mok: ", name,
              " must be 16-byte aligned");
}

// A's transposed row scales [K / 128, ld], ld >= rows and a multiple of 4 (each K tile's 128
// row scales are one 16-byte-aligned bulk copy).
void check_a_scale(const at::Tensor& s, int64_t k, int64_t rows) {
  TORCH_CHECK(s.is_cuda() && s.scalar_type() == at::kFloat && s.dim() == 2 && s.stride(1) == 1,
              "megatron_mok: the row scales must be a CUDA float32 [K / 128, ld] tensor with "
              "unit column stride (the transposed 1 x 128 scales)");
  TORCH_CHECK(s.size(0) == k / kGroup && s.size(1) >= rows && s.stride(0) >= rows &&
                  s.stride(0) % 4 == 0 && reinterpret_cast<uintptr_t>(s.data_ptr()) % 16 == 0,
              "megatron_mok: the row scales must be [K / 128 = ", k / kGroup, ", >= ", rows,
              "] with a row stride that is a multiple of 4 and 16-byte aligned, got ", s.sizes(),
              " stride ", s.strides());
}

template <class Cfg>
void launch_fp8(GemmParams p, const Fp8Scales& scales, const at::Tensor& a, int a_rows, int a_cols,
                const at::Tensor& b, int b_n, int b_k, int b_q, const OutView& out,
                const OutView& h, int64_t max_ctas) {
  constexpr int C = Cfg::kCluster;
  if (p.num_tasks <= 0 || p.n_tiles <= 0) return;
  const int m_groups = (p.m_tiles + C - 1) / C;  // tasks: groups of C neighbouring row tiles
  p.num_tasks = (p.num_tasks / p.m_tiles) * m_groups;
  make_context_current(a);
  auto mA = make_tensor(make_gmem_ptr(reinterpret_cast<const fp8*>(a.data_ptr())),
                        make_shape(a_rows, a_cols), make_stride(int64_t(a_cols), _1{}));
  auto tma_a = make_tma_atom(SM90_TMA_LOAD{}, mA, typename Cfg::SmemLayoutA{}(_, _, 0),
                             Shape<Int<Cfg::BM>, Int<Cfg::BK>>{});
  // B (N, K, Q): Q = experts (kStore) or 2 E halves, gate of e = 2e, up = 2e + 1 (kSwiGLU).
  auto mB = make_tensor(make_gmem_ptr(reinterpret_cast<const fp8*>(b.data_ptr())),
                        make_shape(b_n, b_k, b_q),
                        make_stride(int64_t(b_k), _1{}, int64_t(b_n) * b_k));
  auto tma_b = make_tma_atom(SM90_TMA_LOAD{}, mB, typename Cfg::SmemLayoutBBox{}(_, _, 0),
                             Shape<Int<Cfg::BN / Cfg::kSplit>, Int<Cfg::BK>>{});
  auto tma_b_mc = [&] {
    if constexpr (C == 1) {
      return tma_b;
    } else {
      return make_tma_atom(SM90_TMA_LOAD_MULTICAST{}, mB, typename Cfg::SmemLayoutBBox{}(_, _, 0),
                           Shape<Int<Cfg::BN / Cfg::kSplit>, Int<Cfg::BK>>{}, Int<C>{});
    }
  }();
  auto tma_o = make_store_atom<Cfg>(out);
  auto tma_h = make_store_atom<Cfg>(h);
  auto kernel = &gemm::grouped_fp8_kernel<Cfg, decltype(tma_a), decltype(tma_b),
                                          decltype(tma_b_mc), decltype(tma_o)>;
  static int max_clusters_per_device[64] = {0};  // per instantiation and device
  const gemm::OperandShapes shapes{a_rows, a_cols, b_n, b_k, b_q};
  launch_persistent<Cfg>(kernel, max_clusters_per_device[a.get_device()], p, a, max_ctas,
                         scales, tma_a, tma_b, tma_b_mc, tma_o, tma_h, shapes);
}

// Runs f(Cfg<C, overlap>{}) by MOK_GEMM_CLUSTER and MOK_FP8_PROMOTION (clusters of 2
// promote serially: the overlap is measured on single CTAs first).
template <template <int, bool> class Cfg, class F>
void with_fp8_cluster(F&& f) {
  if (cluster_size() == 2) f(Cfg<2, false>{});
  else if (knobs::current().fp8_overlap_promotion) f(Cfg<1, true>{});
  else f(Cfg<1, false>{});
}

// out [rows, N] bf16 = dq(a) @ dq(w[e])^T per expert segment: a [rows, K] E4M3 with its
// transposed row scales a_scale_t [K / 128, >= rows], w [E, N, K] E4M3 with block scales
// w_scale [E, N / 128, K / 128].
void grouped_fp8_gemm_rows_cuda(const at::Tensor& a, const at::Tensor& a_scale_t,
                                const at::Tensor& w, const at::Tensor& w_scale,
                                const at::Tensor& offsets, const at::Tensor& num_rows,
                                const at::Tensor& out, int64_t max_ctas) {
  check_fp8_cuda(a, "a", 2);
  check_fp8_cuda(w, "w", 3);
  check_bf16_cuda(out, "out", 2);
  const int64_t R = a.size(0), K = a.size(1), E = w.size(0), N = w.size(1);
  TORCH_CHECK(K % kGroup == 0 && N % kGroup == 0,
              "megatron_mok: blockwise FP8 needs N and K to be multiples of 128, got N = ", N,
              ", K = ", K);
  TORCH_CHECK(w.size(2) == K, "megatron_mok: w must be [E, N, K] with a's K");
  TORCH_CHECK(offsets.numel() == E + 1, "megatron_mok: expert_offsets must have E + 1 entries");
  TORCH_CHECK(out.size(0) == R && out.size(1) == N, "megatron_mok: out must be [rows, N]");
  check_a_scale(a_scale_t, K, R);
  check_f32_cuda(w_scale, "w_scale", {E, N / kGroup, K / kGroup});
  c10::cuda::CUDAGuard guard(a.device());
  GemmParams p = rows_params(offsets, num_rows, R, N, K, CfgFp8Rows<1>::BN);
  const Fp8Scales s{a_scale_t.data_ptr<float>(), a_scale_t.stride(0), w_scale.data_ptr<float>(),
                    int(N / kGroup), int(K / kGroup), 0};
  with_fp8_cluster<CfgFp8Rows>([&](auto cfg) {
    launch_fp8<decltype(cfg)>(p, s, a, int(R), int(K), w, int(N), int(K), int(E), rows_view(out),
                              rows_view(out), max_ctas);
  });
}

// act [rows, I] bf16 = SwiGLU(dq(x) @ dq(w1[e])^T), h [rows, 2I] the pre-activations (bf16,
// optional): x [rows, H] E4M3 with x_scale_t [H / 128, >= rows], w1 [E, 2I, H] E4M3 (gate
// rows, then up rows) with w1_scale [E, 2I / 128, H / 128]. act_q [rows, I] E4M3 and
// act_scale_t [I / 128, >= rows] instead of act: act quantised 1 x 128 in the epilogue from
// its bf16 rounding (the bits of quantize_fp8_rows(act)), no bf16 act written.
void grouped_fp8_fc1_swiglu_cuda(const at::Tensor& x, const at::Tensor& x_scale_t,
                                 const at::Tensor& w1, const at::Tensor& w1_scale,
                                 const at::Tensor& offsets, const at::Tensor& num_rows,
                                 const std::optional<at::Tensor>& act,
                                 const std::optional<at::Tensor>& h, int64_t max_ctas,
                                 const std::optional<at::Tensor>& act_q,
                                 const std::optional<at::Tensor>& act_scale_t) {
  check_fp8_cuda(x, "x_rows", 2);
  check_fp8_cuda(w1, "w1", 3);
  const int64_t R = x.size(0), H = x.size(1), E = w1.size(0), I = w1.size(1) / 2;
  TORCH_CHECK(w1.size(1) == 2 * I && w1.size(2) == H, "megatron_mok: w1 must be [E, 2I, H]");
  TORCH_CHECK(H % kGroup == 0 && I % kGroup == 0,
              "megatron_mok: blockwise FP8 needs H and I to be multiples of 128, got H = ", H,
              ", I = ", I);
  TORCH_CHECK(offsets.numel() == E + 1, "megatron_mok: expert_offsets must have E + 1 entries");
  const bool quant = act_q.has_value();
  TORCH_CHECK(quant == act_scale_t.has_value() && quant != act.has_value(),
              "megatron_mok: give act, or act_q and act_scale_t");
  if (quant) {
    check_fp8_cuda(*act_q, "act_q", 2);
    TORCH_CHECK(act_q->size(0) == R && act_q->size(1) == I && act_q->device() == x.device(),
                "megatron_mok: act_q must be [rows, I] on x's device");
    check_a_scale(*act_scale_t, I, R);
    TORCH_CHECK(act_scale_t->device() == x.device(),
                "megatron_mok: act_scale_t must be on x's device");
  } else {
    check_bf16_cuda(*act, "act", 2);
    TORCH_CHECK(act->size(0) == R && act->size(1) == I, "megatron_mok: act must be [rows, I]");
  }
  check_a_scale(x_scale_t, H, R);
  check_f32_cuda(w1_scale, "w1_scale", {E, 2 * I / kGroup, H / kGroup});
  c10::cuda::CUDAGuard guard(x.device());
  // kQuantAct: a task is a pair of 64-act-column tiles (one 1 x 128 group).
  GemmParams p = rows_params(offsets, num_rows, R, I, H,
                             CfgFp8Fc1SwiGLU<1>::BN / 2 * (quant ? 2 : 1));
  if (h.has_value()) {
    check_bf16_cuda(*h, "h", 2);
    TORCH_CHECK(h->size(0) == R && h->size(1) == 2 * I, "megatron_mok: h must be [rows, 2I]");
    p.store_h = true;
  }
  const Fp8Scales s{x_scale_t.data_ptr<float>(), x_scale_t.stride(0), w1_scale.data_ptr<float>(),
                    int(2 * I / kGroup), int(H / kGroup), int(I / kGroup)};
  if (quant) {
    p.act_q = reinterpret_cast<uint8_t*>(act_q->data_ptr());
    p.act_scale_t = act_scale_t->data_ptr<float>();
    p.act_scale_ld = act_scale_t->stride(0);
    // No bf16 act: the output view (never stored to) spans act_q's bytes as bf16.
    const OutView q_view = rows_view(act_q->view(at::kBFloat16));
    const OutView h_view = h.has_value() ? halves_view(*h) : q_view;
    with_fp8_cluster<CfgFp8Fc1SwiGLUQuantAct>([&](auto cfg) {
      launch_fp8<decltype(cfg)>(p, s, x, int(R), int(H), w1, int(I), int(H), int(2 * E), q_view,
                                h_view, max_ctas);
    });
    return;
  }
  const OutView act_view = rows_view(*act);
  const OutView h_view = h.has_value() ? halves_view(*h) : act_view;
  with_fp8_cluster<CfgFp8Fc1SwiGLU>([&](auto cfg) {
    launch_fp8<decltype(cfg)>(p, s, x, int(R), int(H), w1, int(I), int(H), int(2 * E), act_view,
                              h_view, max_ctas);
  });
}

// d_h [rows, 2I] bf16 = SwiGLU'(h) * w * (dq(dy) @ dq(w2t[e])^T): dy [rows, H] E4M3 with
// dy_scale_t [H / 128, >= rows], w2t [E, I, H] E4M3 (w2 transposed, quantised in 128 x 128
// blocks along H) with w2t_scale [E, I / 128, H / 128]; h [rows, 2I] bf16. row_w,
// dots_part [rows, I / 128], act_scaled [rows, I] as grouped_dgrad_swiglu's (together);
// dh_q [rows, 2I] E4M3 and dh_scale_t [2I / 128, >= rows] (together): d_h quantised 1 x 128
// from its bf16 values in the same epilogue (the bits of quantize_fp8_rows(d_h)).
void grouped_fp8_dgrad_swiglu_cuda(const at::Tensor& dy, const at::Tensor& dy_scale_t,
                                   const at::Tensor& w2t, const at::Tensor& w2t_scale,
                                   const at::Tensor& offsets, const at::Tensor& num_rows,
                                   const at::Tensor& h, const at::Tensor& d_h, int64_t max_ctas,
                                   const std::optional<at::Tensor>& row_w,
                                   const std::optional<at::Tensor>& dots_part,
                                   const std::optional<at::Tensor>& act_scaled,
                                   const std::optional<at::Tensor>& dh_q,
                                   const std::optional<at::Tensor>& dh_scale_t) {
  check_fp8_cuda(dy, "dy_rows", 2);
  check_fp8_cuda(w2t, "w2t", 3);
  check_bf16_cuda(h, "h", 2);
  check_bf16_cuda(d_h, "d_h", 2);
  const int64_t R = dy.size(0), H = dy.size(1), E = w2t.size(0), I = w2t.size(1);
  TORCH_CHECK(w2t.size(2) == H, "megatron_mok: w2t must be [E, I, H] (w2 transposed)");
  TORCH_CHECK(H % kGroup == 0 && I % kGroup == 0,
              "megatron_mok: blockwise FP8 needs H and I to be multiples of 128, got H = ", H,
              ", I = ", I);
  TORCH_CHECK(offsets.numel() == E + 1, "megatron_mok: expert_offsets must have E + 1 entries");
  TORCH_CHECK(h.size(0) == R && h.size(1) == 2 * I && d_h.sizes() == h.sizes(),
              "megatron_mok: h and d_h must be [rows, 2I]");
  check_a_scale(dy_scale_t, H, R);
  check_f32_cuda(w2t_scale, "w2t_scale", {E, I / kGroup, H / kGroup});
  c10::cuda::CUDAGuard guard(dy.device());
  GemmParams p = rows_params(offsets, num_rows, R, I, H, CfgFp8DgradSwiGLU<1>::BN);
  p.h_in = reinterpret_cast<const __nv_bfloat16*>(h.data_ptr());
  set_row_scale(p, row_w, dots_part, act_scaled, R, I, dy.device());
  TORCH_CHECK(dh_q.has_value() == dh_scale_t.has_value(),
              "megatron_mok: dh_q and dh_scale_t go together");
  if (dh_q.has_value()) {  // d_h quantised in the epilogue as well (fc1 dgrad's A)
    check_fp8_cuda(*dh_q, "dh_q", 2);
    TORCH_CHECK(dh_q->sizes() == d_h.sizes() && dh_q->device() == dy.device(),
                "megatron_mok: dh_q must be d_h's shape on its device");
    check_a_scale(*dh_scale_t, 2 * I, R);
    TORCH_CHECK(dh_scale_t->device() == dy.device(), "megatron_mok: dh_scale_t must be on dy's device");
    p.dh_q = reinterpret_cast<uint8_t*>(dh_q->data_ptr());
    p.dh_scale_t = dh_scale_t->data_ptr<float>();
    p.dh_scale_ld = dh_scale_t->stride(0);
  }
  const Fp8Scales s{dy_scale_t.data_ptr<float>(), dy_scale_t.stride(0),
                    w2t_scale.data_ptr<float>(), int(I / kGroup), int(H / kGroup), 0};
  with_fp8_cluster<CfgFp8DgradSwiGLU>([&](auto cfg) {
    launch_fp8<decltype(cfg)>(p, s, dy, int(R), int(H), w2t, int(I), int(H), int(E),
                              rows_view(d_h), halves_view(d_h), max_ctas);
  });
}

// 1 x 128 quantisation of bf16 rows, as megatron_mok.fp8_formats.quantize_blockwise: per
// group scale = amax / 448 (1 for an all-zero group), q = rne_e4m3(x / scale) saturated
// (IEEE division, so the bits are the reference's). One warp per kItemsPerWarp consecutive
// (row, group) items, 4 values a lane each, every load issued before the first reduction
// (a warp with a single 8-byte load in flight leaves HBM idle); the scale goes to the
// transposed layout the GEMMs read.
constexpr int kItemsPerWarp = 4;

// One (row, group) item of 128 values, 4 a lane (raw: this lane's 8 bytes): its E4M3
// values and scale as quantize_blockwise gives them.
__device__ __forceinline__ void quantize_group(const uint2& raw, int lane,
                                               __nv_fp8_storage_t* __restrict__ q_group,
                                               float* __restrict__ scale_out) {
  const float2 v01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 v23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  float amax = fmaxf(fmaxf(fabsf(v01.x), fabsf(v01.y)), fmaxf(fabsf(v23.x), fabsf(v23.y)));
  CUTE_UNROLL
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float scale = amax > 0.f ? amax / 448.f : 1.f;
  const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(
      make_float2(v01.x / scale, v01.y / scale), __NV_SATFINITE, __NV_E4M3);
  const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
      make_float2(v23.x / scale, v23.y / scale), __NV_SATFINITE, __NV_E4M3);
  *reinterpret_cast<uint32_t*>(q_group + lane * 4) = uint32_t(lo) | (uint32_t(hi) << 16);
  if (lane == 0) *scale_out = scale;
}

__global__ void quantize_fp8_rows_kernel(const __nv_bfloat16* __restrict__ x,
                                         __nv_fp8_storage_t* __restrict__ q,
                                         float* __restrict__ scale_t, int64_t scale_ld,
                                         int64_t rows, int groups) {
  const int lane = threadIdx.x % 32;
  const int64_t first = (int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32) *
                        kItemsPerWarp;
  const int64_t items = rows * groups;
  if (first >= items) return;
  uint2 raw[kItemsPerWarp];
  CUTE_UNROLL
  for (int j = 0; j < kItemsPerWarp; ++j) {  // item first + j is values [128 item, + 128)
    raw[j] = first + j < items
        ? __ldg(reinterpret_cast<const uint2*>(x + (first + j) * kGroup + lane * 4))
        : make_uint2(0u, 0u);
  }
  CUTE_UNROLL
  for (int j = 0; j < kItemsPerWarp; ++j) {
    const int64_t item = first + j;
    if (item >= items) break;
    quantize_group(raw[j], lane, q + item * kGroup,
                   scale_t + int64_t(item % groups) * scale_ld + item / groups);
  }
}

// EP = 1, one pass over the routed rows: row j of the row table is token peer_token[j]
// of x (padding rows, peer_rank < 0: zeros, scale 1, weight 0). Writes its E4M3 values
// and scales (the bits of quantising x per token and gathering, or of quantising the
// gathered rows: a group's quantisation depends on its values alone), optionally the bf16
// row itself (`rows`, what pull_rows writes) and the route's router weight (`row_w`).
// Rows at and past num_rows (read on the device) are not written, as pull_rows.
__global__ void gather_quantize_fp8_rows_kernel(
    const __nv_bfloat16* __restrict__ x, const int* __restrict__ peer_rank,
    const int* __restrict__ peer_token, const int* __restrict__ peer_k,
    const int* __restrict__ num_rows, const float* __restrict__ topk_w, int topk,
    __nv_fp8_storage_t* __restrict__ q, float* __restrict__ scale_t, int64_t scale_ld,
    __nv_bfloat16* __restrict__ rows_out, float* __restrict__ row_w, int64_t capacity,
    int groups) {
  const int lane = threadIdx.x % 32;
  const int64_t first = (int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32) *
                        kItemsPerWarp;
  const int64_t items = min(int64_t(num_rows[0]), capacity) * groups;
  if (first >= items) return;
  const int64_t k_cols = int64_t(groups) * kGroup;
  uint2 raw[kItemsPerWarp];
  CUTE_UNROLL
  for (int j = 0; j < kItemsPerWarp; ++j) {  // all loads in flight before the reductions
    const int64_t item = first + j;
    raw[j] = make_uint2(0u, 0u);
    if (item < items) {
      const int64_t row = item / groups;
      if (peer_rank[row] >= 0) {
        raw[j] = __ldg(reinterpret_cast<const uint2*>(
            x + int64_t(peer_token[row]) * k_cols + (item % groups) * kGroup + lane * 4));
      }
    }
  }
  CUTE_UNROLL
  for (int j = 0; j < kItemsPerWarp; ++j) {
    const int64_t item = first + j;
    if (item >= items) break;
    const int64_t row = item / groups;
    const int group = int(item % groups);
    quantize_group(raw[j], lane, q + item * kGroup, scale_t + int64_t(group) * scale_ld + row);
    if (rows_out != nullptr) {
      *reinterpret_cast<uint2*>(rows_out + item * kGroup + lane * 4) = raw[j];
    }
    if (row_w != nullptr && group == 0 && lane == 0) {
      row_w[row] = peer_rank[row] >= 0
          ? topk_w[int64_t(peer_token[row]) * topk + peer_k[row]] : 0.f;
    }
  }
}

void quantize_fp8_rows_cuda(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale_t) {
  check_bf16_cuda(x, "x", 2);
  check_fp8_cuda(q, "q", 2);
  const int64_t R = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kGroup == 0, "megatron_mok: 1 x 128 quantisation needs K to be a multiple of "
              "128, got ", K);
  TORCH_CHECK(q.sizes() == x.sizes() && q.device() == x.device(),
              "megatron_mok: q must be x's shape on x's device");
  check_a_scale(scale_t, K, R);
  TORCH_CHECK(scale_t.device() == x.device(), "megatron_mok: scale_t must be on x's device");
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t items = R * (K / kGroup);
  if (items == 0) return;
  constexpr int kWarps = 8, kItemsPerBlock = kWarps * kItemsPerWarp;
  quantize_fp8_rows_kernel<<<int((items + kItemsPerBlock - 1) / kItemsPerBlock), 32 * kWarps, 0,
                             at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()),
      reinterpret_cast<__nv_fp8_storage_t*>(q.data_ptr()), scale_t.data_ptr<float>(),
      scale_t.stride(0), R, int(K / kGroup));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void gather_quantize_fp8_rows_cuda(const at::Tensor& x, const at::Tensor& peer_rank,
                                   const at::Tensor& peer_token, const at::Tensor& peer_k,
                                   const at::Tensor& num_rows,
                                   const std::optional<at::Tensor>& topk_w, const at::Tensor& q,
                                   const at::Tensor& scale_t,
                                   const std::optional<at::Tensor>& rows,
                                   const std::optional<at::Tensor>& row_w) {
  check_bf16_cuda(x, "x", 2);
  check_fp8_cuda(q, "q", 2);
  const int64_t K = x.size(1), capacity = q.size(0);
  TORCH_CHECK(K % kGroup == 0, "megatron_mok: 1 x 128 quantisation needs K to be a multiple of "
              "128, got ", K);
  TORCH_CHECK(q.size(1) == K && q.device() == x.device(),
              "megatron_mok: q must be [capacity, K] on x's device");
  check_a_scale(scale_t, K, capacity);
  TORCH_CHECK(scale_t.device() == x.device(), "megatron_mok: scale_t must be on x's device");
  for (const at::Tensor* t : {&peer_rank, &peer_token, &peer_k}) {
    TORCH_CHECK(t->is_cuda() && t->scalar_type() == at::kInt && t->is_contiguous() &&
                    t->numel() == capacity && t->device() == x.device(),
                "megatron_mok: the row table must be contiguous int32 [capacity] on x's device");
  }
  TORCH_CHECK(num_rows.is_cuda() && num_rows.scalar_type() == at::kInt && num_rows.numel() == 1,
              "megatron_mok: num_rows must be a CUDA int32 tensor with one element");
  if (rows.has_value()) {
    check_bf16_cuda(*rows, "rows", 2);
    TORCH_CHECK(rows->sizes() == q.sizes() && rows->device() == x.device(),
                "megatron_mok: rows must be q's shape on x's device");
  }
  TORCH_CHECK(topk_w.has_value() == row_w.has_value(), "megatron_mok: topk_w and row_w go together");
  int topk = 0;
  if (row_w.has_value()) {
    TORCH_CHECK(topk_w->is_cuda() && topk_w->scalar_type() == at::kFloat && topk_w->dim() == 2 &&
                    topk_w->is_contiguous() && topk_w->size(0) == x.size(0) &&
                    topk_w->device() == x.device(),
                "megatron_mok: topk_w must be contiguous CUDA float32 [tokens, K]");
    TORCH_CHECK(row_w->is_cuda() && row_w->scalar_type() == at::kFloat && row_w->is_contiguous() &&
                    row_w->numel() == capacity && row_w->device() == x.device(),
                "megatron_mok: row_w must be contiguous CUDA float32 [capacity]");
    topk = int(topk_w->size(1));
  }
  c10::cuda::CUDAGuard guard(x.device());
  const int64_t items = capacity * (K / kGroup);
  if (items == 0) return;
  constexpr int kWarps = 8, kItemsPerBlock = kWarps * kItemsPerWarp;
  gather_quantize_fp8_rows_kernel<<<int((items + kItemsPerBlock - 1) / kItemsPerBlock),
                                    32 * kWarps, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), peer_rank.data_ptr<int>(),
      peer_token.data_ptr<int>(), peer_k.data_ptr<int>(), num_rows.data_ptr<int>(),
      row_w.has_value() ? topk_w->data_ptr<float>() : nullptr, topk,
      reinterpret_cast<__nv_fp8_storage_t*>(q.data_ptr()), scale_t.data_ptr<float>(),
      scale_t.stride(0),
      rows.has_value() ? reinterpret_cast<__nv_bfloat16*>(rows->data_ptr()) : nullptr,
      row_w.has_value() ? row_w->data_ptr<float>() : nullptr, capacity, int(K / kGroup));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// 128 x 128 block quantisation of expert weights, as quantize_blockwise(w, block_rows=128):
// one CTA per block, q [E, N, K] and its transpose qt [E, K, N] (the dgrads' layout: the
// same blocks, so the same scales), scale [E, N / 128, K / 128]. Every global access is a
// warp covering whole 128-byte lines: thread t moves 8 values of row 16 p + t / 16 (pass p
// of 8), columns 8 (t % 16) ..; the transpose goes through shared memory, whose row pitch
// of 132 bytes lets the 16 lanes reading one column run on 16 banks.
constexpr int kBlockThreads = 256, kBlockPasses = kGroup * kGroup / (8 * kBlockThreads);
constexpr int kTilePitch = kGroup + 4;

__global__ void __launch_bounds__(kBlockThreads)
quantize_fp8_blocks_kernel(const __nv_bfloat16* __restrict__ w,
                           __nv_fp8_storage_t* __restrict__ q,
                           __nv_fp8_storage_t* __restrict__ qt, float* __restrict__ scale,
                           int n, int k) {
  __shared__ float warp_max[kBlockThreads / 32];
  __shared__ __align__(16) uint8_t tile[kGroup * kTilePitch];
  const int nb = n / kGroup, kb = k / kGroup;
  const int e = blockIdx.x / (nb * kb), bn = (blockIdx.x / kb) % nb, bk = blockIdx.x % kb;
  const int sub_row = threadIdx.x / 16, col = (threadIdx.x % 16) * 8;
  const __nv_bfloat16* src = w + (int64_t(e) * n + bn * kGroup) * k + bk * kGroup + col;
  uint4 raw[kBlockPasses];
  CUTE_UNROLL
  for (int p = 0; p < kBlockPasses; ++p)
    raw[p] = __ldg(reinterpret_cast<const uint4*>(src + int64_t(16 * p + sub_row) * k));
  float amax = 0.f;
  CUTE_UNROLL
  for (int p = 0; p < kBlockPasses; ++p) {
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw[p]);
    CUTE_UNROLL
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(pairs[i]);
      amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
  }
  CUTE_UNROLL
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  amax = warp_max[0];
  CUTE_UNROLL
  for (int i = 1; i < kBlockThreads / 32; ++i) amax = fmaxf(amax, warp_max[i]);
  const float s = amax > 0.f ? amax / 448.f : 1.f;
  __nv_fp8_storage_t* dst = q + (int64_t(e) * n + bn * kGroup) * k + bk * kGroup + col;
  CUTE_UNROLL
  for (int p = 0; p < kBlockPasses; ++p) {
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw[p]);
    uint32_t packed[2];
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      const float2 f0 = __bfloat1622float2(pairs[2 * h]), f1 = __bfloat1622float2(pairs[2 * h + 1]);
      const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(
          make_float2(f0.x / s, f0.y / s), __NV_SATFINITE, __NV_E4M3);
      const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
          make_float2(f1.x / s, f1.y / s), __NV_SATFINITE, __NV_E4M3);
      packed[h] = uint32_t(lo) | (uint32_t(hi) << 16);
    }
    const int row = 16 * p + sub_row;
    *reinterpret_cast<uint2*>(dst + int64_t(row) * k) = make_uint2(packed[0], packed[1]);
    uint32_t* t32 = reinterpret_cast<uint32_t*>(tile + row * kTilePitch + col);
    t32[0] = packed[0];
    t32[1] = packed[1];
  }
  if (threadIdx.x == 0) scale[(int64_t(e) * nb + bn) * kb + bk] = s;
  __syncthreads();
  // qt row r (a K index) is tile column r: thread t gathers its 8 N values.
  __nv_fp8_storage_t* dst_t = qt + (int64_t(e) * k + bk * kGroup) * n + bn * kGroup + col;
  CUTE_UNROLL
  for (int p = 0; p < kBlockPasses; ++p) {
    const int r = 16 * p + sub_row;
    uint32_t word[2] = {0u, 0u};
    CUTE_UNROLL
    for (int b = 0; b < 8; ++b) word[b / 4] |= uint32_t(tile[(col + b) * kTilePitch + r]) << (8 * (b % 4));
    *reinterpret_cast<uint2*>(dst_t + int64_t(r) * n) = make_uint2(word[0], word[1]);
  }
}

void quantize_fp8_blocks_cuda(const at::Tensor& w, const at::Tensor& q, const at::Tensor& qt,
                              const at::Tensor& scale) {
  check_bf16_cuda(w, "w", 3);
  check_fp8_cuda(q, "q", 3);
  check_fp8_cuda(qt, "qt", 3);
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
  TORCH_CHECK(N % kGroup == 0 && K % kGroup == 0, "megatron_mok: 128 x 128 blocks need both "
              "weight dims to be multiples of 128, got ", w.sizes());
  TORCH_CHECK(q.sizes() == w.sizes() && qt.size(0) == E && qt.size(1) == K && qt.size(2) == N,
              "megatron_mok: q must be [E, N, K] and qt [E, K, N]");
  check_f32_cuda(scale, "scale", {E, N / kGroup, K / kGroup});
  c10::cuda::CUDAGuard guard(w.device());
  const int64_t blocks = E * (N / kGroup) * (K / kGroup);
  if (blocks == 0) return;
  TORCH_CHECK(blocks < (int64_t(1) << 31), "megatron_mok: too many weight blocks");
  quantize_fp8_blocks_kernel<<<int(blocks), kBlockThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const __nv_bfloat16*>(w.data_ptr()),
      reinterpret_cast<__nv_fp8_storage_t*>(q.data_ptr()),
      reinterpret_cast<__nv_fp8_storage_t*>(qt.data_ptr()), scale.data_ptr<float>(), int(N),
      int(K));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) {
  m.impl("grouped_fp8_gemm_rows", &grouped_fp8_gemm_rows_cuda);
  m.impl("grouped_fp8_fc1_swiglu", &grouped_fp8_fc1_swiglu_cuda);
  m.impl("grouped_fp8_dgrad_swiglu", &grouped_fp8_dgrad_swiglu_cuda);
  m.impl("quantize_fp8_rows", &quantize_fp8_rows_cuda);
  m.impl("gather_quantize_fp8_rows", &gather_quantize_fp8_rows_cuda);
  m.impl("quantize_fp8_blocks", &quantize_fp8_blocks_cuda);
}

}  // namespace megatron_mok
