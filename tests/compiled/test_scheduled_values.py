"""The optimizer rule reads the scheduled hyperparameters of ``param_groups`` two ways: ``refresh`` copies them into
the tensors the one-update programs read, and ``current_values`` reads them as floats for the rows of a call of
several updates. Both must give each name the value ``param_groups`` holds, in the order of ``rule.names``; here the
expected values are read from ``param_groups`` by the test itself, every one distinct, over two groups."""

from __future__ import annotations

import pytest
import torch

from lightning_sink.compiled.optimizer_rules import OptimizerRule, optimizer_rule


def _expected(settings: dict, kind: str) -> list[float]:
    if kind == "sgd":
        return [settings["lr"], settings["momentum"], settings["weight_decay"]]
    beta1, beta2 = settings["betas"]
    return [settings["lr"], beta1, beta2, settings["eps"], settings["weight_decay"]]


def _optimizer(kind: str, first: list[torch.Tensor], second: list[torch.Tensor]) -> torch.optim.Optimizer:
    if kind == "sgd":
        groups = [
            {"params": first, "lr": 0.11, "momentum": 0.12, "weight_decay": 0.13},
            {"params": second, "lr": 0.21, "momentum": 0.22, "weight_decay": 0.23},
        ]
        return torch.optim.SGD(groups)
    groups = [
        {"params": first, "lr": 0.11, "betas": (0.12, 0.13), "eps": 0.14, "weight_decay": 0.15},
        {"params": second, "lr": 0.21, "betas": (0.22, 0.23), "eps": 0.24, "weight_decay": 0.25},
    ]
    return (torch.optim.Adam if kind == "adam" else torch.optim.AdamW)(groups)


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_both_readers_give_each_name_the_value_param_groups_holds(kind: str) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    params = list(net.parameters())
    optimizer = _optimizer(kind, params[:2], params[2:])
    rule = optimizer_rule(optimizer, params)
    assert isinstance(rule, OptimizerRule), rule
    for step in range(2):  # as built, then after a scheduler-like change of every value
        expected = [_expected(group, kind) for group in optimizer.param_groups]
        assert rule.current_values() == expected  # float64 tensors hold a Python float exactly
        refreshed = [[float(group.scheduled[name]) for name in rule.names] for group in rule.groups]
        assert refreshed == expected
        for group in optimizer.param_groups:
            for name, value in list(group.items()):
                if name == "betas":
                    group[name] = (value[0] / 2, value[1] / 3)
                elif isinstance(value, float) and name in ("lr", "momentum", "weight_decay", "eps"):
                    group[name] = value * (5 + step)
        rule.refresh()
