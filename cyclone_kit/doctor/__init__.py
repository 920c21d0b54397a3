"""``cyclone-kit doctor``: pure checks (:mod:`~cyclone_kit.doctor.checks`), what the cluster says and the smoke
job (:mod:`~cyclone_kit.doctor.job`), and the probe every rank of the smoke job runs (:mod:`~cyclone_kit.doctor.probe`)."""
