/* build_matmul.c -- a matmul's job graph, built from its decision record.
 *
 * The record (spyre.h, "construction") holds what was decided once per kernel: the
 * tiling, the scratchpad regions, the views of the buffers and the per-tile program. Each
 * build derives the schedule from it and makes every command on a spy_graph (graph.c):
 *
 * - A *task* is one core's share of a wave: one output tile over one K slice; a *use* is
 *   one step of a task, the matmul of one K chunk. Blocks of pm x pn tiles are dealt to
 *   the groups wave by wave; a group's cores are (s, i, j) with j fastest.
 * - The tasks of a grid row share each A chunk, those of a grid column each B chunk: one
 *   of them (rotating with the step and the wave) loads it and forwards it over the ring
 *   to the others. A use's chunks land in operand buffer (wave * steps + step) % nbuf,
 *   the same on every core; a write into a buffer waits for the buffer's previous use on
 *   that core (its matmul, and the forwards when the core loaded that chunk).
 * - Split-K adds the slices' partial sums pairwise over the ring (slice s + 2^r into
 *   slice s); the root (slice 0) runs the per-tile program between its loads and stores,
 *   alternating between two sets of staging tiles.
 *
 * Program order (the commands' keys) is the time order of the steps, with a wave's
 * reduction and epilogue placed nbuf - 1 steps into the next wave (the next wave's first
 * forwards must not queue behind the reduction on a core's ring port). DMA patterns in
 * the stick layout are made for each box: a run of contiguous bytes over up to three
 * outer dimensions, several commands when it needs more, a descriptor list when it has
 * none (spyre_rt/construct/access.py describes the same patterns). */
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

/* program-order phases inside one step */
enum { PH_LOAD, PH_SEND, PH_MATMUL, PH_REDUCE_SEND, PH_REDUCE_ADD, PH_BIAS, PH_EPILOGUE, PH_STORE };

/* the most commands (or operations) a program block holds */
#define MM_MAX_OPS ((uint64_t)SPY_BUILD_MAX_BYTES / sizeof(spy_cmd))
/* the widest SFU operand row the card takes, in elements (program.c's bound on counts) */
#define SPY_MM_MAX_PITCH (1u << 26)
/* the most dependency pairs made (8 per command: real matmuls make about 3) */
#define MM_MAX_PAIRS (8 * MM_MAX_OPS)

typedef struct run {
    uint32_t first, count; /* commands [first, first + count) in the order they were made */
} run;

typedef struct mm_task {
    uint32_t wave, core, batch, s, i, j;
    uint32_t rows, cols, row0, col0; /* its output tile */
    uint32_t rank_m, rank_n;         /* of its tile's rows and columns among the distinct sizes */
    uint32_t nuses, first_use;
    int32_t prev, next;              /* the core's task before and after it (-1: none) */
    int32_t last_add, sent;          /* split-K: its last add, the pair in which it sends (-1) */
    int32_t root;                    /* its index among the roots (-1: not one) */
} mm_task;

typedef struct mm_use {
    uint32_t task, step, chunk, slot; /* chunk: the K chunk */
    int32_t prev;                     /* the core's previous use of the same operand buffers */
    uint32_t shared[2];               /* its A and B chunks (shared by a grid row / column) */
    uint8_t loads[2];                 /* does its task load them */
} mm_use;

typedef struct mm_pair {
    uint32_t snd, rcv; /* tasks */
    int32_t prev_add;  /* the receiver core's add before this one (-1: none) */
} mm_pair;

typedef struct mm_root {
    uint32_t task, slot;
    int32_t prev2;     /* the root two before on its core: the last to use the same staging tiles */
    uint32_t program;  /* its program's first instruction */
    uint32_t pieces;   /* its last matmul, program and stores cut in pieces of rows (1: whole) */
    uint32_t width;    /* rows of each piece but the last */
    uint32_t extra;    /* its pieces after the first: their index among every root's */
    uint32_t depth;    /* the last matmuls each piece walks (1: the last only) */
    uint32_t extra_mm; /* the matmuls of its pieces after the first: their index among every root's */
} mm_root;

/* ---- DMA patterns in the stick layout ------------------------------------------------------ */

typedef struct pdim {
    uint64_t count, src, dst; /* src: the DRAM side's byte stride; dst: the scratchpad's */
} pdim;

#define PAT_MAX_DIMS 3
#define PAT_WORK_DIMS 8

typedef struct pattern {
    uint64_t run, start;      /* start: device byte offset of the box's first element */
    uint32_t ndims, nouter;
    pdim dims[PAT_MAX_DIMS];  /* innermost first */
    pdim outer[PAT_WORK_DIMS]; /* beyond three: one command per combination (outer[0] fastest) */
    uint64_t nbases;
} pattern;

/* Drop unit dims, fuse neighbours contiguous on both sides, absorb into the run the inner
 * dims that continue it; more than three dims become bases. */
static void pattern_finish(pattern *p, const pdim *dims, uint32_t n)
{
    pdim m[PAT_WORK_DIMS];
    uint32_t k = 0;
    for (uint32_t x = 0; x < n; x++) {
        pdim d = dims[x];
        if (d.count == 1)
            continue;
        if (k && d.src == m[k - 1].src * m[k - 1].count && d.dst == m[k - 1].dst * m[k - 1].count) {
            d = (pdim){m[k - 1].count * d.count, m[k - 1].src, m[k - 1].dst};
            k--;
        }
        m[k++] = d;
    }
    uint32_t lo = 0;
    while (lo < k && m[lo].src == p->run && m[lo].dst == p->run)
        p->run *= m[lo++].count;
    p->nouter = 0;
    p->nbases = 1;
    while (k - lo > PAT_MAX_DIMS) { /* the outermost first */
        p->outer[p->nouter++] = m[--k];
        p->nbases *= m[k].count;
    }
    p->ndims = k - lo;
    for (uint32_t x = 0; x < p->ndims; x++)
        p->dims[x] = m[lo + x];
}

/* The pattern moving box (counts) of a view starting at logical element `base`, with
 * logical strides `st` and scratchpad byte strides `lx`; false when it has none. */
static bool stick_pattern(const spy_layout *l, uint64_t base, const uint64_t counts[2], const uint64_t st[2],
                          const uint64_t lx[2], pattern *p)
{
    uint64_t e = l->itemsize, n_row = l->row_len, sb = l->stick_bytes, s = sb / e;
    uint64_t stick_stride = (l->rows ? l->rows : 1) * sb;
    pdim dims[PAT_WORK_DIMS];
    uint32_t nd = 0;
    uint32_t nitems = 2;
    if (l->rows <= 1) { /* one row is linear memory: any box works */
        p->run = e;
        if (st[1] == 1 && lx[1] == e)
            p->run = counts[--nitems] * e;
        for (uint32_t x = nitems; x-- > 0;)
            if (counts[x] > 1)
                dims[nd++] = (pdim){counts[x], st[x] * e, lx[x]};
        p->start = base * e;
        pattern_finish(p, dims, nd);
        return true;
    }
    uint64_t r0 = base / n_row, c0 = base % n_row;
    uint64_t inner = 0;
    if (st[1] == 1 && lx[1] == e && counts[1] > 1)
        inner = counts[--nitems];
    uint64_t col_span = 0, in_stick = 0;
    for (uint32_t x = nitems; x-- > 0;) { /* innermost first */
        uint64_t count = counts[x];
        if (count == 1)
            continue;
        uint64_t q = st[x] / n_row, m = st[x] % n_row;
        col_span += m * (count - 1);
        if (m % s == 0) { /* whole rows and whole sticks */
            dims[nd++] = (pdim){count, q * sb + (m / s) * stick_stride, lx[x]};
            continue;
        }
        if (s % m)
            return false; /* moves part of a stick */
        uint64_t f = s / m; /* steps of this dim that fill one stick */
        if (count <= f) {
            dims[nd++] = (pdim){count, q * sb + m * e, lx[x]};
            in_stick += m * (count - 1);
        } else if (count % f == 0) {
            dims[nd++] = (pdim){f, q * sb + m * e, lx[x]};
            dims[nd++] = (pdim){count / f, q * sb * f + stick_stride, lx[x] * f};
            in_stick += m * (f - 1);
        } else {
            return false; /* does not tile the stick */
        }
    }
    if (inner) {
        col_span += inner - 1;
        if (c0 % s == 0 && in_stick == 0 && inner > s) { /* whole sticks, the innermost dim */
            memmove(dims + 1, dims, nd * sizeof *dims);
            dims[0] = (pdim){(inner + s - 1) / s, stick_stride, s * e};
            nd++;
            p->run = sb;
        } else if (c0 % s + in_stick + inner <= s) {
            p->run = inner * e;
        } else {
            return false; /* a run crosses a stick boundary at an unaligned column */
        }
    } else {
        p->run = e;
        if (c0 % s + in_stick >= s)
            return false;
    }
    if (c0 + col_span >= n_row)
        return false; /* the columns wrap into the next row */
    p->start = (c0 / s) * stick_stride + r0 * sb + (c0 % s) * e;
    pattern_finish(p, dims, nd);
    return true;
}

/* Device byte offset of logical element `x`. */
static uint64_t stick_phys(const spy_layout *l, uint64_t x)
{
    uint64_t s = l->stick_bytes / l->itemsize, r = x / l->row_len, c = x % l->row_len;
    return (c / s) * (l->rows ? l->rows : 1) * l->stick_bytes + r * l->stick_bytes + (c % s) * l->itemsize;
}

/* ---- the builder ------------------------------------------------------------------------------ */

typedef struct mm_desc_item {
    uint64_t key[5];
    uint64_t base, lx, box[2];
    uint32_t seq, cmd;
} mm_desc_item;

/* The boxes of one view moved between DRAM and the scratchpads by one kind of command. */
typedef struct mm_stream {
    const spy_layout *lay;
    uint32_t slot, itemsize;
    bool load;
    uint64_t st[2], lx[2]; /* the box's dims: logical strides, scratchpad byte strides */
    /* the last box's pattern (relative to its start), reused by the boxes alike */
    bool memo, affine;
    uint64_t key[5];
    pattern pat;
    spy_vec pending;       /* mm_desc_item: boxes moved by descriptor lists */
    uint32_t seq;
} mm_stream;

typedef struct mm_build {
    const spy_matmul_record *r;
    spy_graph g;
    uint32_t e_in, steps, tm, tn, depth;
    uint64_t ntasks, nuses, nk, nchunks[2], npairs, nroots, nblocks;
    uint64_t least;                      /* commands at least */
    uint32_t *k_size, *slice_first, *slice_len;
    uint64_t *k_start, *m_start, *n_start;
    uint32_t *m_rank, *n_rank, ndm, ndn; /* each tile size's rank among the distinct ones */
    mm_task *tasks;
    mm_use *uses;
    mm_pair *pairs;
    mm_root *roots;
    uint32_t *loader[2];                 /* per shared chunk: the use that loads it */
    run *loaded[2], *arrival[2], *sends[2];
    uint32_t mm0, rsend0, radd0, sfu0;   /* the first of each block of one command per op */
    run *ld, *st;                        /* per (tiles, root) */
    uint64_t nextra;                     /* pieces after a root's first, of every root */
    uint64_t nextra_mm;                  /* their matmuls: `depth` each */
    uint32_t pmm0, psfu0;                /* their matmuls and programs */
    run *pst;                            /* per (store tiles, extra piece) */
    run *pro_ready, *pro_vec;            /* an A prologue's: per A chunk, its program and (per
                                            vector, per chunk) its vectors' loads */
    bool overflow;                       /* more dependencies than a program block holds */
    void *blocks[40];                    /* every allocation, freed at the end */
    uint32_t nblk;
} mm_build;

static void *mm_alloc(mm_build *b, uint64_t n, size_t size)
{
    void *p = n && n <= SIZE_MAX / size && b->nblk < SPY_ARRAY_LEN(b->blocks) ? calloc((size_t)n, size) : NULL;
    if (p)
        b->blocks[b->nblk++] = p;
    return p;
}

static void mm_release(mm_build *b)
{
    for (uint32_t i = 0; i < b->nblk; i++)
        free(b->blocks[i]);
    b->nblk = 0;
}

static int64_t use_key(const mm_build *b, uint64_t u, int phase)
{
    const mm_use *x = &b->uses[u];
    return ((int64_t)b->tasks[x->task].wave * b->steps + x->step) * 8 + phase;
}

static int64_t end_key(const mm_build *b, uint64_t t, int phase)
{
    int64_t steps = b->steps ? b->steps : 1;
    return (((int64_t)b->tasks[t].wave + 1) * steps + b->r->nbuf - 2) * 8 + phase;
}

/* command `after` waits for command `before` */
static inline void depend(mm_build *b, uint64_t after, uint64_t before)
{
    spy_vec *v = &b->g.pairs;
    uint64_t len = v->len;
    if (len < v->cap) { /* the common case: room reserved (spy_graph_reserve) */
        uint32_t *p = (uint32_t *)v->data + 2 * len;
        p[0] = (uint32_t)after;
        p[1] = (uint32_t)before;
        v->len = len + 1;
    } else if (len < MM_MAX_PAIRS) {
        spy_graph_depend(&b->g, after, before);
    } else {
        b->overflow = true;
    }
}

/* every command of `a` waits for every command of `c` */
static inline void depend_runs(mm_build *b, run a, run c)
{
    if (a.count == 1 && c.count == 1) {
        depend(b, a.first, c.first);
    } else if (b->g.pairs.len + (uint64_t)a.count * c.count > MM_MAX_PAIRS) {
        b->overflow = true;
    } else {
        spy_graph_depend_runs(&b->g, a.first, a.count, c.first, c.count);
    }
}

static spy_status too_big(void)
{
    return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: makes more than %llu commands, a program block of "
                    "more than %llu bytes", (unsigned long long)MM_MAX_OPS, (unsigned long long)SPY_BUILD_MAX_BYTES);
}

/* n zeroed commands of one key and opcode; NULL when host memory ran out (the encode says so). */
static spy_cmd *add_cmds(mm_build *b, uint64_t n, int64_t key, uint8_t op, uint32_t *first)
{
    uint64_t f;
    spy_cmd *c = spy_graph_add(&b->g, n, key, &f);
    *first = (uint32_t)f;
    for (uint64_t i = 0; c && i < n; i++)
        c[i].op = op;
    return c;
}

static int64_t *keys_at(mm_build *b, uint32_t first) { return (int64_t *)b->g.keys.data + first; }

static void stream_init(mm_build *b, mm_stream *s, const spy_mm_view *v, const uint64_t st[2], uint64_t pitch_bytes,
                        uint32_t itemsize, bool load)
{
    memset(s, 0, sizeof *s);
    s->lay = &b->r->slots[v->slot];
    s->slot = v->slot;
    s->itemsize = itemsize;
    s->load = load;
    s->st[0] = st[0], s->st[1] = st[1];
    s->lx[0] = pitch_bytes, s->lx[1] = itemsize;
    s->pending.elem = sizeof(mm_desc_item);
}

/* What a box's pattern depends on besides where it starts (its start's column in a storage
 * row): its shape, where it starts inside a stick, whether its columns reach past its row's
 * end (no pattern then), whether its last column is the row's last (the padding after it
 * may be written). A one-row storage is linear memory: its boxes differ by shape alone. */
static void box_key(const mm_stream *s, uint64_t column, const uint64_t box[2], uint64_t key[5])
{
    const spy_layout *l = s->lay;
    key[0] = box[0], key[1] = box[1], key[2] = key[3] = key[4] = 0;
    if (l->rows <= 1)
        return;
    uint64_t n_row = l->row_len, a, c, span;
    bool wraps = !spy_mul_ok(box[0] - 1, s->st[0] % n_row, &a) || !spy_mul_ok(box[1] - 1, s->st[1] % n_row, &c) ||
                 !spy_add_ok(a, c, &span) || !spy_add_ok(span, column, &span) || span >= n_row;
    key[2] = column % (l->stick_bytes / l->itemsize);
    key[3] = wraps;
    key[4] = column + box[1] >= n_row && s->st[1] == 1;
}

/* The commands moving one box: a pattern's (one per base), or one descriptor-list DMA
 * whose descriptors come when the stream ends. */
static spy_status dma_box(mm_build *b, mm_stream *s, uint64_t base, uint64_t box0, uint64_t box1, uint64_t lx_off,
                          uint32_t core, int64_t key, run *out)
{
    const spy_layout *l = s->lay;
    uint64_t box[2] = {box0, box1}, k[5], row = base / l->row_len, column = base - row * l->row_len;
    box_key(s, column, box, k);
    if (!s->memo || memcmp(k, s->key, sizeof k)) {
        s->memo = true;
        memcpy(s->key, k, sizeof k);
        s->affine = stick_pattern(s->lay, base, box, s->st, s->lx, &s->pat);
        if (s->affine && !s->load && !k[4]) { /* a store writes nothing past its box but the row's padding */
            uint64_t bytes = s->pat.run * s->pat.nbases;
            for (uint32_t x = 0; x < s->pat.ndims; x++)
                bytes *= s->pat.dims[x].count;
            s->affine = bytes == box0 * box1 * s->itemsize;
        }
    }
    uint64_t n = s->affine ? s->pat.nbases : 1;
    if (b->g.cmds.len + n > MM_MAX_OPS)
        return too_big();
    uint32_t first;
    spy_cmd *c = add_cmds(b, n, key, s->load ? SPY_OP_LOAD : SPY_OP_STORE, &first);
    *out = (run){first, (uint32_t)n};
    if (!c)
        return SPY_OK;
    if (!s->affine) {
        c->core = (uint16_t)core;
        c->flags = SPY_DMA_DESCS;
        if (s->load)
            c->u.dma.src_slot = s->slot;
        else
            c->u.dma.dst_slot = s->slot;
        mm_desc_item *it = spy_vec_push(&s->pending, 1);
        if (!it)
            return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for a matmul's descriptor lists");
        *it = (mm_desc_item){{k[0], k[1], k[2], k[3], k[4]}, base, lx_off, {box0, box1}, s->seq++, first};
        return SPY_OK;
    }
    const pattern *p = &s->pat;
    uint64_t e = l->itemsize, per_stick = l->stick_bytes / e; /* a power of two */
    uint64_t start = (column / per_stick) * (l->rows ? l->rows : 1) * l->stick_bytes + row * l->stick_bytes +
                     (column & (per_stick - 1)) * e; /* stick_phys(base) */
    for (uint64_t i = 0; i < n; i++) {
        uint64_t dev = start, lx = lx_off, rest = i;
        for (uint32_t o = 0; o < p->nouter; o++) {
            uint64_t kk = rest % p->outer[o].count;
            rest /= p->outer[o].count;
            dev += kk * p->outer[o].src;
            lx += kk * p->outer[o].dst;
        }
        spy_cmd *x = &c[i];
        x->core = (uint16_t)core;
        x->u.dma.run_bytes = (uint32_t)p->run;
        x->u.dma.ndims = p->ndims;
        if (s->load) {
            x->u.dma.src_slot = s->slot;
            x->u.dma.src_off = dev;
            x->u.dma.dst_off = lx;
        } else {
            x->u.dma.dst_slot = s->slot;
            x->u.dma.dst_off = dev;
            x->u.dma.src_off = lx;
        }
        for (uint32_t d = 0; d < p->ndims; d++) {
            x->u.dma.count[d] = (uint32_t)p->dims[d].count;
            x->u.dma.src_stride[d] = s->load ? p->dims[d].src : p->dims[d].dst;
            x->u.dma.dst_stride[d] = s->load ? p->dims[d].dst : p->dims[d].src;
        }
    }
    return SPY_OK;
}

static int desc_item_order(const void *x, const void *y)
{
    const mm_desc_item *a = x, *c = y;
    for (int i = 0; i < 5; i++)
        if (a->key[i] != c->key[i])
            return a->key[i] < c->key[i] ? -1 : 1;
    return a->seq < c->seq ? -1 : a->seq > c->seq;
}

/* Runs of a box contiguous on both sides, one descriptor each; with d NULL only counted. */
static uint64_t box_runs(const mm_stream *s, const mm_desc_item *it, spy_desc *d)
{
    uint64_t e = s->lay->itemsize, n = 0, dev0 = 0, lx0 = 0, len = 0, prev_dev = 0, prev_lx = 0;
    for (uint64_t i = 0; i < it->box[0]; i++)
        for (uint64_t j = 0; j < it->box[1]; j++) {
            uint64_t dev = stick_phys(s->lay, it->base + i * s->st[0] + j * s->st[1]);
            uint64_t lx = it->lx + i * s->lx[0] + j * s->lx[1];
            if (len && dev == prev_dev + e && lx == prev_lx + e) {
                len += e;
            } else {
                if (len && d)
                    d[n - 1] = (spy_desc){s->load ? dev0 : lx0, s->load ? lx0 : dev0, (uint32_t)len, 0};
                n++;
                dev0 = dev, lx0 = lx, len = e;
            }
            prev_dev = dev, prev_lx = lx;
        }
    if (len && d)
        d[n - 1] = (spy_desc){s->load ? dev0 : lx0, s->load ? lx0 : dev0, (uint32_t)len, 0};
    return n;
}

/* The descriptor lists of the stream's boxes that have no pattern, in the order of their
 * keys (the boxes of one key in the order they were made). */
static spy_status stream_end(mm_build *b, mm_stream *s)
{
    mm_desc_item *items = s->pending.data;
    uint64_t n = s->pending.len;
    spy_status st = SPY_OK;
    if (n > 1)
        qsort(items, (size_t)n, sizeof *items, desc_item_order);
    for (uint64_t i = 0; i < n && st == SPY_OK; i++) {
        uint64_t count = box_runs(s, &items[i], NULL), first;
        if (count > UINT32_MAX || b->g.descs.len + count > (uint64_t)SPY_BUILD_MAX_BYTES / sizeof(spy_desc)) {
            st = too_big();
            break;
        }
        spy_desc *d = spy_graph_descs(&b->g, count, &first);
        spy_cmd *c = (spy_cmd *)b->g.cmds.data + items[i].cmd;
        if (!d || b->g.cmds.failed)
            break; /* the encode reports it */
        box_runs(s, &items[i], d);
        c->u.dma.src_off = first;
        c->u.dma.desc_count = (uint32_t)count;
    }
    spy_vec_free(&s->pending);
    return st;
}

/* ---- the schedule ------------------------------------------------------------------------------ */

/* Each size's rank among the distinct sizes of `size` (n of them); the count of distinct ones. */
static uint32_t size_ranks(const uint32_t *size, uint32_t n, uint32_t *rank, uint32_t *tmp)
{
    uint32_t nd = 0;
    for (uint32_t i = 0; i < n; i++) { /* distinct sizes, kept sorted (few: tiles are even) */
        uint32_t x = 0;
        while (x < nd && tmp[x] < size[i])
            x++;
        if (x < nd && tmp[x] == size[i])
            continue;
        memmove(tmp + x + 1, tmp + x, (nd - x) * sizeof *tmp);
        tmp[x] = size[i];
        nd++;
    }
    for (uint32_t i = 0; i < n; i++) {
        uint32_t lo = 0, hi = nd;
        while (hi - lo > 1) {
            uint32_t mid = (lo + hi) / 2;
            if (tmp[mid] <= size[i])
                lo = mid;
            else
                hi = mid;
        }
        rank[i] = lo;
    }
    return nd;
}

static spy_status schedule(mm_build *b)
{
    const spy_matmul_record *r = b->r;
    uint32_t pk = r->pk, pm = r->pm, pn = r->pn, gc = pk * pm * pn, nbuf = r->nbuf;
    b->slice_first = mm_alloc(b, pk, sizeof(uint32_t));
    b->slice_len = mm_alloc(b, pk, sizeof(uint32_t));
    b->m_start = mm_alloc(b, r->m_tiles, sizeof(uint64_t));
    b->n_start = mm_alloc(b, r->n_tiles, sizeof(uint64_t));
    b->m_rank = mm_alloc(b, r->m_tiles, sizeof(uint32_t));
    b->n_rank = mm_alloc(b, r->n_tiles, sizeof(uint32_t));
    uint32_t *tmp = mm_alloc(b, (uint64_t)r->m_tiles + r->n_tiles + r->num_cores * (uint64_t)nbuf, sizeof(uint32_t));
    int32_t *last = mm_alloc(b, r->num_cores * (uint64_t)(nbuf > 2 ? nbuf : 2), sizeof(int32_t));
    b->k_size = mm_alloc(b, b->nk ? b->nk : 1, sizeof(uint32_t));
    b->k_start = mm_alloc(b, b->nk ? b->nk : 1, sizeof(uint64_t));
    b->tasks = mm_alloc(b, b->ntasks, sizeof(mm_task));
    b->uses = mm_alloc(b, b->nuses ? b->nuses : 1, sizeof(mm_use));
    b->roots = mm_alloc(b, b->nroots, sizeof(mm_root));
    b->pairs = mm_alloc(b, b->npairs ? b->npairs : 1, sizeof(mm_pair));
    for (int op = 0; op < 2; op++)
        b->loader[op] = mm_alloc(b, b->nchunks[op] ? b->nchunks[op] : 1, sizeof(uint32_t));
    if (!b->slice_first || !b->slice_len || !b->m_start || !b->n_start || !b->m_rank || !b->n_rank || !tmp ||
        !last || !b->k_size || !b->k_start || !b->tasks || !b->uses || !b->roots || !b->pairs || !b->loader[0] ||
        !b->loader[1])
        return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for a matmul's schedule of %llu tasks",
                        (unsigned long long)b->ntasks);

    /* geometry: tiles, and K chunks of tk from each slice's start */
    uint64_t at = 0, kc = 0;
    b->steps = 0;
    for (uint32_t s = 0; s < pk; s++) {
        uint64_t len = (r->k_slice[s] + r->tk - 1) / r->tk;
        b->slice_first[s] = (uint32_t)kc;
        b->slice_len[s] = (uint32_t)len;
        if (len > b->steps)
            b->steps = (uint32_t)len;
        for (uint64_t c = 0; c < len; c++, kc++) {
            uint64_t left = r->k_slice[s] - c * r->tk;
            b->k_size[kc] = (uint32_t)(left < r->tk ? left : r->tk);
            b->k_start[kc] = at;
            at += b->k_size[kc];
        }
    }
    at = 0;
    for (uint32_t x = 0; x < r->m_tiles; x++, at += r->m_size[x - 1])
        b->m_start[x] = at;
    at = 0;
    for (uint32_t x = 0; x < r->n_tiles; x++, at += r->n_size[x - 1])
        b->n_start[x] = at;
    b->ndm = size_ranks(r->m_size, r->m_tiles, b->m_rank, tmp);
    b->ndn = size_ranks(r->n_size, r->n_tiles, b->n_rank, tmp);

    /* tasks: blocks in order (batch, M block, N block) dealt to the groups wave by wave */
    uint64_t wm = r->m_tiles / pm, wn = r->n_tiles / pn;
    for (uint32_t c = 0; c < r->num_cores; c++)
        last[c] = -1;
    uint64_t t = 0, u = 0, nr = 0;
    for (uint64_t blk = 0; blk < b->nblocks; blk++) {
        uint64_t bb = blk / (wm * wn), rest = blk % (wm * wn), mb = rest / wn, nb = rest % wn;
        uint32_t wave = (uint32_t)(blk / r->groups), group = (uint32_t)(blk % r->groups);
        for (uint32_t local = 0; local < gc; local++, t++) {
            mm_task *x = &b->tasks[t];
            uint32_t s = local / (pm * pn), i = local % (pm * pn) / pn, j = local % pn;
            uint64_t mt = mb * pm + i, nt = nb * pn + j;
            *x = (mm_task){wave, ((group * pk + s) * pm + i) * pn + j, (uint32_t)bb, s, i, j,
                           r->m_size[mt], r->n_size[nt], (uint32_t)b->m_start[mt], (uint32_t)b->n_start[nt],
                           b->m_rank[mt], b->n_rank[nt], b->slice_len[s], (uint32_t)u, -1, -1, -1, -1, -1};
            x->prev = last[x->core];
            if (x->prev >= 0)
                b->tasks[x->prev].next = (int32_t)t;
            last[x->core] = (int32_t)t;
            if (s == 0) {
                x->root = (int32_t)nr;
                b->roots[nr++].task = (uint32_t)t;
            }
            u += x->nuses;
        }
    }

    /* uses; a chunk is shared by the tasks that differ only in `along` (A: the grid column),
     * loaded by the one whose place matches the step and the wave */
    for (uint64_t c = 0; c < (uint64_t)r->num_cores * nbuf; c++)
        last[c] = -1;
    uint64_t total_len = b->nk; /* chunks of all slices */
    u = 0;
    for (t = 0; t < b->ntasks; t++) {
        const mm_task *x = &b->tasks[t];
        uint64_t blk = t / gc;
        uint32_t slot = (uint32_t)((uint64_t)x->wave * b->steps % nbuf);
        uint32_t across[2] = {x->i, x->j}, along[2] = {x->j, x->i}, width[2] = {pn, pm}, place[2];
        uint64_t shared[2];
        for (int op = 0; op < 2; op++) {
            uint64_t p = op ? pn : pm;
            shared[op] = blk * p * total_len + p * b->slice_first[x->s] + (uint64_t)across[op] * b->slice_len[x->s];
            place[op] = (uint32_t)(((uint64_t)across[op] + x->wave + (uint32_t)op) % width[op]);
        }
        for (uint32_t step = 0; step < x->nuses; step++, u++) {
            mm_use *y = &b->uses[u];
            y->task = (uint32_t)t;
            y->step = step;
            y->chunk = b->slice_first[x->s] + step;
            y->slot = slot;
            slot = slot + 1 == nbuf ? 0 : slot + 1;
            uint64_t key = (uint64_t)x->core * nbuf + y->slot;
            y->prev = last[key];
            last[key] = (int32_t)u;
            for (int op = 0; op < 2; op++) { /* the loader's place turns with the step */
                y->shared[op] = (uint32_t)(shared[op] + step);
                y->loads[op] = along[op] == place[op];
                place[op] = place[op] + 1 == width[op] ? 0 : place[op] + 1;
                if (y->loads[op])
                    b->loader[op][y->shared[op]] = (uint32_t)u;
            }
        }
    }

    /* split-K: wave by wave, round by round, slice s + 2^r into slice s */
    uint64_t np = 0, first_root = 0;
    for (uint64_t rt = 0; rt < b->nroots; rt++)
        b->roots[rt].slot = UINT32_MAX;
    for (uint32_t c = 0; c < r->num_cores; c++)
        last[c] = -1;
    while (first_root < b->nroots) {
        uint32_t wave = b->tasks[b->roots[first_root].task].wave;
        uint64_t end = first_root;
        while (end < b->nroots && b->tasks[b->roots[end].task].wave == wave)
            end++;
        for (uint32_t rnd = 0; (1u << rnd) < pk; rnd++)
            for (uint32_t s = 0; s + (1u << rnd) < pk; s += 2u << rnd)
                for (uint64_t rt = first_root; rt < end; rt++) {
                    uint32_t root = b->roots[rt].task;
                    mm_pair *pr = &b->pairs[np];
                    pr->rcv = root + s * pm * pn;
                    pr->snd = root + (s + (1u << rnd)) * pm * pn;
                    uint32_t core = b->tasks[pr->rcv].core;
                    pr->prev_add = last[core];
                    last[core] = (int32_t)np;
                    b->tasks[pr->rcv].last_add = (int32_t)np;
                    b->tasks[pr->snd].sent = (int32_t)np;
                    np++;
                }
        first_root = end;
    }

    /* roots: their staging tiles alternate on each core */
    uint32_t *seq = tmp;
    memset(seq, 0, r->num_cores * sizeof *seq);
    for (uint32_t c = 0; c < r->num_cores; c++)
        last[c] = -1;
    int32_t *before = last + r->num_cores; /* per core: the root before its last one */
    for (uint64_t rt = 0; rt < b->nroots; rt++) {
        mm_root *x = &b->roots[rt];
        uint32_t core = b->tasks[x->task].core;
        x->slot = seq[core]++ % 2;
        x->prev2 = last[core] >= 0 ? before[core] : -1;
        before[core] = last[core];
        last[core] = (int32_t)rt;
    }
    return SPY_OK;
}

/* ---- tiles in pieces ----------------------------------------------------------------------------
 * A tile's program reads the one accumulator that the core's next tile then overwrites, so
 * the arrays waited for the whole program between tiles; and a core's last tile is stored
 * when its arrays have nothing left to do, every core at once: the job ended a whole
 * tile's stores after the last matmul. Cut in pieces of rows, a tile's last matmul, its
 * program and its stores go piece by piece: a piece's program and stores run while the
 * arrays compute the next pieces, and the next tile waits for the last piece's program
 * only. A core's last tile goes deeper: each piece walks its last `last_depth` K chunks in
 * turn, so that its first rows are done, and stored, that many chunks before the end (the
 * record asks for as many chunks as the stores of the last tiles take; the operand buffers
 * hold them all, as no later load waits for them). Each row still adds its chunks in order:
 * the sums are the same. Rows, not columns: a piece is then one range of each scratchpad
 * tile, apart from the others'. Not with split-K (the partial sums are added whole), nor for
 * a tile of few rows (pieces_of). */
#define MM_MAX_STRIP 65536   /* rows of a strip of the per-tile program, at most */
#define MM_PIECES 4          /* pieces of a tile, at most */
#define MM_PIECE_MIN_ROWS 16 /* rows of a piece, at least */
#define MM_PIECE_ALIGN 8     /* rows the arrays fill at a time (pt_gran_m) */

/* The rows of each piece but the last of a tile of `rows` (rows itself: whole), and the
 * pieces: each but the last a whole number of the arrays' row fills. */
static uint32_t piece_width(uint32_t rows)
{
    if (rows < 2 * MM_PIECE_MIN_ROWS)
        return rows;
    uint32_t n = rows / MM_PIECE_MIN_ROWS < MM_PIECES ? rows / MM_PIECE_MIN_ROWS : MM_PIECES;
    return ((rows + n - 1) / n + MM_PIECE_ALIGN - 1) / MM_PIECE_ALIGN * MM_PIECE_ALIGN;
}

static uint32_t pieces_of(uint32_t rows)
{
    uint32_t w = piece_width(rows);
    return w ? (rows + w - 1) / w : 1;
}

static void plan_pieces(mm_build *b)
{
    b->nextra = b->nextra_mm = 0;
    for (uint64_t rt = 0; rt < b->nroots; rt++) {
        mm_root *x = &b->roots[rt];
        const mm_task *t = &b->tasks[x->task];
        x->pieces = 1, x->width = t->rows, x->extra = 0, x->depth = 1, x->extra_mm = 0;
        if (b->npairs || !t->nuses || pieces_of(t->rows) < 2)
            continue;
        x->pieces = pieces_of(t->rows);
        x->width = piece_width(t->rows);
        x->extra = (uint32_t)b->nextra;
        b->nextra += x->pieces - 1;
        uint32_t depth = t->next < 0 && b->r->last_depth > 1 ? b->r->last_depth : 1;
        x->depth = depth < t->nuses ? depth : t->nuses;
        x->extra_mm = (uint32_t)b->nextra_mm;
        b->nextra_mm += (uint64_t)(x->pieces - 1) * x->depth;
    }
}

/* Piece p of a root: its first row in the tile and its rows. */
static uint32_t piece_row(const mm_root *x, uint32_t p) { return p * x->width; }

static uint32_t piece_rows(const mm_build *b, const mm_root *x, uint32_t p)
{
    uint32_t rows = b->tasks[x->task].rows, r0 = piece_row(x, p);
    return rows - r0 < x->width ? rows - r0 : x->width;
}

/* The last matmul that reads the operand buffers of use u: its last piece's, if the pieces
 * walk it. */
static uint32_t use_last_mm(const mm_build *b, uint64_t u)
{
    const mm_use *y = &b->uses[u];
    const mm_task *t = &b->tasks[y->task];
    const mm_root *x = t->root >= 0 ? &b->roots[t->root] : NULL;
    if (!x || x->pieces < 2 || y->step + x->depth < t->nuses)
        return b->mm0 + (uint32_t)u;
    uint32_t d = y->step + x->depth - t->nuses;
    return b->pmm0 + x->extra_mm + (x->pieces - 2) * x->depth + d;
}

/* A root's last program: its last piece's. */
static uint32_t root_last_sfu(const mm_build *b, uint64_t rt)
{
    const mm_root *x = &b->roots[rt];
    return x->pieces > 1 ? b->psfu0 + x->extra + x->pieces - 2 : b->sfu0 + (uint32_t)rt;
}

/* ---- the commands ------------------------------------------------------------------------------ */

/* Whether an operand of a program run strip by strip (an A prologue's, a tile's in strips
 * or pieces) moves down with the strip: its tiles and values per row, but for those marked
 * SPY_OPND_FIXED (the temporaries, which hold one strip); not values per column. */
static bool moves(const spy_operand *o)
{
    return (o->kind == SPY_OPND_TILE || o->kind == SPY_OPND_ROW) && !(o->reserved & SPY_OPND_FIXED);
}

/* `o` in the strip (or piece) that starts `r0` rows down, its mark cleared (the card's
 * programs carry none). */
static void shift_rows(spy_operand *o, uint32_t r0)
{
    if (moves(o))
        o->v.off += (uint64_t)r0 * o->pitch * spy_dtype_size(o->dtype);
    o->reserved = 0;
}

/* The instructions of an A prologue for chunks of `rows` x `depth` in operand buffer `slot`,
 * strip by strip: made once per distinct (slot, rows, depth), of at most `most`. NULL when
 * host memory ran out (the encode says so). */
typedef struct pro_variant {
    uint32_t slot, rows, depth, begin, count;
} pro_variant;

static const pro_variant *pro_instrs(mm_build *b, pro_variant *seen, uint32_t *nseen, uint64_t most, uint32_t slot,
                                     uint32_t rows, uint32_t depth)
{
    const spy_matmul_record *r = b->r;
    for (uint32_t i = 0; i < *nseen; i++)
        if (seen[i].slot == slot && seen[i].rows == rows && seen[i].depth == depth)
            return &seen[i];
    if (*nseen >= most)
        return NULL;
    uint32_t strip = r->pro_strip < rows ? r->pro_strip : rows, strips = (rows + strip - 1) / strip;
    uint64_t begin;
    spy_instr *ins = spy_graph_instrs(&b->g, (uint64_t)strips * r->npro_instrs, &begin);
    if (!ins)
        return NULL;
    for (uint32_t s = 0; s < strips; s++)
        for (uint32_t k = 0; k < r->npro_instrs; k++) {
            spy_instr *in = &ins[(uint64_t)s * r->npro_instrs + k];
            *in = r->pro_program[(uint64_t)slot * r->npro_instrs + k];
            in->rows = rows - s * strip < strip ? rows - s * strip : strip, in->cols = depth;
            shift_rows(&in->dst, s * strip);
            for (int a = 0; a < 3; a++)
                shift_rows(&in->src[a], s * strip);
        }
    seen[*nseen] = (pro_variant){slot, rows, depth, (uint32_t)begin, strips * r->npro_instrs};
    return &seen[(*nseen)++];
}

/* An A prologue: for each A chunk, on the core that loads it, the loads of its vectors (in
 * the chunk's buffer's regions) and one SFU command running the program over the chunk in
 * place once the chunk and its vectors landed. The writes into a buffer's regions wait for
 * the buffer's previous use as the chunk's load does (buffer_reuse). */
static spy_status prologue(mm_build *b)
{
    const spy_matmul_record *r = b->r;
    uint64_t nc = b->nchunks[0];
    spy_status status = SPY_OK;
    for (uint32_t v = 0; v < r->npro_vectors && status == SPY_OK; v++) {
        const spy_mm_vector *pv = &r->pro_vectors[v];
        uint64_t st[2] = {0, pv->per_row ? pv->view.strides[1] : pv->view.strides[2]};
        mm_stream s;
        uint64_t pitch = (uint64_t)pv->itemsize * (pv->per_row ? b->tm : b->depth); /* one row */
        stream_init(b, &s, &pv->view, st, pitch, pv->itemsize, true);
        for (uint64_t c = 0; c < nc && status == SPY_OK; c++) {
            uint32_t u = b->loader[0][c];
            const mm_use *y = &b->uses[u];
            const mm_task *x = &b->tasks[y->task];
            uint64_t base = pv->view.offset + x->batch * pv->view.strides[0], n;
            if (pv->per_row)
                base += x->row0 * pv->view.strides[1], n = x->rows;
            else
                base += b->k_start[y->chunk] * pv->view.strides[2], n = b->k_size[y->chunk];
            status = dma_box(b, &s, base, 1, n, pv->lx[y->slot], x->core, use_key(b, u, PH_LOAD),
                             &b->pro_vec[v * nc + c]);
        }
        if (status == SPY_OK)
            status = stream_end(b, &s);
        spy_vec_free(&s.pending);
    }
    if (status != SPY_OK)
        return status;
    /* distinct (buffer, rows, depth): rows of each M tile size, depths of each chunk size */
    uint64_t most = (uint64_t)r->nbuf * b->ndm * (b->nk < 64 ? b->nk : 64);
    pro_variant *seen = mm_alloc(b, most ? most : 1, sizeof *seen);
    if (!seen)
        return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for a matmul's prologue");
    uint32_t nseen = 0, first;
    spy_cmd *c = add_cmds(b, nc, 0, SPY_OP_SFU, &first);
    for (uint64_t k = 0; k < nc; k++) {
        uint32_t u = b->loader[0][k];
        const mm_use *y = &b->uses[u];
        const mm_task *x = &b->tasks[y->task];
        b->pro_ready[k] = (run){first + (uint32_t)k, 1};
        if (!c)
            continue;
        const pro_variant *pv = pro_instrs(b, seen, &nseen, most, y->slot, x->rows, b->k_size[y->chunk]);
        if (!pv) {
            b->g.instrs.failed = true; /* reported by the encode */
            continue;
        }
        c[k].core = (uint16_t)x->core;
        c[k].u.sfu.ninstrs = pv->count;
        c[k].u.sfu.instr_begin = pv->begin;
        keys_at(b, first)[k] = use_key(b, u, PH_LOAD);
        depend_runs(b, b->pro_ready[k], b->loaded[0][k]);
        for (uint32_t v = 0; v < r->npro_vectors; v++)
            depend_runs(b, b->pro_ready[k], b->pro_vec[v * nc + k]);
    }
    return SPY_OK;
}

/* The part of a grouped matmul whose columns hold column `col` (0 when B is whole). */
static uint32_t part_of(const spy_matmul_record *r, uint64_t col)
{
    uint32_t p = 0;
    while (p + 1 < r->nparts && r->parts[p + 1].n0 <= col)
        p++;
    return p;
}

/* One operand (0: A, 1: B): a load per shared chunk, a ring send per other use of it. A
 * grouped matmul's B is loaded part by part, each part's view a stream of its own. */
static spy_status operand(mm_build *b, int op)
{
    const spy_matmul_record *r = b->r;
    bool trans = r->flags & (op ? SPY_MM_TRANS_B : SPY_MM_TRANS_A);
    const uint64_t *region = op ? r->b_lx : r->a_lx;
    uint32_t pitch = op ? r->b_pitch : r->a_pitch;
    uint32_t nstreams = op && r->nparts ? r->nparts : 1;
    uint64_t nc = b->nchunks[op];
    run *loaded = b->loaded[op], *arrival = b->arrival[op], *sends = b->sends[op];
    spy_status status = SPY_OK;
    for (uint32_t part = 0; part < nstreams && status == SPY_OK; part++) {
        const spy_mm_view *v = op ? (r->nparts ? &r->parts[part].b : &r->b) : &r->a;
        uint64_t n0 = op && r->nparts ? r->parts[part].n0 : 0;
        uint64_t st[2] = {trans ? v->strides[2] : v->strides[1], trans ? v->strides[1] : v->strides[2]};
        mm_stream s;
        stream_init(b, &s, v, st, (uint64_t)pitch * b->e_in, b->e_in, true);
        for (uint64_t c = 0; c < nc && status == SPY_OK; c++) {
            uint32_t u = b->loader[op][c];
            const mm_use *y = &b->uses[u];
            const mm_task *x = &b->tasks[y->task];
            uint64_t k0 = b->k_start[y->chunk], depth = b->k_size[y->chunk], base, box0, box1;
            if (op == 0) {
                base = v->offset + x->batch * v->strides[0] + x->row0 * v->strides[1] + k0 * v->strides[2];
                box0 = trans ? depth : x->rows, box1 = trans ? x->rows : depth;
            } else {
                if (nstreams > 1 && part_of(r, x->col0) != part)
                    continue;
                base = v->offset + x->batch * v->strides[0] + k0 * v->strides[1] + (x->col0 - n0) * v->strides[2];
                box0 = trans ? x->cols : depth, box1 = trans ? depth : x->cols;
            }
            status = dma_box(b, &s, base, box0, box1, region[y->slot], x->core, use_key(b, u, PH_LOAD), &loaded[c]);
        }
        if (status == SPY_OK)
            status = stream_end(b, &s);
        spy_vec_free(&s.pending);
    }
    if (status == SPY_OK && op == 0 && r->npro_instrs)
        status = prologue(b);
    if (status != SPY_OK)
        return status;
    /* what the forwards and the matmuls of a chunk wait for: its load, or its prologue */
    const run *ready = op == 0 && r->npro_instrs ? b->pro_ready : loaded;

    /* the sends, grouped by chunk so that a chunk's sends are one run */
    for (uint64_t c = 0; c < nc; c++)
        sends[c] = (run){0, 0};
    uint64_t nsend = 0;
    for (uint64_t u = 0; u < b->nuses; u++)
        if (!b->uses[u].loads[op]) {
            sends[b->uses[u].shared[op]].count++;
            nsend++;
        }
    uint32_t first = 0;
    spy_cmd *c = add_cmds(b, nsend, 0, SPY_OP_RING, &first);
    uint64_t at = first;
    for (uint64_t k = 0; k < nc; k++) {
        sends[k].first = (uint32_t)at;
        at += sends[k].count;
        sends[k].count = 0; /* counted again while filled */
    }
    for (uint64_t u = 0; u < b->nuses; u++) {
        const mm_use *y = &b->uses[u];
        if (y->loads[op]) {
            arrival[u] = ready[y->shared[op]];
            continue;
        }
        run *sr = &sends[y->shared[op]];
        uint32_t i = sr->first + sr->count++;
        arrival[u] = (run){i, 1};
        if (!c)
            continue;
        const mm_use *src = &b->uses[b->loader[op][y->shared[op]]];
        const mm_task *from = &b->tasks[src->task];
        spy_cmd *x = &c[i - first];
        x->core = (uint16_t)from->core;
        x->u.ring.dst_core = b->tasks[y->task].core;
        x->u.ring.src_off = x->u.ring.dst_off = (uint32_t)region[y->slot];
        uint64_t depth = b->k_size[src->chunk];
        uint64_t rows = op == 0 ? (trans ? depth : from->rows) : (trans ? from->cols : depth);
        x->u.ring.bytes = (uint32_t)(rows * pitch * b->e_in);
        keys_at(b, i)[0] = use_key(b, u, PH_SEND);
    }
    for (uint64_t k = 0; k < nc; k++) /* a chunk is forwarded once it landed (and was rewritten) */
        for (uint32_t i = 0; i < sends[k].count; i++)
            depend_runs(b, (run){sends[k].first + i, 1}, ready[k]);
    return SPY_OK;
}

static void matmuls(mm_build *b)
{
    const spy_matmul_record *r = b->r;
    spy_cmd *c = add_cmds(b, b->nuses, 0, SPY_OP_MATMUL, &b->mm0);
    if (!c)
        return;
    int64_t *keys = keys_at(b, b->mm0);
    uint8_t trans = (uint8_t)(r->flags & (SPY_MM_TRANS_A | SPY_MM_TRANS_B));
    for (uint64_t u = 0; u < b->nuses; u++) {
        const mm_use *y = &b->uses[u];
        const mm_task *x = &b->tasks[y->task];
        spy_matmul *mm = &c[u].u.mm;
        c[u].core = (uint16_t)x->core;
        c[u].flags = (uint8_t)((y->step > 0 ? SPY_MM_ACCUMULATE : 0) | trans);
        mm->a_off = (uint32_t)r->a_lx[y->slot];
        mm->b_off = (uint32_t)r->b_lx[y->slot];
        mm->c_off = (uint32_t)r->acc_lx;
        /* a root's last matmuls: its first piece (all of it when it is whole) */
        bool last = x->root >= 0 && y->step + b->roots[x->root].depth >= x->nuses;
        mm->m = last ? b->roots[x->root].width : x->rows, mm->n = x->cols, mm->k = b->k_size[y->chunk];
        mm->lda = r->a_pitch, mm->ldb = r->b_pitch, mm->ldc = r->c_pitch;
        mm->a_dtype = mm->b_dtype = r->in_dtype;
        keys[u] = use_key(b, u, PH_MATMUL);
    }
}

/* A write into an operand buffer waits for the previous use of that buffer on its core: its
 * matmul, and the forwards of its chunk if the core loaded it. */
static void buffer_reuse(mm_build *b, int op)
{
    run *arrival = b->arrival[op];
    bool pro = op == 0 && b->r->npro_instrs;
    uint64_t nc = b->nchunks[op];
    for (uint64_t u = 0; u < b->nuses; u++)
        depend_runs(b, (run){b->mm0 + (uint32_t)u, 1}, arrival[u]); /* a matmul waits for its chunks */
    for (uint64_t u = 0; u < b->nuses; u++) {
        const mm_use *y = &b->uses[u];
        if (y->prev < 0)
            continue;
        run before = {use_last_mm(b, (uint64_t)y->prev), 1};
        depend_runs(b, arrival[u], before);
        if (pro && y->loads[0]) { /* what writes the buffer's regions before the prologue */
            depend_runs(b, b->loaded[0][y->shared[0]], before);
            for (uint32_t v = 0; v < b->r->npro_vectors; v++)
                depend_runs(b, b->pro_vec[v * nc + y->shared[0]], before);
        }
    }
    for (uint64_t u = 0; u < b->nuses; u++) {
        int32_t prev = b->uses[u].prev;
        if (prev < 0 || !b->uses[prev].loads[op])
            continue;
        run fw = b->sends[op][b->uses[prev].shared[op]];
        if (!fw.count)
            continue;
        depend_runs(b, arrival[u], fw);
        if (pro && b->uses[u].loads[0])
            depend_runs(b, b->loaded[0][b->uses[u].shared[0]], fw);
    }
}

/* At the start, when every buffer is free, a load for step c waits until its core has the
 * chunks of step c - 1: the first step's chunks get the DRAM to themselves. */
static void in_step_order(mm_build *b, int op)
{
    for (int which = 0; which < 2; which++)
        for (uint64_t c = 0; c < b->nchunks[op]; c++) {
            uint32_t u = b->loader[op][c];
            if (b->uses[u].step > 0 && b->uses[u].prev < 0)
                depend_runs(b, b->loaded[op][c], b->arrival[which][u - 1]);
        }
}

static int64_t last_mm(const mm_build *b, uint32_t task)
{
    const mm_task *x = &b->tasks[task];
    return x->nuses ? (int64_t)x->first_use + x->nuses - 1 : -1;
}

/* The pieces after the first of a root's last matmuls: the same matmuls on later rows of A
 * and of the accumulator, piece by piece, each after the one before. */
static void piece_matmuls(mm_build *b)
{
    if (!b->nextra_mm)
        return;
    spy_cmd *c = add_cmds(b, b->nextra_mm, 0, SPY_OP_MATMUL, &b->pmm0);
    if (!c)
        return;
    const spy_cmd *cmds = (const spy_cmd *)b->g.cmds.data;
    uint32_t isz = spy_dtype_size(b->r->in_dtype);
    for (uint64_t rt = 0; rt < b->nroots; rt++) {
        const mm_root *x = &b->roots[rt];
        if (x->pieces < 2)
            continue;
        uint32_t last = b->mm0 + (uint32_t)last_mm(b, x->task), first = last + 1 - x->depth;
        int64_t key = keys_at(b, last)[0]; /* after the first piece, in the order made */
        for (uint32_t p = 1; p < x->pieces; p++)
            for (uint32_t d = 0; d < x->depth; d++) {
                uint32_t e = x->extra_mm + (p - 1) * x->depth + d, r0 = piece_row(x, p);
                c[e] = cmds[first + d];
                spy_matmul *mm = &c[e].u.mm;
                mm->m = piece_rows(b, x, p);
                mm->a_off += (b->r->flags & SPY_MM_TRANS_A ? r0 : r0 * mm->lda) * isz;
                mm->c_off += r0 * mm->ldc * 4;
                keys_at(b, b->pmm0)[e] = key;
                depend(b, b->pmm0 + e, e == x->extra_mm ? last : b->pmm0 + e - 1);
            }
    }
}

static spy_operand tile_operand(uint8_t dtype, uint32_t pitch, uint64_t off)
{
    return (spy_operand){SPY_OPND_TILE, dtype, 0, pitch, {.off = off}};
}

/* Split-K: a send of each partial sum into the receiver's receive buffer, and its add
 * (one SFU program acc += recv per tile shape, in the order of the shapes). */
static void reduction(mm_build *b)
{
    const spy_matmul_record *r = b->r;
    if (!b->npairs)
        return;
    spy_cmd *c = add_cmds(b, b->npairs, 0, SPY_OP_RING, &b->rsend0);
    for (uint64_t p = 0; c && p < b->npairs; p++) {
        const mm_pair *pr = &b->pairs[p];
        c[p].core = (uint16_t)b->tasks[pr->snd].core;
        c[p].u.ring.dst_core = b->tasks[pr->rcv].core;
        c[p].u.ring.src_off = (uint32_t)r->acc_lx;
        c[p].u.ring.dst_off = (uint32_t)r->recv_lx;
        c[p].u.ring.bytes = b->tasks[pr->snd].rows * r->c_pitch * 4;
        keys_at(b, b->rsend0)[p] = end_key(b, pr->rcv, PH_REDUCE_SEND);
    }
    /* the programs: the shapes of the receivers' tiles, in order */
    uint64_t nshape = (uint64_t)b->ndm * b->ndn;
    uint32_t *index = mm_alloc(b, nshape, sizeof(uint32_t));
    if (!index) {
        b->g.instrs.failed = true; /* reported by the encode */
        return;
    }
    for (uint64_t p = 0; p < b->npairs; p++) {
        const mm_task *x = &b->tasks[b->pairs[p].rcv];
        index[(uint64_t)x->rank_m * b->ndn + x->rank_n] = 1;
    }
    uint64_t n = 0, begin;
    for (uint64_t i = 0; i < nshape; i++)
        if (index[i])
            n++;
    spy_instr *ins = spy_graph_instrs(&b->g, n, &begin);
    spy_operand acc = tile_operand(SPY_DT_F32, r->c_pitch, r->acc_lx), recv = tile_operand(SPY_DT_F32, r->c_pitch,
                                                                                            r->recv_lx);
    n = 0;
    for (uint64_t i = 0; i < nshape; i++) {
        if (!index[i])
            continue;
        if (ins)
            ins[n] = (spy_instr){SPY_SFU_ADD, 0, 0, 0, 0, 0, acc, {acc, recv, {0}}};
        index[i] = (uint32_t)(begin + n++);
    }
    /* the instruction's tile shape: that of any receiver with the shape */
    for (uint64_t p = 0; ins && p < b->npairs; p++) {
        const mm_task *x = &b->tasks[b->pairs[p].rcv];
        spy_instr *in = &ins[index[(uint64_t)x->rank_m * b->ndn + x->rank_n] - begin];
        in->rows = x->rows, in->cols = x->cols;
    }
    c = add_cmds(b, b->npairs, 0, SPY_OP_SFU, &b->radd0);
    for (uint64_t p = 0; c && p < b->npairs; p++) {
        const mm_task *x = &b->tasks[b->pairs[p].rcv];
        c[p].core = (uint16_t)x->core;
        c[p].u.sfu.ninstrs = 1;
        c[p].u.sfu.instr_begin = index[(uint64_t)x->rank_m * b->ndn + x->rank_n];
        keys_at(b, b->radd0)[p] = end_key(b, b->pairs[p].rcv, PH_REDUCE_ADD);
    }
    for (uint64_t p = 0; p < b->npairs; p++) /* the sender's sum is complete */
        depend(b, b->rsend0 + p, b->mm0 + last_mm(b, b->pairs[p].snd));
    for (uint64_t p = 0; p < b->npairs; p++) { /* and has every add it receives */
        int32_t own = b->tasks[b->pairs[p].snd].last_add;
        if (own >= 0)
            depend(b, b->rsend0 + p, b->radd0 + own);
    }
    for (uint64_t p = 0; p < b->npairs; p++) /* the receive buffer is free */
        if (b->pairs[p].prev_add >= 0)
            depend(b, b->rsend0 + p, b->radd0 + b->pairs[p].prev_add);
    for (uint64_t p = 0; p < b->npairs; p++)
        depend(b, b->radd0 + p, b->rsend0 + p);
    for (uint64_t p = 0; p < b->npairs; p++)
        depend(b, b->radd0 + p, b->mm0 + last_mm(b, b->pairs[p].rcv));
}

/* The strips of `rows` rows of a tile's program (one when it is not in strips). */
static uint32_t strips_of(const spy_matmul_record *r, uint32_t rows)
{
    return r->epi_strip && rows > r->epi_strip ? (rows + r->epi_strip - 1) / r->epi_strip : 1;
}

/* A root's instructions before its piece p (each piece's program strip by strip). */
static uint64_t piece_first(const mm_build *b, const mm_root *x, uint32_t p)
{
    uint64_t at = 0;
    for (uint32_t q = 0; q < p; q++)
        at += (uint64_t)strips_of(b->r, piece_rows(b, x, q)) * b->r->ninstrs;
    return at;
}

/* The per-tile programs: one for each (whole or in pieces, staging slot, rows, cols) of the
 * roots, in that order; each root's first instruction. A root in pieces has the program once
 * per piece, on the piece's rows (its tile and row operands moved down by the piece's first
 * row): piece p's starts piece_first(p) after the root's first. With epi_strip, each piece's
 * (or whole tile's) program is there once per strip of its rows, moved down the same way,
 * but for the operands that hold one strip (SPY_OPND_FIXED). */
static void programs(mm_build *b)
{
    const spy_matmul_record *r = b->r;
    uint64_t nshape = 4 * (uint64_t)b->ndm * b->ndn, n = r->ninstrs;
    uint64_t *at = mm_alloc(b, nshape, sizeof(uint64_t));
    if (!at) {
        b->g.instrs.failed = true;
        return;
    }
#define ROOT_SHAPE(x) \
    ((((uint64_t)((x)->pieces > 1) * 2 + (x)->slot) * b->ndm + b->tasks[(x)->task].rank_m) * b->ndn + \
     b->tasks[(x)->task].rank_n)
    /* a root's pieces follow from its rows: alike for every root of its shape */
    for (uint64_t rt = 0; rt < b->nroots; rt++)
        at[ROOT_SHAPE(&b->roots[rt])] = piece_first(b, &b->roots[rt], b->roots[rt].pieces);
    uint64_t total = 0, begin;
    for (uint64_t i = 0; i < nshape; i++) { /* each shape's instructions -> its first */
        uint64_t len = at[i];
        at[i] = total;
        total += len;
    }
    spy_instr *ins = spy_graph_instrs(&b->g, total, &begin);
    for (uint64_t rt = 0; rt < b->nroots; rt++) {
        mm_root *x = &b->roots[rt];
        uint64_t first = at[ROOT_SHAPE(x)];
        x->program = (uint32_t)(begin + first);
        if (!ins || ins[first].rows) /* written already (a tile has rows) */
            continue;
        spy_instr *in = &ins[first];
        for (uint32_t p = 0; p < x->pieces; p++) {
            uint32_t rows = piece_rows(b, x, p), nstrip = strips_of(r, rows), w = nstrip > 1 ? r->epi_strip : rows;
            for (uint32_t j = 0; j < nstrip; j++)
                for (uint64_t k = 0; k < n; k++, in++) {
                    uint32_t r0 = piece_row(x, p) + j * w;
                    *in = r->program[k].ins;
                    in->rows = rows - j * w < w ? rows - j * w : w;
                    if (!in->cols) /* else a column slice of the tile, its operands at the slice */
                        in->cols = b->tasks[x->task].cols;
                    if (x->slot) {
                        in->dst.v.off = r->program[k].v1[0];
                        for (int a = 0; a < 3; a++)
                            in->src[a].v.off = r->program[k].v1[1 + a];
                    }
                    shift_rows(&in->dst, r0);
                    for (int a = 0; a < 3; a++)
                        shift_rows(&in->src[a], r0);
                }
        }
    }
#undef ROOT_SHAPE
}

/* Where each root's epilogue loads go in program order: during its wave, so that they
 * arrive while the arrays still work on it (placed at the wave's end, the SFU waited for
 * them, every core loading at once), and spread over the wave's steps as the stores are,
 * half a wave apart from them, so that the cores do not all load at once; never before the
 * program of the root two before (the last reader of the same landing tiles), so that the
 * core's DMA queue does not wait on it. Roots of a wave are consecutive. */
static void epilogue_load_keys(const mm_build *b, int64_t *keys)
{
    int64_t steps = b->steps ? b->steps : 1;
    for (uint64_t first = 0, end; first < b->nroots; first = end) {
        uint32_t wave = b->tasks[b->roots[first].task].wave;
        for (end = first; end < b->nroots && b->tasks[b->roots[end].task].wave == wave; end++)
            ;
        uint64_t n = end - first;
        for (uint64_t rt = first; rt < end; rt++) {
            int64_t step = (int64_t)(((rt - first) + n / 2) % n * (uint64_t)steps / n);
            int64_t key = ((int64_t)wave * steps + step) * 8 + PH_BIAS;
            int32_t prev2 = b->roots[rt].prev2;
            int64_t after = prev2 >= 0 ? end_key(b, b->roots[prev2].task, PH_EPILOGUE) + 1 : key;
            keys[rt] = key > after ? key : after;
        }
    }
}

/* The epilogue's tiles (loads and stores) of each root: one stream each. A root in pieces
 * stores its first piece's rows in `out` and each later piece's in `pieces_out`. */
static spy_status epilogue_tiles(mm_build *b, const spy_mm_tiles *tl, const int64_t *load_keys, run *out,
                                 run *pieces_out)
{
    /* a tile's values per row land as one row of them: its rows are the box's columns */
    bool per_row = tl->row == SPY_MM_TILES_PER_ROW, periodic = tl->row >= SPY_MM_TILES_PERIODIC;
    bool one_row = tl->row && tl->row != SPY_MM_TILES_PERIODIC_ROWS;
    uint64_t st[2] = {tl->view.strides[per_row ? 2 : 1], tl->view.strides[per_row ? 1 : 2]};
    mm_stream s;
    stream_init(b, &s, &tl->view, st, (uint64_t)tl->pitch * tl->itemsize, tl->itemsize, load_keys != NULL);
    spy_status status = SPY_OK;
    const spy_mm_view *v = &tl->view;
    uint64_t n0 = tl->part ? b->r->parts[tl->part - 1].n0 : 0;
    for (uint64_t rt = 0; rt < b->nroots && status == SPY_OK; rt++) {
        const mm_root *x = &b->roots[rt];
        const mm_task *t = &b->tasks[x->task];
        if (tl->part && part_of(b->r, t->col0) != tl->part - 1)
            continue; /* another part's tile: its runs stay empty */
        for (uint32_t p = 0; p < (load_keys ? 1 : x->pieces) && status == SPY_OK; p++) {
            uint32_t r0 = piece_row(x, p), rows = one_row ? 1 : load_keys ? t->rows : piece_rows(b, x, p);
            uint64_t cols = per_row ? t->rows : periodic ? tl->pitch : t->cols;
            uint64_t base = v->offset + t->batch * v->strides[0] + (uint64_t)(t->row0 + r0) * v->strides[1] +
                            (periodic ? 0 : (t->col0 - n0) * v->strides[2]);
            status = dma_box(b, &s, base, rows, cols, tl->lx[x->slot] + (uint64_t)r0 * tl->pitch * tl->itemsize,
                             t->core, load_keys ? load_keys[rt] : end_key(b, x->task, PH_STORE),
                             p ? &pieces_out[x->extra + p - 1] : &out[rt]);
        }
    }
    if (status == SPY_OK)
        status = stream_end(b, &s);
    spy_vec_free(&s.pending);
    return status;
}

/* Command `after` waits for every store of root rt's tile (each piece's). */
static void after_stores(mm_build *b, uint32_t after, const run *st, const run *pst, uint64_t rt)
{
    depend_runs(b, (run){after, 1}, st[rt]);
    for (uint32_t p = 1; p < b->roots[rt].pieces; p++)
        depend_runs(b, (run){after, 1}, pst[b->roots[rt].extra + p - 1]);
}

/* The matmuls of a task over which the stores of its core's previous tile are spread: all
 * of them; for a last tile in pieces, those before its pieces' walk less as many again,
 * so that they are out of the way when its own stores begin. */
static uint64_t paced_uses(const mm_build *b, const mm_task *x)
{
    const mm_root *rt = x->root >= 0 ? &b->roots[x->root] : NULL;
    if (!rt || rt->pieces < 2 || x->nuses <= 2 * rt->depth)
        return x->nuses;
    return x->nuses - 2 * rt->depth;
}

/* Per root: its loads, its program (after the tile's last matmul and adds), its stores; the
 * staging tiles of a slot are written again only once the root two before read them. The
 * store of the r-th of a wave's R roots waits for matmul r * steps / R of its core's next
 * task (paced_uses'): spread over the next wave, stores take the DRAM the loads leave. */
static spy_status epilogue(mm_build *b)
{
    const spy_matmul_record *r = b->r;
    uint64_t R = b->nroots;
    programs(b);
    spy_cmd *c = add_cmds(b, R, 0, SPY_OP_SFU, &b->sfu0);
    for (uint64_t rt = 0; c && rt < R; rt++) {
        const mm_root *x = &b->roots[rt];
        c[rt].core = (uint16_t)b->tasks[x->task].core;
        c[rt].u.sfu.ninstrs = (uint32_t)piece_first(b, x, 1);
        c[rt].u.sfu.instr_begin = x->program;
        keys_at(b, b->sfu0)[rt] = end_key(b, x->task, PH_EPILOGUE);
    }
    if (b->nuses)
        for (uint64_t rt = 0; rt < R; rt++) {
            int64_t lm = last_mm(b, b->roots[rt].task);
            if (lm >= 0)
                depend(b, b->sfu0 + rt, b->mm0 + lm);
        }
    if (b->npairs)
        for (uint64_t rt = 0; rt < R; rt++) {
            int32_t a = b->tasks[b->roots[rt].task].last_add;
            if (a >= 0)
                depend(b, b->sfu0 + rt, b->radd0 + a);
        }
    /* a root in pieces: each later piece's program after its matmul */
    c = b->nextra ? add_cmds(b, b->nextra, 0, SPY_OP_SFU, &b->psfu0) : NULL;
    for (uint64_t rt = 0; c && rt < R; rt++) {
        const mm_root *x = &b->roots[rt];
        for (uint32_t p = 1; p < x->pieces; p++) {
            uint32_t e = x->extra + p - 1;
            c[e].core = (uint16_t)b->tasks[x->task].core;
            c[e].u.sfu.ninstrs = strips_of(r, piece_rows(b, x, p)) * r->ninstrs;
            c[e].u.sfu.instr_begin = x->program + (uint32_t)piece_first(b, x, p);
            keys_at(b, b->psfu0)[e] = end_key(b, x->task, PH_EPILOGUE);
            depend(b, b->psfu0 + e, b->pmm0 + x->extra_mm + p * x->depth - 1); /* its last matmul */
        }
    }
    spy_status s = SPY_OK;
    int64_t *load_keys = r->nloads ? mm_alloc(b, R, sizeof(int64_t)) : NULL;
    if (r->nloads && !load_keys)
        return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for a matmul's %llu epilogue tiles",
                        (unsigned long long)R);
    if (load_keys)
        epilogue_load_keys(b, load_keys);
    for (uint32_t i = 0; i < r->nloads && s == SPY_OK; i++)
        s = epilogue_tiles(b, &r->loads[i], load_keys, b->ld + i * R, NULL);
    if (s != SPY_OK)
        return s;
    for (uint32_t i = 0; i < r->nloads; i++) {
        const run *ld = b->ld + i * R;
        for (uint64_t rt = 0; rt < R; rt++)
            depend_runs(b, (run){b->sfu0 + (uint32_t)rt, 1}, ld[rt]);
        for (uint64_t rt = 0; rt < R; rt++)
            for (uint32_t p = 1; p < b->roots[rt].pieces; p++)
                depend_runs(b, (run){b->psfu0 + b->roots[rt].extra + p - 1, 1}, ld[rt]);
        for (uint64_t rt = 0; rt < R; rt++) /* its tile was read */
            if (b->roots[rt].prev2 >= 0)
                depend_runs(b, ld[rt], (run){root_last_sfu(b, (uint64_t)b->roots[rt].prev2), 1});
    }
    /* per root, the wave's pacing of its stores */
    uint64_t wave_first = 0;
    for (uint32_t o = 0; o < r->nstores; o++) {
        run *st = b->st + o * R, *pst = b->pst ? b->pst + o * b->nextra : NULL;
        s = epilogue_tiles(b, &r->stores[o], NULL, st, pst);
        if (s != SPY_OK)
            return s;
        for (uint64_t rt = 0; rt < R; rt++)
            depend_runs(b, st[rt], (run){b->sfu0 + (uint32_t)rt, 1});
        for (uint64_t rt = 0; rt < R; rt++) /* the staging tile is free: every piece stored */
            if (b->roots[rt].prev2 >= 0)
                after_stores(b, b->sfu0 + (uint32_t)rt, st, pst, (uint64_t)b->roots[rt].prev2);
        for (uint64_t rt = 0; pst && rt < R; rt++) /* the same for each later piece */
            for (uint32_t p = 1; p < b->roots[rt].pieces; p++) {
                uint32_t e = b->roots[rt].extra + p - 1;
                depend_runs(b, pst[e], (run){b->psfu0 + e, 1});
                if (b->roots[rt].prev2 >= 0)
                    after_stores(b, b->psfu0 + e, st, pst, (uint64_t)b->roots[rt].prev2);
            }
        if (!b->nuses)
            continue;
        wave_first = 0;
        while (wave_first < R) {
            uint32_t wave = b->tasks[b->roots[wave_first].task].wave;
            uint64_t end = wave_first;
            while (end < R && b->tasks[b->roots[end].task].wave == wave)
                end++;
            for (uint64_t rt = wave_first; rt < end; rt++) {
                int32_t nxt = b->tasks[b->roots[rt].task].next;
                if (nxt < 0 || !b->tasks[nxt].nuses)
                    continue;
                uint64_t step = (rt - wave_first) * paced_uses(b, &b->tasks[nxt]) / (end - wave_first);
                run paced = {b->mm0 + b->tasks[nxt].first_use + (uint32_t)step, 1};
                depend_runs(b, st[rt], paced);
                for (uint32_t p = 1; p < b->roots[rt].pieces; p++) /* each piece's stores alike */
                    depend_runs(b, pst[b->roots[rt].extra + p - 1], paced);
            }
            wave_first = end;
        }
    }
    return SPY_OK;
}

/* A task's first matmul overwrites the accumulator: the core's previous task must have sent
 * it (split-K) and its SFU must have read it. */
static void accumulator_reuse(mm_build *b)
{
    if (!b->nuses)
        return;
    for (int pass = 0; pass < 3; pass++) {
        if (pass < 2 && !b->npairs)
            continue;
        for (uint64_t u = 0; u < b->nuses; u++) {
            if (b->uses[u].step)
                continue;
            int32_t prev = b->tasks[b->uses[u].task].prev;
            if (prev < 0)
                continue;
            const mm_task *p = &b->tasks[prev];
            if (pass == 0 && p->sent >= 0)
                depend(b, b->mm0 + u, b->rsend0 + p->sent);
            else if (pass == 1 && p->last_add >= 0)
                depend(b, b->mm0 + u, b->radd0 + p->last_add);
            else if (pass == 2 && p->root >= 0)
                depend(b, b->mm0 + u, root_last_sfu(b, (uint64_t)p->root));
        }
    }
}

/* ---- the record, checked whole ------------------------------------------------------------ */

static bool is_pow2(uint64_t x) { return x && !(x & (x - 1)); }

/* The last element of a view over extents (batch, rows, cols), all nonzero, inside the
 * storage of its slot; BAD_ADDRESS naming `what` otherwise. */
static spy_status view_check(const spy_matmul_record *r, const spy_mm_view *v, const char *what, uint64_t rows,
                             uint64_t cols, uint32_t itemsize)
{
    if (v->slot >= r->nslots)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: %s.slot %u is not one of %u slots", what, v->slot,
                        r->nslots);
    const spy_layout *l = &r->slots[v->slot];
    if (itemsize != l->itemsize)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: %s has %u-byte elements, the layout of slot %u "
                        "%u-byte ones", what, itemsize, v->slot, l->itemsize);
    uint64_t ext[3] = {r->batch, rows, cols}, last = v->offset;
    for (int d = 0; d < 3; d++) {
        uint64_t reach;
        if (!spy_mul_ok(ext[d] - 1, v->strides[d], &reach) || !spy_add_ok(last, reach, &last))
            return spy_fail(SPY_E_BAD_ADDRESS, -1, "matmul record: %s.strides[%d] reaches past 2^64", what, d);
    }
    uint64_t storage = (l->rows ? l->rows : 1) * l->row_len; /* fits: the layout's bytes did */
    if (last >= storage)
        return spy_fail(SPY_E_BAD_ADDRESS, -1, "matmul record: %s.offset %llu and strides reach element %llu of "
                        "slot %u's %llu-element storage", what, (unsigned long long)v->offset,
                        (unsigned long long)last, v->slot, (unsigned long long)storage);
    return SPY_OK;
}

/* A region of `rows` rows of `width` elements, `pitch` apart, at `off`: inside the
 * scratchpad (whole sticks of a row may be moved). */
static spy_status region_check(const spy_matmul_record *r, const char *what, uint64_t off, uint64_t rows,
                               uint64_t width, uint64_t pitch, uint64_t e)
{
    if (pitch < width)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: %s pitch %llu is below the %llu-element rows of its "
                        "tiles", what, (unsigned long long)pitch, (unsigned long long)width);
    uint64_t sb = r->stick_bytes, row = (width * e + sb - 1) / sb * sb; /* each < 2^32 * 8 */
    if (row < pitch * e)
        row = pitch * e;
    uint64_t end = off + (rows - 1) * pitch * e + row; /* off, pitch * e < 2^35; rows < 2^32 */
    if (off >= r->scratchpad_bytes || pitch > UINT32_MAX || end > r->scratchpad_bytes)
        return spy_fail(SPY_E_SCRATCHPAD, -1, "matmul record: %s at %llu, %llu rows of pitch %llu, is outside the "
                        "%llu-byte scratchpad", what, (unsigned long long)off, (unsigned long long)rows,
                        (unsigned long long)pitch, (unsigned long long)r->scratchpad_bytes);
    return SPY_OK;
}

static spy_status operand_check(const spy_matmul_record *r, const spy_operand *o, uint64_t v1, uint32_t i,
                                const char *what, uint32_t tm, uint32_t tn)
{
    if (o->kind == SPY_OPND_NONE || o->kind == SPY_OPND_IMM)
        return SPY_OK;
    if (o->kind > SPY_OPND_IMM || o->dtype >= SPY_DT_COUNT)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: program[%u].%s kind %u or dtype %u is unknown", i,
                        what, o->kind, o->dtype);
    if (o->pitch > SPY_MM_MAX_PITCH)
        return spy_fail(SPY_E_SCRATCHPAD, -1, "matmul record: program[%u].%s pitch %u is over %u", i, what, o->pitch,
                        SPY_MM_MAX_PITCH);
    if (o->reserved & ~SPY_OPND_FIXED)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: program[%u].%s flags %u are unknown", i, what,
                        o->reserved);
    if (!moves(o) && r->epi_strip && r->epi_strip < tm)
        tm = r->epi_strip; /* it holds one strip */
    spy_operand at = *o;
    uint64_t lo, hi;
    for (int slot = 0; slot < 2; slot++) {
        at.v.off = slot ? v1 : o->v.off;
        if (at.v.off > r->scratchpad_bytes || !spy_operand_extent(&at, tm, tn, &lo, &hi) || hi > r->scratchpad_bytes)
            return spy_fail(SPY_E_SCRATCHPAD, -1, "matmul record: program[%u].%s at %llu (slot %d), pitch %u, is "
                            "outside the %llu-byte scratchpad for a %ux%u tile", i, what,
                            (unsigned long long)at.v.off, slot, o->pitch, (unsigned long long)r->scratchpad_bytes,
                            tm, tn);
    }
    return SPY_OK;
}

/* Sizes adding up to `total`, each at least 1 (n of them). */
static spy_status sizes_check(const uint32_t *size, uint32_t n, uint64_t total, const char *what)
{
    uint64_t sum = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (!size[i])
            return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: %s[%u] is 0", what, i);
        sum += size[i]; /* n < 2^32 sizes < 2^32: no overflow */
    }
    if (sum != total)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: %s adds up to %llu, not %llu", what,
                        (unsigned long long)sum, (unsigned long long)total);
    return SPY_OK;
}

/* Columns of part p of a grouped matmul. */
static uint64_t part_cols(const spy_matmul_record *r, uint32_t p)
{
    return (p + 1 < r->nparts ? r->parts[p + 1].n0 : r->n) - r->parts[p].n0;
}

/* A grouped matmul's parts: from column 0, increasing, each N tile inside one. */
static spy_status parts_check(const spy_matmul_record *r)
{
    if (!r->nparts)
        return SPY_OK;
    if (r->nparts > SPY_MM_MAX_PARTS || !r->parts || r->parts[0].n0 != 0)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: %u parts (at most %u, with their array, the first "
                        "from column 0)", r->nparts, SPY_MM_MAX_PARTS);
    for (uint32_t p = 1; p < r->nparts; p++)
        if (r->parts[p].n0 <= r->parts[p - 1].n0 || r->parts[p].n0 >= r->n)
            return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: parts[%u] from column %llu: the parts' columns "
                            "do not increase inside n %llu", p, (unsigned long long)r->parts[p].n0,
                            (unsigned long long)r->n);
    uint64_t at = 0;
    for (uint32_t x = 0; x < r->n_tiles; x++) {
        uint32_t p = part_of(r, at);
        if (at + r->n_size[x] > r->parts[p].n0 + part_cols(r, p))
            return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: N tile %u (columns %llu, +%u) crosses the end of "
                            "part %u", x, (unsigned long long)at, r->n_size[x], p);
        at += r->n_size[x];
    }
    return SPY_OK;
}

/* An A prologue: its vectors' views and regions, and its program over a chunk of tm rows
 * and the deepest K chunk in each operand buffer, inside the scratchpad. */
static spy_status prologue_check(mm_build *b)
{
    const spy_matmul_record *r = b->r;
    if (!r->npro_instrs && !r->npro_vectors)
        return SPY_OK;
    if (!r->npro_instrs || r->npro_instrs > SPY_MM_MAX_PROGRAM || r->npro_vectors > SPY_MM_MAX_VECTORS ||
        !r->pro_strip || !r->pro_program || (r->npro_vectors && !r->pro_vectors) || !r->k ||
        (r->flags & SPY_MM_TRANS_A))
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: a prologue of %u instructions, %u vectors and strips "
                        "of %u rows (1 .. %u, at most %u, at least 1; with their arrays, over a K that is not empty "
                        "and an A read with K contiguous)", r->npro_instrs, r->npro_vectors, r->pro_strip,
                        SPY_MM_MAX_PROGRAM, SPY_MM_MAX_VECTORS);
    spy_status s;
    char what[48];
    for (uint32_t v = 0; v < r->npro_vectors; v++) {
        const spy_mm_vector *pv = &r->pro_vectors[v];
        snprintf(what, sizeof what, "pro_vectors[%u]", v);
        if (pv->per_row > 1 || pv->view.strides[pv->per_row ? 2 : 1] != 0)
            return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: %s is not one value per row (per_row 1, "
                            "strides[2] 0) or per column (per_row 0, strides[1] 0)", what);
        if ((s = view_check(r, &pv->view, what, r->m, r->k, pv->itemsize)) != SPY_OK)
            return s;
        uint64_t n = pv->per_row ? b->tm : b->depth;
        for (uint32_t i = 0; i < r->nbuf; i++) {
            snprintf(what, sizeof what, "pro_vectors[%u].lx[%u]", v, i);
            if ((s = region_check(r, what, pv->lx[i], 1, n, n, pv->itemsize)) != SPY_OK)
                return s;
        }
    }
    const char *opnd[4] = {"dst", "src[0]", "src[1]", "src[2]"};
    uint32_t strip = r->pro_strip < b->tm ? r->pro_strip : b->tm;
    for (uint64_t i = 0; i < (uint64_t)r->nbuf * r->npro_instrs; i++) {
        const spy_instr *in = &r->pro_program[i];
        const spy_operand *o[4] = {&in->dst, &in->src[0], &in->src[1], &in->src[2]};
        for (int k = 0; k < 4; k++) {
            uint64_t lo, hi;
            if (o[k]->kind == SPY_OPND_NONE || o[k]->kind == SPY_OPND_IMM)
                continue;
            /* what moves with the strips spans the chunk's rows; the rest, a strip's */
            uint32_t rows = moves(o[k]) ? b->tm : strip;
            if (o[k]->kind > SPY_OPND_IMM || o[k]->dtype >= SPY_DT_COUNT || o[k]->pitch > SPY_MM_MAX_PITCH ||
                (o[k]->reserved & ~SPY_OPND_FIXED) ||
                o[k]->v.off > r->scratchpad_bytes || !spy_operand_extent(o[k], rows, b->depth, &lo, &hi) ||
                hi > r->scratchpad_bytes)
                return spy_fail(SPY_E_SCRATCHPAD, -1, "matmul record: pro_program[%llu].%s (kind %u, dtype %u, at "
                                "%llu, pitch %u) is unknown or outside the %llu-byte scratchpad for a %ux%u chunk",
                                (unsigned long long)i, opnd[k], o[k]->kind, o[k]->dtype,
                                (unsigned long long)o[k]->v.off, o[k]->pitch,
                                (unsigned long long)r->scratchpad_bytes, b->tm, b->depth);
        }
    }
    b->least += b->nchunks[0] * (1 + (uint64_t)r->npro_vectors);
    return b->least > MM_MAX_OPS ? too_big() : SPY_OK;
}

static spy_status matmul_check(mm_build *b)
{
    const spy_matmul_record *r = b->r;
    if ((r->nslots && !r->slots) || (r->nloads && !r->loads) || (r->nstores && !r->stores) ||
        (r->ninstrs && !r->program))
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: nslots %u, nloads %u, nstores %u or ninstrs %u "
                        "without its array", r->nslots, r->nloads, r->nstores, r->ninstrs);
    if (!r->num_cores || r->num_cores >= SPY_CORE_CARD)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: num_cores %u is not 1 .. %u", r->num_cores,
                        SPY_CORE_CARD - 1);
    if (!is_pow2(r->stick_bytes))
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: stick_bytes %u is not a power of two", r->stick_bytes);
    if (!r->scratchpad_bytes || r->scratchpad_bytes > UINT32_MAX)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: scratchpad_bytes %llu is not 1 .. 2^32 - 1",
                        (unsigned long long)r->scratchpad_bytes);
    if (r->nslots > SPY_MM_MAX_SLOTS)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: nslots %u is more than %u", r->nslots,
                        SPY_MM_MAX_SLOTS);
    for (uint32_t i = 0; i < r->nslots; i++) {
        uint64_t bytes;
        if (spy_layout_bytes(&r->slots[i], &bytes) != SPY_OK)
            return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: slots[%u]: %s", i, spy_last_error());
    }
    const uint64_t dims[4] = {r->batch, r->m, r->n, r->k};
    const char *dim_names[4] = {"batch", "m", "n", "k"};
    for (int d = 0; d < 4; d++)
        if (dims[d] > UINT32_MAX)
            return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: %s %llu is 2^32 or more", dim_names[d],
                            (unsigned long long)dims[d]);
    if (!r->batch || !r->m || !r->n)
        return SPY_OK; /* nothing to compute: no commands */
    if (r->in_dtype != SPY_DT_F16 && r->in_dtype != SPY_DT_BF16 && r->in_dtype != SPY_DT_F32)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: in_dtype %u is not F16, BF16 or F32", r->in_dtype);
    if (r->flags & ~(uint32_t)(SPY_MM_TRANS_A | SPY_MM_TRANS_B))
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: flags 0x%x has unknown bits", r->flags);
    b->e_in = spy_dtype_size(r->in_dtype);

    /* the tiling */
    const uint32_t grid[4] = {r->groups, r->pk, r->pm, r->pn};
    const char *grid_names[4] = {"groups", "pk", "pm", "pn"};
    uint64_t cores = 1;
    for (int d = 0; d < 4; d++) {
        if (!grid[d] || grid[d] > r->num_cores)
            return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: %s %u is not 1 .. num_cores %u", grid_names[d],
                            grid[d], r->num_cores);
        cores *= grid[d]; /* below num_cores^4 < 2^64 */
    }
    if (cores > r->num_cores)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: groups x pk x pm x pn is %llu cores, more than "
                        "num_cores %u", (unsigned long long)cores, r->num_cores);
    if (!r->m_tiles || r->m_tiles % r->pm || !r->n_tiles || r->n_tiles % r->pn)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: m_tiles %u and n_tiles %u are not multiples of pm "
                        "%u and pn %u", r->m_tiles, r->n_tiles, r->pm, r->pn);
    if (r->m_tiles > r->m || r->n_tiles > r->n)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: m_tiles %u or n_tiles %u is more than m or n",
                        r->m_tiles, r->n_tiles);
    if (!r->m_size || !r->n_size || !r->k_slice)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: m_size, n_size or k_slice is missing");
    spy_status s = sizes_check(r->m_size, r->m_tiles, r->m, "m_size");
    if (s == SPY_OK)
        s = sizes_check(r->n_size, r->n_tiles, r->n, "n_size");
    if (s != SPY_OK)
        return s;
    if (!r->tk || !r->nbuf || r->nbuf > SPY_MM_MAX_NBUF)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: tk %u or nbuf %u is not 1 .. %u", r->tk, r->nbuf,
                        SPY_MM_MAX_NBUF);
    if (r->last_depth > r->nbuf) /* the chunks a piece walks are held in the operand buffers at once */
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: last_depth %u is more than nbuf %u", r->last_depth,
                        r->nbuf);
    uint64_t ksum = 0, nk = 0, depth = 0;
    for (uint32_t x = 0; x < r->pk; x++) {
        if (!r->k_slice[x] && r->k)
            return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: k_slice[%u] is 0", x);
        if (r->k_slice[x] > r->k)
            return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: k_slice[%u] %llu is more than k", x,
                            (unsigned long long)r->k_slice[x]);
        ksum += r->k_slice[x];
        nk += (r->k_slice[x] + r->tk - 1) / r->tk;
        uint64_t d = r->k_slice[x] < r->tk ? r->k_slice[x] : r->tk;
        depth = d > depth ? d : depth;
    }
    if (ksum != r->k || (!r->k && r->pk != 1))
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: k_slice adds up to %llu over pk %u slices, not k "
                        "%llu", (unsigned long long)ksum, r->pk, (unsigned long long)r->k);
    b->nk = nk;
    b->depth = (uint32_t)(depth ? depth : 1);

    /* the counts, each below what a program block holds */
    uint64_t gc = (uint64_t)r->pk * r->pm * r->pn, per_block;
    b->nblocks = r->batch * (r->m_tiles / r->pm); /* < 2^64 */
    if (!spy_mul_ok(b->nblocks, r->n_tiles / r->pn, &b->nblocks) || !spy_mul_ok(b->nblocks, gc, &b->ntasks) ||
        !spy_mul_ok((uint64_t)r->pm * r->pn, nk, &per_block) || !spy_mul_ok(b->nblocks, per_block, &b->nuses) ||
        b->ntasks > MM_MAX_OPS || b->nuses > MM_MAX_OPS)
        return too_big();
    b->nroots = b->nblocks * r->pm * r->pn;
    b->npairs = b->nroots * (r->pk - 1);
    b->nchunks[0] = b->nblocks * r->pm * nk;
    b->nchunks[1] = b->nblocks * r->pn * nk;
    /* one command at least per load, send, matmul, split-K send and add, and per root its
     * program, loads and stores */
    b->least = b->nchunks[0] + b->nchunks[1] + 3 * b->nuses + 2 * b->npairs +
               b->nroots * (1 + (uint64_t)r->nloads + r->nstores); /* each term < 2^40 */
    if (b->least > MM_MAX_OPS)
        return too_big();

    /* the views and their tiles */
    uint32_t tm = 0, tn = 0;
    for (uint32_t x = 0; x < r->m_tiles; x++)
        tm = r->m_size[x] > tm ? r->m_size[x] : tm;
    for (uint32_t x = 0; x < r->n_tiles; x++)
        tn = r->n_size[x] > tn ? r->n_size[x] : tn;
    b->tm = tm, b->tn = tn;
    bool ta = r->flags & SPY_MM_TRANS_A, tb = r->flags & SPY_MM_TRANS_B;
    if ((s = parts_check(r)) != SPY_OK)
        return s;
    if (r->k) {
        if ((s = view_check(r, &r->a, "a", r->m, r->k, b->e_in)) != SPY_OK ||
            (!r->nparts && (s = view_check(r, &r->b, "b", r->k, r->n, b->e_in)) != SPY_OK))
            return s;
        char part[32];
        for (uint32_t p = 0; p < r->nparts; p++) {
            snprintf(part, sizeof part, "parts[%u].b", p);
            if ((s = view_check(r, &r->parts[p].b, part, r->k, part_cols(r, p), b->e_in)) != SPY_OK)
                return s;
        }
    } else if (r->a.slot >= r->nslots || r->b.slot >= r->nslots) {
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: a.slot %u or b.slot %u is not one of %u slots",
                        r->a.slot, r->b.slot, r->nslots);
    }
    if (r->nloads > SPY_MM_MAX_TILES || !r->nstores || r->nstores > SPY_MM_MAX_TILES || !r->ninstrs ||
        r->ninstrs > SPY_MM_MAX_PROGRAM)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: nloads %u, nstores %u or ninstrs %u is not in range "
                        "(0 .. %u, 1 .. %u, 1 .. %u)", r->nloads, r->nstores, r->ninstrs, SPY_MM_MAX_TILES,
                        SPY_MM_MAX_TILES, SPY_MM_MAX_PROGRAM);
    char what[48];
    for (uint32_t i = 0; i < r->nloads + r->nstores; i++) {
        bool load = i < r->nloads;
        const spy_mm_tiles *t = load ? &r->loads[i] : &r->stores[i - r->nloads];
        uint32_t x = load ? i : i - r->nloads;
        snprintf(what, sizeof what, "%s[%u]", load ? "loads" : "stores", x);
        if (t->part > r->nparts || (load && t->part))
            return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: %s.part %u: not a store of one of %u parts", what,
                            t->part, r->nparts);
        if (t->row > (load ? SPY_MM_TILES_PERIODIC_ROWS : SPY_MM_TILES_ROW) ||
            (t->row == SPY_MM_TILES_PER_ROW && t->view.strides[2]))
            return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: %s.row %u is not a kind of %s tile%s", what, t->row,
                            load ? "loaded" : "stored",
                            t->row == SPY_MM_TILES_PER_ROW ? " (its view's columns are not one value)" : "");
        /* every row of the output: a row's tiles start at their tile's first row too */
        bool periodic = t->row >= SPY_MM_TILES_PERIODIC;
        uint64_t cols = t->part ? part_cols(r, t->part - 1) : periodic ? t->pitch : r->n;
        if ((s = view_check(r, &t->view, what, r->m, cols, t->itemsize)) != SPY_OK)
            return s;
        for (int slot = 0; slot < 2; slot++) {
            snprintf(what, sizeof what, "%s[%u].lx[%d]", load ? "loads" : "stores", x, slot);
            uint64_t width = t->row == SPY_MM_TILES_PER_ROW ? tm : periodic ? t->pitch : tn;
            uint64_t rows = t->row && t->row != SPY_MM_TILES_PERIODIC_ROWS ? 1 : tm;
            if ((s = region_check(r, what, t->lx[slot], rows, width, t->pitch, t->itemsize)) != SPY_OK)
                return s;
        }
    }

    /* the scratchpad: operand buffers, accumulator, receive buffer */
    for (uint32_t i = 0; i < r->nbuf; i++) {
        snprintf(what, sizeof what, "a_lx[%u]", i);
        if ((s = region_check(r, what, r->a_lx[i], ta ? b->depth : tm, ta ? tm : b->depth, r->a_pitch, b->e_in)))
            return s;
        snprintf(what, sizeof what, "b_lx[%u]", i);
        if ((s = region_check(r, what, r->b_lx[i], tb ? tn : b->depth, tb ? b->depth : tn, r->b_pitch, b->e_in)))
            return s;
    }
    if ((s = region_check(r, "acc_lx", r->acc_lx, tm, tn, r->c_pitch, 4)) != SPY_OK ||
        (r->pk > 1 && (s = region_check(r, "recv_lx", r->recv_lx, tm, tn, r->c_pitch, 4)) != SPY_OK))
        return s;
    if (r->epi_strip > MM_MAX_STRIP)
        return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: epi_strip %u is over %u rows", r->epi_strip,
                        MM_MAX_STRIP);
    const char *opnd[4] = {"dst", "src[0]", "src[1]", "src[2]"};
    for (uint32_t i = 0; i < r->ninstrs; i++) {
        const spy_mm_instr *in = &r->program[i];
        const spy_operand *o[4] = {&in->ins.dst, &in->ins.src[0], &in->ins.src[1], &in->ins.src[2]};
        if (in->ins.rows || in->ins.cols > tn) /* rows come from each tile; columns: 0 (the tile's) or a slice's */
            return spy_fail(SPY_E_INVALID_ARG, -1, "matmul record: program[%u] has %u rows and %u columns (0 rows, "
                            "and columns 0 or at most the tiles' %u)", i, in->ins.rows, in->ins.cols, tn);
        for (int k = 0; k < 4; k++)
            if ((s = operand_check(r, o[k], in->v1[k], i, opnd[k], tm, in->ins.cols ? in->ins.cols : tn)) != SPY_OK)
                return s;
    }
    return prologue_check(b);
}

spy_status spy_build_matmul(const spy_matmul_record *r, spy_built *out)
{
    if (!r || !out)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null matmul record or output");
    out->data = NULL;
    out->bytes = 0;
    mm_build b;
    memset(&b, 0, sizeof b);
    b.r = r;
    spy_status s = matmul_check(&b);
    if (s != SPY_OK)
        return s;
    spy_graph_init(&b.g);
    for (uint32_t i = 0; i < r->nslots; i++) {
        uint64_t bytes = 0;
        spy_layout_bytes(&r->slots[i], &bytes);
        spy_graph_slot(&b.g, SPY_SLOT_DRAM, bytes);
    }
    if (r->batch && r->m && r->n) {
        spy_graph_reserve(&b.g, b.least + b.least / 8, 3 * b.least); /* about what a matmul makes */
        s = schedule(&b);
        if (s == SPY_OK)
            plan_pieces(&b);
        uint64_t R = b.nroots;
        for (int op = 0; op < 2 && s == SPY_OK; op++) {
            b.loaded[op] = mm_alloc(&b, b.nchunks[op] ? b.nchunks[op] : 1, sizeof(run));
            b.sends[op] = mm_alloc(&b, b.nchunks[op] ? b.nchunks[op] : 1, sizeof(run));
            b.arrival[op] = mm_alloc(&b, b.nuses ? b.nuses : 1, sizeof(run));
            if (!b.loaded[op] || !b.sends[op] || !b.arrival[op])
                s = spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for a matmul's operations");
        }
        if (s == SPY_OK && r->npro_instrs) {
            uint64_t nc = b.nchunks[0] ? b.nchunks[0] : 1;
            b.pro_ready = mm_alloc(&b, nc, sizeof(run));
            b.pro_vec = mm_alloc(&b, nc * (r->npro_vectors ? r->npro_vectors : 1), sizeof(run));
            if (!b.pro_ready || !b.pro_vec)
                s = spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for a matmul's prologue");
        }
        if (s == SPY_OK) {
            b.ld = mm_alloc(&b, (r->nloads ? r->nloads : 1) * R, sizeof(run));
            b.st = mm_alloc(&b, r->nstores * R, sizeof(run));
            b.pst = b.nextra ? mm_alloc(&b, r->nstores * b.nextra, sizeof(run)) : NULL;
            if (!b.ld || !b.st || (b.nextra && !b.pst))
                s = spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for a matmul's operations");
        }
        for (int op = 0; op < 2 && s == SPY_OK; op++)
            s = operand(&b, op);
        if (s == SPY_OK) {
            matmuls(&b);
            piece_matmuls(&b);
            buffer_reuse(&b, 0);
            buffer_reuse(&b, 1);
            in_step_order(&b, 0);
            in_step_order(&b, 1);
            reduction(&b);
            s = epilogue(&b);
        }
        if (s == SPY_OK)
            accumulator_reuse(&b);
        if (s == SPY_OK && b.overflow)
            s = too_big();
    }
    if (s == SPY_OK)
        s = spy_graph_encode(&b.g, out);
    spy_graph_free(&b.g);
    mm_release(&b);
    return s;
}
