"""SonicMoE (Dao-AILab, pip `sonic-moe`) as a layer baseline: the fastest public Hopper MoE
training kernels we know, fed the same inputs as every other backend of benchmarks.layer.

The call is SonicMoE's general-routing entry point, `moe_general_routing_inputs`, with the
routes flattened token-major (token ids sorted ascending, as it requires) and the router
weights as its scores, so the gradients of x, the routing weights and both expert weights
come from its own backward. It gets its weights in its native layout: fc1's gate and up
rows interleaved ([g0, u0, g1, u1, ...], its default) in a [2I, H, E] view with stride
order (2, 0, 1) of an [E, 2I, H] tensor, fc2 as an [H, I, E] view of [E, H, I]; these
copies are made once, outside any timing, and their gradients are mapped back to our
layout for the correctness check. SonicMoE has no shared expert: where a shape has one, it
runs as the same two BF16 GEMMs torch-unfused uses (cuBLAS), added in fp32.

Staging for a GPU machine without a package registry: install the wheels sonic-moe
0.1.2.post1, quack-kernels 0.4.1, nvidia-cutlass-dsl(-libs-base) 4.4.2, apache-tvm-ffi and
torch-c-dlpack-ext into one folder (`pip install --no-deps --target`), pack it as
.sonic/sonic_site.tar.xz; scripts/gpu_check.sh's SONIC=1 unpacks it to /tmp/sonic and puts
/tmp/sonic and /tmp/sonic/nvidia_cutlass_dsl/python_packages on PYTHONPATH. Its first call per shape JIT-compiles CuTe DSL kernels (minutes):
`first_call_s` in the backend's info says how long, and it happens before any timing.
"""

from __future__ import annotations

import time

import torch

from megatron_mok.activations import swiglu


def _interleave_gate_up(w1: torch.Tensor) -> torch.Tensor:
    """[E, 2I, H] = [gate; up] -> [E, 2I, H] with rows g0, u0, g1, u1, ..."""
    experts, two_inter, hidden = w1.shape
    return w1.view(experts, 2, two_inter // 2, hidden).transpose(1, 2).reshape(
        experts, two_inter, hidden)


def _deinterleave_gate_up(w1: torch.Tensor) -> torch.Tensor:
    experts, two_inter, hidden = w1.shape
    return w1.view(experts, two_inter // 2, 2, hidden).transpose(1, 2).reshape(
        experts, two_inter, hidden)


class SonicMoEBackend:
    """benchmarks.layer.Backend protocol (prepare / run / leaves / grads / close)."""

    name = "sonicmoe"

    def __init__(self, weights, device, num_tokens_hint: int = 0):
        import sonicmoe  # noqa: F401  (ImportError: not staged; the benchmark records it)
        from sonicmoe.enums import ActivationType
        from sonicmoe.functional import moe_general_routing_inputs
        self._moe = moe_general_routing_inputs
        self._swiglu = ActivationType.SWIGLU
        self.weights = weights
        self.num_experts = weights.w1.shape[0]
        # Its own leaves, in its layout (copies outside timing).
        self.w1 = _interleave_gate_up(weights.w1.detach()).contiguous().requires_grad_(True)
        self.w2 = weights.w2.detach().contiguous().requires_grad_(True)
        self.shared = None
        if weights.shared_w1 is not None:
            self.shared = (weights.shared_w1.detach().clone().requires_grad_(True),
                           weights.shared_w2.detach().clone().requires_grad_(True))
        self.info = {"sonicmoe": _version(), "w1_layout": "interleaved gate/up",
                     "shared_expert": "torch bf16 GEMMs" if self.shared else None}
        self._compiled: set = set()

    def prepare(self, case) -> dict:
        num_tokens, topk = case.topk_idx.shape
        token_idx = torch.arange(num_tokens, device=case.x.device,
                                 dtype=torch.int32).repeat_interleave(topk)
        inp = {"x": case.x.detach().requires_grad_(True), "topk_idx": case.topk_idx,
               "topk_w": case.topk_w.detach().requires_grad_(True),
               "token_idx": token_idx,
               "expert_idx": case.topk_idx.reshape(-1).to(torch.int32).contiguous()}
        self._warm_up(inp, case)
        return inp

    def _warm_up(self, inp: dict, case) -> None:
        """The first call per (T, K) compiles its kernels: do it here, untimed, forward and
        backward, and report how long it took."""
        key = tuple(case.topk_idx.shape)
        if key in self._compiled:
            return
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.enable_grad():
            y = self.run(inp)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        torch.autograd.backward(y, torch.ones_like(y))
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        for t in self.leaves(inp):
            t.grad = None
        self._compiled.add(key)
        self.info[f"first_call_s_T{key[0]}"] = {"fwd": round(t1 - t0, 1),
                                                "bwd": round(t2 - t1, 1)}

    def run(self, inp: dict) -> torch.Tensor:
        x = inp["x"]
        y, _ = self._moe(x, inp["topk_w"].reshape(-1), inp["token_idx"], inp["expert_idx"],
                         self.w1.permute(1, 2, 0), None, self.w2.permute(1, 2, 0), None,
                         self.num_experts, torch.cuda.current_stream().cuda_stream,
                         self._swiglu, False, False)
        if self.shared is None:
            return y
        shared_w1, shared_w2 = self.shared
        act = swiglu(x @ shared_w1.t()).to(x.dtype)
        return (y.float() + (act @ shared_w2.t()).float()).to(x.dtype)

    def leaves(self, inp: dict) -> list:
        return [inp["x"], inp["topk_w"], self.w1, self.w2, *(self.shared or ())]

    def grads(self, inp: dict) -> dict:
        out = {"dx": inp["x"].grad, "d_topk_w": inp["topk_w"].grad,
               "dw1": None if self.w1.grad is None else _deinterleave_gate_up(self.w1.grad),
               "dw2": self.w2.grad}
        if self.shared is not None:
            out["d_shared_w1"], out["d_shared_w2"] = self.shared[0].grad, self.shared[1].grad
        return out

    def close(self) -> None:
        pass


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("sonic-moe")
    except Exception:
        return "?"
