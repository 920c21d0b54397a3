"""The request: command-line arguments -> a checked :class:`~cyclone_kit.config.validate.ResolvedJob`.

:func:`job_from_args` is the one way down through ``config/`` for ``submit``: it calls each module
once, in turn, and none of them calls back up into another::

    jobspec.spec_from_args      the spec file (or SCRIPT.py / -m), --set, the flags -> JobSpec
    profile.load_profile        the cluster profile the spec names
    validate.resolve            every resource decided on the profile (the profile's [container] merged in);
      validate.check_backend,   what the chosen backend cannot run is refused
      check_restart_backend
    script.checked_job          train.data_dir exists here, the script exists, compiles and is hashed,
                                its args' placeholders are filled from the job's layout
    container.check_container   the image, runtime and binds on this login node (after the script:
                                the working folder it resolved is bound in)

Every refusal is one :class:`~cyclone_kit.core.errors.ValidationError` line with a HINT, raised
before anything is written.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cyclone_kit.config.container import check_container
from cyclone_kit.config.jobspec import spec_from_args
from cyclone_kit.config.profile import load_profile
from cyclone_kit.config.script import checked_job
from cyclone_kit.config.validate import ResolvedJob, check_backend, check_restart_backend, resolve


def job_from_args(args: argparse.Namespace, backend: str | None = None) -> ResolvedJob:
    """Build and check the job the flags describe; with ``backend``, one that backend can run.

    Args:
        args: ``submit``'s namespace (:func:`~cyclone_kit.config.jobspec.add_job_arguments`, ``--runs-dir``).
        backend: the backend's registered name (already checked), or None to skip its refusals.

    Raises:
        ValidationError: the first problem found, in the order of the module docstring.
    """
    spec = spec_from_args(args)
    profile = load_profile(spec.resources.profile)
    job = resolve(spec, profile)
    if backend is not None:
        check_backend(job.spec, backend)
        check_restart_backend(job, backend)
    job = checked_job(job, data_check=not getattr(args, "no_data_check", False))
    return check_container(job, Path(getattr(args, "runs_dir", None) or "runs"))
