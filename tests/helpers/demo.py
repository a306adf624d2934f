"""The demo task the end-to-end tests run (defs/demo/demo_hello_file), and what solves it."""

from __future__ import annotations

from helpers import REPO

DEMO = REPO / "defs" / "demo"
TASK = "demo_hello_file"
KEY = "greeting.txt"  # a substring of the task's prompt: the scripted server's script key
SOLVE = "printf 'Hello, et-hpc!\\n' > /home/user/greeting.txt"
