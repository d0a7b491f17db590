"""Loading the user's own code: a function of an importable module (`package.module:function`)
or a Python file imported as a module (`path/to/file.py`), for rewards, tools and environments.
Loading runs that code, by design: the user names it. A mistake is one UserError line."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from grouprl.errors import UserError


def load_attribute(module: Any, attr: str, where: str) -> Any:
    """`module.attr`, a callable; one UserError line naming what `where` does hold otherwise."""
    fn = getattr(module, attr, None)
    if fn is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise UserError(
            f"{where} has no function {attr!r}; functions found: {', '.join(found) or 'none'}"
        )
    if not callable(fn):
        raise UserError(f"{where}:{attr} is a {type(fn).__name__}, not a function")
    return fn


def import_function(module_name: str, attr: str, spec: str, what: str = "reward") -> Any:
    """`package.module:function` (the `what` named by `spec`), one UserError line if it is not
    there."""
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UserError(
            f"cannot import module {module_name!r} for {what} {spec!r}: {err}"
        ) from None
    return load_attribute(module, attr, module_name)


def import_file(path: Path, what: str = "reward") -> Any:
    """Import a Python file as a module (its directory importable while it runs); `what` the
    file holds (a reward, a tool) names it in errors."""
    name = f"grouprl_{what}s_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise UserError(
            f"importing {what} file {path} raised {type(err).__name__}: {err}; fix the file"
        ) from None
    finally:
        sys.path.pop(0)
    sys.modules[name] = module
    return module
