"""Wire formats: the two ways a model talks to the terminal: ET's ``<command>`` text protocol and tool calls.

Text protocol (Endless Terminals): the reply holds ``<command>...</command>`` (the last one wins)
or ``<action>done</action>`` (which takes precedence); anything else gets the fixed
could-not-parse reply. Tool-call protocol: one ``terminal`` tool taking ``{command, timeout?}``;
a reply without a tool call ends the episode. Both share the observation text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from et_hpc.agent.prompts import TEXT_SYSTEM_PROMPT, TOOLS_SYSTEM_PROMPT
from et_hpc.sandbox.shell import OUTPUT_LIMIT_CHARS

CMD_RE = re.compile(r"<command>\s*(.*?)\s*</command>", re.DOTALL)
DONE_RE = re.compile(r"<action>\s*done\s*</action>", re.DOTALL)


DONE_TEXT = "<action>done</action>"

TOOL_NAME = "terminal"

TERMINAL_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": (
            "Run one shell command in a persistent bash session (cwd and exported variables "
            "carry over between calls) and return its merged stdout/stderr and exit code. "
            "Commands must be non-interactive."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The shell command to run."},
                "timeout": {
                    "type": "integer",
                    "description": "Seconds to allow before the command is interrupted (optional).",
                },
            },
            "required": ["command"],
        },
    },
}

Mode = Literal["text", "tools"]


def default_system_prompt(mode: Mode) -> str:
    return TEXT_SYSTEM_PROMPT if mode == "text" else TOOLS_SYSTEM_PROMPT


@dataclass(frozen=True)
class ParsedText:
    """What a text-protocol reply asks for."""

    kind: Literal["command", "done", "invalid"]
    command: str | None = None


THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)


def strip_thinking(text: str) -> str:
    """The reply without its closed ``<think>...</think>`` blocks (reasoning is not an action)."""
    return THINK_RE.sub("", text)


def parse_text_reply(text: str | None) -> ParsedText:
    """``<action>done</action>`` wins over commands; among commands the last one wins. Closed
    ``<think>`` blocks are ignored: a command the model only thought about is not run."""
    text = strip_thinking(text or "")
    if DONE_RE.search(text):
        return ParsedText("done")
    cmds = CMD_RE.findall(text)
    if cmds and cmds[-1].strip():
        return ParsedText("command", cmds[-1])
    return ParsedText("invalid")


class ToolArgsError(ValueError):
    """The model's tool-call arguments are not usable; ``str()`` is shown to the model."""


def history_arguments(arguments: str | None) -> str:
    """Tool-call arguments as the conversation keeps them: a JSON object's text, which every server
    re-renders (vLLM and llama-server parse the arguments of the history's calls, and refuse the
    whole request when they cannot). Arguments that are not one (a reply cut off at its token
    limit, broken JSON) are kept as the string ``{"unparsed": ...}``: the model's own malformed
    reply must stay its failure, never become a request the server rejects."""
    try:
        obj = json.loads(arguments or "")
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        return arguments or "{}"
    return json.dumps({"unparsed": arguments or ""}, ensure_ascii=False)


def parse_tool_arguments(name: str | None, arguments: str | None) -> tuple[str, int | None]:
    """Return ``(command, timeout)`` from a ``terminal`` tool call, or raise ``ToolArgsError``."""
    if not name:  # a ``<tool_call>`` block that is not JSON has no name either: say what is wrong
        try:
            json.loads(arguments or "")
        except json.JSONDecodeError as e:
            raise ToolArgsError(
                f"Could not parse the tool call as JSON ({e.msg} at position {e.pos}). "
                'Call `terminal` like <tool_call>{"name": "terminal", "arguments": {"command": "ls"}}</tool_call>.'
            ) from None
    if name != TOOL_NAME:
        raise ToolArgsError(f"Unknown tool {name!r}. The only tool is `{TOOL_NAME}`.")
    try:
        args = json.loads(arguments or "")
    except json.JSONDecodeError as e:
        raise ToolArgsError(
            f"Could not parse the tool call arguments as JSON ({e.msg} at position {e.pos}). "
            'Call `terminal` with arguments like {"command": "ls -la", "timeout": 30}.'
        ) from None
    if not isinstance(args, dict):
        raise ToolArgsError('The tool call arguments must be a JSON object like {"command": "ls"}.')
    cmd = args.get("command")
    if not isinstance(cmd, str) or not cmd.strip():
        raise ToolArgsError('The `command` argument is missing or empty; pass {"command": "..."}.')
    timeout = args.get("timeout")
    if timeout is not None:
        try:
            timeout = int(timeout)
        except (TypeError, ValueError):
            raise ToolArgsError("The `timeout` argument must be an integer number of seconds.") from None
        if timeout <= 0:
            raise ToolArgsError("The `timeout` argument must be a positive number of seconds.")
    return cmd, timeout


def truncate_output(out: str, limit: int = OUTPUT_LIMIT_CHARS) -> str:
    """Cut to ``limit`` characters, keeping head and tail around a notice."""
    if len(out) <= limit:
        return out
    notice = f"\n\n[... output truncated: {len(out) - limit} of {len(out)} characters omitted ...]\n\n"
    keep = max(limit - len(notice), 0)
    head = keep // 2
    tail = keep - head
    return out[:head] + notice + (out[-tail:] if tail else "")


def format_observation(
    output: str,
    exit_code: int | None,
    *,
    timed_out: bool = False,
    timeout_s: float | None = None,
    limit: int = OUTPUT_LIMIT_CHARS,
) -> str:
    """The observation text ET gives the model after a command."""
    out = truncate_output(output or "", limit)
    if timed_out:
        secs = f" after {timeout_s:g} s" if timeout_s is not None else ""
        return f"Command failed. Output: Command timed out{secs} and was interrupted. Partial output:\n{out}\n\n(exit_code=timeout)"
    if exit_code == 0:
        return f"Command executed successfully. Output: {out}\n\n(exit_code=0)"
    code = "unknown" if exit_code is None else exit_code
    return f"Command failed. Output: {out}\n\n(exit_code={code})"
