/* program.c -- decoding and validating program blocks, and the facts about a command that
 * the validator and the simulator share (its engine, the bytes of a host DMA).
 *
 * Everything a command could do wrong is caught here, before anything runs: the block's
 * own header (spy_block_check, which plan blocks use too), sizes and offsets, every
 * command's opcode, core, dtype and shape (SFU instructions against the op table,
 * sfu_ops.h), every scratchpad range against the scratchpad (and the alignment of typed
 * scratchpad operands), every DRAM or host range against its slot's declared extent, and
 * cycles in the graph formed by dependencies *and* engine order (commands on one engine
 * run in program order, so a dependency on a later command of the same engine is a
 * deadlock even when the dependency graph alone is acyclic). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define MAX_COUNT (1u << 26)
/* Dependency edges of one program. Commands may share dependency entries (their windows
 * [dep_begin, +ndeps) may overlap), so the edge count is bounded on its own. */
#define MAX_EDGES (1u << 26)

typedef struct vctx {
    const spy_profile *p;
    spy_program *prog;
    uint64_t lx_high;
} vctx;

uint32_t spy_engine_of(const spy_profile *p, const spy_cmd *c)
{
    switch (c->op) {
    case SPY_OP_H2D: return p->num_cores * SPY_ENG_PER_CORE + SPY_ENG_H2D;
    case SPY_OP_D2H: return p->num_cores * SPY_ENG_PER_CORE + SPY_ENG_D2H;
    case SPY_OP_BARRIER: return p->num_cores * SPY_ENG_PER_CORE + SPY_ENG_CTRL;
    case SPY_OP_LOAD:
    case SPY_OP_GATHER: return c->core * SPY_ENG_PER_CORE + SPY_ENG_LOAD;
    case SPY_OP_STORE:
    case SPY_OP_SCATTER: return c->core * SPY_ENG_PER_CORE + SPY_ENG_STORE;
    case SPY_OP_MATMUL: return c->core * SPY_ENG_PER_CORE + SPY_ENG_PT;
    case SPY_OP_SFU: return c->core * SPY_ENG_PER_CORE + SPY_ENG_SFU;
    default: return c->core * SPY_ENG_PER_CORE + SPY_ENG_RING;
    }
}

static spy_status lx_range(vctx *v, uint32_t i, const char *what, uint64_t off, uint64_t len)
{
    uint64_t end;
    if (!spy_add_ok(off, len, &end) || end > v->p->scratchpad_bytes)
        return spy_fail(SPY_E_SCRATCHPAD, i,
                        "command %u: %s scratchpad range [%llu, +%llu) exceeds the %llu-byte "
                        "scratchpad",
                        i, what, (unsigned long long)off, (unsigned long long)len,
                        (unsigned long long)v->p->scratchpad_bytes);
    if (end > v->lx_high)
        v->lx_high = end;
    return SPY_OK;
}

static spy_status slot_range(vctx *v, uint32_t i, const char *what, uint32_t slot, uint32_t kind,
                             uint64_t off, uint64_t len, bool writes)
{
    const spy_program *g = v->prog;
    if (slot >= g->hdr->nslots)
        return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: %s slot %u, the program has %u slots",
                        i, what, slot, g->hdr->nslots);
    if (g->slots[slot].kind != kind)
        return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: %s slot %u is a %s slot, needs %s", i,
                        what, slot, g->slots[slot].kind == SPY_SLOT_HOST ? "host" : "DRAM",
                        kind == SPY_SLOT_HOST ? "host" : "DRAM");
    uint64_t end;
    if (!spy_add_ok(off, len, &end) || end > g->slots[slot].extent)
        return spy_fail(SPY_E_BAD_ADDRESS, i,
                        "command %u: %s range [%llu, +%llu) is outside slot %u (extent %llu)", i,
                        what, (unsigned long long)off, (unsigned long long)len, slot,
                        (unsigned long long)g->slots[slot].extent);
    if (writes)
        g->slot_written[slot] = 1;
    return SPY_OK;
}

/* Span of a strided pattern: last byte touched + 1, relative to its start. */
static bool pattern_span(uint32_t run, uint32_t ndims, const uint32_t *count, const uint64_t *stride,
                         uint64_t *span)
{
    uint64_t s = run;
    for (uint32_t d = 0; d < ndims; d++) {
        uint64_t t;
        if (count[d] == 0 || count[d] > MAX_COUNT)
            return false;
        if (!spy_mul_ok((uint64_t)(count[d] - 1), stride[d], &t) || !spy_add_ok(s, t, &s))
            return false;
    }
    *span = s;
    return true;
}

static uint64_t pattern_bytes(uint32_t run, uint32_t ndims, const uint32_t *count)
{
    uint64_t n = run;
    for (uint32_t d = 0; d < ndims; d++)
        n *= count[d];
    return n;
}

spy_status spy_program_footprint(const spy_cmd *cmds, uint32_t ncmds, const spy_desc *descs, uint32_t ndescs,
                                 uint64_t *dram_bytes, uint32_t *cores)
{
    if ((ncmds && !cmds) || (ndescs && !descs) || !dram_bytes || !cores)
        return spy_fail(SPY_E_INVALID_ARG, -1, "program footprint: null commands, descriptors or output");
    uint64_t total = 0, seen[1024] = {0}; /* a bit per core id */
    uint32_t distinct = 0;
    for (uint32_t i = 0; i < ncmds; i++) {
        const spy_cmd *c = &cmds[i];
        if (c->op == SPY_OP_LOAD || c->op == SPY_OP_STORE) {
            const spy_dma *d = &c->u.dma;
            if (c->flags & SPY_DMA_DESCS) {
                uint64_t first = d->src_off < ndescs ? d->src_off : ndescs;
                uint64_t end = first + d->desc_count < ndescs ? first + d->desc_count : ndescs;
                for (uint64_t k = first; k < end; k++)
                    total += descs[k].bytes;
            } else {
                total += pattern_bytes(d->run_bytes, d->ndims < 3 ? d->ndims : 3, d->count);
            }
        } else if (c->op == SPY_OP_GATHER || c->op == SPY_OP_SCATTER) {
            const spy_gather *g = &c->u.gather;
            total += (uint64_t)g->nidx * pattern_bytes(g->run_bytes, g->ndims < 2 ? g->ndims : 2, g->count);
        }
        if (c->core != SPY_CORE_CARD && !(seen[c->core / 64] & (1ull << (c->core % 64)))) {
            seen[c->core / 64] |= 1ull << (c->core % 64);
            distinct++;
        }
    }
    *dram_bytes = total;
    *cores = distinct;
    return SPY_OK;
}

static spy_status check_dma(vctx *v, uint32_t i, const spy_cmd *c)
{
    const spy_dma *d = &c->u.dma;
    const spy_program *g = v->prog;
    bool src_lx = c->op == SPY_OP_STORE, dst_lx = c->op == SPY_OP_LOAD;
    uint32_t src_kind = c->op == SPY_OP_H2D ? SPY_SLOT_HOST : SPY_SLOT_DRAM;
    uint32_t dst_kind = c->op == SPY_OP_D2H ? SPY_SLOT_HOST : SPY_SLOT_DRAM;
    spy_status s;
    if (c->flags & ~(uint32_t)SPY_DMA_DESCS)
        return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: unknown DMA flags 0x%x", i, c->flags);
    if (c->flags & SPY_DMA_DESCS) {
        uint64_t first = d->src_off, end;
        if (d->desc_count == 0 || !spy_add_ok(first, d->desc_count, &end) || end > g->hdr->ndescs)
            return spy_fail(SPY_E_BAD_COMMAND, i,
                            "command %u: descriptors [%llu, +%u) outside the program's %u", i,
                            (unsigned long long)first, d->desc_count, g->hdr->ndescs);
        uint64_t total = 0;
        for (uint64_t k = first; k < end; k++) {
            const spy_desc *ds = &g->descs[k];
            if (ds->bytes == 0)
                return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: descriptor %llu is empty", i,
                                (unsigned long long)k);
            s = src_lx ? lx_range(v, i, "source", ds->src_off, ds->bytes)
                       : slot_range(v, i, "source", d->src_slot, src_kind, ds->src_off, ds->bytes,
                                    false);
            if (s != SPY_OK)
                return s;
            s = dst_lx ? lx_range(v, i, "destination", ds->dst_off, ds->bytes)
                       : slot_range(v, i, "destination", d->dst_slot, dst_kind, ds->dst_off,
                                    ds->bytes, true);
            if (s != SPY_OK)
                return s;
            total += ds->bytes;
        }
        v->prog->info.dma_bytes += total;
        return SPY_OK;
    }
    if (d->run_bytes == 0 || d->ndims > 3)
        return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: DMA run of %u bytes over %u dims", i,
                        d->run_bytes, d->ndims);
    uint64_t sspan, dspan;
    if (!pattern_span(d->run_bytes, d->ndims, d->count, d->src_stride, &sspan) ||
        !pattern_span(d->run_bytes, d->ndims, d->count, d->dst_stride, &dspan))
        return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: DMA pattern counts or strides overflow",
                        i);
    s = src_lx ? lx_range(v, i, "source", d->src_off, sspan)
               : slot_range(v, i, "source", d->src_slot, src_kind, d->src_off, sspan, false);
    if (s != SPY_OK)
        return s;
    s = dst_lx ? lx_range(v, i, "destination", d->dst_off, dspan)
               : slot_range(v, i, "destination", d->dst_slot, dst_kind, d->dst_off, dspan, true);
    if (s != SPY_OK)
        return s;
    v->prog->info.dma_bytes += pattern_bytes(d->run_bytes, d->ndims, d->count);
    return SPY_OK;
}

static bool mm_dtype_ok(uint32_t dt) { return dt == SPY_DT_F16 || dt == SPY_DT_BF16 || dt == SPY_DT_F32; }

/* Typed scratchpad operands start on a whole element: the kernels load them as arrays of
 * their dtype (pitches are in elements, so every row stays aligned too). */
static spy_status lx_aligned(uint32_t i, const char *what, uint64_t off, uint32_t es)
{
    if (es > 1 && off % es)
        return spy_fail(SPY_E_BAD_COMMAND, i,
                        "command %u: %s scratchpad offset %llu is not a multiple of its %u-byte "
                        "elements",
                        i, what, (unsigned long long)off, es);
    return SPY_OK;
}

static spy_status check_matrix(vctx *v, uint32_t i, const char *what, uint32_t off, uint32_t rows,
                               uint32_t cols, uint32_t ld, uint32_t es)
{
    if (ld < cols)
        return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: %s row pitch %u below its %u columns",
                        i, what, ld, cols);
    spy_status s = lx_aligned(i, what, off, es);
    if (s != SPY_OK)
        return s;
    uint64_t len = ((uint64_t)(rows - 1) * ld + cols) * es;
    return lx_range(v, i, what, off, len);
}

static spy_status check_matmul(vctx *v, uint32_t i, const spy_cmd *c)
{
    const spy_matmul *m = &c->u.mm;
    if (c->flags & ~(uint32_t)(SPY_MM_ACCUMULATE | SPY_MM_TRANS_A | SPY_MM_TRANS_B))
        return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: unknown matmul flags 0x%x", i, c->flags);
    if (m->m == 0 || m->n == 0 || m->k == 0 || m->m > MAX_COUNT || m->n > MAX_COUNT ||
        m->k > MAX_COUNT)
        return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: matmul shape %ux%ux%u", i, m->m, m->n,
                        m->k);
    if (!mm_dtype_ok(m->a_dtype) || !mm_dtype_ok(m->b_dtype))
        return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: matmul operand dtypes %u, %u", i,
                        m->a_dtype, m->b_dtype);
    bool ta = c->flags & SPY_MM_TRANS_A, tb = c->flags & SPY_MM_TRANS_B;
    spy_status s;
    s = check_matrix(v, i, "matmul A", m->a_off, ta ? m->k : m->m, ta ? m->m : m->k, m->lda,
                     spy_dtype_size(m->a_dtype));
    if (s != SPY_OK)
        return s;
    s = check_matrix(v, i, "matmul B", m->b_off, tb ? m->n : m->k, tb ? m->k : m->n, m->ldb,
                     spy_dtype_size(m->b_dtype));
    if (s != SPY_OK)
        return s;
    s = check_matrix(v, i, "matmul C", m->c_off, m->m, m->n, m->ldc, 4);
    if (s != SPY_OK)
        return s;
    v->prog->info.macs += (uint64_t)m->m * m->n * m->k;
    return SPY_OK;
}

bool spy_operand_extent(const spy_operand *o, uint32_t rows, uint32_t cols, uint64_t *lo,
                        uint64_t *hi)
{
    uint64_t es = spy_dtype_size(o->dtype), n;
    switch (o->kind) {
    case SPY_OPND_TILE: n = (uint64_t)(rows - 1) * o->pitch + cols; break;
    case SPY_OPND_ROW: n = (uint64_t)(rows - 1) * o->pitch + 1; break;
    case SPY_OPND_COL: n = cols; break;
    case SPY_OPND_SCALAR: n = 1; break;
    default: return false;
    }
    *lo = o->v.off;
    *hi = o->v.off + n * es; /* rows, cols, pitch < 2^26: no overflow below 2^64 */
    return true;
}

static spy_status check_operand(vctx *v, uint32_t i, uint32_t k, const spy_instr *ins,
                                const spy_operand *o, bool is_dst)
{
    const char *name = is_dst ? "destination" : "source";
    if (o->dtype >= SPY_DT_COUNT)
        return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: SFU instruction %u %s dtype %u", i, k,
                        name, o->dtype);
    if (o->kind == SPY_OPND_IMM) {
        if (is_dst)
            return spy_fail(SPY_E_BAD_COMMAND, i,
                            "command %u: SFU instruction %u writes an immediate", i, k);
        return SPY_OK;
    }
    if (o->kind < SPY_OPND_TILE || o->kind > SPY_OPND_SCALAR)
        return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: SFU instruction %u %s kind %u", i, k,
                        name, o->kind);
    if (o->kind == SPY_OPND_TILE && ins->rows > 1 && o->pitch < ins->cols)
        return spy_fail(SPY_E_BAD_COMMAND, i,
                        "command %u: SFU instruction %u %s pitch %u below its %u columns", i, k,
                        name, o->pitch, ins->cols);
    if (o->pitch > MAX_COUNT || o->v.off > v->p->scratchpad_bytes)
        return spy_fail(SPY_E_SCRATCHPAD, i,
                        "command %u: SFU instruction %u %s at %llu outside the scratchpad", i, k,
                        name, (unsigned long long)o->v.off);
    uint32_t es = spy_dtype_size(o->dtype);
    if (es > 1 && o->v.off % es)
        return spy_fail(SPY_E_BAD_COMMAND, i,
                        "command %u: SFU instruction %u %s scratchpad offset %llu is not a "
                        "multiple of its %u-byte elements",
                        i, k, name, (unsigned long long)o->v.off, es);
    uint64_t lo, hi;
    spy_operand_extent(o, ins->rows, ins->cols, &lo, &hi);
    if (hi <= v->p->scratchpad_bytes) { /* the common case: no message to format */
        if (hi > v->lx_high)
            v->lx_high = hi;
        return SPY_OK;
    }
    char what[64];
    snprintf(what, sizeof what, "SFU instruction %u %s", k, name);
    return lx_range(v, i, what, lo, hi - lo);
}

static spy_status check_sfu(vctx *v, uint32_t i, const spy_cmd *c)
{
    const spy_sfu *f = &c->u.sfu;
    const spy_program *g = v->prog;
    uint64_t end;
    if (f->ninstrs == 0 || !spy_add_ok(f->instr_begin, f->ninstrs, &end) || end > g->hdr->ninstrs)
        return spy_fail(SPY_E_BAD_COMMAND, i,
                        "command %u: SFU instructions [%u, +%u) outside the program's %u", i,
                        f->instr_begin, f->ninstrs, g->hdr->ninstrs);
    for (uint32_t k = f->instr_begin; k < end; k++) {
        const spy_instr *ins = &g->instrs[k];
        const spy_sfu_op *op = spy_sfu_op_find(ins->op);
        if (!op)
            return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: SFU instruction %u opcode %u", i, k,
                            ins->op);
        if (ins->rows == 0 || ins->cols == 0 || ins->rows > MAX_COUNT || ins->cols > MAX_COUNT)
            return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: SFU instruction %u shape %ux%u", i,
                            k, ins->rows, ins->cols);
        if (ins->aux > op->aux_max)
            return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: SFU instruction %u (%s) aux %u",
                            i, k, op->name, ins->aux);
        bool reduce = op->kind == SPY_SFU_KIND_REDUCE;
        uint32_t dk = ins->dst.kind;
        bool dst_ok = reduce ? (dk == SPY_OPND_ROW || (dk == SPY_OPND_SCALAR && ins->rows == 1))
                             : (dk == SPY_OPND_TILE || (dk == SPY_OPND_ROW && ins->cols == 1) ||
                                (dk == SPY_OPND_COL && ins->rows == 1) ||
                                (dk == SPY_OPND_SCALAR && ins->rows == 1 && ins->cols == 1));
        if (!dst_ok)
            return spy_fail(SPY_E_BAD_COMMAND, i,
                            "command %u: SFU instruction %u destination kind %u cannot hold a "
                            "%ux%u result",
                            i, k, dk, ins->rows, ins->cols);
        spy_status s = check_operand(v, i, k, ins, &ins->dst, true);
        if (s != SPY_OK)
            return s;
        for (int a = 0; a < 3; a++) {
            const spy_operand *o = &ins->src[a];
            if ((uint32_t)a >= op->arity) {
                if (o->kind != SPY_OPND_NONE)
                    return spy_fail(SPY_E_BAD_COMMAND, i,
                                    "command %u: SFU instruction %u has an extra operand %d", i, k,
                                    a);
                continue;
            }
            if (op->kind == SPY_SFU_KIND_IOTA && o->kind != SPY_OPND_IMM)
                return spy_fail(SPY_E_BAD_COMMAND, i,
                                "command %u: SFU instruction %u (iota) needs immediates", i, k);
            s = check_operand(v, i, k, ins, o, false);
            if (s != SPY_OK)
                return s;
        }
        v->prog->info.sfu_elems += (uint64_t)ins->rows * ins->cols;
    }
    return SPY_OK;
}

static spy_status check_gather(vctx *v, uint32_t i, const spy_cmd *c)
{
    const spy_gather *gt = &c->u.gather;
    if (gt->idx_dtype != SPY_DT_I64 && gt->idx_dtype != SPY_DT_I32)
        return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: index dtype %u", i, gt->idx_dtype);
    if (gt->nidx == 0 || gt->nidx > MAX_COUNT || gt->limit == 0 || gt->run_bytes == 0 ||
        gt->ndims > 2)
        return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: gather of %u indices, limit %llu", i,
                        gt->nidx, (unsigned long long)gt->limit);
    spy_status s = lx_aligned(i, "indices", gt->idx_off, spy_dtype_size(gt->idx_dtype));
    if (s != SPY_OK)
        return s;
    s = lx_range(v, i, "indices", gt->idx_off, (uint64_t)gt->nidx * spy_dtype_size(gt->idx_dtype));
    if (s != SPY_OK)
        return s;
    uint64_t span, rows_span, dram;
    if (!pattern_span(gt->run_bytes, gt->ndims, gt->count, gt->stride, &span) ||
        !spy_mul_ok(gt->limit - 1, gt->row_stride, &rows_span) ||
        !spy_add_ok(rows_span, span, &dram))
        return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: gather pattern overflows", i);
    s = slot_range(v, i, "table", gt->table_slot, SPY_SLOT_DRAM, gt->table_off, dram,
                   c->op == SPY_OP_SCATTER);
    if (s != SPY_OK)
        return s;
    uint64_t packed = pattern_bytes(gt->run_bytes, gt->ndims, gt->count);
    uint64_t lx = (uint64_t)(gt->nidx - 1) * gt->lx_pitch + packed;
    s = lx_range(v, i, "rows", gt->lx_off, lx);
    if (s != SPY_OK)
        return s;
    v->prog->info.dma_bytes += packed * gt->nidx;
    return SPY_OK;
}

static spy_status check_command(vctx *v, uint32_t i)
{
    const spy_profile *p = v->p;
    const spy_cmd *c = &v->prog->cmds[i];
    const spy_program *g = v->prog;
    uint64_t dend;
    if (c->op == 0 || c->op >= SPY_OP_COUNT)
        return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: unknown opcode %u", i, c->op);
    bool card = c->op == SPY_OP_H2D || c->op == SPY_OP_D2H || c->op == SPY_OP_BARRIER;
    if (card ? c->core != SPY_CORE_CARD : c->core >= p->num_cores)
        return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: core %u for opcode %u (card has %u cores)",
                        i, c->core, c->op, p->num_cores);
    if (!spy_add_ok(c->dep_begin, c->ndeps, &dend) || dend > g->hdr->ndeps)
        return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: dependencies [%u, +%u) outside the %u",
                        i, c->dep_begin, c->ndeps, g->hdr->ndeps);
    for (uint64_t k = c->dep_begin; k < dend; k++) {
        if (g->deps[k] >= g->hdr->ncmds || g->deps[k] == i)
            return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: depends on command %u", i,
                            g->deps[k]);
    }
    switch (c->op) {
    case SPY_OP_BARRIER: return SPY_OK;
    case SPY_OP_H2D: case SPY_OP_D2H: case SPY_OP_LOAD: case SPY_OP_STORE:
        return check_dma(v, i, c);
    case SPY_OP_MATMUL: return check_matmul(v, i, c);
    case SPY_OP_SFU: return check_sfu(v, i, c);
    case SPY_OP_RING:
        if (c->u.ring.dst_core >= p->num_cores || c->u.ring.bytes == 0)
            return spy_fail(SPY_E_BAD_COMMAND, i, "command %u: ring to core %u of %u bytes", i,
                            c->u.ring.dst_core, c->u.ring.bytes);
        if (lx_range(v, i, "ring source", c->u.ring.src_off, c->u.ring.bytes) != SPY_OK)
            return SPY_E_SCRATCHPAD;
        return lx_range(v, i, "ring destination", c->u.ring.dst_off, c->u.ring.bytes);
    case SPY_OP_GATHER: case SPY_OP_SCATTER: return check_gather(v, i, c);
    }
    return SPY_OK;
}

/* Kahn's algorithm over dependencies plus engine order. */
static spy_status check_acyclic(const spy_profile *p, spy_program *g)
{
    uint32_t n = g->hdr->ncmds;
    uint32_t neng = spy_num_engines(p);
    uint32_t *indeg = calloc(n ? n : 1, sizeof *indeg);
    uint32_t *succ_start = calloc((size_t)n + 1, sizeof *succ_start);
    /* one entry per edge: nedges, not the header's ndeps (windows may overlap) */
    uint32_t *succ = malloc(((size_t)g->nedges + 1) * sizeof *succ);
    uint32_t *eng_next = malloc((size_t)(n ? n : 1) * sizeof *eng_next);
    uint32_t *last_on = malloc((size_t)neng * sizeof *last_on);
    uint32_t *queue = malloc((size_t)(n ? n : 1) * sizeof *queue); /* commands in a topological order */
    spy_status st = SPY_OK;
    if (!indeg || !succ_start || !succ || !eng_next || !last_on || !queue) {
        st = spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted validating a program");
        goto out;
    }
    for (uint32_t e = 0; e < neng; e++)
        last_on[e] = UINT32_MAX;
    for (uint32_t i = 0; i < n; i++)
        eng_next[i] = UINT32_MAX;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t e = spy_engine_of(p, &g->cmds[i]);
        if (last_on[e] != UINT32_MAX) {
            eng_next[last_on[e]] = i;
            indeg[i]++;
        }
        last_on[e] = i;
        for (uint32_t k = 0; k < g->cmds[i].ndeps; k++) {
            succ_start[g->deps[g->cmds[i].dep_begin + k]]++;
            indeg[i]++;
        }
    }
    /* prefix sums -> CSR of dependency successors */
    uint32_t acc = 0;
    for (uint32_t i = 0; i <= n; i++) {
        uint32_t c = succ_start[i];
        succ_start[i] = acc;
        acc += c;
    }
    {
        uint32_t *fill = calloc(n ? n : 1, sizeof *fill);
        if (!fill) {
            st = spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted validating a program");
            goto out;
        }
        for (uint32_t i = 0; i < n; i++)
            for (uint32_t k = 0; k < g->cmds[i].ndeps; k++) {
                uint32_t d = g->deps[g->cmds[i].dep_begin + k];
                succ[succ_start[d] + fill[d]++] = i;
            }
        free(fill);
    }
    uint32_t head = 0, tail = 0;
    for (uint32_t i = 0; i < n; i++)
        if (indeg[i] == 0)
            queue[tail++] = i;
    while (head < tail) {
        uint32_t i = queue[head++];
        for (uint32_t k = succ_start[i]; k < succ_start[i + 1]; k++)
            if (--indeg[succ[k]] == 0)
                queue[tail++] = succ[k];
        if (eng_next[i] != UINT32_MAX && --indeg[eng_next[i]] == 0)
            queue[tail++] = eng_next[i];
    }
    if (tail != n) {
        uint32_t culprit = 0;
        for (uint32_t i = 0; i < n; i++)
            if (indeg[i]) {
                culprit = i;
                break;
            }
        st = spy_fail(SPY_E_CYCLE, culprit,
                      "command %u: dependency cycle (with engine order) among %u commands", culprit,
                      n - tail);
    }
out:
    free(indeg);
    free(succ_start);
    free(succ);
    free(eng_next);
    free(last_on);
    free(queue);
    return st;
}

static uint64_t align8(uint64_t x) { return (x + 7) & ~(uint64_t)7; }
static spy_status summarise_host_dma(spy_program *g);

spy_status spy_block_check(const void *blob, uint64_t len, uint64_t header_bytes, uint32_t magic,
                           uint32_t version, const char *what)
{
    if (!blob || len < header_bytes)
        return spy_fail(SPY_E_BAD_PROGRAM, -1, "%s block of %llu bytes is shorter than its header",
                        what, (unsigned long long)len);
    if ((uintptr_t)blob % 8)
        return spy_fail(SPY_E_BAD_PROGRAM, -1, "%s block is not 8-byte aligned", what);
    const uint32_t *words = blob; /* every block starts with its magic and version */
    if (words[0] != magic)
        return spy_fail(SPY_E_BAD_PROGRAM, -1, "not a %s block (magic 0x%08x)", what, words[0]);
    if (words[1] != version)
        return spy_fail(SPY_E_BAD_PROGRAM, -1, "%s block version %u, runtime reads %u", what,
                        words[1], version);
    return SPY_OK;
}

spy_status spy_program_decode(const spy_profile *p, const void *blob, uint64_t len,
                              spy_program **out)
{
    *out = NULL;
    spy_status st = spy_block_check(blob, len, sizeof(spy_job_header), SPY_JOB_MAGIC, SPY_JOB_VERSION,
                                    "program");
    if (st != SPY_OK)
        return st;
    const spy_job_header *h = blob;
    if (h->ncmds == 0 || h->ncmds > MAX_COUNT || h->ndeps > MAX_COUNT || h->ninstrs > MAX_COUNT ||
        h->nslots > MAX_COUNT || h->ndescs > MAX_COUNT || h->flags != 0)
        return spy_fail(SPY_E_BAD_PROGRAM, -1, "program block counts out of range (%u commands)",
                        h->ncmds);
    uint64_t want = sizeof(spy_job_header) + (uint64_t)h->nslots * sizeof(spy_slot) +
                    (uint64_t)h->ncmds * sizeof(spy_cmd) + align8((uint64_t)h->ndeps * 4) +
                    (uint64_t)h->ninstrs * sizeof(spy_instr) + (uint64_t)h->ndescs * sizeof(spy_desc);
    if (h->total_bytes != want || len != want)
        return spy_fail(SPY_E_BAD_PROGRAM, -1,
                        "program block is %llu bytes, header says %llu, counts need %llu",
                        (unsigned long long)len, (unsigned long long)h->total_bytes,
                        (unsigned long long)want);
    spy_program *g = calloc(1, sizeof *g);
    if (!g)
        return spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted");
    const uint8_t *b = blob;
    uint64_t off = sizeof(spy_job_header);
    g->hdr = h;
    g->slots = (const spy_slot *)(b + off);
    off += (uint64_t)h->nslots * sizeof(spy_slot);
    g->cmds = (const spy_cmd *)(b + off);
    off += (uint64_t)h->ncmds * sizeof(spy_cmd);
    g->deps = (const uint32_t *)(b + off);
    off += align8((uint64_t)h->ndeps * 4);
    g->instrs = (const spy_instr *)(b + off);
    off += (uint64_t)h->ninstrs * sizeof(spy_instr);
    g->descs = (const spy_desc *)(b + off);
    g->slot_written = calloc(h->nslots ? h->nslots : 1, 1);
    if (!g->slot_written) {
        spy_program_free(g);
        return spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted");
    }
    for (uint32_t s = 0; s < h->nslots; s++)
        if (g->slots[s].kind > SPY_SLOT_HOST) {
            uint32_t kind = g->slots[s].kind;
            spy_program_free(g);
            return spy_fail(SPY_E_BAD_PROGRAM, -1, "slot %u has unknown kind %u", s, kind);
        }
    vctx v = {p, g, 0};
    uint64_t cores[4] = {0}; /* bitmap of up to 256 cores */
    for (uint32_t i = 0; i < h->ncmds; i++) {
        spy_status s = check_command(&v, i);
        if (s != SPY_OK) {
            spy_program_free(g);
            return s;
        }
        /* each window was checked against ndeps (<= MAX_COUNT): no overflow in 64 bits */
        g->nedges += g->cmds[i].ndeps;
        if (g->nedges > MAX_EDGES) {
            spy_program_free(g);
            return spy_fail(SPY_E_BAD_PROGRAM, i,
                            "command %u: the program's commands have more than %u dependency "
                            "edges in all",
                            i, MAX_EDGES);
        }
        uint16_t core = g->cmds[i].core;
        if (core != SPY_CORE_CARD && core < 256)
            cores[core / 64] |= 1ull << (core % 64);
    }
    spy_status s = check_acyclic(p, g);
    if (s == SPY_OK)
        s = summarise_host_dma(g);
    if (s != SPY_OK) {
        spy_program_free(g);
        return s;
    }
    g->info.ncmds = h->ncmds;
    g->info.nslots = h->nslots;
    g->info.total_bytes = h->total_bytes;
    g->info.lx_high_water = v.lx_high;
    for (int w = 0; w < 4; w++)
        g->info.cores_used += (uint32_t)__builtin_popcountll(cores[w]);
    *out = g;
    return SPY_OK;
}

void spy_program_free(spy_program *g)
{
    if (!g)
        return;
    free(g->slot_written);
    free(g->h2d_pairs);
    free(g);
}

/* What a launch needs about host transfers, computed once instead of per launch. */
static spy_status summarise_host_dma(spy_program *g)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < g->hdr->ncmds; i++)
        n += g->cmds[i].op == SPY_OP_H2D;
    g->h2d_pairs = malloc(2 * (size_t)(n ? n : 1) * sizeof(uint32_t));
    if (!g->h2d_pairs)
        return spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted");
    for (uint32_t i = 0; i < g->hdr->ncmds; i++) {
        const spy_cmd *c = &g->cmds[i];
        if (c->op == SPY_OP_H2D) {
            g->h2d_pairs[2 * g->nh2d] = c->u.dma.src_slot;
            g->h2d_pairs[2 * g->nh2d + 1] = c->u.dma.dst_slot;
            g->nh2d++;
            g->bytes_h2d += spy_host_dma_bytes(g, c);
        } else if (c->op == SPY_OP_D2H) {
            g->bytes_d2h += spy_host_dma_bytes(g, c);
        }
    }
    return SPY_OK;
}

uint64_t spy_host_dma_bytes(const spy_program *g, const spy_cmd *c)
{
    const spy_dma *d = &c->u.dma;
    uint64_t bytes = 0;
    if (c->flags & SPY_DMA_DESCS) {
        for (uint64_t k = d->src_off; k < d->src_off + d->desc_count; k++)
            bytes += g->descs[k].bytes;
        return bytes;
    }
    bytes = d->run_bytes;
    for (uint32_t k = 0; k < d->ndims; k++)
        bytes *= d->count[k];
    return bytes;
}
