"""How bench.goodput splits its engines between the P/D pools."""

from __future__ import annotations

import pytest

from bench import goodput


def test_engines_split_in_half_by_default() -> None:
    assert goodput.parse_args(["--engines", "4"]).prefill_engines == 2


def test_an_uneven_split_is_given_explicitly() -> None:
    args = goodput.parse_args(["--engines", "3", "--prefill-engines", "1"])
    cluster = goodput.Cluster(None, ["a", "b", "c"], 0.5, args.prefill_engines)  # type: ignore[arg-type]
    assert (cluster.prefill, cluster.decode) == (["a"], ["b", "c"])


@pytest.mark.parametrize(
    "argv",
    [["--engines", "3"], ["--engines", "3", "--prefill-engines", "3"], ["--engines", "2", "--prefill-engines", "0"]],
    ids=["odd-without-split", "no-decode-engine", "no-prefill-engine"],
)
def test_a_split_that_leaves_a_pool_empty_is_refused(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit):
        goodput.parse_args(argv)
    assert "engines" in capsys.readouterr().err
