"""What the TRL adapter costs: a GRPOTrainer run with ``LensTRLCallback`` against the same run without it.

``python benchmarks/trl_cost.py --steps 8 --repeats 3``: the tiny Qwen2 of ``lens_callbacks/examples/trl_grpo.py``
(fp32, CPU, accumulation 2, 8 rollouts a step, every step audited by rollout). Runs alternate plain /
audited so the shared machine's load falls on both; the ratio of the medians of ``trainer.train()``
wall time is printed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lora", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)

    from trl import GRPOTrainer

    from lens_callbacks.examples.trl_grpo import digit_reward, grpo_config, prompt_dataset, save_policy, tiny_tokenizer
    from lens_callbacks.integrations.trl import LensGRPOMixin, LensTRLCallback

    class AuditedGRPO(LensGRPOMixin, GRPOTrainer):
        pass

    policy = save_policy(tempfile.mkdtemp() + "/policy")

    def run(audit: bool) -> float:
        peft_config = None
        if args.lora:
            from peft import LoraConfig

            peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        trainer = (AuditedGRPO if audit else GRPOTrainer)(
            model=policy,
            reward_funcs=digit_reward,
            args=grpo_config(tempfile.mkdtemp(), max_steps=args.steps, scale_rewards="none", reward_weights=[1000.0]),
            train_dataset=prompt_dataset(),
            processing_class=tiny_tokenizer(),
            peft_config=peft_config,
            callbacks=[LensTRLCallback()] if audit else [],
        )
        t = time.perf_counter()
        trainer.train()
        return time.perf_counter() - t

    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for audit in (False, True):
            times[audit].append(run(audit))
    plain, audited = statistics.median(times[False]), statistics.median(times[True])
    print(f"train() over {args.steps} steps: plain {plain:.3f} s, audited {audited:.3f} s (medians of {args.repeats})")
    print(f"ratio audited / plain: {audited / plain:.2f}")


if __name__ == "__main__":
    main()
