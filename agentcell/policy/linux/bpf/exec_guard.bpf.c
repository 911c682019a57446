// SPDX-License-Identifier: GPL-2.0
// The exec policy's backstop (policy/linux/exec_guard.py loads it): a raw tracepoint on
// sched_process_exec that kills (SIGKILL) a process of a guarded host uid whose exec started a program
// the exec gate (fanotify FAN_OPEN_EXEC_PERM on the sandbox's mounts) cannot judge:
// * R_LOADER: the ELF loader run as the main program (`ld.so /bin/x`, or a script whose "#!" names the
//   loader): the file the kernel runs is named as a shared object is (*.so, *.so.*: ld-linux-*.so.2,
//   musl's libc.so) and the kernel loaded no interpreter for it (AT_BASE == 0 in the new program's
//   auxiliary vector: glibc's libc.so.6, which runs to print its version, has one). Every
//   dynamic exec opens the loader as its interpreter, so the gate must allow the file itself; here the
//   loader would then open and map any file with plain open(2)/mmap(2), which no exec check sees;
// * R_INTERNAL: a file on a kernel-internal mount (MNT_INTERNAL: kern_mount()'s, e.g. the shmem mount
//   of memfd_create(2) files, exec'd through /proc/self/fd/N or execveat(AT_EMPTY_PATH)), or on a
//   superblock users cannot mount (SB_NOUSER): no mount of the sandbox holds it, so no mark sees it.
//   (Not SB_KERNMOUNT: devtmpfs mounted by users shares its kernel mount's superblock.)
// The tracepoint fires after the point of no return of execve, before the new program's first
// instruction: the signal is pending when the exec returns to user space, where it is taken first, so
// the new program runs nothing. Each kill is one event in the ring (bounded per uid and second).
//
// CO-RE like the kernel tracer (record/linux/bpf/kernel_trace.bpf.c): the structs name only the fields
// read; libbpf relocates their offsets against the running kernel's BTF.
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

#define NAME_B 256               // bytes of the exec'd path and of the file's name kept
#define NAME_SCAN 64             // bytes of the file's name looked at for a loader's name
#define AUXV_PAIRS 32            // auxiliary vector entries looked through for AT_BASE
#define AT_NULL 0
#define AT_BASE 7
#define SIGKILL 9
#define MNT_INTERNAL 0x4000
#define SB_NOUSER (1UL << 31)
#define ALLOW_LOADER 1           // guarded flags: what this uid may run anyway
#define ALLOW_INTERNAL 2
#define R_LOADER 1               // why a process was killed
#define R_INTERNAL 2
#define WINDOW_NS 1000000000ULL  // each uid gets config.budget events per window; beyond: counted

struct qstr { const unsigned char *name; } __attribute__((preserve_access_index));
struct dentry { struct qstr d_name; } __attribute__((preserve_access_index));
struct super_block { unsigned long s_flags; } __attribute__((preserve_access_index));
struct vfsmount { struct super_block *mnt_sb; int mnt_flags; } __attribute__((preserve_access_index));
struct path { struct vfsmount *mnt; struct dentry *dentry; } __attribute__((preserve_access_index));
struct file { struct path f_path; } __attribute__((preserve_access_index));
struct linux_binprm { struct file *file; const char *filename; } __attribute__((preserve_access_index));
struct mm_struct { unsigned long saved_auxv[2]; } __attribute__((preserve_access_index));
struct task_struct { int tgid; char comm[16]; struct mm_struct *mm; } __attribute__((preserve_access_index));

struct config { __u32 budget, pad; };
struct budget { __u64 window_start, count, dropped; };

// one kill
struct kill {
    __u64 ktime_ns;
    __u32 uid, tgid, reason, signal_err;  // signal_err: bpf_send_signal's result (0: sent)
    char comm[16];                        // the new program's name (the kernel set it from the path)
    char filename[NAME_B];                // the path as exec'd (/dev/fd/N for execveat(fd, "", AT_EMPTY_PATH))
    char name[NAME_B];                    // the file's own name ("memfd:<name>" for a memfd)
};

struct { __uint(type, BPF_MAP_TYPE_RINGBUF); __uint(max_entries, 1 << 20); } kills SEC(".maps");
// host uid -> ALLOW_* flags: the uids guarded
struct { __uint(type, BPF_MAP_TYPE_HASH); __uint(max_entries, 65536); __type(key, __u32); __type(value, __u32); }
    guarded SEC(".maps");
struct { __uint(type, BPF_MAP_TYPE_ARRAY); __uint(max_entries, 1); __type(key, __u32); __type(value, struct config); }
    config SEC(".maps");
// uid -> its window: a sandbox killing itself in a loop writes config.budget events a second, its
// neighbours' still get theirs
struct { __uint(type, BPF_MAP_TYPE_LRU_HASH); __uint(max_entries, 65536); __type(key, __u32); __type(value, struct budget); }
    budgets SEC(".maps");
// [0]: events lost (the ring was full)
struct { __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY); __uint(max_entries, 1); __type(key, __u32); __type(value, __u64); }
    lost SEC(".maps");

// A shared object's name: ".so" ending it or followed by '.' (glibc's ld-linux-x86-64.so.2, ld-2.31.so,
// musl's ld-musl-x86_64.so.1 or the libc.so it links to, ld64.so.2, libc.musl-x86_64.so.1). Programs are
// not named so; the loaders are, and musl's loader is its libc.so (Debian: /lib/ld-musl-x86_64.so.1 ->
// x86_64-linux-musl/libc.so), so a fixed list of loader names would miss it.
static __always_inline int shared_object_name(const char *n) {
    #pragma unroll
    for (int i = 0; i < NAME_SCAN - 3; i++) {
        if (n[i] == 0)
            return 0;
        if (n[i] == '.' && n[i + 1] == 's' && n[i + 2] == 'o' && (n[i + 3] == 0 || n[i + 3] == '.'))
            return 1;
    }
    return 0;
}

// The kernel loaded an interpreter for the new program (AT_BASE, its load address, is not 0). The
// loader run directly has none; every dynamically linked program has one.
static __always_inline int has_interpreter(struct task_struct *t) {
    struct mm_struct *mm = BPF_CORE_READ(t, mm);
    unsigned long *auxv = (unsigned long *)((char *)mm + bpf_core_field_offset(struct mm_struct, saved_auxv));
    for (int i = 0; i < AUXV_PAIRS; i++) {
        unsigned long pair[2];
        if (bpf_probe_read_kernel(pair, sizeof(pair), &auxv[2 * i]) != 0 || pair[0] == AT_NULL)
            return 0;
        if (pair[0] == AT_BASE)
            return pair[1] != 0;
    }
    return 0;
}

static __always_inline int within_budget(__u32 uid, __u64 now) {
    __u32 zero = 0;
    struct config *cfg = bpf_map_lookup_elem(&config, &zero);
    if (!cfg)
        return 0;
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
    if (++b->count > cfg->budget) {
        __sync_fetch_and_add(&b->dropped, 1);
        return 0;
    }
    return 1;
}

SEC("raw_tp/sched_process_exec")
int on_exec(__u64 *ctx) {
    __u32 uid = (__u32)bpf_get_current_uid_gid();
    __u32 *flags = bpf_map_lookup_elem(&guarded, &uid);
    if (!flags)
        return 0;  // every process of an unguarded uid stops here
    __u32 allow = *flags;
    struct task_struct *t = (struct task_struct *)ctx[0];
    struct linux_binprm *bprm = (struct linux_binprm *)ctx[2];
    struct file *file = BPF_CORE_READ(bprm, file);
    struct vfsmount *mnt = BPF_CORE_READ(file, f_path.mnt);
    char name[NAME_SCAN] = {};
    bpf_probe_read_kernel_str(name, sizeof(name), BPF_CORE_READ(file, f_path.dentry, d_name.name));

    __u32 reason = 0;
    if (!(allow & ALLOW_INTERNAL) &&
        ((BPF_CORE_READ(mnt, mnt_flags) & MNT_INTERNAL) || (BPF_CORE_READ(mnt, mnt_sb, s_flags) & SB_NOUSER)))
        reason = R_INTERNAL;
    else if (!(allow & ALLOW_LOADER) && shared_object_name(name) && !has_interpreter(t))
        reason = R_LOADER;
    if (!reason)
        return 0;

    long err = bpf_send_signal(SIGKILL);  // the process (every thread: exec left one), before user space
    __u64 now = bpf_ktime_get_ns();
    if (!within_budget(uid, now))
        return 0;
    struct kill *k = bpf_ringbuf_reserve(&kills, sizeof(struct kill), 0);
    if (!k) {
        __u32 zero = 0;
        __u64 *count = bpf_map_lookup_elem(&lost, &zero);
        if (count)
            __sync_fetch_and_add(count, 1);
        return 0;
    }
    k->ktime_ns = now;
    k->uid = uid;
    k->tgid = BPF_CORE_READ(t, tgid);
    k->reason = reason;
    k->signal_err = (__u32)-err;
    bpf_probe_read_kernel_str(k->comm, sizeof(k->comm), &t->comm);
    bpf_probe_read_kernel_str(k->filename, sizeof(k->filename), BPF_CORE_READ(bprm, filename));
    bpf_probe_read_kernel_str(k->name, sizeof(k->name), BPF_CORE_READ(file, f_path.dentry, d_name.name));
    bpf_ringbuf_submit(k, 0);
    return 0;
}

char LICENSE[] SEC("license") = "GPL";
