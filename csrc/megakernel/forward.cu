// Host side of the forward megakernel: argument checks, TMA descriptors of fc1 and fc2,
// one cooperative launch over every SM. Reads the row count and the expert offsets on the
// device: nothing here synchronises with the host.

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "gemm/host.cuh"
#include "megakernel/forward.cuh"
#include "megakernel/launch.cuh"
#include "knobs.h"

namespace megatron_mok {
namespace {

using namespace cute;
using namespace gemm_host;
using megakernel::ForwardParams;

using Cfg1 = CfgFc1SwiGLU<1>;  // the core's fc1 + SwiGLU tiles
using Cfg2 = CfgRowsNT<1>;     // the core's fc2 tiles

// MOK_MEGAKERNEL_GATHER = lines (default) | tma | rows: how direct mode gathers fc1's rows
// (A/B measurements, docs/perf-notes.md: lines measured fastest at e77b681).
int gather_mode() {
  switch (knobs::current().gather) {
    case knobs::kGatherTma: return megakernel::kGatherTma;
    case knobs::kGatherRows: return megakernel::kGatherRows;
    default: return megakernel::kGatherLines;
  }
}

// MOK_MOVER_WARPS = 1 | 2 | 4 | 8 (default): row movers (warps) per comm CTA. The rate
// scales ~2x per doubling up to 4 and a further 0-25 % at 8 (docs/perf-notes.md,
// megakernel v10-v11).
int mover_warps() { return knobs::current().mover_warps; }

// x [T, H] bf16 as a TMA tensor map of 1 x 64 boxes (gemm_host::row_box_map).
cute::TmaDescriptor row_map(const at::Tensor& x) { return row_box_map(x); }

void moe_forward(const at::Tensor& peer_base, int64_t x_offset,
                 const std::optional<at::Tensor>& x_local, int64_t slots_offset,
                 const at::Tensor& peer_rank, const at::Tensor& peer_token,
                 const at::Tensor& peer_k, const at::Tensor& offsets, const at::Tensor& num_rows,
                 int64_t topk, const at::Tensor& w1, const at::Tensor& w2,
                 const at::Tensor& x_rows, const at::Tensor& act,
                 const std::optional<at::Tensor>& h, const at::Tensor& y_rows,
                 const at::Tensor& counters, const at::Tensor& watchdog, int64_t timeout_ms,
                 int64_t rank, int64_t num_comm, int64_t minibatch_rows, bool direct,
                 bool store_y, int64_t hold_tile, const std::optional<at::Tensor>& probe,
                 bool scatter, const std::optional<at::Tensor>& b1,
                 const std::optional<at::Tensor>& b2, bool glu, double glu_alpha,
                 double glu_limit, double glu_offset) {
  check_bf16_cuda(x_rows, "x_rows", 2);
  check_bf16_cuda(w1, "w1", 3);
  check_bf16_cuda(w2, "w2", 3);
  check_bf16_cuda(act, "act", 2);
  check_bf16_cuda(y_rows, "y_rows", 2);
  // R: rows of the table (act, h, y_rows); x_rows may be a ring of fewer rows (comm mode).
  const int64_t R = y_rows.size(0), H = y_rows.size(1), E = w1.size(0), I = w1.size(1) / 2;
  const int64_t ring_rows = x_rows.size(0);
  TORCH_CHECK(w1.size(1) == 2 * I && w1.size(2) == H, "megatron_mok: w1 must be [E, 2I, H]");
  TORCH_CHECK(w2.size(0) == E && w2.size(1) == H && w2.size(2) == I,
              "megatron_mok: w2 must be [E, H, I]");
  TORCH_CHECK(act.size(0) == R && act.size(1) == I, "megatron_mok: act must be [rows, I]");
  TORCH_CHECK(x_rows.size(1) == H && ring_rows <= R && ring_rows % 128 == 0,
              "megatron_mok: x_rows must be [rows, H] or a ring of whole 128-row tiles");
  TORCH_CHECK(ring_rows == R || (!direct && ring_rows >= minibatch_rows),
              "megatron_mok: an x_rows ring needs comm CTAs and at least one minibatch of rows "
              "(its pulls wait on the fc1 tiles of an earlier minibatch), got ", ring_rows,
              " rows for minibatch ", minibatch_rows);
  TORCH_CHECK(offsets.numel() == E + 1, "megatron_mok: expert_offsets must have E + 1 entries");
  for (auto [t, name] : {std::pair{&peer_rank, "peer_rank"}, {&peer_token, "peer_token"},
                         {&peer_k, "peer_k"}}) {
    megakernel::check_int32_table(*t, name, R);
  }
  const int64_t m_tiles = R / 128;
  megakernel::check_int32_table(counters, "counters",
                                megakernel::forward_counters_size(int(m_tiles)));
  megakernel::check_watchdog_and_peers(watchdog, peer_base);
  TORCH_CHECK(x_offset % 16 == 0 && slots_offset % 16 == 0,
              "megatron_mok: symmetric offsets must be 16-byte aligned");
  if (x_local.has_value()) check_bf16_cuda(*x_local, "x", 2);
  TORCH_CHECK(!x_local.has_value() || x_local->size(1) == H, "megatron_mok: x must be [T, H]");
  c10::cuda::CUDAGuard guard(x_rows.device());
  make_context_current(x_rows);  // before any TMA descriptor (row_map too)
  const int sms = num_sms(x_rows.get_device());
  TORCH_CHECK(!direct || x_local.has_value(),
              "megatron_mok: the direct megakernel (EP = 1) gathers from a local x");
  // Comm mode with 0 comm SMs is spread mode: every CTA's producer warps pull rows.
  TORCH_CHECK(direct ? num_comm == 0 : (num_comm >= 0 && num_comm < sms),
              "megatron_mok: the forward megakernel needs 0 to ", sms - 1,
              " comm SMs (0 in direct mode), got ", num_comm);
  const bool spread = !direct && num_comm == 0;
  TORCH_CHECK(!spread || ring_rows == R, "megatron_mok: an x_rows ring needs comm CTAs");
  TORCH_CHECK(scatter || ((direct || spread) && x_local.has_value()),
              "megatron_mok: only the direct and spread megakernels at EP = 1 can skip the "
              "slots");
  // MOK_MOVER_WARPS is an upper bound: rows too long for that many movers' slots get fewer.
  int warps = direct || spread ? 1 : mover_warps();
  while (warps > 1 && megakernel::mover_lag(int(H * 2), Cfg1::kSmemBytes, warps) == 0) warps /= 2;
  const int lag = megakernel::mover_lag(int(H * 2), Cfg1::kSmemBytes, warps);
  TORCH_CHECK(direct || spread || lag >= 1, "megatron_mok: the forward megakernel's ", warps,
              " row movers cannot hold rows of H = ", H, " bf16 in shared memory");
  megakernel::check_minibatch_rows(minibatch_rows);

  ForwardParams p{};
  p.fc1 = rows_params(offsets, num_rows, R, I, H, Cfg1::BN / 2);
  p.fc1.store_h = h.has_value();
  p.fc2 = rows_params(offsets, num_rows, R, H, I, Cfg2::BN);
  set_col_bias(p.fc1, b1, E, 2 * I, x_rows.device(), "b1");
  set_col_bias(p.fc2, b2, E, H, x_rows.device(), "b2");
  const bool general_glu = set_glu(p.fc1, glu, glu_alpha, glu_limit, glu_offset);
  TORCH_CHECK(!(b1.has_value() || b2.has_value()) || general_glu, "megatron_mok: the experts' "
              "biases run in the general GLU epilogues: pass glu (SwiGLU: alpha 1, limit inf, "
              "offset 0)");
  p.fc1_shapes = {int(ring_rows), int(H), int(I), int(H), int(2 * E)};
  p.ring_tiles = ring_rows < R ? int(ring_rows / 128) : 0;
  p.fc2_shapes = {int(R), int(I), int(H), int(I), int(E)};
  p.mb_tiles = int(minibatch_rows / 128);
  p.mover_lag = lag;
  p.mover_warps = warps;
  p.num_comm = int(num_comm);
  p.spread = spread;
  p.pull_target = spread ? 128 : warps;
  p.counters = counters.data_ptr<int>();
  p.peer_rank = peer_rank.data_ptr<int>();
  p.peer_token = peer_token.data_ptr<int>();
  p.peer_k = peer_k.data_ptr<int>();
  p.peer_base = peer_base.data_ptr<int64_t>();
  p.x_offset = x_offset;
  p.slots_offset = slots_offset;
  p.x_local = x_local.has_value() ? reinterpret_cast<const uint4*>(x_local->data_ptr()) : nullptr;
  p.topk = int(topk);
  p.row_vecs = int(H / 8);
  p.x_rows = reinterpret_cast<uint4*>(x_rows.data_ptr());
  p.y_rows = reinterpret_cast<const uint4*>(y_rows.data_ptr());
  p.dog = {watchdog.data_ptr<int64_t>(), timeout_ms * 1000000, int(rank)};
  p.hold_tile = int(hold_tile);
  p.probe = nullptr;
  if (probe.has_value()) {
    TORCH_CHECK(probe->device() == x_rows.device() && probe->scalar_type() == at::kLong &&
                    probe->is_contiguous() &&
                    probe->numel() >= int64_t(sms) * megakernel::kProbeSlots,
                "megatron_mok: probe must be a contiguous int64 tensor on x_rows' device of at "
                "least ", int64_t(sms) * megakernel::kProbeSlots, " entries");
    p.probe = reinterpret_cast<unsigned long long*>(probe->data_ptr<int64_t>());
  }
  p.direct = direct;
  p.gather = gather_mode();
  if (direct && p.gather == megakernel::kGatherTma && x_local->size(0) > 0) {
    p.num_tokens = int(x_local->size(0));
    p.x_row_map = row_map(*x_local);
  }
  p.scatter = scatter;
  p.store_y = !(direct || spread) || store_y || !scatter;
  if (R == 0) return;

  // fc1's tiles with SwiGLU or the general GLU: the same shapes, TMA boxes and shared memory.
  auto launch = [&](auto cfg1, auto cfg2) {
    using CfgA = decltype(cfg1);
    using CfgB = decltype(cfg2);
    static_assert(CfgA::kSmemBytes == Cfg1::kSmemBytes && CfgA::BN == Cfg1::BN &&
                  CfgB::kSmemBytes == Cfg2::kSmemBytes && CfgB::BN == Cfg2::BN);
    auto tma_x = make_load_a<CfgA>(x_rows, make_stride(H, _1{}), int(ring_rows), int(H));
    auto tma_w1 = make_load_b<CfgA>(w1, make_stride(H, _1{}, I * H), int(I), int(H), int(2 * E));
    auto tma_act = make_store_atom<CfgA>(rows_view(act));
    auto tma_h = make_store_atom<CfgA>(h.has_value() ? halves_view(*h) : rows_view(act));
    auto tma_act_in = make_load_a<CfgB>(act, make_stride(I, _1{}), int(R), int(I));
    auto tma_w2 = make_load_b<CfgB>(w2, make_stride(I, _1{}, H * I), int(H), int(I), int(E));
    auto tma_y = make_store_atom<CfgB>(rows_view(y_rows));
    auto kernel = &megakernel::moe_forward_kernel<CfgA, CfgB, decltype(tma_x), decltype(tma_w1),
                                                  decltype(tma_act), decltype(tma_act_in),
                                                  decltype(tma_w2), decltype(tma_y)>;
    megakernel::launch_cooperative(kernel, sms, CfgA::kThreads, CfgA::kSmemBytes, p, tma_x,
                                   tma_w1, tma_act, tma_h, tma_act_in, tma_w2, tma_y);
  };
  if (general_glu) {
    launch(CfgFc1Glu{}, CfgRowsNTBias{});  // the general variants: GLU, b1 and b2
  } else {
    launch(Cfg1{}, Cfg2{});
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(megatron_mok, CUDA, m) { m.impl("moe_forward", &moe_forward); }

}  // namespace megatron_mok
