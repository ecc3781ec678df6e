"""Per (GPU, shape) choice of the forward and backward paths and their knobs, measured
once and cached.

The kernel backend's forward can run as v1's launch chain or as the forward megakernel
(spread, direct or comm mode, with comm SMs x minibatch knobs). Which one is fastest
depends on the shape and the GPU (docs/megakernel.md, "Measured"), so
`kernels.tuning.tune()` times the candidates on a real workspace and stores the fastest
under a key of the GPU name and the shape (`store`); `forward_plan()` (called by every kernel-backend forward)
uses a cached plan when there is one. Precedence: MOK_FORWARD in the environment, then
the cache (MoKConfig.autotune), then the default with the config's knobs (the spread
megakernel at EP = 1 where it runs, else the launch chain).

The backward likewise: `kernels.tuning.tune_backward()` times the dgrad half (the launch chain, or the
backward megakernel x minibatch; EP = 1) and `backward_plan()` resolves MOK_BACKWARD, then
the cache, then the launch chain. Its entries sit under the forward key + "|bwd".

Cache: JSON at $MOK_AUTOTUNE_CACHE (default ~/.cache/megatron_mok/autotune.json), read
once per process. Fill it with `python -m benchmarks.autotune` or by calling `kernels.tuning.tune()`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import torch

from megatron_mok import knobs
from megatron_mok.kernels import megakernel

MINIBATCHES = (1024, 2048, 4096, 8192)
COMM_SMS = (4, 8, 16, 24)
BACKWARD_MINIBATCHES = (1024, 2048, 4096)


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
    path: str             # "launches" or a megakernel path (megakernel.FORWARD_PATHS)
    num_comm_sms: int     # comm CTAs (comm mode only)
    minibatch_rows: int   # rows per readiness counter (megakernel only)


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    path: str             # "launches" or "megakernel" (megakernel.BACKWARD_PATHS)
    minibatch_rows: int   # rows per readiness counter (megakernel only)


def cache_file() -> Path:
    env = knobs.get("MOK_AUTOTUNE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "megatron_mok" / "autotune.json"


def plan_key(gpu: str, num_tokens: int, hidden: int, inter: int, num_local_experts: int,
             topk: int, ep_size: int) -> str:
    """GPU and shape, plus the MOK_* knobs that change what a plan measured (those not at
    their defaults: knobs.plan_signature), so a plan is never reused under other knobs."""
    key = f"{gpu}|T={num_tokens}|H={hidden}|I={inter}|E_loc={num_local_experts}|K={topk}|EP={ep_size}"
    signature = knobs.plan_signature()
    return f"{key}|{signature}" if signature else key


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def variant_tag(config) -> str:
    """What the experts compute beyond plain SwiGLU, as a key suffix ("" for SwiGLU without
    biases, so the plain entries keep their keys): the general GLU's function, clamp and
    offset and the expert biases run other epilogues, so their plans are timed and cached
    apart."""
    if config is None:
        return ""
    act = config.activation
    if act.is_swiglu and not config.expert_bias:
        return ""
    tag = act.function + ("-glu" if act.gated else "")
    if act.clamp is not None:
        tag += f"-clamp{act.clamp:g}"
    if act.linear_offset:
        tag += f"-offset{act.linear_offset:g}"
    return f"|act={tag}" + ("|bias" if config.expert_bias else "")


def workspace_key(ws, inter: int, config=None) -> str:
    """The cache key of a workspace shape (and, with config, its experts' variant)."""
    gpu = _device_name(ws.device)
    return plan_key(gpu, ws.num_tokens, ws.hidden_size, inter, ws.num_local_experts, ws.topk,
                    ws.ep_size) + variant_tag(config)


_LOADED: dict = {}  # cache file path -> its entries
# Resolved plans per (workspace shape, inter, config, ...): forward_plan / backward_plan
# run in every layer call, and resolving builds the cache path and key strings (~20 us
# each). Dropped whenever what they read can change: store, forget_cache, a knobs reload.
_RESOLVED: dict = {}


def _forget_resolved(_values=None) -> None:
    _RESOLVED.clear()


knobs.on_reload(_forget_resolved)


def _memo_key(ws, *rest) -> tuple:
    return (ws.device, ws.num_tokens, ws.hidden_size, ws.num_local_experts, ws.topk,
            ws.ep_size, *rest)


def _entries() -> dict:
    path = cache_file()
    key = str(path)
    if key not in _LOADED:
        entries = {}
        if path.exists():
            try:
                entries = json.loads(path.read_text())
            except (OSError, ValueError) as err:
                warnings.warn(f"megatron_mok: ignoring the unreadable autotune cache {path}: {err}")
        _LOADED[key] = entries
    return _LOADED[key]


def forget_cache() -> None:
    """Drop the entries read from the cache file, so the next lookup reads it again (for
    tests and scripts that rewrite the file or point MOK_AUTOTUNE_CACHE elsewhere)."""
    _LOADED.clear()
    _RESOLVED.clear()


def lookup(key: str) -> Optional[ForwardPlan]:
    entry = _entries().get(key)
    if entry is None:
        return None
    plan = entry.get("plan", {})
    if plan.get("path") not in megakernel.FORWARD_PATHS:
        return None
    return ForwardPlan(plan["path"], int(plan["num_comm_sms"]), int(plan["minibatch_rows"]))


def store(key: str, plan, timings_ms: dict, write: bool = True) -> None:
    """Remember the plan (a ForwardPlan or BackwardPlan) in this process and, with
    `write`, in the cache file."""
    entries = _entries()
    entries[key] = {"plan": dataclasses.asdict(plan), "timings_ms": timings_ms}
    _RESOLVED.clear()
    if not write:
        return
    path = cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    # A temporary file of this writer's own (ranks and processes tune at once), then an
    # atomic rename: readers see the old or the new file, never a mix.
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def forward_plan(ws, inter: int, config) -> ForwardPlan:
    """_resolve_forward_plan, memoised per workspace shape, inter and config."""
    key = _memo_key(ws, "fwd", inter, config)
    plan = _RESOLVED.get(key)
    if plan is None:
        plan = _RESOLVED[key] = _resolve_forward_plan(ws, inter, config)
    return plan


def _resolve_forward_plan(ws, inter: int, config) -> ForwardPlan:
    """The forward path and knobs for this workspace: MOK_FORWARD, else the cached plan
    (config.autotune), else the default with the config's knobs: at EP = 1 the spread
    megakernel where it can run (measured 0.97-1.17x the launch chain's time, 5 of 6
    shapes faster: docs/megakernel.md), otherwise the launch chain. Non-gated experts
    (squared-ReLU, GeLU) always run the launch chain: the megakernels' epilogues are the
    GLU ones (MOK_FORWARD does not apply to them); so do FP8 passes (the FP8 GEMMs are not
    in the megakernels yet)."""
    if not config.activation.gated or config.fp8:  # FP8: its GEMMs are launches so far
        return ForwardPlan("launches", config.fwd_num_comm_sms, config.minibatch_size)
    path = ("megakernel-spread" if ws.ep_size == 1 and megakernel.runnable(ws.hidden_size)
            else "launches")
    default = ForwardPlan(path, config.fwd_num_comm_sms, config.minibatch_size)
    if knobs.is_set("MOK_FORWARD"):
        return dataclasses.replace(default, path=megakernel.forward_path(ws.hidden_size))
    plan = lookup(workspace_key(ws, inter, config)) if config.autotune else None
    if plan is None or (plan.path != "launches" and not megakernel.runnable(ws.hidden_size)):
        return default
    return plan


def candidates(ep_size: int, num_sms: int) -> list[ForwardPlan]:
    plans = [ForwardPlan("launches", 0, 0)]
    if ep_size == 1:
        plans += [ForwardPlan("megakernel", 0, mb) for mb in MINIBATCHES]
    comm_path = "megakernel-comm" if ep_size == 1 else "megakernel"
    plans += [ForwardPlan(comm_path, c, mb) for c in COMM_SMS if c < num_sms
              for mb in MINIBATCHES[1:]]
    plans += [ForwardPlan("megakernel-spread", 0, mb) for mb in MINIBATCHES[1:]]
    return plans


def plan_name(plan: ForwardPlan) -> str:
    """The plan's name in timings and logs."""
    if plan.path == "launches":
        return "launches"
    if plan.path == "megakernel" and plan.num_comm_sms == 0:
        return f"megakernel-direct/mb{plan.minibatch_rows}"
    return f"{plan.path}/comm{plan.num_comm_sms}/mb{plan.minibatch_rows}"


# ---------------------------------------------------------------------------------------
# Backward


def backward_key(ws, inter: int, config=None) -> str:
    """The forward key + "|bwd"; + "|wgrad-fused" when MOK_BACKWARD_WGRAD=fused, whose
    megakernel plans time different work (the weight gradients inside)."""
    suffix = "|wgrad-fused" if knobs.get("MOK_BACKWARD_WGRAD") == "fused" else ""
    return workspace_key(ws, inter, config) + "|bwd" + suffix


def lookup_backward(key: str) -> Optional[BackwardPlan]:
    plan = _entries().get(key, {}).get("plan", {})
    if plan.get("path") not in megakernel.BACKWARD_PATHS:
        return None
    return BackwardPlan(plan["path"], int(plan["minibatch_rows"]))


def backward_plan(ws, inter: int, config, dtype: torch.dtype, in_place: bool) -> BackwardPlan:
    """_resolve_backward_plan, memoised per workspace shape and arguments."""
    key = _memo_key(ws, "bwd", inter, config, dtype, in_place)
    plan = _RESOLVED.get(key)
    if plan is None:
        plan = _RESOLVED[key] = _resolve_backward_plan(ws, inter, config, dtype, in_place)
    return plan


def _resolve_backward_plan(ws, inter: int, config, dtype: torch.dtype,
                           in_place: bool) -> BackwardPlan:
    """The backward's dgrad path: MOK_BACKWARD (with MOK_BACKWARD_MINIBATCH) if set, else
    the cached plan (config.autotune) where the megakernel can run, else the launch chain
    (the backward megakernel is not yet measured: docs/perf-notes.md). Non-gated experts:
    the launch chain, whatever MOK_BACKWARD says (as the forward); FP8 passes too."""
    minibatch = int(knobs.get("MOK_BACKWARD_MINIBATCH"))
    if config is not None and (not config.activation.gated or config.fp8):
        return BackwardPlan("launches", minibatch)
    if knobs.is_set("MOK_BACKWARD"):
        return BackwardPlan(megakernel.backward_path(ws, dtype, in_place), minibatch)
    plan = lookup_backward(backward_key(ws, inter, config)) \
        if config is None or config.autotune else None
    if plan is None or (plan.path == "megakernel"
                        and not megakernel.backward_runnable(ws, dtype, in_place)):
        return BackwardPlan("launches", minibatch)
    return plan


def backward_candidates() -> list[BackwardPlan]:
    return [BackwardPlan("launches", 0)] + [BackwardPlan("megakernel", mb)
                                            for mb in BACKWARD_MINIBATCHES]


def backward_plan_name(plan: BackwardPlan) -> str:
    """The backward plan's name in timings and logs."""
    return "launches" if plan.path == "launches" else f"megakernel/mb{plan.minibatch_rows}"
