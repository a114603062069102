/* transfer.c -- transfer graphs: programs of DMA commands between host and device memory
 * that stay in host memory (spyre.h). Create validates a private copy of the block once;
 * run binds its slots and puts the job on the timeline like any launch (job.c). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

struct spy_transfer {
    spy_device *dev;      /* borrowed: the device outlives its transfer graphs */
    uint8_t *blob;        /* our copy: the validated program points into it */
    spy_block block;      /* a host-resident stand-in for a control block; owns the program */
};

/* A transfer graph runs on the DMA engines only. */
static spy_status check_dma_only(const spy_program *g)
{
    for (uint32_t i = 0; i < g->hdr->ncmds; i++) {
        uint8_t op = g->cmds[i].op;
        if (op != SPY_OP_H2D && op != SPY_OP_D2H && op != SPY_OP_BARRIER)
            return spy_fail(SPY_E_BAD_COMMAND, i,
                            "command %u: a transfer graph runs on the DMA engines only (opcode %u)",
                            i, op);
    }
    return SPY_OK;
}

spy_status spy_transfer_create(spy_device *d, const void *blob, uint64_t len, spy_transfer **out)
{
    SPY_ENTER(d);
    if (!out || !blob)
        SPY_LEAVE(d, spy_fail(SPY_E_INVALID_ARG, -1, "null transfer arguments"));
    *out = NULL;
    if (len > SIZE_MAX - 7)
        SPY_LEAVE(d, spy_fail(SPY_E_BAD_PROGRAM, -1, "transfer graph of %llu bytes",
                              (unsigned long long)len));
    spy_transfer *t = calloc(1, sizeof *t);
    uint8_t *copy = t ? aligned_alloc(8, (len + 7) & ~7ull) : NULL;
    if (!t || !copy) {
        free(t);
        free(copy);
        SPY_LEAVE(d, spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted"));
    }
    memcpy(copy, blob, len);
    spy_program *g;
    spy_status s = spy_program_decode(&d->prof, copy, len, &g);
    if (s == SPY_OK) {
        s = check_dma_only(g);
        if (s != SPY_OK)
            spy_program_free(g);
    }
    if (s != SPY_OK) {
        free(copy);
        free(t);
        SPY_LEAVE(d, s);
    }
    d->counters.validated_commands += g->hdr->ncmds;
    t->dev = d;
    t->blob = copy;
    t->block.prog = g;
    t->block.kind = SPY_MEM_CONTROL;
    *out = t;
    SPY_LEAVE(d, SPY_OK);
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
    SPY_ENTER(d);
    SPY_REFUSE_IF_LOST(d);
    uint64_t host_t = spy_host_clock_locked(d);
    if (nbindings != t->block.prog->hdr->nslots || (nbindings && !bindings))
        SPY_LEAVE(d, spy_fail(SPY_E_INVALID_ARG, -1, "transfer has %u slots, %u bindings given",
                              t->block.prog->hdr->nslots, nbindings));
    uint64_t first = d->job_seq;
    double end = 0;
    spy_status s = spy_job_run_bound(d, &t->block, bindings, (double)spy_host_clock_locked(d), name, &end);
    spy_trace_launch(d, name, host_t, first, d->job_seq - first);
    if (end_ns)
        *end_ns = end;
    SPY_LEAVE(d, s);
}
