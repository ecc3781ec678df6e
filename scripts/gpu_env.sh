# Sourced by the GPU scripts (run from the repository root): OUT (created), PY, megatron-core
# from .whl/ when the machine lacks it, this checkout on PYTHONPATH, NVLink multicast off;
# TE=1: Transformer Engine 2.20.2 unpacked from .te/te_h200_bundle.tar.xz (the TE wheel's
# tree and its torch extension built for torch 2.11; once per machine) onto PYTHONPATH.
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if ! $PY -c "import megatron.core" 2>/dev/null; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
if [ "${TE:-0}" = 1 ]; then
  [ -d /tmp/te/site ] || { mkdir -p /tmp/te && tar -C /tmp/te -xJf .te/te_h200_bundle.tar.xz; }
  export PYTHONPATH=/tmp/te/site:$PYTHONPATH LD_PRELOAD=/tmp/te/shim/libte_cublaslt_shim.so
fi
