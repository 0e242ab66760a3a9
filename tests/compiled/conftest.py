"""The fixture the compiled-program fit tests share."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_sink.compiled.step_programs import StepPrograms


@pytest.fixture
def several_calls(monkeypatch) -> list[int]:
    """How many micro-batches each ``run_several`` call of the fit trained."""
    calls: list[int] = []
    original = StepPrograms.run_several

    def counted(self: StepPrograms, batches: Any = None, hyperparameters: Any = None, count: Any = None) -> Any:
        outputs = original(self, batches, hyperparameters, count)
        calls.append(len(outputs))
        return outputs

    monkeypatch.setattr(StepPrograms, "run_several", counted)
    return calls
