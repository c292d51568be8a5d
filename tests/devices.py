"""Devices for the tests: which ones this machine has, and a stand-in for an accelerator's tensor.

DEVICES is the CPU, and "cuda" marked to be skipped (saying why) where torch sees no GPU: a test
parametrized by it runs its CPU item everywhere and its CUDA item where there is a GPU, each its own
item, so the CPU one passes or fails on its own. DEVICE_PAIRS puts two replicas of one swarm on the
CPU everywhere and on the CPU and the GPU where there is one. `Foreign` stands in for a tensor that
lives on an accelerator, seen from a CPU-only machine: its metadata can be read and it can be copied
to the CPU exactly, and any computation on it raises. Code that computes (casts, transforms, selects)
on its input's own device fails with it here as its results would round or order differently on a GPU.
"""

from __future__ import annotations

import json

import pytest
import torch

NO_GPU = (f"needs a CUDA device: torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'}) sees none "
          "here; the CPU variant of this test ran instead")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
DEVICE_PAIRS = [pytest.param(("cpu", "cpu"), id="cpu+cpu"),
                pytest.param(("cpu", "cuda"), id="cpu+cuda", marks=needs_cuda)]


class ForeignComputation(AssertionError):
    """Something computed on a tensor of another device instead of copying it to the CPU first."""


_METADATA = {torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel, torch.Tensor.is_complex, torch.Tensor.detach,
             torch.Tensor.is_floating_point, torch.Tensor.element_size, torch.Tensor.__repr__,
             torch.Tensor.__format__}


class Foreign(torch.Tensor):
    """A tensor as an accelerator holds it, seen from the CPU: metadata and an exact copy to the CPU only."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__get__" or func in _METADATA:  # shape, dtype, device, ...
            return super().__torch_function__(func, types, args, kwargs)
        if func is torch.Tensor.to or func is torch.Tensor.cpu:
            source = args[0]
            device, dtype = ((torch.device("cpu"), None) if func is torch.Tensor.cpu
                             else torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items()
                                                                       if k != "copy"})[:2])
            if device is not None and device.type == "cpu" and dtype in (None, source.dtype):
                with torch._C.DisableTorchFunctionSubclass():
                    return source.clone()  # what a copy off the device gives: a plain CPU tensor
            raise ForeignComputation(f"Tensor.to{args[1:]} {kwargs} converts on the tensor's own device")
        raise ForeignComputation(f"{getattr(func, '__name__', func)} computed on the tensor's own device")


def foreign(x: torch.Tensor) -> Foreign:
    return x.clone().as_subclass(Foreign)


def state_bytes(blob: bytes) -> tuple[dict, bytes]:
    """A safetensors blob as (its header, its tensor bytes). The header's `__metadata__` map comes out in
    another key order from call to call (safetensors keeps it in a Rust HashMap), so it is compared as
    JSON; the tensor bytes are compared as bytes."""
    size = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8:8 + size]), blob[8 + size:]


