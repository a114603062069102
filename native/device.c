/* device.c -- the device object: open (with its profile checked, profile.c), close and
 * reset, the host clock and the device's finish, counters and fault injection. The
 * device's memory, jobs, transfer graphs, plans and trace have rooms of their own
 * (memory.c, job.c, transfer.c, plan.c, trace.c). */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Device addresses never look like host pointers, and each device opened gets a window of
 * its own (spyre.h): the next free window is handed out at open. This counter is the one
 * piece of state the runtime shares between devices. */
#define ADDRESS_WINDOW (1ull << SPY_ADDRESS_WINDOW_SHIFT) /* 1 TiB per device */
static atomic_uint_fast64_t next_instance;

/* ---- open / close / reset ---- */

static void free_lx(spy_device *d)
{
    if (!d->lx)
        return;
    for (uint32_t c = 0; c < d->prof.num_cores; c++)
        free(d->lx[c]);
    free(d->lx);
    d->lx = NULL;
}

/* The state a reset starts again: device memory and the scratchpads. */
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
    spy_status s = spy_profile_check(profile);
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
    d->clock_key = instance + 1;
    (void)spy_thread_cpu_take(d->clock_key); /* the opening thread's CPU time counts from here */
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

void spy_device_close(spy_device *d)
{
    if (!d)
        return;
    spy_alloc_destroy(&d->mem);
    free_lx(d);
    spy_sim_free(d->sim);
    spy_trace_free(&d->trace);
    free(d->slot_host);
    spy_sfu_rows_free(&d->sfu_rows);
    spy_gemm_panels_free(&d->gemm_panels);
    pthread_mutex_destroy(&d->lock);
    free(d);
}

uint32_t spy_device_mode(const spy_device *d) { return d ? d->mode : 0; }

uint64_t spy_device_instance(const spy_device *d) { return d ? d->instance : 0; }

uint64_t spy_device_epoch(spy_device *d) { return d ? atomic_load(&d->epoch) : 0; }

spy_status spy_device_reset(spy_device *d)
{
    spy_clear_error();
    if (!d)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null device");
    spy_lock(d);
    spy_alloc_destroy(&d->mem);
    free_lx(d);
    d->lost = false;
    d->epoch++;
    d->fault_kind = SPY_FAULT_NONE;
    spy_status s = make_state(d);
    spy_unlock(d);
    return s;
}

/* ---- clocks ---- */

uint64_t spy_host_clock_ns(spy_device *d)
{
    if (!d)
        return 0;
    spy_lock(d);
    uint64_t t = spy_host_clock_locked(d);
    spy_unlock(d);
    return t;
}

double spy_device_finish_ns(spy_device *d)
{
    double finish = 0;
    if (d)
        spy_read_locked(d, &finish, &d->device_free, sizeof finish);
    return finish;
}

/* The host waits until the device timeline reaches t (no further than its finish). */
static void wait_until_locked(spy_device *d, double t)
{
    if (t > d->device_free)
        t = d->device_free;
    uint64_t now = spy_host_clock_locked(d);
    if (t > (double)now) {
        uint64_t wait = (uint64_t)ceil(t) - now;
        d->waited_ns += wait;
        d->counters.wait_ns += wait;
    }
}

spy_status spy_synchronize(spy_device *d)
{
    SPY_ENTER(d);
    wait_until_locked(d, d->device_free);
    SPY_REFUSE_IF_LOST(d);
    SPY_LEAVE(d, SPY_OK);
}

spy_status spy_synchronize_until(spy_device *d, double t_ns)
{
    SPY_ENTER(d);
    if (isnan(t_ns))
        SPY_LEAVE(d, spy_fail(SPY_E_INVALID_ARG, -1, "synchronize until NaN"));
    wait_until_locked(d, t_ns);
    SPY_REFUSE_IF_LOST(d);
    SPY_LEAVE(d, SPY_OK);
}

spy_status spy_clock_read(spy_device *d, spy_clock *out)
{
    spy_clear_error();
    if (!d || !out)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null argument");
    spy_lock(d); /* one instant: a getter, not counted as a native call */
    out->host_ns = spy_host_clock_locked(d);
    out->host_wall_ns = spy_host_wall_locked(d);
    out->finish_ns = d->device_free;
    out->work_ns = d->device_work;
    spy_unlock(d);
    return SPY_OK;
}

/* ---- counters ---- */

spy_status spy_counters_get(spy_device *d, spy_counters *out)
{
    if (!d || !out)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null argument");
    spy_read_locked(d, out, &d->counters, sizeof *out);
    return SPY_OK;
}

spy_status spy_counters_reset(spy_device *d)
{
    if (!d)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null device");
    spy_lock(d);
    memset(&d->counters, 0, sizeof d->counters);
    spy_unlock(d);
    return SPY_OK;
}

/* ---- faults ---- */

spy_status spy_fault_inject(spy_device *d, uint32_t kind, uint64_t after_n)
{
    if (!d || kind > SPY_FAULT_LOST)
        return spy_fail(SPY_E_INVALID_ARG, -1, "bad device or fault kind");
    spy_lock(d);
    d->fault_kind = kind;
    d->fault_after = after_n;
    spy_unlock(d);
    return SPY_OK;
}
