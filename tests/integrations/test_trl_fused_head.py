"""TRL's fused LM head as the one-pass engine reads it: the logits gradient copied out of TRL's own backward,
held against autograd on the materialised logits, and the capture's failures turned into a fallback."""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("trl", reason="the `trl` extra is not installed: pip install -e '.[trl]'")

from trl.kernels.chunked_logprob import ChunkedLogProbFunction  # noqa: E402

from lens_callbacks.integrations import trl_fused_head  # noqa: E402
from lens_callbacks.integrations.trl_fused_head import fused_head_refusal  # noqa: E402


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


@contextlib.contextmanager
def _capturing(root, rows):
    """A capture of ``root`` installed and active, as the engines use one; its fused-head extension."""
    from lens_callbacks.credit.engines.ghost import RowCapture
    from lens_callbacks.integrations.trl_fused_head import head_captures

    cap = RowCapture(root).install()
    cap.batch = rows  # what the layers before the head would have set
    cap.active = True
    (fc,) = head_captures(cap)
    try:
        yield cap, fc
    finally:
        cap.remove()


def _recorded(h, W, b, targets, temperature, chunk, softcap, scale, outputs, rows, grads):
    """The head's use as the capture records it for one call of TRL's function, after its backward."""
    import trl.trainer.utils as utils

    head = torch.nn.Linear(W.shape[1], W.shape[0], bias=b is not None, dtype=W.dtype)
    head.weight = W
    if b is not None:
        head.bias = b
    with _capturing(head, rows) as (cap, fc):
        out = utils._ChunkedLogProbFunction.apply(h, W, b, targets, temperature, chunk, softcap, scale, outputs)
    torch.autograd.backward([x for x in out[:2] if x is not None], [g for g in grads if g is not None])
    assert fc.error is None, fc.error
    (use,) = cap.uses
    return use


@pytest.mark.parametrize(
    ("softcap", "scale", "temperature", "bias", "entropy"),
    [(None, 1.0, 1.0, False, False), (None, 0.5, 0.7, True, True), (30.0, 2.0, 1.3, False, True)],
    ids=["plain", "scaled+bias+entropy", "softcap"],
)
def test_the_recorded_logits_gradient_is_the_one_trls_backward_forms(softcap, scale, temperature, bias, entropy):
    g = torch.Generator().manual_seed(0)
    rows, n, d, V, chunk = 3, 8, 16, 4099, 1024  # V not a multiple of the tile: a short last tile
    N = rows * n
    h = torch.randn(N, d, generator=g, dtype=torch.float64).requires_grad_(True)
    W = torch.nn.Parameter(0.3 * torch.randn(V, d, generator=g, dtype=torch.float64))
    b = torch.nn.Parameter(0.1 * torch.randn(V, generator=g, dtype=torch.float64)) if bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    targets[:3] = torch.tensor([0, V - 1, V - 1])  # the first and last tile, and a repeated token
    outputs = ("log_probs", "entropy") if entropy else ("log_probs",)
    g_lp = torch.randn(N, generator=g, dtype=torch.float64)
    g_ent = torch.randn(N, generator=g, dtype=torch.float64) if entropy else None
    ref = _dense_logits_grad(
        h.detach(), W.detach(), None if b is None else b.detach(), targets, temperature, softcap, scale, g_lp, g_ent
    )  # [N, V]
    use = _recorded(h, W, b, targets, temperature, chunk, softcap, scale, outputs, rows, (g_lp, g_ent))

    dz = use.b.reshape(N, V)
    assert use.a.shape == (rows, n, d) and use.b.shape == (rows, n, V)
    # TRL's fold works in float32 whatever the inputs' dtype: float32's roundoff, relative to the largest entry
    assert float((dz - ref).abs().max()) <= 1e-6 * float(ref.abs().max()), float((dz - ref).abs().max())
    # and the rows' pieces add up to the gradient TRL's own backward gave the head: Σ_t z'_t ⊗ h_t
    assert torch.allclose(dz.t() @ h.detach(), W.grad, rtol=1e-5, atol=1e-6 * float(W.grad.abs().max()))
    if b is not None:
        assert torch.allclose(dz.sum(0), b.grad, rtol=1e-5, atol=1e-6 * float(b.grad.abs().max()))


def test_recording_leaves_trls_gradients_bit_identical():
    import trl.trainer.utils as utils

    g = torch.Generator().manual_seed(3)
    h0 = torch.randn(12, 8, generator=g)
    W0 = torch.randn(300, 8, generator=g)
    targets = torch.randint(0, 300, (12,), generator=g)
    g_lp, g_ent = torch.randn(12, generator=g), torch.randn(12, generator=g)
    args = (1.0, 128, None, 1.0, ("log_probs", "entropy"))

    h, W = h0.clone().requires_grad_(True), torch.nn.Parameter(W0.clone())
    lp, ent, *_ = utils._ChunkedLogProbFunction.apply(h, W, None, targets, *args)  # TRL's own
    torch.autograd.backward([lp, ent], [g_lp, g_ent])
    h2 = h0.clone().requires_grad_(True)
    use = _recorded(h2, torch.nn.Parameter(W0.clone()), None, targets, *args, 3, (g_lp, g_ent))
    assert torch.equal(use.weight.grad, W.grad) and torch.equal(h2.grad, h.grad)


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

    def broken(self, fold):
        raise RuntimeError("no logits gradient here")

    monkeypatch.setattr(trl_fused_head._TileSink, "wrap", broken)
    policy = save_policy(str(tmp_path / "policy"))
    cb = LensTRLCallback()
    tr = AuditedGRPO(
        model=policy,
        reward_funcs=digit_reward,
        processing_class=tiny_tokenizer(),
        args=grpo_config(
            str(tmp_path / "out"),
            max_steps=1,
            gradient_accumulation_steps=1,
            per_device_train_batch_size=8,
            scale_rewards="none",
        ),
        train_dataset=prompt_dataset(),
        callbacks=[cb],
    )
    tr.train()  # the failure is inside TRL's backward: training goes on
    ((_, report),) = cb.history
    assert isinstance(report, CreditReport) and report.engine == "ghost" and report.grad_match <= 1e-6
    assert "fused LM head could not be read" in cb.ride_reason and "no logits gradient here" in cb.ride_reason


def _head_call(hidden, head, targets):
    import trl.trainer.utils as utils

    # as TRL's fused forward calls it off Triton devices: every position, targets clamped
    return utils._ChunkedLogProbFunction.apply(
        hidden, head.weight, head.bias, targets, 1.0, 16, None, 1.0, ("log_probs", "entropy")
    )


def test_the_capture_records_the_heads_use_before_its_weight_is_reduced():
    g = torch.Generator().manual_seed(1)
    B, n, d, V = 3, 5, 8, 40
    head = torch.nn.Linear(d, V, bias=True)
    hidden = torch.randn(B * n, d, generator=g).requires_grad_(True)
    targets = torch.randint(0, V, (B * n,), generator=g)
    seen = []
    with _capturing(head, B) as (cap, fc):  # the head is never called as a module: no layer hook fires for it
        head.weight.register_hook(lambda gw: seen.append(cap.uses[0].b is not None))  # B exists when W's grad does
        lp, ent, *_ = _head_call(hidden, head, targets)
    assert fc.error is None and fc.calls == 1
    (use,) = cap.uses
    assert use.rule == "fused_lm_head" and use.a.shape == (B, n, d) and use.weight is head.weight
    g_lp, g_ent = torch.randn(B * n, generator=g), torch.randn(B * n, generator=g)
    torch.autograd.backward([lp, ent], [g_lp, g_ent])
    assert seen == [True]
    ref = _dense_logits_grad(
        hidden.detach().double(),
        head.weight.detach().double(),
        head.bias.detach().double(),
        targets,
        1.0,
        None,
        1.0,
        g_lp.double(),
        g_ent.double(),
    )
    assert use.b.shape == (B, n, V)
    assert torch.allclose(use.b.reshape(B * n, V).double(), ref, atol=1e-6 * float(ref.abs().max()))
    # the rows' pieces Σ_t z'_t ⊗ h_t add up to the head's own gradient
    assert torch.allclose(torch.einsum("bnv,bnd->vd", use.b, use.a), head.weight.grad, atol=1e-6)


def test_a_forward_that_calls_the_head_twice_is_not_read_and_the_function_is_restored():
    import trl.trainer.utils as utils

    head = torch.nn.Linear(4, 10, bias=False)
    hidden = torch.randn(8, 4, requires_grad=True)
    targets = torch.randint(0, 10, (8,))
    with _capturing(head, 2) as (cap, fc):  # a forward split in two chunks of one row each
        assert utils._ChunkedLogProbFunction is fc
        _head_call(hidden[:4], head, targets[:4])
        _head_call(hidden[4:], head, targets[4:])
    assert "ran 2 times" in fc.error and len(cap.uses) == 1  # the engine finds two edges, one use: exact fallback
    assert utils._ChunkedLogProbFunction is ChunkedLogProbFunction  # restored when the capture is removed


def test_a_weight_outside_the_captures_root_is_not_recorded():
    head, other = (
        torch.nn.Linear(4, 10, bias=False),
        torch.nn.Linear(4, 10, bias=False),
    )  # e.g. a reference model's head
    with _capturing(head, 2) as (cap, fc):
        _head_call(torch.randn(8, 4, requires_grad=True), other, torch.randint(0, 10, (8,)))
    assert cap.uses == [] and fc.calls == 0 and fc.error is None


def test_on_a_triton_device_the_head_is_not_recorded(monkeypatch):
    # TRL scores only the labelled positions there (hidden[mask]): whatever the count, the rows are lost
    monkeypatch.setattr(trl_fused_head, "fused_head_refusal", lambda device: "Triton")
    head = torch.nn.Linear(4, 10, bias=False)
    with _capturing(head, 2) as (cap, fc):
        _head_call(torch.randn(8, 4, requires_grad=True), head, torch.randint(0, 10, (8,)))
    assert cap.uses == [] and "Triton" in fc.error


def test_two_captures_removed_in_the_order_they_were_installed_restore_the_function():
    import trl.trainer.utils as utils

    from lens_callbacks.credit.engines.ghost import RowCapture

    head = torch.nn.Linear(4, 10, bias=False)
    first = RowCapture(head).install()
    second = RowCapture(head).install()  # two riders on one step (a credit audit and probe credit)
    assert utils._ChunkedLogProbFunction is not ChunkedLogProbFunction
    first.remove()
    assert utils._ChunkedLogProbFunction is not ChunkedLogProbFunction  # the second is still installed
    second.remove()
    assert utils._ChunkedLogProbFunction is ChunkedLogProbFunction
