"""Everything that knows Slurm's command lines and output formats, as pure functions.

* :mod:`.argv` builds argv lists for sbatch, squeue, sacct, scontrol and scancel;
* :mod:`.parse` turns their output into :class:`~cyclone_kit.slurm.parse.JobInfo` records;
* :mod:`.states` maps Slurm's state strings onto :class:`~cyclone_kit.slurm.states.JobState`;
* :mod:`.hostlist` expands ``gpu[01-04,07]`` and ``2(x3),1``;
* :mod:`.env` reads facts about the current job from a Slurm environment mapping.

Running the commands is the backend's job (:mod:`cyclone_kit.backends.slurm`).
"""
