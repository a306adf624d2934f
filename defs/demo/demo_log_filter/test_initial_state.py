import os

LOG = "/home/user/logs/app.log"


def test_log_present():
    assert os.path.isfile(LOG), f"{LOG} is missing"
    with open(LOG, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) == 8


def test_errors_absent():
    assert not os.path.exists("/home/user/logs/errors.log"), "errors.log must not exist yet"
