"""Checks shared by the launchers: every bad argument becomes a `KernelArgumentError`."""

from typing import Optional, Sequence

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from .errors import KernelArgumentError

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def is_interpreted(kernel: object) -> bool:
    """True when `kernel` runs on the CPU under Triton's interpreter.

    Triton reads TRITON_INTERPRET once, when it is imported and decorates kernels; the whole of
    `triton.language` is then interpreted or compiled, so the mode cannot change later.
    """
    return isinstance(kernel, InterpretedFunction)


def check_tensor(
    name: str,
    tensor: object,
    *,
    ndim: int,
    dtypes: Sequence[torch.dtype],
    shape: Optional[Sequence[Optional[int]]] = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Checks type, rank, dtype and (where given) sizes; `None` in `shape` matches any size."""
    if not isinstance(tensor, torch.Tensor):
        raise KernelArgumentError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise KernelArgumentError(
            f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}"
        )
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(dtype) for dtype in dtypes)
        raise KernelArgumentError(f"{name} has dtype {tensor.dtype}; use one of {allowed}")
    if shape is not None:
        for axis, (actual, expected) in enumerate(zip(tensor.shape, shape)):
            if expected is not None and actual != expected:
                raise KernelArgumentError(
                    f"{name} has shape {tuple(tensor.shape)} but dimension {axis} must be "
                    f"{expected}"
                )
    if contiguous and not tensor.is_contiguous():
        raise KernelArgumentError(f"{name} must be contiguous; pass {name}.contiguous()")
    if tensor.dim() > 0 and tensor.numel() > 0 and tensor.stride(-1) != 1:
        raise KernelArgumentError(
            f"{name} must be contiguous in its last dimension (stride 1), got strides "
            f"{tensor.stride()}"
        )
    return tensor


def check_devices(kernel: object, tensors: dict) -> None:
    """All tensors on one device: CUDA normally, the CPU only under TRITON_INTERPRET=1."""
    devices = {name: tensor.device for name, tensor in tensors.items() if tensor is not None}
    first_name, first_device = next(iter(devices.items()))
    for name, device in devices.items():
        if device != first_device:
            raise KernelArgumentError(
                f"{name} is on {device} but {first_name} is on {first_device}; "
                "move all tensors to one device"
            )
    interpreted = is_interpreted(kernel)
    if interpreted and first_device.type != "cpu":
        raise KernelArgumentError(
            f"TRITON_INTERPRET=1 runs kernels on the CPU but the tensors are on {first_device}; "
            "move them to the CPU or unset TRITON_INTERPRET before importing Triton"
        )
    if not interpreted and first_device.type != "cuda":
        raise KernelArgumentError(
            f"the tensors are on {first_device}; the Triton kernels need CUDA tensors "
            "(or set TRITON_INTERPRET=1 before importing Triton to run them on the CPU)"
        )


def next_power_of_2(value: int) -> int:
    return triton.next_power_of_2(max(1, value))
