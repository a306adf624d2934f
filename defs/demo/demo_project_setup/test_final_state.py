import os
import stat

P = "/home/user/project"


def test_layout():
    assert sorted(os.listdir(os.path.join(P, "src"))) == ["app.py", "util.py"]
    assert sorted(os.listdir(os.path.join(P, "docs"))) == ["CHANGES.md", "README.md"]


def test_inbox_keeps_other_files():
    assert os.listdir("/home/user/inbox") == ["data.bin"]


def test_manifest():
    with open(os.path.join(P, "MANIFEST.txt"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert lines == ["docs/CHANGES.md", "docs/README.md", "src/app.py", "src/util.py"], lines


def test_app_executable():
    mode = os.stat(os.path.join(P, "src", "app.py")).st_mode
    assert mode & stat.S_IXUSR, "src/app.py is not executable"


def test_content_kept():
    with open(os.path.join(P, "src", "util.py"), encoding="utf-8") as f:
        assert "def greet(name):" in f.read()
