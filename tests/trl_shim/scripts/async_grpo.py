# TRL's examples/scripts/async_grpo.py (huggingface/trl) as its authors wrote it, with the import
# changed to grouprl.trl, the hub model replaced by the tiny Qwen2.5-template chat model
# ($TINY_MODEL) and GSM8K by a local file in its columns ($GSM8K), max_completion_length and
# max_steps made small, and report_to "none". No vLLM server to start: grouprl samples on its
# own sampler thread.

import os

from datasets import load_dataset
from trl.rewards import accuracy_reward

from grouprl.trl import AsyncGRPOConfig, AsyncGRPOTrainer


def format_sample(sample):
    return {
        "prompt": [{"role": "user", "content": sample["question"]}],
        "solution": sample["answer"].split("####")[-1].strip(),
    }


def main() -> None:
    dataset = load_dataset("json", data_files=os.environ["GSM8K"], split="train")
    dataset = dataset.map(format_sample, remove_columns=dataset.column_names)

    config = AsyncGRPOConfig(
        output_dir="async_grpo_gsm8k",
        save_strategy="no",
        per_device_train_batch_size=16,
        gradient_accumulation_steps=2,
        max_completion_length=16,
        chat_template_kwargs={"enable_thinking": False},
        max_steps=6,
        learning_rate=1e-5,
        report_to="none",
        log_completions=True,
    )
    trainer = AsyncGRPOTrainer(
        model=os.environ["TINY_MODEL"],
        args=config,
        train_dataset=dataset,
        reward_funcs=accuracy_reward,
    )
    trainer.train()


if __name__ == "__main__":
    main()
