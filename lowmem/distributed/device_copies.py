"""Copies of a batch's tensors from host memory to the device."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` copied to `device` without making the host wait.

    From pageable memory a copy to a GPU waits for the work already queued on the device; from page-locked
    (pinned) memory it is queued like a kernel. A batch is a few hundred kB, so pinning it here costs little
    where the DataLoader did not (pin_memory is off on a low memory budget).
    """
    if device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
