"""What the Hydra entry points share before Hydra starts: the command line checked as a whole, and
the exit status of bad input.

Hydra reports a bad override (an unknown group choice, a value of the wrong type, a key the schema
lacks, a sweep without --multirun) in several lines with exit status 1, its config search path or
a hint about HYDRA_FULL_ERROR last, so a short tail of the output loses what was wrong, and by then
it has made the run dir. The entry points therefore compose the config themselves first, once per
value of every swept override, run their own cheap checks on it, and end bad input with one line
and exit status 2.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

USAGE_ERROR = 2  # exit status of bad input, for every entry point
SWEEP_FLAGS = ("-m", "--multirun")
# an output location the user chose that cannot take the output: bad input too, not a fault of the program
OUTPUT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
LOCK_FILE = ".specdec.lock"  # in a run dir: held by the run writing there


class CommandLineError(Exception):
    """A bad command line, as one line for the user."""


class SpecdecUserError(CommandLineError):
    """Bad input found in a composed config or the files it names: one line, exit status 2."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise SpecdecUserError(message)


@contextmanager
def user_errors() -> Iterator[None]:
    """The core, the registries and the asset loaders raise these for bad input, with messages
    meant for users."""
    try:
        yield
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as error:
        raise SpecdecUserError(str(error)) from error


@contextmanager
def exit_codes(program: str, errors: tuple[type[BaseException], ...] = (SpecdecUserError,),
               interrupted: str = "interrupted") -> Iterator[None]:
    """An entry point's end on bad input (one line on stderr, status 2) and on Ctrl-C (status 130)."""
    try:
        yield
    except errors as error:
        # our messages already quote their causes; a library's may span lines
        print(f"{program}: error: {' '.join(str(error).split())}", file=sys.stderr)
        raise SystemExit(USAGE_ERROR) from None
    except OSError as error:
        if error.errno not in OUTPUT_ERRNOS:
            raise
        where = error.filename or "the output location"
        print(f"{program}: error: cannot write {where}: {error.strerror}; free space there, or choose another location",
              file=sys.stderr)
        raise SystemExit(USAGE_ERROR) from None
    except KeyboardInterrupt:
        print(f"{program}: {interrupted}", file=sys.stderr)
        raise SystemExit(130) from None


class ArgumentParser(argparse.ArgumentParser):
    """argparse, ending bad input as every entry point does: one line naming the problem, first and
    alone (argparse prints its usage block before it), and exit status 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(USAGE_ERROR)


def check_command_line(
    program: str,
    config_dir: Path,
    config_name: str,
    check: Callable[[object], None] | None = None,  # the entry point's checks of a composed config
    argv: Sequence[str] | None = None,
) -> Path | None:
    """Exit with one line and status 2 when the command line cannot make a valid config; else the
    dir Hydra will write into (check_overrides)."""
    try:
        return check_overrides(sys.argv[1:] if argv is None else argv, config_dir, config_name, check)
    except CommandLineError as error:
        print(f"{program}: error: {error}", file=sys.stderr)
        raise SystemExit(USAGE_ERROR) from None


def pin_output_dir(argv: list[str], output_dir: Path) -> None:
    """Set the command line's run dir (sweep dir with -m) to ``output_dir``, in place: a default
    named by the clock (outputs/DATE/TIME) would otherwise be resolved again when Hydra starts,
    perhaps a second later, and name another dir than the one locked."""
    key = "hydra.sweep.dir" if any(arg in SWEEP_FLAGS for arg in argv) else "hydra.run.dir"
    quoted = str(output_dir).replace("\\", "\\\\").replace("'", "\\'")
    argv[:] = [arg for arg in argv if not arg.startswith(f"{key}=")] + [f"{key}='{quoted}'"]


@contextmanager
def hold_lock(lock: Path, what: str, remedy: str) -> Iterator[None]:
    """Hold an exclusive lock on the file ``lock`` (made, with its folder, if absent) while the block
    runs, and remove the file after. When another process holds it, SpecdecUserError names ``what``
    and that process, and nothing is written; a folder that cannot take the file is named the same
    way. The kernel releases the lock when its holder ends, however it ends; a file left by a killed
    holder is simply taken over."""
    while True:
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise SpecdecUserError(f"{what}: cannot write there ({error.strerror}); {remedy}") from None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock_holder(descriptor)
            os.close(descriptor)
            raise SpecdecUserError(f"{what} is in use by {holder}; {remedy}") from None
        try:  # the file may have been removed by its last holder after we opened it: lock the one there now
            current = os.stat(lock).st_ino == os.fstat(descriptor).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(descriptor)
    try:
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"process {os.getpid()}".encode(), 0)
        yield
    finally:
        lock.unlink(missing_ok=True)  # while still held: a process waiting on this file finds it gone and retries
        os.close(descriptor)


def lock_holder(descriptor: int) -> str:
    """The holder a lock file names. A holder writes its pid just after taking the lock, so a file
    still empty is read again for a moment before the holder is called "another process"."""
    for _ in range(50):
        holder = os.pread(descriptor, 64, 0).decode(errors="replace").strip()
        if holder:
            return holder
        time.sleep(0.01)
    return "another process"


def check_writable(path: Path, what: str) -> None:
    """Refuse, before any compute, an output ``path`` whose nearest existing folder cannot take a file
    (read-only file system, no permission)."""
    folder = path if path.is_dir() else path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        raise SpecdecUserError(f"{what} {path}: {folder} is not a writable folder; choose another location")


# launchers whose Hydra plugin is an optional extra: without it Hydra says only that it cannot find
# the plugin's schema, naming neither the option nor the fix
LAUNCHER_EXTRAS = {"slurm": "slurm", "local": "slurm"}


def _check_launcher(override) -> None:
    if override.get_key_element() != "hydra/launcher" or override.is_sweep_override():
        return
    extra = LAUNCHER_EXTRAS.get(str(override.value()))
    if extra and not _importable("hydra_plugins.hydra_submitit_launcher"):
        raise CommandLineError(
            f"{override.input_line} needs the submitit launcher plugin, which is not installed: "
            f"pip install -e '.[{extra}]' (scripts/setup.sh installs it)"
        )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def check_overrides(
    argv: Sequence[str], config_dir: Path, config_name: str, check: Callable[[object], None] | None = None
) -> Path | None:
    """Raise CommandLineError for the first override that cannot compose, or whose config ``check``
    refuses by raising CommandLineError. Hydra's own flags (--help, --cfg, ...) hand the
    command line to Hydra unchecked; hydra.* overrides are Hydra's to check. Returns the dir Hydra
    will write into (hydra.run.dir, or hydra.sweep.dir with -m) as resolved now; None where it
    cannot be told before Hydra starts (Hydra's flags, or a dir naming what only a job knows)."""
    # hydra, omegaconf: ~0.4 s to import; this shared leaf's other helpers need neither
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    if any(arg.startswith("-") and arg not in SWEEP_FLAGS for arg in argv):
        return None
    sweep = any(arg in SWEEP_FLAGS for arg in argv)
    try:
        parsed = OverridesParser.create().parse_overrides([arg for arg in argv if arg not in SWEEP_FLAGS])
    except Exception as error:  # Hydra's grammar errors: OverrideParseException and others
        raise CommandLineError(f"cannot read the command line: {one_line(error)}") from None
    options = []  # per override: the override lines of each of its values
    searchpath = [override for override in parsed if override.get_key_element() == "hydra.searchpath"]
    # config folders a user adds (a drafter of their own: docs/adding-a-drafter.md) hold choices too
    folders = [config_dir] + [
        Path(str(folder).removeprefix("file://")) for override in searchpath for folder in override.value()
    ]
    for override in parsed:
        if override.is_hydra_override():
            _check_launcher(override)
            continue
        if not override.is_sweep_override():
            options.append([override.input_line])
            continue
        if not sweep:
            raise CommandLineError(f"{override.input_line} lists several values; add -m (--multirun) to sweep over them")
        if not override.is_discrete_sweep() or override.value_type.name == "GLOB_CHOICE_SWEEP":
            continue  # intervals (for optimising sweepers) and globs are Hydra's to expand
        options.append([f"{override.get_key_element()}={value}" for value in override.sweep_string_iterator()])
    for lines in options:
        key, _, _ = lines[0].lstrip("+").partition("=")
        groups = [folder / key for folder in folders if (folder / key).is_dir()]
        if groups and not lines[0].startswith("~"):
            known = sorted(path.stem for group in groups for path in group.glob("*.yaml"))
            for line in lines:
                if line.partition("=")[2] not in known:
                    raise CommandLineError(
                        f"unknown {key} {line.partition('=')[2]!r}; choose one of {', '.join(known)}"
                    )
    # one config with every override's first value, then one per further value of each sweep
    base = [override.input_line for override in searchpath] + [lines[0] for lines in options]
    variants = [base] + [
        base[:i] + [line] + base[i + 1 :] for i, lines in enumerate(options, start=len(searchpath)) for line in lines[1:]
    ]
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        for overrides in variants:
            try:
                cfg = compose(config_name=config_name, overrides=overrides)
            except Exception as error:  # Hydra and OmegaConf errors for a key or value the schema refuses
                raise CommandLineError(one_line(error)) from None
            if check is not None:
                check(cfg)  # raises CommandLineError (or a subclass) for bad input
        hydra_lines = [o.input_line for o in parsed if o.is_hydra_override() and not o.is_sweep_override() and o not in searchpath]
        hydra = compose(config_name=config_name, overrides=base + hydra_lines, return_hydra_config=True).hydra
    try:
        output = OmegaConf.select(hydra, "sweep.dir" if sweep else "run.dir", throw_on_missing=True)
    except Exception:  # an interpolation of what Hydra sets per job (hydra.job.num, ...)
        return None
    return Path(output) if output else None


def one_line(error: BaseException) -> str:
    """An exception chain's messages on one line, without the indented detail lines (full_key: ...),
    OmegaConf's message templates and Hydra's hint about HYDRA_FULL_ERROR."""
    parts, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        for line in str(error).splitlines():
            line = line.strip() if not line.startswith((" ", "\t")) else ""
            if line and line != "None" and "$VALUE" not in line and "HYDRA_FULL_ERROR" not in line and line not in parts:
                parts.append(line)
        error = error.__cause__ or error.__context__
    return "; ".join(parts) or "invalid command line"
