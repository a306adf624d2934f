"""The scoring entry helper's view part: the tests' root built from the agent's final state.

``runtime_view(pristine, avoid, notes)`` turns ``/`` of scoring's private mount namespace into a
new root (``pivot_root``) on a tmpfs: bind mounts of every entry of the agent's ``/``, ``/usr``
and ``/etc`` (never opened or read), except the loader's and libc's runtime files (``/lib*``,
``/usr/lib*``, ``/etc/ld.so.*``, ``nsswitch.conf``), which are the pristine image's. An entry that
cannot be shown raises ``Refused``; a failure of ours raises ``Infra``. ``usable_dir`` says why a
directory is not one the agent's uid can use. Runs inside the helper program after
``enter_sys`` (``et_hpc.scoring.enter.helper_argv``; docs/sandbox.md, step 4).
"""

import os

if __spec__ is not None:  # imported; in the helper program every part shares one namespace
    from et_hpc.scoring.enter_sys import MS_BIND, MS_NODEV, MS_NOSUID, MS_REC, STAGES, Infra, Refused, check, libc, mount

MNT_DETACH = 2
LIB_NAMES = ("lib", "lib32", "lib64", "libx32")  # at / and in /usr: the loader's default dirs
ETC_RUNTIME = ("ld.so.preload", "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "nsswitch.conf")
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
VIEW_DIRS = ("mnt", "media", "srv", "opt", "run", "tmp")  # in the pristine tree, first free one


def _agent_state(what: str, e: Exception) -> Refused:
    return Refused(f"the state left cannot be mapped for the tests: {what} ({getattr(e, 'strerror', None) or e})")


def _place(src: str, st: os.stat_result, dst: str) -> None:
    """``dst`` (in the view) shows ``src``: the same symlink, or a bind mount of the object itself
    (a directory recursively, with what is mounted below it)."""
    import stat as _st

    if _st.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
        return
    if _st.S_ISDIR(st.st_mode):
        os.mkdir(dst, 0o755)
        mount(src, dst, None, MS_BIND | MS_REC)
    else:
        os.close(os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        mount(src, dst, None, MS_BIND)


def _mirror(src_dir: str, dst: str, skip: tuple[str, ...], owner: str) -> int:
    """Every entry of the directory the path ``src_dir`` leads to, placed in ``dst`` (see
    ``_place``), except the names in ``skip``. ``owner`` names whose state it is (for the error);
    anything that cannot be read or placed is the state's failure (Refused). Entries are never
    opened or read: only their type decides how they are shown (a symlink is copied, anything
    else is bound), so every path shows the tests what it showed the agent."""
    try:
        names = os.listdir(src_dir)
    except OSError as e:
        raise _agent_state(f"{owner}{src_dir} cannot be listed", e) from None
    n = 0
    for name in names:
        if name in skip:
            continue
        src = os.path.join(src_dir, name)
        try:
            _place(src, os.lstat(src), os.path.join(dst, name))
        except (OSError, ValueError) as e:  # ValueError: a name no system call takes (never one listed)
            raise _agent_state(f"{owner}{src!r} cannot be shown to the tests", e) from None
        n += 1
    return n


def _pristine_entries(pristine: str, rel: str, names: tuple[str, ...], dst: str) -> None:
    """The pristine tree's own ``rel/name`` for each name it has, placed in ``dst`` (Infra on error)."""
    for name in names:
        src = f"{pristine}{rel}/{name}"
        try:
            st = os.lstat(src)
        except FileNotFoundError:
            continue
        except OSError as e:
            raise Infra(f"the pristine tree cannot be read: {src}: {e.strerror}") from None
        try:
            _place(src, st, os.path.join(dst, name))
        except OSError as e:
            raise Infra(f"could not place the pristine {src} in the tests' root: {e}") from None


def _dir_like(src: str, dst: str) -> None:
    """A fresh directory in the view with the mode and owner of the agent's directory ``src``
    (a directory the agent's path leads to; 0755 and ours if it leads to none)."""
    os.mkdir(dst, 0o755)
    try:
        st = os.stat(src)
    except OSError:
        return
    import stat as _st

    if _st.S_ISDIR(st.st_mode):
        os.chmod(dst, _st.S_IMODE(st.st_mode))
        try:
            os.chown(dst, st.st_uid, st.st_gid)
        except OSError:
            pass  # an owner not mapped in the instance's user namespace: ours it stays


def runtime_view(pristine: str, avoid: str, notes: list[str]) -> None:
    """Step 4 of docs/sandbox.md ("Scoring entry"): make ``/`` (of scoring's private mount namespace) a new root that
    shows the agent's final state everywhere, except that what the dynamic loader and libc read
    from the root is the pristine image's, unconditionally: ``/lib*``, ``/usr/lib*`` (the default
    library dirs with gconv and locales) and ``/etc``'s ``ld.so.preload``, ``ld.so.cache``,
    ``ld.so.conf*`` and ``nsswitch.conf`` (absent when the image has none). Nothing of the agent's
    is read to decide this; its state itself is untouched (the new root is only bind mounts of it).
    """
    view = None
    for d in VIEW_DIRS:
        cand = f"{pristine}/{d}"
        if d != avoid and os.path.isdir(cand) and not os.path.islink(cand):
            view = cand
            break
    if view is None:
        raise Infra(f"no directory to build the tests' root on in {pristine}")
    try:
        mount("et-root", view, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m,mode=0755")
        # the pristine tree first, while the view is empty; the copy of the view itself it
        # brings along (the view is mounted in it) is dropped
        os.makedirs(view + pristine, 0o755)
        mount(pristine, view + pristine, None, MS_BIND | MS_REC)
        check(libc.umount2((view + view).encode(), MNT_DETACH), "umount the view's copy")
    except OSError as e:
        raise Infra(f"could not build the tests' root: {e}") from None
    skip_top = (*LIB_NAMES, "usr", "etc", pristine.strip("/"))
    n = _mirror("/", view, skip_top, "")
    try:
        _dir_like("/usr", view + "/usr")
        _dir_like("/etc", view + "/etc")
    except OSError as e:
        raise Infra(f"could not build the tests' root: {e}") from None
    import stat as _st

    for d, skip in (("/usr", LIB_NAMES), ("/etc", ETC_RUNTIME)):
        try:
            is_dir = _st.S_ISDIR(os.stat(d).st_mode)
        except OSError:
            is_dir = False
        if is_dir:
            n += _mirror(d, view + d, skip, "")
        else:
            notes.append(f"{d} is not a directory: the tests saw only the image's runtime files there")
    _pristine_entries(pristine, "", LIB_NAMES, view)
    _pristine_entries(pristine, "/usr", LIB_NAMES, view + "/usr")
    _pristine_entries(pristine, "/etc", ETC_RUNTIME, view + "/etc")
    nr = SYS_PIVOT_ROOT.get(os.uname().machine, 155)
    try:
        os.chdir(view)
        check(libc.syscall(nr, b".", b"."), "pivot_root")
        check(libc.umount2(b".", MNT_DETACH), "umount the old root")
        os.chdir("/")
    except OSError as e:
        raise Infra(f"could not switch to the tests' root: {e}") from None
    STAGES["view_entries"] = float(n)


def usable_dir(path: str) -> str | None:
    """Why ``path`` is not a directory the agent's uid can enter and list, or None if it is."""
    try:
        import stat as _st

        st = os.stat(path)
    except OSError as e:
        return f"{path} is unusable ({e.strerror})"
    if not _st.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if not os.access(path, os.X_OK | os.R_OK):  # real uid, no capabilities
        return f"{path} is not accessible (mode {oct(st.st_mode & 0o7777)})"
    return None
