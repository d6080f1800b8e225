"""``capture``: the option every callback that can ride on the training step takes, with one meaning.

``"separate"`` reads the step by a pass of the callback's own; ``"training_step"`` installs the one-pass
engine's hooks (:class:`~lens_callbacks.credit.engines.ghost.RideAlong`) for the training step's own forward
and backward and reads the step from what they captured and ``.grad``.
"""

from __future__ import annotations

from typing import Sequence

CAPTURES = ("separate", "training_step")

#: What riding along does to a compiled step (benchmarks/compiled_ride_drift.py, a 2-layer Llama, Adam).
COMPILED_RIDE_DRIFT = (
    "measured on a 2-layer Llama: 29 graph breaks, and parameters 3e-5 (inductor) and 6e-6 (aot_eager) apart from an "
    "unaudited run after 6 steps"
)


def check_capture(capture: object) -> str:
    """``capture`` itself, or a ValueError naming the valid options."""
    if capture not in CAPTURES:
        raise ValueError(f"`capture` must be one of {list(CAPTURES)}, got {capture!r}.")
    return str(capture)


def compiled_blocks_ride(compiled: Sequence[str]) -> str:
    """Why a step of a compiled module is not captured (``compiled``: the compiled parts' names)."""
    return (
        f"torch.compile ({compiled[0]}): the layer hooks riding along would break the compiled graph and change what "
        f"it computes ({COMPILED_RIDE_DRIFT}); the separate pass, which runs the module eagerly and leaves the "
        "compiled step as it is, reads it instead"
    )
