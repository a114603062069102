/* plan.c -- graph plans: a compiled step's programs, resident on the card, with the
 * relocation table that derives every job's slot addresses from a few plan bindings
 * (spyre.h). Create validates the whole block and uploads and commits every program; a
 * launch checks each binding once, patches the table and runs every job (job.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

struct spy_plan {
    spy_device *dev;
    uint32_t njobs, nbindings;
    struct plan_job {
        uint64_t prog_addr;  /* the program block it owns; 0: it shares an earlier job's */
        spy_program *prog;   /* committed when the plan was created; owned by its block */
        uint32_t reloc_begin, nslots, name, kind;
        spy_collective coll; /* a collective job's (kind SPY_PLAN_JOB_COLLECTIVE) */
    } *jobs;
    uint32_t ngroups;
    spy_ccl **groups;         /* per group: the ring its collectives run in (the caller's) */
    spy_reloc *relocs;
    uint64_t *extent;      /* per binding: bytes the launch must provide */
    uint8_t *binding_used; /* per binding: some slot is relocated against it (all DRAM) */
    uint32_t max_slots;
    uint64_t upload_bytes;
    uint64_t epoch;           /* the device's reset epoch when the plan was created */
    uint8_t *binding_written; /* per binding: some job writes through it */
    uint8_t **binding_host;   /* host memory behind each binding of the last launch */
    spy_layout *layout;       /* per binding: the stick layout its storage must record */
    /* The bindings of the last launch whose checks all passed, and the device's reset epoch
     * and allocator changes then: a launch with the same bindings and no change since (a
     * graph replay, a step bound as before) skips the checks and keeps binding_host. */
    uint64_t *checked;
    uint64_t checked_epoch, checked_changes;
    bool checked_valid;
};

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

/* A collective job (validated): its descriptor, and its two slots' extents. */
static void add_collective(spy_plan *p, uint32_t j, const spy_plan_job *pj, const uint8_t *coll)
{
    struct plan_job *job = &p->jobs[j];
    job->kind = SPY_PLAN_JOB_COLLECTIVE;
    job->reloc_begin = pj->reloc_begin;
    job->nslots = 2;
    job->name = pj->name;
    memcpy(&job->coll, coll, sizeof job->coll);
    const uint64_t bytes[2] = {job->coll.in_bytes, job->coll.out_bytes};
    for (uint32_t k = 0; k < 2; k++) {
        const spy_reloc *r = &p->relocs[pj->reloc_begin + k];
        uint64_t need = r->offset + bytes[k]; /* checked not to overflow by spy_plan_create */
        if (need > p->extent[r->binding])
            p->extent[r->binding] = need;
        p->binding_used[r->binding] = 1;
        if (k == 1)
            p->binding_written[r->binding] = 1;
    }
    if (p->max_slots < 2)
        p->max_slots = 2;
    p->upload_bytes += sizeof job->coll;
}

/* Per job, the first job that names the same program block (offset and length) and is a
 * program too: itself, or the job whose committed program it shares. NULL when out of
 * memory. Sorting keeps this O(n log n) for the largest plans (2^20 jobs). */
struct prog_ref {
    uint64_t off, len;
    uint32_t job;
};

static int prog_ref_order(const void *a, const void *b)
{
    const struct prog_ref *x = a, *y = b;
    if (x->off != y->off)
        return x->off < y->off ? -1 : 1;
    if (x->len != y->len)
        return x->len < y->len ? -1 : 1;
    return x->job < y->job ? -1 : x->job > y->job;
}

static uint32_t *program_owners(const spy_plan_job *pj, uint32_t njobs)
{
    uint32_t *owner = malloc((size_t)njobs * sizeof *owner);
    struct prog_ref *refs = malloc((size_t)njobs * sizeof *refs);
    if (!owner || !refs) {
        free(owner);
        free(refs);
        return NULL;
    }
    uint32_t n = 0;
    for (uint32_t j = 0; j < njobs; j++) {
        owner[j] = j;
        if (pj[j].kind == SPY_PLAN_JOB_PROGRAM)
            refs[n++] = (struct prog_ref){pj[j].prog_off, pj[j].prog_len, j};
    }
    qsort(refs, n, sizeof *refs, prog_ref_order);
    for (uint32_t i = 1; i < n; i++)
        if (refs[i].off == refs[i - 1].off && refs[i].len == refs[i - 1].len)
            owner[refs[i].job] = owner[refs[i - 1].job]; /* the run's first: the lowest job */
    free(refs);
    return owner;
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
    spy_status s = spy_block_check(blob, len, sizeof(spy_plan_header), SPY_PLAN_MAGIC, SPY_PLAN_VERSION,
                                   "plan");
    if (s != SPY_OK)
        return s;
    const spy_plan_header *h = blob;
    if (h->total_bytes != len || h->njobs == 0 || h->njobs > (1u << 20) ||
        h->nrelocs > (1u << 24) || h->nbindings > (1u << 20))
        return spy_fail(SPY_E_BAD_PROGRAM, -1,
                        "plan block header: %u jobs, %u relocations, %u bindings, %llu bytes of %llu",
                        h->njobs, h->nrelocs, h->nbindings, (unsigned long long)h->total_bytes,
                        (unsigned long long)len);
    uint64_t tables = sizeof *h + (uint64_t)h->njobs * sizeof(spy_plan_job) +
                      (uint64_t)h->nrelocs * sizeof(spy_reloc) + (uint64_t)h->nbindings * sizeof(spy_layout);
    if (tables > len)
        return spy_fail(SPY_E_BAD_PROGRAM, -1, "plan tables (%llu bytes) exceed the block (%llu)",
                        (unsigned long long)tables, (unsigned long long)len);
    const spy_plan_job *pj = (const spy_plan_job *)(const void *)((const uint8_t *)blob + sizeof *h);
    const spy_reloc *rl = (const spy_reloc *)(const void *)(pj + h->njobs);
    const spy_layout *lay = (const spy_layout *)(const void *)(rl + h->nrelocs);
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
        if (pj[j].kind > SPY_PLAN_JOB_COLLECTIVE)
            return spy_fail(SPY_E_BAD_PROGRAM, -1, "plan job %u: unknown kind %u", j, pj[j].kind);
        if (pj[j].kind == SPY_PLAN_JOB_COLLECTIVE) {
            spy_collective c;
            if (pj[j].prog_len != sizeof c || pj[j].nslots != 2)
                return spy_fail(SPY_E_BAD_PROGRAM, -1, "plan job %u: a collective is %zu bytes with 2 slots, not "
                                "%llu bytes with %u", j, sizeof c, (unsigned long long)pj[j].prog_len, pj[j].nslots);
            memcpy(&c, (const uint8_t *)blob + pj[j].prog_off, sizeof c);
            if (spy_collective_check(&c) != SPY_OK)
                return spy_fail(SPY_E_BAD_PROGRAM, -1, "plan job %u: %s", j, spy_last_error());
            if (c.group >= h->ngroups)
                return spy_fail(SPY_E_BAD_PROGRAM, -1, "plan job %u: group %u of %u", j, c.group, h->ngroups);
            const uint64_t bytes[2] = {c.in_bytes, c.out_bytes};
            for (uint32_t k = 0; k < 2; k++)
                if (!spy_add_ok(rl[pj[j].reloc_begin + k].offset, bytes[k], &end))
                    return spy_fail(SPY_E_BAD_PROGRAM, -1, "plan job %u slot %u: offset overflows", j, k);
        }
    }
    if (h->ngroups > SPY_CCL_MAX_RANKS * 64u)
        return spy_fail(SPY_E_BAD_PROGRAM, -1, "plan block header: %u groups", h->ngroups);
    for (uint32_t r = 0; r < h->nrelocs; r++)
        if (rl[r].binding >= h->nbindings)
            return spy_fail(SPY_E_BAD_PROGRAM, -1, "relocation %u names binding %u of %u", r,
                            rl[r].binding, h->nbindings);
    for (uint32_t b = 0; b < h->nbindings; b++)
        if (lay[b].itemsize && spy_layout_check(d, &lay[b], UINT64_MAX) != SPY_OK)
            return spy_fail(SPY_E_BAD_PROGRAM, -1, "plan binding %u: %s", b, spy_last_error());

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
    p->checked = calloc((size_t)h->nbindings + 1, sizeof *p->checked);
    p->layout = malloc(((size_t)h->nbindings + 1) * sizeof *p->layout);
    p->ngroups = h->ngroups;
    p->groups = calloc((size_t)h->ngroups + 1, sizeof *p->groups);
    if (!p->jobs || !p->relocs || !p->extent || !p->binding_used || !p->binding_written || !p->binding_host ||
        !p->checked || !p->layout || !p->groups)
        return plan_fail(p, spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted"));
    memcpy(p->relocs, rl, (size_t)h->nrelocs * sizeof *rl);
    memcpy(p->layout, lay, (size_t)h->nbindings * sizeof *lay);

    /* Jobs that name one program (the same offset and length) share its resident copy:
     * a decoder's layers run the same programs on other buffers, and the relocations,
     * not the programs, say which. */
    uint32_t *owner = program_owners(pj, h->njobs);
    if (!owner)
        return plan_fail(p, spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted"));

    spy_lock(d);
    d->counters.native_calls++;
    p->epoch = d->epoch;
    if (d->lost) {
        spy_unlock(d);
        free(owner);
        return plan_fail(p, spy_fail(SPY_E_DEVICE_LOST, -1, "device %u is lost; reset it", d->ordinal));
    }
    s = SPY_OK;
    for (uint32_t j = 0; j < h->njobs && s == SPY_OK; j++) {
        if (pj[j].kind == SPY_PLAN_JOB_COLLECTIVE) {
            add_collective(p, j, &pj[j], (const uint8_t *)blob + pj[j].prog_off);
            continue;
        }
        p->jobs[j].reloc_begin = pj[j].reloc_begin;
        p->jobs[j].nslots = pj[j].nslots;
        p->jobs[j].name = pj[j].name;
        if (owner[j] != j) { /* committed already, by the first job that names it */
            p->jobs[j].prog = p->jobs[owner[j]].prog;
        } else {
            uint64_t addr;
            s = spy_alloc_get(&d->mem, pj[j].prog_len, SPY_MEM_CONTROL, true, NULL, &addr);
            if (s != SPY_OK)
                break;
            p->jobs[j].prog_addr = addr;
            spy_block *b = spy_alloc_find(&d->mem, addr, pj[j].prog_len);
            b->plan_owned = 1;
            memcpy(b->backing, (const uint8_t *)blob + pj[j].prog_off, pj[j].prog_len);
            s = spy_job_commit_block(d, b, pj[j].prog_len, NULL);
            if (s != SPY_OK) { /* name the job; spy_fail copes with its own message as argument */
                s = spy_fail(s, spy_last_error_command(), "plan job %u: %s", j, spy_last_error());
                break;
            }
            p->jobs[j].prog = b->prog;
            p->upload_bytes += pj[j].prog_len;
        }
        const spy_program *g = p->jobs[j].prog;
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
    }
    free(owner);
    if (s != SPY_OK) {
        release_plan_blocks(d, p);
        spy_unlock(d);
        free(p->jobs);
        p->jobs = NULL;
        return plan_fail(p, s);
    }
    /* The upload is a control transfer on the PCIe link. */
    double now = (double)spy_host_clock_locked(d);
    double start = d->device_free > now ? d->device_free : now;
    d->device_free = start + d->prof.pcie_latency_ns + (double)p->upload_bytes / d->prof.pcie_bytes_per_ns;
    d->device_work += d->device_free - start;
    d->counters.bytes_h2d += p->upload_bytes;
    spy_unlock(d);
    *out = p;
    return SPY_OK;
}

void spy_plan_destroy(spy_plan *p)
{
    if (!p)
        return;
    if (p->jobs) {
        spy_lock(p->dev);
        release_plan_blocks(p->dev, p);
        spy_unlock(p->dev);
    }
    free(p->jobs);
    free(p->relocs);
    free(p->extent);
    free(p->binding_used);
    free(p->binding_written);
    free(p->layout);
    free(p->groups);
    free(p->binding_host);
    free(p->checked);
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

spy_status spy_plan_set_group(spy_plan *p, uint32_t index, spy_ccl *ring)
{
    spy_clear_error();
    if (!p || !ring || index >= p->ngroups)
        return spy_fail(SPY_E_INVALID_ARG, -1, "plan group %u: no plan, no ring, or not one of its %u groups", index,
                        p ? p->ngroups : 0);
    for (uint32_t j = 0; j < p->njobs; j++)
        if (p->jobs[j].kind == SPY_PLAN_JOB_COLLECTIVE && p->jobs[j].coll.group == index &&
            p->jobs[j].coll.nranks != spy_ccl_size(ring))
            return spy_fail(SPY_E_INVALID_ARG, -1, "plan group %u: job %u was built for %u ranks, the ring has %u",
                            index, j, p->jobs[j].coll.nranks, spy_ccl_size(ring));
    p->groups[index] = ring;
    return SPY_OK;
}

/* A job of the launch failed: abort the plan's groups, so that the other ranks' collectives
 * fail instead of waiting for this rank's (the first reason given to a ring stays). */
static void abort_groups(spy_plan *p, uint32_t job)
{
    if (!p->ngroups)
        return;
    char reason[200];
    snprintf(reason, sizeof reason, "its card failed in job %u of a plan: %s", job, spy_last_error());
    for (uint32_t g = 0; g < p->ngroups; g++)
        spy_ccl_abort(p->groups[g], reason);
}

/* One plan's launch on its locked device: check its bindings, patch, run every job. */
static spy_status launch_locked(spy_plan *p, const uint64_t *bindings, uint32_t nbindings, uint32_t name,
                                double *step_end_ns)
{
    spy_device *d = p->dev;
    uint64_t host_t = spy_host_clock_locked(d);
    if (p->epoch != d->epoch)
        return spy_fail(SPY_E_NOT_COMMITTED, -1, "the plan was made before the device was reset; rebuild it");
    if (nbindings != p->nbindings || (nbindings && !bindings))
        return spy_fail(SPY_E_INVALID_ARG, -1, "plan takes %u bindings, %u given", p->nbindings, nbindings);
    for (uint32_t g = 0; g < p->ngroups; g++)
        if (!p->groups[g])
            return spy_fail(SPY_E_INVALID_ARG, -1, "plan group %u has no ring attached (spy_plan_set_group)", g);
    /* Bounds of every binding, once: the commands were checked against slot extents, and
     * each slot is a binding plus an offset inside the binding's extent. The same bindings
     * as the last launch that passed, with no free or commit on the device since, still
     * pass, with the same host memory behind them. */
    size_t table_bytes = (size_t)nbindings * sizeof *bindings;
    bool same = p->checked_valid && p->checked_epoch == d->epoch && p->checked_changes == d->mem.changes &&
                (!nbindings || memcmp(p->checked, bindings, table_bytes) == 0);
    p->checked_valid = same;
    for (uint32_t b = 0; b < nbindings && !same; b++) {
        p->binding_host[b] = NULL;
        if (!p->binding_used[b] || p->extent[b] == 0)
            continue;
        spy_block *blk = spy_alloc_find(&d->mem, bindings[b], p->extent[b]);
        if (!blk)
            return spy_fail(SPY_E_BAD_ADDRESS, -1, "plan binding %u: [0x%llx, +%llu) is not inside a live allocation",
                            b, (unsigned long long)bindings[b], (unsigned long long)p->extent[b]);
        if ((blk->prog || blk->plan_owned) && p->binding_written[b])
            return spy_fail(SPY_E_BAD_ADDRESS, -1, "plan binding %u would overwrite a program", b);
        const spy_layout *want = &p->layout[b];
        if (want->itemsize && (blk->addr != bindings[b] || blk->layout.rows != want->rows ||
                               blk->layout.row_len != want->row_len || blk->layout.itemsize != want->itemsize ||
                               blk->layout.stick_bytes != want->stick_bytes))
            return spy_fail(SPY_E_LAYOUT, -1, "plan binding %u: the plan was built for a storage of %llu x %llu "
                            "elements of %u bytes; the storage bound records %llu x %llu of %u",
                            b, (unsigned long long)want->rows, (unsigned long long)want->row_len, want->itemsize,
                            (unsigned long long)blk->layout.rows, (unsigned long long)blk->layout.row_len,
                            blk->layout.itemsize);
        p->binding_host[b] = blk->backing ? blk->backing + (bindings[b] - blk->addr) : NULL;
    }
    if (!same) {
        if (nbindings)
            memcpy(p->checked, bindings, table_bytes);
        p->checked_epoch = d->epoch;
        p->checked_changes = d->mem.changes;
        p->checked_valid = true;
    }
    /* Patching the resident relocation table is a small control transfer. */
    double now = (double)spy_host_clock_locked(d);
    double not_before = now + d->prof.pcie_latency_ns + (double)nbindings * 8.0 / d->prof.pcie_bytes_per_ns;
    uint64_t first = d->job_seq;
    double end = 0;
    spy_status s = SPY_OK;
    uint8_t **slot_host = spy_job_slot_hosts(d, p->max_slots + 1);
    if (!slot_host)
        return spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted");
    /* Walking the resident jobs is the card's command processor's work, not the host's: the
     * whole walk (relocations, each job's execution) leaves the host clock, as the
     * simulation inside each job does. Checking and patching the bindings above is the
     * host's. */
    bool outermost = spy_card_work_begin(d);
    for (uint32_t j = 0; j < p->njobs && s == SPY_OK; j++) {
        const struct plan_job *job = &p->jobs[j];
        for (uint32_t k = 0; k < job->nslots; k++) {
            const spy_reloc *r = &p->relocs[job->reloc_begin + k];
            slot_host[k] = p->binding_host[r->binding] ? p->binding_host[r->binding] + r->offset : NULL;
        }
        if (job->kind == SPY_PLAN_JOB_COLLECTIVE)
            s = spy_job_collective(d, p->groups[job->coll.group], &job->coll, slot_host[0], slot_host[1],
                                   j == 0 ? not_before : 0, job->name, &end);
        else
            s = spy_job_execute(d, job->prog, j == 0 ? not_before : 0, job->name, &end);
        if (s != SPY_OK) {
            spy_note_error_job(j);
            abort_groups(p, j);
        }
    }
    spy_card_work_end(d, outermost);
    d->counters.plan_launches++;
    spy_trace_launch(d, name, host_t, first, d->job_seq - first);
    if (step_end_ns)
        *step_end_ns = end;
    return s;
}

spy_status spy_plan_launch(spy_plan *p, const uint64_t *bindings, uint32_t nbindings,
                           uint32_t name, double *step_end_ns)
{
    spy_clear_error();
    if (!p)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null plan");
    spy_device *d = p->dev;
    SPY_ENTER(d);
    SPY_REFUSE_IF_LOST(d);
    SPY_LEAVE(d, launch_locked(p, bindings, nbindings, name, step_end_ns));
}

spy_status spy_plan_launch_many(uint32_t n, spy_plan *const *plans, const uint64_t *const *bindings,
                                const uint32_t *nbindings, const uint32_t *names, uint32_t *failed,
                                double *end_ns)
{
    spy_clear_error();
    if (failed)
        *failed = 0;
    if (!n || !plans || !bindings || !nbindings || !names)
        return spy_fail(SPY_E_INVALID_ARG, -1, "no plans, or a null array");
    for (uint32_t i = 0; i < n; i++)
        if (!plans[i] || plans[i]->dev != plans[0]->dev)
            return spy_fail(SPY_E_INVALID_ARG, -1, "plan %u is null or on another device", i);
    spy_device *d = plans[0]->dev;
    SPY_ENTER(d);
    SPY_REFUSE_IF_LOST(d);
    /* Every plan of the current reset epoch before anything runs: a stale list runs nothing. */
    for (uint32_t i = 0; i < n; i++)
        if (plans[i]->epoch != d->epoch) {
            if (failed)
                *failed = i;
            SPY_LEAVE(d, spy_fail(SPY_E_NOT_COMMITTED, -1, "plan %u was made before the device was reset", i));
        }
    spy_status s = SPY_OK;
    for (uint32_t i = 0; i < n && s == SPY_OK; i++) {
        s = launch_locked(plans[i], bindings[i], nbindings[i], names[i], end_ns);
        if (s != SPY_OK && failed)
            *failed = i;
    }
    SPY_LEAVE(d, s);
}
