"""Command-line surface: `--moe-token-dispatcher-type mok` and the `--mok-*` knobs.

Megatron-LM builds the choices of `--moe-token-dispatcher-type` from the Literal
type of `TransformerConfig.moe_token_dispatcher_type`, so registering "mok" means
widening that Literal before the parser is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
import warnings

from megatron_mok.config import BACKENDS, FP8_RECIPES, FP8_WGRAD, MAIN_GRAD_FUSION, MoKConfig

DISPATCHER_TYPE = "mok"


def register_mok_dispatcher_type() -> None:
    """Add "mok" to the choices of TransformerConfig.moe_token_dispatcher_type (idempotent)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    field = {f.name: f for f in dataclasses.fields(TransformerConfig)}["moe_token_dispatcher_type"]
    choices = typing.get_args(field.type)
    if DISPATCHER_TYPE in choices:
        return
    widened = typing.Literal[tuple(choices) + (DISPATCHER_TYPE,)]
    field.type = widened
    TransformerConfig.__annotations__["moe_token_dispatcher_type"] = widened


# Knobs MoK (and upstream Megatron-LM's MoK integration) has that the Hopper backend does
# not use: accepted so launch scripts written for them run, with a warning when set.
_UNUSED_ON_HOPPER = (  # (argument, MoKConfig field, why)
    ("mok_bwd_comm_sms", "bwd_num_comm_sms", "the Hopper backward megakernel has no "
     "dedicated comm CTAs (every CTA's producer warps pull dy)"),
    ("mok_macrobatch_size", "macrobatch_size", "the Hopper pass keeps every routed row for "
     "the backward (one pass over a full-size buffer, no ring reuse)"),
)


class _MegakernelBackend(argparse.Action):
    """`--moe-megakernel-backend mok` (upstream Megatron-LM's name for the switch) sets
    `--moe-token-dispatcher-type mok`."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.moe_token_dispatcher_type = DISPATCHER_TYPE


def add_mok_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron `extra_args_provider`: the MoKConfig knobs as `--mok-*` flags. Upstream
    Megatron-LM's MoK names are accepted too: `--moe-megakernel-backend mok` for
    `--moe-token-dispatcher-type mok`, `--mok-fwd-num-comm-sms`, `--mok-bwd-num-comm-sms`,
    `--mok-schedule-capacity-multiplier` (docs/knobs.md)."""
    defaults = MoKConfig()
    group = parser.add_argument_group(title="megatron_mok")
    group.add_argument("--moe-megakernel-backend", choices=(DISPATCHER_TYPE,), default=None,
                       action=_MegakernelBackend,
                       help="Upstream Megatron-LM's spelling of --moe-token-dispatcher-type mok.")
    group.add_argument("--mok-backend", choices=BACKENDS, default=defaults.backend,
                       help="Backend of the fused MoE pass: auto picks the kernel where the "
                            "GPU supports it, else the PyTorch reference.")
    group.add_argument("--mok-fwd-comm-sms", "--mok-fwd-num-comm-sms", type=int,
                       default=defaults.fwd_num_comm_sms,
                       help="SMs running communication CTAs in the forward megakernel's comm "
                            "mode (used when no autotuned plan chooses otherwise).")
    group.add_argument("--mok-bwd-comm-sms", "--mok-bwd-num-comm-sms", type=int,
                       default=defaults.bwd_num_comm_sms,
                       help="Accepted for MoK / upstream Megatron-LM launch scripts; not used "
                            "on Hopper (a warning says so when set).")
    group.add_argument("--mok-minibatch-size", type=int, default=defaults.minibatch_size,
                       help="Rows per readiness counter of the forward megakernel (the "
                            "comm/compute overlap unit; used when no autotuned plan chooses "
                            "otherwise).")
    group.add_argument("--mok-macrobatch-size", type=int, default=defaults.macrobatch_size,
                       help="Accepted for MoK / upstream Megatron-LM launch scripts; not used "
                            "on Hopper (a warning says so when set).")
    group.add_argument("--mok-capacity-multiplier", "--mok-schedule-capacity-multiplier",
                       type=float,
                       default=defaults.schedule_capacity_multiplier,
                       help="Worst-case fraction of all EP routes landing on one rank "
                            "(sizes the row table; overflow raises).")
    group.add_argument("--mok-debug-checks", action="store_true",
                       help="Validate routing eagerly (host sync) on the kernel backend.")
    group.add_argument("--mok-no-autotune", action="store_true",
                       help="Ignore the cached autotune plans (python -m benchmarks.autotune "
                            "fills them); use the defaults instead: the spread forward "
                            "megakernel at EP = 1, the launch chain at EP > 1 and in the "
                            "backward.")
    group.add_argument("--mok-main-grad-fusion", choices=MAIN_GRAD_FUSION,
                       default=defaults.main_grad_fusion,
                       help="Add the expert weight gradients straight into main_grad: auto "
                            "follows --gradient-accumulation-fusion, on whenever DDP gives "
                            "the parameters a main_grad.")
    group.add_argument("--mok-fp8", choices=FP8_RECIPES, default=None,
                       help="Run the routed experts in FP8 with this recipe (blockwise: E4M3, "
                            "1 x 128 / 128 x 128 scales) without Megatron's --fp8-format for "
                            "the rest of the model; the shared expert stays BF16. The "
                            "reference backend runs it at any EP size, the kernel backend "
                            "at EP = 1 with MOK_FP8_KERNELS=1.")
    group.add_argument("--mok-fp8-wgrad", choices=FP8_WGRAD, default=defaults.fp8_wgrad,
                       help="Precision of the FP8 experts' weight-gradient GEMMs.")
    return parser


def mok_config_from_args(args: argparse.Namespace) -> MoKConfig:
    """MoKConfig from parsed `--mok-*` flags (ValueError names the bad knob)."""
    defaults = MoKConfig()
    for name, field, why in _UNUSED_ON_HOPPER:
        if getattr(args, name, getattr(defaults, field)) != getattr(defaults, field):
            warnings.warn(f"megatron_mok: --{name.replace('_', '-')} has no effect: "
                          f"{why}", UserWarning, stacklevel=2)
    return MoKConfig(
        fwd_num_comm_sms=args.mok_fwd_comm_sms,
        bwd_num_comm_sms=args.mok_bwd_comm_sms,
        minibatch_size=args.mok_minibatch_size,
        macrobatch_size=args.mok_macrobatch_size,
        schedule_capacity_multiplier=args.mok_capacity_multiplier,
        backend=args.mok_backend,
        debug_checks=args.mok_debug_checks,
        autotune=not getattr(args, "mok_no_autotune", False),
        main_grad_fusion=getattr(args, "mok_main_grad_fusion", "auto"),
        fp8=getattr(args, "mok_fp8", None),
        fp8_wgrad=getattr(args, "mok_fp8_wgrad", defaults.fp8_wgrad),
    )


def warn_mok_flags_without_mok(args: argparse.Namespace) -> None:
    """--mok-* flags set on a run whose MoE layers use another dispatcher do nothing: say
    so (a --mok-fp8 run that trains in BF16 without a word would mislead)."""
    if getattr(args, "moe_token_dispatcher_type", None) == "mok":
        return
    defaults = vars(add_mok_args(argparse.ArgumentParser()).parse_args([]))
    changed = [name for name, default in defaults.items()
               if getattr(args, name, default) != default]
    if changed:
        flags = ", ".join("--" + name.replace("_", "-") for name in changed)
        warnings.warn(f"megatron_mok: {flags} only apply with --moe-token-dispatcher-type "
                      f"mok (this run uses {getattr(args, 'moe_token_dispatcher_type', None)})",
                      UserWarning, stacklevel=2)
