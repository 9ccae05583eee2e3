"""The seccomp filter every sandboxed program runs under.

Built with libseccomp (through ``pyseccomp``) on the host and exported as
classic BPF; the sandbox harness loads it into each model process after its
namespaces are set up and its capabilities are dropped (``no_new_privs``).

Default allow, with these denied (EPERM, so programs see an ordinary error):
sockets of any family but AF_UNIX; ptrace and process_vm_*; mount, umount,
pivot_root, unshare, setns, clone with namespace flags; bpf, perf_event_open,
userfaultfd; keyctl and the key syscalls; io_uring; kernel module, kexec,
reboot, swap, clock and quota syscalls. Other architectures' syscall ABIs
(x32, i386 via int 0x80) kill the process: libseccomp's default bad-arch action.
"""

from __future__ import annotations

import errno
import functools
import socket
import tempfile

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev",
    "mount", "umount2", "pivot_root", "chroot", "unshare", "setns",
    "fsopen", "fsmount", "fsconfig", "move_mount", "open_tree", "mount_setattr",
    "bpf", "perf_event_open", "userfaultfd",
    "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "reboot", "swapon", "swapoff", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "quotactl", "acct", "lookup_dcookie", "name_to_handle_at", "open_by_handle_at",
    "syslog", "vhangup", "personality",
)  # fmt: skip
# clone(2) flags that create namespaces: CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET|NEWTIME
_NS_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)


@functools.lru_cache(maxsize=1)
def filter_bpf() -> bytes:
    """The filter as BPF bytes (cached: building it takes a few milliseconds)."""
    import pyseccomp as sc

    f = sc.SyscallFilter(defaction=sc.ALLOW)
    deny = sc.ERRNO(errno.EPERM)
    f.add_rule(deny, "socket", sc.Arg(0, sc.NE, socket.AF_UNIX))
    f.add_rule(deny, "socketpair", sc.Arg(0, sc.NE, socket.AF_UNIX))
    for flag in _NS_FLAGS:  # clone with any namespace flag set
        f.add_rule(deny, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # its flags live in memory; libc falls back to clone
    for name in DENIED:
        try:
            f.add_rule(deny, name)
        except (RuntimeError, ValueError, OSError):  # unknown on this architecture
            continue
    with tempfile.TemporaryFile() as fh:  # libseccomp writes to a file descriptor
        f.export_bpf(fh)
        fh.seek(0)
        return fh.read()
