"""Hostlist and SLURM_TASKS_PER_NODE expansion: tables of the cases other tools got wrong, and properties."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cyclone_kit.core.errors import ValidationError
from cyclone_kit.slurm import hostlist

EXPANSIONS = [
    (
        "gpu[01-04,07],cn[001-003]",
        ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cn001", "cn002", "cn003"],
    ),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("linux[1,2]", ["linux1", "linux2"]),
    ("alpha,beta", ["alpha", "beta"]),
    ("node64-[17-20]", ["node64-17", "node64-18", "node64-19", "node64-20"]),
    ("n[9-11]", ["n9", "n10", "n11"]),  # padding follows the low bound: n9, not n09
    ("c[1-2]", ["c1", "c2"]),  # what the local test cluster prints
    ("g1", ["g1"]),
    ("cn[08-10]", ["cn08", "cn09", "cn10"]),
    ("", []),
]


@pytest.mark.parametrize(("text", "hosts"), EXPANSIONS)
def test_expand(text: str, hosts: list[str]) -> None:
    assert hostlist.expand(text) == hosts


@pytest.mark.parametrize(
    ("text", "first"),
    [
        ("gpu[01-04,07],cn[001-003]", "gpu01"),
        ("rack[1-2]-node[01-02]", "rack1-node01"),
        ("linux[1,2]", "linux1"),
        ("alpha,beta", "alpha"),
        ("node64-[17-20]", "node64-17"),
        ("n[9-11]", "n9"),
        ("cn[001-003],gpu07", "cn001"),
    ],
)
def test_first_host(text: str, first: str) -> None:
    assert hostlist.first_host(text) == first


@pytest.mark.parametrize("bad", ["c[1-2", "c1-2]", "a[3-1]", "a[x-y]", "a[1-2],b[", "c1 c2", "n[1-\n3]"])
def test_expand_rejects_with_hint(bad: str) -> None:
    with pytest.raises(ValidationError) as info:
        hostlist.expand(bad)
    text = str(info.value)
    assert repr(bad) in text
    assert "HINT:" in text and "\n" not in text


def test_first_host_of_empty_list_explains() -> None:
    with pytest.raises(ValidationError) as info:
        hostlist.first_host("")
    assert "SLURM_JOB_NODELIST" in str(info.value)


@pytest.mark.parametrize(
    ("text", "counts"),
    [
        ("2(x3),1", [2, 2, 2, 1]),
        ("4", [4]),
        ("2(x2)", [2, 2]),  # what the 2-node x 2-task test job sees
        ("1,3(x2),2", [1, 3, 3, 2]),
        (" 4(x4) ", [4, 4, 4, 4]),
    ],
)
def test_expand_tasks_per_node(text: str, counts: list[int]) -> None:
    assert hostlist.expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("bad", ["", "2(x3", "x", "2(3)", "2,,1", "-1"])
def test_expand_tasks_per_node_rejects_with_hint(bad: str) -> None:
    with pytest.raises(ValidationError) as info:
        hostlist.expand_tasks_per_node(bad)
    assert "HINT:" in str(info.value)


@pytest.mark.parametrize("bad", [["a,b"], ["rack[1]"], [""], ["with space"]])
def test_collect_rejects_names_a_hostlist_cannot_hold(bad: list[str]) -> None:
    with pytest.raises(ValidationError):
        hostlist.collect(bad)


def test_collect_compresses() -> None:
    assert hostlist.collect(["n9", "n10", "n11"]) == "n[9-11]"
    assert hostlist.collect(["c1", "c2", "g1"]) == "c[1-2],g1"
    assert hostlist.collect([]) == ""


# ------------------------------------------------------------------------------------ properties
_prefix = st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=6).map(lambda s: s)
_suffix = st.sampled_from(["", "-", "x-"])
_host = st.builds(
    lambda p, s, n, w: f"{p}{s}{n:0{w}d}",
    _prefix,
    _suffix,
    st.integers(min_value=0, max_value=999),
    st.integers(min_value=1, max_value=4),
)
_plain_host = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=8).filter(lambda s: s[0] != "-")


@given(st.lists(st.one_of(_host, _plain_host), min_size=1, max_size=40, unique=True))
def test_collect_then_expand_round_trips(hosts: list[str]) -> None:
    compressed = hostlist.collect(hosts)
    assert sorted(hostlist.expand(compressed)) == sorted(hosts)
    # Compressing the expansion again is stable.
    assert hostlist.collect(hostlist.expand(compressed)) == compressed


@given(
    _prefix,
    st.integers(min_value=0, max_value=500),
    st.integers(min_value=0, max_value=60),
    st.integers(min_value=1, max_value=4),
)
def test_range_expands_to_its_length_in_order(prefix: str, low: int, span: int, width: int) -> None:
    high = low + span
    text = f"{prefix}[{low:0{width}d}-{high:0{width}d}]"
    hosts = hostlist.expand(text)
    assert len(hosts) == span + 1
    assert hosts[0] == f"{prefix}{low:0{width}d}"
    assert hostlist.first_host(text) == hosts[0]
    assert [int(h[len(prefix) :]) for h in hosts] == list(range(low, high + 1))


@given(st.lists(st.tuples(st.integers(min_value=1, max_value=64), st.integers(min_value=1, max_value=8)), max_size=10))
def test_tasks_per_node_round_trip(runs: list[tuple[int, int]]) -> None:
    text = ",".join(f"{count}(x{rep})" if rep > 1 else str(count) for count, rep in runs) or "1"
    expected = [count for count, rep in runs for _ in range(rep)] or [1]
    assert hostlist.expand_tasks_per_node(text) == expected


def test_expand_ignores_surrounding_whitespace() -> None:
    # Values read from files or env often end with a newline.
    assert hostlist.expand(" c[1-2]\n") == ["c1", "c2"]
