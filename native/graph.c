/* graph.c -- a program block under construction: the native builder's common part.
 *
 * A builder (construct.c) appends slots, commands with their program-order keys,
 * dependency pairs, SFU instructions and descriptors to a spy_graph; spy_graph_encode
 * orders the commands by key (stably), renumbers the pairs and writes the program block
 * the validator reads (spyre.h, "Program block layout"). Appending reports no error: the
 * first host allocation that fails marks the graph, and its encode fails with
 * SPY_E_HOST_NOMEM, so a builder checks once, at the end. */
#include <stdlib.h>

#include "internal.h"

/* ---- growable arrays ---------------------------------------------------------------------- */

void *spy_vec_push(spy_vec *v, uint64_t n)
{
    if (v->failed)
        return NULL;
    if (v->len + n > v->cap) {
        uint64_t cap = v->cap ? v->cap : 16;
        while (cap < v->len + n)
            cap *= 2;
        uint64_t bytes;
        void *p = spy_mul_ok(cap, v->elem, &bytes) && bytes <= SIZE_MAX ? realloc(v->data, (size_t)bytes) : NULL;
        if (!p) {
            v->failed = true;
            return NULL;
        }
        v->data = p;
        v->cap = cap;
    }
    uint8_t *at = (uint8_t *)v->data + v->len * v->elem;
    memset(at, 0, (size_t)(n * v->elem));
    v->len += n;
    return at;
}

void spy_vec_free(spy_vec *v)
{
    free(v->data);
    v->data = NULL;
    v->len = v->cap = 0;
    v->failed = false;
}

/* ---- program blocks ------------------------------------------------------------------------ */

bool spy_block_bytes(uint32_t nslots, uint64_t ncmds, uint64_t ndeps, uint64_t ndescs, uint64_t *total)
{
    if (ncmds > UINT32_MAX || ndeps > UINT32_MAX || ndescs > UINT32_MAX)
        return false;
    uint64_t t = sizeof(spy_job_header) + (uint64_t)nslots * sizeof(spy_slot) + ncmds * sizeof(spy_cmd) +
                 (ndeps * 4 + 7) / 8 * 8 + ndescs * sizeof(spy_desc); /* each term < 2^40: no overflow */
    *total = t;
    return t <= SPY_BUILD_MAX_BYTES;
}

spy_status spy_block_alloc(uint64_t total, uint32_t nslots, uint32_t ncmds, uint32_t ndeps, uint32_t ndescs,
                           spy_built *out, spy_block_sections *blk)
{
    uint64_t *mem = total <= SIZE_MAX - 7 ? calloc((size_t)(total + 7) / 8, 8) : NULL;
    if (!mem)
        return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for a %llu-byte program block",
                        (unsigned long long)total);
    uint8_t *b = (uint8_t *)mem;
    spy_job_header *h = (spy_job_header *)b;
    h->magic = SPY_JOB_MAGIC;
    h->version = SPY_JOB_VERSION;
    h->ncmds = ncmds;
    h->ndeps = ndeps;
    h->nslots = nslots;
    h->ndescs = ndescs;
    h->total_bytes = total;
    blk->slots = (spy_slot *)(h + 1);
    blk->cmds = (spy_cmd *)(blk->slots + nslots);
    blk->deps = (uint32_t *)(blk->cmds + ncmds);
    blk->descs = (spy_desc *)((uint8_t *)blk->deps + ((uint64_t)ndeps * 4 + 7) / 8 * 8);
    out->data = b;
    out->bytes = total;
    return SPY_OK;
}

void spy_built_free(spy_built *b)
{
    if (!b)
        return;
    free(b->data);
    b->data = NULL;
    b->bytes = 0;
}

/* ---- job graphs ------------------------------------------------------------------------------ */

/* order[0..n) sorted stably by keys: a bottom-up merge sort through `tmp`; a run already in
 * order (the common case: commands made in program order) costs one pass. */
static void stable_order(const int64_t *keys, uint64_t n, uint64_t *order, uint64_t *tmp)
{
    bool sorted = true;
    for (uint64_t i = 0; i < n; i++) {
        order[i] = i;
        if (i && keys[i] < keys[i - 1])
            sorted = false;
    }
    if (sorted)
        return;
    for (uint64_t width = 1; width < n; width *= 2) {
        for (uint64_t lo = 0; lo < n; lo += 2 * width) {
            uint64_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            uint64_t a = lo, b = mid, k = lo;
            while (a < mid && b < hi)
                tmp[k++] = keys[order[b]] < keys[order[a]] ? order[b++] : order[a++];
            while (a < mid)
                tmp[k++] = order[a++];
            while (b < hi)
                tmp[k++] = order[b++];
        }
        memcpy(order, tmp, (size_t)n * sizeof *order);
    }
}

static spy_status graph_check(const spy_graph_record *r, uint64_t *total)
{
    if ((r->nslots && !r->slots) || (r->ncmds && (!r->cmds || !r->keys)) ||
        (r->npairs && (!r->after || !r->before)) || (r->ninstrs && !r->instrs) || (r->ndescs && !r->descs))
        return spy_fail(SPY_E_INVALID_ARG, -1, "graph record: a count without its array");
    if (!spy_block_bytes(r->nslots, r->ncmds, r->npairs, r->ndescs, total) ||
        *total + (uint64_t)r->ninstrs * sizeof(spy_instr) > SPY_BUILD_MAX_BYTES)
        return spy_fail(SPY_E_INVALID_ARG, -1, "graph record: ncmds %llu, npairs %llu, ndescs %u and ninstrs %u "
                        "make a program block of more than %llu bytes", (unsigned long long)r->ncmds,
                        (unsigned long long)r->npairs, r->ndescs, r->ninstrs,
                        (unsigned long long)SPY_BUILD_MAX_BYTES);
    *total += (uint64_t)r->ninstrs * sizeof(spy_instr);
    for (uint64_t i = 0; i < r->npairs; i++)
        if (r->after[i] < 0 || (uint64_t)r->after[i] >= r->ncmds || r->before[i] < 0 ||
            (uint64_t)r->before[i] >= r->ncmds)
            return spy_fail(SPY_E_INVALID_ARG, -1, "graph record: %s[%llu] = %lld names no command of %llu",
                            r->after[i] < 0 || (uint64_t)r->after[i] >= r->ncmds ? "after" : "before",
                            (unsigned long long)i,
                            (long long)(r->after[i] < 0 || (uint64_t)r->after[i] >= r->ncmds ? r->after[i]
                                                                                              : r->before[i]),
                            (unsigned long long)r->ncmds);
    return SPY_OK;
}

spy_status spy_graph_encode_record(const spy_graph_record *r, spy_built *out)
{
    uint64_t total = 0;
    spy_status s = graph_check(r, &total);
    if (s != SPY_OK)
        return s;
    uint64_t n = r->ncmds;
    uint64_t *order = malloc((size_t)(3 * n + 1) * sizeof *order); /* order, merge buffer, rank */
    uint32_t *fill = malloc((size_t)(n + 1) * sizeof *fill);
    if (!order || !fill) {
        free(order);
        free(fill);
        return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory to order %llu commands", (unsigned long long)n);
    }
    uint64_t *rank = order + 2 * n;
    stable_order(r->keys, n, order, order + n);
    spy_block_sections blk;
    s = spy_block_alloc(total, r->nslots, (uint32_t)n, (uint32_t)r->npairs, r->ndescs, out, &blk);
    if (s != SPY_OK) {
        free(order);
        free(fill);
        return s;
    }
    ((spy_job_header *)out->data)->ninstrs = r->ninstrs;
    if (r->nslots)
        memcpy(blk.slots, r->slots, (size_t)r->nslots * sizeof *blk.slots);
    for (uint64_t i = 0; i < n; i++) {
        rank[order[i]] = i;
        blk.cmds[i] = r->cmds[order[i]];
        blk.cmds[i].ndeps = 0;
    }
    for (uint64_t i = 0; i < r->npairs; i++)
        blk.cmds[rank[r->after[i]]].ndeps++;
    uint32_t begin = 0;
    for (uint64_t i = 0; i < n; i++) {
        blk.cmds[i].dep_begin = fill[i] = begin;
        begin += blk.cmds[i].ndeps;
    }
    for (uint64_t i = 0; i < r->npairs; i++) /* grouped per waiting command, in the given order */
        blk.deps[fill[rank[r->after[i]]]++] = (uint32_t)rank[r->before[i]];
    spy_instr *instrs = (spy_instr *)blk.descs; /* the instructions come before the descriptors */
    if (r->ninstrs)
        memcpy(instrs, r->instrs, (size_t)r->ninstrs * sizeof *instrs);
    if (r->ndescs)
        memcpy(instrs + r->ninstrs, r->descs, (size_t)r->ndescs * sizeof(spy_desc));
    free(order);
    free(fill);
    return SPY_OK;
}

/* ---- a graph under construction ---------------------------------------------------------- */

void spy_graph_init(spy_graph *g)
{
    memset(g, 0, sizeof *g);
    g->slots.elem = sizeof(spy_slot);
    g->cmds.elem = sizeof(spy_cmd);
    g->keys.elem = sizeof(int64_t);
    g->after.elem = g->before.elem = sizeof(int64_t);
    g->instrs.elem = sizeof(spy_instr);
    g->descs.elem = sizeof(spy_desc);
}

void spy_graph_free(spy_graph *g)
{
    spy_vec *v[] = {&g->slots, &g->cmds, &g->keys, &g->after, &g->before, &g->instrs, &g->descs};
    for (size_t i = 0; i < SPY_ARRAY_LEN(v); i++)
        spy_vec_free(v[i]);
}

uint32_t spy_graph_slot(spy_graph *g, uint32_t kind, uint64_t extent)
{
    spy_slot *s = spy_vec_push(&g->slots, 1);
    if (s) {
        s->kind = kind;
        s->extent = extent;
    }
    return (uint32_t)(g->slots.len - 1);
}

spy_cmd *spy_graph_add(spy_graph *g, uint64_t n, int64_t key, uint64_t *first)
{
    *first = g->cmds.len;
    spy_cmd *c = spy_vec_push(&g->cmds, n);
    int64_t *k = spy_vec_push(&g->keys, n);
    if (!c || !k)
        return NULL;
    for (uint64_t i = 0; i < n; i++)
        k[i] = key;
    return c;
}

void spy_graph_depend(spy_graph *g, uint64_t after, uint64_t before)
{
    int64_t *a = spy_vec_push(&g->after, 1), *b = spy_vec_push(&g->before, 1);
    if (a && b) {
        *a = (int64_t)after;
        *b = (int64_t)before;
    }
}

spy_instr *spy_graph_instrs(spy_graph *g, uint64_t n, uint64_t *first)
{
    *first = g->instrs.len;
    return spy_vec_push(&g->instrs, n);
}

spy_desc *spy_graph_descs(spy_graph *g, uint64_t n, uint64_t *first)
{
    *first = g->descs.len;
    return spy_vec_push(&g->descs, n);
}

spy_status spy_graph_encode(const spy_graph *g, spy_built *out)
{
    out->data = NULL;
    out->bytes = 0;
    const spy_vec *v[] = {&g->slots, &g->cmds, &g->keys, &g->after, &g->before, &g->instrs, &g->descs};
    for (size_t i = 0; i < SPY_ARRAY_LEN(v); i++)
        if (v[i]->failed)
            return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for a program under construction");
    if (g->slots.len > UINT32_MAX || g->instrs.len > UINT32_MAX || g->descs.len > UINT32_MAX)
        return spy_fail(SPY_E_INVALID_ARG, -1, "a program of %llu slots, %llu instructions and %llu descriptors "
                        "is over the block's 2^32 - 1 of each", (unsigned long long)g->slots.len,
                        (unsigned long long)g->instrs.len, (unsigned long long)g->descs.len);
    spy_graph_record r = {
        .nslots = (uint32_t)g->slots.len, .ninstrs = (uint32_t)g->instrs.len, .ndescs = (uint32_t)g->descs.len,
        .ncmds = g->cmds.len, .npairs = g->after.len,
        .slots = g->slots.data, .cmds = g->cmds.data, .keys = g->keys.data,
        .after = g->after.data, .before = g->before.data, .instrs = g->instrs.data, .descs = g->descs.data,
    };
    return spy_graph_encode_record(&r, out);
}
