"""Train on 4 gloo ranks (FSDP2 + TP on a 2x2 mesh, Adam), reshard offline to 2 ranks with another split
(TP only), continue training from the resharded files: identical to continuing from DCP's own load-time
resharding, and the losses continue those of the original run. And the other way round, 2 ranks to 4."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.reshard.train_worker import spawn


@pytest.mark.slow
@pytest.mark.parametrize(("before", "after"), [("dp2_tp2", "tp2"), ("tp2", "dp2_tp2")])
def test_training_continues_from_the_resharded_checkpoint(tmp_path: Path, before: str, after: str):
    source = tmp_path / "source"
    spawn("train", 4 if before == "dp2_tp2" else 2, before, str(source))
    spawn("resume", 4 if after == "dp2_tp2" else 2, after, str(source), str(tmp_path))
    mine = torch.load(tmp_path / "result_resharded.pt", weights_only=True)
    by_dcp = torch.load(tmp_path / "result_dcp.pt", weights_only=True)
    assert mine["losses"] == by_dcp["losses"]
    for name in by_dcp["params"]:
        assert torch.equal(mine["params"][name], by_dcp["params"][name]), name
        assert torch.equal(mine["exp_avg"][name], by_dcp["exp_avg"][name]), name
    continued = torch.load(f"{source}.continued.pt", weights_only=True)  # the 4-rank run's own next losses
    assert mine["losses"] == pytest.approx(continued, rel=1e-5)
