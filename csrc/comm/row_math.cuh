// Per-vector row arithmetic shared by every row mover (ops.pull_rows in comm/rows.cu and
// the backward megakernel's movers): one definition, so their scaled rows and dots agree
// bit for bit. A uint4 holds 8 bf16.
#pragma once

#include <cuda_bf16.h>

namespace megatron_mok::row_math {

// sum_i a[i] * b[i] over 8 bf16 pairs, fp32 fma in element order.
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b) {
  const __nv_bfloat162* pa = reinterpret_cast<const __nv_bfloat162*>(&a);
  const __nv_bfloat162* pb = reinterpret_cast<const __nv_bfloat162*>(&b);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 fa = __bfloat1622float2(pa[i]), fb = __bfloat1622float2(pb[i]);
    s = __fmaf_rn(fa.x, fb.x, s);
    s = __fmaf_rn(fa.y, fb.y, s);
  }
  return s;
}

// bf16 x fp32 weight, rounded to bf16.
__device__ __forceinline__ uint4 scale8(const uint4& a, float w) {
  uint4 out;
  const __nv_bfloat162* pa = reinterpret_cast<const __nv_bfloat162*>(&a);
  __nv_bfloat162* po = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pa[i]);
    po[i] = __floats2bfloat162_rn(f.x * w, f.y * w);
  }
  return out;
}

}  // namespace megatron_mok::row_math
