import os

LOG = "/home/user/logs/app.log"
OUT = "/home/user/logs/errors.log"
EXPECTED = [
    "2025-01-01T10:01:00 [ERROR] disk full on /var",
    "2025-01-01T10:02:00 [ERROR] connection refused by db-1",
    "2025-01-01T10:03:00 [ERROR] retry budget exhausted",
]


def test_errors_file():
    assert os.path.isfile(OUT), f"{OUT} was not created"
    with open(OUT, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert lines == EXPECTED, f"errors.log holds {lines!r}"


def test_app_log_unchanged():
    with open(LOG, encoding="utf-8") as f:
        assert len(f.read().splitlines()) == 8, "app.log was modified"
