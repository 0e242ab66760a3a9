"""Every bad argument fails at construction, naming the argument, the value and what is valid."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy

from lightning_sink import LossScalePrecision, SinkDDPStrategy, SinkModelParallelStrategy, SinkStrategy
from lightning_sink.callbacks import LossMonitor, LossScaleMonitor, TimeMonitor
from lightning_sink.loss_scale import DynamicLossScale, FixedLossScale
from lightning_sink.strategies.config import SinkConfig
from tests.helpers import TinyClassifier, loader, make_dataset, quiet_trainer

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
    for backend in ("gloo", "cpu:gloo,cuda:nccl", None):
        strategy_cls(process_group_backend=backend)
    if torch.cuda.is_available():
        strategy_cls(process_group_backend="nccl")


@pytest.mark.skipif(torch.cuda.is_available(), reason="nccl works on this machine")
@pytest.mark.parametrize("strategy_cls", [SinkDDPStrategy, SinkModelParallelStrategy])
def test_nccl_without_cuda_is_refused_at_construction(strategy_cls):
    with pytest.raises(
        ValueError, match=r"process_group_backend='nccl' cannot work on this machine, which has no CUDA device.*'gloo'"
    ):
        strategy_cls(process_group_backend="nccl")


def test_nccl_with_cpu_devices_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"process_group_backend='nccl' cannot work on the devices \['cpu'\]"):
        SinkDDPStrategy(process_group_backend="nccl", parallel_devices=[torch.device("cpu")])


def test_unknown_ddp_keyword_is_refused_at_construction():
    with pytest.raises(
        TypeError, match=r"SinkDDPStrategy got unknown keyword argument\(s\) bogus_kwarg=1: valid are .*find_unused"
    ):
        SinkDDPStrategy(bogus_kwarg=1)
    with pytest.raises(TypeError, match=r"unknown keyword argument\(s\) device_ids=\[0\]"):  # Lightning sets it
        SinkDDPStrategy(device_ids=[0])


def test_lightning_and_ddp_keywords_pass():
    strategy = SinkDDPStrategy(find_unused_parameters=True, static_graph=False, start_method="spawn")
    assert strategy._start_method == "spawn"


class SeesTheDDPModel(Callback):
    def on_train_start(self, trainer, pl_module):
        self.bucket_view = trainer.model.gradient_as_bucket_view


@pytest.mark.parametrize("strategy_cls", [SinkDDPStrategy, DDPStrategy])
def test_ddp_keywords_reach_ddp_as_with_stock_lightning(strategy_cls):
    seen = SeesTheDDPModel()
    strategy = strategy_cls(gradient_as_bucket_view=True)
    trainer = quiet_trainer(strategy=strategy, devices=1, max_epochs=1, callbacks=[seen])
    trainer.fit(TinyClassifier(), loader(make_dataset(num_samples=16), 4))
    assert seen.bucket_view is True


def test_a_device_that_does_not_exist_is_refused_at_construction():
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU (cuda:0 on a machine without any)
    with pytest.raises(ValueError, match=rf"device='{missing}' is not valid: this machine has .*'cuda'.*pass a device"):
        SinkStrategy(device=missing)
    with pytest.raises(ValueError, match=r"device='meta' is not valid: 'meta' is not a device to train on"):
        SinkStrategy(device="meta")
    with pytest.raises(ValueError, match=rf"parallel_devices=device\(type='cuda', index={missing[5:]}\) is not valid"):
        SinkDDPStrategy(parallel_devices=[torch.device(missing)])


@pytest.mark.parametrize(
    ("device", "reason"),
    [
        ("tpu", "not a device type autocast runs on"),
        ("meta", "not a device type autocast runs on"),
        ("cuda:0", "an autocast device type has no index"),
        (1, "not a string"),
    ],
)
def test_loss_scale_precision_refuses_unknown_autocast_devices(device, reason):
    with pytest.raises(ValueError, match=rf"device={device!r} is not valid: {reason}; pass one of 'cpu'"):
        LossScalePrecision("16-mixed", device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_loss_scale_precision_refuses_cuda_on_a_machine_without_it():
    with pytest.raises(ValueError, match=r"device='cuda' is not valid: this machine has no 'cuda' device"):
        LossScalePrecision("16-mixed", device="cuda")


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


COUNT_BOUND = r"is too large: a count must be at most 9223372036854775807 \(2\*\*63 - 1, the largest int64"


@pytest.mark.parametrize("strategy_cls", STRATEGIES)
@pytest.mark.parametrize("name", ["accumulation_steps", "sink_size"])
def test_a_count_beyond_what_the_process_holds_is_refused_stating_the_bound(strategy_cls, name):
    with pytest.raises(ValueError, match=rf"^{name}=1180591620717411303424 {COUNT_BOUND}"):
        strategy_cls(**{name: 2**70})
    strategy_cls(**{name: 2**63 - 1})  # the bound itself is a count the process holds


@pytest.mark.parametrize(
    "make, text",
    [
        (lambda: SinkConfig(4, sink_size=8, prefetch_depth=2**64), "prefetch_depth=18446744073709551616 "),
        (lambda: SinkConfig(device_data_budget=2**64), "device_data_budget=18446744073709551616 "),
        (lambda: SinkModelParallelStrategy(data_parallel_size=2**64), "data_parallel_size=18446744073709551616 "),
        (lambda: DynamicLossScale(scale_window=2**64), r"DynamicLossScale\(scale_window=18446744073709551616\) "),
        (lambda: DynamicLossScale(hysteresis=2**64), r"DynamicLossScale\(hysteresis=18446744073709551616\) "),
        (lambda: LossMonitor(per_print_times=2**64), "per_print_times=18446744073709551616 "),
        (lambda: LossScaleMonitor(per_print_times=2**64), "per_print_times=18446744073709551616 "),
        (lambda: TimeMonitor(data_size=2**64), "data_size=18446744073709551616 "),
    ],
)
def test_every_count_argument_is_bounded(make, text):
    with pytest.raises(ValueError, match=text + COUNT_BOUND):
        make()


@pytest.mark.parametrize("cls, name", [(DynamicLossScale, "init_scale"), (FixedLossScale, "loss_scale")])
@pytest.mark.parametrize("value, named", [(float("nan"), r"NaN \(not a number\)"), (float("inf"), "infinite")])
def test_nan_and_infinite_scales_are_named_as_such(cls, name, value, named):
    with pytest.raises(
        ValueError, match=rf"^{cls.__name__}\({name}={value!r}\) is {named}: pass a finite number > 0\.$"
    ):
        cls(**{name: value})
    with pytest.raises(ValueError, match=r"\(scale_factor=-inf\) is infinite"):
        DynamicLossScale(scale_factor=-float("inf"))
