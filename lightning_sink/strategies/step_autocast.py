"""The autocast region the whole-step programs build for a fit's precision plugin, or why they cannot.

Lightning's ``MixedPrecision`` (``precision="bf16-mixed"``, and ``"16-mixed"``, which the sink strategies run through
``LossScalePrecision("16-mixed")`` with the loss scale on the device) runs ``training_step`` inside its
``train_step_context``: ``torch.autocast`` and nothing else. The programs build that region into their traced forward.
Its settings are read from torch's autocast state inside the plugin's own context (``AutocastRegion.entered_by``),
so they are the plugin's, not a copy of Lightning's rules. A plugin whose context does anything besides autocast
(``HalfPrecision``'s default dtype, a user's override) is not built in: the fit runs the eager step programs.
"""

from __future__ import annotations

from lightning.pytorch.plugins.precision import MixedPrecision, Precision

from lightning_sink.compiled import AutocastRegion
from lightning_sink.precision import LossScalePrecision

__all__ = ["step_autocast"]


def _autocast_only(plugin: Precision) -> bool:
    """Whether entering ``plugin.train_step_context()`` does exactly what ``MixedPrecision`` does: enter autocast."""
    kind = type(plugin)
    return (
        isinstance(plugin, MixedPrecision)
        and kind.train_step_context is Precision.train_step_context
        and kind.forward_context is MixedPrecision.forward_context
    )


def step_autocast(plugin: Precision) -> AutocastRegion | str | None:
    """The autocast region ``plugin`` runs ``training_step`` in (None: none), or the one-line reason the programs
    cannot build its context."""
    kind = type(plugin)
    owner = plugin  # the plugin whose contexts are entered
    if (
        isinstance(plugin, LossScalePrecision)
        and kind.train_step_context is Precision.train_step_context
        and kind.forward_context is LossScalePrecision.forward_context
    ):
        owner = plugin.context_plugin
    if type(owner).train_step_context is Precision.train_step_context and (
        type(owner).forward_context is Precision.forward_context
    ):
        return None
    if not _autocast_only(owner):
        return (
            f"the precision plugin {kind.__name__} runs training_step in a context other than autocast (a default"
            " dtype, as '16-true', 'bf16-true' and '64-true' set) that the programs do not build: use"
            " precision='32-true', '16-mixed' or 'bf16-mixed' (a LossScalePrecision of these works) or"
            " graph_mode='eager'"
        )
    assert isinstance(owner, MixedPrecision)  # _autocast_only
    return AutocastRegion.entered_by(plugin.train_step_context(), owner.device)
