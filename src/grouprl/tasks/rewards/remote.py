"""A reward model behind an HTTP server as a reward: `--rewards http://HOST:PORT/get_reward W`
(OpenRLHF's remote reward shape, which `grouprl serve` answers for a sequence-classification
model: `grouprl.endpoint.rewards`).

Each call posts `{"query": [...], "prompts": [...], "labels": [...]}` in batches of 64: a query
is the prompt and the completion joined as text (OpenRLHF's), or, for conversational rows, the
prompt's messages and the completion's (which grouprl's server renders with the reward model's
template; an OpenRLHF server expects strings); labels are the rows' `answer`, or None. A batch
the server does not answer within the timeout after two retries scores None (counted in
`NAME_unscored`, never 0); an answer with another number of rewards is one line.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from grouprl.errors import UserError, one_line

BATCH = 64
RETRIES = 2
TIMEOUT = 60.0


def is_remote_spec(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


class RemoteReward:
    """Callable with TRL's reward signature (see the module docstring)."""

    def __init__(self, url: str, name: str = "reward_model") -> None:
        self.url, self.__name__ = url, name

    def check(self) -> None:
        """The server answers an empty query (one line where it does not)."""
        try:
            rewards = self._post({"query": [], "prompts": [], "labels": []}, retries=0)
        except Exception as err:  # any failure is the same line
            route = "" if self.url.rstrip("/").endswith("/get_reward") else (
                "; the url names the route too, e.g. http://127.0.0.1:5000/get_reward")  # fmt: skip
            raise UserError(f"reward server {self.url} does not answer ({one_line(err)}); "
                            f"start it (grouprl serve REWARD_MODEL) or fix the url{route}") from None  # fmt: skip
        if rewards != []:
            raise UserError(f"reward server {self.url} answered {rewards!r} for no queries; it "
                            'must answer {"rewards": [...]}, one per query')  # fmt: skip

    def __call__(self, completions: Sequence[Any], prompts: Sequence[Any], answer: Any = None,
                 log_metric: Any = None, **kwargs: Any) -> list[float | None]:  # fmt: skip
        n = len(completions)
        labels = list(answer) if answer is not None else [None] * n
        out: list[float | None] = []
        for i in range(0, n, BATCH):
            part = slice(i, min(i + BATCH, n))
            queries = [_query(p, c) for p, c in zip(prompts[part], completions[part])]
            body = {"query": queries, "prompts": [_plain(p) for p in prompts[part]],
                    "labels": labels[part]}  # fmt: skip
            try:
                rewards = self._post(body, retries=RETRIES)
            except Exception:  # no answer: these completions are unscored
                out += [None] * len(queries)
                continue
            if not isinstance(rewards, list) or len(rewards) != len(queries):
                raise UserError(f"reward server {self.url} answered {len(rewards)} rewards for "
                                f"{len(queries)} queries; it must give one per query")  # fmt: skip
            out += [float(r) for r in rewards]
        if log_metric is not None:
            log_metric(f"{self.__name__}_unscored", sum(r is None for r in out) / max(n, 1))
        return out

    def _post(self, body: dict, *, retries: int) -> Any:
        import httpx

        wait = 0.5
        for attempt in range(retries + 1):
            try:
                response = httpx.post(self.url, json=body, timeout=TIMEOUT)
                if response.status_code == 429 or response.status_code >= 500:
                    raise httpx.HTTPStatusError("busy", request=response.request,
                                                response=response)  # fmt: skip
                response.raise_for_status()
                return response.json()["rewards"]
            except (httpx.TransportError, httpx.HTTPStatusError):
                if attempt == retries:
                    raise
                time.sleep(wait)
                wait *= 2
        raise AssertionError("unreachable")


def _plain(value: Any) -> str:
    if isinstance(value, str):
        return value
    return "\n".join(str(m.get("content", "")) for m in value)


def _query(prompt: Any, completion: Any) -> Any:
    if isinstance(prompt, str) and isinstance(completion, str):
        return prompt + completion
    messages = [prompt] if isinstance(prompt, str) else list(prompt)
    reply = completion if isinstance(completion, list) else [
        {"role": "assistant", "content": str(completion)}]  # fmt: skip
    if messages and isinstance(messages[0], str):
        messages = [{"role": "user", "content": messages[0]}]
    return [*messages, *reply]
