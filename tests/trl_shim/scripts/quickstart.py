# A quickstart in the style of TRL's GRPOTrainer documentation: reward_funcs a list of
# functions, a conversational Dataset, peft_config=LoraConfig(...). The import is grouprl.trl's,
# the model the tiny Qwen2.5-template chat model ($TINY_MODEL), the sizes small, report_to "none".

import os

from datasets import Dataset
from peft import LoraConfig

from grouprl.trl import GRPOConfig, GRPOTrainer

dataset = Dataset.from_list(
    [
        {"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}], "solution": str(a + b)}
        for a in range(10)
        for b in range(10)
    ]
)


def reward_len(completions, **kwargs):
    return [-abs(20 - len(c[0]["content"])) / 20 for c in completions]


def reward_correct(completions, solution, **kwargs):
    return [float(c[0]["content"].strip().endswith(s)) for c, s in zip(completions, solution)]


training_args = GRPOConfig(
    output_dir="quickstart-grpo",
    learning_rate=1e-5,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=16,
    max_steps=3,
    logging_steps=1,
    report_to="none",
)
trainer = GRPOTrainer(
    model=os.environ["TINY_MODEL"],
    reward_funcs=[reward_len, reward_correct],
    args=training_args,
    train_dataset=dataset,
    peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"),
)
trainer.train()
trainer.save_model(training_args.output_dir)
