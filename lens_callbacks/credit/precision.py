r"""How exact a credit reading can be: unit roundoffs, the floor of ``conservation_error``, and autocast.

``conservation_error = ‖Σ_S g_S − g_full‖ / ‖g_full‖`` is zero in exact arithmetic. Computed, each part's
gradient carries a rounding error proportional to its own size, so the parts' sum is off by up to a few
unit roundoffs of the coarsest dtype the pass computed in, times ``Σ_S ‖g_S‖ / ‖g_full‖`` (the
cancellation: parts much larger than their sum cancel, and their rounding does not). The floor is

    floor = FLOOR_UNITS[dtype] · u · max(1, scale)

with ``u`` the unit roundoff of the coarser of the audit dtype and the dtype the forward computed the
gradient's values in (autocast's, or a float32 normalisation inside a float64 model: :class:`PrecisionWatch`),
and ``scale`` the cancellation where the norms were read (the forward-mode engine's scalar check uses
``Σ_{k,t} |∇terms[k,t] · g_full| / ‖g_full‖²``, its own cancellation over positions; a reading of projected
shares alone uses ``Σ_S |projected_share_S|``, which bounds the cancellation from below, and allows
``PROJECTED_FACTOR`` times more units). A reading over its floor is not rounding: the parts do not add up
to the gradient they claim to split (see :mod:`lens_callbacks.credit.guard`).

``FLOOR_UNITS`` was set from healthy runs (``benchmarks/conservation_floor.py`` writes them to
``benchmarks/results/``): every engine, float64, float32, bfloat16 and float32 under bf16 autocast, on
GPT-2, Llama, Qwen2 (tied), ``nn.MultiheadAttention`` and a Llama at a 32k vocabulary. The most any healthy
reading used was 2.3 units in float32/float64 and 0.7 in bfloat16 with the norms read (4.6 and 0.9 with
projected shares alone): the floor allows 64 and 8 (about 25 and 10 times more; 16 times that again for
projected shares alone).

Pure torch; never imports lightning.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch
import torch.autograd.forward_ad as fwAD
from torch.overrides import TorchFunctionMode

from .graph import graph_nodes

__all__ = [
    "UNIT_ROUNDOFF",
    "FLOOR_UNITS",
    "PROJECTED_FACTOR",
    "coarsest",
    "unit_roundoff_of",
    "rounding_scale",
    "floor_units",
    "dtype_named",
    "conservation_floor",
    "autocast_dtype",
    "PrecisionWatch",
]

#: Unit roundoff ``u`` (half the machine epsilon) of the floating dtypes.
UNIT_ROUNDOFF: dict[torch.dtype, float] = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}

#: Rounding units (times the cancellation) a healthy reading's ``conservation_error`` stays under, by the
#: coarsest dtype in play. In float32 and float64 the long reductions of real shapes add to a piece's own
#: rounding (up to 2.3 units seen); in bfloat16 and float16 the pieces' own rounding dominates (0.7 seen).
FLOOR_UNITS: dict[torch.dtype, float] = {
    torch.float64: 64.0,
    torch.float32: 64.0,
    torch.bfloat16: 8.0,
    torch.float16: 8.0,
}
#: Where only projected shares were read the cancellation is bounded from below only: this many times more.
PROJECTED_FACTOR = 16.0


def dtype_named(name: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    """``torch.float32`` for ``"float32"`` (or a dtype itself); None for anything that names no dtype."""
    if isinstance(name, torch.dtype):
        return name
    d = getattr(torch, str(name).replace("torch.", ""), None) if name else None
    return d if isinstance(d, torch.dtype) else None


def coarsest(*dtypes: Union[str, torch.dtype, None]) -> torch.dtype:
    """The coarsest of ``dtypes`` (names or dtypes; unknown ones are skipped), float32 if none is known.

    Example:
        >>> coarsest("float32", torch.bfloat16, None)
        torch.bfloat16
    """
    known = [d for d in map(dtype_named, dtypes) if d in UNIT_ROUNDOFF]
    return max(known, key=UNIT_ROUNDOFF.__getitem__) if known else torch.float32


def unit_roundoff_of(*dtypes: Union[str, torch.dtype, None]) -> float:
    """``u`` of the coarsest of ``dtypes`` (see :func:`coarsest`).

    Example:
        >>> unit_roundoff_of("float32", torch.bfloat16) == 2.0**-8
        True
    """
    return UNIT_ROUNDOFF[coarsest(*dtypes)]


def rounding_scale(
    dtype: Union[str, torch.dtype, None], compute_dtype: Union[str, torch.dtype, None] = None, scale: float = 1.0
) -> float:
    """``u · max(1, scale)``: what one rounding unit of a reading's ``conservation_error`` is (NaN scale reads as 1)."""
    s = scale if isinstance(scale, (int, float)) and math.isfinite(scale) else 1.0
    return unit_roundoff_of(dtype, compute_dtype) * max(1.0, float(s))


def floor_units(
    dtype: Union[str, torch.dtype, None],
    compute_dtype: Union[str, torch.dtype, None] = None,
    projected_only: bool = False,
) -> float:
    """How many rounding units (:func:`rounding_scale`) the floor allows for the coarsest of the two dtypes."""
    units = FLOOR_UNITS[coarsest(dtype, compute_dtype)]
    return units * PROJECTED_FACTOR if projected_only else units


def conservation_floor(
    dtype: Union[str, torch.dtype, None],
    compute_dtype: Union[str, torch.dtype, None] = None,
    scale: float = 1.0,
    projected_only: bool = False,
) -> float:
    """The largest ``conservation_error`` rounding explains for a reading made in ``dtype``.

    Args:
        dtype: the audit dtype (``report.dtype``).
        compute_dtype: the coarser dtype the forward computed the gradient's values in, if any
            (``report.compute_dtype``: autocast's, or a float32 normalisation inside a float64 model).
        scale: the cancellation (``Σ_S ‖g_S‖ / ‖g_full‖``), or the engine's own bound on it; NaN reads as 1.
        projected_only: only projected shares were read (``scale`` is then a lower bound).

    Example:
        >>> round(conservation_floor("float32", scale=2.0) / 2.0**-24)
        128
        >>> conservation_floor("float64") < conservation_floor("float32") < conservation_floor("float32", "bfloat16")
        True
    """
    return floor_units(dtype, compute_dtype, projected_only) * rounding_scale(dtype, compute_dtype, scale)


def autocast_dtype(device: Union[str, torch.device, None]) -> Optional[torch.dtype]:
    """The dtype autocast computes in on ``device``'s type right now, or None when autocast is off there."""
    kind = torch.device(device).type if device is not None else "cpu"
    try:
        if torch.is_autocast_enabled(kind):
            return torch.get_autocast_dtype(kind)
    except (RuntimeError, TypeError, AttributeError):  # a device type autocast does not know
        return None
    return None


#: Whether autograd nodes expose the metadata of their op's outputs (``Node._input_metadata``), so that
#: :meth:`PrecisionWatch.see_graph` can read a forward's dtypes off its graph.
GRAPH_DTYPES = hasattr(torch.autograd.graph.Node, "_input_metadata")


class PrecisionWatch(TorchFunctionMode):
    """Records the coarsest floating dtype of the differentiable values a forward computes.

    Entered around an audit's forward (or, for a reverse-mode forward, read off its graph afterwards with
    :meth:`see_graph`): an op whose output carries the gradient (``requires_grad``, or a
    forward-mode tangent) in a coarser dtype than the audit's — autocast's bfloat16 matmuls, or a float32
    normalisation inside a float64 model (transformers' RMSNorm) — sets the precision the reading can have.
    Values off the gradient path (masks, rotary tables) do not count. It changes nothing it sees.

    Example:
        >>> w = torch.ones(2, dtype=torch.float64, requires_grad=True)
        >>> with PrecisionWatch() as watch:
        ...     y = (w.float() * 2).double().sum()
        >>> watch.coarser_than("float64")
        'float32'
    """

    def __init__(self, baseline: Union[str, torch.dtype, None] = None) -> None:
        super().__init__()
        self.coarsest: Optional[torch.dtype] = None
        self._fine: set = set()  # dtypes no coarser than what is known: skipped at once (most ops' outputs)
        self._raise_to(dtype_named(baseline))

    def _raise_to(self, d: Optional[torch.dtype]) -> None:
        if d is None or d not in UNIT_ROUNDOFF:
            return
        if self.coarsest is None or UNIT_ROUNDOFF[d] > UNIT_ROUNDOFF[self.coarsest]:
            self.coarsest = d
        self._fine = {x for x, u in UNIT_ROUNDOFF.items() if u <= UNIT_ROUNDOFF[self.coarsest]}

    def _see(self, x: Any) -> None:
        if not isinstance(x, torch.Tensor) or x.dtype in self._fine or x.dtype not in UNIT_ROUNDOFF:
            return
        if x.requires_grad or fwAD.unpack_dual(x).tangent is not None:
            self._raise_to(x.dtype)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if type(out) is tuple or type(out) is list:
            for x in out:
                self._see(x)
        else:
            self._see(out)
        return out

    def see_graph(self, root: torch.Tensor) -> None:
        """Records the dtypes of the differentiable values ``root`` was computed from, read off its autograd
        graph (the outputs of every node, one visit per node) instead of op by op during the forward: the
        values on the gradient path are the same, and the forward pays nothing per op. Where this torch's
        nodes do not expose their outputs' metadata (:data:`GRAPH_DTYPES` is False) the watch must be
        entered around the forward instead.

        Example:
            >>> w = torch.ones(2, dtype=torch.float64, requires_grad=True)
            >>> watch = PrecisionWatch("float64")
            >>> watch.see_graph((w.float() * 2).double().sum())
            >>> watch.coarser_than("float64")
            'float32'
        """
        for node in graph_nodes(root):
            for meta in node._input_metadata:  # the dtype of each output of the op this node differentiates
                if meta.dtype not in self._fine:
                    self._raise_to(meta.dtype)

    def coarser_than(self, dtype: Union[str, torch.dtype, None]) -> Optional[str]:
        """The coarsest dtype seen when it is coarser than ``dtype`` (its name), else None."""
        d = dtype_named(dtype)
        if self.coarsest is None or (d in UNIT_ROUNDOFF and UNIT_ROUNDOFF[self.coarsest] <= UNIT_ROUNDOFF[d]):
            return None
        return str(self.coarsest).replace("torch.", "")
