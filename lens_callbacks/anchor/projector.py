"""Rank1TrajProjector: de-stale a delayed anchor along the leading direction of its snapshot window.

One fire: fold the newly visible snapshot into the ring, read the retrospective coefficient error of the
previous fit (it predicted this snapshot before seeing it), re-fit the window from the Gram alone, and —
from ``N0`` snapshots on — build ``θ̂(t_tgt) = θ_base + Σ_i γ_i Δ_i`` per tensor, an explicit linear
combination of stored snapshots, with a per-block coherence gate and trust ``τ``.

What this cannot do: the line is fitted to the coefficient on one direction; everything off that
direction is taken from the base snapshot, and a trajectory that turns (fire_cos low) or wanders (EVR1
at the random-walk null) is not extrapolable — the gate then hands back the stale snapshot.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Callable, Mapping, Optional, Sequence

import torch

from .fit import Rank1Fit, destale, evr1_null_quantile, fit_rank1
from .ring import GrowingWeightTrajRing, prefix_gram

__all__ = ["Rank1TrajProjector", "AnchorReading", "Projection", "trust", "block_of", "SPAN_TOL"]

SPAN_TOL = 1e-9  # self-test: θ̂ rebuilt from raw snapshots agrees with θ_base + ĉ·v1 to this (relative)


def block_of(name: str, pool: str) -> str:
    """The block a tensor's gate is pooled over.

    ``"global"``: one block; ``"tensor"``: each tensor alone; ``"layer"``: the name up to and including its
    first integer component (``transformer.h.3.attn.c_attn.weight`` → ``transformer.h.3``), else the
    tensor's own name.

    Example:
        >>> block_of("transformer.h.3.attn.c_attn.weight", "layer"), block_of("lm_head.weight", "layer")
        ('transformer.h.3', 'lm_head.weight')
    """
    if pool == "global":
        return "global"
    if pool == "tensor":
        return name
    if pool == "layer":
        parts = name.split(".")
        for i, p in enumerate(parts):
            if re.fullmatch(r"\d+", p):
                return ".".join(parts[: i + 1])
        return name
    raise ValueError(f"`pool` must be one of 'global', 'layer', 'tensor', got {pool!r}.")


def trust(
    evr1: float,
    evr1_null: float,
    r2: float,
    r2_min: float,
    fire_cos: float,
    sign_agree: float,
    retro_ratio: float = float("nan"),
    retro_gate: bool = False,
) -> float:
    r"""Trust ``τ ∈ [0, 1]`` in a block's projection: the geometric mean of its factors.

    ``e = clip((EVR1 − q_null)/(1 − q_null))`` (coherence beyond the random-walk null),
    ``r = clip((R² − r2_min)/(1 − r2_min))`` (the coefficient is on a line), ``f = clip(fire_cos)`` (the
    direction held between fires) and ``s = clip(2·sign_agree − 1)`` (``sign(M_anchor)`` agrees with
    Resolution B's ``sign(−a·v1)`` beyond chance); a factor that cannot be read yet (``nan``: first fit,
    no ``M_anchor``) counts 1. With ``retro_gate`` a fifth factor ``k = clip(1 − retro_ratio)`` requires the
    previous fit's ``θ̂`` to have predicted the newest snapshot better than holding the one before
    (``retro_weight_ratio < 1``; ``nan`` counts 0 here: no projection before one such check).
    Gate ON ⇔ ``τ > 0``.

    Example:
        >>> trust(0.99, 0.84, 0.97, 0.7, 0.9, 0.8) > 0, trust(0.80, 0.84, 0.99, 0.7, 1.0, 1.0)
        (True, 0.0)
        >>> trust(0.99, 0.84, 0.97, 0.7, 0.9, 0.8, retro_ratio=1.5, retro_gate=True)
        0.0
    """

    def clip(x: float) -> float:
        return min(max(x, 0.0), 1.0)

    if not (math.isfinite(evr1) and math.isfinite(r2)):
        return 0.0
    factors = [
        clip((evr1 - evr1_null) / (1.0 - evr1_null)) if evr1_null < 1.0 else 0.0,
        clip((r2 - r2_min) / (1.0 - r2_min)) if r2_min < 1.0 else float(r2 >= 1.0),
        clip(fire_cos) if math.isfinite(fire_cos) else 1.0,
        clip(2.0 * sign_agree - 1.0) if math.isfinite(sign_agree) else 1.0,
    ]
    if retro_gate:
        factors.append(clip(1.0 - retro_ratio) if math.isfinite(retro_ratio) else 0.0)
    prod = math.prod(factors)
    return prod ** (1.0 / len(factors)) if prod > 0.0 else 0.0


_NAN = float("nan")


@dataclass(frozen=True)
class AnchorReading:
    r"""What one fire of the projector read (pooled over all tensors unless named per block).

    Attributes:
        t_fast: the live step of the fire. t_W: the newest visible snapshot's tick. W: snapshots in the window.
        projected: whether θ̂ was built (``W ≥ N0`` and the span self-test passed).
        evr1, evr1_null: ``λ1/trace`` of the pooled window Gram and the random-walk null quantile it must beat.
        r2, sigma1, slope: the pooled fit's ``R²``, ``σ1`` and OLS slope ``a`` (per tick).
        h_eff, t_tgt: de-stale distance and target tick (``t_tgt ≤ t_fast``).
        coef_pred_error: retrospective ``|ĉ_prev(t_new) − c_true| / |c_true − c_W,prev|`` on the previous fit's
            direction (``< 1``: the line beat holding the old coefficient). coef_pred_abs: the numerator / σ1.
        retro_weight_ratio: the same retrospective prediction in weight space, from the Gram alone:
            ``||θ_new − θ̂_prev(t_new)|| / ||θ_new − θ_W,prev||`` (``< 1``: the previous θ̂ beat the stale snapshot).
        fire_cos: ``cos(v1_prev, v1)`` between consecutive fits.
        sign_agree: share of coordinates where ``sign(M_anchor) = sign(−a·v1)`` (Resolution B cross-check).
        gated_on_fraction: share of parameters (by count) whose block's gate is ON. tau_mean: count-weighted τ.
        weight_err_ratio: ``||θ̂ − θ_true|| / ||θ_stale − θ_true||`` (every tensor projected, ungated).
        weight_err_ratio_gated: the same with gated-OFF blocks at the stale snapshot (what the anchor uses).
        vel_err_ratio: velocity extrapolation ``θ_W + h·(θ_W − θ_{W−1})/(t_W − t_{W−1})`` against the stale one.
        newest_err_ratio: ``θ_W + (ĉ − c_W)·v1`` (keeps the newest snapshot's off-v1 part) against the stale one.
        comm_bytes: one fire's traffic, weights up (native dtype) plus one sign bit per parameter down.
        span_residual: the largest relative gap of the span self-test.
        reason: why nothing was projected, when it was not.
    """

    t_fast: int
    t_W: int
    W: int
    projected: bool = False
    evr1: float = _NAN
    evr1_null: float = _NAN
    r2: float = _NAN
    sigma1: float = _NAN
    slope: float = _NAN
    h_eff: float = _NAN
    t_tgt: float = _NAN
    coef_pred_error: float = _NAN
    coef_pred_abs: float = _NAN
    retro_weight_ratio: float = _NAN
    fire_cos: float = _NAN
    sign_agree: float = _NAN
    gated_on_fraction: float = 0.0
    tau_mean: float = 0.0
    weight_err_ratio: float = _NAN
    weight_err_ratio_gated: float = _NAN
    vel_err_ratio: float = _NAN
    newest_err_ratio: float = _NAN
    comm_bytes: float = 0.0
    span_residual: float = _NAN
    reason: Optional[str] = None
    blocks: Mapping[str, Mapping[str, float]] = field(default_factory=dict, compare=False, repr=False)

    def to_dict(self, prefix: str = "anchor/") -> dict[str, float]:
        """Finite numeric readings (NaN ones are left out so that charts do not break)."""
        out: dict[str, float] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool):
                out[prefix + f.name] = float(v)
            elif isinstance(v, (int, float)) and math.isfinite(float(v)):
                out[prefix + f.name] = float(v)
        return out

    def render(self) -> str:
        head = f"anchor fire @ step {self.t_fast}: W={self.W}, t_W={self.t_W}, projected={self.projected}"
        rows = [head]
        for k, v in self.to_dict("").items():
            if k not in ("t_fast", "W", "t_W", "projected"):
                rows.append(f"  {k:<24}{v:.6g}")
        if self.reason:
            rows.append(f"  reason: {self.reason}")
        return "\n".join(rows)


@dataclass
class Projection:
    """The anchor's weights after a fire, per tensor (fp32, flat), and the merger's trust per tensor."""

    anchor: dict[str, torch.Tensor]
    tau: dict[str, float]
    gate: dict[str, bool]
    reading: AnchorReading
    theta_hat: Optional[dict[str, torch.Tensor]] = None


class Rank1TrajProjector:
    r"""Growing-window rank-1 projection of delayed snapshots (Resolution A's eval point).

    Args:
        n0: snapshots needed before projecting (the spec's ``N0 = 4``); below it a strict no-op.
        w_cap: the most snapshots in the window; the oldest is dropped and the base re-based past it.
        h_safe: cap on the de-stale distance in ticks (``None``: up to the live step).
        pool: block for the coherence gate: ``"global"``, ``"layer"`` or ``"tensor"``.
        r2_min: ``R²`` at which the trust's line factor starts above 0.
        null_quantile: quantile of the random-walk EVR1 null that a block's EVR1 must exceed.
        null_samples, seed: the null's Monte-Carlo size and seed (deterministic, cached).
        null_dim: dimension of the isotropic walk the null assumes (``None``: the block's parameter count).
            Real updates are anisotropic; a smaller effective dimension widens the null (stricter gate).
        retro_gate: add the retrospective factor ``clip(1 − retro_weight_ratio)`` to the trust (see :func:`trust`):
            a block projects only after its previous ``θ̂`` predicted the newest snapshot better than holding
            the one before. ``False`` keeps the four factors of the spec (first projection at ``n0``).

    Example:
        >>> p = Rank1TrajProjector(n0=4)
        >>> for t in range(5):
        ...     r = p.fire({"w": torch.tensor([1.0 * t, 0.5 * t])}, tick=10 * t, t_fast=10 * t + 10,
        ...                truth={"w": torch.tensor([1.0 * t + 1, 0.5 * t + 0.5])}).reading
        >>> r.projected, round(r.evr1, 12), round(r.weight_err_ratio, 9), round(r.r2, 12)
        (True, 1.0, 0.0, 1.0)
    """

    def __init__(
        self,
        n0: int = 4,
        w_cap: int = 16,
        h_safe: Optional[float] = None,
        pool: str = "layer",
        r2_min: float = 0.7,
        null_quantile: float = 0.95,
        null_samples: int = 2000,
        seed: int = 0,
        null_dim: Optional[int] = None,
        retro_gate: bool = True,
    ) -> None:
        if not isinstance(n0, int) or isinstance(n0, bool) or n0 < 3:
            raise ValueError(f"`n0` must be an int ≥ 3 (a line plus a residual), got {n0!r}; the spec uses 4.")
        if not isinstance(w_cap, int) or isinstance(w_cap, bool) or w_cap < n0:
            raise ValueError(f"`w_cap` must be an int ≥ n0 = {n0}, got {w_cap!r}: a window below N0 never projects.")
        if h_safe is not None and not (h_safe >= 0):
            raise ValueError(f"`h_safe` must be ≥ 0 or None, got {h_safe!r}.")
        block_of("x", pool)
        if not (0.0 <= r2_min < 1.0):
            raise ValueError(f"`r2_min` must be in [0, 1), got {r2_min!r}.")
        if not (0.0 < null_quantile < 1.0):
            raise ValueError(f"`null_quantile` must be in (0, 1), got {null_quantile!r}.")
        self.n0, self.h_safe, self.pool = n0, h_safe, pool
        self.r2_min, self.null_quantile, self.null_samples, self.seed = r2_min, null_quantile, null_samples, seed
        if null_dim is not None and (isinstance(null_dim, bool) or not isinstance(null_dim, int) or null_dim < 1):
            raise ValueError(f"`null_dim` must be a positive int or None, got {null_dim!r}.")
        self.null_dim = null_dim
        self.retro_gate = bool(retro_gate)
        self.ring = GrowingWeightTrajRing(w_cap)
        self.prev_fit: dict[str, Rank1Fit] = {}  # "" = pooled over all tensors, else block name
        self.comm_bytes = 0.0
        self.last_reading: Optional[AnchorReading] = None
        self.n_fires = 0
        self._retro: tuple[float, float, float] = (_NAN, _NAN, _NAN)
        self._retro_blocks: dict[str, tuple[float, float]] = {}
        self._fire_cos: dict[str, float] = {}

    # -- blocks --------------------------------------------------------------------------------
    def blocks(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for n in self.ring.names:
            out.setdefault(block_of(n, self.pool), []).append(n)
        return out

    # -- fire ----------------------------------------------------------------------------------
    def observe(
        self,
        snapshot: Mapping[str, torch.Tensor],
        tick: int,
        row_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ) -> None:
        """Fold a newly visible snapshot in; read the retrospective error and ``fire_cos``; re-fit."""
        ring = self.ring
        self.comm_bytes = float(sum(t.numel() * t.element_size() + (t.numel() + 7) // 8 for t in snapshot.values()))
        ring.append(snapshot, tick, row_reduce)
        self.n_fires += 1
        groups = {"": list(ring.names), **self.blocks()} if self.pool != "global" else {"": list(ring.names)}
        ids_full = ring.delta_ids()
        D_full = {g: ring.consecutive_gram(ns) for g, ns in groups.items()}  # before any drop

        # Retrospective: each previous fit predicted this snapshot's coefficient before seeing it.
        self._retro_blocks = {}
        for g in groups:
            prev = self.prev_fit.get(g)
            if prev is not None and prev.sigma1 > 0.0 and ring.ticks[0] == prev.ticks[0]:
                B = prefix_gram(D_full[g])  # [n, n] on the base the previous fit used
                u = torch.tensor(prev.u1, dtype=torch.float64)
                c_true = float(B[: len(prev.u1), -1] @ u) / prev.sigma1
                c_hat = prev.predict(tick)
                err = abs(c_hat - c_true)
                hold = abs(c_true - prev.c[-1])
                # The same prediction in weight space, from the Gram alone: ||θ_new − (θ_base + ĉ·v1)||² =
                # B[new, new] − 2·ĉ·c_true + ĉ², against holding the previous snapshot, ||d_new||² = D[new, new].
                w_err2 = max(float(B[-1, -1]) - 2.0 * c_hat * c_true + c_hat * c_hat, 0.0)
                w_hold2 = float(D_full[g][-1, -1])
                self._retro_blocks[g] = (
                    err / hold if hold > 0 else _NAN,
                    err / prev.sigma1,
                    math.sqrt(w_err2 / w_hold2) if w_hold2 > 0 else _NAN,
                )
        self._retro = self._retro_blocks.get("", (_NAN, _NAN, _NAN))

        if ring.over_cap:
            ring.drop_oldest_and_rebase()

        new_fits: dict[str, Rank1Fit] = {}
        self._fire_cos = {}
        if ring.W >= self.n0:
            for g, ns in groups.items():
                f = fit_rank1(ring.base_gram(ns), ring.ticks, ring.delta_ids())
                if f is None:
                    continue
                new_fits[g] = f
                p = self.prev_fit.get(g)
                self._fire_cos[g] = _fire_cos(p, f, D_full[g], ids_full) if p is not None else _NAN
        self.prev_fit = new_fits

    def project(
        self,
        t_fast: int,
        truth: Optional[Mapping[str, torch.Tensor]] = None,
        m_anchor: Optional[Mapping[str, torch.Tensor]] = None,
        null_d: Optional[int] = None,
        theta_dtype: torch.dtype = torch.float32,
    ) -> Projection:
        """Build the anchor's weights for the live step ``t_fast`` (``θ̂`` per gated-ON block, else ``θ_W``).

        ``θ̂`` is built in float64 and returned as ``theta_dtype`` (flat, per tensor).
        """
        ring = self.ring
        if ring.W == 0:
            raise ValueError("`project` needs at least one observed snapshot.")
        t_W = ring.ticks[-1]
        stale = {n: ring.prev[n].clone() for n in ring.names}
        base = dict(
            t_fast=int(t_fast),
            t_W=int(t_W),
            W=ring.W,
            comm_bytes=self.comm_bytes,
            coef_pred_error=self._retro[0],
            coef_pred_abs=self._retro[1],
            retro_weight_ratio=self._retro[2],
        )
        if ring.W < self.n0:
            reading = AnchorReading(**base, reason=f"W = {ring.W} < n0 = {self.n0} snapshots: strict no-op.")
            self.last_reading = reading
            return Projection(stale, {n: 1.0 for n in ring.names}, {n: False for n in ring.names}, reading)

        h_eff, t_tgt = destale(int(t_fast), int(t_W), self.h_safe)
        pooled = self.prev_fit.get("")
        sq = {"hat": 0.0, "stale": 0.0, "vel": 0.0, "newest": 0.0, "gated": 0.0}
        span_res = 0.0
        theta_hat: dict[str, torch.Tensor] = {}
        agree: dict[str, list[float]] = {}
        gap = ring.ticks[-1] - ring.ticks[-2]
        blocks = self.blocks()
        bname = {n: b for b, ns in blocks.items() for n in ns}
        for n in ring.names:
            f = fit_rank1(ring.base_gram([n]), ring.ticks, ring.delta_ids())
            base_t = ring.base[n].double()  # [d]
            if f is None or f.sigma1 <= 0.0:
                x = base_t.clone()
                v1 = torch.zeros_like(base_t)
                c_hat, c_W, gam = 0.0, 0.0, ()
            else:
                c_hat, c_W = f.predict(t_tgt), f.c[-1]
                gam = f.gammas(c_hat)
                v1 = torch.zeros_like(base_t)  # [d]
                snap_comb = (1.0 - math.fsum(gam)) * base_t  # θ̂ as an affine combination of raw snapshots
                for i, Di in enumerate(ring.displacements(n)):
                    v1.add_(Di, alpha=f.u1[i] / f.sigma1)
                    snap_comb.add_(base_t, alpha=gam[i]).add_(Di, alpha=gam[i])  # += γ_i·θ_i, θ_i = θ_base + Δ_i
                x = base_t + c_hat * v1  # θ̂ = θ_base + ĉ·v1
                rel = float(torch.dist(snap_comb, x)) / max(float(torch.linalg.vector_norm(x)), 1e-300)
                del snap_comb
                span_res = max(span_res, rel)
            theta_hat[n] = x.to(theta_dtype)
            if m_anchor is not None and n in m_anchor and f is not None:
                m = m_anchor[n].detach().reshape(-1).to(x.device)
                s_m, s_b = torch.sign(m), torch.sign(-f.a * v1)
                both = (s_m != 0) & (s_b != 0)
                acc = agree.setdefault(bname[n], [0.0, 0.0])
                acc[0] += float(((s_m == s_b) & both).sum())
                acc[1] += float(both.sum())
            if truth is not None:
                tr = truth[n].detach().reshape(-1).double().to(x.device)
                W_t = ring.prev[n].double()
                sq["hat"] += float(torch.dist(x, tr)) ** 2
                sq["stale"] += float(torch.dist(W_t, tr)) ** 2
                sq["vel"] += float(torch.dist(W_t.add(ring.deltas[-1][n], alpha=h_eff / gap), tr)) ** 2
                sq["newest"] += float(torch.dist(W_t.add_(v1, alpha=c_hat - c_W), tr)) ** 2
            del v1

        span_ok = span_res <= SPAN_TOL
        gate: dict[str, bool] = {}
        tau: dict[str, float] = {}
        block_info: dict[str, dict[str, float]] = {}
        on_numel, tau_sum, total = 0, 0.0, ring.numel()
        for b, ns in blocks.items():
            key = b if self.pool != "global" else ""  # observe() keys the global block's fit as the pooled one
            fb = self.prev_fit.get(key)
            numel = ring.numel(ns)
            sa = agree.get(b)
            sign_agree = sa[0] / sa[1] if sa and sa[1] > 0 else _NAN
            if fb is None or not span_ok:
                tb, null = 0.0, _NAN
            else:
                null = evr1_null_quantile(
                    fb.ticks, null_d or self.null_dim or numel, self.null_quantile, self.null_samples, self.seed
                )
                fc = self._fire_cos.get(key, _NAN)
                retro = self._retro_blocks.get(key, (_NAN, _NAN, _NAN))[2]
                tb = trust(fb.evr1, null, fb.r2, self.r2_min, fc, sign_agree, retro, self.retro_gate)
            block_info[b] = {
                "tau": tb,
                "evr1_null": null,
                "sign_agree": sign_agree,
                "evr1": fb.evr1 if fb else _NAN,
                "r2": fb.r2 if fb else _NAN,
            }
            for n in ns:
                gate[n] = tb > 0.0
                tau[n] = tb if tb > 0.0 else 1.0  # gated OFF: today's signed_ema on the stale snapshot
            if tb > 0.0:
                on_numel += numel
                tau_sum += tb * numel
        anchor = {n: (theta_hat[n].to(torch.float32) if gate[n] else stale[n]) for n in ring.names}
        if truth is not None:
            for n in ring.names:
                tr = truth[n].detach().reshape(-1).double()
                sq["gated"] += float(torch.sum((anchor[n].double().to(tr.device) - tr) ** 2))
        den = math.sqrt(sq["stale"]) if truth is not None else _NAN

        def ratio(k: str) -> float:
            return math.sqrt(sq[k]) / den if truth is not None and den > 0 else _NAN

        n_agree = sum(a[0] for a in agree.values())
        n_both = sum(a[1] for a in agree.values())
        null_pooled = (
            evr1_null_quantile(
                pooled.ticks, null_d or self.null_dim or total, self.null_quantile, self.null_samples, self.seed
            )
            if pooled is not None
            else _NAN
        )
        reading = AnchorReading(
            **base,
            projected=span_ok,
            evr1=pooled.evr1 if pooled else _NAN,
            evr1_null=null_pooled,
            r2=pooled.r2 if pooled else _NAN,
            sigma1=pooled.sigma1 if pooled else _NAN,
            slope=pooled.a if pooled else _NAN,
            h_eff=float(h_eff),
            t_tgt=float(t_tgt),
            fire_cos=self._fire_cos.get("", _NAN),
            sign_agree=n_agree / n_both if n_both > 0 else _NAN,
            gated_on_fraction=on_numel / total if total else 0.0,
            tau_mean=tau_sum / total if total else 0.0,
            weight_err_ratio=ratio("hat"),
            weight_err_ratio_gated=ratio("gated"),
            vel_err_ratio=ratio("vel"),
            newest_err_ratio=ratio("newest"),
            span_residual=span_res,
            reason=None
            if span_ok
            else f"span self-test failed: residual {span_res:.3g} > {SPAN_TOL:g}; anchor left stale.",
            blocks=block_info,
        )
        self.last_reading = reading
        return Projection(anchor, tau, gate, reading, theta_hat)

    def fire(
        self,
        snapshot: Mapping[str, torch.Tensor],
        tick: int,
        t_fast: int,
        truth: Optional[Mapping[str, torch.Tensor]] = None,
        m_anchor: Optional[Mapping[str, torch.Tensor]] = None,
        row_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
        null_d: Optional[int] = None,
    ) -> Projection:
        """:meth:`observe` then :meth:`project`."""
        self.observe(snapshot, tick, row_reduce)
        return self.project(t_fast, truth, m_anchor, null_d)

    # -- persistence ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "ring": self.ring.state_dict(),
            "prev_fit": {k: _fit_to_dict(v) for k, v in self.prev_fit.items()},
            "comm_bytes": self.comm_bytes,
            "n_fires": self.n_fires,
            "retro": list(self._retro),
            "retro_blocks": {k: list(v) for k, v in self._retro_blocks.items()},
            "fire_cos": dict(self._fire_cos),
        }

    def load_state_dict(self, state: Mapping) -> None:
        self.ring.load_state_dict(state["ring"])
        self.prev_fit = {
            k: Rank1Fit(**{kk: (tuple(vv) if isinstance(vv, list) else vv) for kk, vv in v.items()})
            for k, v in state["prev_fit"].items()
        }
        self.comm_bytes = float(state["comm_bytes"])
        self.n_fires = int(state["n_fires"])
        self._retro = tuple(state["retro"])  # type: ignore[assignment]
        self._retro_blocks = {k: tuple(v) for k, v in state.get("retro_blocks", {}).items()}  # type: ignore[misc]
        self._fire_cos = dict(state["fire_cos"])


def _fit_to_dict(f: Rank1Fit) -> dict:
    return {
        k.name: (list(getattr(f, k.name)) if isinstance(getattr(f, k.name), tuple) else getattr(f, k.name))
        for k in fields(f)
    }


def _fire_cos(prev: Rank1Fit, new: Rank1Fit, D_full: torch.Tensor, ids_full: Sequence[int]) -> float:
    """``cos(v1_prev, v1_new)`` from the consecutive-delta Gram taken before the drop (both in its span)."""
    pos = {k: i for i, k in enumerate(ids_full)}
    bp = torch.zeros(len(ids_full), dtype=torch.float64)
    bn = torch.zeros(len(ids_full), dtype=torch.float64)
    for k, v in prev.beta().items():
        if k not in pos:
            return _NAN
        bp[pos[k]] = v
    for k, v in new.beta().items():
        bn[pos[k]] = v
    num = float(bp @ D_full @ bn)
    den = math.sqrt(max(float(bp @ D_full @ bp), 0.0) * max(float(bn @ D_full @ bn), 0.0))
    return num / den if den > 0 else _NAN
