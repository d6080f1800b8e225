"""Why every audit pass runs under ``audit_passes()``: two reproductions in plain torch, and the fix.

1. ``torch.func.functional_call`` on an inductor-compiled module followed by repeated
   ``torch.autograd.grad(..., retain_graph=True)`` — one full gradient and one per part, as the reference
   engine takes them — returns parts whose sum is not the full gradient (measured 0.158 relative on a tiny
   Llama; in any case far above float32 rounding). Run eagerly (``torch.compiler.set_stance("force_eager")``),
   the same calls are exact.
2. Reentrant activation checkpointing refuses ``torch.autograd.grad`` with respect to its inputs and hides
   the parameters inside it from the graph (their gradient reads as None, silently zero); run as
   non-reentrant, the gradient equals the unchecked one bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from lens_callbacks.credit.primitives import audit_passes


def _llama():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg)


def _parts_gap(model, ids, adv) -> float:
    """``‖Σ_S g_S − g_full‖ / ‖g_full‖`` with every gradient taken as the reference engine takes it."""
    params = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    logits = torch.func.functional_call(model, params, (ids,)).logits[:, :-1]
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]  # [B, T-1]
    terms = -adv[:, None] * lp / lp.numel()
    leaves = list(params.values())
    full = torch.autograd.grad(terms.sum(), leaves, retain_graph=True, allow_unused=True)
    total = [torch.zeros_like(x) for x in leaves]
    for k in range(terms.shape[0]):
        gs = torch.autograd.grad(terms[k].sum(), leaves, retain_graph=True, allow_unused=True)
        for t, g in zip(total, gs):
            if g is not None:
                t.add_(g)
    flat = lambda xs: torch.cat([(torch.zeros_like(x) if g is None else g).reshape(-1) for x, g in zip(leaves, xs)])  # noqa: E731
    f = flat(full)
    return float((torch.cat([t.reshape(-1) for t in total]) - f).norm() / f.norm())


@pytest.mark.slow
def test_functional_call_through_an_inductor_compiled_module_loses_conservation_and_eager_keeps_it():
    model = _llama()
    compiled = torch.compile(model, backend="inductor")
    g = torch.Generator().manual_seed(1)
    ids, adv = torch.randint(0, 64, (4, 16), generator=g), torch.randn(4, generator=g)
    compiled(ids).logits.sum().backward()  # compiled as training would compile it
    broken = _parts_gap(compiled, ids, adv)
    assert broken > 1e-3, broken  # the reproduction: far above float32 rounding (2e-7 below)
    with audit_passes():
        fixed = _parts_gap(compiled, ids, adv)
    assert fixed < 1e-6, fixed


def test_reentrant_checkpointing_refuses_autograd_grad_and_the_audit_runs_it_non_reentrant():
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)

    def loss():
        return checkpoint(lambda y: torch.tanh(lin(y)), x, use_reentrant=True).sum()

    with pytest.raises(RuntimeError, match="use_reentrant=True, torch.utils.checkpoint is incompatible with .grad"):
        torch.autograd.grad(loss(), [x])
    # worse, the parameters inside the checkpoint are not in the graph at all: their gradient reads as None
    assert torch.autograd.grad(loss(), list(lin.parameters()), allow_unused=True) == (None, None)
    with audit_passes():
        got = torch.autograd.grad(loss(), list(lin.parameters()))
    want = torch.autograd.grad(torch.tanh(lin(x)).sum(), list(lin.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    import torch.utils.checkpoint as ckpt

    assert ckpt.CheckpointFunction.__name__ == "CheckpointFunction"  # restored on exit


def test_compiled_code_is_left_alone_on_exit():
    assert torch.compiler.is_compiling() is False
    with audit_passes():
        pass
    f = torch.compile(lambda x: x * 2, backend="eager")
    assert torch.equal(f(torch.ones(2)), torch.full((2,), 2.0))
