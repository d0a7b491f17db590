"""The OpenAI-compatible endpoint: the policy served to programs that speak OpenAI's HTTP API.

- `wire`: requests read and answers written in OpenAI's shapes (chat completions, completions,
  models) and in the token-in/token-out shape of `/inference/v1/generate` (renderers' client).
- `server`: the HTTP server (aiohttp, on 127.0.0.1) over a backend that answers requests.
- `agents`: agent programs as rollouts (`--agent file.py:function`): each episode's requests
  answered by the run's sampler, turn by turn, token-exactly.

The engines do not know about this room: it drives the sampler through the same turn handler
interface as tools and environments (`grouprl.rollout.turns`).
"""
