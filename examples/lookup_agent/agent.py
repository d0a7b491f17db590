"""The built-in lookup task written as an agent program: a loop over the `openai` client.

    grouprl train --task lookup --agent examples/lookup_agent/agent.py:agent

The prompt (`#482+37=`) goes to the completions route with `</lookup>` as a stop string. A
turn that ends in a call (`<lookup>482`) is answered by the program: it appends the closing tag
and the value, and asks again; a turn that ends otherwise is the answer. The program returns
None, so the task's own `correct` reward scores the completion, as in the native tool loop
(`grouprl train --task lookup`).
"""

import re

from grouprl.tasks.builtin.lookup import lookup

CALL = re.compile(r"<lookup>(\d+)$")


async def agent(client, row, model):
    prompt = row["prompt"]
    for _ in range(4):
        out = await client.completions.create(model=model, prompt=prompt, stop=["</lookup>"])
        choice = out.choices[0]
        prompt += choice.text
        call = CALL.search(choice.text)
        if choice.finish_reason != "stop" or call is None:
            return None  # the answer (or the budget ran out): the task's reward scores it
        try:
            value = str(lookup(int(call.group(1))))
        except KeyError as err:
            value = f"error: {err}"
        prompt += "</lookup>" + value
    return None
