"""The script run once in a new sandbox instance: the account naming and the copy-up of ``$HOME``.

``PREPARE_SCRIPT`` is bash (its builtins where it can) with two placeholders that
``Sandbox._prepare_script`` fills: ``__HOME__`` (the quoted home directory) and
``__IMAGE_IS_OURS__`` (``true`` or ``false``: whether the image's own root is owned by us).
It always exits 0; what it does is in the comment above it.
"""

# Run once in a new instance (as part of the first shell's startup, or as its own exec), by bash
# and with bash's builtins only where it can: every program started in the instance costs a few
# milliseconds of the episode's setup.
# 1. Task images are built with --fakeroot and `useradd user` + `chown user:user`; the agent runs
#    as the invoking uid, which apptainer names after the host account. Where the image has a
#    `user` account (else, the account with uid 1000: the first `useradd`, which upstream's
#    agent ran as), our uid and gid are given that name in the instance's /etc/passwd and
#    /etc/group (apptainer writes both per instance, owned by us), so tests that check
#    "owned by user" see the agent's files as `user`'s: other lines with our id are dropped,
#    that account's ids become ours, the rest is kept as it was.
# 2. Where the image's files keep foreign owners (setuid installs mount squashfs in the kernel),
#    $HOME is copied up into the writable layer as ours (content, modes and times kept). When the
#    image's own root (the pristine bind, which no overlay covers) is ours, every file of the image
#    is (a rootless FUSE mount shows every file as owned by the mounting user; an unpacked tree was
#    written by us), and $HOME is not searched.
PREPARE_SCRIPT = r"""
et_ids() {  # FILE NAME ID NEW K: drop lines whose 3rd field is ID (but NAME's); NAME's K id fields := NEW
  # (status 2: FILE unreadable or without NAME, left alone)
  local l out= found= re="^[^:]*:([^:]*):([0-9]*:){$5}(.*)$" own='^[^:]*:[^:]*:([^:]*):'
  while IFS= read -r l || [ -n "$l" ]; do
    case $l in
      "$2":*) found=1; [[ $l =~ $re ]] && l="$2:${BASH_REMATCH[1]}:$4:${BASH_REMATCH[3]}" ;;
      *) [[ $l =~ $own ]] && [ "${BASH_REMATCH[1]}" = "$3" ] && continue ;;
    esac
    out+=$l$'\n'
  done 2>/dev/null <"$1" || return 2
  [ -n "$found" ] || return 2
  while [ "${out%$'\n'}" != "$out" ]; do out=${out%$'\n'}; done
  printf '%s\n' "$out" 2>/dev/null >"$1"
}
me=$EUID mg=${GROUPS[0]} n= c= l= re='^([a-z_][a-z0-9_-]*):[^:]*:1000:'
while IFS= read -r l || [ -n "$l" ]; do
  case $l in user:*) n=user; break ;; esac
  [ -z "$c" ] && [[ $l =~ $re ]] && c=${BASH_REMATCH[1]}
done 2>/dev/null </etc/passwd
[ -n "$n" ] || n=$c
if [ -n "$n" ]; then
  et_ids /etc/passwd "$n" "$me" "$me:$mg" 2; [ $? = 2 ] || et_ids /etc/group "$n" "$mg" "$mg" 1
fi
h=__HOME__
if [ -d "$h" ] && ! __IMAGE_IS_OURS__ && [ -n "$(find "$h" -xdev ! -user "$me" -print 2>/dev/null | head -n 1)" ]; then
  t="$h.et-hpc-$$"
  cp -a "$h" "$t" 2>/dev/null && rm -rf "$h" 2>/dev/null; mv "$t" "$h" 2>/dev/null
fi
true
"""
