"""docs/strategy_options.md's table against the strategies' signatures (every argument, its default, which strategy
takes it), and docs/compiled_programs.md's opening against what the code does."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from lightning_sink import SinkDDPStrategy, SinkModelParallelStrategy, SinkStrategy

DOCS = Path(__file__).resolve().parents[1] / "docs"
STRATEGIES = (SinkStrategy, SinkDDPStrategy, SinkModelParallelStrategy)


def table() -> tuple[list[str], list[list[str]]]:
    text = (DOCS / "strategy_options.md").read_text()
    lines = [line for line in text.split("## Which graph mode", 1)[0].splitlines() if line.startswith("| ")]
    header, *rows = ([cell.strip() for cell in line.strip("|").split("|")] for line in lines)
    return header, [row for row in rows if not set(row[0]) <= {"-"}]


def documented_default(parameter: inspect.Parameter) -> str:
    if parameter.kind is inspect.Parameter.VAR_KEYWORD:
        return ""
    return "`" + repr(parameter.default).replace("'", '"').replace("datetime.", "") + "`"


def signature_rows() -> dict[str, dict[str, object]]:
    """argument -> {"default": as the table writes it, strategy name: takes it}"""
    found: dict[str, dict[str, object]] = {}
    for strategy in STRATEGIES:
        for name, parameter in inspect.signature(strategy.__init__).parameters.items():
            if name == "self":
                continue
            label = f"`**{name}`" if parameter.kind is inspect.Parameter.VAR_KEYWORD else f"`{name}`"
            row = found.setdefault(label, {"default": documented_default(parameter)})
            assert row["default"] == documented_default(parameter), f"{label}: defaults differ between strategies"
            row[f"`{strategy.__name__}`"] = True
    return found


def test_the_table_has_every_argument_of_every_strategy_with_its_default():
    header, rows = table()
    assert header[:5] == ["argument", "default", "`SinkStrategy`", "`SinkDDPStrategy`", "`SinkModelParallelStrategy`"]
    expected = signature_rows()
    documented = {row[0]: row for row in rows}
    assert sorted(documented) == sorted(expected)
    for label, row in documented.items():
        assert row[1] == expected[label]["default"], label
        for column, cell in zip(header[2:5], row[2:5]):
            assert cell == ("yes" if expected[label].get(column) else "-"), (label, column)


def test_the_graph_mode_table_has_a_row_for_each_mode_the_strategies_accept():
    from lightning_sink.strategies.graph_modes import GRAPH_MODES

    text = (DOCS / "strategy_options.md").read_text().split("## Which graph mode", 1)[1]
    assert set(re.findall(r"^\| `\"(\w+)\"`", text, re.MULTILINE)) == set(GRAPH_MODES)


def test_compiled_programs_opens_with_what_compile_does_in_sink_mode():
    opening = (DOCS / "compiled_programs.md").read_text().split("\n\n")[1]
    assert "today compiles only" not in opening
    assert "In sink mode" in opening and "one compiled\nfunction over the whole step" in opening
