"""``mesh_clipping`` in one process, on plain tensors: the same as torch's own clipping (the multi-mesh case runs on 4
processes in test_multinode.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_sink.strategies.mesh_clipping import MeshClipping, clip_grad_norm_across_meshes, clip_grad_value_local


def parameters_with_gradients(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in ((4, 3), (5,), (2, 2, 2))]
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)
    params.append(torch.nn.Parameter(torch.zeros(3)))  # no gradient: left alone
    return params


@pytest.mark.parametrize("max_norm", [0.1, 1e6])
def test_norm_clipping_equals_torch_clip_grad_norm(max_norm):
    ours, theirs = parameters_with_gradients(), parameters_with_gradients()
    total = clip_grad_norm_across_meshes(ours, max_norm, world_size=1)
    expected_total = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert torch.allclose(total, expected_total, rtol=1e-6)
    for mine, reference in zip(ours, theirs):
        assert (mine.grad is None) == (reference.grad is None)
        if mine.grad is not None:
            assert torch.allclose(mine.grad, reference.grad, rtol=1e-6, atol=0)


def test_value_clipping_equals_torch_clip_grad_value():
    ours, theirs = parameters_with_gradients(), parameters_with_gradients()
    clip_grad_value_local(ours, 0.5)
    torch.nn.utils.clip_grad_value_(theirs, 0.5)
    for mine, reference in zip(ours, theirs):
        if mine.grad is not None:
            assert torch.equal(mine.grad, reference.grad)


def test_mesh_clipping_routes_a_precision_plugin_and_gives_it_back():
    from lightning.pytorch.plugins.precision import Precision

    plugin = Precision()
    params = parameters_with_gradients()
    optimizer = torch.optim.SGD(params, lr=0.1)
    clipping = MeshClipping(plugin, world_size=1)
    plugin.clip_gradients(optimizer, 0.5, "value")  # (Lightning passes the algorithm as its enum, equal to "value")
    assert max(float(p.grad.abs().max()) for p in params if p.grad is not None) <= 0.5
    clipping.remove()
    assert "clip_grad_by_norm" not in vars(plugin) and "clip_grad_by_value" not in vars(plugin)
