"""infer_layout on its own (no real run): documented FSDP2/TP placement rules and clear errors."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lightning_sink.layout_inference import infer_layout, main
from tests.helpers import TinyClassifier
from tests.strategies.mp_models import TPClassifier


def test_data_parallel_only_mesh_shards_rows_evenly_in_rank_order():
    layout = infer_layout(TPClassifier, 4, 1, with_optimizer=False)
    assert (layout.world_size, layout.mesh.shape, layout.mesh.ranks) == (4, (4, 1), ((0,), (1,), (2,), (3,)))
    weight = layout.tensors["state_dict.net.0.weight"]  # 16 x 8; fully_shard splits dim 0 over the 4 dp ranks
    assert weight.placements == ("Shard(0)", "Shard(0)")  # (ColwiseParallel on a 1-rank mesh: a trivial split)
    assert [(c.rank, c.offsets, c.sizes) for c in weight.chunks] == [(r, (4 * r, 0), (4, 8)) for r in range(4)]
    assert not any(key.startswith("optimizer_0.") for key in layout.tensors)


def test_tensor_parallel_only_mesh_splits_columns_of_the_row_wise_layer():
    layout = infer_layout(TPClassifier, 1, 4, init_args={"optimizer": "sgd"})
    weight = layout.tensors["state_dict.net.2.weight"]  # 4 x 16, RowwiseParallel: input features split
    assert weight.placements == ("Shard(0)", "Shard(1)")  # (fully_shard on a 1-rank data-parallel mesh: trivial)
    assert [(c.rank, c.offsets, c.sizes) for c in weight.chunks] == [(r, (0, 4 * r), (4, 4)) for r in range(4)]
    assert layout.tensors["optimizer_0.state.net.2.weight.momentum_buffer"].placements == weight.placements
    assert not dist.is_initialized()  # the fake process group is gone


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(module=TPClassifier, data_parallel_size=0, tensor_parallel_size=2), "data_parallel_size=0"),
        (dict(module=TPClassifier, data_parallel_size=2, tensor_parallel_size="2"), "tensor_parallel_size='2'"),
        (dict(module="no_such_package.Model", data_parallel_size=1, tensor_parallel_size=1), "no_such_package"),
        (dict(module="Model", data_parallel_size=1, tensor_parallel_size=1), "class path"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        infer_layout(**kwargs)


def test_a_module_without_configure_model_has_no_tensor_parallel_plan():
    # Data parallel only, it is sharded as its minimal configure_model would (tests/test_layout_plain_models.py).
    with pytest.raises(TypeError, match="configure_model"):
        infer_layout(TinyClassifier, 2, 2)
    assert not dist.is_initialized()


def test_cli_rejects_init_args_that_are_not_a_json_object(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(
            [
                "--model",
                "tests.strategies.mp_models.TPClassifier",
                "--init-args",
                "[1]",
                "--data-parallel-size",
                "1",
                "--tensor-parallel-size",
                "1",
                "--output",
                str(tmp_path / "x.json"),
            ]
        )
    assert "--init-args" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_refused_inside_a_distributed_run():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    with pytest.raises(RuntimeError, match="outside a distributed run"):
        infer_layout(TPClassifier, 1, 1)


def test_cli_reports_a_bad_mesh_size_without_writing(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "--model",
                "tests.strategies.mp_models.TPClassifier",
                "--data-parallel-size",
                "0",
                "--tensor-parallel-size",
                "1",
                "--output",
                str(tmp_path / "x.json"),
            ]
        )
    assert exit_info.value.code == 2
    assert "data_parallel_size=0" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
