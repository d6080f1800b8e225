"""AnchorProjectionCallback: a delayed anchor's sign correction, with the rank-1 de-staling projection.

A thin adapter over :mod:`lens_callbacks.anchor`: it takes the snapshots, simulates their delay, feeds
the projector, evaluates the anchor's gradient on the paired batch through ``credit_terms`` at weights it
holds apart from the live ones, keeps the ``M_anchor`` EMA and applies the merger to ``.grad``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from ..anchor import Rank1TrajProjector, confidence_weights, ema_update, projected_merge, signed_ema
from ..anchor.projector import AnchorReading, block_of
from ..credit.engine import evaluate_terms, resolve_dtype
from ..credit.inputs.terms import is_credit_source
from ..metrics.anchor import GatedOnFraction, WeightPredictionError
from ..refusal import Refusal
from ._logging import log_figure

__all__ = ["AnchorProjectionCallback", "coefficient_figure"]

MODES = ("off", "signed_ema", "projected")


def _int(name: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"`{name}` must be an int ≥ {lo}, got {v!r}.")
    return v


def _unit(name: str, v: Any, hi_open: bool = False) -> float:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= 1.0 and not (hi_open and v == 1.0)
    if not ok:
        rng = "[0, 1)" if hi_open else "[0, 1]"
        raise ValueError(f"`{name}` must be a number in {rng}, got {v!r}.")
    return float(v)


class AnchorProjectionCallback(Callback):
    r"""Sign-correct the fast gradient with a delayed anchor; optionally de-stale the anchor first.

    Every ``cadence`` optimizer steps the live trainable weights are snapshotted; a snapshot becomes
    visible to the anchor ``delay_K`` steps later (a fire). On every step with a visible snapshot the anchor's
    gradient ``G_anchor`` is taken on the batch the module trained on (``credit_terms``), at the anchor's
    weights — the raw stale snapshot in ``"signed_ema"`` mode, ``θ̂`` (Resolution A) in ``"projected"`` mode once
    the window holds ``n0`` snapshots and the block's gate is ON — and fed to
    ``M_anchor ← β_anc·M_anchor + (1−β_anc)·G_anchor``. Then, before the optimizer step,

    - ``"signed_ema"``: ``.grad ← α·G + (1−α)·|G|·sign(M_anchor)``;
    - ``"projected"``: ``α_eff = α + (1−α)(1−τ)``, ``.grad ← α_eff·G + (1−α_eff)·(w·|G|·sign(M) + (1−w)·G)``
      with block trust ``τ`` and per-coordinate confidence ``w_i = clip(|M_i|/(κ·quantile_p(|M|)), 0, 1)``;
      a gated-OFF block (and every block below ``n0``) gets exactly ``signed_ema`` at the stale snapshot;
    - ``"off"`` (default): nothing at all — no snapshot, no RNG use, no gradient change.

    The anchor's weights live in the callback; the module's parameters are never written (the anchor's
    forward runs through ``torch.func.functional_call`` on copies, under ``torch.random.fork_rng``). A failed
    anchor evaluation leaves ``.grad`` as it was and is recorded in ``last_refusal``.

    Args:
        mode: ``"off"``, ``"signed_ema"`` or ``"projected"``.
        cadence: steps between snapshots (``> 0``).
        delay_K: steps before a snapshot is visible to the anchor (``≥ 0``).
        alpha: ``α`` of the merger, in ``[0, 1]`` (spec: 0.25).
        beta_anc: EMA factor of ``M_anchor``, in ``[0, 1)`` (spec: 0.5).
        w_cap: the most snapshots in the fit window (``≥ n0``).
        n0: snapshots before projecting (spec: 4).
        h_safe: cap on the de-stale distance in steps (``None``: up to the present; never past it).
        kappa, p: confidence ``w_i`` scale and quantile (``κ > 0``, ``p ∈ (0, 1]``).
        pool: block of the coherence gate: ``"layer"``, ``"global"`` or ``"tensor"``.
        r2_min: ``R²`` at which the line starts to earn trust.
        null_quantile: quantile of the random-walk EVR1 null a block must beat.
        null_dim: dimension of the isotropic random walk behind the null (``None``: the block's size).
        retro_gate: also require the block's line to have predicted the newest snapshot's coefficient better
            than holding the old one (``trust``'s fifth factor); ``False``: the spec's four factors.
        dtype: dtype of the anchor's forward (``"native"`` = the parameters' own).
        log_readings: log ``anchor/...`` scalars through ``pl_module.log_dict``.
        figure_every_n_fires: every that many projected fires, add a TensorBoard figure of the pooled
            coefficient trajectory ``c_i`` on the ticks with its OLS line and ``ĉ(t_tgt)`` (needs matplotlib
            and a logger with ``add_figure``; 0 = never).

    Example:
        >>> from lightning.pytorch import Trainer
        >>> from lens_callbacks import AnchorProjectionCallback
        >>> anchor = AnchorProjectionCallback(mode="projected", cadence=20, delay_K=20)  # "off" (the default) changes nothing
        >>> trainer = Trainer(callbacks=[anchor], max_steps=100, logger=False, enable_checkpointing=False)
    """

    def __init__(
        self,
        mode: str = "off",
        cadence: int = 20,
        delay_K: int = 20,
        alpha: float = 0.25,
        beta_anc: float = 0.5,
        w_cap: int = 16,
        n0: int = 4,
        h_safe: Optional[int] = None,
        kappa: float = 1.0,
        p: float = 0.5,
        pool: str = "layer",
        r2_min: float = 0.7,
        null_quantile: float = 0.95,
        null_dim: Optional[int] = None,
        retro_gate: bool = True,
        dtype: str = "native",
        log_readings: bool = True,
        figure_every_n_fires: int = 0,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES!r}, got {mode!r}.")
        self.mode = mode
        self.cadence = _int("cadence", cadence, 1)
        self.delay_K = _int("delay_K", delay_K, 0)
        self.alpha = _unit("alpha", alpha)
        self.beta_anc = _unit("beta_anc", beta_anc, hi_open=True)
        self.n0 = _int("n0", n0, 3)
        if isinstance(w_cap, bool) or not isinstance(w_cap, int) or w_cap < self.n0:
            raise ValueError(f"`w_cap` must be an int ≥ n0 = {self.n0}, got {w_cap!r}; raise w_cap or lower n0.")
        self.w_cap = w_cap
        if h_safe is not None:
            h_safe = _int("h_safe", h_safe, 0)
        self.h_safe = h_safe
        if not isinstance(kappa, (int, float)) or isinstance(kappa, bool) or not kappa > 0:
            raise ValueError(f"`kappa` must be a number > 0, got {kappa!r}.")
        self.kappa = float(kappa)
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 < p <= 1.0:
            raise ValueError(f"`p` must be a number in (0, 1], got {p!r}.")
        self.p = float(p)
        block_of("x", pool)
        self.pool = pool
        self.r2_min = float(r2_min)
        self.null_quantile = float(null_quantile)
        self.null_dim = null_dim
        self.retro_gate = bool(retro_gate)
        resolve_dtype(dtype)
        self.dtype = dtype
        self.log_readings = bool(log_readings)
        self.figure_every_n_fires = _int("figure_every_n_fires", figure_every_n_fires, 0)
        # Set by an audit or conservation check in the same Trainer: keep a copy of .grad before the merger,
        # so they read the gradient the module produced whatever their place in the callback list.
        self.keep_pre_merge = False
        self._new_projector()  # validates the fit arguments (r2_min, null_quantile, null_dim) with their names
        self._reset()

    def _reset(self) -> None:
        self.projector: Optional[Rank1TrajProjector] = None
        self._pending: list[tuple[int, dict[str, torch.Tensor]]] = []
        self._anchor: Optional[dict[str, torch.Tensor]] = None
        self._projected_active = False
        self._tau: dict[str, float] = {}
        self._gate: dict[str, bool] = {}
        self.m_anchor: Optional[dict[str, torch.Tensor]] = None
        self._last_step = -1
        self._restored = False
        self._batch: Any = None
        self.last_reading: Optional[AnchorReading] = None
        self.last_refusal: Optional[Refusal] = None
        self.merged_step = -1  # the latest step whose .grad the merger changed
        self.pre_merge_grads: Optional[dict[str, torch.Tensor]] = None  # that step's .grad before the merger
        self.readings: list[AnchorReading] = []
        self.weight_error = WeightPredictionError()
        self.gated_on = GatedOnFraction()

    @property
    def state_key(self) -> str:
        return self._generate_state_key(mode=self.mode, cadence=self.cadence, delay_K=self.delay_K)

    @property
    def merges_grad(self) -> bool:
        """Whether this callback may change ``.grad`` before the optimizer step (any mode but ``"off"``)."""
        return self.mode != "off"

    def merged_at(self, step: int) -> bool:
        """Whether the merger changed ``.grad`` at optimizer step ``step`` (``trainer.global_step`` then)."""
        return self.merged_step == int(step)

    # -- hooks ---------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.mode == "off":
            return
        if not is_credit_source(pl_module):
            raise ValueError(
                f"`mode` must be 'off' for a module without `credit_terms(batch) -> CreditTerms`, got mode={self.mode!r} "
                f"with {type(pl_module).__name__}: implement credit_terms (lens_callbacks.credit.CreditSource) so the "
                "anchor can evaluate its gradient on the paired batch."
            )
        if self.projector is None:
            self.projector = self._new_projector()

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After configure_model (where FSDP2 shards), before the first step: the earliest a sharded run shows.
        # FSDP2: the callback works on whole views of the parameters and their .grad (gathered once per
        # step, written back to the shards after the merge), so ring, fit and merge are those of DDP.
        if self.mode == "off":
            return
        from ._distributed import check_strategy, is_sharded

        check_strategy(trainer, "AnchorProjectionCallback")
        self._sharded = is_sharded(pl_module)

    def _new_projector(self) -> Rank1TrajProjector:
        return Rank1TrajProjector(
            n0=self.n0,
            w_cap=self.w_cap,
            h_safe=self.h_safe,
            pool=self.pool,
            r2_min=self.r2_min,
            null_quantile=self.null_quantile,
            null_dim=self.null_dim,
            retro_gate=self.retro_gate,
        )

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.mode == "off":
            return
        self._batch = batch

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.mode == "off":
            return
        step = trainer.global_step
        if step == self._last_step:  # a second optimizer in the same step: the grads are already merged
            return
        self._last_step = step
        params = {n: p for n, p in pl_module.named_parameters() if p.requires_grad}
        shards = None
        if getattr(self, "_sharded", False):
            from ._distributed import whole_views

            shards, params = params, whole_views(params)
        if self._restored:
            self._move_state(params)
        with torch.no_grad():
            if step % self.cadence == 0:
                self._pending.append((step, {n: p.detach().clone() for n, p in params.items()}))
            while self._pending and self._pending[0][0] + self.delay_K <= step:
                tick, snap = self._pending.pop(0)
                try:
                    self._fire(pl_module, tick, snap, step, params)
                except Exception as e:  # never stop the user's run: keep the previous anchor, say why
                    self.last_refusal = Refusal(
                        "anchor_fire",
                        f"the snapshot of step {tick} could not be folded in: {type(e).__name__}: {e}",
                        numbers={"step": step, "tick": tick},
                        remedy="the anchor keeps its previous weights",
                    )
        if self._anchor is None:
            return
        if shards is not None:
            from ._distributed import fsdp_hooks_off

            with fsdp_hooks_off(pl_module):
                g_anchor = self._anchor_grad(trainer, pl_module, params)
        else:
            g_anchor = self._anchor_grad(trainer, pl_module, params)
        if g_anchor is None:
            return
        with torch.no_grad():
            self.m_anchor = {
                n: ema_update(None if self.m_anchor is None else self.m_anchor.get(n), g, self.beta_anc)
                for n, g in g_anchor.items()
            }
            try:
                disagree, count = self._merge(params)
                if shards is not None:
                    from ._distributed import write_back_grads

                    write_back_grads(shards, params)
                if count > 0:
                    self.merged_step = step
            except Exception as e:
                self.last_refusal = Refusal(
                    "anchor_merge",
                    f"the merger failed: {type(e).__name__}: {e}",
                    numbers={"step": step},
                    remedy=".grad was left as it was",
                )
                return
        if self.log_readings and count > 0:
            pl_module.log("anchor/disagree_fraction", disagree / count, on_step=True, on_epoch=False, batch_size=1)

    # -- pieces --------------------------------------------------------------------------------
    def _fire(self, pl_module: LightningModule, tick: int, snap: dict, step: int, params: dict) -> None:
        if self.projector is None:  # setup was skipped (a hook called by hand): build it now
            self.projector = self._new_projector()
        truth = {n: p.detach() for n, p in params.items()}
        m = self.m_anchor
        prj = self.projector.fire(snap, tick, step, truth=truth, m_anchor=m)
        r = prj.reading
        self.last_reading = r
        self.readings.append(r)
        use_hat = self.mode == "projected" and prj.theta_hat is not None and r.projected
        self._projected_active = use_hat
        self._tau = dict(prj.tau) if use_hat else {}
        self._gate = dict(prj.gate) if use_hat else {}
        self._anchor = {
            n: (prj.anchor[n] if use_hat else self.projector.ring.prev[n])
            .reshape(p.shape)
            .to(p.device, p.dtype)
            .clone()
            for n, p in params.items()
        }
        if prj.theta_hat is not None and r.projected:
            names = list(params)
            self.weight_error.update(
                [prj.theta_hat[n] for n in names],
                [truth[n] for n in names],
                [self.projector.ring.prev[n] for n in names],
            )
            total = self.projector.ring.numel()
            self.gated_on.update(round(r.gated_on_fraction * total), total)
        if self.log_readings:
            out = r.to_dict("anchor/")
            if prj.theta_hat is not None and r.projected:
                out["anchor/run/weight_err_ratio"] = float(self.weight_error.compute())
                out["anchor/run/gated_on_fraction"] = float(self.gated_on.compute())
            pl_module.log_dict(out, on_step=True, on_epoch=False, batch_size=1)
        n_proj = sum(1 for x in self.readings if x.projected)
        if r.projected and self.figure_every_n_fires and n_proj % self.figure_every_n_fires == 0:
            self._log_figure(pl_module, step)

    def _log_figure(self, pl_module: LightningModule, step: int) -> None:
        fit = self.projector.prev_fit.get("") if self.projector is not None else None
        if fit is None or getattr(pl_module, "global_rank", 0) != 0:
            return
        try:
            fig = coefficient_figure(fit, self.last_reading)
        except ImportError:  # matplotlib is an optional extra
            return
        log_figure(pl_module.trainer, "anchor/coefficient_trajectory", fig, step)

    def _anchor_grad(
        self, trainer: Trainer, pl_module: LightningModule, params: dict
    ) -> Optional[dict[str, torch.Tensor]]:
        devices = sorted({p.device.index or 0 for p in params.values() if p.device.type == "cuda"})
        error: Optional[BaseException] = None
        try:
            with torch.random.fork_rng(devices=devices), torch.enable_grad():
                terms, names, leaves, _ = evaluate_terms(pl_module, self._batch, self.dtype, params=self._anchor)
                loss = terms.terms.sum()
                if not loss.requires_grad:
                    raise ValueError("the anchor's terms carry no graph to the parameters.")
                gs = torch.autograd.grad(loss, leaves, allow_unused=True)
        except Exception as e:  # a reading that cannot be made never stops the user's run
            error = e
        world = getattr(trainer, "world_size", 1)
        if world > 1:
            # Every rank must agree before the collective below, or one failing rank would hang the others.
            ok = trainer.strategy.reduce_boolean_decision(error is None, all=True)
            if not ok and error is None:
                error = RuntimeError("the anchor's gradient failed on another rank.")
        if error is not None:
            self.last_refusal = Refusal(
                "anchor_gradient",
                f"the anchor's gradient could not be evaluated: {type(error).__name__}: {error}",
                numbers={"step": trainer.global_step},
                remedy="check `credit_terms` on the trained batch; .grad was left as it was",
            )
            return None
        out = {}
        for n, leaf, g in zip(names, leaves, gs):
            g = torch.zeros_like(leaf) if g is None else g.detach()
            g = g.to(params[n].dtype)
            if world > 1:
                # The anchor's backward does not go through DDP.forward: average it as DDP averages .grad.
                g = trainer.strategy.reduce(g.clone(), reduce_op="mean")
            out[n] = g
        return out

    def _merge(self, params: dict) -> tuple[float, float]:
        disagree, count = 0.0, 0.0
        if self.m_anchor is None:
            return disagree, count
        merged = []
        for n, p in params.items():
            if p.grad is None or n not in self.m_anchor:
                continue
            G, m = p.grad, self.m_anchor[n].to(p.grad.dtype)
            if self.mode == "projected" and self._projected_active and self._gate.get(n, False):
                new = projected_merge(G, m, self.alpha, self._tau[n], confidence_weights(m, self.kappa, self.p))
            else:
                new = signed_ema(G, m, self.alpha)
            disagree += float((torch.sign(G) * torch.sign(m) < 0).sum())
            count += G.numel()
            merged.append((p, new))
        if self.keep_pre_merge:
            by_param = {id(p): n for n, p in params.items()}
            self.pre_merge_grads = {by_param[id(p)]: p.grad.detach().clone() for p, _ in merged}
        for p, new in merged:  # all or nothing: a failure above leaves every .grad as it was
            p.grad.copy_(new)
        return disagree, count

    # -- persistence ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.mode == "off":
            return {}
        return {
            "projector": None if self.projector is None else self.projector.state_dict(),
            "pending": [(t, {n: x.clone() for n, x in s.items()}) for t, s in self._pending],
            "anchor": None if self._anchor is None else {n: x.clone() for n, x in self._anchor.items()},
            "projected_active": self._projected_active,
            "tau": dict(self._tau),
            "gate": dict(self._gate),
            "m_anchor": None if self.m_anchor is None else {n: x.clone() for n, x in self.m_anchor.items()},
            "last_step": self._last_step,
            "weight_error": {
                "err_sq": self.weight_error.err_sq.clone(),
                "stale_sq": self.weight_error.stale_sq.clone(),
            },
            "gated_on": {"on": self.gated_on.on.clone(), "total": self.gated_on.total.clone()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.mode == "off" or not state_dict:
            return
        self.projector = self._new_projector()
        if state_dict["projector"] is not None:
            self.projector.load_state_dict(state_dict["projector"])
        self._pending = [(int(t), dict(s)) for t, s in state_dict["pending"]]
        self._anchor = state_dict["anchor"]
        self._projected_active = bool(state_dict["projected_active"])
        self._tau = dict(state_dict["tau"])
        self._gate = dict(state_dict["gate"])
        self.m_anchor = state_dict["m_anchor"]
        self._last_step = int(state_dict["last_step"])
        self.weight_error.err_sq = state_dict["weight_error"]["err_sq"].clone()
        self.weight_error.stale_sq = state_dict["weight_error"]["stale_sq"].clone()
        self.gated_on.on = state_dict["gated_on"]["on"].clone()
        self.gated_on.total = state_dict["gated_on"]["total"].clone()
        self._restored = True  # a checkpoint may have been loaded onto another device

    def _move_state(self, params: dict) -> None:
        # Each tensor follows its parameter's device (the ring's Grams stay on the CPU).
        dev = {n: p.device for n, p in params.items()}
        if self.projector is not None:
            ring = self.projector.ring
            for n in ring.names:
                d = dev.get(n)
                if d is None:
                    continue
                ring.base[n] = ring.base[n].to(d)
                ring.prev[n] = ring.prev[n].to(d)
                for dk in ring.deltas:
                    dk[n] = dk[n].to(d)
        self._pending = [(t, {n: x.to(dev.get(n, x.device)) for n, x in snap.items()}) for t, snap in self._pending]
        for store in (self._anchor, self.m_anchor):
            if store is not None:
                for n in list(store):
                    store[n] = store[n].to(dev.get(n, store[n].device))
        self._restored = False


def coefficient_figure(fit: Any, reading: Optional[AnchorReading] = None) -> Any:
    """A matplotlib figure: the window's coefficients ``c_i`` on their ticks, the OLS line and ``ĉ(t_tgt)``."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(fit.ticks, fit.c, "o", label="c_i = <Δ_i, v1>")
    t_end = reading.t_tgt if reading is not None and math.isfinite(reading.t_tgt) else fit.ticks[-1]
    xs = [fit.ticks[0], t_end]
    ax.plot(xs, [fit.predict(x) for x in xs], "-", label=f"OLS a={fit.a:.3g}, R²={fit.r2:.3f}")
    if reading is not None and math.isfinite(reading.t_tgt):
        ax.plot([reading.t_tgt], [fit.predict(reading.t_tgt)], "*", ms=10, label="ĉ(t_tgt)")
    ax.set_xlabel("step")
    ax.set_ylabel("coefficient on v1")
    ax.set_title(f"EVR1 {fit.evr1:.3f}, W {fit.W}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
