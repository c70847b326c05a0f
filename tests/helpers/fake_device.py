"""A device that is not the CPU, for machines without a GPU: where a GPU run would mix devices,
code run on it fails the same way, while every value is still computed (on the CPU) and can be
compared with a plain CPU run.

The device is PyTorch's PrivateUse1 backend registered from Python under the name `fakegpu`
(torch.utils.backend_registration: a device guard and hooks, so autograd's engine accepts it). Its
tensors are wrapper subclasses: each holds a real CPU tensor and reports `fakegpu:0` as its
device. Every ATen call on them unwraps, runs the CPU kernel and wraps the result again, after
applying the rule a CUDA kernel applies to its operands:

- tensors of one call must share a device; a 0-dim CPU tensor (a scalar) may join device tensors;
- copies between devices (`.to`, `copy_`) are allowed, as are CPU index tensors into a device
  tensor (CUDA's advanced indexing moves them); device indices into a CPU tensor are not;
- factories given `device="fakegpu"` make device tensors (under `FakeGpu()`, which also catches
  the calls that have no tensor operand).

`HostSyncs`, entered inside `use_fake_gpu`, records the calls at which a GPU's host would wait
for the device (a scalar read, a copy to the host, an output sized by the values): what a loop
meant to run ahead of its device may not do per step.

While the device is in use, a matrix product of plain CPU tensors larger than `CPU_MATMUL_FLOPS`
is an error (`CpuComputeError`): a model forward on the CPU while the process's device is not the
CPU is one rank computing alone what belongs on its accelerator (a final evaluation on a model
moved to the CPU, while on a real GPU run the other ranks wait in a collective). The mode sees the
calls made on wrapper level, so the fake device's own CPU kernels are not counted.

The code under test asks what depends on the device through pipeline/devices.py, keyed on "not
the CPU", so this device takes a GPU's side of each question (recomputed log-probs, a current
device, memory counters, which read 0 here). What it cannot see: `torch.cuda.*` calls (the code
under test is handed this device instead of CUDA, see `use_fake_gpu`), NCCL (the collective double
in test_devices.py), and random streams: a backend registered from Python cannot make a generator
of its own (`torch.Generator(device="fakegpu")` raises NotImplementedError), so sampling on this
device draws from a CPU generator (devices.generator), which CUDA would refuse.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from pipeline import devices

NAME = "fakegpu"
_installed = False
_LIBRARIES: list = []   # kept alive: a Library deregisters its kernels when collected


def install() -> torch.device:
    """Register the device (once per process; PrivateUse1 can be renamed only once)."""
    global _installed
    if not _installed:
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
        _setup_privateuseone_for_python_backend(NAME, backend_module=_Module())
        # Allocations that reach the backend itself (torch.tensor(..., device=...) builds on the CPU
        # and copies over with the dispatch modes excluded): a CPU buffer in a device wrapper.
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("empty_strided", lambda size, stride, dtype=None, layout=None, device=None, pin_memory=None:
                 FakeGpuTensor(torch.empty_strided(size, stride, dtype=dtype)), "PrivateUse1")
        lib.impl("empty.memory_format", lambda size, dtype=None, layout=None, device=None, pin_memory=None,
                 memory_format=None: FakeGpuTensor(torch.empty(size, dtype=dtype)), "PrivateUse1")
        lib.impl("_copy_from", _copy_from, "PrivateUse1")
        lib.impl("_copy_from_and_resize", _copy_from_and_resize, "PrivateUse1")
        _LIBRARIES.append(lib)
        _installed = True
    return torch.device(NAME, 0)


class _Module:
    """`torch.fakegpu`: what torch asks of a backend's module (torch.utils.checkpoint records the
    autocast state of every registered device type, so it asks for AMP's dtypes too), and what
    pipeline/devices.py asks of a GPU's: making it current (there is one device, index 0) and its
    memory counters, which are 0: a fake tensor's memory is the CPU tensor inside it, allocated
    by the CPU's allocator, so nothing is ever allocated on the device itself."""

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass

    def device_count(self) -> int:
        return 1

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    def set_device(self, device: torch.device | int) -> None:
        index = device if isinstance(device, int) else torch.device(device).index
        if index not in (None, 0):
            raise RuntimeError(f"{NAME} has one device (index 0), not {index}")

    def memory_allocated(self, device: torch.device | None = None) -> int:
        return 0

    def max_memory_allocated(self, device: torch.device | None = None) -> int:
        return 0

    def reset_peak_memory_stats(self, device: torch.device | None = None) -> None:
        pass


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    (dst.elem if isinstance(dst, FakeGpuTensor) else dst).copy_(src.elem if isinstance(src, FakeGpuTensor) else src)
    return dst


def _copy_from_and_resize(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    target = dst.elem if isinstance(dst, FakeGpuTensor) else dst
    target.resize_(src.shape)
    return _copy_from(src, dst)


class DeviceMixError(RuntimeError):
    """What CUDA raises as "Expected all tensors to be on the same device"."""


class FakeGpuTensor(torch.Tensor):
    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> "FakeGpuTensor":
        out = torch.Tensor._make_wrapper_subclass(
            cls, elem.size(), strides=elem.stride(), storage_offset=elem.storage_offset(), dtype=elem.dtype,
            layout=elem.layout, device=torch.device(NAME, 0), requires_grad=elem.requires_grad)
        out.elem = elem
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return f"FakeGpuTensor({self.elem!r})"

    def tolist(self) -> Any:   # torch refuses it for subclasses; a CUDA tensor's copies to the host, as this does
        return self.to("cpu").tolist()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


def _is_device(x: Any) -> bool:
    return isinstance(x, torch.device) and x.type == NAME or isinstance(x, str) and x.startswith(NAME)


_COPIES = {"aten._to_copy.default", "aten.copy_.default", "aten._copy_from.default",
           "aten._copy_from_and_resize.default"}
_INDEXING = {"aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default",
             "aten._index_put_impl_.default"}


def _check_devices(name: str, args: tuple, kwargs: dict) -> None:
    """The CUDA operand rule (see the module doc) for one call."""
    if name in _COPIES:
        return
    on_device, on_cpu = [], []

    def visit(x: Any) -> Any:
        if isinstance(x, FakeGpuTensor):
            on_device.append(x)
        elif isinstance(x, torch.Tensor) and x.dim() > 0:
            on_cpu.append(x)
        return x

    if name in _INDEXING:
        tree_map(visit, (args[0], *args[2:]))   # the tensor and the values; indices checked below
        indices = [i for i in args[1] if isinstance(i, torch.Tensor)]
        if not isinstance(args[0], FakeGpuTensor) and any(isinstance(i, FakeGpuTensor) for i in indices):
            raise DeviceMixError(f"{name}: indices on {NAME} index a CPU tensor")
    else:
        tree_map(visit, (args, kwargs))
    if on_device and on_cpu:
        shapes = [tuple(t.shape) for t in on_cpu]
        raise DeviceMixError(f"{name}: tensors on {NAME}:0 and on the CPU (shapes {shapes}) in one call")


def _unwrap(x: Any) -> Any:
    if isinstance(x, FakeGpuTensor):
        return x.elem
    if _is_device(x):
        return torch.device("cpu")
    return x


def _dispatch(func, args: tuple, kwargs: dict) -> Any:
    name = str(func)
    _check_devices(name, args, kwargs)
    wants_device = _is_device(kwargs.get("device"))
    has_device_operand = any(isinstance(a, FakeGpuTensor) for a in _flat((args, kwargs)))
    out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
    if name in _COPIES:
        if name == "aten._to_copy.default":
            target = kwargs.get("device")
            to_device = _is_device(target) or (target is None and isinstance(args[0], FakeGpuTensor))
            return FakeGpuTensor(out) if to_device else out
        return args[0]   # in place: the destination, whatever its device
    if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
        return args[0]   # in place (add_, masked_fill_, ...): the tensor that was changed
    if wants_device or has_device_operand:
        return tree_map(lambda x: FakeGpuTensor(x) if isinstance(x, torch.Tensor) else x, out)
    return out


def _flat(x: Any) -> list:
    out: list = []
    tree_map(lambda y: out.append(y), x)
    return out


# Above this, a product of CPU tensors is model-sized work (one tiny-model layer on one sequence
# is ~1e6 FLOPs); host-side bookkeeping (statistics, a CI's resampling) is far below.
CPU_MATMUL_FLOPS = 1e6


class CpuComputeError(RuntimeError):
    """Model-sized compute on the CPU while the process's device is not the CPU."""


class FakeGpu(TorchDispatchMode):
    """Active while code runs on the fake device: factories with `device="fakegpu"` (no tensor
    operand, so no tensor's dispatch sees them) make device tensors, and a large CPU matrix
    product fails (module doc)."""

    def __init__(self, cpu_matmul_flops: float | None = CPU_MATMUL_FLOPS):
        super().__init__()
        self.cpu_matmul_flops = cpu_matmul_flops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if (self.cpu_matmul_flops is not None and name in devices.MATMULS
                and not any(isinstance(a, FakeGpuTensor) for a in args)
                and devices.matmul_flops(name, args) > self.cpu_matmul_flops):
            shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            raise CpuComputeError(f"{name} of CPU tensors {shapes} ({devices.matmul_flops(name, args):.2g} FLOPs) while the "
                                  f"device is {NAME}: this rank computes on the CPU what belongs on its device")
        return _dispatch(func, args, kwargs or {})


# Calls on a device tensor that make a CUDA host wait for its device, beyond scalar reads and copies
# to the host: their output's size depends on the values (the host reads a count), or they check
# their input on the host (torch.multinomial's one-sample path, aten/src/ATen/native/Distributions.cpp).
_HOST_READS = {"aten.nonzero.default", "aten.masked_select.default", "aten.multinomial.default",
               "aten._unique2.default", "aten.unique_consecutive.default", "aten.repeat_interleave.Tensor"}


def waits_for_device(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether the ATen call `name` on these operands makes a CUDA host wait for the device: a scalar
    read (`.item()`, `bool(t)`, `int(t)`), a copy from the device to the host (`.cpu()`, `.tolist()`,
    `.to("cpu")`, `copy_` into a CPU tensor), boolean-mask indexing (a hidden nonzero) or a call of
    `_HOST_READS`. The fake device computes on the CPU, so these only show what a GPU would wait on."""
    on_device = [a for a in _flat((args, kwargs)) if isinstance(a, FakeGpuTensor)]
    if not on_device:
        return False
    if name == "aten._to_copy.default":
        target = kwargs.get("device")
        return isinstance(args[0], FakeGpuTensor) and target is not None and not _is_device(target)
    if name == "aten.copy_.default":
        return not isinstance(args[0], FakeGpuTensor) and isinstance(args[1], FakeGpuTensor)
    if name in _INDEXING:
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
    return name == "aten._local_scalar_dense.default" or name in _HOST_READS


class HostSyncs(TorchDispatchMode):
    """Entered inside `use_fake_gpu`: records each call that would make a CUDA host wait for the
    device (`waits_for_device`), by its ATen name, in `calls`."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if waits_for_device(str(func), args, kwargs):
            self.calls.append(str(func))
        return func(*args, **kwargs)


@contextlib.contextmanager
def use_fake_gpu(cpu_matmul_flops: float | None = CPU_MATMUL_FLOPS) -> Iterator[torch.device]:
    """The fake device, with its mode active (`cpu_matmul_flops`: the largest CPU matrix product
    allowed meanwhile; None: any). `Module.to` swaps each parameter's contents in place
    meanwhile: its default gives a wrapper-subclass result a new Parameter per module, which would
    untie tied weights (an LM head and its embedding) that a real `.to("cuda")` keeps tied."""
    import safetensors.torch as st

    device = install()
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    # safetensors finds tied tensors by their storage pointers, which a wrapper has none of: it is
    # shown the CPU tensor inside (for a CUDA tensor it reads the device pointer). PEFT's adapter
    # saving imported two of those functions by name.
    import peft.utils.other as peft_other
    patched = [(module, name, getattr(module, name)) for module, names in (
        (st, ("storage_ptr", "storage_size", "_end_ptr", "_is_complete")),
        (peft_other, ("storage_ptr", "storage_size"))) for name in names if hasattr(module, name)]
    for module, name, fn in patched:
        setattr(module, name, lambda t, fn=fn: fn(t.elem if isinstance(t, FakeGpuTensor) else t))
    try:
        with FakeGpu(cpu_matmul_flops):
            yield device
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
        for module, name, fn in patched:
            setattr(module, name, fn)


def real(x: Any) -> Any:
    """`x` (a tensor, or a structure of them) as plain CPU tensors."""
    return tree_map(lambda t: t.elem if isinstance(t, FakeGpuTensor) else t, x)
