"""Dockerfile -> def conversion: every Harbor fixture converts; each construct is handled and built for real."""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path

import pytest

from et_hpc.errors import TaskError
from et_hpc.tasks.dockerfile import convert_dockerfile, parse_dockerfile
from et_hpc.tasks.loader import load_tasks
from et_hpc.tasks.recipe import normalise, parse_def_text

BASE = Path("/cache/base/ubuntu_22.04.sif")
BASE_MAP = {"ubuntu_22.04.sif": BASE, "./ubuntu_22.04.sif": BASE}


def _df(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "Dockerfile"
    p.write_text(text)
    return p


def _post(text: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index("%post -c /bin/bash")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("%")), len(lines))
    return lines[start + 1 : end]


def test_all_harbor_fixtures_convert(fixtures_dir: Path):
    tasks = load_tasks(fixtures_dir / "harbor").tasks
    assert len(tasks) == 20
    for t in tasks:
        n = normalise(t, base_map=BASE_MAP)
        d = parse_def_text(n.text, Path(f"{t.id}.def"))  # Apptainer would accept the sections
        assert d.bootstrap == "localimage" and d.from_ == str(BASE) and n.base == BASE
        assert n.kind == "dockerfile" and n.rewrites[0].startswith("FROM ubuntu:22.04 -> Bootstrap: localimage")
        n_run = sum(1 for i in parse_dockerfile(t.recipe.path.read_text(), t.recipe.path) if i.cmd == "RUN")
        assert sum(1 for ln in _post(n.text) if ln.startswith("# Dockerfile:") and ln.endswith(" RUN")) == n_run
    by_id = {t.id: normalise(t, base_map=BASE_MAP) for t in tasks}
    assert by_id["task_000000_3cf0f086"].user == "user" and by_id["task_000000_3cf0f086"].workdir == "/home/user"
    assert by_id["task_000000_41566988"].user == "1000"
    assert by_id["task_000000_1c8c96e7"].workdir is None
    assert by_id["task_000000_9c288622"].env == {"DEBIAN_FRONTEND": "noninteractive", "TZ": "Etc/UTC"}


def test_heredoc_run_kept_verbatim(fixtures_dir: Path):
    df = fixtures_dir / "harbor" / "task_000000_1c8c96e7" / "environment" / "Dockerfile"
    n = convert_dockerfile(df, base_map=BASE_MAP)
    post = "\n".join(_post(n.text))
    # the python file body, its indentation and the quoted terminator survive exactly
    assert "RUN_EOF'\ncat > /home/user/reports/generate.py << 'EOF'\n#!/usr/bin/env python3\nimport csv\n" in post
    assert "\n    data_dir = os.path.join(os.path.dirname(__file__), 'data')\n" in post
    assert "if __name__ == '__main__':\n    main()\nEOF\nET_HPC_RUN_EOF\n/bin/sh /.et-hpc-run.sh </dev/null" in post


def test_heredoc_forms(tmp_path: Path):
    p = _df(
        tmp_path,
        (
            "FROM ubuntu:22.04\n"
            "RUN <<EOF\necho one\necho two\nEOF\n"
            "RUN <<-EOT\n\techo tabbed\n\tEOT\n"
            "RUN <<'PY'\n#!/usr/bin/env python3\nprint('shebang')\nPY\n"
            "RUN python3 <<'PY' && echo after\nprint(1)\nPY\n"
            "RUN cat <<'EOF' > /x\n%percent line\nEOF\n"
            "RUN echo $((1<<2))\n"
        ),
    )
    n = convert_dockerfile(p, base_map=BASE_MAP)
    post = _post(n.text)
    text = "\n".join(post)
    assert "RUN_EOF'\necho one\necho two\nET_HPC_RUN_EOF\n/bin/sh /.et-hpc-run.sh" in text
    assert "RUN_EOF'\necho tabbed\nET_HPC_RUN_EOF" in text
    assert "print('shebang')\nET_HPC_RUN_EOF\nchmod 755 /.et-hpc-run.sh\n/.et-hpc-run.sh </dev/null" in text
    assert "RUN_EOF'\npython3 <<'PY' && echo after\nprint(1)\nPY\nET_HPC_RUN_EOF" in text
    # a line starting with % would end the section for Apptainer: that script travels as base64
    assert not any(ln.lstrip().startswith("%") for ln in post)
    b64 = next(ln for ln in post if ln.startswith("printf '%s' '"))
    assert base64.b64decode(b64.split("'")[3]).decode() == "cat <<'EOF' > /x\n%percent line\nEOF\n"
    assert "echo $((1<<2))" in text  # arithmetic shift is not a heredoc


def test_continuations_comments_and_env(tmp_path: Path):
    p = _df(
        tmp_path,
        (
            "# syntax=docker/dockerfile:1\n"
            "FROM ubuntu:22.04\n"
            "ARG VER=1.2\n"
            'ENV A=1 B="two words" C=${VER}-x\n'
            "ENV LEGACY some value\n"
            "RUN echo 'a \\\n"
            "# dropped comment\n"
            "    b' && \\\n"
            "    echo $A\n"
        ),
    )
    n = convert_dockerfile(p, base_map=BASE_MAP)
    post = _post(n.text)
    assert post.index("export VER=1.2") < post.index("export A=1") < post.index("export C=1.2-x")
    assert "export B='two words'" in post and "export LEGACY='some value'" in post
    assert "echo 'a     b' &&     echo $A" in post
    env = n.text.split("%environment\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert env == ["    export A=1", "    export B='two words'", "    export C=1.2-x", "    export LEGACY='some value'"]
    assert n.env == {"A": "1", "B": "two words", "C": "1.2-x", "LEGACY": "some value"}


def test_workdir_and_user(tmp_path: Path):
    p = _df(
        tmp_path,
        (
            "FROM ubuntu:22.04\nWORKDIR /opt/app\nRUN touch a\nWORKDIR sub\nUSER user\nRUN touch b\n"
            'USER root\nRUN touch c\nWORKDIR /home/user\nUSER user\nCMD ["/bin/bash"]\n'
        ),
    )
    n = convert_dockerfile(p, base_map=BASE_MAP)
    post = _post(n.text)
    i_w1 = post.index("mkdir -p /opt/app && cd /opt/app")
    i_w2 = post.index("mkdir -p /opt/app/sub && cd /opt/app/sub")
    runs = [ln for ln in post if ln.endswith("/.et-hpc-run.sh </dev/null")]
    assert runs == [
        "/bin/sh /.et-hpc-run.sh </dev/null",
        "et_hpc_as user /bin/sh /.et-hpc-run.sh </dev/null",
        "/bin/sh /.et-hpc-run.sh </dev/null",
    ]
    assert i_w1 < i_w2 < post.index(runs[1])
    assert n.workdir == "/home/user" and n.user == "user"
    assert "    et-hpc.workdir /home/user" in n.text and "    cd /home/user 2>/dev/null || true" in n.text


def test_copy_and_add(tmp_path: Path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "a.ini").write_text("a=1\n")
    (tmp_path / "one.txt").write_text("one\n")
    p = _df(tmp_path, ("FROM ubuntu:22.04\nWORKDIR /srv\nCOPY conf/ etc/\nCOPY --chown=user:user one.txt /opt/one.txt\nADD *.txt /drop/\n"))
    n = convert_dockerfile(p, base_map=BASE_MAP)
    assert n.files == [
        (tmp_path / "conf", "/.et-hpc-copy/1"),
        (tmp_path / "one.txt", "/.et-hpc-copy/2"),
        (tmp_path / "one.txt", "/.et-hpc-copy/3"),
    ]
    post = _post(n.text)
    assert "mkdir -p /srv/etc && cp -a /.et-hpc-copy/1/. /srv/etc/" in post
    assert "chown -R user:user /opt/one.txt" in post
    assert "mkdir -p /drop/ && cp -a /.et-hpc-copy/3 /drop/one.txt" in post
    assert f"    {tmp_path / 'conf'} /.et-hpc-copy/1" in n.text.split("%files\n", 1)[1]


@pytest.mark.parametrize(
    "body, match",
    [
        ("FROM ubuntu:22.04\nCOPY missing.txt /x\n", r"Dockerfile:2: COPY source 'missing.txt' not found"),
        ("FROM ubuntu:22.04\nCOPY --from=builder /a /b\n", "another stage"),
        ("FROM ubuntu:22.04\nADD https://example.org/x.tgz /x\n", "offline"),
        ("FROM ubuntu:22.04 AS a\nRUN true\nFROM ubuntu:22.04\n", r"Dockerfile:3: FROM again: multi-stage"),
        ("FROM ubuntu:22.04\nFOO bar\n", r"Dockerfile:2: FOO is not a Dockerfile instruction"),
        ("RUN true\nFROM ubuntu:22.04\n", "before FROM"),
        ("# just a comment\n", "no instructions"),
    ],
)
def test_dockerfile_errors(tmp_path: Path, body: str, match: str):
    with pytest.raises(TaskError, match=match):
        convert_dockerfile(_df(tmp_path, body), base_map=BASE_MAP)


def test_unknown_from_stays_docker(tmp_path: Path):
    n = convert_dockerfile(_df(tmp_path, "FROM python:3.11-slim\nRUN true\n"), base_map=BASE_MAP)
    assert n.text.startswith("Bootstrap: docker\nFrom: python:3.11-slim\n") and n.base is None
    assert "needs a registry" in n.rewrites[0]


# -- real build: the converted def behaves like docker build -----------------------------------

DOCKERFILE = r"""FROM ubuntu:22.04
ARG GREETING=hello
ENV APP_HOME=/opt/app MODE="fast mode"
WORKDIR $APP_HOME
RUN <<EOF
echo "$GREETING from $(pwd)" > greeting.txt
echo "a\tb" > echo.txt
EOF
RUN cat > script.py <<'PY'
%notasection = 1
print("ok")
PY
COPY data/ data/
COPY one.txt /opt/app/copied.txt
RUN mkdir -p sub && chmod 777 /opt/app
WORKDIR sub
RUN pwd > /opt/app/where.txt && cd / && echo "cd does not leak"
RUN pwd > /opt/app/where2.txt
USER nobody
RUN id -u > /opt/app/uid.txt
USER root
RUN id -u > /opt/app/uid_root.txt
WORKDIR /home/user
CMD ["/bin/bash"]
"""


@pytest.mark.apptainer
def test_converted_dockerfile_builds(base_sif: Path, tmp_path: Path):
    ctx = tmp_path / "environment"
    (ctx / "data").mkdir(parents=True)
    (ctx / "data" / "d.txt").write_text("data file\n")
    (ctx / "one.txt").write_text("one\n")
    (ctx / "Dockerfile").write_text(DOCKERFILE)
    n = convert_dockerfile(ctx / "Dockerfile", base_map={"ubuntu_22.04.sif": base_sif})
    (tmp_path / "img.def").write_text(n.text)
    sif = tmp_path / "img.sif"
    r = subprocess.run(
        ["apptainer", "build", "--fakeroot", str(sif), str(tmp_path / "img.def")], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    def cat(path: str) -> str:
        out = subprocess.run(["apptainer", "exec", "--containall", str(sif), "cat", path], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert cat("/opt/app/greeting.txt") == "hello from /opt/app\n"
    assert cat("/opt/app/echo.txt") == "a\tb\n"  # /bin/sh (dash) echo, as docker's RUN
    assert cat("/opt/app/script.py") == '%notasection = 1\nprint("ok")\n'
    assert cat("/opt/app/data/d.txt") == "data file\n" and cat("/opt/app/copied.txt") == "one\n"
    assert cat("/opt/app/where.txt") == "/opt/app/sub\n" and cat("/opt/app/where2.txt") == "/opt/app/sub\n"
    assert cat("/opt/app/uid.txt") == "65534\n" and cat("/opt/app/uid_root.txt") == "0\n"
    env = subprocess.run(
        ["apptainer", "exec", "--containall", "--cleanenv", str(sif), "sh", "-c", 'echo "$MODE|$APP_HOME"'],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert env.stdout == "fast mode|/opt/app\n"
    gone = subprocess.run(
        ["apptainer", "exec", "--containall", str(sif), "ls", "/.et-hpc-run.sh", "/.et-hpc-copy"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert gone.returncode != 0  # build scaffolding removed
