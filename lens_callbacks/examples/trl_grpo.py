"""A complete, offline TRL GRPO run with the credit audit attached.

Everything is built in code: a tiny Qwen2 policy, a word-level tokenizer over a few dozen symbols, an
in-memory prompt set and a reward function. Nothing is downloaded. Run it with::

    python -m lens_callbacks.examples.trl_grpo --steps 4 --loss-type dapo --lora --output-dir /tmp/trl_grpo --tensorboard

and read the readings it prints (they are also in ``trainer.state.log_history`` and, with
``--tensorboard``, in TensorBoard under ``train/credit/...`` and ``train/conservation/...``).

Needs the ``trl`` extra: ``pip install -e '.[trl]'`` in a checkout.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional, Sequence

import torch

__all__ = [
    "SYMBOLS",
    "tiny_tokenizer",
    "tiny_qwen2",
    "save_policy",
    "prompt_dataset",
    "digit_reward",
    "grpo_config",
    "main",
]

#: The whole vocabulary besides the two special tokens: letters, digits and a few operators.
SYMBOLS = tuple("abcdefghijklmnopqrstuvwxyz0123456789+=?")


def tiny_tokenizer():
    """A ``PreTrainedTokenizerFast`` over :data:`SYMBOLS`, one token per whitespace-separated symbol.

    Prompts are left-padded (TRL generates after the prompt, so its end must be the row's end).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for s in SYMBOLS:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def tiny_qwen2(
    tokenizer: Any,
    *,
    seed: int = 0,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 4,
    kv_heads: Optional[int] = None,
    intermediate: Optional[int] = None,
    vocab: Optional[int] = None,
    tie: bool = False,
    positions: int = 64,
) -> torch.nn.Module:
    """A ``Qwen2ForCausalLM`` whose initial weights depend on ``seed`` only (the global RNG is left as it was).

    Eager attention: the same arithmetic in float32 and float64 and under ``functional_call``. ``vocab``
    wider than the tokenizer gives a real policy's LM head (ids past the tokenizer decode to nothing).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer) if vocab is None else vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden if intermediate is None else intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2 if kv_heads is None else kv_heads,
        max_position_embeddings=positions,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=tie,
        attn_implementation="eager",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def save_policy(directory: str, *, seed: int = 0, **shape: Any) -> str:
    """Write a tiny Qwen2 and its tokenizer to ``directory``; returns it, for ``GRPOTrainer(model=directory)``.

    With ``beta > 0`` and no PEFT adapter, TRL builds the frozen reference model from the policy's
    ``name_or_path``, so the policy must exist as a local checkpoint (never a hub id).
    """
    tok = tiny_tokenizer()
    tiny_qwen2(tok, seed=seed, **shape).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def prompt_dataset(n: int = 16, seed: int = 0):
    """``n`` prompts such as ``"3 + 4 ="`` as a ``datasets.Dataset`` with one ``prompt`` column."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    xs = torch.randint(0, 10, (n, 2), generator=g).tolist()
    return Dataset.from_dict({"prompt": [f"{a} + {b} =" for a, b in xs]})


def digit_reward(completions: Sequence[str], **_: Any) -> list[float]:
    """The fraction of completion symbols that are digits (an untrained policy draws some, so groups differ)."""
    out = []
    for c in completions:
        toks = c.split()
        out.append(sum(t.isdigit() for t in toks) / max(len(toks), 1))
    return out


def grpo_config(output_dir: str, **overrides: Any):
    """A ``GRPOConfig`` for a short CPU run: SGD (so step conservation applies), fp32, short completions."""
    from trl import GRPOConfig

    kw: dict[str, Any] = dict(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=4,
        num_iterations=2,
        beta=0.1,
        entropy_coef=0.01,
        max_grad_norm=0.5,
        optim="sgd",
        learning_rate=0.5,
        lr_scheduler_type="constant",
        max_steps=4,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        data_seed=0,
        temperature=1.0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    kw.update(overrides)
    return GRPOConfig(**kw)


def main(argv: Optional[Sequence[str]] = None) -> Any:
    """Train a few GRPO steps with the audit attached; print the last readings. Returns the trainer."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--loss-type", default="grpo")
    p.add_argument("--lora", action="store_true", help="train a LoRA adapter (needs peft)")
    p.add_argument("--output-dir", default=None, help="where TRL may write (default: a temporary directory)")
    p.add_argument("--tensorboard", action="store_true", help="log to TensorBoard (under OUTPUT_DIR/runs/)")
    args = p.parse_args(argv)

    import tempfile

    from trl import GRPOTrainer

    from lens_callbacks.integrations.trl import LensGRPOMixin, LensTRLCallback

    class AuditedGRPO(LensGRPOMixin, GRPOTrainer):
        pass

    out = args.output_dir or tempfile.mkdtemp(prefix="trl_grpo_")
    extra: dict[str, Any] = {"max_steps": args.steps, "loss_type": args.loss_type}
    if args.loss_type == "luspo":
        extra["importance_sampling_level"] = "sequence"
    if args.tensorboard:
        extra["report_to"] = ["tensorboard"]
    tok = tiny_tokenizer()
    policy = save_policy(f"{out}/policy")
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    audit = LensTRLCallback()
    trainer = AuditedGRPO(
        model=policy,
        reward_funcs=digit_reward,
        args=grpo_config(out, **extra),
        train_dataset=prompt_dataset(),
        processing_class=tok,
        peft_config=peft_config,
        callbacks=[audit],
    )
    trainer.train()
    for reading in (audit.last_report, audit.last_conservation):
        if reading is not None:
            print(reading.render())
    return trainer


if __name__ == "__main__":
    main()
