"""The submission plan: everything a backend will do for one job, as one typed value (pure).

Each backend builds it (``Backend.plan``: writes nothing, runs nothing) and runs that same value
(``Backend.schedule``), so ``submit --dry-run`` (which prints :meth:`SubmissionPlan.text`) shows
byte for byte what the scheduled job gets (torchx's ``submit_dryrun`` -> ``schedule``). The submit
side (:mod:`cyclone_kit.submit.submission`) writes the plan's files into the run directory, the one
writer of them, between the two.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cyclone_kit.config.validate import ResolvedJob


def _frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    """A read-only copy of ``mapping``."""
    return MappingProxyType(dict(mapping))


@dataclass(frozen=True)
class SubmissionPlan:
    """What one backend does for one job in one run directory.

    Attributes:
        backend: the registered name of the backend that built it (and will run it).
        run_dir: the run directory (absolute; it need not exist while the plan is only shown).
        job: the resolved job the plan was built from (the backend's record lines name it).
        files: the run directory's files, relative name -> content, in the order they are
            written: ``spec.json``, a user script's copy, and (slurm) the batch script.
        script: what a dry run prints: the batch script sbatch gets (slurm), the batch script
            submitit writes from :attr:`parameters` (submitit), the ranks' plan (local launcher).
        commands: the exact command lines: the ``sbatch`` argv (slurm), the command submitit's
            script runs on every task (submitit), the command every rank runs (local).
        cwd: the working directory the commands start in (``SLURM_SUBMIT_DIR``; a rank's folder).
        parameters: the backend's own settings the commands need (submitit's executor and its
            ``update_parameters`` keywords; the local launcher's threads per rank).
        environment: variables the backend sets for every process on top of the inherited ones
            (values drawn only when the job starts, such as a free port, are placeholders).
        after: job ids this job waits for (``afterany``).
        text_at: where :meth:`text` ends up, relative to the run directory, and who writes it there
            (``job.sbatch``; ``submitit/<job id>_submission.sh (written by submitit)``; the launch record).
        summary: how the job runs, in a few words (a study's progress line for a point run here:
            ``2 rank(s), 4 thread(s) each``).
    """

    backend: str
    run_dir: Path
    job: ResolvedJob
    files: Mapping[str, str | bytes]
    script: str
    commands: tuple[tuple[str, ...], ...]
    cwd: Path | None = None
    parameters: Mapping[str, Any] = field(default_factory=dict)
    environment: Mapping[str, str] = field(default_factory=dict)
    after: tuple[str, ...] = ()
    text_at: str = ""
    summary: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "run_dir", Path(self.run_dir))
        object.__setattr__(self, "files", _frozen(self.files))
        object.__setattr__(self, "parameters", _frozen(self.parameters))
        object.__setattr__(self, "environment", _frozen(self.environment))
        object.__setattr__(self, "commands", tuple(tuple(str(w) for w in c) for c in self.commands))
        object.__setattr__(self, "after", tuple(str(a) for a in self.after))

    def text(self) -> str:
        """What ``submit --dry-run`` prints: :attr:`script`."""
        return self.script


def run_dir_files(job: ResolvedJob, *, spec_text: str | None = None) -> dict[str, str | bytes]:
    """The files every backend's run directory gets: ``spec.json`` (the resolved spec, or
    ``spec_text``) and a user script's copy with its snapshot (reads the script; writes nothing)."""
    from cyclone_kit.config.script import script_files
    from cyclone_kit.config.validate import spec_json
    from cyclone_kit.rundir.layout import SPEC_FILE

    return {SPEC_FILE: spec_json(job) if spec_text is None else spec_text, **script_files(job.spec)}
