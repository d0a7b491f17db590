"""Agent programs as people write them: a loop over the `openai` client (the tests' own)."""

import json

LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "The value stored under a key.",
    "parameters": {"type": "object", "properties": {"key": {"type": "integer"}},
                   "required": ["key"]}}}  # fmt: skip
DOUBLE = {"type": "function", "function": {
    "name": "double", "description": "Twice a number.",
    "parameters": {"type": "object", "properties": {"x": {"type": "integer"}},
                   "required": ["x"]}}}  # fmt: skip


async def single_turn(client, row, model):
    """One question, one answer: reward 1 when the answer holds the row's answer."""
    reply = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": row["prompt"]}]
    )
    return float(str(row["answer"]) in (reply.choices[0].message.content or ""))


async def two_tools(client, row, model):
    """A tool loop with two tools, as written for a hosted model: calls run, results go back as
    tool messages, until the model answers without a call (at most 4 turns)."""
    tools = {"lookup": lambda key: key * 7 + 3, "double": lambda x: 2 * x}
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(4):
        reply = await client.chat.completions.create(model=model, messages=messages,
                                                     tools=[LOOKUP, DOUBLE])  # fmt: skip
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if reply.choices[0].finish_reason != "tool_calls":
            break
        for call in message.tool_calls:
            try:
                result = tools[call.function.name](**json.loads(call.function.arguments))
            except Exception as err:  # a call the model got wrong is answered with the error
                result = f"error: {err}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    return float(str(row["answer"]) in (messages[-1].get("content") or ""))


async def rewrites(client, row, model):
    """Sends its first turn again with its history rewritten (a prefix break)."""
    messages = [{"role": "user", "content": row["prompt"]}]
    reply = await client.chat.completions.create(model=model, messages=messages)
    messages += [{"role": "assistant", "content": "something else entirely"},
                 {"role": "user", "content": "and again?"}]  # fmt: skip
    try:
        await client.chat.completions.create(model=model, messages=messages)
    except Exception as err:  # the 409: counted, the trajectory ended
        return 0.5 if "rewrites" in str(err) else 0.0
    return 1.0 if reply else 0.0


async def no_reward(client, row, model):
    """Returns nothing: the run's reward functions score the conversation."""
    await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": row["prompt"]}]
    )


async def raises(client, row, model):
    await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": row["prompt"]}]
    )
    raise RuntimeError("the agent's own bug")


def not_async(client, row):
    return 1.0


async def rewrites_and_goes_on(client, row, model):
    """Sends its history back rewritten (a prefix break), then goes on from the rewritten
    conversation: its trajectory splits, the rest a row of its own."""
    messages = [{"role": "user", "content": row["prompt"]}]
    await client.chat.completions.create(model=model, messages=messages)
    messages += [{"role": "assistant", "content": "something else entirely"},
                 {"role": "user", "content": "and again?"}]  # fmt: skip
    reply = await client.chat.completions.create(model=model, messages=messages)
    messages += [reply.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "once more?"}]  # fmt: skip
    last = await client.chat.completions.create(model=model, messages=messages)
    return 1.0 if last.choices[0].finish_reason in ("stop", "length") else 0.0


async def rewrites_completions(client, row, model):
    """On the completions route: after the first answer, asks again with its prompt edited (a
    prefix break), so the rest of its trajectory is a row of its own."""
    stop = list("abcdefghijklmnopqrstuvwxyz")  # turns end soon, even a random model's
    first = await client.completions.create(model=model, prompt=row["prompt"], stop=stop)
    if first.choices[0].finish_reason != "stop":  # the budget ended it: no turn after it
        return 0.0
    second = await client.completions.create(model=model, prompt=row["prompt"] + " (edited)\n",
                                             stop=stop)  # fmt: skip
    return float(len(second.choices[0].text) % 2)  # a reward that varies


async def rewrites_per_turn(client, row, model):
    """`rewrites_completions`, rewarding each of its two turns: the second is a row of its own."""
    stop = list("abcdefghijklmnopqrstuvwxyz")
    first = await client.completions.create(model=model, prompt=row["prompt"], stop=stop)
    if first.choices[0].finish_reason != "stop":
        return [0.0]
    second = await client.completions.create(model=model, prompt=row["prompt"] + " (edited)\n",
                                             stop=stop)  # fmt: skip
    return [float(len(first.choices[0].text) % 3), float(len(second.choices[0].text) % 2)]
