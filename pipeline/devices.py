"""What the code asks of the device it was handed: one answer per question, keyed on whether the
device is the CPU or an accelerator (CUDA, or any other device type torch knows).

Which device a process uses is decided once, by pipeline/training/distributed.py (`Context.device`);
this module only answers questions about a device it is given: a random stream on it, making it
the process's current one, the collective backend between processes on it, its memory counters.
Every branch that a GPU run takes and a CPU run does not goes through here, so a device that is
not the CPU (the tests' fake accelerator, tests/helpers/fake_device.py) takes the GPU's side, and
the CPU's side stays what the committed runs did, bit for bit.

The device's own torch module answers (`torch.get_device_module(device)`: torch.cuda for a CUDA
device), not `torch.accelerator`: that one's memory functions ask the device's C++ allocator, which
a backend registered from Python does not have, and its `is_available` speaks for the process, not
for the device a stage was handed (the test processes register the fake accelerator beside their
CPU runs). A module without memory counters gives None (no number, rather than a made-up one).
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

Device = Union[torch.device, str]
GIB = 2 ** 30


def is_accelerator(device: Device) -> bool:
    """Whether `device` is anything but the CPU: where GPU behaviour (its own random streams,
    other kernels, memory of its own) is to be expected."""
    return torch.device(device).type != "cpu"


def generator(device: Device, seed: int) -> torch.Generator:
    """A random stream seeded with `seed`, on `device` when it is an accelerator, so sampling draws
    there (CUDA's sampling kernels refuse a CPU stream). The CPU gets the CPU's stream, as the
    committed runs did. A backend registered from Python (PyTorch's PrivateUse1, as the tests' fake
    accelerator is) cannot make a stream of its own (torch raises NotImplementedError): it draws
    from the CPU's stream with the same seed, which its kernels, CPU kernels, accept."""
    if is_accelerator(device):
        try:
            return torch.Generator(device=device).manual_seed(seed)
        except NotImplementedError:
            pass
    return torch.Generator().manual_seed(seed)


def set_current(device: Device) -> None:
    """Make `device` its kind's current device in this process (torch.cuda.set_device), so code that
    asks for "the" device (NCCL's communicator, DeepSpeed's buffers) gets this rank's. The CPU has
    no current device."""
    if is_accelerator(device):
        torch.get_device_module(device).set_device(torch.device(device))


def collective_backend(device: Device) -> str:
    """The torch.distributed backend between processes whose tensors live on `device`: gloo on the
    CPU; on an accelerator the one torch pairs with its type (NCCL for CUDA, XCCL for XPU), else
    gloo (a backend registered from Python has none of its own; the tests route the fake
    accelerator's collectives through a double with NCCL's rule over a gloo group)."""
    if not is_accelerator(device):
        return "gloo"
    return dist.Backend.default_device_backend_map.get(torch.device(device).type, "gloo")


def _counter(device: Device, name: str) -> Optional[Callable]:
    """The device module's memory function `name`, or None: on the CPU, where the module has no
    such counter, and before the device's runtime started (nothing allocated there yet; asking
    would start it)."""
    if not is_accelerator(device):
        return None
    module = torch.get_device_module(device)
    started = getattr(module, "is_initialized", None)
    if started is not None and not started():
        return None
    return getattr(module, name, None)


def peak_memory_gib(device: Device) -> Optional[float]:
    """The most memory torch has held allocated on `device` since the last `reset_peak` (or the
    start), GiB; None where there is no counter (module doc)."""
    read = _counter(device, "max_memory_allocated")
    return None if read is None else read(torch.device(device)) / GIB


def reset_peak(device: Device) -> None:
    """Start a new peak for `peak_memory_gib` (nothing where there is no counter)."""
    reset = _counter(device, "reset_peak_memory_stats")
    if reset is not None:
        reset(torch.device(device))


def allocated(device: Device) -> Optional[int]:
    """Bytes torch holds allocated on `device` now; None where there is no counter."""
    read = _counter(device, "memory_allocated")
    return None if read is None else int(read(torch.device(device)))


def free_memory(device: Device) -> Optional[tuple[int, str]]:
    """Free bytes on `device` and the device's name (for a message); None on the CPU and where the
    device's module cannot say (the CPU's free memory is the machine's RAM: psutil's)."""
    if not is_accelerator(device):
        return None
    module = torch.get_device_module(device)
    if not (hasattr(module, "mem_get_info") and hasattr(module, "get_device_name")):
        return None
    return int(module.mem_get_info(torch.device(device))[0]), str(module.get_device_name(torch.device(device)))


# ---- Compute that ran on the CPU while the device is not ------------------------------------------
# A model forward on the CPU in a process whose device is a GPU is one rank computing alone what
# belongs on its accelerator (a final evaluation on a model moved to the CPU), while on a multi-GPU
# run the other ranks wait in a collective until it ends or their timeout does. Only matrix products
# are counted: they are what a model's forward is made of, and host-side bookkeeping (statistics, a
# CI's resampling) has none of any size.

COUNT_CPU_MATMULS = "PIPELINE_COUNT_CPU_MATMULS"   # set (to 1): each stage counts them (scripts/gpu_check.py)
MATMULS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default")


def matmul_flops(name: str, args: tuple) -> float:
    """FLOPs of one matrix product (`name` one of MATMULS, `args` its ATen operands): 2 per
    multiply-add; addmm and baddbmm carry the added tensor first."""
    a, b = (args[1], args[2]) if name in ("aten.addmm.default", "aten.baddbmm.default") else (args[0], args[1])
    return 2.0 * a.numel() * b.shape[-1]


class CpuMatmuls(TorchDispatchMode):
    """FLOPs of the matrix products whose operands all are CPU tensors (`flops`), and the largest
    one with its operands' shapes (`largest`, to name the culprit)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0.0
        self.largest: tuple[float, str] = (0.0, "")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in MATMULS and all(a.device.type == "cpu" for a in args if isinstance(a, torch.Tensor)):
            flops = matmul_flops(name, args)
            self.flops += flops
            if flops > self.largest[0]:
                self.largest = (flops, f"{name} {[tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_cpu_matmuls(device: Device) -> Iterator[Optional[CpuMatmuls]]:
    """While the body runs, the FLOPs of matrix products on CPU tensors in this thread (`.flops`,
    `.largest`), when COUNT_CPU_MATMULS is set and `device` is an accelerator; else None and no
    counting. Every operation then passes through Python, so it is for checks, not for runs."""
    if not (os.environ.get(COUNT_CPU_MATMULS) and is_accelerator(device)):
        yield None
        return
    with CpuMatmuls() as counter:
        yield counter
