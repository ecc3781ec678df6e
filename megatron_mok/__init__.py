"""megatron_mok: a fused MoE layer (dispatch + expert SwiGLU MLPs + combine) for Megatron-Core.

Four rooms (docs/architecture.md), bottom up:
  the spec        reference.py (the function, pure PyTorch, EP over torch.distributed),
                  activations.py, fp8_formats.py (blockwise for Hopper, MXFP8 for Blackwell),
                  validation.py, config.py (MoKConfig), knobs.py, routing_errors.py
  functional API  functional.py (MoK-shaped forward / backward / recompute, autograd),
                  workspace.py, schedule.py, backend_choice.py, grad_accumulation.py,
                  shared_fold.py
  kernel backend  kernels/ (the compiled Hopper pass: ops, grouped GEMM, megakernels,
                  launch chain, autotuned plans)
  Megatron        megatron/ (`--moe-token-dispatcher-type mok`), pretrain_gpt.py
"""

__version__ = "0.1.0"

from megatron_mok.config import MoKConfig  # noqa: E402,F401
