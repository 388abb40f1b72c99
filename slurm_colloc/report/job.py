"""One job's report: the facts (:mod:`.model`), what ended each attempt
(:mod:`.story`), and their notes and advice (:mod:`.recommend`). Kept apart so that
the model does not depend on the words and advice that read it."""

from __future__ import annotations

from slurm_colloc.config import CollocConfig
from slurm_colloc.report import next_estimate, story
from slurm_colloc.report.inquirer import Inquirer
from slurm_colloc.report.model import JobReport, assemble
from slurm_colloc.report.recommend import notes_and_advice


def build(job_id: str, inquirer: Inquirer, cfg: CollocConfig) -> JobReport:
    """The report of ``job_id``; raises ``UnknownJobError`` for an unknown job."""
    rep = assemble(job_id, inquirer, cfg)
    for a in rep.attempts:
        a.story = story.of(a)
    story.across(rep.attempts)
    rep.notes, rep.recommendations = notes_and_advice(rep)
    rep.next_estimate = next_estimate.of(job_id, rep.user, inquirer, cfg)
    return rep
