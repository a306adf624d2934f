"""Harbor tasks: turn an ``environment/Dockerfile`` into an Apptainer def (a ``NormalisedRecipe``).

``convert_dockerfile(path, context_dir=..., base_map=...)`` returns a def built rootless from the
cached base image, offline, that behaves like ``docker build``: ``FROM`` a base the map knows
becomes ``Bootstrap: localimage``; each ``RUN`` runs in its own shell in the current ``WORKDIR``
as the current ``USER`` with ``ENV``/``ARG`` set (heredocs and continuations kept exactly);
``COPY``/``ADD`` from the build context are staged through ``%files`` and copied in place, in
order; ``CMD``/``ENTRYPOINT`` become ``%runscript``. Every change is a line in ``rewrites``; what
cannot be built as written raises ``TaskError`` naming the file and line. Each instruction's
rules are beside ``_Converter`` (spython's converter changes continued lines and shares a shell).
"""

from __future__ import annotations

import base64
import glob as globmod
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from et_hpc.errors import TaskError
from et_hpc.tasks.base_names import lookup_base
from et_hpc.tasks.files import read_text
from et_hpc.tasks.model import NormalisedRecipe, PostSpans

RUN_FILE = "/.et-hpc-run.sh"
STAGE_DIR = "/.et-hpc-copy"
IGNORED = {"EXPOSE", "VOLUME", "STOPSIGNAL", "HEALTHCHECK", "ONBUILD"}
KNOWN = {"FROM", "RUN", "CMD", "ENTRYPOINT", "ENV", "ARG", "WORKDIR", "USER", "COPY", "ADD", "LABEL", "SHELL", "MAINTAINER"} | IGNORED
_HEREDOC_RE = re.compile(r"(?<!<)<<(?!<)(-?)\s*(?:'([^']+)'|\"([^\"]+)\"|([A-Za-z_][A-Za-z0-9_.-]*))")
_VAR_RE = re.compile(r"\\\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:[-+])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


@dataclass
class Heredoc:
    delimiter: str
    strip_tabs: bool
    body: list[str]  # lines between the instruction and the terminator
    raw: list[str]  # body lines plus the terminator line, as written


@dataclass
class Instruction:
    cmd: str  # upper case
    args: str  # the logical line after the keyword (continuations joined, heredoc bodies excluded)
    line: int  # 1-based line of the keyword
    heredocs: list[Heredoc] = field(default_factory=list)


def parse_dockerfile(text: str, path: Path) -> list[Instruction]:
    """Split a Dockerfile into instructions: comments dropped, continuations joined, heredocs read."""
    lines = text.splitlines()
    escape = "\\"
    i = 0
    # parser directives: only at the very top, before any other line
    while i < len(lines):
        m = re.match(r"^#\s*([a-zA-Z]+)\s*=\s*(\S+)\s*$", lines[i])
        if not m:
            break
        if m.group(1).lower() == "escape" and m.group(2) in ("\\", "`"):
            escape = m.group(2)
        i += 1
    out: list[Instruction] = []
    while i < len(lines):
        line = lines[i]
        s = line.strip()
        if not s or s.startswith("#"):
            i += 1
            continue
        start = i
        m = re.match(r"^\s*([A-Za-z]+)(\s+|$)(.*)$", line)
        if not m:
            raise TaskError(f"{path}:{i + 1}: cannot parse {s[:60]!r}; expected an instruction such as RUN")
        cmd, text_ = m.group(1).upper(), m.group(3)
        while text_.rstrip().endswith(escape):
            text_ = text_.rstrip()[: -len(escape)]
            i += 1
            while i < len(lines) and (lines[i].strip().startswith("#") or not lines[i].strip()):
                i += 1  # comment and empty lines inside a continuation are dropped, as docker does
            if i >= len(lines):
                break
            text_ += lines[i]
        i += 1
        ins = Instruction(cmd=cmd, args=text_.strip(), line=start + 1)
        if cmd in ("RUN", "COPY", "ADD"):
            for hm in _HEREDOC_RE.finditer(ins.args):
                delim = hm.group(2) or hm.group(3) or hm.group(4)
                strip = hm.group(1) == "-"
                body: list[str] = []
                j = i
                while j < len(lines):
                    cand = lines[j].lstrip("\t") if strip else lines[j]
                    if cand == delim:
                        break
                    body.append(lines[j])
                    j += 1
                if j >= len(lines):
                    continue  # no terminator: not a heredoc (e.g. '<<' inside arithmetic)
                ins.heredocs.append(Heredoc(delim, strip, body, lines[i : j + 1]))
                i = j + 1
        out.append(ins)
    return out


def substitute(s: str, env: dict[str, str]) -> str:
    """Docker-style ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR:+alt}`` substitution."""

    def rep(m: re.Match) -> str:
        if m.group(0) == "\\$":
            return "$"
        name = m.group(1) or m.group(4)
        val = env.get(name, "")
        op = m.group(2)
        if op == ":-":
            return val or m.group(3)
        if op == ":+":
            return m.group(3) if val else ""
        return val

    return _VAR_RE.sub(rep, s)


def _json_list(args: str) -> list[str] | None:
    a = args.strip()
    if not a.startswith("["):
        return None
    try:
        v = json.loads(a)
    except json.JSONDecodeError:
        return None
    return [str(x) for x in v] if isinstance(v, list) else None


def _delimiter(lines: list[str], base: str) -> str:
    d, n = base, 0
    while any(ln.strip() == d for ln in lines):
        n += 1
        d = f"{base}_{n}"
    return d


def _needs_b64(lines: list[str]) -> bool:
    # Apptainer reads any line starting with '%' as a section header, even inside a heredoc.
    return any(ln.lstrip().startswith("%") for ln in lines)


def files_line(host: Path, dest: str) -> str:
    """The ``%files`` line that copies ``host`` to ``dest`` (the whole def's and a step build's)."""
    return f"    {shlex.quote(str(host))} {shlex.quote(dest)}"


def write_file_lines(dest: str, content: str, tag: str) -> list[str]:
    """Shell lines for %post that write ``content`` to ``dest`` exactly."""
    body = content.split("\n")
    if _needs_b64(body):
        b64 = base64.b64encode(content.encode()).decode()
        return [f"printf '%s' '{b64}' | base64 -d > {shlex.quote(dest)}"]
    if content.endswith("\n"):
        body = body[:-1]
        delim = _delimiter(body, f"ET_HPC_{tag}_EOF")
        return [f"cat > {shlex.quote(dest)} <<'{delim}'", *body, delim]
    delim = _delimiter(body, f"ET_HPC_{tag}_EOF")
    return [f"cat <<'{delim}' | head -c -1 > {shlex.quote(dest)}", *body, "", delim]


def _parse_kv(args: str, path: Path, line: int, what: str) -> list[tuple[str, str]]:
    try:
        toks = shlex.split(args, posix=True)
    except ValueError as e:
        raise TaskError(f"{path}:{line}: cannot parse {what} ({e}); check its quotes") from None
    if not toks:
        raise TaskError(f"{path}:{line}: {what} without arguments; remove it or add KEY=value")
    if "=" not in toks[0]:  # legacy "ENV KEY value with spaces"
        rest = args.strip()[len(args.strip().split(None, 1)[0]) :].strip()
        try:
            val = " ".join(shlex.split(rest)) if rest else ""
        except ValueError:
            val = rest
        return [(toks[0], val)]
    pairs = []
    for t in toks:
        if "=" not in t:
            raise TaskError(f"{path}:{line}: {what} item {t!r} is not KEY=value; fix it")
        k, v = t.split("=", 1)
        pairs.append((k, v))
    return pairs


# How each instruction is built:
# - FROM ubuntu:22.04 -> Bootstrap: localimage on the base-map entry (the same SIF that
#   ./ubuntu_22.04.sif names); an image the map does not know stays Bootstrap: docker.
# - each RUN runs in its own /bin/sh (or the SHELL set), in the current WORKDIR, as the current
#   USER, with ENV/ARG exported; a failing RUN fails the build. BuildKit heredocs (RUN <<EOF and
#   RUN cat <<'EOF' > f) and line continuations are kept exactly; the script text goes through a
#   quoted heredoc (or base64 when a line would look like a def section to Apptainer).
# - WORKDIR -> mkdir -p + cd for later steps, and the runtime cwd (workdir).
# - ENV -> exported for later steps and written to %environment.
# - COPY/ADD from the build context -> %files into a staging dir, then copied into place at the
#   same point of the build (so ordering with RUN is kept); sources must exist.
# - USER -> later RUN steps use setpriv; the runtime user is recorded (user).
# - CMD/ENTRYPOINT -> %runscript; LABEL -> %labels; EXPOSE and friends are ignored (and said so
#   in rewrites).
# spython's converter was tried first: it strips the indentation of continued lines (changing
# quoted strings), ignores WORKDIR for later RUN steps and runs every step in one shell, so this
# module parses the Dockerfile itself.
class _Converter:
    def __init__(self, path: Path, context: Path, base_map: dict[str, Path]):
        self.path = path
        self.context = context
        self.base_map = base_map
        self.header: list[str] = []
        self.post: list[str] = []
        self.env_lines: list[str] = []
        self.labels: list[str] = []
        self.files: list[tuple[Path, str]] = []
        self.rewrites: list[str] = []
        self.base: Path | None = None
        self.env: dict[str, str] = {}  # ENV (runtime + build)
        self.args: dict[str, str] = {}  # ARG (build only)
        self.workdir = "/"
        self.workdir_set = False
        self.user = "root"
        self.shell = ["/bin/sh", "-c"]
        self.cmd: list[str] | str | None = None
        self.entrypoint: list[str] | str | None = None
        self.seen_from = False
        self.n_copy = 0
        self.uses_as = False
        self.ignored: dict[str, int] = {}

    def err(self, ins: Instruction, msg: str) -> TaskError:
        return TaskError(f"{self.path}:{ins.line}: {ins.cmd} {msg}")

    def vars(self) -> dict[str, str]:
        return {**self.args, **self.env}

    def abs_dest(self, p: str) -> str:
        return str(PurePosixPath(self.workdir) / p) if not p.startswith("/") else p

    # -- instructions -------------------------------------------------------------------------
    def do_FROM(self, ins: Instruction) -> None:
        if self.seen_from:
            raise self.err(ins, "again: multi-stage Dockerfiles are not supported; flatten it to one stage")
        self.seen_from = True
        toks = [t for t in ins.args.split() if not t.startswith("--")]
        if not toks:
            raise self.err(ins, "without an image; name one, e.g. FROM ubuntu:22.04")
        if len(toks) not in (1, 3) or (len(toks) == 3 and toks[1].lower() != "as"):
            raise self.err(ins, f"{ins.args.strip()[:60]!r} is not 'IMAGE' or 'IMAGE AS NAME'; fix the line")
        image = substitute(toks[0], self.args)
        found = lookup_base(image, self.base_map)
        if found is not None:
            self.base = found
            self.header = ["Bootstrap: localimage", f"From: {found}"]
            self.rewrites.append(f"FROM {image} -> Bootstrap: localimage / From: {found} (cached base)")
        else:
            self.header = ["Bootstrap: docker", f"From: {image}"]
            self.rewrites.append(f"FROM {image} -> Bootstrap: docker (not in the base map: the build needs a registry)")

    def do_ARG(self, ins: Instruction) -> None:
        for k, v in _parse_kv(ins.args, self.path, ins.line, "ARG") if "=" in ins.args else [(t, None) for t in ins.args.split()]:
            if v is None:
                self.args.setdefault(k, "")
                continue
            v = substitute(v, self.vars())
            self.args[k] = v
            if self.seen_from:
                self.post.append(f"export {k}={shlex.quote(v)}")

    def do_ENV(self, ins: Instruction) -> None:
        for k, v in _parse_kv(ins.args, self.path, ins.line, "ENV"):
            v = substitute(v, self.vars())
            self.env[k] = v
            self.post.append(f"export {k}={shlex.quote(v)}")
            self.env_lines.append(f"export {k}={shlex.quote(v)}")

    def do_WORKDIR(self, ins: Instruction) -> None:
        d = substitute(ins.args.strip().strip('"').strip("'"), self.vars())
        if not d:
            raise self.err(ins, "without a directory; name one")
        self.workdir = str(PurePosixPath(self.workdir) / d)
        self.workdir_set = True
        q = shlex.quote(self.workdir)
        self.post.append(f"mkdir -p {q} && cd {q}")

    def do_USER(self, ins: Instruction) -> None:
        u = substitute(ins.args.strip(), self.vars())
        if not u:
            raise self.err(ins, "without a user; name one")
        self.user = u

    def do_SHELL(self, ins: Instruction) -> None:
        v = _json_list(ins.args)
        if not v:
            raise self.err(ins, 'needs the JSON form, e.g. SHELL ["/bin/bash", "-c"]')
        self.shell = v
        self.rewrites.append(f"line {ins.line}: SHELL {' '.join(v)}: later RUN steps use it")

    def do_LABEL(self, ins: Instruction) -> None:
        for k, v in _parse_kv(ins.args, self.path, ins.line, "LABEL"):
            self.labels.append(f"{k} {v}")

    def do_MAINTAINER(self, ins: Instruction) -> None:
        self.labels.append(f"maintainer {ins.args.strip()}")

    def do_CMD(self, ins: Instruction) -> None:
        self.cmd = _json_list(ins.args) or ins.args.strip()

    def do_ENTRYPOINT(self, ins: Instruction) -> None:
        self.entrypoint = _json_list(ins.args) or ins.args.strip()

    def _run_prefix(self) -> list[str]:
        if self.user in ("root", "0", "0:0", "root:root"):
            return []
        self.uses_as = True
        return ["et_hpc_as", self.user]

    def do_RUN(self, ins: Instruction) -> None:
        args = ins.args
        flags = []
        while args.startswith("--"):
            flag, _, args = args.partition(" ")
            flags.append(flag)
            args = args.lstrip()
        if any(f.startswith("--mount") for f in flags):
            self.rewrites.append(f"line {ins.line}: RUN {' '.join(flags)} ignored (no BuildKit mounts)")
        execform = _json_list(args)
        shebang = False
        if execform is not None:
            script = shlex.join(execform) + "\n"
        elif ins.heredocs and not _HEREDOC_RE.sub("", args).strip():
            hd = ins.heredocs[0]  # RUN <<EOF ... EOF: the body is the script
            body = [ln.lstrip("\t") for ln in hd.body] if hd.strip_tabs else hd.body
            script = "\n".join(body) + "\n"
            shebang = bool(body) and body[0].startswith("#!")
        else:
            extra = [ln for hd in ins.heredocs for ln in hd.raw]
            script = "\n".join([args, *extra]) + "\n"
        self.post.append(f"# {self.path.name}:{ins.line} RUN")
        self.post += write_file_lines(RUN_FILE, script, "RUN")
        prefix = self._run_prefix()
        if shebang:
            run = [*prefix, RUN_FILE]
            self.post.append(f"chmod 755 {RUN_FILE}")
        else:
            sh = list(self.shell)
            if sh and sh[-1] in ("-c", "/c", "-Command"):
                sh = sh[:-1]
            run = [*prefix, *sh, RUN_FILE]
        self.post.append(" ".join(shlex.quote(x) if x != "et_hpc_as" else x for x in run) + " </dev/null")

    def do_COPY(self, ins: Instruction) -> None:
        self._copy(ins, add=False)

    def do_ADD(self, ins: Instruction) -> None:
        self._copy(ins, add=True)

    def _copy(self, ins: Instruction, add: bool) -> None:
        """``COPY``/``ADD``: heredoc bodies written in place, build-context sources staged through
        ``%files`` and copied (``ADD`` unpacks tar archives), then ``--chown``/``--chmod``."""
        args, chown, chmod = self._copy_flags(ins)
        items = self._copy_items(ins, args)
        dest = self.abs_dest(items[-1])
        srcs = items[:-1]
        q = shlex.quote(dest)
        self.post.append(f"# {self.path.name}:{ins.line} {ins.cmd}")
        heredoc_names = {hd.delimiter for hd in ins.heredocs}
        for hd in ins.heredocs:  # COPY <<EOF /dest: the body becomes the file
            body = [ln.lstrip("\t") for ln in hd.body] if hd.strip_tabs else hd.body
            target = dest if not dest.endswith("/") else dest + hd.delimiter
            self.post.append(f"mkdir -p {shlex.quote(str(PurePosixPath(target).parent))}")
            self.post += write_file_lines(target, "\n".join(body) + "\n", "COPY")
        srcs = [s for s in srcs if not (s.startswith("<<") and s.lstrip("<-").strip("'\"") in heredoc_names)]
        hosts = [h for s in srcs for h in self._context_sources(ins, s)]
        many = len(hosts) > 1 or dest.endswith("/")
        for h in hosts:
            self._copy_staged(h, dest, add=add, many=many)
        if chown:
            self.post.append(f"chown -R {shlex.quote(chown)} {q}")
        if chmod:
            self.post.append(f"chmod -R {shlex.quote(chmod)} {q}")

    def _copy_flags(self, ins: Instruction) -> tuple[str, str | None, str | None]:
        """The arguments after the ``--`` flags, and the ``--chown`` (substituted) and ``--chmod``
        values; ``--from`` is refused (only the build context is there)."""
        args = ins.args
        chown = chmod = None
        while args.startswith("--"):
            flag, _, args = args.partition(" ")
            args = args.lstrip()
            name, _, val = flag[2:].partition("=")
            if name == "from":
                raise self.err(ins, f"{flag}: copying from another stage or image is not supported; copy from the build context")
            if name == "chown":
                chown = substitute(val, self.vars())
            elif name == "chmod":
                chmod = val
        return args, chown, chmod

    def _copy_items(self, ins: Instruction, args: str) -> list[str]:
        """The sources and the destination (last), JSON or shell form, with variables substituted."""
        items = _json_list(args)
        if items is None:
            try:
                items = shlex.split(args)
            except ValueError as e:
                raise self.err(ins, f"cannot be parsed ({e}); check its quotes") from None
        if len(items) < 2 and not ins.heredocs:
            raise self.err(ins, "needs a source and a destination")
        return [substitute(x, self.vars()) for x in items]

    def _context_sources(self, ins: Instruction, s: str) -> list[Path]:
        """The existing files the source ``s`` names in the build context (a glob sorted); an URL,
        no match or a path outside the context is an error."""
        if re.match(r"^[a-z]+://", s):
            raise self.err(ins, f"{s}: downloading at build time is not supported offline; put the file in the build context")
        pattern = str(self.context / s.lstrip("/"))
        matches = sorted(Path(p) for p in globmod.glob(pattern)) if any(c in s for c in "*?[") else [Path(pattern)]
        matches = [m for m in matches if m.exists()]
        if not matches:
            raise self.err(ins, f"source {s!r} not found in the build context {self.context}; add it there")
        out = []
        for m in matches:
            mr = m.resolve()
            if self.context.resolve() not in (mr, *mr.parents):
                raise self.err(ins, f"source {s!r} is outside the build context {self.context}")
            out.append(mr)
        return out

    def _copy_staged(self, h: Path, dest: str, *, add: bool, many: bool) -> None:
        """Stage ``h`` through ``%files`` and copy it to ``dest`` as docker does: a directory's
        content, an archive unpacked (``ADD``), into ``dest`` as a directory (``many``), or as
        ``dest`` itself unless that is an existing directory."""
        q = shlex.quote(dest)
        self.n_copy += 1
        stage = f"{STAGE_DIR}/{self.n_copy}"
        self.files.append((h, stage))
        sq = shlex.quote(stage)
        if h.is_dir():
            self.post.append(f"mkdir -p {q} && cp -a {sq}/. {q}/")
        elif add and re.search(r"\.(tar|tar\.gz|tgz|tar\.bz2|tbz2|tar\.xz|txz)$", h.name):
            self.post.append(f"mkdir -p {q} && tar -xf {sq} -C {q}")
        elif many:
            self.post.append(f"mkdir -p {q} && cp -a {sq} {shlex.quote(dest.rstrip('/') + '/' + h.name)}")
        else:
            self.post.append(
                f"if [ -d {q} ]; then cp -a {sq} {shlex.quote(dest.rstrip('/') + '/' + h.name)}; "
                f"else mkdir -p {shlex.quote(str(PurePosixPath(dest).parent))} && cp -a {sq} {q}; fi"
            )

    # -- output -------------------------------------------------------------------------------
    def runscript(self) -> list[str]:
        def form(v: list[str] | str | None) -> str:
            if v is None:
                return ""
            return shlex.join(v) if isinstance(v, list) else f"/bin/sh -c {shlex.quote(v)}"

        lines = []
        if self.workdir_set:
            lines.append(f"cd {shlex.quote(self.workdir)} 2>/dev/null || true")
        ep, cmd = form(self.entrypoint), form(self.cmd)
        if ep:
            lines.append(f'if [ "$#" -gt 0 ]; then exec {ep} "$@"; fi')
            lines.append(f"exec {ep} {cmd}".rstrip())
        else:
            lines.append('if [ "$#" -gt 0 ]; then exec "$@"; fi')
            lines.append(f"exec {cmd or '/bin/bash'}")
        return lines

    def preamble(self) -> list[str]:
        """The first lines of %post: what every RUN's shell relies on (and every step of a step build)."""
        out = [
            f"# converted by et-hpc from {self.path}; each RUN runs in its own shell, like docker build",
            "set -e",
            "cd /",
        ]
        if self.uses_as:
            out += [
                "et_hpc_as() {  # run a command as a Dockerfile USER (name, uid, or user:group)",
                '    local spec="$1"; shift',
                '    local u="${spec%%:*}" g=""; [ "$spec" != "$u" ] && g="${spec#*:}"',
                "    local uid gid home",
                '    uid=$(id -u "$u" 2>/dev/null || echo "$u")',
                '    if [ -n "$g" ]; then gid=$(getent group "$g" | cut -d: -f3); gid=${gid:-$g};',
                '    else gid=$(id -g "$u" 2>/dev/null || echo "$uid"); fi',
                '    home=$(getent passwd "$uid" | cut -d: -f6); home=${home:-/}',
                '    HOME="$home" setpriv --reuid="$uid" --regid="$gid" --clear-groups "$@"',
                "}",
            ]
        return out

    def epilogue(self) -> list[str]:
        return [f"rm -rf {RUN_FILE} {STAGE_DIR}"]

    def render(self) -> str:
        out = [*self.header, ""]
        if self.files:
            out.append("%files")
            out += [files_line(h, d) for h, d in self.files]
            out.append("")
        out.append("%post -c /bin/bash")
        out += self.preamble()
        out += self.post
        out += self.epilogue()
        out.append("")
        if self.env_lines:
            out.append("%environment")
            out += ["    " + ln for ln in self.env_lines]
            out.append("")
        labels = list(self.labels)
        if self.workdir_set:
            labels.append(f"et-hpc.workdir {self.workdir}")
        if self.user not in ("root", "0"):
            labels.append(f"et-hpc.user {self.user}")
        if labels:
            out.append("%labels")
            out += ["    " + ln for ln in labels]
            out.append("")
        out.append("%runscript")
        out += ["    " + ln for ln in self.runscript()]
        return "\n".join(out) + "\n"


def convert_dockerfile(path: Path, *, context_dir: Path | None = None, base_map: dict[str, Path]) -> NormalisedRecipe:
    """Convert a Dockerfile into a def to build; ``TaskError`` names the file and line of any problem."""
    path = Path(path).resolve()
    context = Path(context_dir).resolve() if context_dir else path.parent
    text = read_text(path, "Dockerfile")
    conv = _Converter(path, context, base_map)
    instructions = parse_dockerfile(text, path)
    if not instructions:
        raise TaskError(f"{path}: no instructions; start it with FROM ubuntu:22.04")
    spans: list[tuple[str, list[str], list[tuple[Path, str]]]] = []
    for ins in instructions:
        if ins.cmd not in KNOWN:
            raise conv.err(ins, f"is not a Dockerfile instruction et-hpc knows; known: {', '.join(sorted(KNOWN))}")
        if not conv.seen_from and ins.cmd not in ("FROM", "ARG"):
            raise conv.err(ins, "before FROM; the Dockerfile must start with FROM")
        if ins.cmd in IGNORED:
            conv.ignored[ins.cmd] = conv.ignored.get(ins.cmd, 0) + 1
            continue
        n_post, n_files = len(conv.post), len(conv.files)
        getattr(conv, f"do_{ins.cmd}")(ins)
        if len(conv.post) > n_post:
            kind = {"ENV": "env", "ARG": "env", "WORKDIR": "workdir"}.get(ins.cmd, "step")
            spans.append((kind, conv.post[n_post:], conv.files[n_files:]))
    n_run = sum(1 for i in instructions if i.cmd == "RUN")
    conv.rewrites.insert(
        0 if not conv.rewrites else 1,
        f"{path.name}: {len(instructions)} instructions ({n_run} RUN) -> %post -c /bin/bash, one shell per RUN",
    )
    if conv.env:
        conv.rewrites.append(f"ENV {', '.join(conv.env)} -> exported in %post and %environment")
    if conv.workdir_set:
        conv.rewrites.append(f"WORKDIR: runtime cwd {conv.workdir} (label et-hpc.workdir, %runscript cd)")
    if conv.user not in ("root", "0"):
        conv.rewrites.append(f"USER {conv.user}: later RUN steps run through setpriv; at run time the invoking user runs the task")
    if conv.files:
        conv.rewrites.append(f"COPY/ADD: {len(conv.files)} context path(s) -> %files into {STAGE_DIR}, copied in order")
    for k, n in sorted(conv.ignored.items()):
        conv.rewrites.append(f"{k} ignored ({n}x): no meaning for an Apptainer image")
    if conv.cmd is not None or conv.entrypoint is not None:
        conv.rewrites.append("CMD/ENTRYPOINT -> %runscript")
    return NormalisedRecipe(
        text=conv.render(),
        files=conv.files,
        base=conv.base,
        rewrites=conv.rewrites,
        kind="dockerfile",
        source=path,
        workdir=conv.workdir if conv.workdir_set else None,
        user=None if conv.user in ("root", "0") else conv.user,
        env=dict(conv.env),
        post_spans=PostSpans(preamble=conv.preamble(), spans=spans, epilogue=conv.epilogue()),
    )
