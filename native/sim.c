/* sim.c -- the co-simulated device timeline.
 *
 * A job's commands run on engines: per core a LOAD, a STORE, a PT (systolic) and an SFU
 * engine and a ring port; per card the two PCIe directions and a control engine. An
 * engine runs its commands one at a time in program order; a command starts when its
 * engine reaches it and its dependencies have ended. Durations come from the profile
 * (cost model below). DRAM <-> scratchpad transfers share the DRAM bandwidth: after a
 * fixed latency each active transfer progresses at min(core port, DRAM / active), an
 * exact processor-sharing model kept with one "bytes served per transfer" counter and
 * a heap of finishing targets, so a step costs O(log n) per event.
 *
 * Functional effects are applied when a command starts, in timeline order; the
 * dependencies guarantee the inputs are complete at that point. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

enum { EV_DONE = 0, EV_LATENCY = 1 };

typedef struct event {
    double t;
    uint64_t seq;
    uint32_t cmd;
    uint32_t kind;
} event;

typedef struct heap {
    event *a;
    size_t n, cap;
} heap;

struct spy_sim {
    size_t cap;          /* commands the arrays hold */
    size_t engcap;
    uint32_t *pending;
    uint32_t *succ_start, *succ;
    size_t succcap;
    uint32_t *eng_start, *eng_list, *eng_cursor;
    uint8_t *eng_busy;
    double *start, *bytes;
    heap ev, pool;
    uint64_t seq;
};

static bool heap_less(const event *x, const event *y)
{
    return x->t < y->t || (x->t == y->t && x->seq < y->seq);
}

static bool heap_push(heap *h, event e)
{
    if (h->n == h->cap) {
        size_t nc = h->cap ? h->cap * 2 : 256;
        event *a = realloc(h->a, nc * sizeof *a);
        if (!a)
            return false;
        h->a = a;
        h->cap = nc;
    }
    size_t i = h->n++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (!heap_less(&e, &h->a[parent]))
            break;
        h->a[i] = h->a[parent];
        i = parent;
    }
    h->a[i] = e;
    return true;
}

static event heap_pop(heap *h)
{
    event top = h->a[0], last = h->a[--h->n];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        const event *best = &last;
        if (l < h->n && heap_less(&h->a[l], best)) {
            m = l;
            best = &h->a[l];
        }
        if (r < h->n && heap_less(&h->a[r], best))
            m = r;
        if (m == i)
            break;
        h->a[i] = h->a[m];
        i = m;
    }
    if (h->n)
        h->a[i] = last;
    return top;
}

spy_sim *spy_sim_new(void) { return calloc(1, sizeof(spy_sim)); }

void spy_sim_free(spy_sim *s)
{
    if (!s)
        return;
    free(s->pending);
    free(s->succ_start);
    free(s->succ);
    free(s->eng_start);
    free(s->eng_list);
    free(s->eng_cursor);
    free(s->eng_busy);
    free(s->start);
    free(s->bytes);
    free(s->ev.a);
    free(s->pool.a);
    free(s);
}

static bool reserve(spy_sim *s, size_t n, size_t ndeps, size_t neng)
{
    if (n > s->cap) {
        size_t c = n;
        void *p1 = realloc(s->pending, c * sizeof(uint32_t));
        if (p1) s->pending = p1;
        void *p2 = realloc(s->succ_start, (c + 1) * sizeof(uint32_t));
        if (p2) s->succ_start = p2;
        void *p3 = realloc(s->eng_list, c * sizeof(uint32_t));
        if (p3) s->eng_list = p3;
        void *p4 = realloc(s->start, c * sizeof(double));
        if (p4) s->start = p4;
        void *p5 = realloc(s->bytes, c * sizeof(double));
        if (p5) s->bytes = p5;
        if (!p1 || !p2 || !p3 || !p4 || !p5)
            return false;
        s->cap = c;
    }
    if (ndeps > s->succcap) {
        void *p = realloc(s->succ, ndeps * sizeof(uint32_t));
        if (!p)
            return false;
        s->succ = p;
        s->succcap = ndeps;
    }
    if (neng > s->engcap) {
        void *p1 = realloc(s->eng_start, (neng + 1) * sizeof(uint32_t));
        if (p1) s->eng_start = p1;
        void *p2 = realloc(s->eng_cursor, neng * sizeof(uint32_t));
        if (p2) s->eng_cursor = p2;
        void *p3 = realloc(s->eng_busy, neng);
        if (p3) s->eng_busy = p3;
        if (!p1 || !p2 || !p3)
            return false;
        s->engcap = neng;
    }
    return true;
}

/* ---- cost model ---------------------------------------------------------------------- */

static double round_up(double x, double g) { return g > 1 ? ceil(x / g) * g : x; }

static double charged(const spy_profile *p, uint64_t run, uint64_t nruns)
{
    uint64_t burst = p->dram_burst_bytes ? p->dram_burst_bytes : 1;
    return (double)(((run + burst - 1) / burst) * burst) * (double)nruns;
}

/* Bytes a DRAM-side transfer charges to the shared DRAM bandwidth. */
static double dram_bytes(const spy_profile *p, const spy_program *g, const spy_cmd *c)
{
    if (c->op == SPY_OP_GATHER || c->op == SPY_OP_SCATTER) {
        const spy_gather *gt = &c->u.gather;
        uint64_t runs = gt->nidx;
        for (uint32_t d = 0; d < gt->ndims; d++)
            runs *= gt->count[d];
        return charged(p, gt->run_bytes, runs);
    }
    const spy_dma *d = &c->u.dma;
    if (c->flags & SPY_DMA_DESCS) {
        double total = 0;
        for (uint64_t k = d->src_off; k < d->src_off + d->desc_count; k++)
            total += charged(p, g->descs[k].bytes, 1);
        return total;
    }
    uint64_t runs = 1;
    for (uint32_t k = 0; k < d->ndims; k++)
        runs *= d->count[k];
    return charged(p, d->run_bytes, runs);
}

static double matmul_ns(const spy_profile *p, const spy_cmd *c)
{
    const spy_matmul *m = &c->u.mm;
    double macs = (double)m->m * m->n * m->k;
    double padded = round_up(m->m, p->pt_gran_m) * round_up(m->n, p->pt_gran_n) *
                    round_up(m->k, p->pt_gran_k);
    double rate = p->pt_macs_per_ns * p->pt_utilization * (macs / padded);
    if (m->a_dtype == SPY_DT_F32 || m->b_dtype == SPY_DT_F32)
        rate *= p->pt_fp32_ratio;
    return p->pt_latency_ns + macs / rate;
}

static double pcie_ns(const spy_profile *p, const spy_program *g, const spy_cmd *c)
{
    double ndesc = (c->flags & SPY_DMA_DESCS) ? c->u.dma.desc_count : 1;
    return p->pcie_latency_ns + ndesc * p->pcie_descriptor_ns +
           (double)spy_host_dma_bytes(g, c) / p->pcie_bytes_per_ns;
}

static double fixed_ns(const spy_profile *p, const spy_program *g, const spy_cmd *c)
{
    switch (c->op) {
    case SPY_OP_BARRIER: return p->barrier_ns;
    case SPY_OP_H2D: case SPY_OP_D2H: return pcie_ns(p, g, c);
    case SPY_OP_MATMUL: return matmul_ns(p, c);
    case SPY_OP_SFU: {
        double cycles = 0;
        for (uint32_t k = 0; k < c->u.sfu.ninstrs; k++)
            cycles += spy_sfu_cycles(p, &g->instrs[c->u.sfu.instr_begin + k]);
        return c->u.sfu.ninstrs * p->sfu_latency_ns + cycles / p->clock_ghz;
    }
    case SPY_OP_RING: {
        uint32_t a = c->core, b = c->u.ring.dst_core, n = p->num_cores;
        uint32_t hops = a > b ? a - b : b - a;
        if (n - hops < hops)
            hops = n - hops;
        return hops * p->ring_hop_ns +
               c->u.ring.bytes / (p->ring_bytes_per_cycle * p->clock_ghz);
    }
    }
    return 0;
}

static bool uses_dram_pool(const spy_cmd *c)
{
    return c->op == SPY_OP_LOAD || c->op == SPY_OP_STORE || c->op == SPY_OP_GATHER ||
           c->op == SPY_OP_SCATTER;
}

/* ---- the event loop ------------------------------------------------------------------ */

typedef struct run_state {
    spy_device *dev;
    const spy_program *g;
    spy_sim *s;
    spy_exec_ctx *ctx;
    uint64_t job;
    spy_status err;
    double fail_t;
    double t0;    /* absolute start of the job: the loop runs in job-relative time so that
                     durations do not depend on where the job sits on the timeline */
    double compute[2]; /* the span of its compute commands ([0] < 0: none yet) */
} run_state;

static void trace_cmd(run_state *r, uint32_t i, double start, double end)
{
    spy_device *dev = r->dev;
    if (!dev->trace.enabled || !dev->trace.commands)
        return;
    const spy_cmd *c = &r->g->cmds[i];
    spy_trace_event ev = {0};
    ev.kind = SPY_EV_CMD;
    ev.core = c->core;
    uint32_t e = spy_engine_of(&dev->prof, c);
    ev.engine = (uint16_t)(e % SPY_ENG_PER_CORE);
    if (c->core == SPY_CORE_CARD)
        ev.engine = (uint16_t)(e - dev->prof.num_cores * SPY_ENG_PER_CORE);
    ev.start_ns = r->t0 + start;
    ev.end_ns = r->t0 + end;
    ev.job = r->job;
    ev.a = c->op;
    if (c->op == SPY_OP_MATMUL)
        ev.b = (uint64_t)c->u.mm.m * c->u.mm.n * c->u.mm.k;
    else if (uses_dram_pool(c))
        ev.b = (uint64_t)r->s->bytes[i];
    else if (c->op == SPY_OP_RING)
        ev.b = c->u.ring.bytes;
    else if (c->op == SPY_OP_SFU)
        ev.b = c->u.sfu.ninstrs;
    else if (c->op == SPY_OP_H2D || c->op == SPY_OP_D2H)
        ev.b = spy_host_dma_bytes(r->g, c);
    spy_trace_push(dev, &ev);
}

/* Fault injection: returns a failing status when the armed fault fires on this command. */
static spy_status maybe_fault(spy_device *dev, const spy_cmd *c, uint32_t i)
{
    if (dev->fault_kind == SPY_FAULT_NONE)
        return SPY_OK;
    bool is_dma = c->op == SPY_OP_H2D || c->op == SPY_OP_D2H || c->op == SPY_OP_LOAD ||
                  c->op == SPY_OP_STORE || c->op == SPY_OP_GATHER || c->op == SPY_OP_SCATTER;
    if (dev->fault_kind == SPY_FAULT_DMA && !is_dma)
        return SPY_OK;
    if (dev->fault_after > 0) {
        dev->fault_after--;
        return SPY_OK;
    }
    uint32_t kind = dev->fault_kind;
    dev->fault_kind = SPY_FAULT_NONE;
    switch (kind) {
    case SPY_FAULT_DMA:
        return spy_fail(SPY_E_DMA, i, "command %u: DMA engine error (injected)", i);
    case SPY_FAULT_LOST:
        dev->lost = true;
        return spy_fail(SPY_E_DEVICE_LOST, i, "command %u: device lost (injected); reset it", i);
    default:
        return spy_fail(SPY_E_COMMAND_FAULT, i, "command %u: engine error (injected)", i);
    }
}

static void start_cmd(run_state *r, uint32_t i, double t)
{
    spy_sim *s = r->s;
    const spy_cmd *c = &r->g->cmds[i];
    const spy_profile *p = &r->dev->prof;
    s->eng_busy[spy_engine_of(p, c)] = 1;
    s->start[i] = t;
    if (r->err == SPY_OK) {
        spy_status st = maybe_fault(r->dev, c, i);
        if (st == SPY_OK)
            st = spy_exec_command(r->ctx, i);
        if (st != SPY_OK) {
            r->err = st;
            r->fail_t = t;
        }
    }
    event e = {0};
    e.seq = s->seq++;
    e.cmd = i;
    if (uses_dram_pool(c)) {
        s->bytes[i] = dram_bytes(p, r->g, c);
        e.kind = EV_LATENCY;
        e.t = t + p->dma_latency_ns;
    } else {
        e.kind = EV_DONE;
        e.t = t + fixed_ns(p, r->g, c);
    }
    if (!heap_push(&s->ev, e) && r->err == SPY_OK) {
        r->err = spy_fail(SPY_E_HOST_NOMEM, i, "host memory exhausted simulating");
        r->fail_t = t;
    }
}

static void try_start(run_state *r, uint32_t e, double t)
{
    spy_sim *s = r->s;
    if (s->eng_busy[e] || s->eng_cursor[e] == s->eng_start[e + 1])
        return;
    uint32_t i = s->eng_list[s->eng_cursor[e]];
    if (s->pending[i] == 0)
        start_cmd(r, i, t);
}

static void finish_cmd(run_state *r, uint32_t i, double t)
{
    spy_sim *s = r->s;
    const spy_profile *p = &r->dev->prof;
    uint32_t e = spy_engine_of(p, &r->g->cmds[i]);
    trace_cmd(r, i, s->start[i], t);
    uint8_t op = r->g->cmds[i].op;
    if (op == SPY_OP_MATMUL || op == SPY_OP_SFU) {
        if (r->compute[0] < 0 || s->start[i] < r->compute[0])
            r->compute[0] = s->start[i];
        if (t > r->compute[1])
            r->compute[1] = t;
    }
    s->eng_busy[e] = 0;
    s->eng_cursor[e]++;
    for (uint32_t k = s->succ_start[i]; k < s->succ_start[i + 1]; k++) {
        uint32_t j = s->succ[k];
        if (--s->pending[j] == 0)
            try_start(r, spy_engine_of(p, &r->g->cmds[j]), t);
    }
    try_start(r, e, t);
}

spy_status spy_sim_run(spy_device *dev, const spy_program *g, spy_exec_ctx *ctx, double t0,
                       uint32_t name, double *duration, double compute[2])
{
    const spy_profile *p = &dev->prof;
    spy_sim *s = dev->sim;
    uint32_t n = g->hdr->ncmds;
    uint32_t neng = spy_num_engines(p);
    /* the successor array holds one entry per edge, which can exceed the dependency
     * entries when commands share them (validation bounded the edge count) */
    if (!reserve(s, n, (size_t)g->nedges, neng))
        return spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted simulating");
    /* dependency successors (CSR) and per-engine command lists (counting sort) */
    memset(s->succ_start, 0, ((size_t)n + 1) * sizeof(uint32_t));
    memset(s->eng_start, 0, ((size_t)neng + 1) * sizeof(uint32_t));
    for (uint32_t i = 0; i < n; i++) {
        const spy_cmd *c = &g->cmds[i];
        s->pending[i] = c->ndeps;
        for (uint32_t k = 0; k < c->ndeps; k++)
            s->succ_start[g->deps[c->dep_begin + k] + 1]++;
        s->eng_start[spy_engine_of(p, c) + 1]++;
    }
    for (uint32_t i = 0; i < n; i++)
        s->succ_start[i + 1] += s->succ_start[i];
    for (uint32_t e = 0; e < neng; e++)
        s->eng_start[e + 1] += s->eng_start[e];
    memcpy(s->eng_cursor, s->eng_start, neng * sizeof(uint32_t));
    for (uint32_t i = 0; i < n; i++) {
        const spy_cmd *c = &g->cmds[i];
        uint32_t e = spy_engine_of(p, c);
        s->eng_list[s->eng_cursor[e]++] = i;
        for (uint32_t k = 0; k < c->ndeps; k++) {
            uint32_t d = g->deps[c->dep_begin + k];
            s->succ[s->succ_start[d]++] = i;
        }
    }
    /* succ_start was advanced while filling; shift back */
    for (uint32_t i = n; i > 0; i--)
        s->succ_start[i] = s->succ_start[i - 1];
    s->succ_start[0] = 0;
    memcpy(s->eng_cursor, s->eng_start, neng * sizeof(uint32_t));
    memset(s->eng_busy, 0, neng);
    s->ev.n = 0;
    s->pool.n = 0;
    s->seq = 0;

    run_state r = {dev, g, s, ctx, dev->job_seq, SPY_OK, 0, t0, {-1, 0}};

    double t = 0, served = 0, job_end = 0;
    for (uint32_t e = 0; e < neng; e++)
        try_start(&r, e, t);
    while (s->ev.n || s->pool.n) {
        double rate = 0, t_pool = INFINITY, t_ev = s->ev.n ? s->ev.a[0].t : INFINITY;
        if (s->pool.n) {
            rate = p->dram_bytes_per_ns / (double)s->pool.n;
            if (rate > p->core_dma_bytes_per_ns)
                rate = p->core_dma_bytes_per_ns;
            t_pool = t + (s->pool.a[0].t - served) / rate;
            if (t_pool < t)
                t_pool = t;
        }
        if (t_pool <= t_ev) {
            served = s->pool.a[0].t;  /* exact: the finishing transfer is fully served */
            t = t_pool;
            event e = heap_pop(&s->pool);
            finish_cmd(&r, e.cmd, t);
        } else {
            served += (t_ev - t) * rate;
            t = t_ev;
            event e = heap_pop(&s->ev);
            if (e.kind == EV_LATENCY) {
                event j = {served + s->bytes[e.cmd], s->seq++, e.cmd, EV_DONE};
                if (!heap_push(&s->pool, j)) {
                    r.err = spy_fail(SPY_E_HOST_NOMEM, e.cmd, "host memory exhausted simulating");
                    break;
                }
            } else {
                finish_cmd(&r, e.cmd, t);
            }
        }
        if (t > job_end)
            job_end = t;
        if (r.err != SPY_OK && (r.err == SPY_E_DEVICE_LOST || r.err == SPY_E_HOST_NOMEM))
            break;
    }
    if (r.err != SPY_OK) {
        /* The job stops at the failing command; later commands were neither executed
         * nor, after the fault, given any effect. */
        s->ev.n = 0;
        s->pool.n = 0;
    }
    spy_trace_job(dev, r.job, t0, t0 + job_end, name, n, r.compute);
    *duration = job_end;
    compute[0] = r.compute[0];
    compute[1] = r.compute[1];
    return r.err;
}
