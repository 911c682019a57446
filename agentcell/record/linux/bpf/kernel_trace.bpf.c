// SPDX-License-Identifier: GPL-2.0
// agentcell's kernel tracer (record/linux/kernel_trace.py loads it), for the processes running as a
// host uid of the server's range:
// * one event per successful exec, written at the exec, with the new program's argv (read from its
//   fresh stack, where the kernel copied it), the path it was exec'd as, the working directory and the
//   binary (relative to the process's root, as audit's CWD) and its pids at every pid-namespace level:
//   a raw tracepoint on sched_process_exec;
// * one event per exit of a process it reported the exec of (the last of its threads, with its exit
//   code or the killing signal, as wait(2) reports it): a raw tracepoint on sched_process_exit;
// * one event per path syscall refused (open, mkdir, unlink, rename, link, symlink, mknod, chmod, chown,
//   truncate, utime, setxattr), from one of two programs, the loader picks which:
//   - on_cap_denied, a raw tracepoint on cap_capable (6.14+), which fires at every capability check of
//     the host and writes only a failed one made during such a call (a file's permission bits refused
//     the caller, and so did the capability that would override them): costs nothing to a call that
//     checks no capability, which is nearly every call;
//   - on_sys_exit, a raw tracepoint on sys_exit: every path syscall failing with EACCES, EPERM or EROFS
//     (read-only mounts too), at the price of the syscall tracepoint, which puts every syscall of every
//     process of the host on the kernel's slow path (measured: +100-180 ns a syscall).
// Seccomp's refusals are not here: the kernel's audit writes them (SECCOMP records), at no cost to the
// calls it allows.
//
// Built by record/linux/kernel_trace.py with clang -target bpf; the structs below name only the fields read: libbpf
// relocates their offsets against the running kernel's BTF (CO-RE), so no kernel headers are needed.
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

#define ARGS_MAX 65536          // bytes of argv kept (beyond: cut, flagged)
#define CWD_MAX 4096            // bytes of the working directory's components
#define NAME_MAX_B 256          // one component, the exec'd path
#define DEPTH_MAX 64            // components walked up from the working directory
#define LEVELS 4                // pid-namespace levels reported
#define F_ARGS_CUT 1
#define F_CWD_CUT 2
#define F_EXE_CUT 4
#define T_EXEC 1
#define T_DENIAL 2
#define T_EXIT 4
#define EPERM 1
#define EACCES 13
#define EROFS 30
#define CAP_CHOWN 0
#define CAP_DAC_OVERRIDE 1
#define CAP_FOWNER 3
#define CAP_LINUX_IMMUTABLE 9
#define CAP_SYS_RAWIO 17
#define CAP_SYS_PTRACE 19
#define CAP_MKNOD 27
#define PATH_BUF (CWD_MAX + NAME_MAX_B)
#define WINDOW_NS 1000000000ULL  // each uid gets config.budget events per window; beyond: counted

struct qstr { const unsigned char *name; } __attribute__((preserve_access_index));
struct dentry { struct dentry *d_parent; struct qstr d_name; } __attribute__((preserve_access_index));
struct vfsmount { struct dentry *mnt_root; } __attribute__((preserve_access_index));
struct mount { struct mount *mnt_parent; struct dentry *mnt_mountpoint; struct vfsmount mnt; }
    __attribute__((preserve_access_index));
struct path { struct vfsmount *mnt; struct dentry *dentry; } __attribute__((preserve_access_index));
struct fs_struct { struct path root; struct path pwd; } __attribute__((preserve_access_index));
struct upid { int nr; void *ns; } __attribute__((preserve_access_index));  // whole: its size is numbers[]'s stride
struct pid { unsigned int level; struct upid numbers[1]; } __attribute__((preserve_access_index));
struct mm_struct { unsigned long arg_start; unsigned long arg_end; } __attribute__((preserve_access_index));
typedef struct { int counter; } atomic_t;
struct signal_struct { atomic_t live; } __attribute__((preserve_access_index));
struct task_struct {
    int tgid;
    int exit_code;
    struct signal_struct *signal;
    struct task_struct *real_parent;
    struct mm_struct *mm;
    struct fs_struct *fs;
    struct pid *thread_pid;
    char comm[16];
} __attribute__((preserve_access_index));
struct file { struct path f_path; } __attribute__((preserve_access_index));
struct pt_regs { unsigned long dx, si, di, orig_ax, r10; } __attribute__((preserve_access_index));
struct linux_binprm { const char *filename; struct file *file; } __attribute__((preserve_access_index));

struct config { __u32 uid_first; __u32 uid_last; __u32 budget; __u32 _pad; };
struct budget { __u64 window_start; __u64 count; __u64 dropped; };  // per host uid

struct event {
    __u32 type, _pad0;          // T_EXEC
    __u64 ktime_ns;             // CLOCK_MONOTONIC
    __u32 tgid, ppid, uid, flags;
    __u32 level, parent_level;  // the deepest pid namespace's level of the process, of its parent
    __s32 pids[LEVELS], ppids[LEVELS];  // their numbers at levels 0..LEVELS-1 (0: none)
    __u32 file_len, cwd_len, exe_len, args_len;
    char comm[16];
    char file[NAME_MAX_B];
    char cwd[PATH_BUF];  // the working directory's components, innermost first, each NUL-terminated
    char exe[PATH_BUF];  // the file the kernel runs (a script's interpreter), so
    char args[ARGS_MAX];             // argv as on the stack: NUL-separated
};

// a refused path syscall
struct denial {
    __u32 type, tgid;           // T_DENIAL
    __u64 ktime_ns;
    __u32 uid, err, nr, open_flags, level, flags;  // err: the errno; nr: the syscall's number
    __s32 pids[LEVELS];
    __u32 path_len, cwd_len;
    char comm[16];
    char path[PATH_BUF];        // as the call named it
    char cwd[PATH_BUF];         // components, innermost first (for a relative path only)
};

// a process's exit, once its last thread is gone
struct exit_event {
    __u32 type, tgid;           // T_EXIT
    __u64 ktime_ns;
    __u32 uid, status;          // status: as wait(2) reports it (code << 8, or the signal)
};

struct { __uint(type, BPF_MAP_TYPE_RINGBUF); __uint(max_entries, 16 << 20); } events SEC(".maps");
// processes whose exec was reported (tgid -> 1): only their exits are, so a sandbox forking without
// exec'ing writes nothing, and every exit written has its exec before it in the ring
struct { __uint(type, BPF_MAP_TYPE_LRU_HASH); __uint(max_entries, 65536); __type(key, __u32); __type(value, __u8); }
    execd SEC(".maps");
struct { __uint(type, BPF_MAP_TYPE_ARRAY); __uint(max_entries, 1); __type(key, __u32); __type(value, struct config); }
    config SEC(".maps");
// one event being written per CPU (a per-CPU array's values are limited to 32 KiB); the loader sets
// max_entries to the number of possible CPUs
struct { __uint(type, BPF_MAP_TYPE_ARRAY); __uint(max_entries, 1); __type(key, __u32); __type(value, struct event); }
    scratch SEC(".maps");
// uid -> its window: a flooding sandbox's execs are counted, not written (its neighbours' still are)
struct { __uint(type, BPF_MAP_TYPE_LRU_HASH); __uint(max_entries, 65536); __type(key, __u32); __type(value, struct budget); }
    budgets SEC(".maps");
// uids whose execs are not written for now (a sandbox suppressed as a flooder: counted in budgets)
struct { __uint(type, BPF_MAP_TYPE_HASH); __uint(max_entries, 65536); __type(key, __u32); __type(value, __u32); }
    muted SEC(".maps");
// [0]: events lost (the ring was full)
struct { __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY); __uint(max_entries, 1); __type(key, __u32); __type(value, __u64); }
    lost SEC(".maps");

static __always_inline void pids_of(struct task_struct *t, __u32 *level, __s32 *out) {
    struct pid *p = BPF_CORE_READ(t, thread_pid);
    unsigned int l = BPF_CORE_READ(p, level);
    *level = l;
    #pragma unroll
    for (int i = 0; i < LEVELS; i++) {
        out[i] = 0;
        if (i <= l)
            out[i] = BPF_CORE_READ(p, numbers[i].nr);
    }
}

struct walk {
    char *buf;  // PATH_BUF bytes
    __u32 *flags;
    __u32 cut;
    struct dentry *dentry, *root_dentry;
    struct vfsmount *vfsmnt, *root_mnt;
    struct mount *mnt;
    __u32 off;
    int done;
};

static long cwd_step(__u32 i, struct walk *w) {
    // locals: CO-RE reads through a member of `struct walk` would relocate against it too
    struct dentry *dentry = w->dentry;
    struct vfsmount *vfsmnt = w->vfsmnt;
    struct mount *mnt = w->mnt;
    if (dentry == w->root_dentry && vfsmnt == w->root_mnt)
        return 1;
    struct dentry *parent = BPF_CORE_READ(dentry, d_parent);
    struct dentry *mnt_root = BPF_CORE_READ(vfsmnt, mnt_root);
    if (dentry == mnt_root || dentry == parent) {
        struct mount *up = BPF_CORE_READ(mnt, mnt_parent);
        if (up == mnt)
            return 1;  // the top of the mount tree, outside the process's root: stop
        w->dentry = BPF_CORE_READ(mnt, mnt_mountpoint);
        w->mnt = up;
        w->vfsmnt = (struct vfsmount *)((char *)up + bpf_core_field_offset(struct mount, mnt));
        return 0;
    }
    __u32 off = w->off;
    if (off >= CWD_MAX) {
        *w->flags |= w->cut;
        return 1;
    }
    const unsigned char *name = BPF_CORE_READ(dentry, d_name.name);
    long n = bpf_probe_read_kernel_str(&w->buf[off & (CWD_MAX - 1)], NAME_MAX_B, name);
    if (n > 0)
        w->off = off + n;
    w->dentry = parent;
    return 0;
}

// The uid's window (and not muted): else counted as dropped.
static __always_inline int within_budget(struct config *cfg, __u32 uid, __u64 now) {
    struct budget *b = bpf_map_lookup_elem(&budgets, &uid);
    if (!b) {
        struct budget fresh = { .window_start = now };
        bpf_map_update_elem(&budgets, &uid, &fresh, BPF_NOEXIST);
        b = bpf_map_lookup_elem(&budgets, &uid);
        if (!b)
            return 0;
    }
    if (now - b->window_start >= WINDOW_NS) {
        b->window_start = now;
        b->count = 0;
    }
    if (++b->count > cfg->budget || bpf_map_lookup_elem(&muted, &uid)) {
        __sync_fetch_and_add(&b->dropped, 1);
        return 0;
    }
    return 1;
}

static __always_inline struct config *ours(__u32 uid) {
    __u32 zero = 0;
    struct config *cfg = bpf_map_lookup_elem(&config, &zero);
    return cfg && uid >= cfg->uid_first && uid <= cfg->uid_last ? cfg : 0;
}

static __always_inline void send(void *e, __u64 size) {
    if (bpf_ringbuf_output(&events, e, size, 0) != 0) {
        __u32 zero = 0;
        __u64 *count = bpf_map_lookup_elem(&lost, &zero);
        if (count)
            __sync_fetch_and_add(count, 1);
    }
}

// This CPU's scratch event, if the uid is within its budget (else counted as dropped): NULL to skip.
static __always_inline void *claim(struct config *cfg, __u32 uid, __u64 now) {
    if (!within_budget(cfg, uid, now))
        return 0;
    __u32 cpu = bpf_get_smp_processor_id();
    return bpf_map_lookup_elem(&scratch, &cpu);
}

// The path of (vfsmnt, dentry) up to the root of `fs` into buf (components, innermost first; `cut`
// into *flags if it did not fit); its length.
static __always_inline __u32 walk_path(struct fs_struct *fs, struct vfsmount *vfsmnt, struct dentry *dentry,
                                       char *buf, __u32 *flags, __u32 cut) {
    struct walk w = { .buf = buf, .flags = flags, .cut = cut, .off = 0, .dentry = dentry, .vfsmnt = vfsmnt,
                      .root_dentry = BPF_CORE_READ(fs, root.dentry), .root_mnt = BPF_CORE_READ(fs, root.mnt) };
    w.mnt = (struct mount *)((char *)vfsmnt - bpf_core_field_offset(struct mount, mnt));
    bpf_loop(DEPTH_MAX, cwd_step, &w, 0);
    return w.off;
}

SEC("raw_tp/sched_process_exec")
int on_exec(__u64 *ctx) {
    __u32 uid = (__u32)bpf_get_current_uid_gid();
    struct config *cfg = ours(uid);
    if (!cfg)
        return 0;
    __u64 now = bpf_ktime_get_ns();
    struct event *e = claim(cfg, uid, now);
    if (!e)
        return 0;
    e->type = T_EXEC;

    struct task_struct *t = (struct task_struct *)ctx[0];
    struct linux_binprm *bprm = (struct linux_binprm *)ctx[2];
    e->ktime_ns = now;
    e->tgid = BPF_CORE_READ(t, tgid);
    e->uid = uid;
    e->flags = 0;
    struct task_struct *parent = BPF_CORE_READ(t, real_parent);
    e->ppid = BPF_CORE_READ(parent, tgid);
    pids_of(t, &e->level, e->pids);
    pids_of(parent, &e->parent_level, e->ppids);
    bpf_probe_read_kernel_str(e->comm, sizeof(e->comm), &t->comm);
    long n = bpf_probe_read_kernel_str(e->file, NAME_MAX_B, BPF_CORE_READ(bprm, filename));
    e->file_len = n > 0 ? n : 0;

    struct fs_struct *fs = BPF_CORE_READ(t, fs);
    e->cwd_len = walk_path(fs, BPF_CORE_READ(fs, pwd.mnt), BPF_CORE_READ(fs, pwd.dentry), e->cwd, &e->flags, F_CWD_CUT);
    struct file *exe = BPF_CORE_READ(bprm, file);
    e->exe_len = walk_path(fs, BPF_CORE_READ(exe, f_path.mnt), BPF_CORE_READ(exe, f_path.dentry), e->exe, &e->flags,
                           F_EXE_CUT);

    unsigned long start = BPF_CORE_READ(t, mm, arg_start), end = BPF_CORE_READ(t, mm, arg_end);
    __u64 len = end > start ? end - start : 0;
    if (len > ARGS_MAX) {
        len = ARGS_MAX;
        e->flags |= F_ARGS_CUT;
    }
    if (bpf_probe_read_user(e->args, len, (void *)start) != 0)
        len = 0;
    e->args_len = len;
    send(e, __builtin_offsetof(struct event, args) + len);
    __u32 tgid = e->tgid;
    __u8 one = 1;
    bpf_map_update_elem(&execd, &tgid, &one, BPF_ANY);
    return 0;
}

SEC("raw_tp/sched_process_exit")
int on_exit(__u64 *ctx) {
    struct task_struct *t = (struct task_struct *)ctx[0];
    if (BPF_CORE_READ(t, signal, live.counter) != 0)
        return 0;  // a thread: the process lives on
    __u32 tgid = BPF_CORE_READ(t, tgid);
    if (!bpf_map_lookup_elem(&execd, &tgid))
        return 0;
    bpf_map_delete_elem(&execd, &tgid);
    struct exit_event x = { .type = T_EXIT, .tgid = tgid, .ktime_ns = bpf_ktime_get_ns(),
                            .uid = (__u32)bpf_get_current_uid_gid(), .status = BPF_CORE_READ(t, exit_code) };
    send(&x, sizeof(x));
    return 0;
}

// -- refused path syscalls ------------------------------------------------------------------------
#define O_WRONLY 01
#define O_CREAT 0100
#define O_TRUNC 01000

// The refused path syscall `nr` of the current task (its registers `regs`), with `err`, if its path
// argument can be read: one denial event.
static __always_inline int path_denial(struct config *cfg, __u32 uid, struct pt_regs *regs, __u32 nr, __u32 err) {
    unsigned long path, flags = 0;
    switch (nr) {  // x86_64 numbers: where each call has the path it is refused on
    case 2:  // open(path, flags)
        path = BPF_CORE_READ(regs, di);
        flags = BPF_CORE_READ(regs, si);
        break;
    case 85:  // creat
        path = BPF_CORE_READ(regs, di);
        flags = O_WRONLY | O_CREAT | O_TRUNC;
        break;
    case 76: case 83: case 87: case 84: case 82: case 90: case 92: case 94: case 133: case 132: case 235:
    case 188: case 189:  // truncate mkdir unlink rmdir rename chmod chown lchown mknod utime utimes setxattr lsetxattr
        path = BPF_CORE_READ(regs, di);
        break;
    case 86: case 88:  // link(old, new), symlink(target, new): the new name
        path = BPF_CORE_READ(regs, si);
        break;
    case 257:  // openat(dfd, path, flags)
        path = BPF_CORE_READ(regs, si);
        flags = BPF_CORE_READ(regs, dx);
        break;
    case 437: {  // openat2(dfd, path, how): how->flags is its first field
        path = BPF_CORE_READ(regs, si);
        __u64 how = 0;
        bpf_probe_read_user(&how, sizeof(how), (void *)BPF_CORE_READ(regs, dx));
        flags = how;
        break;
    }
    case 258: case 263: case 264: case 316: case 268: case 452: case 260: case 259: case 280:
        // mkdirat unlinkat renameat renameat2 fchmodat fchmodat2 fchownat mknodat utimensat (dfd, path, ...)
        path = BPF_CORE_READ(regs, si);
        break;
    case 265:  // linkat(olddfd, old, newdfd, new)
        path = BPF_CORE_READ(regs, r10);
        break;
    case 266:  // symlinkat(target, newdfd, new)
        path = BPF_CORE_READ(regs, dx);
        break;
    default:
        return 0;
    }
    if (!path)
        return 0;  // utimensat on an fd
    __u64 now = bpf_ktime_get_ns();
    struct denial *d = claim(cfg, uid, now);
    if (!d)
        return 0;
    struct task_struct *t = (struct task_struct *)bpf_get_current_task();
    d->type = T_DENIAL;
    d->tgid = bpf_get_current_pid_tgid() >> 32;
    d->ktime_ns = now;
    d->uid = uid;
    d->err = err;
    d->nr = nr;
    d->open_flags = flags;
    d->flags = 0;
    pids_of(t, &d->level, d->pids);
    bpf_get_current_comm(d->comm, sizeof(d->comm));
    // read from the caller's memory: what it named (a racing thread of its own could change it
    // meanwhile: the path is the process's word, the refusal and the rest are the kernel's)
    long n = bpf_probe_read_user_str(d->path, PATH_BUF, (void *)path);
    d->path_len = n > 0 ? n : 0;
    d->cwd_len = 0;
    if (n > 0 && d->path[0] != '/') {  // relative: where the caller was
        struct fs_struct *fs = BPF_CORE_READ(t, fs);
        d->cwd_len = walk_path(fs, BPF_CORE_READ(fs, pwd.mnt), BPF_CORE_READ(fs, pwd.dentry), d->cwd, &d->flags,
                               F_CWD_CUT);
    }
    send(d, sizeof(*d));
    return 0;
}

// cap_capable(cred, target_ns, capable_ns, cap, ret): a capability refused during a path syscall, one
// whose refusal fails the call. The file permission check (generic_permission) asks for CAP_DAC_OVERRIDE
// last when the mode bits refuse (after CAP_DAC_READ_SEARCH for a read: not reported, so one refusal
// is one event); /proc/<pid>/ files ask for CAP_SYS_PTRACE; chmod, utimes, O_NOATIME, a sticky
// directory's unlink for CAP_FOWNER; chown for CAP_CHOWN; mknod for CAP_MKNOD. Not CAP_FSETID (a chmod
// that only drops the set-group-ID bit succeeds) nor CAP_SYS_ADMIN/CAP_SYS_RESOURCE (asked without
// failing the call, e.g. by every mmap), and two that may fail in a call that then succeeds (below).
// Unseen: a refusal by the mode bits alone (exec of a file without an x bit), to a process that has
// the capability in its user namespace but the file's owner is not mapped there (the sandbox's root on
// a host-owned file), a link(2) refused by the mode bits, and read-only mounts (EROFS).
SEC("raw_tp/cap_capable")
int on_cap_denied(__u64 *ctx) {
    if ((int)ctx[4] == 0)
        return 0;  // granted: every check of a privileged process stops here
    __u32 err;
    switch ((int)ctx[3]) {
    case CAP_DAC_OVERRIDE: case CAP_SYS_PTRACE:
        err = EACCES;
        break;
    case CAP_FOWNER: case CAP_CHOWN: case CAP_MKNOD: case CAP_LINUX_IMMUTABLE: case CAP_SYS_RAWIO:
        err = EPERM;
        break;
    default:
        return 0;
    }
    __u32 uid = (__u32)bpf_get_current_uid_gid();
    struct config *cfg = ours(uid);
    if (!cfg)
        return 0;
    struct pt_regs *regs = (struct pt_regs *)bpf_task_pt_regs((struct task_struct *)bpf_get_current_task_btf());
    __u32 nr = BPF_CORE_READ(regs, orig_ax);
    // checks that may fail without failing the call: link(2) under protected_hardlinks asks whether the
    // caller may read and write the file, then lets its owner link it anyway (git links its read-only
    // objects); utimes(2) to "now" asks whether the caller owns the file, then lets a writer do it
    if ((int)ctx[3] == CAP_DAC_OVERRIDE && (nr == 86 || nr == 265))  // link, linkat
        return 0;
    if ((int)ctx[3] == CAP_FOWNER && (nr == 132 || nr == 235 || nr == 280))  // utime, utimes, utimensat
        return 0;
    return path_denial(cfg, uid, regs, nr, err);
}

SEC("raw_tp/sys_exit")
int on_sys_exit(__u64 *ctx) {
    long ret = (long)ctx[1];
    if (ret != -EACCES && ret != -EPERM && ret != -EROFS)
        return 0;  // every syscall that did not fail so stops here
    __u32 uid = (__u32)bpf_get_current_uid_gid();
    struct config *cfg = ours(uid);
    if (!cfg)
        return 0;
    struct pt_regs *regs = (struct pt_regs *)ctx[0];
    return path_denial(cfg, uid, regs, BPF_CORE_READ(regs, orig_ax), -ret);
}


char LICENSE[] SEC("license") = "GPL";
