"""A single-turn verifiers 0.4 taskset, as the Environments Hub's are written: sums, rewarded
when the reply holds the answer, and a little for a short reply (so a random model's rewards
vary)."""

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str = ""


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, trace) -> float:
        return 1.0 if self.data.answer in (trace.last_reply or "") else 0.0

    @vf.reward(weight=0.5)
    async def short(self, trace) -> float:
        return 1.0 if len(trace.last_reply or "") < 12 else 0.0


class Sums(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for i in range(12):
            yield SumTask(
                SumData(prompt=f"What is {i} plus {i}?", answer=str(2 * i)), self.config.task
            )


__all__ = ["Sums"]
