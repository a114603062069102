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
        spy_trace_job(d, d->job_seq, start, start + duration, name, g->hdr->ncmds, g->compute_ns);
    } else {
        spy_exec_ctx ctx = {d, g, d->slot_host};
        s = spy_sim_run(d, g, &ctx, start, name, &duration, g->compute_ns);
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
    spy_trace_job(d, d->job_seq, start, start + duration_ns, name, 0, NULL);
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

/* ---- collectives of card memory ----------------------------------------------------------- */

spy_status spy_collective_check(const spy_collective *c)
{
    if (!c)
        return spy_fail(SPY_E_INVALID_ARG, -1, "collective: no descriptor");
    uint32_t es = spy_ccl_elem_size(c->dtype);
    bool reduces = c->kind == SPY_COLL_ALL_REDUCE || c->kind == SPY_COLL_REDUCE_SCATTER;
    if (c->kind < SPY_COLL_ALL_REDUCE || c->kind > SPY_COLL_BROADCAST)
        return spy_fail(SPY_E_INVALID_ARG, -1, "collective: unknown kind %u", c->kind);
    if (c->nranks == 0 || c->nranks > SPY_CCL_MAX_RANKS || c->root >= c->nranks)
        return spy_fail(SPY_E_INVALID_ARG, -1, "collective: %u ranks (1 to %d), root %u", c->nranks,
                        SPY_CCL_MAX_RANKS, c->root);
    if (!es || c->op > SPY_CCL_AVG || (reduces && c->op == SPY_CCL_AVG && c->dtype >= SPY_CCL_I32))
        return spy_fail(SPY_E_INVALID_ARG, -1, "collective: element type %u with reduction %u", c->dtype, c->op);
    if (!isfinite(c->duration_ns) || c->duration_ns < 0)
        return spy_fail(SPY_E_INVALID_ARG, -1, "collective: a duration of %g ns", c->duration_ns);
    const uint64_t limit = 1ull << 48;
    uint64_t whole = 0; /* the bytes of all ranks: what the chunks interleave */
    bool sizes_ok = c->in_bytes < limit && c->out_bytes < limit;
    switch (c->kind) {
    case SPY_COLL_ALL_GATHER:
        sizes_ok = sizes_ok && spy_mul_ok(c->in_bytes, c->nranks, &whole) && whole == c->out_bytes &&
                   (c->chunk_bytes == 0 || (c->chunk_bytes <= c->in_bytes && c->in_bytes % c->chunk_bytes == 0));
        break;
    case SPY_COLL_REDUCE_SCATTER:
        sizes_ok = sizes_ok && spy_mul_ok(c->out_bytes, c->nranks, &whole) && whole == c->in_bytes &&
                   c->out_bytes % es == 0 &&
                   (c->chunk_bytes == 0 || (c->chunk_bytes % es == 0 && c->chunk_bytes <= c->out_bytes &&
                                            c->out_bytes % c->chunk_bytes == 0));
        break;
    default:
        sizes_ok = sizes_ok && c->in_bytes == c->out_bytes && (c->kind != SPY_COLL_ALL_REDUCE || c->in_bytes % es == 0);
        break;
    }
    if (!sizes_ok)
        return spy_fail(SPY_E_INVALID_ARG, -1,
                        "collective of kind %u over %u ranks: %llu input bytes, %llu output bytes and chunks of %llu "
                        "do not fit it (elements of %u bytes)",
                        c->kind, c->nranks, (unsigned long long)c->in_bytes, (unsigned long long)c->out_bytes,
                        (unsigned long long)c->chunk_bytes, es);
    return SPY_OK;
}

/* The ring's descriptor of a collective of timing-mode cards: the data call's, marked as
 * moving none (a functional and a timing card in one call are mismatched collectives). */
static void sync_descriptor(const spy_collective *c, uint64_t desc[5])
{
    static const uint32_t kinds[] = {0, SPY_CCL_KIND_ALLREDUCE, SPY_CCL_KIND_ALLGATHER, SPY_CCL_KIND_REDUCE_SCATTER,
                                     SPY_CCL_KIND_BROADCAST};
    desc[0] = kinds[c->kind] | 0x100u;
    desc[1] = c->kind == SPY_COLL_REDUCE_SCATTER ? c->out_bytes : c->in_bytes;
    desc[2] = c->dtype;
    desc[3] = c->op;
    desc[4] = c->kind == SPY_COLL_BROADCAST ? c->root : c->tag;
}

static spy_status move_data(spy_ccl *ring, const spy_collective *c, uint8_t *in, uint8_t *out)
{
    uint32_t es = spy_ccl_elem_size(c->dtype);
    switch (c->kind) {
    case SPY_COLL_ALL_REDUCE:
        return spy_ccl_allreduce(ring, in, out, c->in_bytes / es, c->dtype, c->op, c->tag);
    case SPY_COLL_ALL_GATHER:
        return spy_ccl_allgather(ring, in, out, c->in_bytes, c->chunk_bytes ? c->chunk_bytes : c->in_bytes);
    case SPY_COLL_REDUCE_SCATTER:
        return spy_ccl_reduce_scatter(ring, in, out, c->out_bytes / es,
                                      (c->chunk_bytes ? c->chunk_bytes : c->out_bytes) / es, c->dtype, c->op);
    default:
        if (in != out)
            memmove(out, in, c->in_bytes);
        return spy_ccl_broadcast(ring, out, c->in_bytes, c->root);
    }
}

spy_status spy_job_collective(spy_device *d, spy_ccl *ring, const spy_collective *c, uint8_t *in, uint8_t *out,
                              double not_before, uint32_t name, double *end)
{
    if (spy_ccl_size(ring) != c->nranks)
        return spy_fail(SPY_E_INVALID_ARG, -1, "collective for %u ranks run in a group of %u", c->nranks,
                        spy_ccl_size(ring));
    double ready = d->device_free > not_before ? d->device_free : not_before;
    if (not_before > d->device_free)
        d->counters.device_idle_host_ns += not_before - d->device_free;
    /* The ring stands in for the interconnect: its walk is the card's work, not the host's. */
    bool outermost = spy_card_work_begin(d);
    spy_ccl_set_clock(ring, ready);
    spy_status s;
    if (in && out) {
        s = move_data(ring, c, in, out);
    } else {
        uint64_t desc[5];
        sync_descriptor(c, desc);
        s = spy_ccl_sync(ring, desc);
    }
    spy_card_work_end(d, outermost);
    if (s != SPY_OK)
        return s;
    double start = spy_ccl_clock(ring);
    if (start < ready)
        start = ready;
    spy_trace_job(d, d->job_seq, start, start + c->duration_ns, name, 0, NULL);
    d->device_free = start + c->duration_ns;
    d->device_work += c->duration_ns;
    d->counters.device_busy_ns += c->duration_ns;
    d->counters.jobs++;
    d->job_seq++;
    *end = d->device_free;
    return SPY_OK;
}

/* Host memory of [addr, +len) on a locked device, checked: inside a live data allocation
 * (one the collective may write when `written`); a storage that starts at addr and records
 * a stick layout must record the one `tag` names, when it names one (the layout the bytes
 * are reduced as on every rank). NULL in *host when nothing backs it. */
static spy_status collective_memory(spy_device *d, uint64_t addr, uint64_t len, bool written, uint64_t tag,
                                    const char *what, uint8_t **host)
{
    spy_block *b = spy_alloc_find(&d->mem, addr, len ? len : 1);
    if (!b)
        return spy_fail(SPY_E_BAD_ADDRESS, -1, "collective %s: [0x%llx, +%llu) is not inside a live allocation",
                        what, (unsigned long long)addr, (unsigned long long)len);
    if (b->kind != SPY_MEM_DATA || (written && (b->prog || b->plan_owned)))
        return spy_fail(SPY_E_BAD_ADDRESS, -1, "collective %s: 0x%llx is not data memory", what,
                        (unsigned long long)addr);
    if (tag && b->addr == addr && b->layout.itemsize && tag != ((b->layout.rows << 32) | b->layout.row_len))
        return spy_fail(SPY_E_LAYOUT, -1, "collective %s: the storage records %llu x %llu elements, the collective "
                        "was made for %llu x %llu", what, (unsigned long long)b->layout.rows,
                        (unsigned long long)b->layout.row_len, (unsigned long long)(tag >> 32),
                        (unsigned long long)(tag & 0xffffffffu));
    *host = b->backing ? b->backing + (addr - b->addr) : NULL;
    return SPY_OK;
}

spy_status spy_collective_launch(spy_device *d, spy_ccl *ring, const spy_collective *coll, uint64_t in,
                                 uint64_t out, uint32_t name, double *end_ns)
{
    SPY_ENTER(d);
    SPY_REFUSE_IF_LOST(d);
    if (!ring)
        SPY_LEAVE(d, spy_fail(SPY_E_INVALID_ARG, -1, "collective: no ring"));
    spy_status s = spy_collective_check(coll);
    if (s != SPY_OK)
        SPY_LEAVE(d, s);
    uint64_t host_t = spy_host_clock_locked(d);
    uint8_t *in_host = NULL, *out_host = NULL;
    if ((s = collective_memory(d, in, coll->in_bytes, false, coll->tag, "input", &in_host)) != SPY_OK ||
        (s = collective_memory(d, out, coll->out_bytes, true, 0, "output", &out_host)) != SPY_OK)
        SPY_LEAVE(d, s);
    uint64_t first = d->job_seq;
    double end = 0;
    s = spy_job_collective(d, ring, coll, in_host, out_host, (double)host_t, name, &end);
    spy_trace_launch(d, name, host_t, first, d->job_seq - first);
    if (end_ns)
        *end_ns = end;
    SPY_LEAVE(d, s);
}
