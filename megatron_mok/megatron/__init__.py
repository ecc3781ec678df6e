"""Megatron-Core plugin: `--moe-token-dispatcher-type mok`.

    from megatron_mok.megatron import register, gpt_decoder_block_spec
    register()                      # before Megatron-LM parses its arguments
    spec = gpt_decoder_block_spec(config, use_transformer_engine=False, mok_config=MoKConfig())

Importing this package widens the dispatcher-type Literal, so `mok` parses in any
Megatron-LM launch script that imports it; `python -m megatron_mok.pretrain_gpt` is
a ready launcher.
"""

from megatron_mok.megatron.args import (  # noqa: F401
    add_mok_args, mok_config_from_args, register_mok_dispatcher_type)

register = register_mok_dispatcher_type
register()

from megatron_mok.megatron.dispatcher import MokTokenDispatcher, routing_to_topk  # noqa: E402,F401
from megatron_mok.megatron.layer import MokMoELayer, check_mok_supported  # noqa: E402,F401
from megatron_mok.megatron.spec import (  # noqa: E402,F401
    gpt_decoder_block_spec, gpt_layer_local_spec_with_mok, gpt_layer_te_spec_with_mok,
    swap_moe_layers)
