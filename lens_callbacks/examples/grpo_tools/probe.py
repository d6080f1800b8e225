"""The tool-using GRPO example with a probe objective: the likelihood of given episodes' trained turns.

``probe_terms(episodes)`` is the mean negative log-likelihood per trained token of a list of trajectories
(e.g. reference episodes that call the calculator correctly, held out from training), so that
``ProbeCreditCallback`` and ``lens-callbacks audit RUN_DIR --probe FILE.jsonl`` read which rollouts of a
step made those episodes more likely. The probe batch is the trajectories themselves (or the rollout
batch :meth:`make_rollout_batch` builds from them).

YAML class path: ``lens_callbacks.examples.grpo_tools.probe.ToolsProbeModule``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

from lens_callbacks.credit.inputs.terms import CreditTerms
from lens_callbacks.credit.inputs.trajectories import Trajectory

from .module import GRPOToolsModule, ToolRolloutBatch

__all__ = ["ToolsProbeModule"]


class ToolsProbeModule(GRPOToolsModule):
    """:class:`~lens_callbacks.examples.grpo_tools.GRPOToolsModule` with ``probe_terms`` (same arguments)."""

    def make_probe_batch(self, trajectories: Sequence[Trajectory]) -> ToolRolloutBatch:
        """The probe batch of trajectories read from a file (``lens-callbacks audit --probe``)."""
        return self.make_rollout_batch(trajectories)

    def probe_terms(self, batch: Any) -> CreditTerms:
        r"""``terms[k, t] = −log π(y_{k,t} | y_{k,<t}) · trained[k, t] / N_trained`` of the probe episodes."""
        rb = batch if isinstance(batch, ToolRolloutBatch) else self.make_rollout_batch(list(batch))
        b = rb.batch.to(self.device)
        logits = self.policy(
            input_ids=b.input_ids, attention_mask=b.attention_mask, position_ids=b.position_ids
        ).logits  # [B, T, V]
        logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, b.input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
        logp = F.pad(logp, (1, 0))  # [B, T]
        trained = b.trained  # [B, T]
        terms = -logp * trained.to(logp.dtype) / trained.sum().clamp(min=1)  # [B, T]
        return CreditTerms(terms, trained, b.rollout, b.group, rewards=b.rewards, tokens=b.input_ids)
