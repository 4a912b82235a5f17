/*
 * sandbox-exec: the last, privileged step of the process backend's exec chain.
 *
 * It runs as root inside the sandbox's fresh namespaces (after `unshare --root`, which
 * made a pid namespace without forking: this process stays outside it, and its first
 * child is the namespace's process 1), starts the sandboxed command as that child and
 * waits for it, in this order:
 *
 *   1. read the seccomp program (classic BPF, built by seccomp_policy.py) from fd 3
 *      and close that fd, so nothing of it is left for the command; then close every
 *      other descriptor but stdin, stdout and stderr: the service's own are close-on-exec,
 *      but one it inherited without that flag (from whatever started it) would otherwise
 *      reach every sandboxed command, a pipe or socket of the host's;
 *   2. fork. The parent (outside the pid namespace, where nothing of the sandbox can see
 *      or signal it) waits for the child and ends the way it ended: the same exit code,
 *      or killed by the same signal. The service reads the chain's status from it, and
 *      nothing else can report the command's death by a signal: the namespace's process
 *      1 cannot signal itself, and `unshare --fork`, which waited for it before, turned
 *      a child killed by SIGKILL (the memory limit's OOM killer, the CPU time limit)
 *      into exit 1 and "sigprocmask unblock failed" on stderr (util-linux 2.38).
 *      The child, the namespace's process 1 and the command to be, dies with the parent
 *      (the parent-death signal) and mounts a /proc of its pid namespace;
 *   3. name the host: sethostname("sandbox") in the new UTS namespace, and set
 *      kernel.shm_rmid_forced in the new IPC namespace: a System V segment goes as soon as
 *      no process holds it. Without it a segment the command left behind went only with
 *      the namespace, which the kernel frees later, on a work queue: its memory stayed
 *      charged to the sandbox for a moment after the exec returned, and a next command
 *      started at once was OOM-killed (seen on a loaded machine);
 *   4. resource limits (address space, CPU seconds, file size, open files, no core).
 *      The CPU limit is soft and hard at once: the kernel never sends SIGXCPU (a soft
 *      limit's signal) to a pid namespace's process 1, so the command ran on to the
 *      hard limit while its children died by SIGXCPU at the soft one; with one limit
 *      every process of the exec dies by SIGKILL at --cpu seconds, as on Docker;
 *   5. empty the capability bounding set and the ambient set while still root;
 *   6. drop supplementary groups, then the gid, then the uid (real, effective, saved):
 *      with every uid non-zero the kernel clears the permitted and effective sets;
 *      then arm the parent-death signal again (SIGKILL): the uid change cleared the one
 *      step 2 set, and without it the command outlived a killed service (the seccomp
 *      filter keeps the command from clearing it); a parent already gone ends it here;
 *   7. clear the inheritable set too, and set no_new_privs (setuid binaries and file
 *      capabilities cannot give anything back; seccomp needs it unprivileged);
 *   8. install the seccomp filter -- last, so the steps above are not filtered;
 *   9. replace the environment with exactly the one the service passed (--env), and
 *      exec the command (PATH from that environment).
 *
 * Any failure exits 125 before the command runs: the service reports it.
 *
 * `sandbox-exec --syscall-numbers NAME...` prints "NAME NR" for the build's own
 * architecture (unknown names print -1), so the policy uses this kernel ABI's numbers.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/audit.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <grp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define FAIL 125
#define MAX_FILTER 4096
#define MAX_ENV 1024

static void die(const char *what) {
    fprintf(stderr, "sandbox-exec: %s: %s\n", what, strerror(errno));
    _exit(FAIL);
}

static void usage(const char *why) {
    fprintf(stderr, "sandbox-exec: %s\n", why);
    _exit(FAIL);
}

struct syscall_name { const char *name; long nr; };

#define SC(x) {#x, __NR_##x}
static const struct syscall_name known[] = {
#ifdef __NR_add_key
    SC(add_key),
#endif
#ifdef __NR_keyctl
    SC(keyctl),
#endif
#ifdef __NR_request_key
    SC(request_key),
#endif
#ifdef __NR_io_uring_setup
    SC(io_uring_setup), SC(io_uring_enter), SC(io_uring_register),
#endif
#ifdef __NR_userfaultfd
    SC(userfaultfd),
#endif
    SC(perf_event_open), SC(bpf), SC(ptrace), SC(process_vm_readv), SC(process_vm_writev),
    SC(unshare), SC(setns), SC(clone), SC(prctl),
#ifdef __NR_clone3
    SC(clone3),
#endif
    SC(mount), SC(umount2), SC(pivot_root), SC(chroot),
#ifdef __NR_open_tree
    SC(open_tree), SC(move_mount), SC(fsopen), SC(fsconfig), SC(fsmount), SC(fspick),
#endif
#ifdef __NR_mount_setattr
    SC(mount_setattr),
#endif
    SC(kexec_load),
#ifdef __NR_kexec_file_load
    SC(kexec_file_load),
#endif
    SC(init_module), SC(finit_module), SC(delete_module), SC(reboot), SC(swapon), SC(swapoff),
    SC(acct), SC(settimeofday), SC(clock_settime), SC(clock_adjtime), SC(adjtimex),
    SC(sethostname), SC(setdomainname), SC(syslog), SC(quotactl), SC(open_by_handle_at),
    SC(name_to_handle_at), SC(fanotify_init), SC(vhangup), SC(personality), SC(kcmp),
#ifdef __NR_iopl
    SC(iopl), SC(ioperm),
#endif
#ifdef __NR_uselib
    SC(uselib),
#endif
#ifdef __NR_lookup_dcookie
    SC(lookup_dcookie),
#endif
#ifdef __NR_pidfd_getfd
    SC(pidfd_getfd),
#endif
};

static int print_numbers(int argc, char **argv) {
    for (int i = 0; i < argc; i++) {
        long nr = -1;
        for (size_t k = 0; k < sizeof(known) / sizeof(known[0]); k++)
            if (strcmp(known[k].name, argv[i]) == 0) nr = known[k].nr;
        printf("%s %ld\n", argv[i], nr);
    }
    printf("@arch %u\n", (unsigned)(
#if defined(__x86_64__)
        AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
        AUDIT_ARCH_AARCH64
#else
        0
#endif
    ));
    return 0;
}

static struct sock_filter filter[MAX_FILTER];

static unsigned short read_filter(int fd) {
    size_t got = 0, want = sizeof(filter);
    while (got < want) {
        ssize_t n = read(fd, (char *)filter + got, want - got);
        if (n < 0) { if (errno == EINTR) continue; die("reading the seccomp program"); }
        if (n == 0) break;
        got += (size_t)n;
    }
    close(fd);
    if (got == 0 || got % sizeof(struct sock_filter) != 0) usage("the seccomp program on fd 3 is empty or torn");
    return (unsigned short)(got / sizeof(struct sock_filter));
}

/* Closes every descriptor from 3 up. close_range(2) where the kernel has it (5.9 and
   later); otherwise one close per number the open-file limit allows, which on such a
   kernel is what bounds the numbers a descriptor can have. */
static void close_inherited(void) {
#ifdef SYS_close_range
    if (syscall(SYS_close_range, 3U, ~0U, 0) == 0) return;
    if (errno != ENOSYS) die("close_range");
#endif
    struct rlimit r;
    if (getrlimit(RLIMIT_NOFILE, &r) != 0) die("getrlimit(RLIMIT_NOFILE)");
    for (rlim_t fd = 3; fd < r.rlim_cur && fd < (rlim_t)1 << 30; fd++) close((int)fd);
}

static rlim_t number(const char *text, const char *what) {
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno || !end || *end) usage(what);
    return (rlim_t)v;
}

static void limit(int resource, rlim_t soft, rlim_t hard, const char *what) {
    struct rlimit r = {soft, hard};
    if (setrlimit(resource, &r) != 0) die(what);
}

/* The parent's part (step 2): waits for the child and ends as it ended. */
static int wait_and_relay(pid_t child) {
    int status;
    while (waitpid(child, &status, 0) < 0)
        if (errno != EINTR) die("waitpid");
    if (WIFEXITED(status)) _exit(WEXITSTATUS(status));
    int sig = WIFSIGNALED(status) ? WTERMSIG(status) : SIGKILL;
    /* No core file of this root process, whatever the signal. */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    if (sig != SIGKILL && sig != SIGSTOP) signal(sig, SIG_DFL);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, sig);
    sigprocmask(SIG_UNBLOCK, &set, NULL);
    kill(getpid(), sig);
    _exit(128 + sig); /* a signal whose default is to go on: its number, as a shell reports it */
}

/* Whether the parent has ended (the read end of `alive` reports a hang-up). */
static int parent_gone(int alive) {
    struct pollfd p = {alive, POLLIN, 0};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLERR));
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "--syscall-numbers") == 0) return print_numbers(argc - 2, argv + 2);

    uid_t uid = 0; gid_t gid = 0;
    rlim_t as = 0, cpu = 0, fsize = 0, nofile = 1024;
    const char *hostname = "sandbox";
    char *env[MAX_ENV + 1];
    int nenv = 0, i = 1;
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--") == 0) { i++; break; }
        if (i + 1 >= argc) usage("option without a value");
        const char *v = argv[++i];
        if (strcmp(a, "--uid") == 0) uid = (uid_t)number(v, "bad --uid");
        else if (strcmp(a, "--gid") == 0) gid = (gid_t)number(v, "bad --gid");
        else if (strcmp(a, "--as") == 0) as = number(v, "bad --as");
        else if (strcmp(a, "--cpu") == 0) cpu = number(v, "bad --cpu");
        else if (strcmp(a, "--fsize") == 0) fsize = number(v, "bad --fsize");
        else if (strcmp(a, "--nofile") == 0) nofile = number(v, "bad --nofile");
        else if (strcmp(a, "--hostname") == 0) hostname = v;
        else if (strcmp(a, "--env") == 0) {
            if (nenv >= MAX_ENV || !strchr(v, '=')) usage("bad --env");
            env[nenv++] = (char *)v;
        } else usage("unknown option");
    }
    env[nenv] = NULL;
    if (i >= argc) usage("no command after --");
    if (uid == 0 || gid == 0) usage("--uid and --gid must name an unprivileged user");

    /* 1. the seccomp program, then no descriptor but 0, 1 and 2 */
    struct sock_fprog prog = {read_filter(3), filter};
    close_inherited();

    /* 2. the parent waits and relays; the child is the pid namespace's process 1 */
    int alive[2];
    if (pipe2(alive, O_CLOEXEC) != 0) die("pipe2");
    pid_t child = fork();
    if (child < 0) die("fork");
    if (child > 0) {
        /* The write end of `alive` stays open until this process ends, however it ends:
           a child that armed its parent-death signal too late sees the pipe hung up. */
        close(alive[0]);
        return wait_and_relay(child);
    }
    close(alive[1]);
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0) die("PR_SET_PDEATHSIG");
    if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) != 0) die("mounting /proc");

    /* 3. a host name of our own (the UTS namespace is the sandbox's); System V segments
       that die with their last holder (the IPC namespace is this exec's) */
    if (sethostname(hostname, strlen(hostname)) != 0) die("sethostname");
    int forced = open("/proc/sys/kernel/shm_rmid_forced", O_WRONLY | O_CLOEXEC);
    if (forced < 0 || write(forced, "1\n", 2) != 2) die("setting kernel.shm_rmid_forced");
    close(forced);

    /* 4. resource limits */
    if (as) limit(RLIMIT_AS, as, as, "RLIMIT_AS");
    if (cpu) limit(RLIMIT_CPU, cpu, cpu, "RLIMIT_CPU");
    if (fsize) limit(RLIMIT_FSIZE, fsize, fsize, "RLIMIT_FSIZE");
    limit(RLIMIT_NOFILE, nofile, nofile, "RLIMIT_NOFILE");
    limit(RLIMIT_CORE, 0, 0, "RLIMIT_CORE");

    /* 5. no capability can come back: bounding and ambient sets emptied as root */
    for (int cap = 0; cap <= CAP_LAST_CAP; cap++)
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 && errno != EINVAL) die("PR_CAPBSET_DROP");
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 && errno != EINVAL) die("PR_CAP_AMBIENT");

    /* 6. the unprivileged identity: groups, gid, uid (all three of each) */
    if (setgroups(0, NULL) != 0) die("setgroups");
    if (setresgid(gid, gid, gid) != 0) die("setresgid");
    if (setresuid(uid, uid, uid) != 0) die("setresuid");
    /* prctl(2): a credential change clears the parent-death signal; the parent dies with
       the service, and this process is the namespace's init, whose death takes every
       process of the sandbox's exec with it. A parent that ended before the signal was
       armed (again) would not send it: then end here. */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0) die("PR_SET_PDEATHSIG");
    if (parent_gone(alive[0])) usage("the parent ended before the command started");
    close(alive[0]);

    /* 7. no inheritable capabilities, no new privileges */
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof(data));
    if (syscall(SYS_capset, &header, data) != 0) die("capset");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) die("PR_SET_NO_NEW_PRIVS");

    /* 8. the seccomp filter */
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0) != 0) die("PR_SET_SECCOMP");

    /* 9. exactly the service's environment, then the command */
    if (clearenv() != 0) die("clearenv");
    for (int k = 0; k < nenv; k++)
        if (putenv(env[k]) != 0) die("putenv");
    execvp(argv[i], argv + i);
    fprintf(stderr, "sandbox-exec: %s: %s\n", argv[i], strerror(errno));
    _exit(errno == ENOENT ? 127 : 126);
}
