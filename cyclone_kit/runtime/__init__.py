"""The code that runs inside the job, on every rank.

``env`` (pure rank bootstrap) imports no torch; ``dist``, ``models``, ``data``, ``train``,
``checkpoint`` and ``signals`` do. Entry points: ``python -m cyclone_kit.runtime --run-dir DIR``
and :func:`cyclone_kit.runtime.__main__.run_training`.
"""
