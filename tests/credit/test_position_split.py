"""The position split: where the step's gradient was computed, beside the loss-mask split, in the same pass.

Reference (independent of the engine's pieces): every covered layer gets a zero perturbation ``E_P`` that
acts only at the positions of part ``P`` (a Linear adds ``mask_P · (x E_Pᵀ)``, an embedding ``mask_P · E_P[id]``,
a LayerNorm ``mask_P · (x̂ ∘ e_w + e_b)``); autograd's gradient with respect to ``E_P`` is the piece of the
gradient computed at ``P``, and its dot with ``g_full`` over ``‖g_full‖²`` is ``P``'s share. One backward
per part, float64.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lens_callbacks.credit import CreditTerms, disintegrate
from lens_callbacks.credit.engines.ghost import RideAlong
from lens_callbacks.credit.inputs.partition import by_rollout, position_parts
from tests.credit.test_ghost_rules import VocabPolicy, vocab_batch

TOL = 1e-12


class WholePolicy(VocabPolicy):
    """The vocabulary policy with its head on every position (as transformers' models run it)."""

    def segments(self, B, T):
        return None, None

    def credit_terms(self, batch):
        tokens, trained, adv, group = batch
        B, T = tokens.shape
        x = self.tok(tokens) + self.pos(torch.arange(T)[None])  # [B, T, d]
        causal = torch.tril(torch.ones(T, T, dtype=x.dtype)) / torch.arange(1, T + 1, dtype=x.dtype)[:, None]
        x = self.norm(causal @ x)  # [B, T, d]
        h = x + self.out(torch.tanh(self.fc(x)))  # [B, T, d]
        lp = torch.log_softmax(self.head(h), -1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]  # [B, T-1]
        lp = nn.functional.pad(lp, (1, 0))  # [B, T]
        terms = -adv[:, None] * lp * trained / trained.sum().clamp_min(1)  # [B, T]
        seg, names = self.segments(B, T)
        return CreditTerms(terms, trained, torch.arange(B), group, segment=seg, segment_names=names)


class TurnPolicy(WholePolicy):
    """Three segments per row, the first (a prompt) untrained; position 0 outside every segment."""

    def segments(self, B, T):
        seg = torch.arange(T)[None].expand(B, T) * 3 // T  # [B, T] in 0..2
        return seg.masked_fill(torch.arange(T)[None].expand(B, T) == 0, -1), ("user", "assistant", "tool")


def _perturbed_shares(module: VocabPolicy, batch) -> dict[str, float]:
    """Each position part's share by autograd through per-part zero perturbations (the reference)."""
    terms0 = module.credit_terms(batch)
    ids, names = position_parts(terms0)
    params = [p for p in module.parameters() if p.requires_grad]
    g_full = torch.autograd.grad(terms0.terms.sum(), params)
    full = dict(zip([n for n, p in module.named_parameters() if p.requires_grad], g_full))
    full_sq = math.fsum(float((g * g).sum()) for g in g_full)
    out = {}
    for k, name in enumerate(names):
        mask = (ids == k).to(torch.float64)[..., None]  # [B, T, 1]
        pert, handles = {}, []

        def lin_hook(mod, inp, y, key):
            E = torch.zeros_like(mod.weight, requires_grad=True)
            pert[key + ".weight"] = E
            extra = inp[0] @ E.T
            if mod.bias is not None:
                e = torch.zeros_like(mod.bias, requires_grad=True)
                pert[key + ".bias"] = e
                extra = extra + e
            return y + mask * extra

        def emb_hook(mod, inp, y, key):
            E = torch.zeros_like(mod.weight, requires_grad=True)
            pert.setdefault(key + ".weight", [])
            pert[key + ".weight"].append(E)
            extra = E[inp[0]]
            return y + (mask if extra.shape[0] == mask.shape[0] else mask[:1]) * extra

        def norm_hook(mod, inp, y, key):
            ew = torch.zeros_like(mod.weight, requires_grad=True)
            eb = torch.zeros_like(mod.bias, requires_grad=True)
            pert[key + ".weight"], pert[key + ".bias"] = ew, eb
            xhat = nn.functional.layer_norm(inp[0], mod.normalized_shape, None, None, mod.eps)
            return y + mask * (xhat * ew + eb)

        for key, mod in module.named_modules():
            hook = {nn.Linear: lin_hook, nn.Embedding: emb_hook, nn.LayerNorm: norm_hook}.get(type(mod))
            if hook is not None:
                handles.append(mod.register_forward_hook(lambda m, i, y, key=key, h=hook: h(m, i, y, key)))
        try:
            loss = module.credit_terms(batch).terms.sum()
        finally:
            for h in handles:
                h.remove()
        flat = {kk: (v if isinstance(v, list) else [v]) for kk, v in pert.items()}
        leaves = [e for v in flat.values() for e in v]
        grads = iter(torch.autograd.grad(loss, leaves))
        dot = 0.0
        for key, es in flat.items():
            g_sum = sum(next(grads) for _ in es)
            name_p = key if key in full else key.replace("head.weight", "tok.weight")  # the tied head
            dot += float((g_sum * full[name_p]).sum())
        out[name] = dot / full_sq
    return out


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("readings", ["all", "projected"])
def test_the_position_split_equals_the_perturbation_reference_and_sums_to_one(tie, readings):
    module, batch = TurnPolicy(tie=tie), vocab_batch()
    ref = _perturbed_shares(module, batch)
    r = disintegrate(module, batch, "by_rollout", dtype="float64", readings=readings, position_split=True)
    split = r.position_split
    assert split is not None and split.ok, split
    assert split.part_names == ("user", "assistant", "tool", "outside_segments")
    for name, share in zip(split.part_names, split.projected_share):
        assert abs(share - ref[name]) <= TOL, (name, share, ref[name])
    assert abs(math.fsum(split.projected_share) - 1.0) <= 1e-12 and split.conservation_error <= 1e-12
    # the untrained user turn carries credit through attention: the loss-mask split gives it none
    assert abs(ref["user"]) > 1e-3


def test_with_each_row_its_own_segment_the_position_split_is_the_rollout_split():
    class RowSegments(WholePolicy):
        def segments(self, B, T):
            return torch.arange(B)[:, None].expand(B, T).clone(), None

    r = disintegrate(RowSegments(tie=True), vocab_batch(), "by_rollout", dtype="float64", position_split=True)
    assert r.position_split.ok, r.position_split.reason
    for a, b in zip(r.projected_share, r.position_split.projected_share):  # rows do not interact
        assert abs(a - b) <= TOL


def test_riding_along_reads_the_same_position_split():
    module, batch = TurnPolicy(tie=True), vocab_batch()
    sep = disintegrate(module, batch, "by_rollout", dtype="float64", readings="shares", position_split=True)
    ride = RideAlong(module).start()
    loss = module.credit_terms(batch).terms.sum()
    ride.on_loss(loss, by_rollout, readings="shares", position_split=True)
    loss.backward()
    got = ride.report(by_rollout, readings="shares")
    ride.clear()
    assert not isinstance(got, str), got
    for a, b in zip(sep.position_split.projected_share, got.position_split.projected_share):
        assert abs(a - b) <= TOL


def test_the_position_split_says_why_it_is_not_read():
    module, batch = TurnPolicy(tie=True), vocab_batch()
    r = disintegrate(module, batch, "by_segment", dtype="float64", position_split=True, engine="reference")
    assert not r.position_split.ok and "one-pass engine" in r.position_split.reason
    assert r.to_dict()["credit/position_split/read"] == 0.0


def test_the_callback_logs_and_tables_the_position_split_separate_and_riding_along():
    import warnings

    import lightning.pytorch as pl

    from lens_callbacks.callbacks import CreditAuditCallback

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.policy = TurnPolicy(tie=True)

        def credit_terms(self, batch=None):
            return self.policy.credit_terms(vocab_batch())

        def training_step(self, batch, batch_idx):
            return self.credit_terms().terms.sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)  # the same step twice: the two audits compare

    got = {}
    for capture in ("separate", "training_step"):
        audit = CreditAuditCallback(
            capture=capture,
            readings="shares",
            position_split=True,
            dtype="float64",
            log_figure=False,
            log_table_every_n_steps=0,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            pl.Trainer(
                max_steps=1,
                accelerator="cpu",
                devices=1,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[audit],
            ).fit(Lit(), torch.utils.data.DataLoader(range(1), batch_size=None))
        got[capture] = {k: v for k, v in audit.last_values.items() if "position_split" in k}
        assert "position split (the gradient computed" in audit.last_table.render()
    assert got["separate"]["credit/position_split/read"] == 1.0
    for k, v in got["separate"].items():
        assert abs(v - got["training_step"][k]) <= 1e-12, k
    ref = _perturbed_shares(TurnPolicy(tie=True), vocab_batch())
    assert abs(got["separate"]["credit/position_split/projected_share/user"] - ref["user"]) <= TOL
