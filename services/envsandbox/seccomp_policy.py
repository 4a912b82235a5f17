"""The system calls sandboxed code may not make, as one policy for both backends.

Modelled on Docker's default profile, but as a deny list on top of the other layers
(an unprivileged uid with no capabilities, no_new_privs, namespaces): what is denied here
is what those layers leave reachable, or what shares kernel state across sandboxes.

* keyrings (``add_key``, ``keyctl``, ``request_key``): per-uid kernel state, a channel
  between episodes;
* ``io_uring_*``, ``userfaultfd``, ``perf_event_open``, ``bpf``: large kernel attack surface;
* ``ptrace``, ``process_vm_*``, ``kcmp``, ``pidfd_getfd``: reaching into other processes;
* new namespaces (``unshare``, ``setns``, ``clone`` with ``CLONE_NEW*`` flags; ``clone3``
  answers ENOSYS so libc falls back to ``clone``, whose flags a filter can read) and every
  mount call: the sandbox's own view of the system stays as built;
* host-wide settings (clock, hostname, swap, modules, kexec, reboot, accounting, syslog);
* ``prctl(PR_SET_PDEATHSIG)``: the process backend's launcher arms it so the sandboxed
  command dies with the service; clearing it (or trading SIGKILL for a signal it ignores)
  would let the command outlive a killed service.

Denied calls fail with EPERM (ENOSYS for ``clone3``); a call made through another
architecture's ABI (x32, or a foreign audit arch) kills the process.

:func:`bpf_program` turns the policy into a classic BPF program for the process backend's
launcher (numbers from the launcher itself, so they are this kernel ABI's);
:func:`docker_profile` into a Docker seccomp profile. :func:`run_bpf` interprets a program
for the unit tests.
"""
from __future__ import annotations

import errno
import json
import struct
from collections.abc import Mapping

DENIED = (
    "add_key", "keyctl", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "perf_event_open", "bpf",
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "unshare", "setns",
    "mount", "umount2", "pivot_root", "chroot", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff",
    "acct", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "sethostname", "setdomainname", "syslog",
    "quotactl", "open_by_handle_at", "name_to_handle_at", "fanotify_init", "vhangup", "personality",
    "iopl", "ioperm", "uselib", "lookup_dcookie",
)
NO_SYS = ("clone3",)
#: Calls judged by their first argument (see bpf_program), on every ABI.
ARGUMENT_RULES = ("clone", "prctl")
#: CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET (clone's low byte is the exit signal).
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
#: prctl's option that sets (or clears) the signal a process gets when its parent dies.
PR_SET_PDEATHSIG = 1
X32_SYSCALL_BIT = 0x40000000
AUDIT_ARCH_X86_64 = 0xC000003E

# Classic BPF opcodes and seccomp return values.
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW = 0x7FFF0000
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
_NR, _ARCH, _ARG0_LOW = 0, 4, 16  # offsets in struct seccomp_data (little-endian args)


def bpf_program(numbers: Mapping[str, int], arch: int) -> bytes:
    """The policy as ``struct sock_filter[]`` bytes for ``arch`` (an AUDIT_ARCH_* value),
    with syscall numbers from ``numbers`` (names this ABI lacks are skipped)."""
    denied = sorted({numbers[n] for n in DENIED if numbers.get(n, -1) >= 0})
    nosys = sorted({numbers[n] for n in NO_SYS if numbers.get(n, -1) >= 0})
    clone = numbers.get("clone", -1)
    prctl = numbers.get("prctl", -1)
    # (opcode, k, label if the condition holds, label if not); None: fall through.
    Step = tuple[int, int, str | None, str | None]
    steps: list[Step] = [(_LD_W_ABS, _ARCH, None, None), (_JEQ_K, arch, None, "kill"), (_LD_W_ABS, _NR, None, None)]
    if arch == AUDIT_ARCH_X86_64:
        steps.append((_JGE_K, X32_SYSCALL_BIT, "kill", None))
    steps += [(_JEQ_K, nr, "deny", None) for nr in denied]
    steps += [(_JEQ_K, nr, "nosys", None) for nr in nosys]
    if clone >= 0:
        steps.append((_JEQ_K, clone, "clone", None))
    if prctl >= 0:
        steps.append((_JEQ_K, prctl, "prctl", None))
    # Jumps only go forward: the argument checks come before the return blocks they end in.
    blocks: list[tuple[str, list[Step]]] = [
        ("allow", [(_RET_K, RET_ALLOW, None, None)]),
        # clone: the low 32 bits of its flags; any namespace bit set -> deny.
        ("clone", [(_LD_W_ABS, _ARG0_LOW, None, None), (_JSET_K, CLONE_NEW_FLAGS, "deny", "allow_after_clone")]),
        ("allow_after_clone", [(_RET_K, RET_ALLOW, None, None)]),
        # prctl: its option (an int, the low 32 bits) PR_SET_PDEATHSIG -> deny.
        ("prctl", [(_LD_W_ABS, _ARG0_LOW, None, None), (_JEQ_K, PR_SET_PDEATHSIG, "deny", "allow_after_prctl")]),
        ("allow_after_prctl", [(_RET_K, RET_ALLOW, None, None)]),
        ("deny", [(_RET_K, RET_ERRNO | errno.EPERM, None, None)]),
        ("nosys", [(_RET_K, RET_ERRNO | errno.ENOSYS, None, None)]),
        ("kill", [(_RET_K, RET_KILL_PROCESS, None, None)]),
    ]
    labels: dict[str, int] = {}
    for name, block in blocks:
        labels[name] = len(steps)
        steps += block
    if len(steps) > 4096:
        raise ValueError("seccomp program longer than the kernel accepts")

    def jump(at: int, label: str | None) -> int:
        if label is None:
            return 0
        distance = labels[label] - at - 1
        if not 0 <= distance <= 255:
            raise ValueError("seccomp program too long for short jumps")
        return distance

    return b"".join(struct.pack("=HBBI", code, jump(at, yes), jump(at, no), k) for at, (code, k, yes, no) in enumerate(steps))


def run_bpf(program: bytes, nr: int, arch: int, arg0: int = 0) -> int:
    """What ``program`` returns for one system call (an interpreter of the subset used)."""
    insns = [struct.unpack_from("=HBBI", program, i) for i in range(0, len(program), 8)]
    data = struct.pack("<iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == _LD_W_ABS:
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == _RET_K:
            return k
        elif code in (_JEQ_K, _JGE_K, _JSET_K):
            taken = acc == k if code == _JEQ_K else acc >= k if code == _JGE_K else bool(acc & k)
            pc += jt if taken else jf
        else:
            raise ValueError(f"unexpected BPF opcode {code:#x}")
        pc += 1


def docker_profile() -> str:
    """The policy as a Docker seccomp profile (JSON), for ``--security-opt seccomp=``."""
    profile = {
        "defaultAction": "SCMP_ACT_ALLOW",
        "defaultErrnoRet": errno.EPERM,
        "syscalls": [
            {"names": list(DENIED), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM},
            {"names": list(NO_SYS), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS},
            {
                "names": ["clone"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": errno.EPERM,
                "args": [{"index": 0, "value": CLONE_NEW_FLAGS, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}],
                "comment": "placeholder, replaced below",
            },
        ],
    }
    # libseccomp matches MASKED_EQ(mask, value): deny clone when any namespace bit is set,
    # one rule per bit (a rule's args are ANDed, rules are ORed).
    bits = [1 << b for b in range(32) if CLONE_NEW_FLAGS & (1 << b)]
    profile["syscalls"][2:] = [
        {"names": ["clone"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM,
         "args": [{"index": 0, "value": bit, "valueTwo": bit, "op": "SCMP_CMP_MASKED_EQ"}]}
        for bit in bits
    ]
    profile["syscalls"].append(
        {"names": ["prctl"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM,
         "args": [{"index": 0, "value": PR_SET_PDEATHSIG, "valueTwo": 0, "op": "SCMP_CMP_EQ"}]}
    )
    return json.dumps(profile)
