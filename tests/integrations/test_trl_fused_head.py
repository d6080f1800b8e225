"""TRL's fused LM head as the one-pass engine reads it: the logits gradient recomputed with TRL's tile code,
held against autograd on the materialised logits, and the capture's failures turned into a fallback."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl", reason="the `trl` extra is not installed: pip install -e '.[trl]'")

from trl.kernels.chunked_logprob import ChunkedLogProbFunction  # noqa: E402

from lens_callbacks.integrations import trl_fused_head  # noqa: E402
from lens_callbacks.integrations.trl_fused_head import fused_head_refusal, fused_logits_grad  # noqa: E402


def _dense_logits_grad(h, W, b, targets, temperature, softcap, scale, g_lp, g_ent):
    """The same per-token outputs from the materialised ``[N, V]`` logits, differentiated by autograd."""
    z = (h @ W.t() + (0 if b is None else b)).detach().requires_grad_(True)  # [N, V]
    y = z * scale
    if softcap is not None:
        y = softcap * torch.tanh(y / softcap)
    y = y / temperature
    logp = torch.log_softmax(y, -1)  # [N, V]
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)  # [N]
    ent = -(logp.exp() * logp).sum(-1)  # [N]
    loss = (lp * g_lp).sum() + (0 if g_ent is None else (ent * g_ent).sum())
    (dz,) = torch.autograd.grad(loss, z)
    return dz


@pytest.mark.parametrize(
    ("softcap", "scale", "temperature", "bias", "entropy"),
    [(None, 1.0, 1.0, False, False), (None, 0.5, 0.7, True, True), (30.0, 2.0, 1.3, False, True)],
    ids=["plain", "scaled+bias+entropy", "softcap"],
)
def test_the_logits_gradient_is_the_one_trls_backward_forms(softcap, scale, temperature, bias, entropy):
    g = torch.Generator().manual_seed(0)
    N, d, V, chunk = 24, 16, 4099, 1024  # V not a multiple of the tile: a short last tile
    h = torch.randn(N, d, generator=g, dtype=torch.float64).requires_grad_(True)
    W = (0.3 * torch.randn(V, d, generator=g, dtype=torch.float64)).requires_grad_(True)
    b = (0.1 * torch.randn(V, generator=g, dtype=torch.float64)).requires_grad_(True) if bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    targets[:3] = torch.tensor([0, V - 1, V - 1])  # the first and last tile, and a repeated token
    outputs = ("log_probs", "entropy") if entropy else ("log_probs",)
    lp, ent, *_ = ChunkedLogProbFunction.apply(h, W, b, targets, temperature, chunk, softcap, scale, outputs)
    g_lp = torch.randn(N, generator=g, dtype=torch.float64)
    g_ent = torch.randn(N, generator=g, dtype=torch.float64) if entropy else None

    dz = fused_logits_grad(lp.grad_fn, g_lp, g_ent)  # [N, V]
    ref = _dense_logits_grad(h.detach(), W.detach(), None if b is None else b.detach(), targets, temperature, softcap, scale,
                             g_lp, g_ent)
    # TRL's fold works in float32 whatever the inputs' dtype: float32's roundoff, relative to the largest entry
    assert dz.shape == (N, V)
    assert float((dz - ref).abs().max()) <= 1e-6 * float(ref.abs().max()), float((dz - ref).abs().max())

    # and its weight gradient is the one TRL's own backward gives the head: Σ_t z'_t ⊗ h_t
    torch.autograd.backward([x for x in (lp, ent) if x is not None], [x for x in (g_lp, g_ent) if x is not None])
    assert torch.allclose(dz.t() @ h.detach(), W.grad, rtol=1e-5, atol=1e-6 * float(W.grad.abs().max()))
    if b is not None:
        assert torch.allclose(dz.sum(0), b.grad, rtol=1e-5, atol=1e-6 * float(b.grad.abs().max()))


def test_a_triton_device_is_refused_with_the_reason(monkeypatch):
    assert fused_head_refusal(torch.device("cpu")) is None
    monkeypatch.setattr("trl.kernels.chunked_logprob._use_triton", lambda device: True)
    reason = fused_head_refusal(torch.device("cpu"))
    assert "Triton" in reason and "LoRA" in reason


def test_a_failure_in_the_head_capture_sends_the_step_to_the_separate_pass(tmp_path, monkeypatch):
    from trl import GRPOTrainer

    from lens_callbacks.credit import CreditReport
    from lens_callbacks.examples.trl_grpo import digit_reward, grpo_config, prompt_dataset, save_policy, tiny_tokenizer
    from lens_callbacks.integrations.trl import LensGRPOMixin, LensTRLCallback

    class AuditedGRPO(LensGRPOMixin, GRPOTrainer):
        pass

    def broken(node, g_lp, g_ent):
        raise RuntimeError("no logits gradient here")

    monkeypatch.setattr(trl_fused_head, "fused_logits_grad", broken)
    policy = save_policy(str(tmp_path / "policy"))
    cb = LensTRLCallback()
    tr = AuditedGRPO(model=policy, reward_funcs=digit_reward, processing_class=tiny_tokenizer(),
                     args=grpo_config(str(tmp_path / "out"), max_steps=1, gradient_accumulation_steps=1,
                                      per_device_train_batch_size=8, scale_rewards="none"),
                     train_dataset=prompt_dataset(), callbacks=[cb])
    tr.train()  # the failure is inside TRL's backward: training goes on
    (_, report), = cb.history
    assert isinstance(report, CreditReport) and report.engine == "ghost" and report.grad_match <= 1e-6
    assert "fused LM head could not be read" in cb.ride_reason and "no logits gradient here" in cb.ride_reason
