// Argument checks shared by the CPU and CUDA combine epilogue.
#pragma once

#include <ATen/ATen.h>
#include <optional>

namespace megatron_mok {

inline void check_combine_epilogue_args(const at::Tensor& slots, const at::Tensor& topk_idx,
                                        const at::Tensor& topk_w,
                                        const std::optional<at::Tensor>& shared,
                                        c10::DeviceType device) {
  TORCH_CHECK_VALUE(slots.dim() == 3, "slots must be [T, K, H], got ", slots.sizes());
  TORCH_CHECK_TYPE(slots.scalar_type() == at::kBFloat16 || slots.scalar_type() == at::kFloat,
                   "slots must be bf16 or fp32, got ", slots.scalar_type());
  TORCH_CHECK_VALUE(topk_idx.sizes() == slots.sizes().slice(0, 2) &&
                        topk_w.sizes() == slots.sizes().slice(0, 2),
                    "topk_idx and topk_w must be [T, K] = ", slots.sizes().slice(0, 2));
  TORCH_CHECK_TYPE(topk_w.scalar_type() == at::kFloat, "topk_w must be fp32");
  TORCH_CHECK_TYPE(topk_idx.scalar_type() == at::kInt || topk_idx.scalar_type() == at::kLong,
                   "topk_idx must be int32 or int64");
  TORCH_CHECK_VALUE(slots.is_contiguous() && topk_idx.is_contiguous() && topk_w.is_contiguous(),
                    "slots, topk_idx and topk_w must be contiguous");
  TORCH_CHECK_VALUE(slots.device().type() == device && topk_idx.device() == slots.device() &&
                        topk_w.device() == slots.device(),
                    "slots, topk_idx and topk_w must be on one ", c10::DeviceTypeName(device),
                    " device");
  if (shared.has_value()) {
    TORCH_CHECK_VALUE(shared->dim() == 2 && shared->size(0) == slots.size(0) &&
                          shared->size(1) == slots.size(2) && shared->is_contiguous(),
                      "shared must be a contiguous [T, H] tensor");
    TORCH_CHECK_TYPE(shared->scalar_type() == slots.scalar_type(), "shared must match slots' dtype");
    TORCH_CHECK_VALUE(shared->device() == slots.device(), "shared must be on slots' device");
  }
}

}  // namespace megatron_mok
