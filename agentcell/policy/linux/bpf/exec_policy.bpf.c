// SPDX-License-Identifier: GPL-2.0
// agentcell's exec policy (policy/linux/exec_lsm.py loads it): BPF LSM programs deciding, for the
// processes of a sandbox (its host uids -> its slot and default mode, map `sandboxes`), which files may
// start as programs. A file's verdicts live on its inode (map `files`, inode storage: one bit a slot
// in `allow` and `deny`, the LOADER flag), so every name of it (hard links, symlinks, /proc/self/fd,
// bind mounts) is the same file, and a copy is another one. One-shot approvals are entries of `once`,
// (file id, slot), deleted by the exec they let through: exactly one exec each, even when two race.
//
// * bprm_check_security, at every round of the exec (a script's interpreter is a second round, with
//   bprm->file and bprm->buf its own): deny bit -> EACCES; allow bit -> ok; a `once` entry -> consume
//   it, ok; the ELF loader exec'd directly (`ld.so /bin/x`) -> EACCES unless the mode is allow; mode
//   allow -> ok; a "#!" script -> ok (its interpreter is checked at the next round); else EACCES.
// * mmap_file and file_mprotect: PROT_EXEC of a file with the deny bit -> EACCES (`ld.so /bin/denied`
//   maps it; it never exec's it). file_mprotect sees the file the mapping is of, which for a file of
//   an overlayfs is its upper/lower file, not the one marked: see exec_lsm.py's limits.
// Every refusal is written to the ring `refusals` (counted in `lost` when it is full).
//
// Built like record/linux/bpf/kernel_trace.bpf.c (bpf_build.py): the structs name only the fields
// read, libbpf relocates them against the running kernel's BTF (CO-RE).
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>

#define SLOTS 1024
#define WORDS (SLOTS / 64)
#define MODE_ALLOW 0
#define MODE_DENY 1
#define MODE_ASK 2
#define F_LOADER 1
#define EACCES 13
#define PROT_EXEC 4
#define NAME_MAX_B 256
#define H_EXEC 1
#define H_MMAP 2
#define H_MPROTECT 3

struct qstr { const unsigned char *name; } __attribute__((preserve_access_index));
struct inode { unsigned long i_ino; } __attribute__((preserve_access_index));
struct dentry { struct qstr d_name; } __attribute__((preserve_access_index));
struct path { struct dentry *dentry; } __attribute__((preserve_access_index));
struct file { struct inode *f_inode; struct path f_path; } __attribute__((preserve_access_index));
struct linux_binprm { const char *filename; struct file *file; char buf[256]; } __attribute__((preserve_access_index));
struct vm_area_struct { struct file *vm_file; } __attribute__((preserve_access_index));

struct sandbox { __u32 slot; __u32 mode; };
struct marks { __u64 allow[WORDS]; __u64 deny[WORDS]; __u32 flags; __u32 id; };  // id: once's key, set by the server
struct once_key { __u32 id; __u32 slot; };
struct refusal {
    __u64 ktime_ns;
    __u32 uid, tgid, slot, hook;  // hook: H_*
    __u32 id, _pad;               // the file's id (0: no marks)
    char comm[16];
    char name[NAME_MAX_B];        // exec: the path as exec'd (or the interpreter's); mmap: the file's name
};

struct { __uint(type, BPF_MAP_TYPE_HASH); __uint(max_entries, 65536); __type(key, __u32); __type(value, struct sandbox); }
    sandboxes SEC(".maps");
struct { __uint(type, BPF_MAP_TYPE_INODE_STORAGE); __uint(map_flags, BPF_F_NO_PREALLOC); __type(key, int);
         __type(value, struct marks); } files SEC(".maps");
struct { __uint(type, BPF_MAP_TYPE_HASH); __uint(max_entries, 65536); __type(key, struct once_key); __type(value, __u8); }
    once SEC(".maps");
struct { __uint(type, BPF_MAP_TYPE_RINGBUF); __uint(max_entries, 256 << 10); } refusals SEC(".maps");
struct { __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY); __uint(max_entries, 1); __type(key, __u32); __type(value, __u64); }
    lost SEC(".maps");

// An earlier program's refusal, passed on: within the range the verifier lets an LSM program return
// (-MAX_ERRNO..0), whatever the argument held.
static __always_inline int passed_on(int ret) {
    return ret < -4095 || ret > 0 ? -EACCES : ret;
}

static __always_inline int bit(const __u64 *words, __u32 slot) {
    return (words[(slot / 64) & (WORDS - 1)] >> (slot % 64)) & 1;
}

static __always_inline int refuse(struct sandbox *sb, __u32 uid, __u32 hook, struct marks *m, const void *name) {
    struct refusal *r = bpf_ringbuf_reserve(&refusals, sizeof(*r), 0);
    if (!r) {
        __u32 zero = 0;
        __u64 *count = bpf_map_lookup_elem(&lost, &zero);
        if (count)
            __sync_fetch_and_add(count, 1);
        return -EACCES;
    }
    r->ktime_ns = bpf_ktime_get_ns();
    r->uid = uid;
    r->tgid = bpf_get_current_pid_tgid() >> 32;
    r->slot = sb->slot;
    r->hook = hook;
    r->id = m ? m->id : 0;
    r->_pad = 0;
    bpf_get_current_comm(r->comm, sizeof(r->comm));
    r->name[0] = 0;
    bpf_probe_read_kernel_str(r->name, sizeof(r->name), name);
    bpf_ringbuf_submit(r, 0);
    return -EACCES;
}

SEC("lsm/bprm_check_security")
int BPF_PROG(check_exec, struct linux_binprm *bprm, int ret) {
    if (ret)
        return passed_on(ret);  // refused already
    __u32 uid = (__u32)bpf_get_current_uid_gid();
    struct sandbox *sb = bpf_map_lookup_elem(&sandboxes, &uid);
    if (!sb)
        return 0;  // not a sandbox's process: not ours to decide
    __u32 slot = sb->slot;
    struct file *file = bprm->file;
    struct marks *m = bpf_inode_storage_get(&files, file->f_inode, 0, 0);
    if (m) {
        if (bit(m->deny, slot))
            return refuse(sb, uid, H_EXEC, m, bprm->filename);
        if (bit(m->allow, slot))
            return 0;
        struct once_key k = { .id = m->id, .slot = slot };
        if (m->id && bpf_map_delete_elem(&once, &k) == 0)
            return 0;  // deleted by this exec: a racing one finds no entry
        if ((m->flags & F_LOADER) && sb->mode != MODE_ALLOW)
            return refuse(sb, uid, H_EXEC, m, bprm->filename);
    }
    if (sb->mode == MODE_ALLOW)
        return 0;
    if (bprm->buf[0] == '#' && bprm->buf[1] == '!')
        return 0;  // a script: the kernel checks its interpreter at the next round
    return refuse(sb, uid, H_EXEC, m, bprm->filename);
}

// PROT_EXEC of `file` by the current process: refused if the file is denied to its sandbox.
static __always_inline int check_map(struct file *file, unsigned long prot, __u32 hook) {
    if (!file || !(prot & PROT_EXEC))
        return 0;
    __u32 uid = (__u32)bpf_get_current_uid_gid();
    struct sandbox *sb = bpf_map_lookup_elem(&sandboxes, &uid);
    if (!sb)
        return 0;
    struct marks *m = bpf_inode_storage_get(&files, file->f_inode, 0, 0);
    if (m && bit(m->deny, sb->slot))
        return refuse(sb, uid, hook, m, file->f_path.dentry->d_name.name);
    return 0;
}

SEC("lsm/mmap_file")
int BPF_PROG(check_mmap, struct file *file, unsigned long reqprot, unsigned long prot, unsigned long flags, int ret) {
    if (ret)
        return passed_on(ret);
    return check_map(file, prot, H_MMAP);
}

SEC("lsm/file_mprotect")
int BPF_PROG(check_mprotect, struct vm_area_struct *vma, unsigned long reqprot, unsigned long prot, int ret) {
    if (ret)
        return passed_on(ret);
    return check_map(vma->vm_file, prot, H_MPROTECT);
}

char LICENSE[] SEC("license") = "GPL";
