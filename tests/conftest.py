"""Run Triton kernels under the interpreter (CPU tensors) when no GPU is available."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    """Opt-in switches (tests/gpu_arithmetic.py): ``LSTMEM_EMULATE_GPU_ARITH=1`` (or ``reversed``) runs
    every interpreted Triton kernel with the GPU's approximate float32 arithmetic for the whole session;
    ``LSTMEM_TOLERANCE_RATIOS=1`` prints each test's worst error / tolerance ratio."""
    import gpu_arithmetic

    try:
        mode = gpu_arithmetic.session_mode()
    except ValueError as error:
        raise pytest.UsageError(str(error)) from None
    if mode and os.environ.get("TRITON_INTERPRET") == "1":
        emulation = gpu_arithmetic.emulated_gpu_arithmetic(reverse=mode == "reversed")
        emulation.__enter__()
        config.add_cleanup(lambda: emulation.__exit__(None, None, None))
    if os.environ.get("LSTMEM_TOLERANCE_RATIOS", "") not in ("", "0"):
        config.pluginmanager.register(gpu_arithmetic.ToleranceRatios(), "lstmem-tolerance-ratios")


def pytest_report_header(config):
    import gpu_arithmetic

    mode = gpu_arithmetic.session_mode()
    if mode:
        on = os.environ.get("TRITON_INTERPRET") == "1" and gpu_arithmetic.is_active()
        return f"GPU arithmetic emulation ({mode}): {'on' if on else 'off, the kernels run on a GPU'}"


@pytest.fixture(scope="module")
def loaded():
    """``lstmem serve``'s embedded demo model (the library engine, on the CPU) for the serve tests,
    run on one thread (a tiny model: one is fastest); the thread count is restored afterwards."""
    from lstmem_peft.serve.loading import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(device="cpu")
    torch.set_num_threads(threads)
