"""What the TRL adapter costs: a GRPOTrainer run with ``LensTRLCallback`` against the same run without it.

``python benchmarks/trl_cost.py --steps 8 --repeats 3``: the tiny Qwen2 of ``lens_callbacks/examples/trl_grpo.py``
(fp32, CPU, 8 rollouts a step, every step audited by rollout, conservation on), at gradient
accumulation 1 (one micro-batch of 8) and 2 (two of 4), full fine-tuning and a LoRA adapter (r = 4 on
q/v). Three runs per setting, interleaved so the shared machine's load falls on all: plain, audited
riding along TRL's backward where the adapter can (``capture="training_step"``, the default), and audited by the
separate pass (``capture="separate"``). Ratios of the medians of ``trainer.train()`` wall time; the
reason a setting did not ride is printed.

``--shape qwen2 --completion 128``: the same runs on a Qwen2-shaped policy (vocabulary 151,936, tied
embedding / LM head, width 896, 2 layers, MLP 4864, 14 heads / 2 KV heads — ``credit_cost.py``'s real
Qwen2 row) with 128-token completions; the tokenizer is still the tiny one (ids past it decode to nothing,
so the reward reads the tiny vocabulary's symbols).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

#: The policies: the example's tiny Qwen2, and credit_cost.py's Qwen2-shaped real row.
SHAPES = {
    "tiny": {},
    "qwen2": dict(vocab=151936, hidden=896, layers=2, intermediate=4864, heads=14, kv_heads=2, tie=True),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--accumulation", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tuning", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    p.add_argument(
        "--shape", choices=sorted(SHAPES), default="tiny", help="the policy (default: the example's tiny Qwen2)"
    )
    p.add_argument("--completion", type=int, default=4, help="max_completion_length (tokens per completion)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    from trl import GRPOTrainer

    from lens_callbacks.examples.trl_grpo import digit_reward, grpo_config, prompt_dataset, save_policy, tiny_tokenizer
    from lens_callbacks.integrations.trl import LensGRPOMixin, LensTRLCallback

    class AuditedGRPO(LensGRPOMixin, GRPOTrainer):
        pass

    policy = save_policy(tempfile.mkdtemp() + "/policy", **SHAPES[args.shape], positions=max(64, args.completion + 32))

    def run(mode: str, accum: int, tuning: str) -> tuple[float, object]:
        peft_config = None
        if tuning == "lora":
            from peft import LoraConfig

            peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        cb = LensTRLCallback(capture="training_step" if mode == "ride" else "separate") if mode != "plain" else None
        trainer = (GRPOTrainer if cb is None else AuditedGRPO)(
            model=policy,
            reward_funcs=digit_reward,
            args=grpo_config(
                tempfile.mkdtemp(),
                max_steps=args.steps,
                scale_rewards="none",
                reward_weights=[1000.0],
                max_completion_length=args.completion,
                gradient_accumulation_steps=accum,
                per_device_train_batch_size=8 // accum,
            ),
            train_dataset=prompt_dataset(),
            processing_class=tiny_tokenizer(),
            peft_config=peft_config,
            callbacks=[] if cb is None else [cb],
        )
        t = time.perf_counter()
        trainer.train()
        return time.perf_counter() - t, cb

    print(f"policy: {args.shape} {SHAPES[args.shape] or ''}, completions of up to {args.completion} tokens")
    print(
        "| tuning | accumulation | audited / plain, riding along where it can | audited / plain, separate pass | rode along? |"
    )
    print("|---|---:|---:|---:|---|")
    for tuning in args.tuning:
        for accum in args.accumulation:
            times: dict[str, list[float]] = {"plain": [], "ride": [], "separate": []}
            reason = None
            for _ in range(args.repeats):
                for mode in times:
                    t, cb = run(mode, accum, tuning)
                    times[mode].append(t)
                    if mode == "ride":
                        reason = cb.ride_reason
            med = {k: statistics.median(v) for k, v in times.items()}
            rode = "yes" if reason is None else f"no: {reason}"
            print(
                f"| {tuning} | {accum} | {med['ride'] / med['plain']:.2f} | {med['separate'] / med['plain']:.2f} | {rode} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
