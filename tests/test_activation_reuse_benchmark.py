"""The activation-reuse prototype's tangent pass is the same derivative, and takes the step's outputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, jvp

from lens_callbacks.credit import CreditTerms
from lens_callbacks.credit.engines import forward_rules as fr
from lens_callbacks.credit.engines.jvp import terms_jvp

transformers = pytest.importorskip("transformers")


class Terms(nn.Module):
    def __init__(self, lm: nn.Module, ids: torch.Tensor) -> None:
        super().__init__()
        self.lm, self.ids = lm, ids

    def forward(self) -> torch.Tensor:
        logits = self.lm(input_ids=self.ids, use_cache=False).logits[:, :-1]  # [B, T-1, V]
        return torch.log_softmax(logits, -1).gather(-1, self.ids[:, 1:, None])[..., 0]  # [B, T-1]

    def credit_terms(self, batch=None) -> CreditTerms:
        t = self()
        B = t.shape[0]
        return CreditTerms(t, torch.ones_like(t, dtype=torch.bool), torch.arange(B), torch.zeros(B, dtype=torch.long))


def _module() -> Terms:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="eager",
    )
    lm = transformers.LlamaForCausalLM(cfg).double()
    return Terms(lm, torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(1)))


def _replayed(bench, module: Terms, kept, direction) -> tuple[torch.Tensor, torch.Tensor]:
    saved = fr.RULES[bench.LINEAR]
    fr.RULES[bench.LINEAR] = ("linear", bench.replaying_linear(kept))
    try:
        terms, tangent = terms_jvp(module, None, direction, dtype="float64")
    finally:
        fr.RULES[bench.LINEAR] = saved
    return terms.terms, tangent


@pytest.mark.parametrize("head", [False, True], ids=["body", "with-head"])
def test_the_replayed_pass_equals_torch_func_jvp_and_reads_the_kept_outputs(bench_script, head):
    bench = bench_script("activation_reuse")
    module = _module()
    params = dict(module.named_parameters())
    g = torch.Generator().manual_seed(2)
    direction = {n: torch.randn(p.shape, dtype=p.dtype, generator=g) for n, p in params.items()}
    keep = bench.KeepLinearOutputs(None if head else 40)
    with keep:
        module()  # the step's forward
    n_linear = 2 * 7 + 1
    assert len(keep.kept) == n_linear and (keep.kept[-1] is None) == (not head)
    # independent reference: torch.func's forward mode over the functional module
    ref_terms, ref_tangent = jvp(lambda p: functional_call(module, p, ()), (params,), (direction,))
    terms, tangent = _replayed(bench, module, keep.kept, direction)
    ref_terms, ref_tangent = ref_terms.detach(), ref_tangent.detach()
    assert float((tangent - ref_tangent).abs().max()) <= 1e-12 * float(ref_tangent.abs().max())
    assert float((terms - ref_terms).abs().max()) <= 1e-12
    # the kept outputs are what the pass uses: move the last one kept (the head's logits, or the last layer's
    # down projection); a product's primal is the kept value whatever its input, so an earlier one reaches the
    # terms through the tangent only
    moved, last = list(keep.kept), -1 if head else -2
    moved[last] = moved[last] + 0.5 * torch.randn(moved[last].shape, dtype=moved[last].dtype, generator=g)
    moved_terms, _ = _replayed(bench, module, moved, direction)
    assert float((moved_terms - terms).abs().max()) > 1e-3
    with pytest.raises(RuntimeError, match="does not match"):
        _replayed(bench, module, [keep.kept[1][..., :3]] + keep.kept[1:], direction)
