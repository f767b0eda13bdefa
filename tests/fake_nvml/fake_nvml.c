/*
 * fake_nvml.c - a stand-in for the NVIDIA Management Library (libnvidia-ml.so.1).
 *
 * It exports the NVML entry points that the nvidia-ml-py binding (pynvml) calls to
 * enumerate GPUs and read their memory and processes.  Every figure comes from a
 * plain-text state file (format v1, see docs/development.md) named by
 * $FAKE_NVML_STATE, else /etc/fake-nvml/state.  The file is read again on every call
 * that reports state, so a writer can change GPUs and processes between samples.
 *
 * Struct layouts, symbol names and version constants follow nvml.h as used by
 * nvidia-ml-py 13.x.  Build:
 *   cc -shared -fPIC -O2 -Wall -Wextra -Werror -Wl,-soname,libnvidia-ml.so.1 -o libnvidia-ml.so.1 fake_nvml.c
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))

typedef int nvmlReturn_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

#define NVML_MEMORY_V2_VERSION 0x02000028u /* NVML_STRUCT_VERSION(Memory, 2) */
#define NVML_NOT_MIG 0xFFFFFFFFu

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    char busId[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    unsigned int reserved0, reserved1, reserved2, reserved3;
} nvmlPciInfo_v2_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t; /* v2 and v3 share this layout */

/* ------------------------------------------------------------------ state */

#define MAX_GPUS 64
#define MAX_PROCS 1024
#define MAX_NOISE 64
#define MAX_MISSING 64
#define STR 128
#define MAX_STATE_BYTES (1 << 20)
#define MAX_UNSUPPORTED 16
#define MAX_XIDS 32
#define MAX_EVENT_SETS 16
#define NVML_EVENT_TYPE_XID 0x0000000000000008ULL /* nvmlEventTypeXidCriticalError */

struct fake_gpu {
    int present;
    unsigned int index;
    char uuid[STR];
    char name[STR];
    char pci[STR];
    unsigned int pci_id;
    unsigned long long total, reserved, base_used;
    int has_free_override;
    unsigned long long free_override;
    int cc_major, cc_minor;
    int error;
    int n_noise;
    unsigned long long noise[MAX_NOISE];
    /* health: ECC mode and volatile/aggregate uncorrectable errors, remapped rows, retired pages */
    int ecc_mode;
    unsigned long long ecc_uncorrected_volatile, ecc_uncorrected_aggregate;
    unsigned int remap_corrected, remap_uncorrected, remap_pending, remap_failure;
    int retired_pending;
    /* unsupported=f1,f2: these functions answer NVML_ERROR_NOT_SUPPORTED on this GPU */
    int n_unsupported;
    char unsupported[MAX_UNSUPPORTED][STR];
    /* xid=48,79: Xid events every event set registered on this GPU receives, once each */
    int n_xids;
    unsigned long long xids[MAX_XIDS];
};

#define KIND_COMPUTE 1
#define KIND_GRAPHICS 2

struct fake_proc {
    unsigned int gpu;
    unsigned int pid;
    unsigned long long used;
    int kinds;
    int other_pidns; /* pidns=other: a process of another pid namespace, not looked up in /proc */
};

struct fake_state {
    char driver[STR];
    int cuda;
    char nvml[STR];
    int init_error;
    int n_missing;
    char missing[MAX_MISSING][STR];
    int n_gpus;
    struct fake_gpu gpus[MAX_GPUS]; /* slot i holds the GPU whose index is i */
    int n_procs;
    struct fake_proc procs[MAX_PROCS];
};

/* The handle given to callers points into this array: handle - g_handles == index. */
struct fake_handle {
    unsigned int index;
};
static struct fake_handle g_handles[MAX_GPUS];

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
/* Two buffers: a read parses into the spare one and swaps it in only when it is valid. */
static struct fake_state g_buffers[2];
static int g_current;
#define g_state (g_buffers[g_current])
static int g_init_count;
static unsigned long long g_noise_reads[MAX_GPUS];

static const char *state_path(void)
{
    const char *p = getenv("FAKE_NVML_STATE");
    return (p && *p) ? p : "/etc/fake-nvml/state";
}

static int hexval(int c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Percent-decode src into dst (at most dstlen-1 bytes); returns 0 or -1 when too long / malformed. */
static int pct_decode(const char *src, char *dst, size_t dstlen)
{
    size_t n = 0;
    for (; *src; src++) {
        int c = (unsigned char)*src;
        if (c == '%') {
            int hi = hexval((unsigned char)src[1]);
            int lo = hi < 0 ? -1 : hexval((unsigned char)src[2]);
            if (hi < 0 || lo < 0)
                return -1;
            c = hi * 16 + lo;
            src += 2;
        }
        if (n + 1 >= dstlen)
            return -1;
        dst[n++] = (char)c;
    }
    dst[n] = '\0';
    return 0;
}

static int parse_ull(const char *s, unsigned long long *out)
{
    char *end;
    if (!*s || *s == '-')
        return -1;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || *end)
        return -1;
    *out = v;
    return 0;
}

static int parse_int(const char *s, int *out)
{
    unsigned long long v;
    if (parse_ull(s, &v) || v > 0x7fffffffULL)
        return -1;
    *out = (int)v;
    return 0;
}

/* List values are decoded first, then split on ',' (writers may or may not encode the commas). */
static int parse_ull_list(const char *s, unsigned long long *out, int max, int *n)
{
    char buf[8192];
    *n = 0;
    if (!*s)
        return 0;
    if (pct_decode(s, buf, sizeof buf))
        return -1;
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (*n >= max || parse_ull(tok, &out[*n]))
            return -1;
        (*n)++;
    }
    return 0;
}

static int parse_name_list(const char *s, char (*out)[STR], int max, int *n)
{
    char buf[8192];
    *n = 0;
    if (!*s)
        return 0;
    if (pct_decode(s, buf, sizeof buf))
        return -1;
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (*n >= max || strlen(tok) >= STR)
            return -1;
        strcpy(out[*n], tok);
        (*n)++;
    }
    return 0;
}

static int parse_uint(const char *s, unsigned int *out)
{
    unsigned long long v;
    if (parse_ull(s, &v) || v > 0xffffffffULL)
        return -1;
    *out = (unsigned int)v;
    return 0;
}

static int parse_missing(const char *s, struct fake_state *st)
{
    return parse_name_list(s, st->missing, MAX_MISSING, &st->n_missing);
}

static int parse_cc(const char *s, struct fake_gpu *g)
{
    int major, minor, used = 0;
    if (sscanf(s, "%d.%d%n", &major, &minor, &used) != 2 || s[used] != '\0')
        return -1;
    g->cc_major = major;
    g->cc_minor = minor;
    return 0;
}

/* Apply one key=value token (value still percent-encoded) to the record being parsed. */
static int apply_system(struct fake_state *st, const char *key, const char *raw)
{
    if (!strcmp(key, "missing"))
        return parse_missing(raw, st);
    char val[STR];
    if (pct_decode(raw, val, sizeof val))
        return -1;
    if (!strcmp(key, "driver"))
        strcpy(st->driver, val);
    else if (!strcmp(key, "nvml"))
        strcpy(st->nvml, val);
    else if (!strcmp(key, "cuda"))
        return parse_int(val, &st->cuda);
    else if (!strcmp(key, "init_error"))
        return parse_int(val, &st->init_error);
    /* unknown keys are ignored so newer writers stay readable */
    return 0;
}

static int apply_gpu(struct fake_gpu *g, int *have_index, const char *key, const char *raw)
{
    if (!strcmp(key, "noise"))
        return parse_ull_list(raw, g->noise, MAX_NOISE, &g->n_noise);
    if (!strcmp(key, "xid"))
        return parse_ull_list(raw, g->xids, MAX_XIDS, &g->n_xids);
    if (!strcmp(key, "unsupported"))
        return parse_name_list(raw, g->unsupported, MAX_UNSUPPORTED, &g->n_unsupported);
    char val[STR];
    if (pct_decode(raw, val, sizeof val))
        return -1;
    if (!strcmp(key, "index")) {
        int v;
        if (parse_int(val, &v) || v >= MAX_GPUS)
            return -1;
        g->index = (unsigned int)v;
        *have_index = 1;
    } else if (!strcmp(key, "uuid"))
        strcpy(g->uuid, val);
    else if (!strcmp(key, "name"))
        strcpy(g->name, val);
    else if (!strcmp(key, "pci"))
        strcpy(g->pci, val);
    else if (!strcmp(key, "pci_id")) {
        unsigned long long v;
        if (parse_ull(val, &v) || v > 0xffffffffULL)
            return -1;
        g->pci_id = (unsigned int)v;
    } else if (!strcmp(key, "total"))
        return parse_ull(val, &g->total);
    else if (!strcmp(key, "reserved"))
        return parse_ull(val, &g->reserved);
    else if (!strcmp(key, "base_used"))
        return parse_ull(val, &g->base_used);
    else if (!strcmp(key, "free_override")) {
        if (!*val) {
            g->has_free_override = 0;
            return 0;
        }
        g->has_free_override = 1;
        return parse_ull(val, &g->free_override);
    } else if (!strcmp(key, "cc"))
        return parse_cc(val, g);
    else if (!strcmp(key, "error"))
        return parse_int(val, &g->error);
    else if (!strcmp(key, "ecc_mode"))
        return parse_int(val, &g->ecc_mode);
    else if (!strcmp(key, "ecc_uncorrected_volatile"))
        return parse_ull(val, &g->ecc_uncorrected_volatile);
    else if (!strcmp(key, "ecc_uncorrected_aggregate"))
        return parse_ull(val, &g->ecc_uncorrected_aggregate);
    else if (!strcmp(key, "remap_corrected"))
        return parse_uint(val, &g->remap_corrected);
    else if (!strcmp(key, "remap_uncorrected"))
        return parse_uint(val, &g->remap_uncorrected);
    else if (!strcmp(key, "remap_pending"))
        return parse_uint(val, &g->remap_pending);
    else if (!strcmp(key, "remap_failure"))
        return parse_uint(val, &g->remap_failure);
    else if (!strcmp(key, "retired_pending"))
        return parse_int(val, &g->retired_pending);
    return 0;
}

static int apply_proc(struct fake_proc *p, const char *key, const char *raw)
{
    char val[STR];
    if (pct_decode(raw, val, sizeof val))
        return -1;
    if (!strcmp(key, "gpu")) {
        int v;
        if (parse_int(val, &v))
            return -1;
        p->gpu = (unsigned int)v;
    } else if (!strcmp(key, "pid")) {
        int v;
        if (parse_int(val, &v))
            return -1;
        p->pid = (unsigned int)v;
    } else if (!strcmp(key, "used"))
        return parse_ull(val, &p->used);
    else if (!strcmp(key, "kind")) {
        if (!strcmp(val, "compute"))
            p->kinds = KIND_COMPUTE;
        else if (!strcmp(val, "graphics"))
            p->kinds = KIND_GRAPHICS;
        else if (!strcmp(val, "both"))
            p->kinds = KIND_COMPUTE | KIND_GRAPHICS;
        else
            return -1;
    }
    else if (!strcmp(key, "pidns")) {
        if (!strcmp(val, "local"))
            p->other_pidns = 0;
        else if (!strcmp(val, "other"))
            p->other_pidns = 1;
        else
            return -1;
    }
    /* name= is informational: NVML itself does not report process names here */
    return 0;
}

/*
 * Whether a process record still holds its memory.  The driver frees a process's memory
 * when the process dies, so a record of this pid namespace (pidns=local, the default)
 * counts only while /proc/<pid> exists: a simulated engine killed by SIGKILL, whose
 * records nobody removed, holds nothing.  A record of another pid namespace (a
 * container's process, which this /proc cannot show) counts until it is removed.
 */
static int proc_alive(const struct fake_proc *p)
{
    if (p->other_pidns)
        return 1;
    char path[32];
    snprintf(path, sizeof path, "/proc/%u", p->pid);
    return access(path, F_OK) == 0;
}

static int parse_line(struct fake_state *st, char *line)
{
    char *hash = strchr(line, '#');
    if (hash)
        *hash = '\0';
    char *save = NULL;
    char *type = strtok_r(line, " \t\r\n", &save);
    if (!type)
        return 0;
    struct fake_gpu gpu;
    struct fake_proc proc;
    int have_index = 0;
    int kind;
    if (!strcmp(type, "system"))
        kind = 0;
    else if (!strcmp(type, "gpu")) {
        kind = 1;
        memset(&gpu, 0, sizeof gpu);
        gpu.cc_major = 9;
        gpu.cc_minor = 0;
        gpu.ecc_mode = 1; /* data-center GPUs ship with ECC on */
    } else if (!strcmp(type, "proc")) {
        kind = 2;
        memset(&proc, 0, sizeof proc);
        proc.kinds = KIND_COMPUTE;
    } else
        return 0; /* unknown record types are ignored */
    for (char *tok = strtok_r(NULL, " \t\r\n", &save); tok; tok = strtok_r(NULL, " \t\r\n", &save)) {
        char *eq = strchr(tok, '=');
        if (!eq)
            return -1;
        *eq = '\0';
        int rc = kind == 0 ? apply_system(st, tok, eq + 1)
               : kind == 1 ? apply_gpu(&gpu, &have_index, tok, eq + 1)
                           : apply_proc(&proc, tok, eq + 1);
        if (rc)
            return -1;
    }
    if (kind == 1) {
        if (!have_index || st->gpus[gpu.index].present)
            return -1;
        gpu.present = 1;
        st->gpus[gpu.index] = gpu;
        st->n_gpus++;
    } else if (kind == 2) {
        if (st->n_procs >= MAX_PROCS)
            return -1;
        if (proc_alive(&proc))
            st->procs[st->n_procs++] = proc;
    }
    return 0;
}

/*
 * Read the state file into g_state.  Returns NVML_SUCCESS, NVML_ERROR_DRIVER_NOT_LOADED
 * when the file does not exist (no driver), or NVML_ERROR_UNKNOWN when it is unreadable
 * or malformed (with a message on stderr naming the file and line).
 */
static nvmlReturn_t load_state(void)
{
    const char *path = state_path();
    FILE *f = fopen(path, "r");
    if (!f)
        return errno == ENOENT ? NVML_ERROR_DRIVER_NOT_LOADED : NVML_ERROR_UNKNOWN;
    struct fake_state *spare = &g_buffers[1 - g_current];
#define st (*spare)
    st.n_missing = 0;
    st.n_gpus = 0;
    st.n_procs = 0;
    st.init_error = 0;
    for (int i = 0; i < MAX_GPUS; i++)
        st.gpus[i].present = 0;
    strcpy(st.driver, "550.127.05");
    strcpy(st.nvml, "12.550.127.05");
    st.cuda = 12040;
    char line[16384];
    int lineno = 0;
    nvmlReturn_t rc = NVML_SUCCESS;
    size_t total = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        total += strlen(line);
        if (total > MAX_STATE_BYTES || parse_line(&st, line)) {
            fprintf(stderr, "fake-nvml: %s:%d: malformed record\n", path, lineno);
            rc = NVML_ERROR_UNKNOWN;
            break;
        }
    }
    fclose(f);
    if (rc != NVML_SUCCESS)
        return rc;
    for (int i = 0; i < st.n_gpus; i++) {
        if (!st.gpus[i].present) {
            fprintf(stderr, "fake-nvml: %s: GPU indices must be 0..%d without gaps\n", path, st.n_gpus - 1);
            return NVML_ERROR_UNKNOWN;
        }
    }
    g_current = 1 - g_current;
    return NVML_SUCCESS;
#undef st
}

static int is_missing(const char *fn)
{
    for (int i = 0; i < g_state.n_missing; i++)
        if (!strcmp(g_state.missing[i], fn))
            return 1;
    return 0;
}

/* Common prologue of every state-reading entry point (called with g_lock held). */
static nvmlReturn_t enter(const char *fn)
{
    if (g_init_count <= 0)
        return NVML_ERROR_UNINITIALIZED;
    nvmlReturn_t rc = load_state();
    if (rc == NVML_ERROR_DRIVER_NOT_LOADED)
        return NVML_ERROR_DRIVER_NOT_LOADED;
    if (rc)
        return rc;
    if (is_missing(fn))
        return NVML_ERROR_FUNCTION_NOT_FOUND;
    return NVML_SUCCESS;
}

/* Resolve a device handle to its GPU (with g_lock held and state loaded). */
static nvmlReturn_t device(const void *handle, struct fake_gpu **out)
{
    const struct fake_handle *h = handle;
    if (!h || h < g_handles || h >= g_handles + MAX_GPUS)
        return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int idx = (unsigned int)(h - g_handles);
    if ((int)idx >= g_state.n_gpus)
        return NVML_ERROR_GPU_IS_LOST; /* the GPU left the state after its handle was taken */
    struct fake_gpu *g = &g_state.gpus[idx];
    if (g->error)
        return g->error;
    *out = g;
    return NVML_SUCCESS;
}

#define LOCKED_ENTER(fn)                         \
    pthread_mutex_lock(&g_lock);                 \
    nvmlReturn_t rc_ = enter(fn);                \
    if (rc_) {                                   \
        pthread_mutex_unlock(&g_lock);           \
        return rc_;                              \
    }

#define RETURN(rc)                               \
    do {                                         \
        nvmlReturn_t r_ = (rc);                  \
        pthread_mutex_unlock(&g_lock);           \
        return r_;                               \
    } while (0)

static nvmlReturn_t copy_str(char *dst, unsigned int len, const char *src)
{
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > len)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(dst, src);
    return NVML_SUCCESS;
}

/* Memory figures of one GPU; each call advances that GPU's noise cycle. */
static void memory_of(struct fake_gpu *g, unsigned long long *total, unsigned long long *reserved,
                      unsigned long long *free_b, unsigned long long *used)
{
    unsigned long long u = g->base_used;
    for (int i = 0; i < g_state.n_procs; i++)
        if (g_state.procs[i].gpu == g->index)
            u += g_state.procs[i].used;
    unsigned long long noise = 0;
    if (g->n_noise > 0) {
        noise = g->noise[g_noise_reads[g->index] % (unsigned long long)g->n_noise];
        g_noise_reads[g->index]++;
    }
    u += noise;
    unsigned long long avail = g->total > g->reserved ? g->total - g->reserved : 0;
    unsigned long long f = avail > u ? avail - u : 0;
    if (g->has_free_override)
        f = g->free_override;
    *total = g->total;
    *reserved = g->reserved;
    *free_b = f;
    *used = u;
}

/* ------------------------------------------------------------------ entry points */

API const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

API nvmlReturn_t nvmlInitWithFlags(unsigned int flags)
{
    (void)flags;
    pthread_mutex_lock(&g_lock);
    nvmlReturn_t rc = load_state();
    if (rc == NVML_SUCCESS && is_missing("nvmlInitWithFlags"))
        rc = NVML_ERROR_FUNCTION_NOT_FOUND;
    if (rc == NVML_SUCCESS && g_state.init_error)
        rc = g_state.init_error;
    if (rc == NVML_SUCCESS)
        g_init_count++;
    RETURN(rc);
}

API nvmlReturn_t nvmlInit_v2(void)
{
    return nvmlInitWithFlags(0);
}

API nvmlReturn_t nvmlInit(void)
{
    return nvmlInitWithFlags(0);
}

API nvmlReturn_t nvmlShutdown(void)
{
    pthread_mutex_lock(&g_lock);
    if (g_init_count <= 0)
        RETURN(NVML_ERROR_UNINITIALIZED);
    g_init_count--;
    RETURN(NVML_SUCCESS);
}

API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    LOCKED_ENTER("nvmlSystemGetDriverVersion");
    RETURN(copy_str(version, length, g_state.driver));
}

API nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length)
{
    LOCKED_ENTER("nvmlSystemGetNVMLVersion");
    RETURN(copy_str(version, length, g_state.nvml));
}

static nvmlReturn_t cuda_version(const char *fn, int *v)
{
    LOCKED_ENTER(fn);
    if (!v)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *v = g_state.cuda;
    RETURN(NVML_SUCCESS);
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v)
{
    return cuda_version("nvmlSystemGetCudaDriverVersion", v);
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v)
{
    return cuda_version("nvmlSystemGetCudaDriverVersion_v2", v);
}

static nvmlReturn_t device_count(const char *fn, unsigned int *count)
{
    LOCKED_ENTER(fn);
    if (!count)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *count = (unsigned int)g_state.n_gpus;
    RETURN(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    return device_count("nvmlDeviceGetCount_v2", count);
}

API nvmlReturn_t nvmlDeviceGetCount(unsigned int *count)
{
    return device_count("nvmlDeviceGetCount", count);
}

static nvmlReturn_t handle_by_index(const char *fn, unsigned int index, void **out)
{
    LOCKED_ENTER(fn);
    if (!out || index >= (unsigned int)g_state.n_gpus)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    if (g_state.gpus[index].error)
        RETURN(g_state.gpus[index].error);
    g_handles[index].index = index;
    *out = &g_handles[index];
    RETURN(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device_out)
{
    return handle_by_index("nvmlDeviceGetHandleByIndex_v2", index, device_out);
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, void **device_out)
{
    return handle_by_index("nvmlDeviceGetHandleByIndex", index, device_out);
}

API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, void **device_out)
{
    LOCKED_ENTER("nvmlDeviceGetHandleByUUID");
    if (!uuid || !device_out)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    for (int i = 0; i < g_state.n_gpus; i++) {
        if (!strcmp(g_state.gpus[i].uuid, uuid)) {
            if (g_state.gpus[i].error)
                RETURN(g_state.gpus[i].error);
            g_handles[i].index = (unsigned int)i;
            *device_out = &g_handles[i];
            RETURN(NVML_SUCCESS);
        }
    }
    RETURN(NVML_ERROR_NOT_FOUND);
}

static int is_unsupported(const struct fake_gpu *g, const char *fn)
{
    for (int i = 0; i < g->n_unsupported; i++)
        if (!strcmp(g->unsupported[i], fn))
            return 1;
    return 0;
}

#define DEVICE_ENTER(fn, handle)                 \
    LOCKED_ENTER(fn);                            \
    struct fake_gpu *g = NULL;                   \
    {                                            \
        nvmlReturn_t drc_ = device(handle, &g);  \
        if (drc_)                                \
            RETURN(drc_);                        \
        if (is_unsupported(g, fn))               \
            RETURN(NVML_ERROR_NOT_SUPPORTED);    \
    }

API nvmlReturn_t nvmlDeviceGetIndex(void *handle, unsigned int *index)
{
    DEVICE_ENTER("nvmlDeviceGetIndex", handle);
    if (!index)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *index = g->index;
    RETURN(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetName(void *handle, char *name, unsigned int length)
{
    DEVICE_ENTER("nvmlDeviceGetName", handle);
    RETURN(copy_str(name, length, g->name));
}

API nvmlReturn_t nvmlDeviceGetUUID(void *handle, char *uuid, unsigned int length)
{
    DEVICE_ENTER("nvmlDeviceGetUUID", handle);
    RETURN(copy_str(uuid, length, g->uuid));
}

static void pci_fields(const struct fake_gpu *g, unsigned int *domain, unsigned int *bus, unsigned int *dev)
{
    unsigned int d = 0, b = 0, v = 0, fn = 0;
    if (sscanf(g->pci, "%x:%x:%x.%x", &d, &b, &v, &fn) != 4) {
        d = b = v = 0;
    }
    *domain = d;
    *bus = b;
    *dev = v;
}

API nvmlReturn_t nvmlDeviceGetPciInfo_v3(void *handle, nvmlPciInfo_t *pci)
{
    DEVICE_ENTER("nvmlDeviceGetPciInfo_v3", handle);
    if (!pci)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    memset(pci, 0, sizeof *pci);
    pci_fields(g, &pci->domain, &pci->bus, &pci->device);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04x:%02x:%02x.0",
             pci->domain & 0xffffu, pci->bus & 0xffu, pci->device & 0xffu);
    snprintf(pci->busId, sizeof pci->busId, "%.31s", g->pci);
    pci->pciDeviceId = g->pci_id;
    RETURN(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetPciInfo_v2(void *handle, nvmlPciInfo_v2_t *pci)
{
    DEVICE_ENTER("nvmlDeviceGetPciInfo_v2", handle);
    if (!pci)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    memset(pci, 0, sizeof *pci);
    pci_fields(g, &pci->domain, &pci->bus, &pci->device);
    snprintf(pci->busId, sizeof pci->busId, "%04x:%02x:%02x.0",
             pci->domain & 0xffffu, pci->bus & 0xffu, pci->device & 0xffu);
    pci->pciDeviceId = g->pci_id;
    RETURN(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo(void *handle, nvmlMemory_t *mem)
{
    DEVICE_ENTER("nvmlDeviceGetMemoryInfo", handle);
    if (!mem)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    unsigned long long total, reserved, free_b, used;
    memory_of(g, &total, &reserved, &free_b, &used);
    mem->total = total;
    mem->free = free_b;
    mem->used = total - free_b; /* v1 folds the reserved memory into "used" */
    RETURN(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(void *handle, nvmlMemory_v2_t *mem)
{
    DEVICE_ENTER("nvmlDeviceGetMemoryInfo_v2", handle);
    if (!mem)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    if (mem->version != NVML_MEMORY_V2_VERSION)
        RETURN(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    unsigned long long total, reserved, free_b, used;
    memory_of(g, &total, &reserved, &free_b, &used);
    mem->total = total;
    mem->reserved = reserved;
    mem->free = free_b;
    mem->used = used;
    RETURN(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetCudaComputeCapability(void *handle, int *major, int *minor)
{
    DEVICE_ENTER("nvmlDeviceGetCudaComputeCapability", handle);
    if (!major || !minor)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *major = g->cc_major;
    *minor = g->cc_minor;
    RETURN(NVML_SUCCESS);
}

/* NVML's two-call protocol: NULL/short buffer -> count + INSUFFICIENT_SIZE, else fill. */
static nvmlReturn_t running_processes(const char *fn, void *handle, unsigned int *count,
                                      nvmlProcessInfo_t *infos, int kind)
{
    DEVICE_ENTER(fn, handle);
    if (!count)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    unsigned int n = 0;
    for (int i = 0; i < g_state.n_procs; i++)
        if (g_state.procs[i].gpu == g->index && (g_state.procs[i].kinds & kind))
            n++;
    if (n == 0) {
        *count = 0;
        RETURN(NVML_SUCCESS);
    }
    if (!infos || *count < n) {
        *count = n;
        RETURN(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    unsigned int k = 0;
    for (int i = 0; i < g_state.n_procs; i++) {
        const struct fake_proc *p = &g_state.procs[i];
        if (p->gpu == g->index && (p->kinds & kind)) {
            infos[k].pid = p->pid;
            infos[k].usedGpuMemory = p->used;
            infos[k].gpuInstanceId = NVML_NOT_MIG;
            infos[k].computeInstanceId = NVML_NOT_MIG;
            k++;
        }
    }
    *count = n;
    RETURN(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(void *handle, unsigned int *count, nvmlProcessInfo_t *infos)
{
    return running_processes("nvmlDeviceGetComputeRunningProcesses_v3", handle, count, infos, KIND_COMPUTE);
}

API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(void *handle, unsigned int *count, nvmlProcessInfo_t *infos)
{
    return running_processes("nvmlDeviceGetComputeRunningProcesses_v2", handle, count, infos, KIND_COMPUTE);
}

API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(void *handle, unsigned int *count, nvmlProcessInfo_t *infos)
{
    return running_processes("nvmlDeviceGetGraphicsRunningProcesses_v3", handle, count, infos, KIND_GRAPHICS);
}

API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(void *handle, unsigned int *count, nvmlProcessInfo_t *infos)
{
    return running_processes("nvmlDeviceGetGraphicsRunningProcesses_v2", handle, count, infos, KIND_GRAPHICS);
}

/* ------------------------------------------------------------------ health */

API nvmlReturn_t nvmlDeviceGetEccMode(void *handle, int *current, int *pending)
{
    DEVICE_ENTER("nvmlDeviceGetEccMode", handle);
    if (!current || !pending)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *current = g->ecc_mode ? 1 : 0;
    *pending = *current;
    RETURN(NVML_SUCCESS);
}

/* errorType 0 corrected, 1 uncorrected; counterType 0 volatile, 1 aggregate (corrected errors: none) */
API nvmlReturn_t nvmlDeviceGetTotalEccErrors(void *handle, int errorType, int counterType, unsigned long long *count)
{
    DEVICE_ENTER("nvmlDeviceGetTotalEccErrors", handle);
    if (!count || errorType < 0 || errorType > 1 || counterType < 0 || counterType > 1)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    if (!g->ecc_mode)
        RETURN(NVML_ERROR_NOT_SUPPORTED);
    if (errorType == 0)
        *count = 0;
    else if (counterType == 0)
        *count = g->ecc_uncorrected_volatile;
    else /* the aggregate counter includes this boot's errors */
        *count = g->ecc_uncorrected_aggregate > g->ecc_uncorrected_volatile ? g->ecc_uncorrected_aggregate
                                                                              : g->ecc_uncorrected_volatile;
    RETURN(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetRemappedRows(void *handle, unsigned int *corrRows, unsigned int *uncRows,
                                           unsigned int *isPending, unsigned int *failureOccurred)
{
    DEVICE_ENTER("nvmlDeviceGetRemappedRows", handle);
    if (!corrRows || !uncRows || !isPending || !failureOccurred)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *corrRows = g->remap_corrected;
    *uncRows = g->remap_uncorrected;
    *isPending = g->remap_pending ? 1 : 0;
    *failureOccurred = g->remap_failure ? 1 : 0;
    RETURN(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(void *handle, int *isPending)
{
    DEVICE_ENTER("nvmlDeviceGetRetiredPagesPendingStatus", handle);
    if (!isPending)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *isPending = g->retired_pending ? 1 : 0;
    RETURN(NVML_SUCCESS);
}

/* ------------------------------------------------------------------ events (Xid only) */

typedef struct {
    void *device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

/* An event set: which GPUs it listens on and how many of each GPU's xid= events it has delivered. */
struct fake_event_set {
    int used;
    int registered[MAX_GPUS];
    int delivered[MAX_GPUS];
};
static struct fake_event_set g_sets[MAX_EVENT_SETS];

API nvmlReturn_t nvmlEventSetCreate(void **set)
{
    LOCKED_ENTER("nvmlEventSetCreate");
    if (!set)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    for (int i = 0; i < MAX_EVENT_SETS; i++) {
        if (!g_sets[i].used) {
            memset(&g_sets[i], 0, sizeof g_sets[i]);
            g_sets[i].used = 1;
            *set = &g_sets[i];
            RETURN(NVML_SUCCESS);
        }
    }
    RETURN(NVML_ERROR_MEMORY);
}

static struct fake_event_set *event_set(void *set)
{
    struct fake_event_set *s = set;
    if (!s || s < g_sets || s >= g_sets + MAX_EVENT_SETS || !s->used)
        return NULL;
    return s;
}

API nvmlReturn_t nvmlDeviceGetSupportedEventTypes(void *handle, unsigned long long *types)
{
    DEVICE_ENTER("nvmlDeviceGetSupportedEventTypes", handle);
    if (!types)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *types = is_unsupported(g, "nvmlDeviceRegisterEvents") ? 0 : NVML_EVENT_TYPE_XID;
    RETURN(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceRegisterEvents(void *handle, unsigned long long types, void *set)
{
    DEVICE_ENTER("nvmlDeviceRegisterEvents", handle);
    struct fake_event_set *s = event_set(set);
    if (!s)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    if (types & ~NVML_EVENT_TYPE_XID)
        RETURN(NVML_ERROR_NOT_SUPPORTED);
    if (types & NVML_EVENT_TYPE_XID)
        s->registered[g->index] = 1;
    RETURN(NVML_SUCCESS);
}

/* The next xid= event of a GPU the set listens on, else NVML_ERROR_TIMEOUT after timeoutms. */
static nvmlReturn_t event_wait(const char *fn, void *set, nvmlEventData_t *data, unsigned int timeoutms)
{
    LOCKED_ENTER(fn);
    struct fake_event_set *s = event_set(set);
    if (!s || !data)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    for (int i = 0; i < g_state.n_gpus; i++) {
        const struct fake_gpu *g = &g_state.gpus[i];
        if (s->registered[i] && s->delivered[i] < g->n_xids) {
            memset(data, 0, sizeof *data);
            g_handles[i].index = (unsigned int)i;
            data->device = &g_handles[i];
            data->eventType = NVML_EVENT_TYPE_XID;
            data->eventData = g->xids[s->delivered[i]];
            data->gpuInstanceId = NVML_NOT_MIG;
            data->computeInstanceId = NVML_NOT_MIG;
            s->delivered[i]++;
            RETURN(NVML_SUCCESS);
        }
    }
    pthread_mutex_unlock(&g_lock);
    usleep(timeoutms > 60000 ? 60000000u : timeoutms * 1000u);
    return NVML_ERROR_TIMEOUT;
}

API nvmlReturn_t nvmlEventSetWait_v2(void *set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return event_wait("nvmlEventSetWait_v2", set, data, timeoutms);
}

API nvmlReturn_t nvmlEventSetWait(void *set, nvmlEventData_t *data, unsigned int timeoutms)
{
    return event_wait("nvmlEventSetWait", set, data, timeoutms);
}

API nvmlReturn_t nvmlEventSetFree(void *set)
{
    pthread_mutex_lock(&g_lock);
    struct fake_event_set *s = event_set(set);
    if (!s)
        RETURN(NVML_ERROR_INVALID_ARGUMENT);
    s->used = 0;
    RETURN(NVML_SUCCESS);
}
