"""``lightning-sink`` refusing its arguments: exactly one ``error: ...`` line on stderr, nothing on stdout, exit
status 2, for every kind of refusal and every subcommand; ``--help`` still prints the usage. Each case runs the
command as a real subprocess, as a user or a script calls it."""

from __future__ import annotations

import subprocess

import pytest

from tests.reshard.test_cli_failures import cli

NEEDED = ("--src-checkpoints-dir", "src", "--dst-strategy-file", "layout.json")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        pytest.param((), "the following arguments are required: command", id="no-subcommand"),
        pytest.param(("convert",), "invalid choice: 'convert'", id="unknown-subcommand"),
        pytest.param(("--frobnicate",), "", id="unknown-option-before-subcommand"),
        pytest.param(
            ("reshard", *NEEDED, "--dst-checkpoints-dir", "out", "--frobnicate"), "--frobnicate", id="unknown-option"
        ),
        pytest.param(
            ("reshard", "--dst-strategy-file", "layout.json"), "required: --src-checkpoints-dir", id="missing-required"
        ),
        pytest.param(("reshard", *NEEDED), "--dst-checkpoints-dir is required", id="missing-destination"),
        pytest.param(("reshard", *NEEDED, "--list-ranks"), "--list-ranks needs --rank-id", id="bad-combination"),
        pytest.param(
            ("reshard", *NEEDED, "--rank-id", "0", "--workers", "2"), "--workers belongs", id="bad-combination-2"
        ),
        pytest.param(
            ("reshard", *NEEDED, "--dst-checkpoints-dir", "out", "--workers", "0"), "invalid count '0'", id="bad-value"
        ),
        pytest.param(
            ("reshard", *NEEDED, "--dst-checkpoints-dir", "out", "--memory-budget", "lots"),
            "invalid size 'lots'",
            id="bad-size",
        ),
        pytest.param(
            ("reshard", *NEEDED, "--dst-checkpoints-dir", "out", "--workers", "2", "--memory-budget", "0"),
            "invalid size '0': a memory budget must be at least 1 byte",
            id="zero-memory-budget",
        ),
        pytest.param(("reshard", *NEEDED, "--rank-id", "one"), "invalid int value: 'one'", id="bad-int"),
        pytest.param(
            ("reshard", *NEEDED, "--dst-checkpoints-dir", "out", "--ckpt-prefix", "../x"),
            "--ckpt-prefix",
            id="bad-prefix",
        ),
        pytest.param(("verify",), "required: directory", id="verify-missing-folder-argument"),
        pytest.param(("verify", "a", "b"), "unrecognized arguments: b", id="verify-extra-argument"),
        pytest.param(("layout", "--model", "m.M"), "required: --data-parallel-size", id="layout-missing-required"),
        pytest.param(
            ("layout", "--model", "m.M", "--data-parallel-size", "two", "--tensor-parallel-size", "1", "--output", "o"),
            "invalid int value: 'two'",
            id="layout-bad-value",
        ),
    ],
)
def test_a_refusal_is_one_error_line_and_exit_status_2(args: tuple[str, ...], fragment: str):
    done = cli(*args)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "usage:" not in done.stderr and fragment in lines[0], done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("command", [(), ("reshard",), ("verify",), ("layout",)])
def test_help_still_prints_the_usage(command: tuple[str, ...]):
    done: subprocess.CompletedProcess = cli(*command, "--help")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith(f"usage: lightning-sink {' '.join(command)}".rstrip()), done.stdout
