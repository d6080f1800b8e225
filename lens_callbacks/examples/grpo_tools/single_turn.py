"""Rebuild the single-turn example's ``RolloutBatch`` (``lens_callbacks.examples.grpo``) from a run record.

``lens_callbacks.examples.grpo.GRPOModule`` keeps its rollouts as ``last_rollouts``; ``RunRecordCallback`` writes each
as a two-turn trajectory (``user`` prompt, ``assistant`` completion with the sampled ids, ``[EOS]``
included when sampled) and the batch's dropout seed. This function puts them back into the exact
batch the module trained on, so ``lens-callbacks audit`` can replay and re-audit its steps::

    RunRecordCallback(batch_builder="lens_callbacks.examples.grpo_tools.single_turn.grpo_rollout_batch")
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from lens_callbacks.credit.inputs.trajectories import Trajectory

__all__ = ["grpo_rollout_batch"]


def grpo_rollout_batch(module: Any, trajectories: Sequence[Trajectory], meta: Mapping[str, Any]) -> Any:
    """``lens_callbacks.examples.grpo.RolloutBatch`` of recorded two-turn trajectories (rows in record order)."""
    from lens_callbacks.examples.grpo.module import RolloutBatch, grpo_advantages

    if not trajectories:
        raise ValueError("`trajectories` must hold the rollouts of one step, got none.")
    for t in trajectories:
        if [x.role for x in t.turns] != ["user", "assistant"] or any(x.token_ids is None for x in t.turns):
            raise ValueError(
                f"`trajectories` must be user/assistant pairs with token ids (single-turn GRPO), got roles "
                f"{[x.role for x in t.turns]} in rollout {t.rollout}."
            )
    prompts = [list(t.turns[0].token_ids) for t in trajectories]
    comps = [list(t.turns[1].token_ids) for t in trajectories]
    lp = len(prompts[0])
    if any(len(p) != lp for p in prompts):
        raise ValueError("the recorded prompts must all have the same length, as the example samples them.")
    B = len(trajectories)
    G = int(module.hparams.group_size)
    if B % G:
        raise ValueError(f"the step holds {B} rollouts, not a multiple of group_size={G}.")
    L = lp + max(len(c) for c in comps)  # sampling stops once the longest completion has ended
    pad = int(module.pad_id)
    ids = torch.full((B, L), pad, dtype=torch.long)  # [B, L]
    mask = torch.zeros(B, L, dtype=torch.bool)  # [B, L]
    for k, (p, c) in enumerate(zip(prompts, comps)):
        ids[k, : lp + len(c)] = torch.tensor(p + c, dtype=torch.long)
        mask[k, lp : lp + len(c)] = True
    lengths = torch.tensor([lp + len(c) for c in comps])  # [B]
    rewards = torch.tensor([float(t.reward) for t in trajectories], dtype=torch.float64)  # [B]
    adv = grpo_advantages(rewards, G)  # [B], as the module computed them when it sampled
    wdtype = module.policy.dtype
    device = module.device
    return RolloutBatch(
        input_ids=ids.to(device),
        attention_mask=(torch.arange(L)[None, :] < lengths[:, None]).long().to(device),
        completion_mask=mask.to(device),
        advantages=adv.to(device=device, dtype=wdtype),
        rewards=rewards.to(device=device, dtype=wdtype),
        group=torch.tensor([t.group for t in trajectories], dtype=torch.long).to(device),
        rollout=torch.tensor([t.rollout for t in trajectories], dtype=torch.long).to(device),
        prompt_len=lp,
        dropout_seed=int(meta.get("dropout_seed", 0)),
    )
