"""GPT pretraining on megatron-core's `megatron.training.pretrain`, with the MoK MoE layer.

    python -m megatron_mok.pretrain_gpt <Megatron-LM pretrain_gpt flags>
    torchrun --nproc-per-node N -m megatron_mok.pretrain_gpt <flags>

Takes Megatron-LM's GPT pretraining flags unchanged, plus `--moe-token-dispatcher-type mok`
and the `--mok-*` knobs. Mock data works with `--mock-data --tokenizer-type NullTokenizer
--vocab-size N`. On a machine without CUDA it applies `megatron_mok.megatron.cpu_shims`
and trains on the CPU with gloo. Besides Megatron's own logs it prints one line per step:

    [megatron_mok] step 3/20 | lm loss 10.374512 | 412.3 ms | 4967 tokens/s

and on a GPU also `| 123.4 TFLOP/s/GPU | peak 12.34 GiB` (Megatron's FLOP count of the
batch per GPU, torch's peak allocated memory of this rank).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import time
import warnings

STEP_LINE_PREFIX = "[megatron_mok] step"


# --------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------

def _has_flag(argv, *flags):
    return any(a == f or a.startswith(f + "=") for a in argv for f in flags)


def _default_flags(argv, on_cpu):
    """Flags Megatron needs in this environment, appended only when the user gave none.

    On a CPU, and on a GPU without Transformer Engine / apex, the fused kernels that
    Megatron enables by default do not exist, so they are switched off.
    """
    te = _importable("transformer_engine.pytorch")
    wanted = [
        # Megatron defaults to transformer_engine; without TE use the local (non-TE) spec.
        (not te, "--transformer-impl", ["local"]),
        # TransformerConfig refuses the (default) fused RoPE without TE.
        (not te, "--no-rope-fusion", []),
        # Its None default crashes the loop (train_iters // eval_interval), CPU or GPU.
        (True, "--eval-interval", [str(10 ** 9)]),
        # NCCL refuses to start without GPUs.
        (on_cpu, "--distributed-backend", ["gloo"]),
        # The persistent fused LayerNorm is apex's; torch's norm asserts it is off.
        (on_cpu or not _importable("apex"), "--no-persist-layer-norm", []),
        # Fused wgrad accumulation needs apex's fused_weight_gradient_mlp_cuda or TE.
        (on_cpu or not (te or _importable("fused_weight_gradient_mlp_cuda")),
         "--no-gradient-accumulation-fusion", []),
        # The fused masked softmax needs apex's scaled_masked_softmax_cuda or TE.
        (on_cpu or not (te or _importable("scaled_masked_softmax_cuda")),
         "--no-masked-softmax-fusion", []),
    ]
    extra = []
    for needed, flag, values in wanted:
        if needed and not _has_flag(argv, flag):
            extra += [flag] + values
    return list(argv) + extra


def _importable(module):
    try:
        __import__(module)
        return True
    except Exception:
        return False


def _te_importable():
    return _importable("transformer_engine.pytorch")


def _skip_helpers_make_if_prebuilt():
    """The wheel ships helpers_cpp built but no Makefile: skip `make` when it imports."""
    try:
        import megatron.core.datasets.helpers_cpp  # noqa: F401
    except ImportError:
        return
    import megatron.core.datasets.utils as dataset_utils
    dataset_utils.compile_helpers = lambda: None


# --------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------

def _call_with_accepted(fn, *args, **kwargs):
    """fn(*args, **kwargs) minus the keyword arguments fn does not take."""
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """GPTModel, with the MoK MoE layer when `--moe-token-dispatcher-type mok`."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.training import get_args, print_rank_0
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine" and _te_importable()
    print_rank_0(f"building GPT model ({'TE' if use_te else 'local'} spec, "
                 f"dispatcher {args.moe_token_dispatcher_type}) ...")

    if args.num_experts is not None and args.moe_token_dispatcher_type == "mok":
        from megatron_mok.megatron.args import mok_config_from_args
        from megatron_mok.megatron.spec import gpt_decoder_block_spec  # lands separately

        layer_spec = _call_with_accepted(
            gpt_decoder_block_spec, config, use_te, mok_config_from_args(args),
            normalization=args.normalization, qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
    elif args.num_experts is not None:
        from megatron_mok.megatron.args import warn_mok_flags_without_mok
        warn_mok_flags_without_mok(args)
        layer_spec = gpt_layer_specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization=args.normalization,
            qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
    elif use_te:
        layer_spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            None, False, args.qk_layernorm, args.multi_latent_attention, qk_l2_norm=args.qk_l2_norm)
    else:
        layer_spec = gpt_layer_specs.get_gpt_layer_local_spec(
            None, False, args.qk_layernorm, args.multi_latent_attention,
            normalization=args.normalization, qk_l2_norm=args.qk_l2_norm)

    mtp_block_spec = None
    if args.mtp_num_layers is not None:
        last = layer_spec.layer_specs[-1] if hasattr(layer_spec, "layer_specs") else layer_spec
        mtp_block_spec = gpt_layer_specs.get_gpt_mtp_block_spec(
            config, last, use_transformer_engine=use_te, vp_stage=vp_stage)

    return GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        rope_scaling=args.use_rope_scaling,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        mtp_block_spec=mtp_block_spec,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


# --------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------

def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    """GPT datasets (MockGPTDataset with `--mock-data`) built on TP rank 0."""
    from megatron.core import mpu
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer, print_rank_0
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        object_storage_cache_path=args.object_storage_cache_path,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building train, validation, and test datasets ({dataset_type.__name__}) ...")
    train_ds, valid_ds, test_ds = BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples,
        lambda: mpu.get_tensor_model_parallel_rank() == 0, config,
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return train_ds, valid_ds, test_ds


train_valid_test_datasets_provider.is_distributed = True  # the builder decides per rank


_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def _device():
    import torch
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def get_batch(data_iterator, vp_stage=None):
    """The micro-batch of this rank: loaded on TP rank 0, broadcast over TP, sliced for CP."""
    import torch
    from megatron.core import mpu
    from megatron.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage
    from megatron.core.utils import get_batch_on_this_cp_rank
    from megatron.training import get_args

    args = get_args()
    pp_group = mpu.get_pipeline_model_parallel_group()
    first = is_pp_first_stage(pp_group) and (vp_stage is None or vp_stage == 0)
    last = is_pp_last_stage(pp_group) and (
        vp_stage is None or vp_stage == (args.virtual_pipeline_model_parallel_size or 1) - 1)
    if not (first or last) and args.mtp_num_layers is None:
        return {k: None for k in _BATCH_KEYS}

    dev = _device()
    tp_group = mpu.get_tensor_model_parallel_group()
    if mpu.get_tensor_model_parallel_rank() == 0:
        raw = next(data_iterator)
        batch = {k: (raw[k].to(dev, non_blocking=True) if raw.get(k) is not None else None)
                 for k in _BATCH_KEYS}
    else:
        b, s = args.micro_batch_size, args.seq_length
        batch = {
            "tokens": torch.empty(b, s, dtype=torch.int64, device=dev),
            "labels": torch.empty(b, s, dtype=torch.int64, device=dev),
            "loss_mask": torch.empty(b, s, dtype=torch.float32, device=dev),
            "attention_mask": (torch.empty(b, 1, s, s, dtype=torch.bool, device=dev)
                               if args.create_attention_mask_in_dataloader else None),
            "position_ids": torch.empty(b, s, dtype=torch.int64, device=dev),
        }
    if mpu.get_tensor_model_parallel_world_size() > 1:
        src = mpu.get_tensor_model_parallel_src_rank()
        for k in _BATCH_KEYS:
            if batch[k] is not None:
                torch.distributed.broadcast(batch[k], src, group=tp_group)
    if args.context_parallel_size > 1:
        batch["cu_seqlens"] = None
        batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                          cp_group=mpu.get_context_parallel_group())
    return batch


def loss_func(loss_mask, output_tensor):
    """Sum of masked per-token losses and the token count (Megatron averages per token)."""
    import torch
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.view(1).float()])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator, model):
    """One micro-batch forward: (per-token losses, loss function)."""
    from megatron.training import get_timers

    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    batch = get_batch(data_iterator, getattr(model, "vp_stage", None))
    timers("batch-generator").stop()
    output_tensor = model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                          labels=batch["labels"])
    return output_tensor, functools.partial(loss_func, batch["loss_mask"])


# --------------------------------------------------------------------------------------
# per-step line
# --------------------------------------------------------------------------------------

def _model_flops(mt_training, margs, global_batch: int):
    """Megatron's own FLOP count of one global batch (what its throughput log uses), or
    None where this Megatron has none for the config."""
    count = getattr(mt_training, "num_floating_point_operations", None)
    try:
        return float(count(margs, global_batch)) if count else None
    except Exception:  # a config its formula does not cover: no MFU, the step still logs
        return None


def _install_step_logger():
    """Wrap megatron.training.training.train_step: time each step, print loss and tokens/s."""
    import torch
    import megatron.training.training as mt_training
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size
    from megatron.training import get_args

    if getattr(mt_training.train_step, "_mok_step_logger", False):
        return
    train_step = mt_training.train_step

    @functools.wraps(train_step)
    def timed_train_step(*args, **kwargs):
        margs = get_args()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = train_step(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        loss_dict = out[0]
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        if rank == world - 1 and loss_dict:  # the last rank is on the last pipeline stage
            step = (kwargs.get("iteration") or 0) + 1
            tokens = get_current_global_batch_size() * margs.seq_length
            loss = loss_dict.get("lm loss")
            loss = float(loss) if loss is not None else float("nan")
            line = (f"{STEP_LINE_PREFIX} {step}/{margs.train_iters} | lm loss {loss:.6f} | "
                    f"{1000.0 * elapsed:.1f} ms | {tokens / elapsed:.0f} tokens/s")
            if torch.cuda.is_available():  # what MFU and memory tables need, per GPU
                flops = _model_flops(mt_training, margs, get_current_global_batch_size())
                if flops:
                    line += f" | {flops / elapsed / world / 1e12:.1f} TFLOP/s/GPU"
                line += f" | peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
            print(line, flush=True)
        return out

    timed_train_step._mok_step_logger = True
    mt_training.train_step = timed_train_step


# --------------------------------------------------------------------------------------

def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)

    import torch

    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        from megatron_mok.megatron.cpu_shims import apply_cpu_shims
        apply_cpu_shims()
        if "TORCH_COMPILE_DISABLE" not in os.environ:
            # Megatron's torch.compile'd fusions cost more to compile than they save on a CPU.
            import torch._dynamo
            torch._dynamo.config.disable = True
    argv = _default_flags(argv, on_cpu)
    _skip_helpers_make_if_prebuilt()

    from megatron_mok.megatron.args import add_mok_args, register_mok_dispatcher_type
    register_mok_dispatcher_type()  # before the parser reads TransformerConfig's Literal

    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    sys.argv = [sys.argv[0]] + argv
    args = parse_and_validate_args(extra_args_provider=add_mok_args)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"(?s).*recommended to use a ModelConfig")
        cfg = pretrain_cfg_container_from_args(args)

    _install_step_logger()
    pretrain(cfg, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step,
             model_provider=model_provider)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # NCCL warns about a leak otherwise


if __name__ == "__main__":
    main()
