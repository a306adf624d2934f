"""Replies constrained to the protocol: the grammars, and how (or whether) a server enforces them.

``grammar(mode)`` is a GBNF grammar (llama.cpp's format, which vLLM's xgrammar backend also reads)
allowing exactly one command or the done reply: tools mode one Hermes ``<tool_call>`` of the
terminal tool or ``DONE_REPLY``, text mode one ``<command>`` or ``<action>done</action>``.
``how(constrain, mode, token_in, dialect)`` says what a request carries (``grammar``: llama-server's
``grammar`` field or vLLM's ``structured_outputs.grammar``; ``tool_choice``: "required", enforced
by vLLM; ``none``) and, where a constraint was asked for but the server cannot enforce it, the one
warning line the run prints at its start. Details: docs/policy.md, "Constrained replies".
"""

from __future__ import annotations

import logging
import threading
from typing import Literal

log = logging.getLogger(__name__)

How = Literal["grammar", "tool_choice", "none"]

DONE_REPLY = "The task is complete."

# a JSON string (RFC 8259): no raw control characters, escapes only as JSON allows
_JSON_STRING = r"""jstr ::= "\"" ( [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" hex hex hex hex ) )* "\""
hex ::= [0-9a-fA-F]
"""

TOOLS_GRAMMAR = (
    r"""root ::= call | done
call ::= "<tool_call>\n{\"name\": \"terminal\", \"arguments\": {\"command\": " jstr "}}\n</tool_call>"
"""
    + f'done ::= "{DONE_REPLY}"\n'
    + _JSON_STRING
)

TEXT_GRAMMAR = r"""root ::= "<command>" cmd "</command>" | "<action>done</action>"
cmd ::= ( [^<] | "<" [^/] )+
"""

CANNOT = {
    "llama-tools": 'llama-server does not enforce tool_choice "required" on chat completions: tools-mode replies '
    "are NOT constrained (set policy.token_in=true to constrain them with a grammar)",
}

_lock = threading.Lock()


def grammar(mode: str) -> str:
    return TEXT_GRAMMAR if mode == "text" else TOOLS_GRAMMAR


def how(constrain: bool | None, mode: str, token_in: bool, dialect: str | None) -> tuple[How, str | None]:
    """What the requests carry and the warning to give (None: none). ``constrain`` None is the
    default: constrain where the server is llama-server (the embedded one) and token-in is on."""
    if constrain is False:
        return "none", None
    if token_in:
        return ("grammar" if constrain or dialect == "llama" else "none"), None
    if constrain is None:
        return "none", None
    if mode == "text":
        return "grammar", None
    if dialect == "llama":
        return "none", CANNOT["llama-tools"]
    return "tool_choice", None


def warn_once(where: str, warning: str | None) -> None:
    """Log ``warning`` once per process and server (the run's first episode says it)."""
    if warning is None:
        return
    with _lock:
        if (where, warning) in _warned_pairs:
            return
        _warned_pairs.add((where, warning))
    log.warning("%s: %s", where, warning)


_warned_pairs: set[tuple[str, str]] = set()
