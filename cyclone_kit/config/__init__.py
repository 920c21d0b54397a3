"""The user's request as typed, frozen data: cluster profiles, job and sweep specs, and their checks (pure).

Loaded from TOML and ``--set`` at the edge (:mod:`~cyclone_kit.config.toolbox`), validated against a
profile into a :class:`~cyclone_kit.config.validate.ResolvedJob`. The login side only, but for the spec
dataclasses the ranks read back from ``spec.json``.
"""
