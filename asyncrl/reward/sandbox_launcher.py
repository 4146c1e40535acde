"""Inside half of the code sandbox: isolate, limit, drop privileges, exec the untrusted program.

`asyncrl.reward.sandbox` starts this file as a script (`python -I -S sandbox_launcher.py SPEC`),
so it imports nothing but the standard library and runs in a fresh single-threaded process: the
setup below (unshare, mount, setuid) is unsafe in a `preexec_fn` of a threaded parent.

Sequence, as root when available:
1. new network / mount / PID / IPC / UTS namespaces (the network one has only a loopback, down);
2. in the mount namespace every mount becomes read-only and nosuid, except the work dir;
3. fork: the child is PID 1 of the new PID namespace, so when it exits or is killed the kernel
   kills every process it left behind (fork bombs, daemons that called setsid);
4. the child mounts a private /proc, sets rlimits, switches to an unprivileged uid that no other
   live sandbox uses (RLIMIT_NPROC is per uid and not enforced for root) and execs the program.
The launcher stays root, waits for the child and reports on the status fd as JSON lines.
"""

import ctypes
import json
import os
import resource
import select
import signal
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 1 << 18
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC = 1, 2, 4, 8
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_MOUNT_SETATTR = 442  # same number on x86_64 and the asm-generic table (arm64)
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38

libc = ctypes.CDLL(None, use_errno=True)
child_pid = 0


class Unavailable(Exception):
    """An isolation mechanism the spec requires cannot be had on this machine."""


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def check(result, what):
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def report(status_fd, **message):
    os.write(status_fd, (json.dumps(message) + "\n").encode())


def set_parent_death_signal():
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")


def mount_setattr(path, flags, attr_set=0, attr_clr=0):
    attr = MountAttr(attr_set, attr_clr, 0, 0)
    result = libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), flags,
                          ctypes.byref(attr), ctypes.sizeof(attr))
    check(0 if result == 0 else -1, f"mount_setattr({path})")


def make_readonly_except(workdir):
    # Private first: otherwise the bind mount below would propagate to the host's namespace.
    check(libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None), "mount(/, private)")
    check(libc.mount(workdir.encode(), workdir.encode(), None, MS_BIND, None), "bind workdir")
    # Not nodev on "/": that would also close /dev/null; device nodes stay guarded by their modes.
    mount_setattr("/", AT_RECURSIVE, attr_set=MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID)
    mount_setattr(workdir, 0, attr_clr=MOUNT_ATTR_RDONLY,
                  attr_set=MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC)


def isolate(spec):
    """Apply what the spec asks for; return the names of the mechanisms now in force."""
    required = spec["require_isolation"]
    applied = []
    wanted = [("network_namespace", CLONE_NEWNET)] if spec["network_namespace"] else []
    wanted += [("mount_namespace", CLONE_NEWNS), ("pid_namespace", CLONE_NEWPID),
               ("ipc_namespace", CLONE_NEWIPC | CLONE_NEWUTS)]
    for name, flag in wanted:
        if libc.unshare(flag) == 0:
            applied.append(name)
        elif required:
            raise Unavailable(f"{name}: unshare failed: {os.strerror(ctypes.get_errno())}")
    if "mount_namespace" in applied:
        try:
            make_readonly_except(spec["workdir"])
            applied.append("readonly_filesystem")
        except OSError as err:
            if required:
                raise Unavailable(f"readonly_filesystem: {err}") from None
    if os.geteuid() == 0:
        os.chown(spec["workdir"], spec["uid"], spec["uid"])
        for name in os.listdir(spec["workdir"]):
            os.chown(os.path.join(spec["workdir"], name), spec["uid"], spec["uid"])
        applied.append("unprivileged_uid")
    elif required:
        raise Unavailable("unprivileged_uid: the launcher is not root, cannot switch uid")
    return applied


def set_limits(limits):
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value))


def become_program(spec, applied, death_pipe):
    """In the forked child: last setup steps, then exec. Never returns."""
    try:
        if "pid_namespace" in applied and "readonly_filesystem" in applied:
            # A fresh /proc shows only this sandbox's processes, not the trainer's command lines.
            # Only once mounts are private: otherwise it would cover the host's /proc too.
            check(libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None),
                  "mount /proc")
        elif "pid_namespace" not in applied:
            os.setsid()  # so the launcher can kill the whole group when there is no PID namespace
        set_limits(spec["rlimits"])
        if "unprivileged_uid" in applied:
            os.setgroups([])
            os.setgid(spec["uid"])
            os.setuid(spec["uid"])
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        # setuid clears the parent-death signal, so set it afterwards; then make sure the
        # launcher did not die before it was set (its pipe end would read as EOF).
        set_parent_death_signal()
        if select.select([death_pipe], [], [], 0)[0]:
            os._exit(125)
        os.chdir(spec["workdir"])
        argv = [spec["python"], "-I", "-S", "-B", spec["program"]]
        os.execve(spec["python"], argv, spec["env"])
    except BaseException as err:  # reported on the program's stderr, which the parent keeps
        os.write(2, f"sandbox setup failed: {err!r}\n".encode())
    os._exit(126)


def kill_child(signum, frame):
    if child_pid:
        os.kill(child_pid, signal.SIGKILL)
    else:
        os._exit(1)


def main():
    global child_pid
    spec = json.loads(sys.argv[1])
    # The launcher's PID is unique among live processes and the sandbox dies with the launcher,
    # so no two live sandboxes share a uid (and so none shares another's RLIMIT_NPROC budget).
    spec["uid"] = spec["uid_base"] + os.getpid()
    status_fd = spec["status_fd"]
    os.set_inheritable(status_fd, False)
    set_parent_death_signal()
    if os.getppid() != spec["parent_pid"]:
        os._exit(1)
    signal.signal(signal.SIGTERM, kill_child)
    try:
        applied = isolate(spec)
    except Unavailable as err:
        report(status_fd, unavailable=str(err))
        os._exit(2)
    report(status_fd, isolation=applied)
    death_read, death_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(death_write)
        become_program(spec, applied, death_read)
    child_pid = pid
    _, status, usage = os.wait4(pid, 0)
    if "pid_namespace" not in applied:
        try:
            os.killpg(pid, signal.SIGKILL)  # leftovers of the program's session
        except ProcessLookupError:
            pass
    report(status_fd, exit_code=os.waitstatus_to_exitcode(status),
           cpu_seconds=usage.ru_utime + usage.ru_stime, max_rss_kib=usage.ru_maxrss)


if __name__ == "__main__":
    main()
