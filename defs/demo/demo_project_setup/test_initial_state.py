import os

INBOX = "/home/user/inbox"


def test_inbox_contents():
    assert sorted(os.listdir(INBOX)) == ["CHANGES.md", "README.md", "app.py", "data.bin", "util.py"]


def test_project_absent():
    assert not os.path.exists("/home/user/project"), "/home/user/project must not exist yet"
