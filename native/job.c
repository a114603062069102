/* job.c -- programs on the card and one job's run: validating a program block, committing
 * a resident program, binding a job's slots to addresses and putting the job on the device
 * timeline; spy_launch runs one committed program. Transfer graphs (transfer.c) and plans
 * (plan.c) run their jobs through the same functions. */
#include <math.h>
#include <stdlib.h>

#include "internal.h"

spy_status spy_job_validate(spy_device *d, const void *blob, uint64_t len, spy_job_info *info)
{
    SPY_ENTER(d);
    spy_program *g;
    spy_status s = spy_program_decode(&d->prof, blob, len, &g);
    if (s == SPY_OK) {
        d->counters.validated_commands += g->hdr->ncmds;
        if (info)
            *info = g->info;
        spy_program_free(g);
    }
    SPY_LEAVE(d, s);
}

spy_status spy_job_commit_block(spy_device *d, spy_block *b, uint64_t len, spy_job_info *info)
{
    spy_block_uncommit(b);
    spy_program *g;
    spy_status s = spy_program_decode(&d->prof, b->backing, len, &g);
    if (s != SPY_OK)
        return s;
    b->prog = g;
    d->mem.changes++;
    d->counters.commits++;
    d->counters.validated_commands += g->hdr->ncmds;
    if (info)
        *info = g->info;
    return SPY_OK;
}

spy_status spy_program_commit(spy_device *d, uint64_t prog_addr, spy_job_info *info)
{
    SPY_ENTER(d);
    SPY_REFUSE_IF_LOST(d);
    spy_block *b = spy_alloc_find(&d->mem, prog_addr, sizeof(spy_job_header));
    if (!b || b->addr != prog_addr || b->kind != SPY_MEM_CONTROL)
        SPY_LEAVE(d, spy_fail(SPY_E_BAD_ADDRESS, -1,
                              "0x%llx is not the start of a control allocation",
                              (unsigned long long)prog_addr));
    uint64_t total = ((const spy_job_header *)(const void *)b->backing)->total_bytes;
    if (total > b->size)
        SPY_LEAVE(d, spy_fail(SPY_E_BAD_PROGRAM, -1,
                              "program header claims %llu bytes, its allocation has %llu",
                              (unsigned long long)total, (unsigned long long)b->size));
    SPY_LEAVE(d, spy_job_commit_block(d, b, total, info));
}

uint8_t **spy_job_slot_hosts(spy_device *d, size_t n)
{
    if (n > d->slot_host_cap) {
        uint8_t **p = realloc(d->slot_host, n * sizeof *p);
        if (!p)
            return NULL;
        d->slot_host = p;
        d->slot_host_cap = n;
    }
    return d->slot_host;
}

/* Resolve every slot of the program committed in self from addr into the slot scratch;
 * *written_prog is a committed program the job will overwrite (to uncommit after it). */
static spy_status bind_slots(spy_device *d, const spy_block *self, const uint64_t *addr,
                             spy_block **written_prog)
{
    const spy_program *g = self->prog;
    uint8_t **slot_host = spy_job_slot_hosts(d, g->hdr->nslots ? g->hdr->nslots : 1);
    if (!slot_host)
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

/* ...except that in timing mode a host slot is still read when it feeds control memory (a
 * program upload): such a transfer must move real bytes for the program to run. */
static void timing_host_slots(spy_device *d, const spy_program *g, const uint64_t *addr)
{
    if (d->mode != SPY_MODE_TIMING)
        return;
    for (uint32_t k = 0; k < g->nh2d; k++) {
        uint32_t src = g->h2d_pairs[2 * k], dst = g->h2d_pairs[2 * k + 1];
        if (d->slot_host[dst])
            d->slot_host[src] = (uint8_t *)(uintptr_t)addr[src];
    }
}

spy_status spy_job_run_bound(spy_device *d, spy_block *blk, const uint64_t *addr,
                             double not_before, uint32_t name, double *end)
{
    spy_program *g = blk->prog;
    spy_block *overwritten = NULL;
    spy_status s = bind_slots(d, blk, addr, &overwritten);
    if (s != SPY_OK)
        return s;
    timing_host_slots(d, g, addr);
    s = spy_job_execute(d, g, not_before, name, end);
    if (overwritten)
        spy_block_uncommit(overwritten);
    return s;
}

/* Whether a job can be charged its recorded duration instead of being simulated again: in
 * timing mode, a job that nothing backs -- no scratchpads, no memory behind its DRAM slots
 * -- has no effect but its time. On the card the command processor walks the commands;
 * here the walk would run on the host's CPU and evict the host's caches between two steps
 * (Dynamo's guards over a model's parameters then run several times slower). The walk
 * still runs while the trace records commands or a fault is armed: both need it. */
static bool time_only(const spy_device *d, const spy_program *g)
{
    if (d->lx || d->fault_kind != SPY_FAULT_NONE || (d->trace.enabled && d->trace.commands))
        return false;
    for (uint32_t k = 0; k < g->hdr->nslots; k++)
        if (d->slot_host[k] && g->slots[k].kind == SPY_SLOT_DRAM)
            return false;
    return true;
}

spy_status spy_job_execute(spy_device *d, spy_program *g, double not_before, uint32_t name, double *end)
{
    /* The command processor needs job_launch_ns from a job becoming runnable (launched by
     * the host, or the previous job of a plan ending) to its first command, in every mode. */
    double runnable = d->device_free > not_before ? d->device_free : not_before;
    double start = runnable + d->prof.job_launch_ns;
    if (not_before > d->device_free)
        d->counters.device_idle_host_ns += not_before - d->device_free;
    bool outermost = spy_card_work_begin(d);
    double duration = 0;
    spy_status s = SPY_OK;
    if (g->timed && time_only(d, g)) {
        duration = g->duration_ns;
        spy_trace_job(d, d->job_seq, start, start + duration, name, g->hdr->ncmds);
    } else {
        spy_exec_ctx ctx = {d, g, d->slot_host};
        s = spy_sim_run(d, g, &ctx, start, name, &duration);
        /* a failed run stopped early: its length is not the program's */
        g->timed = s == SPY_OK;
        g->duration_ns = duration;
    }
    spy_card_work_end(d, outermost);
    *end = start + duration;
    d->device_free = *end;
    d->device_work += *end - runnable;
    d->counters.device_busy_ns += duration;
    d->counters.jobs++;
    d->counters.commands += g->hdr->ncmds;
    d->counters.bytes_h2d += g->bytes_h2d;
    d->counters.bytes_d2h += g->bytes_d2h;
    d->job_seq++;
    return s;
}

spy_status spy_timed_job(spy_device *d, double not_before, double duration_ns, uint32_t name, double *end_ns)
{
    SPY_ENTER(d);
    SPY_REFUSE_IF_LOST(d);
    if (!isfinite(not_before) || !isfinite(duration_ns) || not_before < 0 || duration_ns < 0)
        SPY_LEAVE(d, spy_fail(SPY_E_INVALID_ARG, -1, "a timed job starts and lasts a finite, non-negative time "
                              "(not %g ns for %g ns)", not_before, duration_ns));
    double start = d->device_free > not_before ? d->device_free : not_before;
    if (not_before > d->device_free)
        d->counters.device_idle_host_ns += not_before - d->device_free;
    spy_trace_job(d, d->job_seq, start, start + duration_ns, name, 0);
    d->device_free = start + duration_ns;
    d->device_work += duration_ns;
    d->counters.device_busy_ns += duration_ns;
    d->counters.jobs++;
    d->job_seq++;
    if (end_ns)
        *end_ns = d->device_free;
    SPY_LEAVE(d, SPY_OK);
}

spy_status spy_launch(spy_device *d, uint64_t prog_addr, const uint64_t *bindings,
                      uint32_t nbindings, uint32_t name, double *job_end_ns)
{
    SPY_ENTER(d);
    SPY_REFUSE_IF_LOST(d);
    uint64_t host_t = spy_host_clock_locked(d);
    spy_block *b = spy_alloc_find(&d->mem, prog_addr, 1);
    if (!b || b->addr != prog_addr || b->kind != SPY_MEM_CONTROL)
        SPY_LEAVE(d, spy_fail(SPY_E_BAD_ADDRESS, -1, "0x%llx is not a program allocation",
                              (unsigned long long)prog_addr));
    if (!b->prog)
        SPY_LEAVE(d, spy_fail(SPY_E_NOT_COMMITTED, -1,
                              "the program at 0x%llx was not committed (or was overwritten since)",
                              (unsigned long long)prog_addr));
    if (nbindings != b->prog->hdr->nslots || (nbindings && !bindings))
        SPY_LEAVE(d, spy_fail(SPY_E_INVALID_ARG, -1, "program has %u slots, %u bindings given",
                              b->prog->hdr->nslots, nbindings));
    uint64_t first = d->job_seq;
    double end = 0;
    double not_before = (double)spy_host_clock_locked(d);
    spy_status s = spy_job_run_bound(d, b, bindings, not_before, name, &end);
    spy_trace_launch(d, name, host_t, first, d->job_seq - first);
    if (job_end_ns)
        *job_end_ns = end;
    SPY_LEAVE(d, s);
}
