// The standalone grouped-GEMM launch of the core (TMA descriptors, grid, cluster and
// scheduler knobs), shared by the ops of grouped_gemm.cu (SwiGLU experts, fc2, wgrad) and
// grouped_act.cu (non-gated experts); launch_persistent (grid, clusters, task counter) also
// launches the FP8 kernels (fp8_gemm.cu).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include "gemm/grouped_gemm.cuh"
#include "gemm/host.cuh"
#include "gemm/pingpong.cuh"
#include "knobs.h"

namespace megatron_mok::gemm_host {

using gemm::Epi;
using gemm::GemmConfig;
using gemm::Grouping;

// MOK_GEMM_SCHEDULER=static: CTA b takes tasks b, b + grid, ...; otherwise (default) tasks
// come from a global counter zeroed before each launch (single-CTA clusters only).
inline bool counter_scheduler() { return !knobs::current().static_scheduler; }

inline int cluster_size() { return knobs::current().cluster; }

// MOK_GEMM_PINGPONG=1: fc2 / the dgrads on the ping-pong kernel (core v6, opt-in).
inline bool pingpong() { return knobs::current().pingpong; }

// MOK_DGRAD_H=global: the dgrad + SwiGLU-backward epilogue reads h from global memory (the
// core before v5); otherwise the producer loads it through the operand ring.
inline bool h_through_ring() { return !knobs::current().dgrad_h_global; }

// Calls f(Cfg<1>{}) or f(Cfg<2>{}) by the cluster size.
template <template <int> class Cfg, class F>
void with_cluster(F&& f) {
  if (cluster_size() == 2) f(Cfg<2>{}); else f(Cfg<1>{});
}

// Launches a persistent kernel of tile configuration Cfg: a cluster of Cfg::kCluster CTAs
// per SM slot up to the task count (max_ctas > 0 caps the CTAs), the task counter zeroed for
// this launch (clusters of 1 with the counter scheduler). max_clusters: the caller's cache of
// the clusters that fit (0: not yet queried). The kernel's arguments are p, then rest.
template <class Cfg, class Kernel, class... Rest>
void launch_persistent(Kernel kernel, int& max_clusters, gemm::GemmParams p, const at::Tensor& like,
                       int64_t max_ctas, const Rest&... rest) {
  constexpr int C = Cfg::kCluster;
  cudaLaunchConfig_t config = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = C;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.blockDim = dim3(Cfg::kThreads);
  config.dynamicSmemBytes = Cfg::kSmemBytes;
  config.stream = at::cuda::getCurrentCUDAStream();
  config.attrs = attr;
  config.numAttrs = C == 1 ? 0 : 1;  // C = 1 launches as a plain grid
  // Per call: the attribute is per device and cheap to set.
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      Cfg::kSmemBytes));
  if (max_clusters == 0) {
    if constexpr (C == 1) {
      max_clusters = num_sms(like.get_device());
    } else {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
      config.gridDim = dim3(num_sms(like.get_device()) / C * C);
      C10_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&max_clusters, kernel, &config));
      TORCH_CHECK(max_clusters > 0, "megatron_mok: no cluster of ", C, " CTAs fits this GPU");
    }
  }
  at::Tensor counter;  // lives until the launch is queued; the allocator orders its reuse
  if (C == 1 && counter_scheduler()) {
    counter = at::zeros({1}, like.options().dtype(at::kInt));
    p.task_counter = counter.data_ptr<int>();
  }
  int clusters = std::min(max_clusters, p.num_tasks);
  if (max_ctas > 0) clusters = std::min<int>(clusters, std::max<int>(1, int(max_ctas) / C));
  config.gridDim = dim3(clusters * C);
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p, rest...));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// out: the output (kRows: rows x N; kTokensAsK: M x N x E); h: the SwiGLU pre-activations
// as (rows, I, 2) when stored, else the same view as out (unused).
// h_in (kHRing): the SwiGLU pre-activations [rows, 2I] that the epilogue reads through the
// operand ring.
template <class Cfg, bool kReduce = false, bool kHRing = false, bool kPingPong = false>
void launch(GemmParams p, const at::Tensor& a, typename Cfg::StrideA stride_a, int a_rows,
            int a_cols, const at::Tensor& b, typename Cfg::StrideB stride_b, int b_n, int b_k,
            int b_q, const OutView& out, const OutView& h, int64_t max_ctas,
            const at::Tensor* h_in = nullptr) {
  constexpr int C = Cfg::kCluster;
  if (p.num_tasks <= 0 || p.n_tiles <= 0) return;
  // Tasks are groups of C neighbouring row tiles (one per CTA of a cluster).
  const int m_groups = (p.m_tiles + C - 1) / C;
  p.num_tasks = (p.num_tasks / p.m_tiles) * m_groups;
  make_context_current(a);
  auto tma_a = make_load_a<Cfg>(a, stride_a, a_rows, a_cols);
  auto tma_b = make_load_b<Cfg>(b, stride_b, b_n, b_k, b_q);
  auto tma_b_mc = [&] {
    if constexpr (C == 1) {
      return tma_b;
    } else {
      auto mB = make_tensor(make_gmem_ptr(as_bf16(b)), make_shape(b_n, b_k, b_q), stride_b);
      return make_tma_atom(SM90_TMA_LOAD_MULTICAST{}, mB, typename Cfg::SmemLayoutBBox{}(_, _, 0),
                           Shape<Int<Cfg::BN / Cfg::kSplit>, Int<Cfg::BK>>{}, Int<C>{});
    }
  }();
  auto tma_o = make_store_atom<Cfg, kReduce>(out);
  auto tma_h = make_store_atom<Cfg, kReduce>(h);
  auto tma_h_in = [&] {
    if constexpr (kHRing) {
      return make_load_h<Cfg>(*h_in);
    } else {
      return tma_a;  // unused
    }
  }();
  auto kernel = [] {
    if constexpr (kPingPong) {
      return &gemm::grouped_gemm_pingpong_kernel<Cfg, kHRing, decltype(tma_a), decltype(tma_b),
                                                 decltype(tma_b_mc), decltype(tma_o),
                                                 decltype(tma_h_in)>;
    } else {
      return &gemm::grouped_gemm_kernel<Cfg, kHRing, decltype(tma_a), decltype(tma_b),
                                        decltype(tma_b_mc), decltype(tma_o), decltype(tma_h_in)>;
    }
  }();
  static int max_clusters_per_device[64] = {0};  // per instantiation and device
  const gemm::OperandShapes shapes{a_rows, a_cols, b_n, b_k, b_q};
  launch_persistent<Cfg>(kernel, max_clusters_per_device[a.get_device()], p, a, max_ctas, tma_a, tma_b, tma_b_mc, tma_o,
                         tma_h, tma_h_in, shapes);
}

}  // namespace megatron_mok::gemm_host
