"""One episode end to end (``run``: sandbox, agent, scoring, record) and the task check built on it
(``check``)."""
