"""The kernel backend: the compiled Hopper (sm_90a) pass behind the functional API.

    ops           the extension's torch.library ops (megatron_mok._C) and their fake impls
    grouped_gemm  the grouped-GEMM core (fc1 + SwiGLU, fc2, dgrads, wgrad) over the row table
    megakernel    the forward and backward megakernels (one persistent launch per pass)
    launch_chain  the pass's steps as separate launches, and what the forward saves
    autotune      the per-(GPU, shape) plans and their cache; tuning times the candidates
    backend       forward / backward of one layer call, as functional.py calls them

Nothing here imports megatron_mok.functional or the Megatron adapter (tests/test_layout.py).
"""
