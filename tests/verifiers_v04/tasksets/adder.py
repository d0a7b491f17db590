"""A verifiers 0.4 taskset with a tool: sums, answered with the `add` tool, which its MCP server
(this file, run as a module) serves. Its task data lives here too: the tool server imports it
by name."""

import verifiers.v1 as vf


class AddData(vf.TaskData):
    answer: str = ""


class AddTool(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the tool is `add`, not `add_tool_add`

    @vf.tool
    async def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


class AddTask(vf.Task[AddData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [AddTool(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, trace) -> float:
        # rewards per turn (prime-rl's trace.info["turn_rewards"]): the call's turn earns 0.25;
        # the answer's turn, the rest of the reward
        trace.info["turn_rewards"] = [0.25, None]
        return 1.0 if self.data.answer in (trace.last_reply or "") else 0.0


class Adder(vf.Taskset[AddTask, vf.TasksetConfig]):
    def load(self):
        for i in range(12):
            yield AddTask(
                AddData(prompt=f"What is {i}+{i + 1}? Use the add tool.", answer=str(2 * i + 1)),
                self.config.task,
            )


__all__ = ["Adder"]

if __name__ == "__main__":
    AddTool.run()
