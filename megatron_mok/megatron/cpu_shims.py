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
        if func is torch.Tensor.cuda:
            # `.cuda()` (model.cuda(), batch.cuda()) leaves the tensor where it is: the CPU.
            return args[0]
        if func is torch.Tensor.type:
            if len(args) == 1 and not kwargs:
                # `param.type() == 'torch.cuda.FloatTensor'` checks in the optimizers and clip_grads.
                name = func(*args)
                return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
            args = tuple(a.replace("torch.cuda.", "torch.", 1) if isinstance(a, str) else a for a in args)
        if func is torch.Tensor.record_stream:
            # Side-stream bookkeeping of device-to-host copies; streams are dummies here.
            return None
        if func in (torch.Tensor.to,) and len(args) > 1 and _is_device_like(args[1]):
            # `t.to('cuda')` / `t.to(torch.cuda.current_device())`.
            args = (args[0], _cpu_device(args[1])) + tuple(args[2:])
        if "device" in kwargs:
            # `torch.empty(..., device='cuda')`, `device=torch.cuda.current_device()` (an int).
            kwargs["device"] = _cpu_device(kwargs["device"])
        return func(*args, **kwargs)


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


def _seed():
    torch.default_generator.seed()


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

    # Parallel groups and the CUDA RNG tracker are only set up when device_count() > 0.
    torch.cuda.device_count = lambda: 1
    # local_rank -> set_device and `with torch.cuda.device(i)` must not touch a driver.
    torch.cuda.set_device = lambda device: None
    torch.cuda.device = lambda device=None: contextlib.nullcontext()
    # current_device() is passed as `device=`; the function mode maps ordinal 0 to the CPU.
    torch.cuda.current_device = lambda: 0

    # torch.cuda RNG calls would lazily init CUDA (raise) or be silently queued (seeds):
    # point them at the CPU generator, the one CPU dropout actually draws from.
    for mod in (torch.cuda, torch.cuda.random):
        mod.get_rng_state = _get_rng_state
        mod.set_rng_state = _set_rng_state
        mod.get_rng_state_all = lambda: [torch.get_rng_state()]
        mod.set_rng_state_all = lambda states: torch.set_rng_state(states[0])
        mod.manual_seed = _manual_seed
        mod.manual_seed_all = _manual_seed
        mod.seed = _seed
        mod.seed_all = _seed
        mod.initial_seed = torch.initial_seed
    # Megatron's RNG tracker forks through its own helpers (default_generators[cuda idx]);
    # without this its fork silently never switches the generator dropout uses.
    mc_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state())
    mc_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state))
    # With one generator the tracker's "CPU RNG changed inside a GPU fork" check always fires.
    logging.getLogger(mc_random.__name__).addFilter(_ForkCheckFilter())

    # Host/device syncs and the caching allocator have nothing to do on the CPU.
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.empty_cache = lambda: None
    # DDP init, the MoE dispatcher and the training loop create side streams and events.
    torch.cuda.Stream = _Stream
    torch.cuda.Event = _Event
    torch.cuda.current_stream = lambda device=None: _Stream()
    torch.cuda.default_stream = lambda device=None: _Stream()
    torch.cuda.set_stream = lambda stream: None
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()

    # gloo's all_to_all_single needs host split sizes; the alltoall dispatcher only converts
    # them to numpy when they live on a GPU (`tensor.is_cuda`).
    moved = _splits_to_numpy(moe_utils.maybe_move_tensor_to_cpu)
    moe_utils.maybe_move_tensor_to_cpu = moved
    token_dispatcher.maybe_move_tensor_to_cpu = moved

    # Megatron hard-codes device='cuda', .cuda() and 'torch.cuda.*Tensor' type checks.
    _MODE = _CudaOnCpuMode()
    _MODE.__enter__()
