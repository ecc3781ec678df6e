"""MokMoELayer: Megatron's MoELayer with dispatch -> experts -> combine as one fused pass.

Router, aux losses, shared experts (unless MOK_SHARED_EXPERT=folded runs one of the routed
experts' width inside the fused pass) and recompute are MoELayer's own. The experts
module is the one Megatron's spec builds (SequentialMLP or TEGroupedMLP), kept for
its parameters only, so checkpoints move between `alltoall`/`flex` and `mok` both
ways; their data is laid back to back per weight (expert_weights) so that the fused
pass reads them stacked without copying them every forward (a warning says so once if
something re-homes them and the pass copies again). Under Megatron's DDP the experts'
weight gradients go straight into their `main_grad` (gradient-accumulation fusion,
MoKConfig.main_grad_fusion). Every configuration the fused pass does not implement fails
here, naming the flag; nothing falls back silently.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Optional

import torch

from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron.core.utils import log_single_rank

from megatron_mok import routing_errors, shared_fold
from megatron_mok.activations import from_megatron
from megatron_mok.config import MoKConfig
from megatron_mok.functional import fused_moe, resolve_backend
from megatron_mok.grad_accumulation import ExpertGradAccumulator
from megatron_mok.kernels import fp8_weight_cache
from megatron_mok.megatron.dispatcher import MokTokenDispatcher
from megatron_mok.megatron.expert_weights import (reverse_local_experts, share_one_storage,
                                                  stack_experts)
from megatron_mok.validation import check_fp8_pass

logger = logging.getLogger(__name__)

# (config attribute, unsupported when, what is not supported, what to pass instead)
_UNSUPPORTED = (
    ("expert_tensor_parallel_size", lambda v: (v or 1) > 1,
     "--expert-tensor-parallel-size > 1 (expert TP)", "--expert-tensor-parallel-size 1"),
    ("moe_latent_size", bool, "--moe-latent-size (latent MoE)",
     "no --moe-latent-size, or another dispatcher (--moe-token-dispatcher-type alltoall)"),
    ("moe_mlp_glu_interleave_size", bool,
     "--moe-mlp-glu-interleave-size (gate/up rows interleaved in fc1)",
     "no --moe-mlp-glu-interleave-size (mok reads fc1 as [gate; up])"),
    ("moe_apply_probs_on_input", bool, "--moe-apply-probs-on-input",
     "no --moe-apply-probs-on-input (mok applies the router weights in its combine)"),
    ("moe_pad_expert_input_to_capacity", bool, "--moe-pad-expert-input-to-capacity",
     "no --moe-pad-expert-input-to-capacity (mok pads per expert itself)"),
    ("moe_shared_expert_overlap", bool, "--moe-shared-expert-overlap",
     "no --moe-shared-expert-overlap (MOK_SHARED_EXPERT=folded runs it inside the pass)"),
    ("overlap_moe_expert_parallel_comm", bool, "--overlap-moe-expert-parallel-comm",
     "no --overlap-moe-expert-parallel-comm (the fused pass overlaps its own NVLink traffic)"),
    ("overlap_dispatch_backward_with_experts_wgrad", bool,
     "--overlap-dispatch-backward-with-experts-wgrad",
     "no --overlap-dispatch-backward-with-experts-wgrad"),
    ("delay_wgrad_compute", bool, "--delay-wgrad-compute", "no --delay-wgrad-compute"),
    ("fp4", bool, "--fp4-format (FP4 training)", "no --fp4-format"),
    ("fp8_param", bool, "--fp8-param-gather (FP8 weight copies)",
     "no --fp8-param-gather (the fused pass quantises its BF16 weights itself)"),
)


def _check_fp8(config) -> Optional[str]:
    """The MoE layers' FP8 recipe from Megatron's --fp8-format / --fp8-recipe: None (BF16)
    or "blockwise". FP8 on Hopper means the blockwise recipe (E4M3, 1 x 128 / 128 x 128
    FP32 scales): MXFP8 has no Hopper hardware path and tensorwise / delayed scaling are
    not MoK's recipes. (So far it runs on the reference backend: no FP8 kernels yet.)"""
    fmt = getattr(config, "fp8", None)
    if not fmt:
        return None
    recipe = getattr(config, "fp8_recipe", None)
    if recipe != "blockwise":
        raise ValueError(f"--moe-token-dispatcher-type mok does not support --fp8-recipe "
                         f"{recipe}: on Hopper the FP8 recipe is blockwise (1 x 128 "
                         f"activations, 128 x 128 weights; MXFP8 is Blackwell's); pass "
                         f"--fp8-recipe blockwise, or no --fp8-format for BF16")
    if fmt != "e4m3":
        raise ValueError(f"--moe-token-dispatcher-type mok does not support --fp8-format {fmt} "
                         f"with the blockwise recipe (it quantises activations, weights and "
                         f"gradients in E4M3, as DeepSeek-V3); pass --fp8-format e4m3")
    return "blockwise"


def check_mok_supported(config) -> None:
    """Raise ValueError naming the first flag the fused pass does not support."""
    _check_fp8(config)
    for attr, unsupported, what, instead in _UNSUPPORTED:
        if unsupported(getattr(config, attr, None)):
            raise ValueError(f"--moe-token-dispatcher-type mok does not support {what}; "
                             f"pass {instead}")
    from_megatron(config)  # raises, naming the flag, for an activation the spec lacks


def expert_weight_list(experts) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-expert fc1 ([2I, H] gated, [I, H] non-gated) and fc2 [H, I] weights of Megatron's
    expert modules."""
    if hasattr(experts, "local_experts"):  # SequentialMLP
        return ([e.linear_fc1.weight for e in experts.local_experts],
                [e.linear_fc2.weight for e in experts.local_experts])
    fc1, fc2 = getattr(experts, "linear_fc1", None), getattr(experts, "linear_fc2", None)
    n = getattr(experts, "num_local_experts", 0)
    if fc1 is not None and all(hasattr(fc1, f"weight{i}") for i in range(n)):  # TEGroupedMLP
        return ([getattr(fc1, f"weight{i}") for i in range(n)],
                [getattr(fc2, f"weight{i}") for i in range(n)])
    raise ValueError(f"--moe-token-dispatcher-type mok cannot read the weights of expert module "
                     f"{type(experts).__name__}")


def expert_bias_list(experts) -> Optional[tuple[list[torch.Tensor], list[torch.Tensor]]]:
    """Per-expert fc1 ([2I] gated, [I] non-gated) and fc2 [H] biases (--add-bias-linear), or
    None without them."""
    if hasattr(experts, "local_experts"):  # SequentialMLP
        fc1 = [e.linear_fc1.bias for e in experts.local_experts]
        fc2 = [e.linear_fc2.bias for e in experts.local_experts]
    else:  # TEGroupedMLP
        n = experts.num_local_experts
        fc1 = [getattr(experts.linear_fc1, f"bias{i}", None) for i in range(n)]
        fc2 = [getattr(experts.linear_fc2, f"bias{i}", None) for i in range(n)]
    # TE's GroupedLinear without biases holds empty tensors in bias{i}: no bias either.
    fc1 = [None if b is None or b.numel() == 0 else b for b in fc1]
    fc2 = [None if b is None or b.numel() == 0 else b for b in fc2]
    if all(b is None for b in (*fc1, *fc2)):
        return None
    if any(b is None for b in (*fc1, *fc2)):
        raise ValueError("--moe-token-dispatcher-type mok needs both expert biases (fc1 and "
                         "fc2) or neither; pass --add-bias-linear or --disable-bias-linear")
    return fc1, fc2


class MokMoELayer(MoELayer):
    """MoELayer whose routed experts run as one fused dispatch + SwiGLU + combine pass."""

    def __init__(self, config, submodules=None, layer_number: Optional[int] = None,
                 pg_collection=None, is_mtp_layer: bool = False, name: Optional[str] = None,
                 mok_config: Optional[MoKConfig] = None):
        check_mok_supported(config)
        pg_collection = pg_collection or get_default_pg_collection()
        # For "mok" MoELayer would build the unfused contract-mode dispatcher (and warn);
        # have it build a cheap one, then swap in the fused one.
        dispatcher_type = config.moe_token_dispatcher_type
        config.moe_token_dispatcher_type = "allgather"
        try:
            super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                             pg_collection=pg_collection, is_mtp_layer=is_mtp_layer, name=name)
        finally:
            config.moe_token_dispatcher_type = dispatcher_type
        # The experts' activation from Megatron's flags: GLUs of silu or quick_gelu (SwiGLU,
        # GPT-OSS's clamped GLU with its linear offset) and non-gated experts (squared-ReLU,
        # GeLU, ...) run on the kernel backend, other GLUs on the reference backend. Expert
        # biases (--add-bias-linear, GPT-OSS) run in the kernel backend's epilogues.
        # FP8: Megatron's --fp8-format e4m3 --fp8-recipe blockwise, or --mok-fp8 blockwise
        # for the MoE layers alone (mok_config).
        mok_config = mok_config or MoKConfig()
        self.mok_config = dataclasses.replace(mok_config,
                                              activation=from_megatron(config),
                                              expert_bias=bool(config.add_bias_linear),
                                              fp8=_check_fp8(config) or mok_config.fp8)
        check_fp8_pass(self.mok_config, hidden=config.hidden_size,
                       inter=config.moe_ffn_hidden_size,
                       biases=self.mok_config.expert_bias)
        # FP8: the weights quantised once per optimizer step (reused across micro-batches
        # once the step hook runs: install_step_check).
        self._fp8_cache = fp8_weight_cache.Fp8WeightCache() if self.mok_config.fp8 else None
        # fused: metadata only (routed_experts_compute runs dispatch + experts + combine).
        self.token_dispatcher = MokTokenDispatcher(
            self.num_local_experts, self.local_expert_indices, config=config,
            pg_collection=pg_collection, fused=True)
        # Fail at construction on an unknown expert module; lay each weight's experts back
        # to back so that the fused pass reads them stacked without a copy.
        fc1, fc2 = expert_weight_list(self.experts)
        if (expert_bias_list(self.experts) is not None) != self.mok_config.expert_bias:
            raise ValueError("--moe-token-dispatcher-type mok: the expert modules' biases do "
                             "not match the config's add_bias_linear; build the experts from "
                             "the same config (pass --disable-bias-linear for none)")
        # MOK_SHARED_EXPERT=folded (at construction): the shared expert joins the pass as
        # one more local expert, its weights right after the experts' (shared_fold).
        self._shared_weights = self._foldable_shared_weights(fc1, fc2)
        shared1, shared2 = self._shared_weights or ((), ())
        self._weights_in_place = (share_one_storage([*fc1, *shared1])
                                  & share_one_storage([*fc2, *shared2]))
        self._accumulators = (None, None)  # built once per set of main_grad buffers
        self._backend_logged = False
        self._reverse = None  # experts stacked backwards (decided at the first forward)
        # Modules whose weights the fused pass reads but whose forward never runs.
        self._weight_modules = list(self.experts.modules())
        if self._shared_weights is not None:
            self._weight_modules += list(self.shared_experts.modules())

    def _foldable_shared_weights(self, fc1, fc2):
        """([shared fc1 weight], [shared fc2 weight]) when the shared expert can run inside
        the fused pass: MOK_SHARED_EXPERT=folded, the routed experts' width, no tensor
        parallelism (its shards would need MoELayer's all-reduce), no gate, not recomputed
        on its own, no CUDA graphs (their partial capture expects a shared output); else
        None (MoELayer runs it)."""
        shared, config = self.shared_experts, self.config
        if shared is None or shared_fold.mode() != "folded" or self.shared_expert_overlap \
                or self.mok_config.expert_bias or self.mok_config.fp8 \
                or self.shared_experts_recompute \
                or getattr(config, "moe_shared_expert_gate", False) \
                or (config.tensor_model_parallel_size or 1) > 1 \
                or config.moe_shared_expert_intermediate_size != config.moe_ffn_hidden_size \
                or getattr(config, "cuda_graph_impl", "none") not in (None, "none") \
                or getattr(config, "enable_cuda_graph", False) \
                or getattr(config, "external_cuda_graph", False):
            return None
        w1 = getattr(getattr(shared, "linear_fc1", None), "weight", None)
        w2 = getattr(getattr(shared, "linear_fc2", None), "weight", None)
        if not shared_fold.foldable(fc1[0].unsqueeze(0), fc2[0].unsqueeze(0), w1, w2):
            return None
        return [w1], [w2]

    def _run_weight_modules_pre_hooks(self) -> None:
        """Run the forward pre-hooks of the modules whose weights the pass reads, as their
        own forward would have: Megatron DDP's --overlap-param-gather waits there for the
        weights' all-gather (and dispatches the next bucket's)."""
        for module in self._weight_modules:
            for hook_id, hook in list(module._forward_pre_hooks.items()):
                if hook_id in module._forward_pre_hooks_with_kwargs:
                    hook(module, (), {})
                else:
                    hook(module, ())

    def shared_experts_compute(self, hidden_states: torch.Tensor):
        if self._shared_weights is not None:
            return None  # computed inside the fused pass, added in its combine
        return super().shared_experts_compute(hidden_states)

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """hidden_states [T, H] and probs = topk_w [T, K] from MokTokenDispatcher."""
        if not self._backend_logged:
            self._backend_logged = True
            backend = resolve_backend(self.mok_config, hidden_states.device, hidden_states.dtype,
                                      self.config.expert_model_parallel_size or 1)
            experts = f"{self.mok_config.fp8} FP8" if self.mok_config.fp8 else \
                str(hidden_states.dtype).replace("torch.", "")
            log_single_rank(logger, logging.INFO,
                            f"megatron_mok: MoE layer {self.layer_number} runs the {backend} "
                            f"backend on {hidden_states.device} (experts in {experts})")
        step_hook = install_step_check(self.config)
        if self._fp8_cache is not None:
            self._fp8_cache.reuse = step_hook
        self._run_weight_modules_pre_hooks()
        fc1, fc2 = expert_weight_list(self.experts)
        reverse = self._experts_backwards(fc1, fc2)
        w1, w2 = stack_experts(fc1, reverse), stack_experts(fc2, reverse)
        biases = expert_bias_list(self.experts)
        b1 = b2 = None
        if biases is not None:  # small: stacked (a copy) every forward
            b1, b2 = (torch.stack(b[::-1] if reverse else b) for b in biases)
        topk_idx = self.token_dispatcher.topk_idx
        if reverse:  # plane j is expert E - 1 - j on every rank: route to it as such
            topk_idx = reverse_local_experts(topk_idx, len(fc1))
            fc1, fc2 = fc1[::-1], fc2[::-1]  # plane order from here on
        # stack_experts aliases the parameters' memory when it can, else copies (and a
        # folded shared weight is appended without a copy only right after the experts').
        in_place = w1.data_ptr() == fc1[0].data_ptr() and w2.data_ptr() == fc2[0].data_ptr()
        if self._shared_weights is not None:
            (shared1,), (shared2,) = self._shared_weights
            in_place = in_place and shared_fold.adjacent(w1, shared1) \
                and shared_fold.adjacent(w2, shared2)
        if self._weights_in_place and not in_place:
            self._weights_in_place = False  # say it once per layer
            warnings.warn("megatron_mok: the expert weights of a MokMoELayer were moved after "
                          "construction (a dtype/device conversion, or the distributed "
                          "optimizer's parameter buffer); each forward now copies them into a "
                          "stacked tensor (docs/design-notes.md)", stacklevel=2)
        if self._shared_weights is not None:  # folded: fused_moe appends it as expert E_loc
            shared1, shared2 = self._shared_weights
            output = fused_moe(
                hidden_states.contiguous(), topk_idx, probs,
                w1, w2, shared1[0], shared2[0], group=self.ep_group, config=self.mok_config,
                accumulators=self._main_grad_accumulators([*fc1, *shared1], [*fc2, *shared2]),
                fold_shared=True)
            return output, None
        output = fused_moe(
            hidden_states.contiguous(), topk_idx, probs,
            w1, w2, group=self.ep_group, config=self.mok_config,
            accumulators=self._main_grad_accumulators(fc1, fc2), b1=b1, b2=b2,
            fp8_cache=self._fp8_cache)
        return output, None

    def _experts_backwards(self, fc1, fc2) -> bool:
        """Stack the experts backwards? When their weights lie backwards in memory, as
        Megatron's distributed optimizer re-homes a TEGroupedMLP's parameters (its buffers
        hold parameters in reverse order): then the pass reads them in place. Decided once
        (every EP rank must number its experts the same way: the ranks agree at the first
        forward); either order is correct, stack_experts copies where it cannot alias."""
        if self._reverse is None:
            backwards = self._shared_weights is None and len(fc1) > 1 and \
                fc1[0].data_ptr() > fc1[-1].data_ptr() and fc2[0].data_ptr() > fc2[-1].data_ptr()
            group = self.ep_group
            if group is not None and torch.distributed.is_initialized() and \
                    torch.distributed.get_world_size(group) > 1:
                flag = torch.tensor([int(backwards)], device=fc1[0].device)
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN,
                                             group=group)
                backwards = bool(flag.item())
            self._reverse = backwards
        return self._reverse

    def _main_grad_accumulators(self, fc1, fc2):
        """(fc1's, fc2's) ExpertGradAccumulator over the parameters' main_grad when fusion
        is on and DDP gave every expert weight one, else None: the backward then adds into
        main_grad and marks grad_added_to_main_grad, as Megatron's fused linears do."""
        mode = self.mok_config.main_grad_fusion
        if mode == "off" or (mode == "auto" and
                             not getattr(self.config, "gradient_accumulation_fusion", False)):
            return None
        if not torch.is_grad_enabled():
            return None
        params = (*fc1, *fc2)
        # Megatron's DDP (grad_added_to_main_grad says its hook checks the flag); not its
        # FSDP, whose main_grad must be fetched anew each step (get_main_grad).
        if not all(p.requires_grad and getattr(p, "main_grad", None) is not None
                   and hasattr(p, "grad_added_to_main_grad")
                   and not hasattr(p, "__fsdp_param__") for p in params):
            return None
        grads = [p.main_grad for p in params]
        cached = self._accumulators
        if cached[0] is not None and all(
                a is b for a, b in zip(grads, (*cached[0].buffers, *cached[1].buffers))):
            return cached
        try:
            # DDP adds the returned gradient even so into a param with zero_out_wgrad.
            self._accumulators = tuple(
                ExpertGradAccumulator([p.main_grad for p in weights],
                                      on_added=lambda weights=weights: _mark_added(weights),
                                      zero_placeholder=any(getattr(p, "zero_out_wgrad", False)
                                                           for p in weights))
                for weights in (fc1, fc2))
        except (TypeError, ValueError):  # e.g. main_grads of mixed dtypes: DDP adds
            self._accumulators = (None, None)
            return None
        return self._accumulators


def install_step_check(config) -> bool:
    """Raise a routing error latched by any pass of the step before the optimizer applies
    the step (routing_errors), and mark the FP8 weights stale (fp8_weight_cache): Megatron
    calls config.finalize_model_grads_func after the last backward of every step, right
    before optimizer.step() synchronises anyway; the check waits there for the last
    schedule's status copy. Installed once per config; True when it is (a training loop
    without the hook: False)."""
    finalize = getattr(config, "finalize_model_grads_func", None)
    if finalize is None:
        return False
    if getattr(finalize, "mok_checks_routing", False):
        return True

    def finalize_then_check(*args, **kwargs):
        result = finalize(*args, **kwargs)
        fp8_weight_cache.advance_step()
        routing_errors.check(wait=True)
        return result

    finalize_then_check.mok_checks_routing = True
    config.finalize_model_grads_func = finalize_then_check
    return True


def _mark_added(params) -> None:
    """Megatron's DDP hook then skips its own add (and drops the placeholder gradient)."""
    for p in params:
        p.grad_added_to_main_grad = True
