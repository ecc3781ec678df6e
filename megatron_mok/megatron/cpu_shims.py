"""Run megatron-core's own training loop (`megatron.training.pretrain`) on a CPU with gloo.

`apply_cpu_shims()` is a no-op when CUDA is available. Without a GPU it patches, in this
one place, everything megatron-core 0.19 needs to train on the CPU (see DEVELOPING.md,
"CPU Megatron"): device queries, the CUDA RNG API, hard-coded `device='cuda'`, streams and
events, and the all-to-all split sizes for gloo. `torch.cuda.is_available()` stays False,
so code that asks the right question still takes its CPU path.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging

import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False
_MODE = None


# --------------------------------------------------------------------------------------
# torch function mode: every 'cuda' device named in Python lands on the CPU
# --------------------------------------------------------------------------------------

def _cpu_device(device):
    """'cuda', 'cuda:N', torch.device('cuda'), or a bare int ordinal -> 'cpu'; else unchanged."""
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str):
        return "cpu" if device.startswith("cuda") else device
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    return device


def _is_device_like(x):
    return isinstance(x, (torch.device, str)) or (isinstance(x, int) and not isinstance(x, bool))


class _CudaOnCpuMode(TorchFunctionMode):
    """Maps the CUDA device / type names megatron hard-codes onto the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            # A mode is off while it handles a call, so func would run the whole backward pass
            # unmapped: custom Functions' backward (_AllToAll, recompute) would hit 'cuda'.
            return self._backward(func, args, kwargs)
        if func is torch.Tensor.cuda:
            # `.cuda()` (model.cuda(), batch.cuda()) leaves the tensor where it is: the CPU.
            return args[0]
        if func is torch.Tensor.type:
            if len(args) == 1 and not kwargs:
                # `param.type() == 'torch.cuda.FloatTensor'` checks in the optimizers and clip_grads.
                name = func(*args)
                return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
            args = tuple(a.replace("torch.cuda.", "torch.", 1) if isinstance(a, str) else a for a in args)
        if func in (torch.Tensor.to,) and len(args) > 1 and _is_device_like(args[1]):
            # `t.to('cuda')` / `t.to(torch.cuda.current_device())`.
            args = (args[0], _cpu_device(args[1])) + tuple(args[2:])
        if "device" in kwargs:
            # `torch.empty(..., device='cuda')`, `device=torch.cuda.current_device()` (an int).
            kwargs["device"] = _cpu_device(kwargs["device"])
        return func(*args, **kwargs)

    def _backward(self, func, args, kwargs):
        """torch.autograd.backward's body, run with this mode pushed again."""
        from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
        from torch.autograd.graph import _engine_run_backward

        bound = inspect.signature(func).bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        tensors = a["self"] if "self" in a else a["tensors"]
        grads = a["gradient"] if "gradient" in a else a["grad_tensors"]
        tensors = (tensors,) if torch.is_tensor(tensors) else tuple(tensors)
        inputs = a["inputs"]
        inputs = () if inputs is None else (inputs,) if torch.is_tensor(inputs) else tuple(inputs)
        grads = _make_grads(tensors, _tensor_or_tensors_to_tuple(grads, len(tensors)),
                            is_grads_batched=False)
        retain_graph = a["retain_graph"] if a["retain_graph"] is not None else a["create_graph"]
        with self:
            _engine_run_backward(tensors, grads, retain_graph, a["create_graph"], inputs,
                                 allow_unreachable=True, accumulate_grad=True)


# --------------------------------------------------------------------------------------
# stand-ins for CUDA streams and events
# --------------------------------------------------------------------------------------

class _Stream:
    """torch.cuda.Stream on a machine where all work is synchronous."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return event if event is not None else _Event()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Event:
    """torch.cuda.Event: records wall time so elapsed_time() stays meaningful."""

    def __init__(self, *args, **kwargs):
        self._t = None

    def record(self, stream=None):
        import time
        self._t = time.perf_counter()

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end):
        return 1000.0 * (end._t - self._t)


# --------------------------------------------------------------------------------------
# CUDA RNG API on the CPU generator
# --------------------------------------------------------------------------------------

def _get_rng_state(device="cuda"):
    return torch.get_rng_state()


def _set_rng_state(new_state, device="cuda"):
    torch.set_rng_state(new_state)


def _manual_seed(seed):
    torch.default_generator.manual_seed(int(seed))


class _ForkCheckFilter(logging.Filter):
    """Drops the tracker's 'CPU RNG state changed within GPU RNG context' warning."""

    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


# --------------------------------------------------------------------------------------
# gloo all-to-all-v split sizes
# --------------------------------------------------------------------------------------

def _splits_to_numpy(move):
    @functools.wraps(move)
    def wrapper(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return move(tensor, as_numpy=as_numpy, record_stream=record_stream)
    return wrapper


# --------------------------------------------------------------------------------------

def apply_cpu_shims() -> None:
    """Make `megatron.training` run on the CPU with gloo (idempotent; no-op with CUDA)."""
    global _APPLIED, _MODE
    if _APPLIED or torch.cuda.is_available():
        return
    _APPLIED = True

    import megatron.training.initialize as mt_initialize
    import megatron.training.training as mt_training
    import megatron.core.tensor_parallel.random as mc_random
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    # initialize_megatron asserts torch.cuda.is_available() unless allow_no_cuda=True.
    init = functools.partial(mt_initialize.initialize_megatron, allow_no_cuda=True)
    mt_initialize.initialize_megatron = init
    mt_training.initialize_megatron = init

    # Parallel groups and the RNG tracker are only built when device_count() > 0.
    torch.cuda.device_count = lambda: 1
    # _initialize_distributed calls set_device(local_rank) once device_count() > 0.
    torch.cuda.set_device = lambda device: None
    # current_device() is called everywhere (a real one needs a driver); 0 is mapped to CPU.
    torch.cuda.current_device = lambda: 0

    # The RNG tracker reads torch.cuda.get_rng_state() (needs a driver) and seeds with
    # torch.cuda.manual_seed() (silently queued without CUDA: every tracker state would be
    # the same unseeded one); checkpoint loading calls set_rng_state. Use the CPU generator.
    for mod in (torch.cuda, torch.cuda.random):
        mod.get_rng_state = _get_rng_state
        mod.set_rng_state = _set_rng_state
        mod.manual_seed = _manual_seed
    # The tracker's fork() switches generators through these helpers (default_generators
    # of a CUDA device); without them fork never switches and inits/dropout draw wrongly.
    mc_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state())
    mc_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state))
    # With one generator, fork()'s "CPU RNG state changed" check fires on every dropout.
    logging.getLogger(mc_random.__name__).addFilter(_ForkCheckFilter())

    # The step logger and timers synchronize (needs a driver); there is nothing to wait for.
    torch.cuda.synchronize = lambda device=None: None
    # Called by train/eval/GC paths (--empty-unused-memory-level, manual GC); no allocator.
    torch.cuda.empty_cache = lambda: None
    # DDP init and the MoE dispatcher make side streams (real ones need a driver).
    torch.cuda.Stream = _Stream
    # Events pair with streams in offload/overlap paths; a wall-clock stand-in.
    torch.cuda.Event = _Event
    # DDP init and the dispatcher compare/wait on current_stream() (needs a driver).
    torch.cuda.current_stream = lambda device=None: _Stream()
    # `with torch.cuda.stream(s)` type-checks s against the real Stream class.
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()

    # gloo's all_to_all_single needs host split sizes (list/numpy, not tensors); the
    # alltoall dispatcher only converts them when they are CUDA tensors (EP > 1).
    moved = _splits_to_numpy(moe_utils.maybe_move_tensor_to_cpu)
    moe_utils.maybe_move_tensor_to_cpu = moved
    token_dispatcher.maybe_move_tensor_to_cpu = moved

    # Megatron hard-codes device='cuda' / device=current_device(), .cuda(), and
    # 'torch.cuda.FloatTensor' type() checks: one function mode maps them all to the CPU.
    _MODE = _CudaOnCpuMode()
    _MODE.__enter__()
