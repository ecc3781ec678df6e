"""Layer specs with MokMoELayer in place of Megatron's MoELayer.

Megatron's own spec builders stay the source of truth (attention, norms, dense
layers, expert and shared-expert modules); these helpers only swap the MoE layer
class, keeping its submodules, so parameter names and layouts are unchanged.
"""

from __future__ import annotations

import functools
from typing import Optional

from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_mok.config import MoKConfig
from megatron_mok.megatron.layer import MokMoELayer


def _swap_mlp(mlp, mok_config: MoKConfig):
    """An MoELayer builder (partial or ModuleSpec) -> the same with MokMoELayer."""
    if isinstance(mlp, functools.partial) and isinstance(mlp.func, type) and \
            issubclass(mlp.func, MoELayer):
        return functools.partial(MokMoELayer, *mlp.args, **{**mlp.keywords,
                                                              "mok_config": mok_config})
    module = getattr(mlp, "module", None)
    if isinstance(module, type) and issubclass(module, MoELayer):  # a ModuleSpec
        params = dict(getattr(mlp, "params", None) or {})
        params["mok_config"] = mok_config
        return type(mlp)(module=MokMoELayer, submodules=mlp.submodules, params=params)
    return mlp


def swap_moe_layers(spec, mok_config: Optional[MoKConfig] = None):
    """Swap the MoE layers of a transformer-layer spec or a block spec (in place; returned)."""
    mok_config = mok_config or MoKConfig()
    layer_specs = getattr(spec, "layer_specs", None)
    for layer_spec in (layer_specs if layer_specs is not None else [spec]):
        submodules = getattr(layer_spec, "submodules", None)
        if submodules is not None and hasattr(submodules, "mlp"):
            submodules.mlp = _swap_mlp(submodules.mlp, mok_config)
    return spec


def gpt_decoder_block_spec(config, use_transformer_engine: bool,
                           mok_config: Optional[MoKConfig] = None, **kwargs):
    """get_gpt_decoder_block_spec with MokMoELayer for every MoE layer."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_transformer_engine,
                                      **kwargs)
    return swap_moe_layers(spec, mok_config)


def gpt_layer_local_spec_with_mok(num_experts: int, mok_config: Optional[MoKConfig] = None,
                                  **kwargs):
    """get_gpt_layer_local_spec (no Transformer Engine) with MokMoELayer."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=True, **kwargs)
    return swap_moe_layers(spec, mok_config)


def gpt_layer_te_spec_with_mok(num_experts: int, mok_config: Optional[MoKConfig] = None,
                               **kwargs):
    """get_gpt_layer_with_transformer_engine_spec with MokMoELayer."""
    from megatron.core.models.gpt.gpt_layer_specs import \
        get_gpt_layer_with_transformer_engine_spec

    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts,
                                                      moe_grouped_gemm=True, **kwargs)
    return swap_moe_layers(spec, mok_config)
