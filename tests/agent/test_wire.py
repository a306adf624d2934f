"""The ET text protocol parser, tool-call argument parsing and observation texts."""

from __future__ import annotations

import pytest

from et_hpc.agent.prompts import COULD_NOT_PARSE, TEXT_SYSTEM_PROMPT, TOOLS_SYSTEM_PROMPT
from et_hpc.agent.wire import (
    ToolArgsError,
    format_observation,
    parse_text_reply,
    parse_tool_arguments,
    truncate_output,
)


def test_last_command_wins():
    p = parse_text_reply("<think>try <command>ls</command> first</think>\n<command>  cat /etc/hostname \n</command>")
    assert p.kind == "command"
    assert p.command == "cat /etc/hostname"


def test_multiline_command_kept_whole():
    p = parse_text_reply("<command>cat <<'EOF' > f\na\nb\nEOF</command>")
    assert p.command == "cat <<'EOF' > f\na\nb\nEOF"


def test_done_takes_precedence_over_commands():
    p = parse_text_reply("<command>rm -rf x</command> <action> done </action>")
    assert p.kind == "done"
    assert p.command is None


@pytest.mark.parametrize("text", ["", None, "I will list files: ls", "<command></command>", "<command>ls"])
def test_unparsable_reply(text):
    assert parse_text_reply(text).kind == "invalid"


def test_could_not_parse_text_is_upstreams():
    assert COULD_NOT_PARSE.startswith("Could not parse a single <command>...</command> or <action>done</action>.")


def test_prompts_name_their_protocol():
    assert "<command>THE_SINGLE_SHELL_COMMAND</command>" in TEXT_SYSTEM_PROMPT
    assert "<action>done</action>" in TEXT_SYSTEM_PROMPT
    assert "`terminal`" in TOOLS_SYSTEM_PROMPT


def test_observation_texts():
    assert format_observation("hi\n", 0) == "Command executed successfully. Output: hi\n\n\n(exit_code=0)"
    assert format_observation("no such file", 2) == "Command failed. Output: no such file\n\n(exit_code=2)"
    t = format_observation("partial", None, timed_out=True, timeout_s=5)
    assert t.startswith("Command failed. Output: Command timed out after 5 s")
    assert "partial" in t and t.endswith("(exit_code=timeout)")


def test_output_cut_at_limit_keeps_head_and_tail():
    out = "H" * 40_000 + "M" * 40_000 + "T" * 40_000
    cut = truncate_output(out, 50_000)
    assert len(cut) == 50_000
    assert cut.startswith("H") and cut.endswith("T")
    assert "output truncated" in cut
    obs = format_observation(out, 0)
    assert len(obs) < 50_100
    assert truncate_output("short", 50_000) == "short"


def test_tool_arguments_ok():
    assert parse_tool_arguments("terminal", '{"command": "ls -la", "timeout": 30}') == ("ls -la", 30)
    assert parse_tool_arguments("terminal", '{"command": "pwd"}') == ("pwd", None)


@pytest.mark.parametrize(
    "name,args,needle",
    [
        ("terminal", '{"command": "ls", "timeout": ', "JSON"),
        ("terminal", '["ls"]', "JSON object"),
        ("terminal", '{"cmd": "ls"}', "`command`"),
        ("terminal", '{"command": "ls", "timeout": "soon"}', "`timeout`"),
        ("terminal", '{"command": "ls", "timeout": -3}', "positive"),
        ("bash", '{"command": "ls"}', "Unknown tool"),
    ],
)
def test_tool_arguments_errors_explain(name, args, needle):
    with pytest.raises(ToolArgsError) as e:
        parse_tool_arguments(name, args)
    assert needle in str(e.value)
