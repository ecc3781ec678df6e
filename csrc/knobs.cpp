// Storage of the launchers' knobs and the set_knobs op that fills it (knobs.h).

#include "knobs.h"

#include <c10/util/Exception.h>
#include <torch/library.h>

namespace megatron_mok {
namespace knobs {
namespace {

Knobs g_knobs;

void set_knobs(bool static_scheduler, int64_t cluster, bool pingpong, bool dgrad_h_global,
               int64_t gather, int64_t mover_warps, bool fp8_overlap_promotion) {
  TORCH_CHECK_VALUE(cluster == 1 || cluster == 2,
                    "megatron_mok: MOK_GEMM_CLUSTER must be 1 or 2, got ", cluster);
  TORCH_CHECK_VALUE(gather >= kGatherLines && gather <= kGatherRows,
                    "megatron_mok: MOK_MEGAKERNEL_GATHER must be lines, tma or rows");
  TORCH_CHECK_VALUE(mover_warps == 1 || mover_warps == 2 || mover_warps == 4 || mover_warps == 8,
                    "megatron_mok: MOK_MOVER_WARPS must be 1, 2, 4 or 8, got ", mover_warps);
  g_knobs = Knobs{static_scheduler, int(cluster), pingpong, dgrad_h_global, int(gather),
                  int(mover_warps), fp8_overlap_promotion};
}

}  // namespace

const Knobs& current() { return g_knobs; }

}  // namespace knobs

TORCH_LIBRARY_FRAGMENT(megatron_mok, m) {
  m.def("set_knobs(bool static_scheduler, int cluster, bool pingpong, bool dgrad_h_global, "
        "int gather, int mover_warps, bool fp8_overlap_promotion) -> ()",
        &knobs::set_knobs);
}

}  // namespace megatron_mok
