# TRL's GRPOTrainer with vLLM in colocate mode, in the style of TRL's vLLM integration docs:
# use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization. The import is grouprl.trl's,
# the model a tiny Qwen2 with heads of 64 ($TINY_MODEL), the data a local JSONL ($SUMS), the
# sizes small, report_to "none". No __main__ guard: vLLM runs in this process.

import os

from datasets import load_dataset

from grouprl.trl import GRPOConfig, GRPOTrainer

dataset = load_dataset("json", data_files=os.environ["SUMS"], split="train")


def reward_len(completions, **kwargs):
    return [-abs(12 - len(c)) / 12 for c in completions]


training_args = GRPOConfig(
    output_dir="trainer_output",
    learning_rate=1e-5,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=12,
    max_steps=2,
    report_to="none",
    use_vllm=True,
    vllm_mode="colocate",
    vllm_gpu_memory_utilization=0.5,
)
trainer = GRPOTrainer(
    model=os.environ["TINY_MODEL"],
    reward_funcs=reward_len,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
