/* construct.c -- the native builder: decision records to encoded program blocks.
 *
 * The layers above decide what a kernel or a transfer moves (spyre.h, "construction");
 * this file makes its commands, dependencies and descriptors and encodes the block. Every
 * record is checked whole before anything is allocated, so a refused record costs nothing
 * and leaves nothing behind. */
#include <stdlib.h>

#include "internal.h"

/* ---- copies ------------------------------------------------------------------------------ */

static uint64_t copy_chunk(const spy_copy_record *r, uint64_t nbytes)
{
    uint64_t per_core = nbytes / r->num_cores + (nbytes % r->num_cores != 0);
    uint64_t stick = r->stick_bytes, rounded = (per_core + stick - 1) / stick * stick;
    return rounded < r->chunk_max ? rounded : r->chunk_max;
}

/* The record checked whole; *nchunks is the chunks of all its ranges. */
static spy_status copy_check(const spy_copy_record *r, uint64_t *nchunks)
{
    if (!r->num_cores || r->num_cores >= SPY_CORE_CARD)
        return spy_fail(SPY_E_INVALID_ARG, -1, "copy record: num_cores %u is not 1 .. %u", r->num_cores,
                        SPY_CORE_CARD - 1);
    if (!r->stick_bytes || (r->stick_bytes & (r->stick_bytes - 1)))
        return spy_fail(SPY_E_INVALID_ARG, -1, "copy record: stick_bytes %u is not a power of two", r->stick_bytes);
    if (!r->chunk_max || r->chunk_max > UINT32_MAX)
        return spy_fail(SPY_E_INVALID_ARG, -1, "copy record: chunk_max %llu is not 1 .. 2^32 - 1",
                        (unsigned long long)r->chunk_max);
    if (r->chunk_max > r->scratchpad_bytes / 2)
        return spy_fail(SPY_E_SCRATCHPAD, -1, "copy record: two chunks of chunk_max %llu bytes are outside a "
                        "%llu-byte scratchpad", (unsigned long long)r->chunk_max,
                        (unsigned long long)r->scratchpad_bytes);
    if ((r->nslots && !r->slot_extent) || (r->nranges && !r->ranges))
        return spy_fail(SPY_E_INVALID_ARG, -1, "copy record: nslots %u or nranges %u without their array",
                        r->nslots, r->nranges);
    uint64_t n = 0;
    for (uint32_t i = 0; i < r->nranges; i++) {
        const spy_copy_range *c = &r->ranges[i];
        if (!c->nbytes)
            continue;
        if (c->src_slot >= r->nslots || c->dst_slot >= r->nslots)
            return spy_fail(SPY_E_INVALID_ARG, -1, "copy record: ranges[%u].%s names slot %u of %u", i,
                            c->src_slot >= r->nslots ? "src_slot" : "dst_slot",
                            c->src_slot >= r->nslots ? c->src_slot : c->dst_slot, r->nslots);
        uint64_t src_end, dst_end;
        if (!spy_add_ok(c->src_off, c->nbytes, &src_end) || src_end > r->slot_extent[c->src_slot])
            return spy_fail(SPY_E_BAD_ADDRESS, -1, "copy record: ranges[%u].src_off %llu + nbytes %llu is outside "
                            "slot %u of %llu bytes", i, (unsigned long long)c->src_off,
                            (unsigned long long)c->nbytes, c->src_slot,
                            (unsigned long long)r->slot_extent[c->src_slot]);
        if (!spy_add_ok(c->dst_off, c->nbytes, &dst_end) || dst_end > r->slot_extent[c->dst_slot])
            return spy_fail(SPY_E_BAD_ADDRESS, -1, "copy record: ranges[%u].dst_off %llu + nbytes %llu is outside "
                            "slot %u of %llu bytes", i, (unsigned long long)c->dst_off,
                            (unsigned long long)c->nbytes, c->dst_slot,
                            (unsigned long long)r->slot_extent[c->dst_slot]);
        uint64_t chunk = copy_chunk(r, c->nbytes);
        n += c->nbytes / chunk + (c->nbytes % chunk != 0);
        if (n > UINT32_MAX / 2)
            return spy_fail(SPY_E_INVALID_ARG, -1, "copy record: ranges[%u] makes more than 2^31 chunks", i);
    }
    *nchunks = n;
    return SPY_OK;
}

spy_status spy_build_copy(const spy_copy_record *r, spy_built *out)
{
    if (!r || !out)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null copy record or output");
    out->data = NULL;
    out->bytes = 0;
    uint64_t n = 0;
    spy_status s = copy_check(r, &n);
    if (s != SPY_OK)
        return s;
    uint32_t cores = r->num_cores;
    uint64_t waits = n > 2 * (uint64_t)cores ? n - 2 * (uint64_t)cores : 0; /* loads after a store */
    uint64_t total;
    if (!spy_block_bytes(r->nslots, 2 * n, n + waits, 0, &total))
        return spy_fail(SPY_E_INVALID_ARG, -1, "copy record: %llu chunks make a program block of more than "
                        "%llu bytes", (unsigned long long)n, (unsigned long long)SPY_BUILD_MAX_BYTES);
    spy_block_sections blk;
    s = spy_block_alloc(total, r->nslots, (uint32_t)(2 * n), (uint32_t)(n + waits), 0, out, &blk);
    if (s != SPY_OK)
        return s;
    for (uint32_t i = 0; i < r->nslots; i++)
        blk.slots[i] = (spy_slot){SPY_SLOT_DRAM, 0, r->slot_extent[i]};
    spy_cmd *cmds = blk.cmds;
    uint32_t *deps = blk.deps;
    uint64_t i = 0, d = 0;
    for (uint32_t x = 0; x < r->nranges; x++) {
        const spy_copy_range *c = &r->ranges[x];
        if (!c->nbytes)
            continue;
        uint64_t chunk = copy_chunk(r, c->nbytes);
        for (uint64_t at = 0; at < c->nbytes; at += chunk, i++) {
            uint64_t size = c->nbytes - at < chunk ? c->nbytes - at : chunk;
            uint64_t seq = i / cores, lx = (seq % 2) * r->chunk_max;
            spy_cmd *load = &cmds[2 * i], *store = &cmds[2 * i + 1];
            load->op = SPY_OP_LOAD;
            store->op = SPY_OP_STORE;
            load->core = store->core = (uint16_t)(i % cores);
            load->u.dma.src_slot = c->src_slot;
            load->u.dma.src_off = c->src_off + at;
            load->u.dma.dst_off = lx;
            store->u.dma.dst_slot = c->dst_slot;
            store->u.dma.src_off = lx;
            store->u.dma.dst_off = c->dst_off + at;
            load->u.dma.run_bytes = store->u.dma.run_bytes = (uint32_t)size;
            load->dep_begin = (uint32_t)d;
            if (seq >= 2) { /* its slot was stored two chunks back on this core */
                load->ndeps = 1;
                deps[d++] = (uint32_t)(2 * (i - 2 * (uint64_t)cores) + 1);
            }
            store->dep_begin = (uint32_t)d;
            store->ndeps = 1;
            deps[d++] = (uint32_t)(2 * i);
        }
    }
    return SPY_OK;
}

/* ---- transfer graphs --------------------------------------------------------------------- */

typedef struct view_dims {
    uint64_t size[SPY_TRANSFER_MAX_DIMS];
    uint64_t stride[SPY_TRANSFER_MAX_DIMS];
    uint32_t n;
} view_dims;

/* The view's dimensions in memory order (size-1 first, then by decreasing stride, ties in
 * their order), unit dimensions dropped and neighbours that continue each other fused. */
static view_dims in_memory_order(const spy_transfer_record *r)
{
    uint32_t order[SPY_TRANSFER_MAX_DIMS];
    for (uint32_t i = 0; i < r->ndims; i++) { /* a stable insertion sort */
        uint32_t j = i;
        for (; j > 0; j--) {
            uint32_t p = order[j - 1];
            bool before = (r->sizes[i] > 1) < (r->sizes[p] > 1) ||
                          ((r->sizes[i] > 1) == (r->sizes[p] > 1) && r->strides[i] > r->strides[p]);
            if (!before)
                break;
            order[j] = p;
        }
        order[j] = i;
    }
    view_dims v = {{0}, {0}, 0};
    for (uint32_t x = 0; x < r->ndims; x++) {
        uint64_t size = r->sizes[order[x]], stride = r->strides[order[x]];
        if (size == 1)
            continue;
        if (v.n && v.stride[v.n - 1] == size * stride) {
            v.size[v.n - 1] *= size;
            v.stride[v.n - 1] = stride;
        } else {
            v.size[v.n] = size;
            v.stride[v.n++] = stride;
        }
    }
    return v;
}

/* The logical start of outer run `i` (row-major over the outer dims). */
static uint64_t run_start(const view_dims *v, uint32_t nouter, uint64_t offset, uint64_t i)
{
    uint64_t start = offset;
    for (uint32_t d = nouter; d-- > 0;) {
        start += (i % v->size[d]) * v->stride[d];
        i /= v->size[d];
    }
    return start;
}

/* The runs of a view: `nruns` starts of `run` elements each, the k-th part of outer run i
 * at run_start(i) + k * split (parts per run: `parts`). */
typedef struct runs {
    view_dims v;
    uint32_t nouter;
    uint64_t nouter_runs; /* product of the outer sizes */
    uint64_t run, parts, split;
} runs;

/* Visits every stick piece of the view in order; with `descs` NULL it only counts. */
static uint64_t stick_pieces(const spy_transfer_record *r, const runs *x, spy_desc *descs)
{
    const spy_layout *l = &r->layout;
    uint64_t e = l->itemsize, s = l->stick_bytes / l->itemsize, n_row = l->row_len;
    uint64_t stick_stride = (l->rows ? l->rows : 1) * (uint64_t)l->stick_bytes;
    bool h2d = r->direction == SPY_OP_H2D;
    uint64_t count = 0, host = 0;
    for (uint64_t i = 0; i < x->nouter_runs; i++) {
        uint64_t base = run_start(&x->v, x->nouter, r->offset, i);
        for (uint64_t k = 0; k < x->parts; k++, host += x->run) {
            uint64_t start = base + k * x->split;
            uint64_t row = start / n_row, c0 = start % n_row;
            for (uint64_t stick = c0 / s;; stick++) {
                uint64_t lo = c0 > stick * s ? c0 : stick * s;
                uint64_t hi = c0 + x->run < (stick + 1) * s ? c0 + x->run : (stick + 1) * s;
                if (lo >= hi)
                    break;
                if (descs) {
                    uint64_t dev = stick * stick_stride + row * l->stick_bytes + (lo % s) * e;
                    uint64_t hst = (host + (lo - c0)) * e;
                    descs[count] = (spy_desc){h2d ? hst : dev, h2d ? dev : hst, (uint32_t)((hi - lo) * e), 0};
                }
                count++;
            }
        }
    }
    return count;
}

/* The record checked whole and its runs: where a run would wander across rows it is cut
 * into whole rows (when it starts every row at its beginning) or into elements. */
static spy_status transfer_check(const spy_transfer_record *r, runs *x, uint64_t *numel, uint64_t *dram_bytes)
{
    if (r->direction != SPY_OP_H2D && r->direction != SPY_OP_D2H)
        return spy_fail(SPY_E_INVALID_ARG, -1, "transfer record: direction %u is neither H2D nor D2H", r->direction);
    if (r->ndims > SPY_TRANSFER_MAX_DIMS)
        return spy_fail(SPY_E_INVALID_ARG, -1, "transfer record: ndims %u is more than %u", r->ndims,
                        SPY_TRANSFER_MAX_DIMS);
    spy_status s = spy_layout_bytes(&r->layout, dram_bytes);
    if (s != SPY_OK)
        return spy_fail(s, -1, "transfer record: layout: %s", spy_last_error());
    /* the view's extent: its elements and its last one, in 64 bits */
    uint64_t n = 1, last = r->offset;
    for (uint32_t i = 0; i < r->ndims; i++)
        if (!spy_mul_ok(n, r->sizes[i], &n))
            return spy_fail(SPY_E_INVALID_ARG, -1, "transfer record: sizes[%u] makes more than 2^64 elements", i);
    for (uint32_t i = 0; n && i < r->ndims; i++) {
        uint64_t reach;
        if (!spy_mul_ok(r->sizes[i] - 1, r->strides[i], &reach) || !spy_add_ok(last, reach, &last))
            return spy_fail(SPY_E_BAD_ADDRESS, -1, "transfer record: strides[%u] reaches past 2^64", i);
    }
    uint64_t storage = (r->layout.rows ? r->layout.rows : 1) * r->layout.row_len; /* fits: dram_bytes did */
    if (n && last >= storage)
        return spy_fail(SPY_E_BAD_ADDRESS, -1, "transfer record: offset %llu, sizes and strides reach element "
                        "%llu of a %llu-element storage", (unsigned long long)r->offset,
                        (unsigned long long)last, (unsigned long long)storage);
    uint64_t host_bytes;
    if (!spy_mul_ok(n, r->layout.itemsize, &host_bytes))
        return spy_fail(SPY_E_INVALID_ARG, -1, "transfer record: %llu elements are more than 2^64 bytes",
                        (unsigned long long)n);
    *numel = n;
    x->v = in_memory_order(r);
    const view_dims *v = &x->v;
    x->run = 1;
    x->nouter = v->n;
    if (v->n && v->size[v->n - 1] && v->stride[v->n - 1] == 1) {
        x->run = v->size[v->n - 1];
        x->nouter = v->n - 1;
    }
    x->nouter_runs = 1;
    for (uint32_t d = 0; d < x->nouter; d++)
        x->nouter_runs *= v->size[d]; /* at most n */
    x->parts = 1;
    x->split = 0;
    uint64_t n_row = r->layout.row_len;
    bool wraps = false, row_starts = true;
    for (uint64_t i = 0; n && i < x->nouter_runs; i++) {
        uint64_t c0 = run_start(v, x->nouter, r->offset, i) % n_row;
        wraps |= c0 + x->run > n_row;
        row_starts &= c0 == 0;
    }
    if (wraps) {
        if (x->run % n_row == 0 && row_starts) { /* whole rows */
            x->parts = x->run / n_row;
            x->split = n_row;
            x->run = n_row;
        } else { /* element by element */
            x->parts = x->run;
            x->split = 1;
            x->run = 1;
        }
    }
    return SPY_OK;
}

spy_status spy_build_transfer(const spy_transfer_record *r, spy_built *out)
{
    if (!r || !out)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null transfer record or output");
    out->data = NULL;
    out->bytes = 0;
    runs x = {0};
    uint64_t numel = 0, dram_bytes = 0;
    spy_status s = transfer_check(r, &x, &numel, &dram_bytes);
    if (s != SPY_OK)
        return s;
    uint64_t ndescs = numel ? stick_pieces(r, &x, NULL) : 0;
    uint64_t total;
    if (!spy_block_bytes(2, 1, 0, ndescs, &total))
        return spy_fail(SPY_E_INVALID_ARG, -1, "transfer record: %llu descriptors make a program block of more "
                        "than %llu bytes", (unsigned long long)ndescs, (unsigned long long)SPY_BUILD_MAX_BYTES);
    spy_block_sections blk;
    s = spy_block_alloc(total, 2, 1, 0, (uint32_t)ndescs, out, &blk);
    if (s != SPY_OK)
        return s;
    blk.slots[0] = (spy_slot){SPY_SLOT_HOST, 0, numel * r->layout.itemsize};
    blk.slots[1] = (spy_slot){SPY_SLOT_DRAM, 0, dram_bytes};
    spy_cmd *cmd = blk.cmds;
    bool h2d = r->direction == SPY_OP_H2D;
    cmd->op = (uint8_t)r->direction;
    cmd->flags = SPY_DMA_DESCS;
    cmd->core = SPY_CORE_CARD;
    cmd->u.dma.src_slot = h2d ? 0 : 1;
    cmd->u.dma.dst_slot = h2d ? 1 : 0;
    cmd->u.dma.desc_count = (uint32_t)ndescs;
    if (numel)
        stick_pieces(r, &x, blk.descs);
    return SPY_OK;
}

/* ---- job graphs in blocks ---------------------------------------------------------------- */

spy_status spy_build_graph(const spy_graph_record *r, spy_built *out)
{
    if (!r || !out)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null graph record or output");
    out->data = NULL;
    out->bytes = 0;
    return spy_graph_encode_record(r, out);
}
