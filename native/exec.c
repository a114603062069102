/* exec.c -- the functional effect of each command.
 *
 * Called by the simulator when a command starts. Everything here was validated when the
 * program was committed and when its slots were bound, so the only checks left are the
 * ones that depend on data: gather/scatter indices. In timing mode only transfers whose
 * device side is backed move bytes (in practice: uploads of program blocks into control
 * memory). */
#include <string.h>

#include "internal.h"

static void copy_pattern(uint8_t *dst, const uint8_t *src, uint32_t run, uint32_t ndims,
                         const uint32_t *count, const uint64_t *sstride, const uint64_t *dstride)
{
    uint32_t c[3] = {1, 1, 1};
    uint64_t ss[3] = {0, 0, 0}, ds[3] = {0, 0, 0};
    for (uint32_t d = 0; d < ndims; d++) {
        c[d] = count[d];
        ss[d] = sstride[d];
        ds[d] = dstride[d];
    }
    for (uint32_t i2 = 0; i2 < c[2]; i2++)
        for (uint32_t i1 = 0; i1 < c[1]; i1++) {
            const uint8_t *s = src + i2 * ss[2] + i1 * ss[1];
            uint8_t *t = dst + i2 * ds[2] + i1 * ds[1];
            if (ss[0] == run && ds[0] == run) {
                memmove(t, s, (size_t)run * c[0]);
                continue;
            }
            for (uint32_t i0 = 0; i0 < c[0]; i0++)
                memmove(t + i0 * ds[0], s + i0 * ss[0], run);
        }
}

static spy_status exec_dma(spy_exec_ctx *x, const spy_cmd *c)
{
    spy_device *dev = x->dev;
    const spy_dma *d = &c->u.dma;
    uint8_t *src, *dst;
    switch (c->op) {
    case SPY_OP_LOAD:
        src = x->slot_host[d->src_slot];
        dst = dev->lx ? dev->lx[c->core] : NULL;
        break;
    case SPY_OP_STORE:
        src = dev->lx ? dev->lx[c->core] : NULL;
        dst = x->slot_host[d->dst_slot];
        break;
    default: /* H2D, D2H */
        src = x->slot_host[d->src_slot];
        dst = x->slot_host[d->dst_slot];
        break;
    }
    if (!src || !dst)
        return SPY_OK; /* timing mode: nothing backs this side */
    if (c->flags & SPY_DMA_DESCS) {
        const spy_desc *ds = x->prog->descs + d->src_off;
        for (uint32_t k = 0; k < d->desc_count; k++)
            memmove(dst + ds[k].dst_off, src + ds[k].src_off, ds[k].bytes);
        return SPY_OK;
    }
    copy_pattern(dst + d->dst_off, src + d->src_off, d->run_bytes, d->ndims, d->count,
                 d->src_stride, d->dst_stride);
    return SPY_OK;
}

static spy_status exec_gather(spy_exec_ctx *x, const spy_cmd *c, uint32_t index)
{
    const spy_gather *g = &c->u.gather;
    uint8_t *table = x->slot_host[g->table_slot];
    uint8_t *lx = x->dev->lx ? x->dev->lx[c->core] : NULL;
    if (!table || !lx)
        return SPY_OK;
    table += g->table_off;
    const uint8_t *idx = lx + g->idx_off;
    uint64_t packed_inner = g->run_bytes;
    uint64_t packed_stride[2] = {g->run_bytes, g->run_bytes};
    if (g->ndims >= 1)
        packed_stride[1] = packed_inner * g->count[0];
    for (uint32_t i = 0; i < g->nidx; i++) {
        int64_t row;
        if (g->idx_dtype == SPY_DT_I64) {
            memcpy(&row, idx + 8 * (uint64_t)i, 8);
        } else {
            int32_t r32;
            memcpy(&r32, idx + 4 * (uint64_t)i, 4);
            row = r32;
        }
        if (row < 0 || (uint64_t)row >= g->limit)
            return spy_fail(SPY_E_INDEX, index,
                            "command %u: index %lld at position %u is outside the table's %llu rows",
                            index, (long long)row, i, (unsigned long long)g->limit);
        uint8_t *dram = table + (uint64_t)row * g->row_stride;
        uint8_t *mem = lx + g->lx_off + (uint64_t)i * g->lx_pitch;
        if (c->op == SPY_OP_GATHER)
            copy_pattern(mem, dram, g->run_bytes, g->ndims, g->count, g->stride, packed_stride);
        else
            copy_pattern(dram, mem, g->run_bytes, g->ndims, g->count, packed_stride, g->stride);
    }
    return SPY_OK;
}

spy_status spy_exec_command(spy_exec_ctx *x, uint32_t index)
{
    const spy_cmd *c = &x->prog->cmds[index];
    spy_device *dev = x->dev;
    switch (c->op) {
    case SPY_OP_BARRIER:
        return SPY_OK;
    case SPY_OP_H2D: case SPY_OP_D2H: case SPY_OP_LOAD: case SPY_OP_STORE:
        return exec_dma(x, c);
    case SPY_OP_GATHER: case SPY_OP_SCATTER:
        return exec_gather(x, c, index);
    default:
        break;
    }
    if (!dev->lx)
        return SPY_OK;
    uint8_t *lx = dev->lx[c->core];
    switch (c->op) {
    case SPY_OP_MATMUL: {
        const spy_matmul *m = &c->u.mm;
        spy_gemm(m, lx + m->a_off, lx + m->b_off, lx + m->c_off, c->flags & SPY_MM_ACCUMULATE,
                 c->flags & SPY_MM_TRANS_A, c->flags & SPY_MM_TRANS_B, &dev->gemm_panels);
        return SPY_OK;
    }
    case SPY_OP_SFU:
        for (uint32_t k = 0; k < c->u.sfu.ninstrs; k++) {
            spy_status s = spy_sfu_run(&x->prog->instrs[c->u.sfu.instr_begin + k], lx, &dev->sfu_rows);
            if (s != SPY_OK)
                return spy_fail(s, index, "command %u: SFU instruction %u failed", index, k);
        }
        return SPY_OK;
    case SPY_OP_RING:
        memmove(dev->lx[c->u.ring.dst_core] + c->u.ring.dst_off, lx + c->u.ring.src_off,
                c->u.ring.bytes);
        return SPY_OK;
    }
    return SPY_OK;
}
