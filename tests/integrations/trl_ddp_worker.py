"""One rank of a 2-process CPU GRPOTrainer run with the audit attached (launched by test_trl_ddp.py).

Writes ``rank{r}.json`` under ``out_dir``: per loss type and audited step, the adapter's global readings and an
independent reference — this rank's per-row gradients by a plain ``torch.autograd.grad`` loop on the live
parameters (no engine, no ``functional_call``, no collective), each dotted in float64 with the un-clipped
averaged ``.grad`` the optimizer applies. The test gathers both ranks' files and compares.

Usage: ``python -m torch.distributed.run --nproc_per_node 2 --master_port P trl_ddp_worker.py POLICY OUT RUN...``
with RUN among :data:`VARIANTS`.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from peft import LoraConfig
from transformers import TrainerCallback
from trl import GRPOTrainer

from lens_callbacks.credit import CreditReport
from lens_callbacks.examples.trl_grpo import digit_reward, grpo_config, prompt_dataset, tiny_tokenizer
from lens_callbacks.integrations.trl import LensGRPOMixin, LensTRLCallback
from tests._spawn_exit import leave_rank


class AuditedGRPO(LensGRPOMixin, GRPOTrainer):
    pass


class ForgetsWorldSize(AuditedGRPO):
    """dapo's normaliser without TRL's division by num_processes: each rank's terms come out 1/W too small."""

    def _lens_micro_terms(self, mb):
        terms, trained, tokens = super()._lens_micro_terms(mb)
        return terms / self.accelerator.num_processes, trained, tokens


class FailsOnRankOne(AuditedGRPO):
    """A policy whose terms cannot be re-derived on rank 1 alone: the other rank must not wait for it."""

    def credit_terms(self, batch=None):
        if self.accelerator.process_index == 1:
            raise RuntimeError("no terms on this rank")
        return super().credit_terms(batch)


# run name -> (trainer class, loss type, LensTRLCallback arguments, steps, GRPOConfig overrides)
VARIANTS = {
    "grpo": (AuditedGRPO, "grpo", {}, 2, {}),
    "dapo": (AuditedGRPO, "dapo", {}, 2, {}),
    "grpo_reference": (AuditedGRPO, "grpo", {"engine": "reference"}, 1, {}),
    # the high-entropy mask's threshold is a quantile over every rank's entropies (a collective in TRL)
    "bnpo_entropy_mask": (AuditedGRPO, "bnpo", {}, 1, {"top_entropy_quantile": 0.5}),
    "dapo_forgets_world_size": (ForgetsWorldSize, "dapo", {"conservation": False}, 1, {}),
    "grpo_fails_on_rank1": (FailsOnRankOne, "grpo", {}, 2, {}),
}


class RowReference(TrainerCallback):
    """Per-row ``<g_k, ḡ>`` by one plain backward per row, after the audit, before the optimizer step."""

    def __init__(self) -> None:
        self.trainer = None
        self.steps: list[dict] = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        tr = self.trainer
        coef = tr.lens_clip_coefficient()
        coef = float(coef)
        named = [(n, p) for n, p in tr.model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        gbar = [torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.double() / coef for p in params]
        micro = tr.lens_micro_batches()
        dots: dict[str, float] = {}
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            terms = tr.credit_terms(micro)  # [B, T], on the live parameters
            rows = terms.terms.size(0)
            for k in range(rows):
                loss_k = terms.terms[k][terms.trained[k]].sum()
                g_k = torch.autograd.grad(loss_k, params, retain_graph=k < rows - 1, allow_unused=True)
                dots[str(int(terms.rollout[k]))] = sum(
                    float((g.double() * v).sum()) for g, v in zip(g_k, gbar) if g is not None
                )
        self.steps.append(
            {
                "step": int(state.global_step),
                "dots": dots,
                "gbar_sq": sum(float((v * v).sum()) for v in gbar),
                "clip_coef": coef,
            }
        )


def run(policy: str, out: str, name: str) -> dict:
    cls, loss_type, cb_args, steps, config = VARIANTS[name]
    cb, ref = LensTRLCallback(**cb_args), RowReference()
    trainer = cls(
        model=policy,
        reward_funcs=digit_reward,
        args=grpo_config(
            os.path.join(out, name),
            loss_type=loss_type,
            max_steps=steps,
            scale_rewards="none",
            reward_weights=[1000.0],
            **config,
        ),
        train_dataset=prompt_dataset(),
        processing_class=tiny_tokenizer(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
        callbacks=[cb] if cls is FailsOnRankOne else [cb, ref],
    )
    ref.trainer = trainer
    trainer.train()
    steps = []
    readings = cb.conservation_history or [(s, None) for s, _ in cb.history]
    for i, ((step, report), (_, reading)) in enumerate(zip(cb.history, readings)):
        entry = {"step": step, "reference": ref.steps[i] if ref.steps else None, "report": report.render()}
        entry["engine"] = getattr(report, "engine", None)
        entry["condition"] = getattr(report, "condition", None)
        if isinstance(report, CreditReport):
            entry.update(
                part_names=list(report.part_names),
                projected_share=list(report.projected_share),
                part_norm=list(report.part_norm),
                share_sum=report.share_sum,
                grad_match=report.grad_match,
                conservation_error=report.conservation_error,
                cancellation=report.cancellation,
                n_trained=report.n_trained,
            )
        entry["conservation"] = (
            None
            if reading is None
            else {
                "render": reading.render(),
                "relative_error": getattr(reading, "relative_error", None),
                "source": getattr(reading, "source", None),
            }
        )
        steps.append(entry)
    logged = [h for h in trainer.state.log_history if "credit/refused" in h]
    return {
        "global_step": int(trainer.state.global_step),
        "world_size": int(trainer.accelerator.num_processes),
        "distributed_type": str(trainer.accelerator.distributed_type),
        "steps": steps,
        "logged_steps": [h["step"] for h in logged],
        "logged_refused": [h["credit/refused"] for h in logged],
    }


def main() -> None:
    policy, out, *names = sys.argv[1:]
    rank = int(os.environ["RANK"])
    result = {name: run(policy, out, name) for name in names}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    leave_rank()  # a gloo group left to the interpreter's exit was seen to abort a rank (tests/_spawn_exit.py)


if __name__ == "__main__":
    main()
