"""FSDPWindow on a real 1-rank FSDP2 model: the FSDP2 internals it reads still hold the window's partial sums."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lightning_sink.strategies.fsdp_window import FSDPWindow


def one_rank_mesh():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    return init_device_mesh("cpu", (1,))


def micro_batches():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(4, 8, generator=generator) for _ in range(3)]


@pytest.mark.parametrize("policy", [None, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)])
def test_partial_sums_are_the_unreduced_gradient_sums_and_can_be_restored(policy):
    mesh = one_rank_mesh()
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    kwargs = {"mesh": mesh} if policy is None else {"mesh": mesh, "mp_policy": policy}

    def make_sharded() -> nn.Module:
        sharded = copy.deepcopy(plain)
        for layer in (sharded[0], sharded[2]):
            fully_shard(layer, **kwargs)
        return fully_shard(sharded, **kwargs)

    sharded = make_sharded()
    window = FSDPWindow(sharded, list(sharded.parameters()), data_parallel_size=1)
    window.set_gradient_sync(False)
    inputs = micro_batches()
    for x in inputs[:2]:
        sharded(x).square().mean().backward()
        window.end_micro_step()
    assert all(param.grad is None for param in sharded.parameters())  # nothing reduced while sync is off

    state = window.state_dict()
    sums = state["buffer"]
    if policy is None:  # fp32: exactly what autograd accumulates on the plain model
        for x in inputs[:2]:
            plain(x).square().mean().backward()
        assert [s.shape for s in sums] == [p.shape for p in plain.parameters()]
        for summed, param in zip(sums, plain.parameters()):
            assert torch.equal(summed, param.grad)
    else:  # bf16 parameters: FSDP2 keeps the sum in reduce_dtype, fp32
        assert all(s.dtype == torch.float32 for s in sums)

    # A resume: a fresh FSDP2 model (no backward yet) gets the sums back; the update step's backward then reduces
    # the sums plus the last micro-step.
    resumed = make_sharded()
    restored = FSDPWindow(resumed, list(resumed.parameters()), data_parallel_size=1)
    restored.load_state_dict(state)
    restored.restore_pending()
    assert all(torch.equal(a, b) for a, b in zip(restored.state_dict()["buffer"], sums))
    restored.set_gradient_sync(True)
    resumed(inputs[2]).square().mean().backward()
    if policy is None:
        plain(inputs[2]).square().mean().backward()
        for param, reference in zip(resumed.parameters(), plain.parameters()):
            assert torch.equal(param.grad.full_tensor(), reference.grad)


def test_without_fully_shard_data_parallel_is_refused():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="data_parallel_size=2 but configure_model applied no `fully_shard`"):
        FSDPWindow(model, list(model.parameters()), data_parallel_size=2)


def test_partial_sums_from_another_mesh_are_refused_by_shape():
    mesh = one_rank_mesh()
    model = fully_shard(nn.Linear(8, 4), mesh=mesh)
    window = FSDPWindow(model, list(model.parameters()), data_parallel_size=1)
    window.load_state_dict({"micro_steps": 1, "buffer": [torch.zeros(2, 8), torch.zeros(4)]})
    with pytest.raises(ValueError, match=r"shape \(2, 8\) where this rank's parameter part has shape \(4, 8\)"):
        window.restore_pending()
