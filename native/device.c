/* device.c -- the device object: open/close, clocks, memory, launches, plans, counters,
 * the trace buffer and fault injection. Every entry point takes the device lock, so one
 * card can be driven from several threads. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Device addresses never look like host pointers, and each device opened gets a window of
 * its own (spyre.h): the next free window is handed out at open. */
#define ADDRESS_WINDOW (1ull << SPY_ADDRESS_WINDOW_SHIFT) /* 1 TiB per device */
static atomic_uint_fast64_t next_instance;

struct spy_plan {
    spy_device *dev;
    uint32_t njobs, nbindings;
    struct plan_job {
        uint64_t prog_addr;
        spy_program *prog;   /* committed when the plan was created; owned by its block */
        uint32_t reloc_begin, nslots, name;
    } *jobs;
    spy_reloc *relocs;
    uint64_t *extent;      /* per binding: bytes the launch must provide */
    uint8_t *binding_used; /* per binding: some slot is relocated against it (all DRAM) */
    uint32_t max_slots;
    uint64_t upload_bytes;
    uint64_t epoch;           /* the device's reset epoch when the plan was created */
    uint8_t *binding_written; /* per binding: some job writes through it */
    uint8_t **binding_host;   /* scratch: host memory behind each binding of a launch */
};

/* Per-launch scratch: resolved host pointers of slots. */
static _Thread_local uint8_t **slot_host;
static _Thread_local size_t slot_host_cap;

static bool ensure_slot_host(size_t n)
{
    if (n <= slot_host_cap)
        return true;
    uint8_t **p = realloc(slot_host, n * sizeof *p);
    if (!p)
        return false;
    slot_host = p;
    slot_host_cap = n;
    return true;
}

static void lock(spy_device *d) { pthread_mutex_lock(&d->lock); }
static void unlock(spy_device *d) { pthread_mutex_unlock(&d->lock); }

/* ---- profile ---- */

static spy_status check_profile(const spy_profile *p)
{
#define POS(f)                                                                                     \
    if (!(p->f > 0) || !isfinite((double)p->f))                                                    \
        return spy_fail(SPY_E_PROFILE, -1, "profile figure " #f " must be positive");
#define NONNEG(f)                                                                                  \
    if (!(p->f >= 0) || !isfinite((double)p->f))                                                   \
        return spy_fail(SPY_E_PROFILE, -1, "profile figure " #f " must not be negative");
    POS(num_cores) POS(corelets_per_core) POS(scratchpad_bytes) POS(dram_bytes) POS(stick_bytes)
    POS(dram_burst_bytes) POS(clock_ghz) POS(pt_macs_per_ns) POS(pt_utilization) POS(pt_fp32_ratio)
    POS(pt_gran_m) POS(pt_gran_n) POS(pt_gran_k) POS(sfu_elems_per_cycle)
    POS(sfu_transcendental_cycles) POS(dram_bytes_per_ns) POS(core_dma_bytes_per_ns)
    POS(pcie_bytes_per_ns) POS(ring_bytes_per_cycle)
    NONNEG(pt_latency_ns) NONNEG(sfu_latency_ns) NONNEG(dma_latency_ns) NONNEG(pcie_latency_ns)
    NONNEG(pcie_descriptor_ns) NONNEG(ring_hop_ns) NONNEG(barrier_ns) NONNEG(job_launch_ns)
#undef POS
#undef NONNEG
    if (p->num_cores > 256)
        return spy_fail(SPY_E_PROFILE, -1, "profile figure num_cores (%u) is above 256", p->num_cores);
    if (p->scratchpad_bytes > (1ull << 31))
        return spy_fail(SPY_E_PROFILE, -1, "profile figure scratchpad_bytes is above 2 GiB");
    if (p->dram_bytes > ADDRESS_WINDOW)
        return spy_fail(SPY_E_PROFILE, -1, "profile figure dram_bytes is above 1 TiB");
    if (p->pt_utilization > 1)
        return spy_fail(SPY_E_PROFILE, -1, "profile figure pt_utilization is above 1");
    if (p->stick_bytes & (p->stick_bytes - 1))
        return spy_fail(SPY_E_PROFILE, -1, "profile figure stick_bytes is not a power of two");
    return SPY_OK;
}

/* ---- open / close ---- */

static void free_lx(spy_device *d)
{
    if (!d->lx)
        return;
    for (uint32_t c = 0; c < d->prof.num_cores; c++)
        free(d->lx[c]);
    free(d->lx);
    d->lx = NULL;
}

static spy_status make_state(spy_device *d)
{
    spy_status s = spy_alloc_init(&d->mem, (uint64_t)SPY_ADDRESS_BASE + d->instance * ADDRESS_WINDOW,
                                  d->prof.dram_bytes, d->prof.stick_bytes);
    if (s != SPY_OK)
        return s;
    if (d->mode == SPY_MODE_FUNCTIONAL) {
        d->lx = calloc(d->prof.num_cores, sizeof *d->lx);
        if (!d->lx)
            return spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted");
        for (uint32_t c = 0; c < d->prof.num_cores; c++) {
            d->lx[c] = calloc(1, d->prof.scratchpad_bytes);
            if (!d->lx[c])
                return spy_fail(SPY_E_HOST_NOMEM, -1, "host memory for scratchpads exhausted");
        }
    }
    return SPY_OK;
}

spy_status spy_device_open(const spy_profile *profile, uint32_t mode, uint32_t ordinal,
                           spy_device **out)
{
    spy_clear_error();
    if (!profile || !out)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null profile or output pointer");
    *out = NULL;
    if (mode != SPY_MODE_FUNCTIONAL && mode != SPY_MODE_TIMING)
        return spy_fail(SPY_E_INVALID_ARG, -1, "unknown mode %u", mode);
    if (ordinal >= 64)
        return spy_fail(SPY_E_INVALID_ARG, -1, "device ordinal %u is above 63", ordinal);
    spy_status s = check_profile(profile);
    if (s != SPY_OK)
        return s;
    uint64_t instance = atomic_fetch_add(&next_instance, 1);
    if (instance >= SPY_MAX_DEVICE_INSTANCES)
        return spy_fail(SPY_E_INVALID_ARG, -1, "%d devices were opened already: no address window is left",
                        SPY_MAX_DEVICE_INSTANCES);
    spy_device *d = calloc(1, sizeof *d);
    if (!d)
        return spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted");
    d->prof = *profile;
    d->mode = mode;
    d->ordinal = ordinal;
    d->instance = instance;
    d->clock_origin = spy_now_ns();
    pthread_mutex_init(&d->lock, NULL);
    d->sim = spy_sim_new();
    if (!d->sim)
        s = spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted");
    if (s == SPY_OK)
        s = make_state(d);
    if (s != SPY_OK) {
        spy_device_close(d);
        return s;
    }
    *out = d;
    return SPY_OK;
}

static void trace_free(spy_trace *t)
{
    free(t->ev);
    for (uint32_t i = 0; i < t->nnames; i++)
        free(t->names[i]);
    free(t->names);
    memset(t, 0, sizeof *t);
}

void spy_device_close(spy_device *d)
{
    if (!d)
        return;
    spy_alloc_destroy(&d->mem);
    free_lx(d);
    spy_sim_free(d->sim);
    trace_free(&d->trace);
    pthread_mutex_destroy(&d->lock);
    free(d);
}

uint32_t spy_device_mode(const spy_device *d) { return d->mode; }

uint64_t spy_device_instance(const spy_device *d) { return d ? d->instance : 0; }

spy_status spy_device_reset(spy_device *d)
{
    spy_clear_error();
    if (!d)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null device");
    lock(d);
    spy_alloc_destroy(&d->mem);
    free_lx(d);
    d->lost = false;
    d->epoch++;
    d->fault_kind = SPY_FAULT_NONE;
    spy_status s = make_state(d);
    unlock(d);
    return s;
}

uint64_t spy_device_epoch(spy_device *d)
{
    if (!d)
        return 0;
    lock(d);
    uint64_t e = d->epoch;
    unlock(d);
    return e;
}

/* ---- clocks ---- */

uint64_t spy_host_clock_locked(spy_device *d)
{
    return spy_now_ns() - d->clock_origin - d->excluded_ns + d->waited_ns;
}

uint64_t spy_host_clock_ns(spy_device *d)
{
    lock(d);
    uint64_t t = spy_host_clock_locked(d);
    unlock(d);
    return t;
}

double spy_device_finish_ns(spy_device *d)
{
    lock(d);
    double t = d->device_free;
    unlock(d);
    return t;
}

spy_status spy_synchronize(spy_device *d)
{
    spy_clear_error();
    lock(d);
    d->counters.native_calls++;
    uint64_t now = spy_host_clock_locked(d);
    if (d->device_free > (double)now) {
        uint64_t wait = (uint64_t)ceil(d->device_free) - now;
        d->waited_ns += wait;
        d->counters.wait_ns += wait;
    }
    spy_status s = d->lost ? spy_fail(SPY_E_DEVICE_LOST, -1, "device %u is lost; reset it", d->ordinal)
                           : SPY_OK;
    unlock(d);
    return s;
}

/* ---- memory ---- */

#define ENTER(d)                                                                                   \
    do {                                                                                           \
        spy_clear_error();                                                                         \
        if (!(d))                                                                                  \
            return spy_fail(SPY_E_INVALID_ARG, -1, "null device");                                 \
        lock(d);                                                                                   \
        (d)->counters.native_calls++;                                                              \
    } while (0)

#define LEAVE(d, s)                                                                                \
    do {                                                                                           \
        spy_status s_ = (s);                                                                       \
        unlock(d);                                                                                 \
        return s_;                                                                                 \
    } while (0)

#define REFUSE_IF_LOST(d)                                                                          \
    if ((d)->lost)                                                                                 \
    LEAVE(d, spy_fail(SPY_E_DEVICE_LOST, -1, "device %u is lost; reset it", (d)->ordinal))

spy_status spy_malloc(spy_device *d, uint64_t nbytes, uint32_t kind, uint64_t *addr)
{
    ENTER(d);
    REFUSE_IF_LOST(d);
    if (!addr || kind > SPY_MEM_CONTROL)
        LEAVE(d, spy_fail(SPY_E_INVALID_ARG, -1, "bad output pointer or memory kind %u", kind));
    bool backed = kind == SPY_MEM_CONTROL || d->mode == SPY_MODE_FUNCTIONAL;
    LEAVE(d, spy_alloc_get(&d->mem, nbytes, kind, backed, addr));
}

static spy_status free_locked(spy_device *d, uint64_t addr)
{
    spy_block *b = spy_alloc_find(&d->mem, addr, 1);
    if (b && b->addr == addr && b->plan_owned)
        return spy_fail(SPY_E_BAD_ADDRESS, -1, "0x%llx belongs to a graph plan", (unsigned long long)addr);
    return spy_alloc_put(&d->mem, addr);
}

spy_status spy_free(spy_device *d, uint64_t addr)
{
    ENTER(d);
    LEAVE(d, free_locked(d, addr));
}

spy_status spy_free_epoch(spy_device *d, uint64_t addr, uint64_t epoch)
{
    ENTER(d);
    if (epoch != d->epoch)
        LEAVE(d, SPY_OK); /* a reset dropped it already */
    LEAVE(d, free_locked(d, addr));
}

spy_status spy_empty_cache(spy_device *d)
{
    ENTER(d);
    spy_alloc_release_cache(&d->mem);
    LEAVE(d, SPY_OK);
}

spy_status spy_mem_stats_get(spy_device *d, spy_mem_stats *out)
{
    ENTER(d);
    if (!out)
        LEAVE(d, spy_fail(SPY_E_INVALID_ARG, -1, "null output"));
    spy_alloc_stats(&d->mem, out);
    LEAVE(d, SPY_OK);
}

spy_status spy_mem_reset_peak(spy_device *d)
{
    ENTER(d);
    d->mem.peak = d->mem.allocated;
    d->mem.data_peak = d->mem.allocated - d->mem.control;
    LEAVE(d, SPY_OK);
}

static void uncommit(spy_block *b)
{
    if (b->prog) {
        spy_program_free(b->prog);
        b->prog = NULL;
    }
}

static spy_status mem_access(spy_device *d, uint64_t addr, uint64_t len, spy_block **out)
{
    spy_block *b = spy_alloc_find(&d->mem, addr, len);
    if (!b)
        return spy_fail(SPY_E_BAD_ADDRESS, -1,
                        "[0x%llx, +%llu) is not inside a live allocation",
                        (unsigned long long)addr, (unsigned long long)len);
    if (!b->backing)
        return spy_fail(SPY_E_BAD_ADDRESS, -1,
                        "0x%llx holds no data: timing-mode tensor memory is not backed",
                        (unsigned long long)addr);
    *out = b;
    return SPY_OK;
}

spy_status spy_mem_read(spy_device *d, uint64_t addr, void *dst, uint64_t len)
{
    ENTER(d);
    REFUSE_IF_LOST(d);
    spy_block *b;
    spy_status s = mem_access(d, addr, len, &b);
    if (s == SPY_OK)
        memcpy(dst, b->backing + (addr - b->addr), len);
    LEAVE(d, s);
}

spy_status spy_mem_write(spy_device *d, uint64_t addr, const void *src, uint64_t len)
{
    ENTER(d);
    REFUSE_IF_LOST(d);
    spy_block *b;
    spy_status s = mem_access(d, addr, len, &b);
    if (s == SPY_OK && b->plan_owned)
        s = spy_fail(SPY_E_BAD_ADDRESS, -1, "0x%llx belongs to a graph plan", (unsigned long long)addr);
    if (s == SPY_OK) {
        memcpy(b->backing + (addr - b->addr), src, len);
        uncommit(b);
    }
    LEAVE(d, s);
}

/* ---- programs ---- */

spy_status spy_job_validate(spy_device *d, const void *blob, uint64_t len, spy_job_info *info)
{
    ENTER(d);
    spy_program *g;
    spy_status s = spy_program_decode(&d->prof, blob, len, &g);
    if (s == SPY_OK) {
        d->counters.validated_commands += g->hdr->ncmds;
        if (info)
            *info = g->info;
        spy_program_free(g);
    }
    LEAVE(d, s);
}

static spy_status commit_block(spy_device *d, spy_block *b, uint64_t len, spy_job_info *info)
{
    uncommit(b);
    spy_program *g;
    spy_status s = spy_program_decode(&d->prof, b->backing, len, &g);
    if (s != SPY_OK)
        return s;
    b->prog = g;
    d->counters.commits++;
    d->counters.validated_commands += g->hdr->ncmds;
    if (info)
        *info = g->info;
    return SPY_OK;
}

spy_status spy_program_commit(spy_device *d, uint64_t prog_addr, spy_job_info *info)
{
    ENTER(d);
    REFUSE_IF_LOST(d);
    spy_block *b = spy_alloc_find(&d->mem, prog_addr, sizeof(spy_job_header));
    if (!b || b->addr != prog_addr || b->kind != SPY_MEM_CONTROL)
        LEAVE(d, spy_fail(SPY_E_BAD_ADDRESS, -1,
                          "0x%llx is not the start of a control allocation",
                          (unsigned long long)prog_addr));
    uint64_t total = ((const spy_job_header *)(const void *)b->backing)->total_bytes;
    if (total > b->size)
        LEAVE(d, spy_fail(SPY_E_BAD_PROGRAM, -1,
                          "program header claims %llu bytes, its allocation has %llu",
                          (unsigned long long)total, (unsigned long long)b->size));
    LEAVE(d, commit_block(d, b, total, info));
}

/* Resolve every slot of g from slot_addr; uncommit programs the job will overwrite. */
static spy_status bind_slots(spy_device *d, const spy_block *self, const uint64_t *addr,
                             spy_block **written_prog)
{
    const spy_program *g = self->prog;
    if (!ensure_slot_host(g->hdr->nslots ? g->hdr->nslots : 1))
        return spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted");
    for (uint32_t s = 0; s < g->hdr->nslots; s++) {
        uint64_t extent = g->slots[s].extent;
        if (g->slots[s].kind == SPY_SLOT_HOST) {
            if (!addr[s] && extent)
                return spy_fail(SPY_E_BAD_ADDRESS, -1, "host slot %u is bound to NULL", s);
            slot_host[s] = (uint8_t *)(uintptr_t)addr[s];
            if (d->mode == SPY_MODE_TIMING)
                slot_host[s] = NULL; /* data is not touched in timing mode... */
            continue;
        }
        spy_block *b = spy_alloc_find(&d->mem, addr[s], extent ? extent : 1);
        if (!b)
            return spy_fail(SPY_E_BAD_ADDRESS, -1,
                            "slot %u bound to [0x%llx, +%llu), which is not inside a live allocation",
                            s, (unsigned long long)addr[s], (unsigned long long)extent);
        slot_host[s] = b->backing ? b->backing + (addr[s] - b->addr) : NULL;
        if (g->slot_written[s] && (b == self || b->plan_owned))
            return spy_fail(SPY_E_BAD_ADDRESS, -1, "slot %u: a job may not write a program", s);
        if (g->slot_written[s] && b->prog)
            *written_prog = b;
    }
    return SPY_OK;
}

/* In timing mode a host slot is still read when it feeds control memory (a program
 * upload): such a transfer must move real bytes for the program to run. */
static void timing_host_slots(spy_device *d, const spy_program *g, const uint64_t *addr)
{
    if (d->mode != SPY_MODE_TIMING)
        return;
    for (uint32_t k = 0; k < g->nh2d; k++) {
        uint32_t src = g->h2d_pairs[2 * k], dst = g->h2d_pairs[2 * k + 1];
        if (slot_host[dst])
            slot_host[src] = (uint8_t *)(uintptr_t)addr[src];
    }
}

static spy_status execute_job(spy_device *d, spy_program *g, double not_before, uint32_t name,
                              double *end);

static spy_status run_job(spy_device *d, spy_block *blk, const uint64_t *addr, double not_before,
                          uint32_t name, double *end)
{
    spy_program *g = blk->prog;
    spy_block *overwritten = NULL;
    spy_status s = bind_slots(d, blk, addr, &overwritten);
    if (s != SPY_OK)
        return s;
    timing_host_slots(d, g, addr);
    s = execute_job(d, g, not_before, name, end);
    if (overwritten)
        uncommit(overwritten);
    return s;
}

/* Run a job whose slots are resolved in slot_host. */
static spy_status execute_job(spy_device *d, spy_program *g, double not_before, uint32_t name,
                              double *end)
{
    spy_status s;
    /* The command processor needs job_launch_ns from a job becoming runnable (launched by
     * the host, or the previous job of a plan ending) to its first command, in every mode. */
    double start = (d->device_free > not_before ? d->device_free : not_before) + d->prof.job_launch_ns;
    if (not_before > d->device_free)
        d->counters.device_idle_host_ns += not_before - d->device_free;
    uint64_t t0 = spy_now_ns();
    spy_exec_ctx ctx = {d, g, slot_host};
    double duration = 0;
    s = spy_sim_run(d, g, &ctx, start, name, &duration);
    uint64_t spent = spy_now_ns() - t0;
    d->excluded_ns += spent;
    d->counters.sim_ns += spent;
    *end = start + duration;
    d->device_free = *end;
    d->counters.device_busy_ns += duration;
    d->counters.jobs++;
    d->counters.commands += g->hdr->ncmds;
    d->counters.bytes_h2d += g->bytes_h2d;
    d->counters.bytes_d2h += g->bytes_d2h;
    d->job_seq++;
    return s;
}

static void trace_launch(spy_device *d, uint32_t name, uint64_t host_t, uint64_t first_job,
                         uint64_t njobs)
{
    if (!d->trace.enabled || njobs == 0) /* a launch refused before any job ran */
        return;
    spy_trace_event ev = {0};
    ev.kind = SPY_EV_LAUNCH;
    ev.core = SPY_CORE_CARD;
    ev.start_ns = (double)host_t;
    ev.end_ns = (double)spy_host_clock_locked(d);
    ev.job = first_job;
    ev.a = name;
    ev.b = njobs;
    spy_trace_push(d, &ev);
}

spy_status spy_launch(spy_device *d, uint64_t prog_addr, const uint64_t *bindings,
                      uint32_t nbindings, uint32_t name, double *job_end_ns)
{
    ENTER(d);
    REFUSE_IF_LOST(d);
    uint64_t host_t = spy_host_clock_locked(d);
    spy_block *b = spy_alloc_find(&d->mem, prog_addr, 1);
    if (!b || b->addr != prog_addr || b->kind != SPY_MEM_CONTROL)
        LEAVE(d, spy_fail(SPY_E_BAD_ADDRESS, -1, "0x%llx is not a program allocation",
                          (unsigned long long)prog_addr));
    if (!b->prog)
        LEAVE(d, spy_fail(SPY_E_NOT_COMMITTED, -1,
                          "the program at 0x%llx was not committed (or was overwritten since)",
                          (unsigned long long)prog_addr));
    if (nbindings != b->prog->hdr->nslots || (nbindings && !bindings))
        LEAVE(d, spy_fail(SPY_E_INVALID_ARG, -1, "program has %u slots, %u bindings given",
                          b->prog->hdr->nslots, nbindings));
    uint64_t first = d->job_seq;
    double end = 0;
    double not_before = (double)spy_host_clock_locked(d);
    spy_status s = run_job(d, b, bindings, not_before, name, &end);
    trace_launch(d, name, host_t, first, d->job_seq - first);
    if (job_end_ns)
        *job_end_ns = end;
    LEAVE(d, s);
}

/* ---- transfer graphs ---- */

struct spy_transfer {
    spy_device *dev;
    uint8_t *blob;        /* our copy: the validated program points into it */
    spy_block block;      /* a host-resident stand-in for a control block */
};

spy_status spy_transfer_create(spy_device *d, const void *blob, uint64_t len, spy_transfer **out)
{
    ENTER(d);
    if (!out || !blob)
        LEAVE(d, spy_fail(SPY_E_INVALID_ARG, -1, "null transfer arguments"));
    *out = NULL;
    spy_transfer *t = calloc(1, sizeof *t);
    uint8_t *copy = t ? aligned_alloc(8, (len + 7) & ~7ull) : NULL;
    if (!t || !copy) {
        free(t);
        free(copy);
        LEAVE(d, spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted"));
    }
    memcpy(copy, blob, len);
    spy_program *g;
    spy_status s = spy_program_decode(&d->prof, copy, len, &g);
    if (s == SPY_OK) {
        for (uint32_t i = 0; i < g->hdr->ncmds; i++) {
            uint8_t op = g->cmds[i].op;
            if (op != SPY_OP_H2D && op != SPY_OP_D2H && op != SPY_OP_BARRIER) {
                s = spy_fail(SPY_E_BAD_COMMAND, i,
                             "command %u: a transfer graph runs on the DMA engines only (opcode %u)",
                             i, op);
                spy_program_free(g);
                break;
            }
        }
    }
    if (s != SPY_OK) {
        free(copy);
        free(t);
        LEAVE(d, s);
    }
    d->counters.validated_commands += g->hdr->ncmds;
    t->dev = d;
    t->blob = copy;
    t->block.prog = g;
    t->block.kind = SPY_MEM_CONTROL;
    *out = t;
    LEAVE(d, SPY_OK);
}

void spy_transfer_destroy(spy_transfer *t)
{
    if (!t)
        return;
    spy_program_free(t->block.prog);
    free(t->blob);
    free(t);
}

spy_status spy_transfer_run(spy_transfer *t, const uint64_t *bindings, uint32_t nbindings,
                            uint32_t name, double *end_ns)
{
    spy_clear_error();
    if (!t)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null transfer");
    spy_device *d = t->dev;
    lock(d);
    d->counters.native_calls++;
    REFUSE_IF_LOST(d);
    uint64_t host_t = spy_host_clock_locked(d);
    if (nbindings != t->block.prog->hdr->nslots || (nbindings && !bindings))
        LEAVE(d, spy_fail(SPY_E_INVALID_ARG, -1, "transfer has %u slots, %u bindings given",
                          t->block.prog->hdr->nslots, nbindings));
    uint64_t first = d->job_seq;
    double end = 0;
    spy_status s = run_job(d, &t->block, bindings, (double)spy_host_clock_locked(d), name, &end);
    trace_launch(d, name, host_t, first, d->job_seq - first);
    if (end_ns)
        *end_ns = end;
    LEAVE(d, s);
}

/* ---- plans ---- */

static void release_plan_blocks(spy_device *d, spy_plan *p)
{
    if (p->epoch != d->epoch)
        return; /* a reset dropped them already */
    for (uint32_t j = 0; j < p->njobs; j++) {
        if (!p->jobs[j].prog_addr)
            continue;
        spy_block *b = spy_alloc_find(&d->mem, p->jobs[j].prog_addr, 1);
        if (b && b->addr == p->jobs[j].prog_addr)
            b->plan_owned = 0;
        (void)spy_alloc_put(&d->mem, p->jobs[j].prog_addr);
        p->jobs[j].prog_addr = 0;
    }
}

static spy_status plan_fail(spy_plan *p, spy_status s)
{
    spy_plan_destroy(p);
    return s;
}

spy_status spy_plan_create(spy_device *d, const void *blob, uint64_t len, spy_plan **out)
{
    spy_clear_error();
    if (!d || !out)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null device or output");
    *out = NULL;
    if (!blob || len < sizeof(spy_plan_header) || (uintptr_t)blob % 8)
        return spy_fail(SPY_E_BAD_PROGRAM, -1, "plan block of %llu bytes is too short or misaligned",
                        (unsigned long long)len);
    const spy_plan_header *h = blob;
    if (h->magic != SPY_PLAN_MAGIC)
        return spy_fail(SPY_E_BAD_PROGRAM, -1, "not a plan block (magic 0x%08x)", h->magic);
    if (h->version != SPY_PLAN_VERSION)
        return spy_fail(SPY_E_BAD_PROGRAM, -1, "plan block version %u, runtime reads %u",
                        h->version, SPY_PLAN_VERSION);
    if (h->total_bytes != len || h->njobs == 0 || h->njobs > (1u << 20) ||
        h->nrelocs > (1u << 24) || h->nbindings > (1u << 20))
        return spy_fail(SPY_E_BAD_PROGRAM, -1,
                        "plan block header: %u jobs, %u relocations, %u bindings, %llu bytes of %llu",
                        h->njobs, h->nrelocs, h->nbindings, (unsigned long long)h->total_bytes,
                        (unsigned long long)len);
    uint64_t tables = sizeof *h + (uint64_t)h->njobs * sizeof(spy_plan_job) +
                      (uint64_t)h->nrelocs * sizeof(spy_reloc);
    if (tables > len)
        return spy_fail(SPY_E_BAD_PROGRAM, -1, "plan tables (%llu bytes) exceed the block (%llu)",
                        (unsigned long long)tables, (unsigned long long)len);
    const spy_plan_job *pj = (const spy_plan_job *)(const void *)((const uint8_t *)blob + sizeof *h);
    const spy_reloc *rl = (const spy_reloc *)(const void *)(pj + h->njobs);
    for (uint32_t j = 0; j < h->njobs; j++) {
        uint64_t end;
        if (pj[j].prog_off < tables || pj[j].prog_off % 8 || pj[j].prog_len < sizeof(spy_job_header) ||
            !spy_add_ok(pj[j].prog_off, pj[j].prog_len, &end) || end > len)
            return spy_fail(SPY_E_BAD_PROGRAM, -1, "plan job %u: program at [%llu, +%llu) is outside "
                            "the block", j, (unsigned long long)pj[j].prog_off,
                            (unsigned long long)pj[j].prog_len);
        if (!spy_add_ok(pj[j].reloc_begin, pj[j].nslots, &end) || end > h->nrelocs)
            return spy_fail(SPY_E_BAD_PROGRAM, -1, "plan job %u: relocations [%u, +%u) outside the %u",
                            j, pj[j].reloc_begin, pj[j].nslots, h->nrelocs);
    }
    for (uint32_t r = 0; r < h->nrelocs; r++)
        if (rl[r].binding >= h->nbindings)
            return spy_fail(SPY_E_BAD_PROGRAM, -1, "relocation %u names binding %u of %u", r,
                            rl[r].binding, h->nbindings);

    spy_plan *p = calloc(1, sizeof *p);
    if (!p)
        return spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted");
    p->dev = d;
    p->njobs = h->njobs;
    p->nbindings = h->nbindings;
    p->jobs = calloc(h->njobs, sizeof *p->jobs);
    p->relocs = malloc(((size_t)h->nrelocs + 1) * sizeof *p->relocs);
    p->extent = calloc((size_t)h->nbindings + 1, sizeof *p->extent);
    p->binding_used = calloc((size_t)h->nbindings + 1, 1);
    p->binding_written = calloc((size_t)h->nbindings + 1, 1);
    p->binding_host = calloc((size_t)h->nbindings + 1, sizeof *p->binding_host);
    if (!p->jobs || !p->relocs || !p->extent || !p->binding_used || !p->binding_written || !p->binding_host)
        return plan_fail(p, spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted"));
    memcpy(p->relocs, rl, (size_t)h->nrelocs * sizeof *rl);

    lock(d);
    d->counters.native_calls++;
    p->epoch = d->epoch;
    if (d->lost) {
        unlock(d);
        return plan_fail(p, spy_fail(SPY_E_DEVICE_LOST, -1, "device %u is lost; reset it", d->ordinal));
    }
    spy_status s = SPY_OK;
    for (uint32_t j = 0; j < h->njobs && s == SPY_OK; j++) {
        uint64_t addr;
        s = spy_alloc_get(&d->mem, pj[j].prog_len, SPY_MEM_CONTROL, true, &addr);
        if (s != SPY_OK)
            break;
        p->jobs[j].prog_addr = addr;
        p->jobs[j].reloc_begin = pj[j].reloc_begin;
        p->jobs[j].nslots = pj[j].nslots;
        p->jobs[j].name = pj[j].name;
        spy_block *b = spy_alloc_find(&d->mem, addr, pj[j].prog_len);
        b->plan_owned = 1;
        memcpy(b->backing, (const uint8_t *)blob + pj[j].prog_off, pj[j].prog_len);
        s = commit_block(d, b, pj[j].prog_len, NULL);
        if (s != SPY_OK) { /* name the job; spy_fail copes with its own message as argument */
            s = spy_fail(s, spy_last_error_command(), "plan job %u: %s", j, spy_last_error());
            break;
        }
        const spy_program *g = b->prog;
        p->jobs[j].prog = b->prog;
        if (g->hdr->nslots != pj[j].nslots) {
            s = spy_fail(SPY_E_BAD_PROGRAM, -1, "plan job %u: %u relocations for %u slots", j,
                         pj[j].nslots, g->hdr->nslots);
            break;
        }
        if (g->hdr->nslots > p->max_slots)
            p->max_slots = g->hdr->nslots;
        for (uint32_t k = 0; k < g->hdr->nslots && s == SPY_OK; k++) {
            const spy_reloc *r = &p->relocs[pj[j].reloc_begin + k];
            uint64_t need;
            /* A plan binds device memory only: a launch checks every binding against the
             * card's allocations, which a host pointer would bypass. */
            if (g->slots[k].kind != SPY_SLOT_DRAM) {
                s = spy_fail(SPY_E_BAD_PROGRAM, -1,
                             "plan job %u slot %u is a host slot; plans bind device memory only",
                             j, k);
                break;
            }
            if (!spy_add_ok(r->offset, g->slots[k].extent, &need)) {
                s = spy_fail(SPY_E_BAD_PROGRAM, -1, "plan job %u slot %u: offset overflows", j, k);
                break;
            }
            if (need > p->extent[r->binding])
                p->extent[r->binding] = need;
            if (g->slot_written[k])
                p->binding_written[r->binding] = 1;
            p->binding_used[r->binding] = 1;
        }
        p->upload_bytes += pj[j].prog_len;
    }
    if (s != SPY_OK) {
        release_plan_blocks(d, p);
        unlock(d);
        free(p->jobs);
        p->jobs = NULL;
        return plan_fail(p, s);
    }
    /* The upload is a control transfer on the PCIe link. */
    double now = (double)spy_host_clock_locked(d);
    double start = d->device_free > now ? d->device_free : now;
    d->device_free = start + d->prof.pcie_latency_ns + (double)p->upload_bytes / d->prof.pcie_bytes_per_ns;
    d->counters.bytes_h2d += p->upload_bytes;
    unlock(d);
    *out = p;
    return SPY_OK;
}

void spy_plan_destroy(spy_plan *p)
{
    if (!p)
        return;
    if (p->jobs) {
        lock(p->dev);
        release_plan_blocks(p->dev, p);
        unlock(p->dev);
    }
    free(p->jobs);
    free(p->relocs);
    free(p->extent);
    free(p->binding_used);
    free(p->binding_written);
    free(p->binding_host);
    free(p);
}

spy_status spy_plan_binding_extent(const spy_plan *p, uint32_t binding, uint64_t *extent)
{
    if (!p || !extent || binding >= p->nbindings)
        return spy_fail(SPY_E_INVALID_ARG, -1, "no binding %u", binding);
    *extent = p->extent[binding];
    return SPY_OK;
}

uint32_t spy_plan_num_jobs(const spy_plan *p) { return p ? p->njobs : 0; }

spy_status spy_plan_launch(spy_plan *p, const uint64_t *bindings, uint32_t nbindings,
                           uint32_t name, double *step_end_ns)
{
    spy_clear_error();
    if (!p)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null plan");
    spy_device *d = p->dev;
    lock(d);
    d->counters.native_calls++;
    REFUSE_IF_LOST(d);
    uint64_t host_t = spy_host_clock_locked(d);
    if (p->epoch != d->epoch)
        LEAVE(d, spy_fail(SPY_E_NOT_COMMITTED, -1, "the plan was made before the device was reset; rebuild it"));
    if (nbindings != p->nbindings || (nbindings && !bindings))
        LEAVE(d, spy_fail(SPY_E_INVALID_ARG, -1, "plan takes %u bindings, %u given", p->nbindings,
                          nbindings));
    /* Bounds of every binding, once: the commands were checked against slot extents, and
     * each slot is a binding plus an offset inside the binding's extent. */
    for (uint32_t b = 0; b < nbindings; b++) {
        p->binding_host[b] = NULL;
        if (!p->binding_used[b] || p->extent[b] == 0)
            continue;
        spy_block *blk = spy_alloc_find(&d->mem, bindings[b], p->extent[b]);
        if (!blk)
            LEAVE(d, spy_fail(SPY_E_BAD_ADDRESS, -1,
                              "plan binding %u: [0x%llx, +%llu) is not inside a live allocation", b,
                              (unsigned long long)bindings[b], (unsigned long long)p->extent[b]));
        if ((blk->prog || blk->plan_owned) && p->binding_written[b])
            LEAVE(d, spy_fail(SPY_E_BAD_ADDRESS, -1, "plan binding %u would overwrite a program", b));
        p->binding_host[b] = blk->backing ? blk->backing + (bindings[b] - blk->addr) : NULL;
    }
    /* Patching the resident relocation table is a small control transfer. */
    double now = (double)spy_host_clock_locked(d);
    double not_before = now + d->prof.pcie_latency_ns +
                        (double)nbindings * 8.0 / d->prof.pcie_bytes_per_ns;
    uint64_t first = d->job_seq;
    double end = 0;
    spy_status s = SPY_OK;
    if (!ensure_slot_host(p->max_slots + 1))
        LEAVE(d, spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted"));
    /* Walking the resident jobs is the card's command processor's work, not the host's: the
     * whole walk leaves the host clock, as the simulation inside each job does. */
    uint64_t walk_t0 = spy_now_ns(), excluded0 = d->excluded_ns, sim0 = d->counters.sim_ns;
    for (uint32_t j = 0; j < p->njobs && s == SPY_OK; j++) {
        const struct plan_job *job = &p->jobs[j];
        for (uint32_t k = 0; k < job->nslots; k++) {
            const spy_reloc *r = &p->relocs[job->reloc_begin + k];
            slot_host[k] = p->binding_host[r->binding] ? p->binding_host[r->binding] + r->offset : NULL;
        }
        s = execute_job(d, job->prog, j == 0 ? not_before : 0, job->name, &end);
        if (s != SPY_OK)
            spy_note_error_job(j);
    }
    uint64_t walked = spy_now_ns() - walk_t0;
    d->excluded_ns = excluded0 + walked;
    d->counters.sim_ns = sim0 + walked;
    d->counters.plan_launches++;
    trace_launch(d, name, host_t, first, d->job_seq - first);
    if (step_end_ns)
        *step_end_ns = end;
    LEAVE(d, s);
}

/* ---- counters ---- */

spy_status spy_counters_get(spy_device *d, spy_counters *out)
{
    if (!d || !out)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null argument");
    lock(d);
    *out = d->counters;
    unlock(d);
    return SPY_OK;
}

spy_status spy_counters_reset(spy_device *d)
{
    if (!d)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null device");
    lock(d);
    memset(&d->counters, 0, sizeof d->counters);
    unlock(d);
    return SPY_OK;
}

/* ---- trace ---- */

void spy_trace_push(spy_device *d, const spy_trace_event *ev)
{
    spy_trace *t = &d->trace;
    if (t->n == t->cap) {
        uint64_t nc = t->cap ? t->cap * 2 : 4096;
        spy_trace_event *e = realloc(t->ev, nc * sizeof *e);
        if (!e)
            return; /* the trace is best effort: dropping an event beats failing a job */
        t->ev = e;
        t->cap = nc;
    }
    t->ev[t->n++] = *ev;
}

spy_status spy_trace_enable(spy_device *d, uint32_t enabled, uint32_t commands)
{
    if (!d)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null device");
    lock(d);
    d->trace.enabled = enabled != 0;
    d->trace.commands = commands != 0;
    unlock(d);
    return SPY_OK;
}

uint32_t spy_trace_intern(spy_device *d, const char *name)
{
    if (!d || !name)
        return 0;
    lock(d);
    spy_trace *t = &d->trace;
    for (uint32_t i = 0; i < t->nnames; i++)
        if (strcmp(t->names[i], name) == 0) {
            unlock(d);
            return i + 1;
        }
    if (t->nnames == t->capnames) {
        uint32_t nc = t->capnames ? t->capnames * 2 : 64;
        char **n = realloc(t->names, nc * sizeof *n);
        if (!n) {
            unlock(d);
            return 0;
        }
        t->names = n;
        t->capnames = nc;
    }
    char *copy = strdup(name);
    if (!copy) {
        unlock(d);
        return 0;
    }
    t->names[t->nnames++] = copy;
    uint32_t id = t->nnames;
    unlock(d);
    return id;
}

const char *spy_trace_name(spy_device *d, uint32_t id)
{
    if (!d || id == 0)
        return NULL;
    lock(d);
    const char *n = id <= d->trace.nnames ? d->trace.names[id - 1] : NULL;
    unlock(d);
    return n;
}

spy_status spy_trace_host_span(spy_device *d, uint32_t name, uint64_t start_ns, uint64_t end_ns)
{
    if (!d)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null device");
    lock(d);
    if (d->trace.enabled) {
        spy_trace_event ev = {0};
        ev.kind = SPY_EV_HOST;
        ev.core = SPY_CORE_CARD;
        ev.start_ns = (double)start_ns;
        ev.end_ns = (double)end_ns;
        ev.job = d->job_seq;
        ev.a = name;
        spy_trace_push(d, &ev);
    }
    unlock(d);
    return SPY_OK;
}

uint64_t spy_trace_count(spy_device *d)
{
    lock(d);
    uint64_t n = d->trace.n;
    unlock(d);
    return n;
}

spy_status spy_trace_read(spy_device *d, uint64_t first, spy_trace_event *out, uint64_t max,
                          uint64_t *n)
{
    if (!d || !n || (max && !out))
        return spy_fail(SPY_E_INVALID_ARG, -1, "null argument");
    lock(d);
    uint64_t avail = first < d->trace.n ? d->trace.n - first : 0;
    uint64_t k = avail < max ? avail : max;
    if (k)
        memcpy(out, d->trace.ev + first, k * sizeof *out);
    *n = k;
    unlock(d);
    return SPY_OK;
}

spy_status spy_trace_clear(spy_device *d)
{
    if (!d)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null device");
    lock(d);
    d->trace.n = 0;
    unlock(d);
    return SPY_OK;
}

/* ---- faults ---- */

spy_status spy_fault_inject(spy_device *d, uint32_t kind, uint64_t after_n)
{
    if (!d || kind > SPY_FAULT_LOST)
        return spy_fail(SPY_E_INVALID_ARG, -1, "bad device or fault kind");
    lock(d);
    d->fault_kind = kind;
    d->fault_after = after_n;
    unlock(d);
    return SPY_OK;
}
