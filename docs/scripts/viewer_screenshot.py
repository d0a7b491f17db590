"""The docs' picture of `grouprl view` (docs/images/viewer.png): GRPO and GSPO side by side.

Trains both for 60 steps (`grouprl compare`, one seed, about 3 minutes on 2 cores) unless the
runs are there, serves them with `grouprl view`'s server and has headless Chromium (Debian's
chromium and chromium-driver, as the tests use) take the page at a logged step with a group
whose GSPO completions the clip acted on and whose GRPO tokens the step moved most.

    .venv/bin/python docs/scripts/viewer_screenshot.py [--out docs/images/viewer.png]
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
from pathlib import Path

from grouprl.report.sinks import group_file, group_steps
from grouprl.report.viewer import ViewerServer, run_dirs


def _record(run: Path, step: int) -> dict:
    return json.loads(gzip.decompress(group_file(run, step).read_bytes()))


def moved(group: dict) -> float:
    """How far the step moved the group's trained tokens: Σ |log π after − log π sampled|."""
    return sum(abs(a - b) for c in group["completions"]
               for a, b, m in zip(c["after_logp"], c["sampler_logp"], c["trained_mask"]) if m)  # fmt: skip


def pick(grpo: Path, gspo: Path) -> tuple[int, int]:
    """The logged step and group (the same prompts in both runs: they share the seed) where
    GSPO's clip acted and GRPO's step moved the tokens most."""
    best = None
    for step in group_steps(gspo):
        for k, (a, b) in enumerate(zip(_record(grpo, step)["groups"],
                                       _record(gspo, step)["groups"], strict=True)):  # fmt: skip
            clipped = any(x for c in b["completions"] for x in c.get("bound", []))
            if clipped and (best is None or moved(a) > best[0]):
                best = (moved(a), step, k)
    assert best is not None, "no step where GSPO's clip acted"
    return best[1], best[2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=Path, default=Path("runs/viewer-shot"))
    parser.add_argument("--out", type=Path, default=Path("docs/images/viewer.png"))
    args = parser.parse_args()
    if not (args.runs / "gspo-s0" / "final").exists():
        subprocess.run([sys.executable, "-m", "grouprl", "compare", "--algos", "grpo,gspo",
                        "--seeds", "1", "--steps", "60", "--eval-every", "20",
                        "--log-groups-every", "10", "--output-dir", str(args.runs)],
                       check=True)  # fmt: skip
    runs = run_dirs([args.runs])
    grpo, gspo = (next(r for r in runs if r.name.startswith(a)) for a in ("grpo", "gspo"))
    step, group = pick(grpo, gspo)

    from browser import chromium  # docs/scripts/browser.py, beside this file
    from selenium.webdriver.support.ui import WebDriverWait

    driver = chromium(1500, 1400)
    server = ViewerServer(runs).start()
    try:
        driver.get(f"{server.url}#step={step}&group={group}&channel=change&runs=0,1")
        WebDriverWait(driver, 20).until(
            lambda d: d.execute_script("return document.body.dataset.ready") == "1"
        )
        driver.save_screenshot(str(args.out))
    finally:
        driver.quit()
        server.close()
    print(f"{args.out}: step {step}, group {group}")


if __name__ == "__main__":
    main()
