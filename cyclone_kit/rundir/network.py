"""Network figures: all-reduce latency (alpha) and bus bandwidth (beta) per network level.

The one owner of ``network.json`` (schema 1), which ``cyclone-kit doctor`` writes into its run
directory and ``cyclone-kit predict --network`` reads; a profile's ``[network]`` table (published
figures) reads into the same :class:`NetworkFigures`, labelled ``published``::

    {"kind": "network", "schema": 1, "source": "measured" | "published",
     "cluster": "local", "partition": "cpu", "device": "cpu", "device_type": "", "backend": "gloo",
     "origin": "doctor run runs/ck-doctor-...", "time": "...",
     "levels": {"inter": {"alpha_s": 9.1e-05, "busbw_gbps": 1.35, "ranks": 2, "nodes": 2,
                          "busbw_peak_gbps": 1.4, "points": [[4, 9.3e-05], ..., [67108864, 0.0497]],
                          "source": "..."},
                "intra": {...}}}

Levels: ``intra`` (ranks inside one node) and ``inter`` (one rank per node, across nodes).
``busbw`` follows nccl-tests: ``bus bytes / time`` with bus bytes = ``2 (n - 1) / n x size``;
``alpha`` is the fitted time of an all-reduce of nothing over ``ranks`` ranks
(:func:`fit_alpha_beta`). Pure apart from :func:`load_network` / :func:`save_network`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cyclone_kit.core.errors import ValidationError
from cyclone_kit.rundir.fileio import write_atomic
from cyclone_kit.rundir.layout import RunDir

SCHEMA = 1
KIND = "network"
#: The levels of a network, inside a node and across nodes.
LEVELS = ("intra", "inter")
SOURCES = ("measured", "published")


@dataclass(frozen=True)
class Level:
    """All-reduce figures of one network level.

    Attributes:
        alpha_s: latency of one all-reduce over ``ranks`` ranks, extrapolated to zero bytes (seconds).
        busbw_gbps: bus bandwidth in GB/s (10^9 bytes), nccl-tests' definition.
        ranks: ranks the figures were measured (or are published) for; nodes: over how many nodes.
        busbw_peak_gbps: the bus bandwidth of the largest message measured (0 when published).
        points: the measured (bytes, seconds) medians.
        source: where the figures come from, in words (a citation for published ones).
    """

    alpha_s: float
    busbw_gbps: float
    ranks: int = 2
    nodes: int = 1
    busbw_peak_gbps: float = 0.0
    points: tuple[tuple[int, float], ...] = ()
    source: str = ""

    @property
    def alpha_hop_s(self) -> float:
        """Latency per ring step: ``alpha_s / (2 (ranks - 1))`` (a ring all-reduce takes 2 (n - 1) steps)."""
        return self.alpha_s / (2 * max(1, self.ranks - 1))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form."""
        return {"alpha_s": self.alpha_s, "busbw_gbps": self.busbw_gbps, "ranks": self.ranks, "nodes": self.nodes,
                "busbw_peak_gbps": self.busbw_peak_gbps, "points": [list(p) for p in self.points],
                "source": self.source}


@dataclass(frozen=True)
class NetworkFigures:
    """The network figures of one cluster partition (``network.json`` or a profile's ``[network]``).

    Attributes:
        levels: ``intra`` / ``inter`` -> :class:`Level` (a level not measured is absent).
        source: ``measured`` (doctor) or ``published``.
        cluster, partition: the profile and partition they belong to.
        device: ``cpu`` or ``cuda``; device_type the partition's GPU type (``V100``; empty on CPU).
        backend: the collective library (``gloo`` / ``nccl``).
        origin: where they come from (a doctor run directory, a profile).
        time: when they were measured (ISO-8601), empty for published ones.
        skipped: level -> why it was not measured.
    """

    levels: Mapping[str, Level]
    source: str = "measured"
    cluster: str = ""
    partition: str = ""
    device: str = "cpu"
    device_type: str = ""
    backend: str = "gloo"
    origin: str = ""
    time: str = ""
    skipped: Mapping[str, str] = field(default_factory=dict)

    @property
    def published(self) -> bool:
        """True for published (not measured) figures."""
        return self.source == "published"

    def level(self, name: str) -> Level | None:
        """The figures of level ``name``, or None when not known."""
        return self.levels.get(name)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (``network.json``)."""
        return {"kind": KIND, "schema": SCHEMA, "source": self.source, "cluster": self.cluster,
                "partition": self.partition, "device": self.device, "device_type": self.device_type,
                "backend": self.backend, "origin": self.origin, "time": self.time,
                "levels": {k: v.to_dict() for k, v in self.levels.items()}, "skipped": dict(self.skipped)}


def bus_factor(ranks: int) -> float:
    """nccl-tests' all-reduce bus factor ``2 (n - 1) / n`` (1 for a single rank)."""
    return 2 * (ranks - 1) / ranks if ranks > 1 else 1.0


def fit_alpha_beta(points: Sequence[tuple[float, float]], ranks: int) -> tuple[float, float]:
    """(alpha seconds, busbw GB/s) fitting ``t = alpha + bus_factor(n) x size / busbw`` to (bytes, seconds).

    Least squares on the relative error (weights 1/t^2), so the microseconds of small messages
    count as much as the milliseconds of large ones. alpha is clamped at 0; when the slope is
    not positive (a sweep too noisy to show a bandwidth) busbw is that of the largest message.

    Raises:
        ValueError: fewer than two points with a positive time.
    """
    pts = [(float(s), float(t)) for s, t in points if t > 0]
    if len(pts) < 2:
        raise ValueError("need at least two (bytes, seconds) points")
    f = bus_factor(ranks)
    weights = [1.0 / t**2 for _, t in pts]
    xs = [f * s for s, _ in pts]
    ys = [t for _, t in pts]
    total = sum(weights)
    mx = sum(w * x for w, x in zip(weights, xs, strict=True)) / total
    my = sum(w * y for w, y in zip(weights, ys, strict=True)) / total
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(weights, xs, strict=True))
    sxy = sum(w * (x - mx) * (y - my) for w, x, y in zip(weights, xs, ys, strict=True))
    slope = sxy / sxx if sxx > 0 else 0.0
    if slope <= 0:  # seconds per bus byte of the largest message
        size, seconds = max(pts)
        slope = seconds / (f * size)
    return max(0.0, my - slope * mx), 1.0 / slope / 1e9


def level_from_points(points: Sequence[tuple[int, float]], ranks: int, nodes: int, source: str = "") -> Level:
    """A measured :class:`Level`: the fit of :func:`fit_alpha_beta` plus the peak bus bandwidth."""
    alpha, busbw = fit_alpha_beta(points, ranks)
    size, seconds = max(points)
    return Level(alpha_s=alpha, busbw_gbps=busbw, ranks=ranks, nodes=nodes,
                 busbw_peak_gbps=bus_factor(ranks) * size / seconds / 1e9 if seconds > 0 else 0.0,
                 points=tuple((int(s), float(t)) for s, t in points), source=source)


def _number(doc: Mapping[str, Any], key: str, where: str, *, positive: bool = True) -> float:
    """A finite (positive) number from ``doc[key]``, else a ValidationError naming ``where``."""
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or (
            value <= 0 if positive else value < 0):
        raise ValidationError(f"{where}: {key} = {value!r} is not a {'positive ' if positive else ''}number",
                              hint=f"give {key} as a number, e.g. {key} = 10.0")
    return float(value)


def level_from_dict(doc: Mapping[str, Any], where: str, *, published: bool = False) -> Level:
    """A :class:`Level` from ``network.json`` (``alpha_s``) or a profile table (``alpha_us``).

    Raises:
        ValidationError: a missing or non-positive figure.
    """
    if not isinstance(doc, Mapping):
        raise ValidationError(f"{where} is not a table", hint="give alpha_us and busbw_gbps")
    alpha = _number(doc, "alpha_us", where, positive=False) * 1e-6 if "alpha_us" in doc else \
        _number(doc, "alpha_s", where, positive=False)
    points = tuple((int(p[0]), float(p[1])) for p in doc.get("points", ()) if isinstance(p, list | tuple) and len(p) == 2)
    return Level(alpha_s=alpha, busbw_gbps=_number(doc, "busbw_gbps", where), ranks=int(doc.get("ranks", 2)),
                 nodes=int(doc.get("nodes", 1)), busbw_peak_gbps=float(doc.get("busbw_peak_gbps", 0.0) or 0.0),
                 points=points, source=str(doc.get("source", "published" if published else "")))


def figures_from_dict(doc: Mapping[str, Any], where: str) -> NetworkFigures:
    """:class:`NetworkFigures` from the JSON form.

    Raises:
        ValidationError: not a network document of this schema, or bad figures.
    """
    if not isinstance(doc, Mapping) or doc.get("kind") != KIND:
        raise ValidationError(f"{where} is not a network.json (no \"kind\": \"network\")",
                              hint="pass the network.json a `cyclone-kit doctor` run wrote into its run directory")
    if doc.get("schema") != SCHEMA:
        raise ValidationError(f"{where} has schema {doc.get('schema')!r}, this version reads schema {SCHEMA}",
                              hint="run `cyclone-kit doctor` again with this version")
    levels_doc = doc.get("levels")
    if not isinstance(levels_doc, Mapping) or not levels_doc:
        raise ValidationError(f"{where} holds no network level", hint="run `cyclone-kit doctor` on 2 nodes or more")
    unknown = sorted(set(levels_doc) - set(LEVELS))
    if unknown:
        raise ValidationError(f"{where}: unknown level(s) {', '.join(unknown)}", hint=f"levels are {', '.join(LEVELS)}")
    source = str(doc.get("source", "measured"))
    levels = {k: level_from_dict(v, f"{where} levels.{k}", published=source == "published")
              for k, v in levels_doc.items()}
    return NetworkFigures(levels=levels, source=source, cluster=str(doc.get("cluster", "")),
                          partition=str(doc.get("partition", "")), device=str(doc.get("device", "cpu")),
                          device_type=str(doc.get("device_type", "")), backend=str(doc.get("backend", "gloo")),
                          origin=str(doc.get("origin", where)), time=str(doc.get("time", "")),
                          skipped={str(k): str(v) for k, v in dict(doc.get("skipped", {})).items()})


def load_network(path: str | Path) -> NetworkFigures:
    """Read a ``network.json`` (or the one inside a doctor run directory).

    Raises:
        ValidationError: missing, unreadable or not a network document.
    """
    path = Path(path)
    if path.is_dir():
        path = RunDir(path).network
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValidationError(f"{path} does not exist",
                              hint="pass the network.json of a `cyclone-kit doctor` run (it prints its run directory)"
                              ) from None
    except (OSError, ValueError) as e:
        raise ValidationError(f"cannot read {path}: {e}", hint="pass a network.json written by `cyclone-kit doctor`"
                              ) from None
    return figures_from_dict(doc, str(path))


def save_network(path: Path, figures: NetworkFigures) -> None:
    """Write ``figures`` to ``path`` atomically (sorted keys, indented)."""
    text = json.dumps(figures.to_dict(), indent=1, sort_keys=True)
    text = re.sub(r"\[\s+(\S+),\s+(\S+)\s+\]", r"[\1, \2]", text)  # one (bytes, seconds) point a line
    write_atomic(path, text + "\n")
