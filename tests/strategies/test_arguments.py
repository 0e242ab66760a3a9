"""Every bad argument fails at construction, naming the argument, the value and what is valid."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest

from lightning_sink import LossScalePrecision, SinkDDPStrategy, SinkModelParallelStrategy, SinkStrategy
from lightning_sink.loss_scale import DynamicLossScale, FixedLossScale
from lightning_sink.strategies.config import SinkConfig

STRATEGIES = [SinkStrategy, SinkDDPStrategy, SinkModelParallelStrategy]


@pytest.mark.parametrize("strategy_cls", STRATEGIES)
def test_prefetch_depth_without_sink_size(strategy_cls):
    with pytest.raises(
        ValueError,
        match=r"prefetch_depth=2 applies to sink mode only, but sink_size=None: set"
        r" sink_size=K",
    ):
        strategy_cls(prefetch_depth=2)


@pytest.mark.parametrize("strategy_cls", STRATEGIES)
@pytest.mark.parametrize(
    "name, value, valid",
    [
        ("accumulation_steps", "4", r"pass an int >= 1"),
        ("sink_size", "8", r"pass an int >= 1 \(micro-batches per sink\), -1"),
        ("prefetch_depth", "2", r"pass an int >= 1 \(batches a background thread reads ahead\), 0"),
        ("sink_size", 0, r"pass an int >= 1"),
    ],
)
def test_string_numbers_and_out_of_range_values(strategy_cls, name, value, valid):
    kwargs = {name: value, **({"sink_size": 4} if name == "prefetch_depth" else {})}
    with pytest.raises(ValueError, match=rf"{name}={value!r} is not valid: {valid}"):
        strategy_cls(**kwargs)


@pytest.mark.parametrize("strategy_cls", [SinkDDPStrategy, SinkModelParallelStrategy])
def test_unknown_process_group_backend(strategy_cls):
    with pytest.raises(ValueError, match=r"process_group_backend='glooo' is not valid: choose one of 'gloo', 'nccl'"):
        strategy_cls(process_group_backend="glooo")


@pytest.mark.parametrize("strategy_cls", [SinkDDPStrategy, SinkModelParallelStrategy])
def test_known_process_group_backends_pass(strategy_cls):
    for backend in ("gloo", "nccl", "cpu:gloo,cuda:nccl", None):
        strategy_cls(process_group_backend=backend)


@pytest.mark.parametrize("strategy_cls", [SinkDDPStrategy, SinkModelParallelStrategy])
def test_negative_timeout(strategy_cls):
    with pytest.raises(
        ValueError,
        match=r"timeout=datetime.timedelta\(days=-1, seconds=86399\) is negative: pass a"
        r" datetime.timedelta >= 0",
    ):
        strategy_cls(timeout=timedelta(seconds=-1))
    with pytest.raises(TypeError, match=r"timeout=30 is not valid: pass a datetime.timedelta >= 0"):
        strategy_cls(timeout=30)


def test_unknown_device_type():
    with pytest.raises(ValueError, match=r"device='gpu:0' is not a device torch knows: pass e.g. 'cpu', 'cuda'"):
        SinkStrategy(device="gpu:0")
    with pytest.raises(TypeError, match=r"device=\['cpu'\] is not valid: pass a device string"):
        SinkStrategy(device=["cpu"])
    with pytest.raises(ValueError, match=r"parallel_devices='tpu7' is not a device torch knows"):
        SinkDDPStrategy(parallel_devices=["tpu7"])


def test_fixed_loss_scale_wants_a_real_bool():
    with pytest.raises(
        TypeError,
        match=r"FixedLossScale\(drop_overflow_update='no'\) is not valid: pass True or"
        r" False",
    ):
        FixedLossScale(drop_overflow_update="no")


def test_skip_window_on_overflow_wants_a_real_bool():
    with pytest.raises(TypeError, match=r"skip_window_on_overflow='yes' is not valid: pass True or False"):
        LossScalePrecision("16-mixed", skip_window_on_overflow="yes")


@pytest.mark.parametrize(
    "cls, name", [(DynamicLossScale, "init_scale"), (DynamicLossScale, "max_scale"), (FixedLossScale, "loss_scale")]
)
def test_scales_that_do_not_fit_the_scale_dtype(cls, name):
    kwargs = {name: 1e39, **({"max_scale": 1e39} if name == "init_scale" else {})}
    with pytest.raises(
        ValueError,
        match=rf"{cls.__name__}\({name}=1e\+39\) does not fit the loss scale's dtype"
        r" torch.float32 \(largest finite value 3.403e\+38\)",
    ):
        cls(**kwargs)


def test_scale_given_as_a_string():
    with pytest.raises(TypeError, match=r"DynamicLossScale\(init_scale='1024'\) is not valid: pass a number"):
        DynamicLossScale(init_scale="1024")


def test_the_strategy_arguments_are_one_frozen_validated_object():
    strategy = SinkStrategy(accumulation_steps=4, sink_size=8, prefetch_depth=0)
    assert strategy.sink_config == SinkConfig(accumulation_steps=4, sink_size=8, prefetch_depth=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.sink_config.sink_size = 2
    with pytest.raises(ValueError, match=r"partial_window='maybe' is not valid"):
        SinkConfig(partial_window="maybe")
