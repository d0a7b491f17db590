"""What the commands other than `train` do, one module per command, named as `grouprl.cli`
names them: `check` (will this run learn: a few steps sampled, one update measured), `compare`
(algorithms side by side on the same data and seeds), `generate` (a model's completions, rendered
as training renders them) and `sft` (supervised warm starts). They build on the trainer
(`grouprl.train`) and sit below the Python API and the command line."""
