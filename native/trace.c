/* trace.c -- the device's trace buffer: events of jobs, commands, launches and host spans
 * (the profiler's input), and the interned names that label them. Recording is best
 * effort: an event that finds no host memory is dropped rather than failing a job. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

void spy_trace_push(spy_device *d, const spy_trace_event *ev)
{
    spy_trace *t = &d->trace;
    if (t->n == t->cap) {
        uint64_t nc = t->cap ? t->cap * 2 : 4096;
        spy_trace_event *e = realloc(t->ev, nc * sizeof *e);
        if (!e)
            return;
        t->ev = e;
        t->cap = nc;
    }
    t->ev[t->n++] = *ev;
}

void spy_trace_launch(spy_device *d, uint32_t name, uint64_t host_start, uint64_t first_job,
                      uint64_t njobs)
{
    if (!d->trace.enabled || njobs == 0) /* a launch refused before any job ran */
        return;
    spy_trace_event ev = {0};
    ev.kind = SPY_EV_LAUNCH;
    ev.core = SPY_CORE_CARD;
    ev.start_ns = (double)host_start;
    ev.end_ns = (double)spy_host_clock_locked(d);
    ev.job = first_job;
    ev.a = name;
    ev.b = njobs;
    spy_trace_push(d, &ev);
}

void spy_trace_job(spy_device *d, uint64_t job, double start, double end, uint32_t name, uint64_t ncmds,
                   const double *compute)
{
    if (!d->trace.enabled)
        return;
    spy_trace_event ev = {0};
    ev.kind = SPY_EV_JOB;
    ev.core = SPY_CORE_CARD;
    ev.start_ns = start;
    ev.end_ns = end;
    ev.job = job;
    ev.a = name;
    ev.b = ncmds;
    spy_trace_push(d, &ev);
    if (compute && compute[0] >= 0) {
        ev.kind = SPY_EV_COMPUTE;
        ev.start_ns = start + compute[0];
        ev.end_ns = start + compute[1];
        ev.a = ev.b = 0;
        spy_trace_push(d, &ev);
    }
}

void spy_trace_free(spy_trace *t)
{
    free(t->ev);
    for (uint32_t i = 0; i < t->nnames; i++)
        free(t->names[i]);
    free(t->names);
    memset(t, 0, sizeof *t);
}

spy_status spy_trace_enable(spy_device *d, uint32_t enabled, uint32_t commands)
{
    if (!d)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null device");
    spy_lock(d);
    d->trace.enabled = enabled != 0;
    d->trace.commands = commands != 0;
    spy_unlock(d);
    return SPY_OK;
}

uint32_t spy_trace_intern(spy_device *d, const char *name)
{
    if (!d || !name)
        return 0;
    spy_lock(d);
    spy_trace *t = &d->trace;
    uint32_t id = 0;
    for (uint32_t i = 0; i < t->nnames && !id; i++)
        if (strcmp(t->names[i], name) == 0)
            id = i + 1;
    if (!id && t->nnames == t->capnames) {
        uint32_t nc = t->capnames ? t->capnames * 2 : 64;
        char **n = realloc(t->names, nc * sizeof *n);
        if (n) {
            t->names = n;
            t->capnames = nc;
        }
    }
    if (!id && t->nnames < t->capnames) {
        char *copy = strdup(name);
        if (copy) {
            t->names[t->nnames++] = copy;
            id = t->nnames;
        }
    }
    spy_unlock(d);
    return id; /* 0 when host memory ran out: an unnamed label */
}

const char *spy_trace_name(spy_device *d, uint32_t id)
{
    if (!d || id == 0)
        return NULL;
    spy_lock(d);
    const char *n = id <= d->trace.nnames ? d->trace.names[id - 1] : NULL;
    spy_unlock(d);
    return n;
}

spy_status spy_trace_host_span(spy_device *d, uint32_t name, uint64_t start_ns, uint64_t end_ns)
{
    if (!d)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null device");
    spy_lock(d);
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
    spy_unlock(d);
    return SPY_OK;
}

uint64_t spy_trace_count(spy_device *d)
{
    uint64_t n = 0;
    if (d)
        spy_read_locked(d, &n, &d->trace.n, sizeof n);
    return n;
}

spy_status spy_trace_read(spy_device *d, uint64_t first, spy_trace_event *out, uint64_t max,
                          uint64_t *n)
{
    if (!d || !n || (max && !out))
        return spy_fail(SPY_E_INVALID_ARG, -1, "null argument");
    spy_lock(d);
    uint64_t avail = first < d->trace.n ? d->trace.n - first : 0;
    uint64_t k = avail < max ? avail : max;
    if (k)
        memcpy(out, d->trace.ev + first, k * sizeof *out);
    *n = k;
    spy_unlock(d);
    return SPY_OK;
}

spy_status spy_trace_clear(spy_device *d)
{
    if (!d)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null device");
    spy_lock(d);
    d->trace.n = 0;
    spy_unlock(d);
    return SPY_OK;
}
