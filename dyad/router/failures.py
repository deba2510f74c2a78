"""What a failed step is put down to, and what the run is told: pure functions over what the
router has seen (the workers that exited or went silent, the failures workers reported).

A worker that dies takes its peers' transfers with it: they report errors of their own (UCX's
"Request canceled", a closed gloo connection), often before the router has seen the death. The
failure is the dead worker's, and their errors are its consequences. Two failures are not
recovered from, since a restart from the checkpoint would meet them again: running out of GPU
memory, and running out of disk space.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from dyad.wire import pb

OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full filesystem, or the user's quota on it
# How an OSError of either reads in a worker's traceback, with the file it names if it names one.
_OUT_OF_SPACE_TEXT = re.compile(
    "(?:" + "|".join(re.escape(os.strerror(number)) for number in OUT_OF_SPACE) + r")(?:: '([^']+)')?"
)

WorkerKey = tuple[str, int]  # (pool, rank)


@dataclass(frozen=True)
class Blame:
    message: str  # the worker to blame first, then the others' errors as its consequences
    repeats: bool  # a restart from the checkpoint would fail the same way: the run ends


def blame(
    lost: list[tuple[WorkerKey, str]], failures: dict[WorkerKey, pb.WorkerResult], during: str,
    reporter: WorkerKey | None = None,
) -> Blame:
    """What a step failed of. `lost`: workers whose process exited or went silent, with why;
    `failures`: the errors workers reported; `during`: what they were doing ("its step");
    `reporter`: the worker whose report is being handled, if one is.

    A reported failure that would repeat comes first (the run ends). Otherwise the first worker
    lost without a word is to blame; failing that, the reporter (or the first that reported).
    Every other reported error follows, a line each, as a consequence."""
    for key, result in failures.items():
        if result.error_repeats:
            return Blame(_repeating(key, result.error, during), repeats=True)
    quiet = [(key, why) for key, why in lost if key not in failures]
    if quiet:
        culprit, why = quiet[0]
        headline = f"worker {_name(culprit)} {why}"
    else:
        culprit = reporter if reporter in failures else next(iter(failures))
        error = failures[culprit].error
        headline = f"worker {_name(culprit)} failed: {last_line(error)}\n{error}"
    consequences = [
        f"then {_name(key)} failed: {last_line(result.error)}" for key, result in failures.items() if key != culprit
    ]
    return Blame("\n".join([headline, *consequences]), repeats=False)


def _repeating(key: WorkerKey, error: str, during: str) -> str:
    """Why the run ends without recovering, and what to change, from the worker's traceback."""
    space = [match for match in _OUT_OF_SPACE_TEXT.finditer(error)]
    if space:
        # The last one is the outermost exception's: the checkpoint's directory where a save failed.
        paths = [match.group(1) for match in space if match.group(1)]
        where = f" writing {paths[-1]}" if paths else ""
        return (
            f"worker {_name(key)} ran out of disk space in {during}{where}; a restart from the checkpoint "
            f"would too, so the run ends without recovering (free space there, or set out_dir on a "
            f"larger filesystem): {last_line(error)}"
        )
    return (
        f"worker {_name(key)} ran out of GPU memory in {during}; a restart from the "
        f"checkpoint would too, so the run ends without recovering (fewer samples a "
        f"microbatch: raise train.microbatches; or more GPUs, ep or tp for the pool): "
        f"{last_line(error)}"
    )


def could_not_write(error: OSError) -> str:
    """What a run ends with when the router cannot write one of its files (`error.filename`):
    out of space, with the bytes it had to write (where known, `NotWritten.size`) and those free
    there; a restart would fail the same way."""
    if error.errno not in OUT_OF_SPACE:
        return f"could not write {error.filename}: {error.strerror}"
    size = getattr(error, "size", None)
    needed = f"{size} bytes to write, " if size is not None else ""
    free = shutil.disk_usage(Path(error.filename).parent).free
    return (
        f"out of disk space writing {error.filename} ({error.strerror}: {needed}{free} bytes free "
        f"there); a restart would fail the same way, so the run ends without recovering"
    )


def last_line(text: str) -> str:
    """A traceback's last line: the exception and its message."""
    lines = text.strip().splitlines()
    return lines[-1] if lines else text


def _name(key: WorkerKey) -> str:
    return f"{key[0]}/{key[1]}"
