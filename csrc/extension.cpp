// Op registry of megatron_mok's extension: schemas and the CPU kernels.
// CUDA kernels live one folder per concern (combine/, ...) and register
// their implementations with TORCH_LIBRARY_IMPL(megatron_mok, CUDA, ...).

#include <Python.h>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "combine/combine_epilogue.h"

namespace megatron_mok {

// y[t] = shared[t] + sum_k w[t,k] * slots[t,k] in fp32, k ascending, rounded once.
// Routes with topk_idx < 0 contribute nothing.
at::Tensor combine_epilogue_cpu(const at::Tensor& slots, const at::Tensor& topk_idx,
                                const at::Tensor& topk_w, const std::optional<at::Tensor>& shared) {
  check_combine_epilogue_args(slots, topk_idx, topk_w, shared, at::kCPU);
  const int64_t T = slots.size(0), K = slots.size(1), H = slots.size(2);
  auto slots_f = slots.to(at::kFloat);
  auto idx = topk_idx.to(at::kLong);
  auto shared_f = shared.has_value() ? shared->to(at::kFloat) : at::Tensor();
  auto acc = at::empty({T, H}, slots.options().dtype(at::kFloat));
  const float* s = slots_f.data_ptr<float>();
  const float* w = topk_w.data_ptr<float>();
  const int64_t* id = idx.data_ptr<int64_t>();
  const float* sh = shared_f.defined() ? shared_f.data_ptr<float>() : nullptr;
  float* out = acc.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        float a = sh ? sh[t * H + h] : 0.f;
        for (int64_t k = 0; k < K; ++k) {
          const float wk = id[t * K + k] >= 0 ? w[t * K + k] : 0.f;
          a += wk * s[(t * K + k) * H + h];
        }
        out[t * H + h] = a;
      }
    }
  });
  return acc.to(slots.scalar_type());
}

TORCH_LIBRARY(megatron_mok, m) {
  m.def("combine_epilogue(Tensor slots, Tensor topk_idx, Tensor topk_w, Tensor? shared) -> Tensor");
  // EP = 1: the same sum over rows[route_row[t, k]] (route_row -1: not routed), CUDA only.
  m.def("combine_rows(Tensor rows, Tensor route_row, Tensor topk_w, Tensor? shared) -> Tensor");
  // EP communication over symmetric memory (csrc/comm/). peer_base: int64 base address
  // of every rank's symmetric buffer; offsets are byte offsets into it.
  m.def("ep_barrier(Tensor peer_base, int flag_offset, Tensor(a!) epoch, int rank, "
        "Tensor(b!) watchdog, int timeout_ms) -> ()");
  m.def("gather_from_peers(Tensor peer_base, int offset, Tensor(a!) out) -> ()");
  // The row table of schedule.build_row_table in three launches (comm/schedule.cu).
  // status: the device's sticky routing status (comm/routing_status.h); dropped (EP > 1):
  // [1 + P T K], the count and then the routes left out for lack of room.
  m.def("build_row_table(Tensor topk_idx_all, int ep_rank, int num_local_experts, "
        "int num_experts, Tensor(a!) peer_rank, Tensor(b!) peer_token, Tensor(c!) peer_k, "
        "Tensor(d!) tokens_per_expert, Tensor(e!) expert_offsets, Tensor(f!) num_rows, "
        "Tensor(g!) overflow, Tensor(h!) invalid_ids, Tensor(i!)? route_row, "
        "Tensor(j!) status, Tensor(k!)? dropped) -> ()");
  // Zero the (t, k) slot row and scalar of every dropped route on its source rank.
  m.def("zero_dropped_routes(Tensor peer_base, int slots_offset, int scalar_offset, "
        "Tensor dropped, int num_tokens, int topk, int hidden) -> ()");
  // w_offset >= 0: row_w[j] = the router weight of row j's route (0 for padding); the
  // rows themselves are copied unscaled (the dgrad epilogue applies the weight).
  m.def("pull_rows(Tensor peer_base, int src_offset, Tensor peer_rank, Tensor peer_token, "
        "Tensor peer_k, Tensor num_rows, int topk, int w_offset, Tensor(a!) out, "
        "Tensor(b!)? row_w=None) -> ()");
  // rows None: the scalars only.
  m.def("push_rows(Tensor? rows, Tensor peer_base, int dst_offset, Tensor peer_rank, "
        "Tensor peer_token, Tensor peer_k, Tensor num_rows, int topk, Tensor? scalars, "
        "int scalar_offset) -> ()");
  // Grouped-GEMM core over the row table (csrc/gemm/). max_ctas > 0 caps the persistent
  // grid (tests: results must not depend on it).
  // bias: fc1's per-expert bias [E, 2I] (gate, up), added before the activation (h holds
  // it). glu: the general GLU act = g' sigmoid(alpha g') (u' + offset), g' = min(g, limit),
  // u' = clamp(u, -limit, limit) (limit inf: no clamp) instead of SwiGLU; with glu the
  // limit must be given (its default is refused).
  m.def("grouped_fc1_swiglu(Tensor x_rows, Tensor w1, Tensor expert_offsets, Tensor num_rows, "
        "Tensor(a!) act, Tensor(b!)? h, int max_ctas, Tensor? bias=None, bool glu=False, "
        "float glu_alpha=1.0, float glu_limit=-1.0, float glu_offset=0.0) -> ()");
  // bias: a per-expert column bias [E, N] added to the output (fc2's).
  m.def("grouped_gemm_rows(Tensor a, Tensor w, Tensor expert_offsets, Tensor num_rows, "
        "bool w_transposed, Tensor(a!) out, int max_ctas, Tensor? bias=None) -> ()");
  // row_w, dots_part, act_scaled (together): dy_rows are unscaled, the epilogue applies
  // row r's router weight row_w[r] and writes dots_part [rows, ceil(I / 256)] (partial
  // <dy, y_row> per column tile) and act_scaled = w * SwiGLU(h) (dW2's operand).
  m.def("grouped_dgrad_swiglu(Tensor dy_rows, Tensor w2, Tensor expert_offsets, "
        "Tensor num_rows, Tensor h, Tensor(a!) d_h, int max_ctas, Tensor? row_w=None, "
        "Tensor(b!)? dots_part=None, Tensor(c!)? act_scaled=None, bool glu=False, "
        "float glu_alpha=1.0, float glu_limit=-1.0, float glu_offset=0.0) -> ()");
  // Non-gated experts (csrc/gemm/grouped_act.cu): w1 [E, I, H]; act = f(x_rows w1[e]^T +
  // bias[e]) (h: the pre-activations, bias included), f by act_fn (0 relu, 1 squared-ReLU,
  // 2 GeLU (erf), 3 GeLU (tanh), 4 x sigmoid(act_alpha x)). grouped_dgrad_act: d_h = f'(h) *
  // (dy_rows w2[e]) (with row_w: times the row's router weight, and dots_part / act_scaled
  // as grouped_dgrad_swiglu's, act = f(h)).
  m.def("grouped_fc1_act(Tensor x_rows, Tensor w1, Tensor expert_offsets, Tensor num_rows, "
        "Tensor(a!) act, Tensor(b!)? h, int max_ctas, Tensor? bias, int act_fn, "
        "float act_alpha) -> ()");
  m.def("grouped_dgrad_act(Tensor dy_rows, Tensor w2, Tensor expert_offsets, "
        "Tensor num_rows, Tensor h, Tensor(a!) d_h, int max_ctas, Tensor? row_w, "
        "Tensor(b!)? dots_part, Tensor(c!)? act_scaled, int act_fn, float act_alpha) -> ()");
  // Blockwise FP8 (csrc/gemm/fp8_gemm.cu): E4M3 operands, A with transposed 1 x 128 row
  // scales [K / 128, >= rows], w with 128 x 128 block scales [E, N / 128, K / 128]; bf16 out.
  // grouped_fp8_fc1_swiglu: w1 [E, 2I, H] (gate rows, then up), act = SwiGLU, h optional.
  // quantize_fp8_rows: bf16 [R, K] -> E4M3 q and scale_t (1 x 128 groups along K).
  m.def("grouped_fp8_gemm_rows(Tensor a, Tensor a_scale_t, Tensor w, Tensor w_scale, "
        "Tensor expert_offsets, Tensor num_rows, Tensor(a!) out, int max_ctas) -> ()");
  // act_q / act_scale_t in place of act: act quantised 1 x 128 in the epilogue (fc2's A).
  m.def("grouped_fp8_fc1_swiglu(Tensor x_rows, Tensor x_scale_t, Tensor w1, Tensor w1_scale, "
        "Tensor expert_offsets, Tensor num_rows, Tensor(a!)? act, Tensor(b!)? h, "
        "int max_ctas, Tensor(c!)? act_q=None, Tensor(d!)? act_scale_t=None) -> ()");
  // grouped_fp8_dgrad_swiglu: w2t [E, I, H] (w2 transposed, 128 x 128 blocks along H);
  // row_w / dots_part [rows, I / 128] / act_scaled as grouped_dgrad_swiglu's; dh_q /
  // dh_scale_t: d_h also quantised 1 x 128 in the epilogue (fc1 dgrad's A).
  m.def("grouped_fp8_dgrad_swiglu(Tensor dy_rows, Tensor dy_scale_t, Tensor w2t, "
        "Tensor w2t_scale, Tensor expert_offsets, Tensor num_rows, Tensor h, Tensor(a!) d_h, "
        "int max_ctas, Tensor? row_w=None, Tensor(b!)? dots_part=None, "
        "Tensor(c!)? act_scaled=None, Tensor(d!)? dh_q=None, Tensor(e!)? dh_scale_t=None) -> ()");
  m.def("quantize_fp8_rows(Tensor x, Tensor(a!) q, Tensor(b!) scale_t) -> ()");
  // gather_quantize_fp8_rows (EP = 1): row j = x[peer_token[j]] (padding rows, peer_rank < 0:
  // zeros, scale 1) quantised 1 x 128 into q / scale_t, optionally also its bf16 copy (rows)
  // and its router weight topk_w[token, peer_k[j]] (row_w, 0 for padding); rows < num_rows.
  m.def("gather_quantize_fp8_rows(Tensor x, Tensor peer_rank, Tensor peer_token, "
        "Tensor peer_k, Tensor num_rows, Tensor? topk_w, Tensor(a!) q, Tensor(b!) scale_t, "
        "Tensor(c!)? rows, Tensor(d!)? row_w) -> ()");
  // quantize_fp8_blocks: w [E, N, K] bf16 -> q [E, N, K], qt [E, K, N] (the transposed
  // layout of the same blocks), scale [E, N / 128, K / 128] (128 x 128 blocks).
  m.def("quantize_fp8_blocks(Tensor w, Tensor(a!) q, Tensor(b!) qt, Tensor(c!) scale) -> ()");
  // The experts' bias gradients (csrc/gemm/segment_sums.cu): out [E, N] fp32, out[e] = the
  // sum of scale[r] * rows[r] (scale optional) over the rows of segment e below num_rows.
  m.def("segment_column_sums(Tensor rows, Tensor expert_offsets, Tensor num_rows, "
        "Tensor? scale, Tensor(a!) out) -> ()");
  // out [rows] fp32: <rows[r], vecs[expert of r]> (fc2's bias term of the router weight's
  // gradient, <dy_row, b2[e]>), 0 past num_rows.
  m.def("segment_row_dots(Tensor rows, Tensor vecs, Tensor expert_offsets, Tensor num_rows, "
        "Tensor(a!) out) -> ()");
  // accumulate: out (fp32) += the gradient, through TMA reduce-add stores (Megatron's
  // main_grad; one owner per tile, so one add per element: deterministic). out's planes
  // may lie apart (stride(0) >= M * N); reverse_experts: expert e's gradient is plane
  // E - 1 - e (the experts' main_grads lie backwards in Megatron's grad buffer).
  // gather_rank / gather_token [rows] int32 with gather_operands (bits: 1 = a, 2 = b): that
  // operand is the tokens [T, M or N] and its row j is token gather_token[j] (zeros where
  // gather_rank[j] < 0), gathered by the kernel (EP = 1).
  m.def("grouped_wgrad(Tensor a, Tensor b, Tensor expert_offsets, Tensor(a!) out, "
        "bool accumulate, int max_ctas, bool reverse_experts=False, Tensor? gather_rank=None, "
        "Tensor? gather_token=None, int gather_operands=2) -> ()");
  // The forward megakernel (csrc/megakernel/): pull -> fc1 + SwiGLU -> fc2 -> push in one
  // persistent launch. x_local: EP = 1, pull from this x instead of the peers' buffers.
  // direct (EP = 1, num_comm = 0): fc1 gathers its rows from x_local, fc2 scatters into the
  // slots (x_rows is not written; y_rows only with store_y).
  // hold_tile >= 0 (tests): the last mover warp never publishes that tile's pull, so the
  // watchdog must fire.
  // probe (optional int64 [num_sms, 16]): per-CTA cycle sums (megakernel/forward.cuh).
  // scatter = false (direct or spread mode, EP = 1): y_rows only, no (t, k) slots
  // (combine_rows reads them in place).
  m.def("moe_forward(Tensor peer_base, int x_offset, Tensor? x_local, int slots_offset, "
        "Tensor peer_rank, Tensor peer_token, Tensor peer_k, Tensor expert_offsets, "
        "Tensor num_rows, int topk, Tensor w1, Tensor w2, Tensor(a!) x_rows, Tensor(b!) act, "
        "Tensor(c!)? h, Tensor(d!) y_rows, Tensor(e!) counters, Tensor(f!) watchdog, "
        "int timeout_ms, int rank, int num_comm, int minibatch_rows, bool direct, bool store_y, "
        "int hold_tile, Tensor(g!)? probe=None, bool scatter=True, Tensor? b1=None, "
        "Tensor? b2=None, bool glu=False, float glu_alpha=1.0, float glu_limit=-1.0, "
        "float glu_offset=0.0) -> ()");
  // The backward megakernel (megakernel/backward.cuh): dy_rows = the dy rows of the table
  // (unscaled) and row_w their router weights, then fc2 dgrad with the weight and the
  // SwiGLU backward in its epilogue (d_h from h; dots_part [rows, ceil(I / 256)]: partial
  // <dy, y_row> per column tile; act_scaled = w * SwiGLU(h)) and dx_rows (fc1 dgrad) in one
  // persistent launch. dy_local / topk_w_local at EP = 1, else the peers' arena; scatter:
  // dx rows into the owners' slots (then dx_rows is not written and may be None). With
  // x_rows, dw2, dw1 (phase 2): dw2 = dy_rows^T act_scaled and dw1 = d_h^T x_rows per
  // expert, bf16, or added into fp32 planes (accumulate; reverse*: expert e into plane
  // E - 1 - e). expert_offsets[E] must equal num_rows: the wgrad tiles wait on the row
  // tiles up to it.
  m.def("moe_backward(Tensor peer_base, int dy_offset, int w_offset, Tensor? dy_local, "
        "Tensor? topk_w_local, int topk, Tensor peer_rank, Tensor peer_token, Tensor peer_k, "
        "Tensor expert_offsets, Tensor num_rows, Tensor w1, Tensor w2, Tensor h, "
        "Tensor(a!) dy_rows, Tensor(b!) row_w, Tensor(c!) dots_part, Tensor(d!) act_scaled, "
        "Tensor(e!) d_h, Tensor(f!)? dx_rows, Tensor(g!) counters, Tensor(h!) watchdog, "
        "int timeout_ms, int rank, int minibatch_rows, bool scatter, int slots_offset, "
        "int hold_tile, Tensor? x_rows=None, Tensor(i!)? dw2=None, Tensor(j!)? dw1=None, "
        "bool accumulate=False, bool reverse2=False, bool reverse1=False, bool glu=False, "
        "float glu_alpha=1.0, float glu_limit=-1.0, float glu_offset=0.0) -> ()");
}

TORCH_LIBRARY_IMPL(megatron_mok, CPU, m) {
  m.impl("combine_epilogue", &combine_epilogue_cpu);
}

}  // namespace megatron_mok

// `import megatron_mok._C` runs the static TORCH_LIBRARY registrations above; the
// module itself exports nothing (ops are reached through torch.ops.megatron_mok).
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
