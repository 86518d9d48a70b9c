"""The jail's launcher: a stdlib-only script that sandbox.py runs as `<base python> -I -S jail.py <config> <code>`
(<config>: a marshal-encoded dict in hex, from the trusted trainer; marshal needs no import, json would cost ~5 ms of
start-up).

It is a script of its own, never imported by the trainer, because the namespaces must be made by a single-threaded
process: unshare(CLONE_NEWUSER) fails with EINVAL in a multithreaded one (the trainer has torch's threads and the
pool's), and forking the trainer (GBs of mappings, locks held by other threads) to call it from a preexec_fn is
both slow and unsafe. Python 3.11 has no os.unshare, so the syscalls go through ctypes (libc's unshare, mount,
umount2, prctl, capset; pivot_root by number).

Four processes, each waiting on the next:

- L, this script on the host: writes the child's uid/gid maps (from outside, so that a root trainer can map the
  sandbox to the unprivileged host uid 65534: RLIMIT_NPROC does not apply to host uid 0), then waits for the
  child, the wall deadline (config `wall_s`) or EOF on its stdin (the trainer's control pipe: the trainer asked
  to stop, or died); on either it SIGKILLs I, and on the deadline it reports `timeout` on the status pipe.
- C, L's child: unshare(user, mount, pid, net, IPC, UTS), takes the in-namespace uid/gid SANDBOX_ID (mapped to
  the host id), forks I and reaps it. A SIGKILL of L kills C (PR_SET_PDEATHSIG), of C kills I.
- I, pid 1 of the new pid namespace: builds the root file system (read-only binds of /usr, /lib*, /bin and the
  Python prefix, a fresh /proc, /dev/null, /dev/zero, /dev/urandom, a tmpfs of `max_file_mib` MiB as /tmp and cwd),
  pivots into it, forks U, drops every capability and reaps until U exits; then it reports U's wait status on the
  status pipe and exits, and the kernel kills whatever else lives in the namespace. C's waitpid returns only when
  all of them are gone, so the trainer's call returns after the whole tree is dead.
- U: sets the rlimits, no_new_privs, drops capabilities (bounding set too, securebits locked), stdin /dev/null,
  closes every other descriptor and execs `python -I -c <code>`.

The status pipe (config `status_fd`) carries lines `exit <wait status>`, `timeout` or `error <message>`.
"""

from __future__ import annotations

import ctypes
import marshal
import os
import resource
import select
import signal
import sys
import time

SANDBOX_ID = 1000
"""The uid and gid the code has inside its user namespace; 0 (root) is left unmapped, so an exec never grants
capabilities."""

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_SECUREBITS = 1, 4, 24, 28
PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 38, 47, 4
SECUREBITS_LOCKED_DOWN = 0xEF
"""NOROOT, NO_SETUID_FIXUP and NO_CAP_AMBIENT_RAISE set, KEEP_CAPS clear, all four locked."""
LINUX_CAPABILITY_VERSION_3 = 0x20080522
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
STATVFS_TO_MS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                 (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))
HOST_DIRS = ("/usr", "/bin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("null", "zero", "urandom")
STAGING = "/tmp"
"""Where I mounts the jail's root tmpfs before pivoting into it (inside the private mount namespace only)."""
USERNS_HELP = (
    "user namespaces are unavailable or restricted here; the sandbox needs them and never runs code without them. "
    "Enable them: `sysctl -w user.max_user_namespaces=15000` (0 disables them), on Debian/Ubuntu kernels "
    "`sysctl -w kernel.unprivileged_userns_clone=1`, on Ubuntu 23.10+ `sysctl -w "
    "kernel.apparmor_restrict_unprivileged_userns=0` (or an AppArmor profile that allows userns for this Python)")

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
LIBC.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
LIBC.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
LIBC.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
LIBC.unshare.argtypes = [ctypes.c_int]


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def check(ret: int, what: str) -> None:
    """Raise OSError (with errno and `what`) when a libc call returned -1."""
    if ret == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def prctl(option: int, arg: int = 0, arg3: int = 0) -> None:
    check(LIBC.prctl(option, arg, arg3, 0, 0), f"prctl({option}, {arg})")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()
    check(LIBC.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {source} on {target}")


def report(status_fd: int, line: str) -> None:
    """One status line to the trainer (newlines in `line` flattened)."""
    os.write(status_fd, (line.replace("\n", " ") + "\n").encode(errors="replace"))


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies; exit now if it already has."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def unescape(field: str) -> str:
    """A mountinfo path field decoded: the kernel writes space, tab, newline and backslash as octal escapes."""
    parts = field.split("\\")
    return parts[0] + "".join(chr(int(p[:3], 8)) + p[3:] for p in parts[1:])


def remount_read_only(path: str) -> None:
    """Remount the bind mount at `path` (and every mount below it) read-only, nosuid, nodev, keeping the flags a
    user namespace may not clear (the source's noexec and atime flags are locked)."""
    points = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = unescape(line.split()[4])
            if point == path or point.startswith(path + "/"):
                points.append(point)
    for point in sorted(points, key=len):
        have = os.statvfs(point).f_flag
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
        flags |= sum(ms for st, ms in STATVFS_TO_MS if have & st)
        if not have & (os.ST_NOATIME | os.ST_RELATIME):
            flags |= MS_STRICTATIME
        mount(None, point, None, flags)


def open_binds(cfg: dict) -> list[tuple[str, str | int]]:
    """(path, what to put there) for the jail's host directories: a symlink's target, or an O_PATH descriptor of
    the directory. Opened by C before it drops to the sandbox's uid, which may not traverse the way there (a
    prefix under /root); I binds from the descriptor."""
    paths = [d for d in HOST_DIRS if os.path.lexists(d)]
    paths += [p for p in cfg["extra_dirs"] if not any(p == d or p.startswith(d + "/") for d in paths)]
    return [(p, os.readlink(p) if os.path.islink(p) else os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in paths]


def build_root(cfg: dict, binds: list[tuple[str, str | int]]) -> None:
    """Build the jail's root file system under STAGING and pivot into it (run by I, pid 1, in the new namespaces)."""
    root = STAGING
    try:
        mount(None, "/", None, MS_REC | MS_PRIVATE)
        mount("sandbox-root", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=256,mode=0755")
    except PermissionError as err:
        raise PermissionError(f"{err}; {USERNS_HELP}") from err
    os.mkdir(f"{root}/proc")
    mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for path, what in binds:
        dst = root + path
        if isinstance(what, str):
            os.symlink(what, dst)
            continue
        os.makedirs(dst, exist_ok=True)
        mount(f"/proc/self/fd/{what}", dst, None, MS_BIND | MS_REC)
        os.close(what)
        remount_read_only(dst)
    for site_dir in cfg["hide_dirs"]:  # the base interpreter's site-packages: the code gets the stdlib only
        if os.path.isdir(root + site_dir):
            mount("sandbox-empty", root + site_dir, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0755")
    os.mkdir(f"{root}/dev")
    for name in DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
    os.mkdir(f"{root}/tmp")
    mount("sandbox-tmp", f"{root}/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={cfg['max_file_mib']}m,nr_inodes=4096,mode=0700,uid={SANDBOX_ID},gid={SANDBOX_ID}")
    check(LIBC.sethostname(b"sandbox", 7), "sethostname")
    os.chdir(root)
    machine = os.uname().machine
    if machine not in SYS_PIVOT_ROOT:
        raise OSError(f"pivot_root: no syscall number known for {machine}")
    check(LIBC.syscall(ctypes.c_long(SYS_PIVOT_ROOT[machine]), b".", b"."), "pivot_root")
    check(LIBC.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def drop_capabilities() -> None:
    """Empty the bounding, ambient, effective, permitted and inheritable sets and lock the securebits."""
    cap = 0
    while LIBC.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    prctl(PR_SET_SECUREBITS, SECUREBITS_LOCKED_DOWN)
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    data = (CapData * 2)()
    check(LIBC.capset(ctypes.byref(CapHeader(LINUX_CAPABILITY_VERSION_3, 0)), data), "capset")


def exec_code(cfg: dict, code: str, status_fd: int) -> None:
    """U: limits, no_new_privs, no capabilities, stdin /dev/null, then exec the interpreter on `code`."""
    try:
        os.chdir("/tmp")
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.set_inheritable(status_fd, False)
        os.closerange(3, status_fd)
        os.closerange(status_fd + 1, 65536)
        for name, soft, hard in cfg["rlimits"]:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        prctl(PR_SET_NO_NEW_PRIVS, 1)
        drop_capabilities()
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
        os.execve(cfg["python"], [cfg["python"], "-I", "-c", code], env)
    except BaseException as err:  # noqa: BLE001 - any failure before exec is the jail's, reported as such
        report(status_fd, f"error exec: {err}")
        os._exit(127)


def init_main(cfg: dict, code: str, status_fd: int, go_r: int, binds: list[tuple[str, str | int]]) -> None:
    """I, pid 1 of the jail's pid namespace (see the module docstring)."""
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.read(go_r, 1) != b"g":  # C died before this process could follow it
            os._exit(1)
        os.close(go_r)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # pid 1 ignores signals without a handler
        os.setsid()  # kill(0, ...) from the code reaches this namespace's processes only
        build_root(cfg, binds)
        child = os.fork()
        if child == 0:
            exec_code(cfg, code, status_fd)
        drop_capabilities()
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == child:
                break
        report(status_fd, f"exit {status}")
    except BaseException as err:  # noqa: BLE001
        report(status_fd, f"error jail set-up: {err}")
    os._exit(0)


def child_main(cfg: dict, code: str, status_fd: int, to_l: int, from_l: int, launcher: int) -> None:
    """C: enter the new namespaces, take the mapped ids, fork I and reap it."""
    try:
        die_with_parent(launcher)
        if host_root():
            os.setgroups([])  # the trainer's supplementary groups (root's) stay behind
        flags = CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
        try:
            check(LIBC.unshare(flags), "unshare(user, mount, pid, net, ipc, uts namespaces)")
        except OSError as err:
            report(status_fd, f"error {err}; {USERNS_HELP}")
            os._exit(1)
        binds = open_binds(cfg)
        os.write(to_l, b"u")
        if os.read(from_l, 1) != b"m":
            os._exit(1)
        os.setresgid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)
        os.setresuid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)
        prctl(PR_SET_DUMPABLE, 0)  # the code, same uid, may not ptrace I (nor read its /proc/1/fd)
        die_with_parent(launcher)  # a uid change cleared the death signal
        go_r, go_w = os.pipe()
        init = os.fork()
        if init == 0:
            os.close(go_w)
            os.close(to_l)
            os.close(from_l)
            init_main(cfg, code, status_fd, go_r, binds)
        os.close(go_r)
        os.write(to_l, f"{init}\n".encode())
        if os.read(from_l, 1) != b"a":
            os.kill(init, signal.SIGKILL)
        os.write(go_w, b"g")
        os.waitpid(init, 0)
    except BaseException as err:  # noqa: BLE001
        report(status_fd, f"error namespace set-up: {err}")
        os._exit(1)
    os._exit(0)


def read_line(fd: int) -> str:
    """One line from a pipe ("" at EOF)."""
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = os.read(fd, 64)
        if not chunk:
            return ""
        buf += chunk
    return buf.decode().strip()


def host_root() -> bool:
    """Whether this process is root of the initial user namespace (the host's uid 0), which may map any id."""
    with open("/proc/self/uid_map") as f:
        return os.geteuid() == 0 and f.read().split() == ["0", "0", "4294967295"]


def write_maps(child: int) -> None:
    """Map SANDBOX_ID in the child's user namespace to host uid/gid 65534 when this process is host root
    (RLIMIT_NPROC is not enforced for host uid 0), else to this process's own ids (all an unprivileged process may
    map); setgroups is denied first (required of an unprivileged writer, and the code has no use for it)."""
    host_uid, host_gid = (65534, 65534) if host_root() else (os.geteuid(), os.getegid())
    for name, text in (("setgroups", "deny"), ("uid_map", f"{SANDBOX_ID} {host_uid} 1"),
                       ("gid_map", f"{SANDBOX_ID} {host_gid} 1")):
        with open(f"/proc/{child}/{name}", "w") as f:
            f.write(text)


def main() -> int:
    """L (see the module docstring); returns the launcher's exit status."""
    cfg, code = marshal.loads(bytes.fromhex(sys.argv[1])), sys.argv[2]
    status_fd = cfg["status_fd"]
    deadline = time.monotonic() + cfg["wall_s"]
    die_with_parent(cfg["parent_pid"])
    to_l_r, to_l_w = os.pipe()
    from_l_r, from_l_w = os.pipe()
    launcher = os.getpid()
    child = os.fork()
    if child == 0:
        os.close(to_l_r)
        os.close(from_l_w)
        os.close(0)  # the control pipe is the launcher's alone
        child_main(cfg, code, status_fd, to_l_w, from_l_r, launcher)
    os.close(to_l_w)
    os.close(from_l_r)
    init_fd = None
    try:
        if os.read(to_l_r, 1) != b"u":  # C failed and reported why
            os.waitpid(child, 0)
            return 1
        write_maps(child)
        os.write(from_l_w, b"m")
        init = read_line(to_l_r)
        if not init:
            os.waitpid(child, 0)
            return 1
        init_fd = os.pidfd_open(int(init))  # before C may reap I: the pid cannot be reused under us
        os.write(from_l_w, b"a")
    except BaseException as err:  # noqa: BLE001
        report(status_fd, f"error launcher: {err}" + (f"; {USERNS_HELP}" if isinstance(err, PermissionError)
                                                      else ""))
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        return 1
    child_fd = os.pidfd_open(child)
    while True:
        ready, _, _ = select.select([child_fd, 0], [], [], max(0.0, deadline - time.monotonic()))
        if child_fd in ready:
            break
        if not ready:
            report(status_fd, "timeout")
        signal.pidfd_send_signal(init_fd, signal.SIGKILL)  # deadline, or the trainer closed the control pipe
        break
    os.waitpid(child, 0)  # C returns once I, and with it every process of the namespace, is gone
    return 0


if __name__ == "__main__":
    sys.exit(main())
