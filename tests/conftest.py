"""Shared test setup. TRITON_INTERPRET must be set before triton is first imported."""
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Test models are tiny: one intra-op thread is fastest, and several test processes
# (servers in subprocesses inherit this) must not spin against each other on 2 cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from radixserve.frontend import drop_checkout_root  # noqa: E402

drop_checkout_root()  # before any test module imports transformers (it imports `kernels` when installed)  (torch does not import triton; triton reads the flag at its import)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # No GPU: the Triton kernels run (slowly, on small shapes) in the interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
