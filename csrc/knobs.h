// The C++ launchers' knobs (megatron_mok/knobs.py reads and validates the MOK_* environment
// once and hands them over through the set_knobs op): no getenv per launch.
#pragma once

namespace megatron_mok {
namespace knobs {

enum GatherMode : int { kGatherLines = 0, kGatherTma = 1, kGatherRows = 2 };

struct Knobs {
  bool static_scheduler = false;  // MOK_GEMM_SCHEDULER=static (else the task counter)
  int cluster = 1;                // MOK_GEMM_CLUSTER: 1 or 2
  bool pingpong = false;          // MOK_GEMM_PINGPONG=1
  bool dgrad_h_global = false;    // MOK_DGRAD_H=global (else through the operand ring)
  int gather = kGatherLines;      // MOK_MEGAKERNEL_GATHER
  int mover_warps = 8;            // MOK_MOVER_WARPS: 1, 2, 4 or 8
  bool fp8_overlap_promotion = false;  // MOK_FP8_PROMOTION=overlap (else serial)
};

const Knobs& current();

}  // namespace knobs
}  // namespace megatron_mok
