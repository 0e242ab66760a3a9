"""``ProgramSettings``: how ``build_step_programs`` builds the step programs, everything but the module, its
optimizer and the example batch; a wrong value raises ``ValueError`` at construction, naming it."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_sink.compiled.autocast_region import AutocastRegion
from lightning_sink.compiled.device_dataset import DeviceDataset, SinkIndices
from lightning_sink.compiled.host_dependence import TrainerReads
from lightning_sink.compiled.rank_sum import RankSum
from lightning_sink.loss_scale import DynamicLossScale, FixedLossScale, LossScaler

__all__ = ["ProgramSettings"]

_CLIP_ALGORITHMS = ("norm", "value")


@dataclass(frozen=True)
class ProgramSettings:
    """How to build the step programs.

    Attributes:
        loss_scale: a loss-scale setting (a ``LossScaler`` is used as is: the programs write its tensors), or None.
        gradient_clip_val: clip the window's gradient (after unscaling) to this norm or value; None: no clipping.
        gradient_clip_algorithm: ``"norm"`` (2-norm over all parameters, as ``clip_grad_norm_``) or ``"value"``.
        backend: ``torch.compile``'s backend (``"inductor"``; ``"aot_eager"`` compiles faster and generates no code).
        cuda_graph: also capture both programs as CUDA graphs (the module must be on a CUDA device).
        data: a staged dataset and the sink-indices buffer its batches are gathered from; then the example batch
            is None and ``accumulate()`` / ``update()`` take no batch (load each sink's indices first).
        micro_steps_per_call: above 1, also build ``run_several``: that many micro-steps in one call, a loop over
            its windows (whole windows of ``accumulation_steps``; a multiple of it). ``None``: decided from the
            step's size (``call_length.default_micro_steps``, and with staged data ``call_length.longest_call`` as
            a second, longer call; one per call under ``RankSum(all_reduce=...)``), the reason in
            ``programs.call_note``.
        accumulation_steps: the window length ``run_several`` assumes.
        loader_call: with batches from a loader (no ``data``) and the call's length decided by the build, the most
            micro-steps a longer call may stack (the sink's micro-batches, bounded by their bytes,
            ``call_length.loader_call``); None: no call longer than the default's.
        autocast: mixed precision: each forward runs in this autocast region (the backward outside it, the
            window's sum in fp32); None: the module's own dtypes.
        rank_sum: under DDP, how the update program sums the window across the processes (``RankSum``); every
            rank builds its programs with the same one. None: one process.
        trainer_reads: with a Lightning trainer, a context listing the trainer attributes the step reads that
            change while the fit runs (``host_dependence.py``: any of them refuses the programs); None: none.
    """

    loss_scale: DynamicLossScale | FixedLossScale | LossScaler | None = None
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    backend: str = "inductor"
    cuda_graph: bool = False
    data: tuple[DeviceDataset, SinkIndices] | None = None
    micro_steps_per_call: int | None = 1
    accumulation_steps: int = 1
    loader_call: int | None = None
    autocast: AutocastRegion | None = None
    rank_sum: RankSum | None = None
    trainer_reads: TrainerReads | None = None

    def __post_init__(self) -> None:
        self._check_clipping_and_precision()
        self._check_call_length()
        if self.cuda_graph and self.rank_sum is not None:
            raise ValueError("cuda_graph=True is for one process: the CUDA-graph programs do not sum across processes")
        if self.data is not None and self.data[1].capacity < self.calls:
            raise ValueError(
                f"micro_steps_per_call={self.calls} exceeds the sink indices' capacity={self.data[1].capacity}"
            )

    @property
    def calls(self) -> int:
        """The micro-steps per call the programs are built with (1 where the build decides it: it may unroll them
        later, from the step's size)."""
        return 1 if self.micro_steps_per_call is None else self.micro_steps_per_call

    @property
    def clip(self) -> tuple[str, float] | None:
        """(algorithm, value) of the window's clipping; None: none."""
        return None if self.gradient_clip_val is None else (self.gradient_clip_algorithm, float(self.gradient_clip_val))

    @property
    def chooses_call_length(self) -> bool:
        """Whether the build decides the call's length from the step's size (the eager route of a sum across
        processes runs one micro-step per call)."""
        return self.micro_steps_per_call is None and (self.rank_sum is None or self.rank_sum.all_reduce is None)

    def _check_clipping_and_precision(self) -> None:
        algorithm, value = self.gradient_clip_algorithm, self.gradient_clip_val
        if algorithm not in _CLIP_ALGORITHMS:
            raise ValueError(f"gradient_clip_algorithm={algorithm!r} is not valid: pass one of {_CLIP_ALGORITHMS}")
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"gradient_clip_val={value!r} is not valid: pass a number > 0 or None")
        if self.autocast is not None and not isinstance(self.autocast, AutocastRegion):
            raise ValueError(
                f"autocast={self.autocast!r} is not valid: pass an AutocastRegion(device_type, dtype) or None"
            )

    def _check_call_length(self) -> None:
        """The call's length against the window's and the route of the sum across processes."""
        calls, steps = self.calls, self.accumulation_steps
        for name, value in (("micro_steps_per_call", calls), ("accumulation_steps", steps)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is not valid: pass an int >= 1")
        if self.micro_steps_per_call is not None and calls % steps:
            raise ValueError(
                f"micro_steps_per_call={calls} is not a multiple of accumulation_steps={steps}: a call runs whole"
                " windows"
            )
        if calls > 1 and self.rank_sum is not None and self.rank_sum.all_reduce is not None:
            raise ValueError(
                "micro_steps_per_call > 1 needs the sum across processes inside the program: pass"
                " RankSum(group=...), not RankSum(all_reduce=...)"
            )
