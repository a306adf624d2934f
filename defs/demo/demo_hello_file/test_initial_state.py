import os

HOME = "/home/user"


def test_home_exists_and_writable():
    assert os.path.isdir(HOME), f"{HOME} is missing"
    assert os.access(HOME, os.W_OK), f"{HOME} is not writable"


def test_greeting_absent():
    assert not os.path.exists(os.path.join(HOME, "greeting.txt")), "greeting.txt must not exist yet"
