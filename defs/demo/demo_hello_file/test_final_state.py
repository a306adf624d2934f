import os

PATH = "/home/user/greeting.txt"


def test_greeting_exists():
    assert os.path.isfile(PATH), f"{PATH} was not created"


def test_greeting_content():
    with open(PATH, encoding="utf-8") as f:
        content = f.read()
    assert content == "Hello, et-hpc!\n", f"unexpected content: {content!r}"
