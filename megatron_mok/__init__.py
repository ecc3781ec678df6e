"""megatron_mok: a fused MoE layer (dispatch + expert SwiGLU MLPs + combine) for Megatron-Core.

The package layers, bottom up:
  reference.py   the spec in pure PyTorch (CPU and GPU, autograd, EP over torch.distributed)
  mxfp8.py       MXFP8 quantise / dequantise
  config.py      MoKConfig, the tuning knobs
  workspace.py   per-(group, shape) buffers, cached
  schedule.py    routing -> row table, sync-free
  functional.py  MoK-shaped API: forward / backward / recompute + autograd Function
  ops.py         torch.library ops of the compiled extension (megatron_mok._C)
  megatron/      the Megatron-Core plugin (`--moe-token-dispatcher-type mok`)
"""

__version__ = "0.1.0"

from megatron_mok.config import MoKConfig  # noqa: E402,F401
