"""Build megatron_mok; the CUDA extension (megatron_mok._C) is built whenever nvcc is found.

No GPU is needed to build: the target is fixed by TORCH_CUDA_ARCH_LIST (default
9.0a, i.e. sm_90a for Hopper's WGMMA/TMA). Without nvcc, a pure-Python package is
installed and the layer runs its reference backend.
"""

import glob
import os
import shutil

from setuptools import find_packages, setup

ext_modules, cmdclass = [], {}


def _cuda_home():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return home
    nvcc = shutil.which("nvcc")
    for candidate in ("/usr/local/cuda",):
        if os.path.exists(os.path.join(candidate, "bin", "nvcc")):
            return candidate
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None


def _extension():
    import torch  # build with --no-build-isolation so this is the runtime torch
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    include_dirs = [os.path.abspath("csrc")]
    # CuTe/CUTLASS headers come with the nvidia-cutlass wheel.
    import cutlass_library
    include_dirs.append(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))
    # torch's CUDA headers pull in cuBLAS/cuSPARSE headers that a bare nvcc install lacks;
    # torch's own nvidia wheels carry them.
    torch_site = os.path.dirname(os.path.dirname(torch.__file__))
    include_dirs += glob.glob(os.path.join(torch_site, "nvidia", "cu*", "include"))
    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/**/*.cu", recursive=True))
    nvcc_flags = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "--expt-extended-lambda",
                  "-gencode=arch=compute_90a,code=sm_90a", "-lineinfo",
                  "-Xptxas=-v" if os.environ.get("MOK_PTXAS_VERBOSE") else "-Xptxas=-O3"]
    ext = CUDAExtension(
        name="megatron_mok._C", sources=sources, include_dirs=include_dirs,
        extra_compile_args={"cxx": ["-O3", "-std=c++17"], "nvcc": nvcc_flags})
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


if os.environ.get("MOK_SKIP_EXTENSION") != "1" and _cuda_home():
    os.environ.setdefault("CUDA_HOME", _cuda_home())
    ext_modules, cmdclass = _extension()

setup(
    name="megatron_mok",
    version="0.1.0",
    description="Fused MoE megakernel (dispatch + SwiGLU experts + combine) for Megatron-Core",
    license="Apache-2.0",
    packages=find_packages(include=["megatron_mok", "megatron_mok.*"]),
    python_requires=">=3.12",
    install_requires=["torch>=2.11", "megatron-core>=0.19,<0.20", "numpy", "psutil"],
    extras_require={"build": ["nvidia-cutlass==4.2.0.0", "ninja"], "test": ["pytest"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
