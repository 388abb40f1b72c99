"""colloc-simjob's checkpoints: how much of its work is done, saved so a rerun resumes.

Why: a requeued job starts its batch script again; a real training job that saved a
checkpoint resumes from it and redoes only the work since. The simulated job does the
same with one small file, so the devcluster can show (and the tests measure) that a
job requeued after an OOM does less work in its second attempt than in its first.

The file (``colloc-simjob.ckpt`` in the job's checkpoint directory, by default
``COLLOC_CHECKPOINT_DIR``) holds the work done and the job's total work, in seconds of
work on an idle GPU; it is replaced atomically (written beside, then renamed), so an
attempt killed while saving leaves the previous checkpoint whole. A checkpoint of a job
with another total (another ``--seconds``) is not this job's and is ignored.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

FILE = "colloc-simjob.ckpt"
ENV_DIR = "COLLOC_CHECKPOINT_DIR"


@dataclass(frozen=True)
class Resume:
    """What a start found: the work already done (0: from zero) and why."""

    done_s: float
    note: str


def path_in(directory: Path) -> Path:
    """The checkpoint file in ``directory``."""
    return directory / FILE


def load(directory: Path, work_s: float) -> Resume:
    """The work already done by this job according to its checkpoint, with one line
    saying where it came from (or why the job starts from zero)."""
    p = path_in(directory)
    try:
        data = json.loads(p.read_text()[:4096])
        total, done = float(data["work_s"]), float(data["done_s"])
    except FileNotFoundError:
        return Resume(0.0, f"no checkpoint in {directory}: starting from zero")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return Resume(0.0, f"checkpoint {p} unreadable ({e}): starting from zero")
    if total != work_s or not 0.0 <= done <= work_s:
        return Resume(0.0, f"checkpoint {p} is for another job ({done:g} of {total:g} s): "
                           "starting from zero")
    return Resume(done, f"resumed from checkpoint {p}: {done:.1f} of {work_s:g} s of work "
                        f"already done ({done / work_s:.0%}), {work_s - done:.1f} s to do")


def save(directory: Path, work_s: float, done_s: float) -> None:
    """Replace the checkpoint with ``done_s`` of ``work_s`` (atomically)."""
    p = path_in(directory)
    tmp = p.with_name(f".{FILE}.{os.getpid()}")
    tmp.write_text(json.dumps({"work_s": work_s, "done_s": round(done_s, 3),
                               "saved": time.time()}))
    os.replace(tmp, p)
