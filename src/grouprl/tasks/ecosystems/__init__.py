"""Other ecosystems' environments as grouprl tasks: reasoning-gym's generators
(`reasoning_gym`) and verifiers environments (`verifiers`). (OpenEnv's servers train through
`--environment`, `grouprl.tasks.tools.environments`.)"""
