import os

import pytest
import torch

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")


def pytest_collection_modifyitems(config, items):
    """GPU tests skip without a GPU; on a GPU machine whose extension did not load they
    fail, loudly, instead of skipping (a broken build must not pass as 'no GPU')."""
    if torch.cuda.is_available():
        from megatron_mok.kernels import ops
        if not ops.extension_available():
            broken = pytest.mark.usefixtures("_extension_must_load")
            for item in items:
                if "gpu" in item.keywords:
                    item.add_marker(broken)
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def _extension_must_load():
    from megatron_mok.kernels import ops
    pytest.fail(f"a GPU is present but {ops.EXTENSION_ERROR}: rebuild the extension "
                f"(make install) before running the GPU tests")


@pytest.fixture(autouse=True)
def _knobs_follow_the_environment(monkeypatch):
    """megatron_mok.knobs reads the MOK_* environment once; a test that sets a knob with
    monkeypatch.setenv / delenv gets it re-read at once, and every test ends with the
    knobs of the restored environment."""
    from megatron_mok import knobs

    def reread(method):
        def wrapper(name, *args, **kwargs):
            result = method(name, *args, **kwargs)
            if str(name).startswith("MOK_"):
                knobs.reload()
            return result
        return wrapper

    monkeypatch.setenv = reread(monkeypatch.setenv)
    monkeypatch.delenv = reread(monkeypatch.delenv)
    yield
    monkeypatch.undo()
    knobs.reload()
