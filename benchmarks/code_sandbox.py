"""Code verification throughput: programs checked in grouprl's sandbox against the floor, a bare
`python -I -c` subprocess per completion with no isolation at all (program and asserts in one
interpreter, as a naive harness would run them).

Both sides check the same completions (distinct programs, MBPP-style asserts) with the same
number of processes at once (one per core); rounds alternate the sides; throughput is each
side's median over rounds, latency percentiles pool every completion's time.

    python benchmarks/code_sandbox.py [--completions 40] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from grouprl import sandbox
from grouprl.sandbox.pool import workers
from grouprl.sandbox.run import check

PROGRAM = """def add(a, b):
    # completion {i}
    total = 0
    for x in range(200):
        total += x % 7
    return a + b
"""


def jobs(n: int, tests: int) -> list[tuple[str, list[str]]]:
    asserts = [f"assert add({t}, {t + 1}) == {2 * t + 1}" for t in range(tests)]
    return [(PROGRAM.format(i=i), asserts) for i in range(n)]


def sandboxed(program: str, asserts: list[str]) -> bool:
    verdict = check(program, sandbox.Tests.asserts(asserts))  # uncached
    if verdict.fraction != 1.0:
        print(f"a check failed: {verdict}", file=sys.stderr)
    return verdict.fraction == 1.0


def floor(flags: list[str]):
    def run(program: str, asserts: list[str]) -> bool:
        source = program + "\n" + "\n".join(asserts)
        done = subprocess.run([sys.executable, *flags, "-c", source], capture_output=True)
        if done.returncode != 0:
            print(f"the floor failed: {done.stderr[-300:]!r}", file=sys.stderr)
        return done.returncode == 0

    return run


def timed_batch(fn, batch, parallel: int) -> tuple[float, list[float]]:
    def one(job):
        start = time.perf_counter()
        assert fn(*job)
        return time.perf_counter() - start

    start = time.perf_counter()
    with ThreadPoolExecutor(parallel) as pool:
        latencies = list(pool.map(one, batch))
    return time.perf_counter() - start, latencies


def measure(n: int, rounds: int, parallel: int) -> list[dict]:
    sides = {"grouprl sandbox": sandboxed, "python -I -c": floor(["-I"]),
             "python -I -S -c": floor(["-I", "-S"])}  # fmt: skip
    rows = []
    for tests in (1, 3, 10):
        batch = jobs(n, tests)
        walls: dict[str, list[float]] = {s: [] for s in sides}
        lats: dict[str, list[float]] = {s: [] for s in sides}
        timed_batch(sandboxed, batch[:4], parallel)  # warm: the runtime, the page cache
        for r in range(rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for side in order:
                wall, latencies = timed_batch(sides[side], batch, parallel)
                walls[side].append(wall)
                lats[side].extend(latencies)
        for side in sides:
            lat = sorted(lats[side])
            rows.append({
                "tests": tests, "side": side,
                "completions_per_s": n / statistics.median(walls[side]),
                "p50_ms": 1e3 * lat[len(lat) // 2], "p95_ms": 1e3 * lat[int(0.95 * len(lat))],
            })  # fmt: skip
        base = next(r for r in rows if r["tests"] == tests and r["side"] == "python -I -c")
        for row in rows[-len(sides) :]:
            row["time_vs_floor"] = base["completions_per_s"] / row["completions_per_s"]
        print(f"{tests} tests done", file=sys.stderr)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--completions", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    if (reason := sandbox.available()) is not None:
        sys.exit(f"the sandbox cannot run here: {reason}")
    rows = measure(args.completions, args.rounds, workers())
    print(f"{args.completions} completions, {workers()} at once, median of {args.rounds} rounds\n")
    print("| tests per completion | checked by | completions/s | p50 ms | p95 ms | time vs floor |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tests']} | {r['side']} | {r['completions_per_s']:.1f} | {r['p50_ms']:.0f} | "
              f"{r['p95_ms']:.0f} | {r['time_vs_floor']:.2f}x |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
