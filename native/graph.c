/* graph.c -- a program block under construction: the native builder's common part.
 *
 * A builder (construct.c) appends slots, commands with their program-order keys,
 * dependency pairs, SFU instructions and descriptors to a spy_graph; spy_graph_encode
 * orders the commands by key (stably), renumbers the pairs and writes the program block
 * the validator reads (spyre.h, "Program block layout"). Appending reports no error: the
 * first host allocation that fails marks the graph, and its encode fails with
 * SPY_E_HOST_NOMEM, so a builder checks once, at the end. */
#include <pthread.h>
#include <stdlib.h>

#include "internal.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define POOL_POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define POOL_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define POOL_POISON(p, n) ((void)(p), (void)(n))
#define POOL_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

/* ---- host memory the builders use again --------------------------------------------------- */

/* A construct-mode launch builds a program block (hundreds of KB for a prefill matmul) and
 * the arrays behind it, and frees them once the block is up. malloc hands memory this large
 * back to the system on free, and the next build faults every page of it in again: that was
 * more than half of a prefill matmul's construction. Freed buffers of POOL_MIN_BYTES or more
 * are kept instead (POOL_SLOTS of them, POOL_MAX_BYTES in all) and handed out again, the
 * smallest that fits first. Each buffer records its capacity in a header before the bytes it
 * hands out. A mutex guards the pool: a block may be freed on another thread than the one
 * that built it. Under ASan a kept buffer is poisoned, so a use after its free still fails. */
#define POOL_SLOTS 8
#define POOL_MIN_BYTES ((uint64_t)64 << 10)
#define POOL_MAX_BYTES ((uint64_t)64 << 20)

typedef struct pool_header {
    uint64_t cap; /* bytes after the header */
    uint64_t reserved;
} pool_header; /* 16 bytes: what follows stays 16-byte aligned */

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pool_header *pool[POOL_SLOTS];
static uint64_t pool_bytes;
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

/* A fork while another thread holds the lock would leave the child's copy locked forever:
 * the fork waits for the lock, and both sides let it go after. */
static void pool_prepare(void) { pthread_mutex_lock(&pool_lock); }
static void pool_release(void) { pthread_mutex_unlock(&pool_lock); }
static void pool_init(void) { pthread_atfork(pool_prepare, pool_release, pool_release); }

void *spy_host_alloc(uint64_t bytes)
{
    if (bytes > SIZE_MAX - sizeof(pool_header) - POOL_MIN_BYTES)
        return NULL;
    pool_header *h = NULL;
    if (bytes >= POOL_MIN_BYTES / 2) {
        pthread_once(&pool_once, pool_init);
        pthread_mutex_lock(&pool_lock);
        int best = -1;
        for (int i = 0; i < POOL_SLOTS; i++)
            if (pool[i] && pool[i]->cap >= bytes && (best < 0 || pool[i]->cap < pool[best]->cap))
                best = i;
        if (best >= 0 && pool[best]->cap / 4 <= bytes) { /* not a large buffer for a small need */
            h = pool[best];
            pool[best] = NULL;
            pool_bytes -= h->cap;
        }
        pthread_mutex_unlock(&pool_lock);
    }
    if (h) {
        POOL_UNPOISON(h + 1, h->cap);
        return h + 1;
    }
    uint64_t cap = bytes < POOL_MIN_BYTES ? bytes : (bytes + POOL_MIN_BYTES - 1) / POOL_MIN_BYTES * POOL_MIN_BYTES;
    h = malloc(sizeof *h + (size_t)cap);
    if (!h)
        return NULL;
    h->cap = cap;
    h->reserved = 0;
    return h + 1;
}

void spy_host_free(void *p)
{
    if (!p)
        return;
    pool_header *h = (pool_header *)p - 1;
    if (h->cap >= POOL_MIN_BYTES) {
        pthread_mutex_lock(&pool_lock);
        int slot = -1;
        for (int i = 0; i < POOL_SLOTS && slot < 0; i++)
            if (!pool[i])
                slot = i;
        if (slot >= 0 && pool_bytes + h->cap <= POOL_MAX_BYTES) {
            POOL_POISON(p, h->cap);
            pool[slot] = h;
            pool_bytes += h->cap;
            h = NULL;
        }
        pthread_mutex_unlock(&pool_lock);
    }
    free(h);
}

void *spy_host_realloc(void *p, uint64_t used, uint64_t bytes)
{
    if (p && ((pool_header *)p - 1)->cap >= bytes)
        return p;
    void *q = spy_host_alloc(bytes);
    if (q && p) {
        memcpy(q, p, (size_t)(used < bytes ? used : bytes));
        spy_host_free(p);
    }
    return q;
}

/* ---- growable arrays ---------------------------------------------------------------------- */

bool spy_vec_reserve(spy_vec *v, uint64_t n)
{
    if (v->failed)
        return false;
    if (v->len + n <= v->cap)
        return true;
    uint64_t cap = v->cap ? v->cap : 16;
    while (cap < v->len + n)
        cap *= 2;
    uint64_t bytes;
    void *p = spy_mul_ok(cap, v->elem, &bytes) ? spy_host_realloc(v->data, v->len * v->elem, bytes) : NULL;
    if (!p) {
        v->failed = true;
        return false;
    }
    v->data = p;
    v->cap = cap;
    return true;
}

void *spy_vec_push(spy_vec *v, uint64_t n)
{
    if (!spy_vec_reserve(v, n))
        return NULL;
    uint8_t *at = (uint8_t *)v->data + v->len * v->elem;
    memset(at, 0, (size_t)(n * v->elem));
    v->len += n;
    return at;
}

void spy_vec_free(spy_vec *v)
{
    spy_host_free(v->data);
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

/* A block of `total` bytes, zeroed or not: its header written (the rest of the header zero)
 * and its sections placed. */
static spy_status block_alloc(uint64_t total, uint32_t nslots, uint32_t ncmds, uint32_t ndeps, uint32_t ndescs,
                              bool zeroed, spy_built *out, spy_block_sections *blk)
{
    size_t words = total <= SIZE_MAX - 7 ? (size_t)(total + 7) / 8 : 0;
    uint64_t *mem = words ? spy_host_alloc((uint64_t)words * 8) : NULL;
    if (!mem)
        return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for a %llu-byte program block",
                        (unsigned long long)total);
    uint8_t *b = (uint8_t *)mem;
    spy_job_header *h = (spy_job_header *)b;
    memset(h, 0, zeroed ? words * 8 : sizeof *h);
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
    if (!zeroed && ndeps % 2)
        blk->deps[ndeps] = 0; /* the padding to 8 bytes */
    out->data = b;
    out->bytes = total;
    return SPY_OK;
}

spy_status spy_block_alloc(uint64_t total, uint32_t nslots, uint32_t ncmds, uint32_t ndeps, uint32_t ndescs,
                           spy_built *out, spy_block_sections *blk)
{
    return block_alloc(total, nslots, ncmds, ndeps, ndescs, true, out, blk);
}

void spy_built_free(spy_built *b)
{
    if (!b)
        return;
    spy_host_free(b->data);
    b->data = NULL;
    b->bytes = 0;
}

/* ---- job graphs ------------------------------------------------------------------------------ */

/* order[0..n) sorted stably by keys, through `tmp` (n entries): a run already in order (the
 * common case: commands made in program order) costs one pass; keys of a small range (a
 * builder's phases of steps) are counted into place; others are merge sorted bottom-up. */
static void stable_order(const int64_t *keys, uint64_t n, uint64_t *order, uint64_t *tmp)
{
    bool sorted = true;
    int64_t lo = n ? keys[0] : 0, hi = lo;
    for (uint64_t i = 0; i < n; i++) {
        order[i] = i;
        if (i && keys[i] < keys[i - 1])
            sorted = false;
        lo = keys[i] < lo ? keys[i] : lo;
        hi = keys[i] > hi ? keys[i] : hi;
    }
    if (sorted)
        return;
    uint64_t range = (uint64_t)hi - (uint64_t)lo; /* below 2^64 */
    uint64_t *at = range <= 4 * n + 1024 ? calloc((size_t)range + 1, sizeof *at) : NULL;
    if (at) {
        for (uint64_t i = 0; i < n; i++)
            at[(uint64_t)keys[i] - (uint64_t)lo]++;
        uint64_t sum = 0;
        for (uint64_t k = 0; k <= range; k++) {
            uint64_t c = at[k];
            at[k] = sum;
            sum += c;
        }
        for (uint64_t i = 0; i < n; i++)
            order[at[(uint64_t)keys[i] - (uint64_t)lo]++] = i;
        free(at);
        return;
    }
    for (uint64_t width = 1; width < n; width *= 2) {
        for (uint64_t lo_ = 0; lo_ < n; lo_ += 2 * width) {
            uint64_t mid = lo_ + width < n ? lo_ + width : n, end = lo_ + 2 * width < n ? lo_ + 2 * width : n;
            uint64_t a = lo_, b = mid, k = lo_;
            while (a < mid && b < end)
                tmp[k++] = keys[order[b]] < keys[order[a]] ? order[b++] : order[a++];
            while (a < mid)
                tmp[k++] = order[a++];
            while (b < end)
                tmp[k++] = order[b++];
        }
        memcpy(order, tmp, (size_t)n * sizeof *order);
    }
}

/* A graph's parts as the encoder reads them: dependency pairs as (after, before) uint32
 * pairs, indices of commands in the order they were made. */
typedef struct graph_parts {
    uint32_t nslots, ninstrs, ndescs;
    uint64_t ncmds, npairs;
    const spy_slot *slots;
    const spy_cmd *cmds;
    const int64_t *keys;
    const uint32_t *pairs;
    const spy_instr *instrs;
    const spy_desc *descs;
} graph_parts;

static spy_status block_size(const graph_parts *g, uint64_t *total)
{
    if (!spy_block_bytes(g->nslots, g->ncmds, g->npairs, g->ndescs, total) ||
        *total + (uint64_t)g->ninstrs * sizeof(spy_instr) > SPY_BUILD_MAX_BYTES)
        return spy_fail(SPY_E_INVALID_ARG, -1, "graph record: ncmds %llu, npairs %llu, ndescs %u and ninstrs %u "
                        "make a program block of more than %llu bytes", (unsigned long long)g->ncmds,
                        (unsigned long long)g->npairs, g->ndescs, g->ninstrs,
                        (unsigned long long)SPY_BUILD_MAX_BYTES);
    *total += (uint64_t)g->ninstrs * sizeof(spy_instr);
    return SPY_OK;
}

/* The block: commands sorted stably by key, each one's dependencies in the order given. A
 * pair naming no command is refused (checked while the pairs are counted). */
static spy_status encode(const graph_parts *g, spy_built *out)
{
    uint64_t total = 0;
    spy_status s = block_size(g, &total);
    if (s != SPY_OK)
        return s;
    uint64_t n = g->ncmds; /* below 2^32, as the pairs (block_size) */
    uint64_t *order = spy_host_alloc((2 * n + 1) * sizeof *order); /* the order, a merge buffer */
    uint32_t *at = spy_host_alloc((2 * n + 1) * sizeof *at);       /* per command made: its place, its deps' */
    if (!order || !at) {
        spy_host_free(order);
        spy_host_free(at);
        return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory to order %llu commands", (unsigned long long)n);
    }
    uint32_t *rank = at, *fill = at + n;
    memset(fill, 0, (size_t)n * sizeof *fill);
    const uint32_t *pair = g->pairs;
    for (uint64_t i = 0; i < g->npairs; i++, pair += 2) { /* dependencies per command made */
        if (pair[0] >= n || pair[1] >= n) {
            spy_host_free(order);
            spy_host_free(at);
            return spy_fail(SPY_E_INVALID_ARG, -1, "graph: dependency pair %llu (%u after %u) names no command of %llu",
                            (unsigned long long)i, pair[0], pair[1], (unsigned long long)n);
        }
        fill[pair[0]]++;
    }
    stable_order(g->keys, n, order, order + n);
    spy_block_sections blk; /* every byte is written below */
    s = block_alloc(total, g->nslots, (uint32_t)n, (uint32_t)g->npairs, g->ndescs, false, out, &blk);
    if (s != SPY_OK) {
        spy_host_free(order);
        spy_host_free(at);
        return s;
    }
    ((spy_job_header *)out->data)->ninstrs = g->ninstrs;
    if (g->nslots)
        memcpy(blk.slots, g->slots, (size_t)g->nslots * sizeof *blk.slots);
    uint32_t begin = 0;
    for (uint64_t i = 0; i < n; i++) { /* in program order: the command, where its dependencies start */
        uint64_t c = order[i];
        rank[c] = (uint32_t)i;
        blk.cmds[i] = g->cmds[c];
        blk.cmds[i].ndeps = fill[c];
        blk.cmds[i].dep_begin = fill[c] = begin;
        begin += blk.cmds[i].ndeps;
    }
    pair = g->pairs;
    for (uint64_t i = 0; i < g->npairs; i++, pair += 2) /* grouped per waiting command, in the given order */
        blk.deps[fill[pair[0]]++] = rank[pair[1]];
    spy_instr *instrs = (spy_instr *)blk.descs; /* the instructions come before the descriptors */
    if (g->ninstrs)
        memcpy(instrs, g->instrs, (size_t)g->ninstrs * sizeof *instrs);
    if (g->ndescs)
        memcpy(instrs + g->ninstrs, g->descs, (size_t)g->ndescs * sizeof(spy_desc));
    spy_host_free(order);
    spy_host_free(at);
    return SPY_OK;
}

spy_status spy_graph_encode_record(const spy_graph_record *r, spy_built *out)
{
    if ((r->nslots && !r->slots) || (r->ncmds && (!r->cmds || !r->keys)) ||
        (r->npairs && (!r->after || !r->before)) || (r->ninstrs && !r->instrs) || (r->ndescs && !r->descs))
        return spy_fail(SPY_E_INVALID_ARG, -1, "graph record: a count without its array");
    graph_parts g = {.nslots = r->nslots, .ninstrs = r->ninstrs, .ndescs = r->ndescs, .ncmds = r->ncmds,
                     .npairs = r->npairs, .slots = r->slots, .cmds = r->cmds, .keys = r->keys,
                     .instrs = r->instrs, .descs = r->descs};
    uint64_t total;
    spy_status s = block_size(&g, &total);
    if (s != SPY_OK)
        return s;
    uint32_t *pairs = spy_host_alloc((2 * r->npairs + 1) * sizeof *pairs); /* npairs < 2^32 (block_size) */
    if (!pairs)
        return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for %llu dependency pairs",
                        (unsigned long long)r->npairs);
    for (uint64_t i = 0; i < r->npairs; i++) {
        bool after_bad = r->after[i] < 0 || (uint64_t)r->after[i] >= r->ncmds;
        if (after_bad || r->before[i] < 0 || (uint64_t)r->before[i] >= r->ncmds) {
            spy_host_free(pairs);
            return spy_fail(SPY_E_INVALID_ARG, -1, "graph record: %s[%llu] = %lld names no command of %llu",
                            after_bad ? "after" : "before", (unsigned long long)i,
                            (long long)(after_bad ? r->after[i] : r->before[i]), (unsigned long long)r->ncmds);
        }
        pairs[2 * i] = (uint32_t)r->after[i];
        pairs[2 * i + 1] = (uint32_t)r->before[i];
    }
    g.pairs = pairs;
    s = encode(&g, out);
    spy_host_free(pairs);
    return s;
}

/* ---- a graph under construction ---------------------------------------------------------- */

void spy_graph_init(spy_graph *g)
{
    memset(g, 0, sizeof *g);
    g->slots.elem = sizeof(spy_slot);
    g->cmds.elem = sizeof(spy_cmd);
    g->keys.elem = sizeof(int64_t);
    g->pairs.elem = 2 * sizeof(uint32_t);
    g->instrs.elem = sizeof(spy_instr);
    g->descs.elem = sizeof(spy_desc);
}

void spy_graph_free(spy_graph *g)
{
    spy_vec *v[] = {&g->slots, &g->cmds, &g->keys, &g->pairs, &g->instrs, &g->descs};
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

void spy_graph_reserve(spy_graph *g, uint64_t ncmds, uint64_t npairs)
{
    spy_vec_reserve(&g->cmds, ncmds);
    spy_vec_reserve(&g->keys, ncmds);
    spy_vec_reserve(&g->pairs, npairs);
}

void spy_graph_depend(spy_graph *g, uint64_t after, uint64_t before)
{
    spy_vec *v = &g->pairs;
    if (v->len < v->cap || spy_vec_reserve(v, 1)) {
        uint32_t *p = (uint32_t *)v->data + 2 * v->len++;
        p[0] = (uint32_t)after;
        p[1] = (uint32_t)before;
    }
}

void spy_graph_depend_runs(spy_graph *g, uint64_t after, uint64_t na, uint64_t before, uint64_t nb)
{
    spy_vec *v = &g->pairs;
    uint64_t n = na * nb; /* below 2^64: the runs are of commands made */
    if (!spy_vec_reserve(v, n))
        return; /* the graph is failed: its encode says so */
    uint32_t *p = (uint32_t *)v->data + 2 * v->len;
    for (uint64_t x = 0; x < na; x++)
        for (uint64_t y = 0; y < nb; y++) {
            *p++ = (uint32_t)(after + x);
            *p++ = (uint32_t)(before + y);
        }
    v->len += n;
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
    const spy_vec *v[] = {&g->slots, &g->cmds, &g->keys, &g->pairs, &g->instrs, &g->descs};
    for (size_t i = 0; i < SPY_ARRAY_LEN(v); i++)
        if (v[i]->failed)
            return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for a program under construction");
    if (g->slots.len > UINT32_MAX || g->instrs.len > UINT32_MAX || g->descs.len > UINT32_MAX)
        return spy_fail(SPY_E_INVALID_ARG, -1, "a program of %llu slots, %llu instructions and %llu descriptors "
                        "is over the block's 2^32 - 1 of each", (unsigned long long)g->slots.len,
                        (unsigned long long)g->instrs.len, (unsigned long long)g->descs.len);
    graph_parts parts = {
        .nslots = (uint32_t)g->slots.len, .ninstrs = (uint32_t)g->instrs.len, .ndescs = (uint32_t)g->descs.len,
        .ncmds = g->cmds.len, .npairs = g->pairs.len,
        .slots = g->slots.data, .cmds = g->cmds.data, .keys = g->keys.data,
        .pairs = g->pairs.data, .instrs = g->instrs.data, .descs = g->descs.data,
    };
    return encode(&parts, out);
}
