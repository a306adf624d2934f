"""Scoring: one room for everything that decides a reward from a state an agent left.

``live`` (run the final tests through the entry helper, the blame table, ``score_fields`` for
the record), ``sweep`` (end the instance's processes from the host), ``helper_pool`` (a ready
entry helper), the entry helper's parts (``enter_sys``, ``enter_view``, ``enter_pytest``,
``enter``: stdlib only, run as one program), ``start_check`` (a kept state read with debugfs
before it is started again). Live scoring and rescoring both score through ``live.score``:
nothing of a state runs by name on either path. Specification: docs/scoring.md; SECURITY.md.
"""
