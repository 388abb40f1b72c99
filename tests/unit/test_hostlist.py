"""Slurm hostlist expressions (issue 26 item 6): expansion as Slurm does it, checked
against an independent construction with hypothesis, and the errors named."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurm_colloc.hostlist import MAX_HOSTS, HostlistError, contains, expand


@pytest.mark.parametrize(("expr", "names"), [
    ("gpu01", ["gpu01"]),
    ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("rack[1-2]-g[1-2]", ["rack1-g1", "rack1-g2", "rack2-g1", "rack2-g2"]),
    ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
    ("n[1-3],n2", ["n1", "n2", "n3"]),
    (" login1 ", ["login1"]),
    ("[1-2]x", ["1x", "2x"]),
])
def test_expand(expr: str, names: list[str]) -> None:
    assert expand(expr) == names


@pytest.mark.parametrize(("expr", "why"), [
    ("", "empty hostlist"), ("a[]", "empty brackets"), ("a[1-", "without ']'"),
    ("a]", "without '['"), ("a[3-1]", "backwards"), ("a b", "letters, digits"),
    ("a[x]", "not N or N-M"), ("a,,b", "empty entry"), ("a[[1]]", "nested"),
    ("a[0-99999999]", f"more than {MAX_HOSTS}"), ("a[0-999]b[0-999]", f"more than {MAX_HOSTS}"),
])
def test_errors_say_why(expr: str, why: str) -> None:
    with pytest.raises(HostlistError, match=why.replace("[", r"\[")):
        expand(expr)


def test_contains_is_exact() -> None:
    assert contains("gpu[01-04]", "gpu03")
    assert not contains("gpu[01-04]", "gpu3")  # padding is part of the name
    assert not contains("gpu[01-04]", "gpu05")
    assert not contains("gpu[01-04]", "GPU01")  # Slurm node names are case-sensitive


prefixes = st.from_regex(r"[a-z][a-z0-9_-]{0,6}", fullmatch=True).filter(
    lambda s: not s[-1].isdigit())
ranges = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 20)), min_size=1, max_size=4)


@given(prefixes, ranges, st.integers(1, 4))
def test_brackets_name_the_numbers_they_list(prefix: str, spans: list[tuple[int, int]],
                                             width: int) -> None:
    """``prefix[a-b,c-d]`` names exactly prefix + each number, padded to the width of
    the range's first number, in order, without repeats."""
    body = ",".join(f"{lo:0{width}d}-{lo + n:0{width}d}" for lo, n in spans)
    want: list[str] = []
    for lo, n in spans:
        w = len(f"{lo:0{width}d}")
        want += [f"{prefix}{i:0{w}d}" for i in range(lo, lo + n + 1)]
    got = expand(f"{prefix}[{body}]")
    assert got == list(dict.fromkeys(want))
    assert all(contains(f"{prefix}[{body}]", h) for h in got[:5])


@given(st.lists(prefixes, min_size=1, max_size=3), st.lists(prefixes, min_size=1, max_size=3))
def test_comma_list_is_the_union(a: list[str], b: list[str]) -> None:
    assert expand(",".join(a + b)) == list(dict.fromkeys(a + b))


@given(prefixes, st.integers(1, 9), prefixes, st.integers(1, 9))
def test_two_brackets_give_every_combination(p: str, n: int, q: str, m: int) -> None:
    names = expand(f"{p}[1-{n}]{q}[1-{m}]")
    assert len(names) == n * m
    assert names == [f"{p}{i}{q}{j}" for i in range(1, n + 1) for j in range(1, m + 1)]
