"""torch.distributed internals: the fake process group (layout inference), the traced all-reduce (compiled update
programs) and FSDP2's window state."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as functional_collectives

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = [
    "init_fake_process_group",
    "traced_all_reduce_sum",
    "fsdp_params",
    "fsdp_partial_sum",
    "fsdp_unsharded_param",
    "set_fsdp_partial_sum",
]


def init_fake_process_group(world_size: int) -> None:
    """A default process group of ``world_size`` ranks, this one rank 0, with no peers: collectives return at once
    and produce nothing. Built from torch's C++ fake process group, registered as torch's own test utility does,
    without importing ``torch.testing``."""
    from torch._C._distributed_c10d import FakeProcessGroup, FakeStore

    def create(common_options: Any, backend_options: Any) -> Any:
        # torch's stub for _create_internal lacks the options argument its C++ binding takes
        return FakeProcessGroup._create_internal(  # type: ignore[call-arg]
            common_options.group_rank, common_options.group_size, backend_options
        )

    dist.Backend.register_backend(dist.Backend.FAKE, create, extended_api=True, devices=["cpu", "cuda"])
    dist.init_process_group(dist.Backend.FAKE, rank=0, world_size=world_size, store=FakeStore())


def traced_all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``tensor`` summed over ``group``'s ranks, out of place, as an operation ``torch.compile`` traces into its
    graph (a functional collective: torch's public ``dist.all_reduce`` works in place on the process group and
    breaks the graph). Meant for compiled programs: run eagerly, it waits for the sum at once."""
    return functional_collectives.all_reduce(tensor, "sum", group)


# FSDP2 keeps a window's partial sums where no public API reaches them. The four functions below are the only places
# that touch its internals; tests/strategies/test_fsdp_window.py fails loudly when torch moves them.
def fsdp_params(modules: list[FSDPModule]) -> list[Any]:
    """The ``FSDPParam`` objects of ``modules`` (FSDP2's per-parameter state), in order."""
    return [
        fsdp_param
        for module in modules
        for group in module._get_fsdp_state()._fsdp_param_groups
        for fsdp_param in group.fsdp_params
    ]


def fsdp_unsharded_param(fsdp_param: Any) -> torch.Tensor:
    """The unsharded parameter whose ``.grad`` FSDP2 accumulates into with gradient sync off."""
    return fsdp_param._unsharded_param


def fsdp_partial_sum(fsdp_param: Any) -> torch.Tensor | None:
    """The unreduced gradient sum: in ``reduce_dtype`` when that differs from the parameter's dtype."""
    if fsdp_param.unsharded_accumulated_grad is not None:
        return fsdp_param.unsharded_accumulated_grad
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    return None if unsharded is None else unsharded.grad


def set_fsdp_partial_sum(fsdp_param: Any, grad: torch.Tensor | None) -> None:
    """Put ``grad`` back where ``fsdp_partial_sum`` reads it: the accumulated gradient when its dtype differs from the
    parameter's, else the unsharded parameter's ``.grad``."""
    unsharded = fsdp_param._unsharded_param
    if grad is not None and grad.dtype != unsharded.dtype:
        fsdp_param.unsharded_accumulated_grad, unsharded.grad = grad, None
    else:
        fsdp_param.unsharded_accumulated_grad, unsharded.grad = None, grad
