"""Which weights answered a turn: the versioned alias a server names in its response's ``model``.

A server started with a versioned alias (endpoint key ``served_model``: ``slurm/vllm.sbatch
--checkpoint-dir`` serves ``NAME@VERSION`` before ``NAME``; ``et-hpc model serve`` serves only the
alias) names it in every response (vLLM: its first served name; llama-server: its alias, whatever
was asked), and vLLM answers a request for an alias it no longer serves with 404 "The model `X`
does not exist." Neither sends a version header. ``ServedVersions`` learns alias -> ``model_version``
from each endpoint record read, gives a request the current alias in place of the plain name, tells
a switch (404 for the alias just sent, the record now naming another) from other errors, and labels
a turn from its response: source ``response``; without an alias, ``endpoint`` (the file's version
read around the request).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

RESPONSE, ENDPOINT = "response", "endpoint"
MAX_SWITCHES = 8  # switches followed within one request before they count as failed attempts


class ServedVersions:
    """Aliases seen in endpoint records, the alias to request now, and the last one sent."""

    def __init__(self) -> None:
        self.versions: dict[str, str] = {}  # alias -> model_version
        self.plain: str | None = None  # the record's plain model name
        self.current: str | None = None  # the alias the record names now (None: none)
        self.sent: str | None = None  # the alias the last request named

    def learn(self, rec: Mapping[str, Any] | None) -> None:
        """Take in an endpoint record (the file's, or a replica's fields)."""
        if rec is None:
            return
        alias, version, plain = rec.get("served_model"), rec.get("model_version"), rec.get("model")
        self.plain = plain if isinstance(plain, str) and plain else self.plain
        if isinstance(alias, str) and alias and version is not None:
            self.versions[str(alias)] = str(version)
            self.current = str(alias)
        else:
            self.current = None

    def request_name(self, model: str | None) -> str | None:
        """The name to send for ``model``: the current alias when ``model`` is the record's plain
        name (or an alias of it, or unset), else ``model`` as it is."""
        use = self.current is not None and (model is None or model == self.plain or model in self.versions)
        self.sent = self.current if use else None
        return self.current if use else model

    def switched(self, status: int, text: str, reread: Callable[[], object]) -> str | None:
        """After an error answer: the alias to retry with when it says the alias just sent is not
        served and the endpoint now names another (the weights switched); else None."""
        if status != 404 or self.sent is None or "does not exist" not in text:
            return None
        reread()
        return self.current if self.current not in (None, self.sent) else None

    def label(self, answered_by: Any, reread: Callable[[], object]) -> str | None:
        """The version a response names in its ``model`` (None: it names no versioned alias)."""
        if not isinstance(answered_by, str) or not answered_by:
            return None
        if answered_by not in self.versions and self.plain and answered_by.startswith(self.plain + "@"):
            reread()  # an alias not read yet: the server moved on before its file did
        if answered_by in self.versions:
            return self.versions[answered_by]
        return answered_by if self.plain and answered_by.startswith(self.plain + "@") else None
