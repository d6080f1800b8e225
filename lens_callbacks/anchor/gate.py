"""Offline gate: replay saved weights with a cadence and a delay, and score the projection.

The GPU-free step 1 of the experiment plan: given weights saved at known steps, simulate the delayed
anchor (snapshots every ``cadence`` steps, visible ``delay_K`` steps later), fire the projector at each
visible snapshot and compare ``θ̂`` with the true weights at the fire step against two baselines — the
stale snapshot and velocity extrapolation.
"""

from __future__ import annotations

import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional, Sequence

import torch

from ..io.safe import ReadLimits, check_inside, load_torch_checkpoint
from .projector import AnchorReading, Rank1TrajProjector

__all__ = ["GateReport", "replay", "load_checkpoints", "step_of"]


@dataclass(frozen=True)
class GateReport:
    """All fires of one replay and their summary.

    Attributes:
        cadence, delay_K: the simulated schedule.
        readings: one :class:`AnchorReading` per fire, in order.
        median_ratio, median_ratio_gated, median_vel_ratio: medians over projected fires of
            ``||θ̂ − θ_true|| / ||θ_stale − θ_true||`` (ungated, gated) and of velocity extrapolation's.
        gated_on_fraction: mean over projected fires.
        decision, reason: ``"project"`` when the gated projection beats the stale snapshot (median gated
            ratio < 1) and is no worse than velocity extrapolation, else ``"stale"``.
    """

    cadence: int
    delay_K: int
    readings: tuple[AnchorReading, ...]
    median_ratio: float
    median_ratio_gated: float
    median_vel_ratio: float
    gated_on_fraction: float
    decision: str
    reason: str

    def decide(self) -> tuple[str, str]:
        """``(decision, reason)``: ``"project"`` or ``"stale"``, and why."""
        return self.decision, self.reason

    def to_dict(self, prefix: str = "anchor_gate/") -> dict[str, float]:
        return {
            f"{prefix}median_ratio": self.median_ratio,
            f"{prefix}median_ratio_gated": self.median_ratio_gated,
            f"{prefix}median_vel_ratio": self.median_vel_ratio,
            f"{prefix}gated_on_fraction": self.gated_on_fraction,
            f"{prefix}n_fires": float(len(self.readings)),
        }

    def render(self) -> str:
        cols = (
            "t_fast",
            "t_W",
            "W",
            "evr1",
            "evr1_null",
            "r2",
            "coef_pred_error",
            "retro_weight_ratio",
            "fire_cos",
            "gated_on_fraction",
            "weight_err_ratio",
            "weight_err_ratio_gated",
            "vel_err_ratio",
            "newest_err_ratio",
        )
        short = (
            "step",
            "t_W",
            "W",
            "EVR1",
            "null",
            "R2",
            "coef_err",
            "retro_w",
            "fire_cos",
            "gate_on",
            "ratio",
            "ratio_gated",
            "vel_ratio",
            "newest",
        )
        lines = [
            f"anchor gate replay: cadence={self.cadence} delay_K={self.delay_K} ({len(self.readings)} fires)",
            " ".join(f"{s:>11}" for s in short),
        ]
        for r in self.readings:
            vals = []
            for c in cols:
                v = getattr(r, c)
                vals.append(f"{v:>11d}" if isinstance(v, int) and not isinstance(v, bool) else f"{float(v):>11.4g}")
            lines.append(" ".join(vals))
        lines.append(
            f"median ratio vs stale: ungated {self.median_ratio:.4g}, gated {self.median_ratio_gated:.4g}; "
            f"velocity extrapolation {self.median_vel_ratio:.4g}; gated ON {self.gated_on_fraction:.3f}"
        )
        lines.append(f"decision: {self.decision} ({self.reason})")
        return "\n".join(lines)


def _median(xs: Sequence[float]) -> float:
    xs = sorted(x for x in xs if math.isfinite(x))
    if not xs:
        return float("nan")
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else 0.5 * (xs[m - 1] + xs[m])


def replay(
    weights: Mapping[int, Mapping[str, torch.Tensor]],
    cadence: int,
    delay_K: int,
    projector: Optional[Rank1TrajProjector] = None,
    progress: Optional[Callable[[Iterable], Iterable]] = None,
    **projector_kwargs,
) -> GateReport:
    r"""Replay weights saved at known steps through the delayed anchor.

    Snapshot ticks are the saved steps that are multiples of ``cadence``; the snapshot at ``t`` fires at
    ``t + delay_K`` and is scored against the weights saved at that step (fires without saved weights at
    their step are skipped as scores but still folded into the ring).

    Example:
        >>> W = {t: {"w": torch.tensor([0.1 * t, -0.05 * t])} for t in range(0, 101, 10)}
        >>> rep = replay(W, cadence=10, delay_K=10)
        >>> rep.decision, round(rep.median_ratio, 9)
        ('project', 0.0)
    """
    if not isinstance(cadence, int) or cadence <= 0:
        raise ValueError(f"`cadence` must be a positive int, got {cadence!r}.")
    if not isinstance(delay_K, int) or delay_K < 0:
        raise ValueError(f"`delay_K` must be an int ≥ 0, got {delay_K!r}.")
    proj = projector or Rank1TrajProjector(**projector_kwargs)
    ticks = sorted(t for t in weights if t % cadence == 0)
    if len(ticks) < 2:
        raise ValueError(
            f"`weights` must hold at least 2 steps that are multiples of cadence={cadence}, got steps {sorted(weights)[:10]!r}."
        )
    it: Iterable[int] = ticks if progress is None else progress(ticks)
    readings: list[AnchorReading] = []
    for t in it:
        t_fast = t + delay_K
        truth = weights.get(t_fast)
        prj = proj.fire(weights[t], t, t_fast, truth=truth)
        if truth is not None:
            readings.append(prj.reading)
    projected = [r for r in readings if r.projected]
    med = _median([r.weight_err_ratio for r in projected])
    med_g = _median([r.weight_err_ratio_gated for r in projected])
    med_v = _median([r.vel_err_ratio for r in projected])
    on = sum(r.gated_on_fraction for r in projected) / len(projected) if projected else 0.0
    if not projected:
        decision, reason = "stale", f"no fire reached n0 = {proj.n0} snapshots with true weights to score against"
    elif not med_g < 1.0:
        decision, reason = "stale", f"gated projection does not beat the stale snapshot (median ratio {med_g:.4g} ≥ 1)"
    elif math.isfinite(med_v) and med_g > med_v:
        decision, reason = "stale", f"velocity extrapolation is better (median {med_v:.4g} < {med_g:.4g})"
    else:
        decision, reason = "project", f"median gated ratio {med_g:.4g} < 1 and ≤ velocity extrapolation {med_v:.4g}"
    return GateReport(cadence, delay_K, tuple(readings), med, med_g, med_v, on, decision, reason)


_STEP_RE = re.compile(r"(?:step[=_-]?|global_step[=_-]?)(\d+)")


def step_of(path: Path, obj: Optional[Mapping] = None) -> Optional[int]:
    """The training step a saved file belongs to: ``global_step`` inside it, else ``step=N``/``step_N`` in its name.

    Example:
        >>> step_of(Path("epoch=0-step=40.ckpt")), step_of(Path("policy_step_000020.pt"))
        (40, 20)
    """
    if obj is not None and isinstance(obj.get("global_step"), int):
        return int(obj["global_step"])
    m = _STEP_RE.findall(path.name)
    return int(m[-1]) if m else None


def load_checkpoints(
    directory: Path, prefix: str = "", limits: Optional[ReadLimits] = None
) -> dict[int, dict[str, torch.Tensor]]:
    """Weights of every ``*.ckpt``/``*.pt``/``*.pth`` in a directory, keyed by step (Lightning or plain state dicts).

    Only floating tensors are kept; ``prefix`` keeps only keys that start with it. Checkpoints travel between
    people, so every file goes through the bounded loader (:func:`lens_callbacks.io.safe.load_torch_checkpoint`:
    regular files under a size cap, ``weights_only=True``, tensor views checked against their storage); a
    symbolic link out of ``directory`` is refused by name; a file reached through several names is read once
    (a link such as Lightning's ``last.ckpt`` to a checkpoint of the same step is skipped; one that would make
    the same weights another step is refused); what all the checkpoints hold together is charged to the memory
    budget (``LENS_MEMORY_MB``); every checkpoint must hold the tensors the first one holds, with their shapes.

    Raises:
        ValueError: a file that is not a regular file, too large, not a ``torch.save`` archive, refused by
            ``weights_only=True``, holding a tensor that views more than its storage, or whose tensors differ
            from the first checkpoint's; names the file (and the tensor).
    """
    from ..io.budget import HeldBudget, same_file_as

    limits = limits or ReadLimits.from_env()
    budget = HeldBudget(limits)
    out: dict[int, dict[str, torch.Tensor]] = {}
    source: dict[int, Path] = {}
    files = sorted(p for p in Path(directory).iterdir() if p.suffix in (".ckpt", ".pt", ".pth"))
    dup = same_file_as([str(p) for p in files])
    loaded: dict[str, tuple[Optional[int], Optional[dict]]] = {}  # first path -> (step inside, weights)
    for p in files:
        first = dup.get(str(p))
        if first is not None:  # the same file again: never read twice
            inside, sd = loaded.get(first, (None, None))
            step = inside if inside is not None else step_of(p)
            if sd is None or step is None or step in out and out[step] is sd:
                continue
            raise ValueError(
                f"{p}: the checkpoint is the same file as {first} (a link) but would be step {step}; refused "
                "(each step needs its own checkpoint)."
            )
        try:
            st = os.stat(p)
        except OSError:
            st = None  # the loader names what is wrong with it
        if st is not None and stat.S_ISREG(st.st_mode):  # a FIFO or device is named as such by the loader
            check_inside(directory, p, "checkpoint")
            budget.check(st.st_size, str(p), "the checkpoint")
        obj = load_torch_checkpoint(p, limits, "checkpoint", root=directory)
        sd = obj.get("state_dict", obj) if isinstance(obj, Mapping) else None
        if not isinstance(sd, Mapping):
            continue
        inside = obj.get("global_step") if isinstance(obj.get("global_step"), int) else None
        step = step_of(p, obj if isinstance(obj, Mapping) else None)
        if step is None:
            continue
        kept = {
            k: v
            for k, v in sd.items()
            if isinstance(k, str) and isinstance(v, torch.Tensor) and v.is_floating_point() and k.startswith(prefix)
        }
        del obj, sd
        budget.charge(sum(v.numel() * v.element_size() for v in kept.values()), str(p), "the checkpoints read so far")
        loaded[str(p)] = (inside, kept)
        out[step] = kept
        source[step] = p
    _check_same_tensors(out, source)
    return out


def _check_same_tensors(weights: Mapping[int, Mapping[str, torch.Tensor]], source: Mapping[int, Path]) -> None:
    """Every checkpoint holds the first one's tensor names and shapes (the replay compares them name by name)."""
    steps = sorted(weights)
    if not steps:
        return
    ref = weights[steps[0]]
    shapes = {k: tuple(v.shape) for k, v in ref.items()}
    for t in steps[1:]:
        w = weights[t]
        for k, shape in shapes.items():
            if k not in w:
                raise ValueError(
                    f"{source[t]}: the checkpoint has no tensor `{_short_name(k)}`, which {source[steps[0]].name} holds; "
                    "every checkpoint must hold the same tensors (use --prefix to keep a common part)."
                )
            if tuple(w[k].shape) != shape:
                raise ValueError(
                    f"{source[t]}: tensor `{_short_name(k)}` has shape {list(w[k].shape)}, but {list(shape)} in "
                    f"{source[steps[0]].name}; every checkpoint must hold the same tensors."
                )
        extra = [k for k in w if k not in shapes]
        if extra:
            raise ValueError(
                f"{source[t]}: the checkpoint holds tensor `{_short_name(extra[0])}`, which {source[steps[0]].name} "
                "does not; every checkpoint must hold the same tensors (use --prefix to keep a common part)."
            )


def _short_name(k: str) -> str:
    return k if len(k) <= 120 else k[:117] + "..."
