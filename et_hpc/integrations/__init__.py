"""Integrations of et-hpc into other frameworks' own interfaces (``atropos``: an atroposlib BaseEnv).

Each submodule imports its framework, which is an optional dependency (``pip install et-hpc[atropos]``).
"""
