"""The run directory: the only contract between the login side and the ranks.

Its file names and layout (:mod:`~cyclone_kit.rundir.layout`), the metrics records
(:mod:`~cyclone_kit.rundir.contract`), error and failure records (:mod:`~cyclone_kit.rundir.failures`),
the rank command line (:mod:`~cyclone_kit.rundir.entry`) and the one atomic writer
(:mod:`~cyclone_kit.rundir.fileio`). Stdlib only.
"""
