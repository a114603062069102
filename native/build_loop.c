/* build_loop.c -- the native builder of loop kernels: a decision record (spyre.h,
 * spy_loop_record) to an encoded program block.
 *
 * The layers above decide once per kernel (tiles, scratchpad regions, stage programs,
 * accesses as affine boxes); this file does what every launch does: each tile's boxes and
 * their DMA patterns or descriptor lists in the stick layout, the gathers' row pieces, the
 * SFU instructions for the tile's rows and its prologue, the dependencies between tiles on
 * a core, and the encoding (graph.c's blocks). The record is checked whole first, in a pass
 * that computes every box and row piece the build will use and sorts the tiles into classes
 * of alike commands; the first tile of a class is built, the others copy it (see klass). A
 * refused record allocates nothing it does not free. Commands are made in program order,
 * each with its dependencies, so the block's sections are written as they come; the stores
 * of merged groups come after every tile (see spyre.h). */
#include <stdlib.h>

#include "internal.h"

#define MAXV SPY_LOOP_MAX_VARS
#define PDIMS (2 * MAXV + 2) /* a pattern's dimensions: a box's, split at sticks, and the run's sticks */
#define BOUND (1ll << 56)    /* a coefficient times an index, or a base: so sums of 17 stay below 2^62 */
#define FREE_IN -1           /* a tile's dependency on the last SFU command two tiles back */
#define FREE_OUT -2          /* ... and on the last store two tiles back */

static int64_t floordiv(int64_t a, int64_t b)
{
    int64_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

static int64_t floormod(int64_t a, int64_t b) { return a - floordiv(a, b) * b; }

static int64_t abs64(int64_t a) { return a < 0 ? -a : a; }

/* ---- the shape of a tile ------------------------------------------------------------------ */

/* One dimension of a box: a loop variable with its count, stride in elements of the storage
 * and stride in bytes of the scratchpad region. */
typedef struct box {
    int64_t base;  /* the storage element of its first index */
    int64_t lx_off;
    uint32_t n;
    int64_t count[MAXV], stride[MAXV], lx[MAXV];
} box;

/* A row variable of a tile (the block variable last) or a column variable: its count and
 * its stride in tile rows or columns. */
typedef struct tile_var {
    uint32_t var;
    int64_t count, stride;
} tile_var;

typedef struct shape {
    uint32_t nrows, ncols;
    tile_var rows[MAXV], cols[MAXV]; /* outermost first */
    int64_t inner;                   /* tile rows per index of the block variable */
    int64_t columns;                 /* elements of a tile row */
} shape;

static void shape_of(const spy_loop_record *r, shape *sh)
{
    int64_t stride = 1;
    sh->nrows = 0;
    for (int64_t j = (int64_t)r->nrow - 1; j > r->block; j--) {
        sh->rows[sh->nrows++] = (tile_var){(uint32_t)j, (int64_t)r->sizes[j], stride};
        stride *= (int64_t)r->sizes[j];
    }
    sh->inner = stride;
    if (r->block >= 0)
        sh->rows[sh->nrows++] = (tile_var){(uint32_t)r->block, 0, stride}; /* count: the tile's */
    for (uint32_t a = 0, b = sh->nrows - 1; sh->nrows && a < b; a++, b--) {
        tile_var t = sh->rows[a];
        sh->rows[a] = sh->rows[b];
        sh->rows[b] = t;
    }
    stride = 1;
    sh->ncols = 0;
    for (int64_t j = (int64_t)r->nvars - 1; j >= (int64_t)r->nrow; j--) {
        sh->cols[sh->ncols++] = (tile_var){(uint32_t)j, (int64_t)r->sizes[j], stride};
        stride *= (int64_t)r->sizes[j];
    }
    sh->columns = stride;
    for (uint32_t a = 0, b = sh->ncols - 1; sh->ncols && a < b; a++, b--) {
        tile_var t = sh->cols[a];
        sh->cols[a] = sh->cols[b];
        sh->cols[b] = t;
    }
}

static bool masks(const spy_loop_access *a, uint32_t j) { return (a->masked >> j) & 1u; }

/* Whether tile t's merged stores go to its group (see spyre.h). */
static bool merged(const spy_loop_record *r, uint32_t t) { return r->nmerges && r->tile_merge[t] >= 0; }

/* The element an access reads at the tile's first row and column, from its storage's start. */
static int64_t origin(const spy_loop_record *r, const int64_t *coeffs, int64_t base, const spy_loop_tile *t)
{
    for (int32_t j = 0; j < r->block; j++)
        base += coeffs[j] * t->fixed[j];
    if (r->block >= 0)
        base += coeffs[r->block] * t->start;
    return base;
}

/* The box of a direct load or store that a tile moves; false when its mask excludes the tile. */
static bool box_of(const spy_loop_record *r, const shape *sh, const spy_loop_access *a, const spy_loop_tile *t,
                   box *b)
{
    for (int32_t j = 0; j < r->block; j++)
        if (masks(a, (uint32_t)j) && !(a->lo[j] <= t->fixed[j] && t->fixed[j] < a->hi[j]))
            return false;
    int64_t e = a->itemsize;
    b->base = origin(r, a->coeffs, a->base, t);
    b->lx_off = 0;
    b->n = 0;
    if (a->kind == SPY_OPND_TILE || a->kind == SPY_OPND_ROW) {
        int64_t pitch = a->kind == SPY_OPND_TILE ? (int64_t)a->lx_pitch * e : e;
        for (uint32_t k = 0; k < sh->nrows; k++) {
            uint32_t j = sh->rows[k].var;
            bool block = (int32_t)j == r->block;
            int64_t count = block ? t->size : sh->rows[k].count, lo = 0, hi = count;
            if (masks(a, j)) {
                lo = block ? (a->lo[j] - t->start > 0 ? a->lo[j] - t->start : 0) : a->lo[j];
                hi = block ? (a->hi[j] - t->start < count ? a->hi[j] - t->start : count) : a->hi[j];
                if (hi <= lo)
                    return false;
            }
            b->base += a->coeffs[j] * lo;
            b->lx_off += lo * sh->rows[k].stride * pitch;
            b->count[b->n] = hi - lo;
            b->stride[b->n] = a->coeffs[j];
            b->lx[b->n++] = sh->rows[k].stride * pitch;
        }
    }
    if (a->kind == SPY_OPND_TILE || a->kind == SPY_OPND_COL) {
        for (uint32_t k = 0; k < sh->ncols; k++) {
            uint32_t j = sh->cols[k].var;
            int64_t lo = masks(a, j) ? a->lo[j] : 0, hi = masks(a, j) ? a->hi[j] : sh->cols[k].count;
            b->base += a->coeffs[j] * lo;
            b->lx_off += lo * sh->cols[k].stride * e;
            b->count[b->n] = hi - lo;
            b->stride[b->n] = a->coeffs[j];
            b->lx[b->n++] = sh->cols[k].stride * e;
        }
    }
    if (!b->n) {
        b->count[0] = 1, b->stride[0] = 1, b->lx[0] = e;
        b->n = 1;
    }
    return true;
}

static bool box_empty(const box *b)
{
    for (uint32_t k = 0; k < b->n; k++)
        if (b->count[k] <= 0)
            return true;
    return false;
}

/* ---- DMA patterns in the stick layout (spyre_rt.construct.access) ------------------------- */

typedef struct dim {
    int64_t count, src, dst; /* src: the storage side, dst: the scratchpad side, in bytes */
} dim;

/* A DMA: run contiguous bytes repeated over dims (innermost first), at start; dimensions
 * past the three a command holds are replicated as commands (`outer`, the first of them
 * varying slowest). */
typedef struct pattern {
    int64_t run, start;
    uint32_t ndims, nouter;
    dim dims[PDIMS];
} pattern;

static int64_t stick_stride(const spy_layout *l) { return (int64_t)(l->rows ? l->rows : 1) * l->stick_bytes; }

/* The physical byte offset of logical element x (>= 0) of a storage. */
static int64_t phys(const spy_layout *l, int64_t x)
{
    int64_t n_row = (int64_t)l->row_len, s = l->stick_bytes / l->itemsize; /* a power of two */
    int64_t r = x / n_row, c = x - r * n_row;
    return (c >> __builtin_ctzll((uint64_t)s)) * stick_stride(l) + r * l->stick_bytes + (c & (s - 1)) * l->itemsize;
}

/* Drops unit dimensions and fuses neighbours contiguous on both sides; then absorbs inner
 * dimensions that continue the run into it; then leaves at most three for the command. */
static void finish(pattern *p, uint32_t n, const dim *dims)
{
    uint32_t m = 0;
    for (uint32_t i = 0; i < n; i++) {
        dim d = dims[i];
        if (d.count == 1)
            continue;
        if (m && d.src == p->dims[m - 1].src * p->dims[m - 1].count &&
            d.dst == p->dims[m - 1].dst * p->dims[m - 1].count) {
            dim prev = p->dims[--m];
            d = (dim){prev.count * d.count, prev.src, prev.dst};
        }
        p->dims[m++] = d;
    }
    uint32_t first = 0;
    while (first < m && p->dims[first].src == p->run && p->dims[first].dst == p->run)
        p->run *= p->dims[first++].count;
    memmove(p->dims, p->dims + first, (m - first) * sizeof *p->dims);
    p->ndims = m - first;
    p->nouter = p->ndims > 3 ? p->ndims - 3 : 0;
}

/* The pattern moving a box of a storage to or from a packed region of the scratchpad;
 * false when the stick layout has none (a descriptor list moves it). */
static bool pattern_of(const spy_layout *l, int64_t base, uint32_t n, const int64_t *counts, const int64_t *strides,
                       const int64_t *lx, pattern *p)
{
    int64_t e = l->itemsize, n_row = (int64_t)l->row_len, s = l->stick_bytes / l->itemsize, sb = l->stick_bytes;
    if (base < 0)
        return false;
    for (uint32_t k = 0; k < n; k++)
        if (strides[k] < 0 || counts[k] <= 0)
            return false;
    dim dims[PDIMS];
    uint32_t nd = 0;
    if (l->rows <= 1) { /* linear memory: any box */
        p->run = e;
        uint32_t items = n;
        if (items && strides[items - 1] == 1 && lx[items - 1] == e)
            p->run = counts[--items] * e;
        for (uint32_t k = items; k-- > 0;)
            dims[nd++] = (dim){counts[k], strides[k] * e, lx[k]};
        p->start = base * e;
        finish(p, nd, dims);
        return true;
    }
    int64_t r0 = base / n_row, c0 = base % n_row;
    uint32_t items = n;
    int64_t inner = -1;
    if (items && strides[items - 1] == 1 && lx[items - 1] == e && counts[items - 1] > 1)
        inner = counts[--items];
    int64_t col_span = 0, in_stick = 0;
    for (uint32_t k = items; k-- > 0;) {
        int64_t count = counts[k];
        if (count == 1)
            continue;
        int64_t q = strides[k] / n_row, m = strides[k] % n_row;
        col_span += m * (count - 1);
        if (m % s == 0) {
            dims[nd++] = (dim){count, q * sb + (m / s) * stick_stride(l), lx[k]};
            continue;
        }
        if (s % m)
            return false;
        int64_t f = s / m;
        if (count <= f) {
            dims[nd++] = (dim){count, q * sb + m * e, lx[k]};
            in_stick += m * (count - 1);
        } else if (count % f == 0) {
            dims[nd++] = (dim){f, q * sb + m * e, lx[k]};
            dims[nd++] = (dim){count / f, q * sb * f + stick_stride(l), lx[k] * f};
            in_stick += m * (f - 1);
        } else {
            return false;
        }
    }
    if (inner >= 0) {
        col_span += inner - 1;
        if (c0 % s == 0 && in_stick == 0 && inner > s) { /* whole sticks: they form the innermost dim */
            p->run = sb;
            memmove(dims + 1, dims, nd * sizeof *dims);
            dims[0] = (dim){(inner + s - 1) / s, stick_stride(l), s * e};
            nd++;
        } else if (c0 % s + in_stick + inner <= s) {
            p->run = inner * e;
        } else {
            return false; /* a contiguous run crosses a stick boundary at an unaligned column */
        }
    } else {
        p->run = e;
        if (c0 % s + in_stick >= s)
            return false;
    }
    if (c0 + col_span >= n_row)
        return false; /* the columns of the box wrap into the next row */
    p->start = (c0 / s) * stick_stride(l) + r0 * sb + (c0 % s) * e;
    finish(p, nd, dims);
    return true;
}

/* The bases of a pattern's commands, one per index of its outer dimensions: base k's
 * offsets on both sides added to *dev and *lx. */
static uint64_t pattern_bases(const pattern *p)
{
    uint64_t n = 1;
    for (uint32_t i = 0; i < p->nouter; i++)
        n *= (uint64_t)p->dims[3 + i].count;
    return n;
}

static void pattern_base(const pattern *p, int64_t start, uint64_t k, int64_t *dev, int64_t *lx)
{
    *dev = start;
    *lx = 0;
    for (uint32_t i = p->ndims; i-- > 3;) { /* the last dimension varies fastest */
        int64_t x = (int64_t)(k % (uint64_t)p->dims[i].count);
        k /= (uint64_t)p->dims[i].count;
        *dev += x * p->dims[i].src;
        *lx += x * p->dims[i].dst;
    }
}

/* ---- the builder's state ---------------------------------------------------------------- */

/* A gather's row pieces for one column of the table (each: DRAM offset from the row's
 * start, scratchpad offset from the tile row's, run bytes, up to two outer dimensions). */
typedef struct piece {
    int64_t dram, lx, run;
    uint32_t ndims;
    dim dims[2];
} piece;

typedef struct pieces_of {
    int64_t c0; /* -1: none yet */
    uint64_t first, n; /* in st->pieces */
} pieces_of;

/* A descriptor-list DMA waiting for its place among the descriptors (see the header). */
typedef struct listed {
    uint64_t cmd, first, n; /* its command; its descriptors in st->runs */
    uint32_t tile, order;   /* its tile; its place among the tile's listed commands */
} listed;

/* The last DMA pattern of an access: alike tiles (boxes of the same counts starting at the
 * same column of a storage row) share it, at their own start. */
typedef struct dma_cache {
    bool valid, affine;
    int64_t c0;
    int64_t count[MAXV];
    pattern p;
} dma_cache;

/* Tiles of alike commands: the first is built and recorded as the class's template, the
 * others are its copy on their core, their dependencies renamed, the DRAM offsets of each
 * load and store moved by where their boxes start (a class with descriptor lists is built
 * tile by tile). */
typedef struct klass {
    uint32_t rep;       /* the tile it was recorded from */
    bool templated;
    uint64_t cmd_first, ncmds, dep_first, ndeps, patch_first, npatches; /* in tcmds, tdeps, tpatches */
    int64_t last_sfu, last_out; /* within the tile, or -1 */
} klass;

#define PATCH_SRC 1      /* src_off moves with the access's box */
#define PATCH_DST 2      /* dst_off moves with it */
#define PATCH_PROLOGUE 3 /* the prologue's instructions are the tile's own */

typedef struct patch {
    uint32_t cmd, access, kind, reserved;
} patch;

/* A merged tile's RING command, by its group. */
typedef struct sent {
    uint32_t group, tile;
    uint64_t cmd;
} sent;

typedef struct builder {
    const spy_loop_record *r;
    shape sh;
    spy_vec cmds, deps32, instrs, descs; /* the block's sections, made in program order */
    dma_cache *dmas;  /* per access */
    /* tile shapes (check_tiles): what fixes a tile's commands but its dependencies on the
     * tile two back: its parity and size, and per access the column of the storage row it
     * starts at (and, with a mask, its box) */
    uint32_t width;        /* words of a shape */
    spy_vec shapes;        /* int64_t: the shapes, in the order tiles first have them */
    uint32_t *table;       /* open hash of the shapes: index + 1, 0 empty */
    uint64_t table_cap;
    uint32_t *shape_of;    /* per tile */
    int64_t *starts;       /* per tile and access: the physical offset its box starts at, or -1 */
    int32_t *class_of;     /* per shape x (FREE_IN | FREE_OUT << 1): its class, or -1 */
    uint32_t *rank;        /* per tile: its class */
    box *boxes;            /* per access: the boxes of the tile being checked */
    bool *moves;
    int64_t *last;         /* per tile: its last SFU command and its last store, or -1 */
    void *arena;           /* the arrays above, one allocation */
    spy_vec classes, tcmds, tdeps, tpatches;
    spy_vec pieces;   /* piece */
    pieces_of *cache; /* per access: the pieces of the column its tiles last gathered */
    spy_vec runs;     /* spy_desc, in tile order */
    spy_vec listed;   /* listed */
    spy_vec pairs;    /* uint64_t: (parity, size) of the stage programs, in the order tiles need them */
    spy_vec deps, issued, levels, prev, outs; /* int64_t: one tile's lists (see build_tile) */
    spy_vec sent;     /* sent: the merged tiles' rings */
    uint64_t total_instrs; /* a parity's stage instructions, all stages */
    uint64_t bytes;        /* of the block so far */
} builder;

#define NOMEM() spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for a loop kernel's program")

/* n zeroed elements at the end of v (spy_vec_push, without its call while there is room). */
static inline void *push(spy_vec *v, uint64_t n)
{
    if (v->len + n > v->cap)
        return spy_vec_push(v, n);
    void *at = (uint8_t *)v->data + v->len * v->elem;
    memset(at, 0, (size_t)(n * v->elem));
    v->len += n;
    return at;
}

/* n elements at the end of v that the caller writes whole (not zeroed while there is room). */
static inline void *push_raw(spy_vec *v, uint64_t n)
{
    if (v->len + n > v->cap)
        return spy_vec_push(v, n);
    void *at = (uint8_t *)v->data + v->len * v->elem;
    v->len += n;
    return at;
}

static inline bool push_i64(spy_vec *v, int64_t x)
{
    int64_t *p = push(v, 1);
    if (p)
        *p = x;
    return p != NULL;
}

/* Every element of src appended to dst (lists of int64_t). */
static inline bool push_all(spy_vec *dst, const spy_vec *src)
{
    int64_t *p = src->len ? push_raw(dst, src->len) : NULL;
    if (p)
        memcpy(p, src->data, (size_t)src->len * sizeof *p);
    return p || !src->len;
}

static void builder_free(builder *st)
{
    spy_vec *v[] = {&st->shapes, &st->classes, &st->tcmds, &st->tdeps, &st->tpatches, &st->cmds, &st->deps32,
                    &st->instrs, &st->descs, &st->pieces, &st->runs, &st->listed, &st->pairs, &st->deps,
                    &st->issued, &st->levels, &st->prev, &st->outs, &st->sent};
    for (size_t i = 0; i < SPY_ARRAY_LEN(v); i++)
        spy_vec_free(v[i]);
    free(st->arena);
}

/* ---- gathers' row pieces -------------------------------------------------------------------- */

/* The pattern of a box of one table row if its scratchpad side is packed (at most two
 * outer dimensions, each stepping by the run times the counts inside it). */
static bool packed(const spy_layout *l, int64_t c0, uint32_t n, const int64_t *counts, const int64_t *strides,
                   const int64_t *lx, pattern *p)
{
    if (!pattern_of(l, c0, n, counts, strides, lx, p) || p->ndims > 2)
        return false;
    int64_t inner = p->run;
    for (uint32_t i = 0; i < p->ndims; i++) {
        if (p->dims[i].dst != inner)
            return false;
        inner *= p->dims[i].count;
    }
    return true;
}

static bool push_pieces(builder *st, const pattern *p, int64_t lx0)
{
    piece *x = spy_vec_push(&st->pieces, 1);
    if (!x)
        return false;
    *x = (piece){p->start, lx0, p->run, p->ndims, {{0}}};
    for (uint32_t i = 0; i < p->ndims; i++)
        x->dims[i] = p->dims[i];
    return true;
}

#define CUT_BUDGET (1 << 22) /* steps of cutting one gather's row: no real row comes near */

/* Cuts the outermost dimension with more than one step where its steps cross a stick
 * boundary, into as few packed pieces as the patterns allow; 1: columns that leave the
 * row (refused), 2: past the budget of steps (refused), -1: no host memory. */
static int cut_pieces(builder *st, const spy_layout *l, int64_t c0, uint32_t n, int64_t *counts,
                      const int64_t *strides, const int64_t *lx, int64_t lx0, uint64_t *budget)
{
    pattern p;
    if (*budget < 16)
        return 2;
    *budget -= 16;
    if (packed(l, c0, n, counts, strides, lx, &p))
        return push_pieces(st, &p, lx0) ? 0 : -1;
    uint32_t outer = 0;
    while (outer < n && counts[outer] <= 1)
        outer++;
    if (outer == n)
        return 1;
    int64_t cnt = counts[outer], step = strides[outer], lstep = lx[outer], s = l->stick_bytes / l->itemsize;
    int64_t i = 0;
    while (i < cnt) {
        bool done = false;
        for (int64_t b = cnt; b > i; b--) { /* the cuts after i, the furthest first */
            if (!(*budget)--)
                return 2;
            if (b != cnt && floormod(c0 + b * step, s) != 0)
                continue;
            if (*budget < 16)
                return 2;
            *budget -= 16;
            counts[outer] = b - i;
            bool ok = packed(l, c0 + i * step, n, counts, strides, lx, &p);
            counts[outer] = cnt;
            if (ok) {
                if (!push_pieces(st, &p, lx0 + i * lstep))
                    return -1;
                i = b;
                done = true;
                break;
            }
        }
        if (!done) { /* not even up to the next boundary: one step, cut further inside */
            counts[outer] = 1;
            int rc = cut_pieces(st, l, c0 + i * step, n, counts, strides, lx, lx0 + i * lstep, budget);
            counts[outer] = cnt;
            if (rc)
                return rc;
            i++;
        }
    }
    return 0;
}

/* The columns a gathered access of kind TILE or COL moves per tile row: how far the mask
 * moves the first, and per column variable its count, stride in bytes of the scratchpad
 * and first index. */
static int64_t gathered_columns(const builder *st, const spy_loop_access *a, uint32_t *n, int64_t *counts,
                                int64_t *strides, int64_t *lx, int64_t *lx0)
{
    int64_t shift = 0, e = a->layout.itemsize;
    *n = 0;
    *lx0 = 0;
    if (a->kind != SPY_OPND_TILE && a->kind != SPY_OPND_COL)
        return 0;
    for (uint32_t k = 0; k < st->sh.ncols; k++) {
        uint32_t j = st->sh.cols[k].var;
        int64_t lo = masks(a, j) ? a->lo[j] : 0, hi = masks(a, j) ? a->hi[j] : st->sh.cols[k].count;
        shift += a->coeffs[j] * lo;
        counts[*n] = hi - lo;
        strides[*n] = a->coeffs[j];
        lx[*n] = st->sh.cols[k].stride * e;
        *lx0 += lo * st->sh.cols[k].stride * e;
        (*n)++;
    }
    return shift;
}

/* The row pieces of gather `i` for a tile (cached per column), and the rows of the table
 * its index may pick (*limit). SPY_E_INVALID_ARG names what the card cannot move. */
static spy_status gather_pieces(builder *st, uint32_t i, const spy_loop_tile *t, const pieces_of **out,
                                int64_t *limit)
{
    const spy_loop_access *a = &st->r->accesses[i];
    const spy_layout *l = &a->layout;
    int64_t counts[MAXV], strides[MAXV], lx[MAXV], lx0;
    uint32_t n;
    int64_t shift = gathered_columns(st, a, &n, counts, strides, lx, &lx0);
    int64_t c0 = floormod(origin(st->r, a->coeffs, a->base, t) + shift, (int64_t)l->row_len);
    int64_t last = c0;
    for (uint32_t k = 0; k < n; k++)
        last += strides[k] * (counts[k] - 1) > 0 ? strides[k] * (counts[k] - 1) : 0;
    *limit = (int64_t)l->rows - last / (int64_t)l->row_len;
    if (*limit < 1)
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: accesses[%u] gathers a block of columns taller "
                        "than its table of %llu rows", i, (unsigned long long)l->rows);
    pieces_of *c = &st->cache[i];
    *out = c;
    if (c->c0 == c0)
        return SPY_OK;
    c->c0 = c0;
    c->first = st->pieces.len;
    if (!n)
        counts[0] = 1, strides[0] = 1, lx[0] = l->itemsize, n = 1;
    for (uint32_t k = 0; k < n; k++)
        if (counts[k] <= 0) {
            c->n = 0; /* it moves nothing */
            return SPY_OK;
        }
    uint64_t budget = CUT_BUDGET;
    int rc = cut_pieces(st, l, c0, n, counts, strides, lx, lx0, &budget);
    c->n = st->pieces.len - c->first;
    if (rc < 0)
        return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for a loop kernel's gathers");
    if (rc > 0) {
        c->c0 = -1;
        return spy_fail(SPY_E_INVALID_ARG, -1, rc == 1 ? "loop record: accesses[%u] gathers columns that leave "
                        "the row its index picks" : "loop record: accesses[%u] gathers a row of columns that "
                        "takes more than 2^22 steps to cut into pieces", i);
    }
    return SPY_OK;
}

/* ---- the record, checked whole ---------------------------------------------------------------- */

/* Bytes of an access's region for `rows` tile rows. */
static uint64_t region_bytes(const spy_loop_access *a, uint64_t rows)
{
    uint64_t e = a->itemsize, pitch = a->lx_pitch;
    switch (a->kind) {
    case SPY_OPND_TILE: return rows * pitch * e;
    case SPY_OPND_ROW: return rows * e;
    case SPY_OPND_COL: return pitch * e;
    default: return e;
    }
}

static spy_status check_operand(const spy_loop_record *r, uint32_t i, const char *which, const spy_operand *o,
                                uint64_t rows, uint64_t cols)
{
    if (o->kind == SPY_OPND_NONE || o->kind == SPY_OPND_IMM)
        return SPY_OK;
    if (o->kind > SPY_OPND_IMM || o->dtype >= SPY_DT_COUNT)
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: instrs[%u].%s has kind %u, dtype %u", i, which,
                        o->kind, o->dtype);
    uint64_t n = o->kind == SPY_OPND_TILE ? (rows - 1) * o->pitch + cols
               : o->kind == SPY_OPND_ROW  ? (rows - 1) * o->pitch + 1
               : o->kind == SPY_OPND_COL  ? cols
                                          : 1; /* rows, cols, pitch < 2^32: no overflow below 2^64 */
    uint64_t end;
    if (!spy_mul_ok(n, spy_dtype_size(o->dtype), &n) || !spy_add_ok(o->v.off, n, &end) || end > r->lx_bytes)
        return spy_fail(SPY_E_SCRATCHPAD, -1, "loop record: instrs[%u].%s at %llu is outside the %llu-byte "
                        "scratchpad layout", i, which, (unsigned long long)o->v.off,
                        (unsigned long long)r->lx_bytes);
    return SPY_OK;
}

/* |c| x the indices of variable j is at most BOUND. */
static bool bounded(const spy_loop_record *r, int64_t c, uint32_t j)
{
    int64_t x;
    return c > -BOUND && c < BOUND && !__builtin_mul_overflow(abs64(c), (int64_t)r->sizes[j], &x) && x <= BOUND;
}

static spy_status check_access(const spy_loop_record *r, uint32_t i, uint64_t columns)
{
    const spy_loop_access *a = &r->accesses[i];
    if (a->op != SPY_OP_LOAD && a->op != SPY_OP_STORE && a->op != SPY_OP_GATHER && a->op != SPY_OP_SCATTER)
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: accesses[%u].op %u is not a load, store, gather or "
                        "scatter", i, a->op);
    if (a->kind < SPY_OPND_TILE || a->kind > SPY_OPND_SCALAR)
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: accesses[%u].kind %u is not a tile, row, column or "
                        "scalar", i, a->kind);
    if (a->slot >= r->nslots)
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: accesses[%u].slot %u names no slot of %u", i, a->slot,
                        r->nslots);
    if (a->op == SPY_OP_GATHER && (a->level < 1 || a->level >= r->levels))
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: accesses[%u].level %u is not a stage 1 .. %u", i,
                        a->level, r->levels - 1);
    uint64_t bytes;
    if (spy_layout_bytes(&a->layout, &bytes) != SPY_OK || a->layout.stick_bytes != r->stick_bytes ||
        bytes >= (1ull << 48))
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: accesses[%u].layout (%llu x %llu of %u bytes, sticks "
                        "of %u) is not a storage of the record's sticks under 2^48 bytes", i,
                        (unsigned long long)a->layout.rows, (unsigned long long)a->layout.row_len,
                        a->layout.itemsize, a->layout.stick_bytes);
    if (bytes > r->slot_extent[a->slot])
        return spy_fail(SPY_E_BAD_ADDRESS, -1, "loop record: accesses[%u].layout's %llu bytes are outside slot %u "
                        "of %llu bytes", i, (unsigned long long)bytes, a->slot,
                        (unsigned long long)r->slot_extent[a->slot]);
    if (a->itemsize != 1 && a->itemsize != 2 && a->itemsize != 4 && a->itemsize != 8)
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: accesses[%u].itemsize %u is not 1, 2, 4 or 8", i,
                        a->itemsize);
    if (a->masked >> r->nvars)
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: accesses[%u].masked 0x%x names a variable past %u", i,
                        a->masked, r->nvars);
    if (a->base <= -BOUND || a->base >= BOUND)
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: accesses[%u].base %lld is outside +-2^56", i,
                        (long long)a->base);
    for (uint32_t j = 0; j < r->nvars; j++) {
        if (masks(a, j) && !(0 <= a->lo[j] && a->lo[j] <= a->hi[j] && (uint64_t)a->hi[j] <= r->sizes[j]))
            return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: accesses[%u] masks variable %u to [lo %lld, hi %lld), "
                            "not inside its %llu indices", i, j, (long long)a->lo[j], (long long)a->hi[j],
                            (unsigned long long)r->sizes[j]);
        if (!bounded(r, a->coeffs[j], j))
            return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: accesses[%u].coeffs[%u] = %lld over its indices "
                            "is outside +-2^56", i, j, (long long)a->coeffs[j]);
    }
    if (a->lx_pitch > (1u << 26))
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: accesses[%u].lx_pitch %u is more than 2^26", i,
                        a->lx_pitch);
    if ((a->kind == SPY_OPND_TILE || a->kind == SPY_OPND_COL) && a->lx_pitch < columns)
        return spy_fail(SPY_E_SCRATCHPAD, -1, "loop record: accesses[%u].lx_pitch %u does not hold a tile row of "
                        "%llu columns", i, a->lx_pitch, (unsigned long long)columns);
    bool gather = a->op == SPY_OP_GATHER || a->op == SPY_OP_SCATTER;
    for (int p = 0; p < 2; p++) {
        if (a->lx_off[p] + region_bytes(a, r->rows_per_tile) > r->lx_bytes)
            return spy_fail(SPY_E_SCRATCHPAD, -1, "loop record: accesses[%u].lx_off[%d] %u and %u rows are outside "
                            "the %llu-byte scratchpad layout", i, p, a->lx_off[p], r->rows_per_tile,
                            (unsigned long long)r->lx_bytes);
        if (gather && a->idx_off[p] % 8)
            return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: accesses[%u].idx_off[%d] %u is not a multiple of "
                            "its 8-byte indices", i, p, a->idx_off[p]);
        if (gather && a->idx_off[p] + 8ull * r->rows_per_tile > r->lx_bytes)
            return spy_fail(SPY_E_SCRATCHPAD, -1, "loop record: accesses[%u].idx_off[%d] %u and %u rows are "
                            "outside the %llu-byte scratchpad layout", i, p, a->idx_off[p], r->rows_per_tile,
                            (unsigned long long)r->lx_bytes);
    }
    return SPY_OK;
}

/* A tile's (or a group's) fields: its core, its indices of the block variable, its fixed ones. */
static spy_status check_box(const spy_loop_record *r, const char *what, uint32_t i, const spy_loop_tile *t)
{
    if (t->core >= r->num_cores)
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: %s[%u].core %u is not one of %u", what, i, t->core,
                        r->num_cores);
    if (!t->size)
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: %s[%u].size is 0", what, i);
    if (r->block >= 0 && (t->start < 0 || (uint64_t)t->start + t->size > r->sizes[r->block]))
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: %s[%u].start %lld + size %u is outside the %llu "
                        "indices of the block variable", what, i, (long long)t->start, t->size,
                        (unsigned long long)r->sizes[r->block]);
    for (int32_t j = 0; j < r->block; j++)
        if (t->fixed[j] < 0 || (uint64_t)t->fixed[j] >= r->sizes[j])
            return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: %s[%u].fixed[%d] %lld is outside the %llu "
                            "indices of variable %d", what, i, j, (long long)t->fixed[j],
                            (unsigned long long)r->sizes[j], j);
    return SPY_OK;
}

/* Bytes of a tile row of an access in its scratchpad region. */
static uint64_t row_bytes(const spy_loop_access *a)
{
    return a->kind == SPY_OPND_TILE ? (uint64_t)a->lx_pitch * a->itemsize : a->itemsize;
}

/* The merged groups: each inside the block variable, its region inside the layout for every
 * merged store; each tile of a group inside its rows; every group with a tile. Only stores
 * of values along the rows merge. `inner`: tile rows per index of the block variable. */
static spy_status check_merges(const spy_loop_record *r, uint64_t inner)
{
    if (!r->nmerges)
        return SPY_OK;
    if (!r->merges || !r->tile_merge || !r->merge_off || r->block < 0)
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: %u merged groups without their arrays or a block "
                        "variable", r->nmerges);
    for (uint32_t i = 0; i < r->naccesses; i++) {
        const spy_loop_access *a = &r->accesses[i];
        if (r->merge_off[i] != SPY_LOOP_UNMERGED &&
            (a->op != SPY_OP_STORE || (a->kind != SPY_OPND_TILE && a->kind != SPY_OPND_ROW)))
            return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: accesses[%u] merges but is not a store of values "
                            "along the rows", i);
    }
    for (uint32_t g = 0; g < r->nmerges; g++) {
        const spy_loop_merge *m = &r->merges[g];
        spy_status s = check_box(r, "merges", g, &m->box);
        if (s != SPY_OK)
            return s;
        uint64_t rows = (uint64_t)m->box.size * inner; /* below 2^40 x 2^26: no overflow */
        for (uint32_t i = 0; i < r->naccesses; i++) {
            uint64_t off = r->merge_off[i], n;
            if (off == SPY_LOOP_UNMERGED)
                continue;
            if (!spy_mul_ok(rows, row_bytes(&r->accesses[i]), &n) || !spy_add_ok(n, off + m->lx_off, &n) ||
                n > r->lx_bytes)
                return spy_fail(SPY_E_SCRATCHPAD, -1, "loop record: merges[%u]'s region for accesses[%u] at %llu is "
                                "outside the %llu-byte scratchpad layout", g, i,
                                (unsigned long long)(off + m->lx_off), (unsigned long long)r->lx_bytes);
        }
    }
    uint64_t *rows = calloc(r->nmerges, sizeof *rows); /* per group: its tiles' indices of the block variable */
    if (!rows)
        return NOMEM();
    spy_status s = SPY_OK;
    for (uint32_t t = 0; t < r->ntiles && s == SPY_OK; t++) {
        int32_t g = r->tile_merge[t];
        if (g < 0)
            continue;
        const spy_loop_tile *tile = &r->tiles[t], *in = (uint32_t)g < r->nmerges ? &r->merges[g].box : NULL;
        bool inside = in && tile->start >= in->start && tile->start + tile->size <= in->start + in->size;
        for (int32_t j = 0; inside && j < r->block; j++)
            inside = tile->fixed[j] == in->fixed[j];
        if (!inside)
            s = spy_fail(SPY_E_INVALID_ARG, -1, "loop record: tiles[%u] is not inside its group %d of %u", t, g,
                         r->nmerges);
        else
            rows[g] += tile->size;
    }
    for (uint32_t g = 0; g < r->nmerges && s == SPY_OK; g++)
        if (rows[g] != r->merges[g].box.size)
            s = spy_fail(SPY_E_INVALID_ARG, -1, "loop record: the tiles of merges[%u] hold %llu of its %u indices "
                         "of the block variable", g, (unsigned long long)rows[g], r->merges[g].box.size);
    free(rows);
    return s;
}

static spy_status check_record(const spy_loop_record *r)
{
    if (!r->num_cores || r->num_cores >= SPY_CORE_CARD)
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: num_cores %u is not 1 .. %u", r->num_cores,
                        SPY_CORE_CARD - 1);
    if (!r->stick_bytes || (r->stick_bytes & (r->stick_bytes - 1)) || r->stick_bytes > 65536)
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: stick_bytes %u is not a power of two up to 65536",
                        r->stick_bytes);
    if (r->scratchpad_bytes >= (1ull << 32))
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: scratchpad_bytes %llu is not below 2^32",
                        (unsigned long long)r->scratchpad_bytes);
    if (r->lx_bytes > r->scratchpad_bytes)
        return spy_fail(SPY_E_SCRATCHPAD, -1, "loop record: lx_bytes %llu are outside a %llu-byte scratchpad",
                        (unsigned long long)r->lx_bytes, (unsigned long long)r->scratchpad_bytes);
    if (r->nvars > MAXV || r->nrow > r->nvars)
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: nvars %u, nrow %u: not nrow <= nvars <= %u", r->nvars,
                        r->nrow, MAXV);
    if (r->nrow ? r->block < 0 || (uint32_t)r->block >= r->nrow : r->block != -1)
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: block %d is not a row variable (nrow %u)", r->block,
                        r->nrow);
    if (!r->levels || r->levels > (1u << 16))
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: levels %u is not 1 .. 2^16", r->levels);
    if (!r->rows_per_tile || r->rows_per_tile > (1u << 26))
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: rows_per_tile %u is not 1 .. 2^26", r->rows_per_tile);
    uint64_t rows = 1, cols = 1;
    for (uint32_t j = 0; j < r->nvars; j++) {
        if (r->sizes[j] > (1ull << 40))
            return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: sizes[%u] %llu is more than 2^40", j,
                            (unsigned long long)r->sizes[j]);
        if ((int32_t)j > r->block && j < r->nrow && !spy_mul_ok(rows, r->sizes[j], &rows))
            rows = UINT64_MAX;
        if (j >= r->nrow && !spy_mul_ok(cols, r->sizes[j], &cols))
            cols = UINT64_MAX;
    }
    if (rows > r->rows_per_tile || cols > (1u << 26))
        return spy_fail(SPY_E_SCRATCHPAD, -1, "loop record: sizes make tile rows of %llu columns and %llu rows per "
                        "index of the block variable, past rows_per_tile %u", (unsigned long long)cols,
                        (unsigned long long)rows, r->rows_per_tile);
    if ((r->nslots && !r->slot_extent) || (r->naccesses && !r->accesses) || (r->ntiles && !r->tiles) ||
        !r->stages || (r->ninstrs && !r->instrs) || (r->nconsts && !r->consts))
        return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: a count without its array (nslots %u, naccesses %u, "
                        "ntiles %u, stages, ninstrs %u, nconsts %u)", r->nslots, r->naccesses, r->ntiles,
                        r->ninstrs, r->nconsts);
    for (uint32_t l = 0; l < r->levels; l++)
        for (int p = 0; p < 2; p++)
            if (r->stages[l].first[p] > r->ninstrs || r->stages[l].count > r->ninstrs - r->stages[l].first[p])
                return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: stages[%u].first[%d] %u + count %u is past "
                                "ninstrs %u", l, p, r->stages[l].first[p], r->stages[l].count, r->ninstrs);
    for (uint32_t i = 0; i < r->ninstrs; i++) {
        const spy_loop_instr *x = &r->instrs[i];
        if (x->tile_rows && rows % x->tile_rows)
            return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: instrs[%u] covers one in %u tile rows, which does "
                            "not divide the %llu rows per index of the block variable", i, x->tile_rows,
                            (unsigned long long)rows);
        uint64_t irows = x->tile_rows ? r->rows_per_tile / x->tile_rows : x->instr.rows;
        if (!irows || irows > (1u << 26) || !x->instr.cols || x->instr.cols > (1u << 26))
            return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: instrs[%u] covers %llu x %u elements, not 1 .. "
                            "2^26 each way", i, (unsigned long long)irows, x->instr.cols);
        spy_status s = check_operand(r, i, "dst", &x->instr.dst, irows, x->instr.cols);
        for (int k = 0; k < 3 && s == SPY_OK; k++)
            s = check_operand(r, i, k == 0 ? "src[0]" : k == 1 ? "src[1]" : "src[2]", &x->instr.src[k], irows,
                              x->instr.cols);
        if (s != SPY_OK)
            return s;
    }
    for (uint32_t i = 0; i < r->nconsts; i++) {
        const spy_loop_const *c = &r->consts[i];
        if (c->lx_off + 8ull > r->lx_bytes)
            return spy_fail(SPY_E_SCRATCHPAD, -1, "loop record: consts[%u].lx_off %u is outside the %llu-byte "
                            "scratchpad layout", i, c->lx_off, (unsigned long long)r->lx_bytes);
        if (c->unit < 1 || c->base <= -BOUND || c->base >= BOUND)
            return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: consts[%u] has unit %lld (not 1 or more) or base "
                            "%lld (outside +-2^56)", i, (long long)c->unit, (long long)c->base);
        for (int32_t j = 0; j <= r->block; j++)
            if (!bounded(r, c->coeffs[j], (uint32_t)j))
                return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: consts[%u].coeffs[%d] = %lld over its indices "
                                "is outside +-2^56", i, j, (long long)c->coeffs[j]);
    }
    for (uint32_t i = 0; i < r->naccesses; i++) {
        spy_status s = check_access(r, i, cols);
        if (s != SPY_OK)
            return s;
    }
    return check_merges(r, rows);
}

/* The tile fields, every box against its storage and its region, every gather's pieces;
 * the stage programs' (parity, size) pairs in the order tiles need them. */
/* Box dimensions of a direct access. */
static uint32_t box_dims(const builder *st, const spy_loop_access *a)
{
    uint32_t n = (a->kind == SPY_OPND_TILE || a->kind == SPY_OPND_ROW ? st->sh.nrows : 0) +
                 (a->kind == SPY_OPND_TILE || a->kind == SPY_OPND_COL ? st->sh.ncols : 0);
    return n ? n : 1;
}

static bool direct(const spy_loop_access *a) { return a->op == SPY_OP_LOAD || a->op == SPY_OP_STORE; }

/* The builder's arrays sized by the record, carved from one allocation (8-byte aligned). */
static spy_status arrays_init(builder *st)
{
    const spy_loop_record *r = st->r;
    st->width = r->nmerges ? 3 : 2;
    for (uint32_t i = 0; i < r->naccesses; i++)
        st->width += direct(&r->accesses[i]) && r->accesses[i].masked ? box_dims(st, &r->accesses[i]) + 3 : 1;
    st->table_cap = 16;
    while (st->table_cap < 2ull * r->ntiles)
        st->table_cap *= 2;
    uint64_t nt = r->ntiles, na = r->naccesses;
    uint64_t sizes[] = {na * sizeof *st->cache, na * sizeof *st->dmas, st->table_cap * sizeof *st->table,
                        nt * sizeof *st->shape_of, nt * na * sizeof *st->starts, nt * 4 * sizeof *st->class_of,
                        nt * sizeof *st->rank, na * sizeof *st->boxes, na * sizeof *st->moves,
                        2 * nt * sizeof *st->last};
    void **to[] = {(void **)&st->cache, (void **)&st->dmas, (void **)&st->table, (void **)&st->shape_of,
                   (void **)&st->starts, (void **)&st->class_of, (void **)&st->rank, (void **)&st->boxes,
                   (void **)&st->moves, (void **)&st->last};
    uint64_t total = 0;
    for (size_t i = 0; i < SPY_ARRAY_LEN(sizes); i++)
        total += (sizes[i] + 7) / 8 * 8; /* counts below 2^32 each: no overflow */
    uint8_t *at = st->arena = malloc(total + 8);
    if (!at)
        return NOMEM();
    for (size_t i = 0; i < SPY_ARRAY_LEN(sizes); i++) {
        *to[i] = at;
        at += (sizes[i] + 7) / 8 * 8;
    }
    memset(st->table, 0, st->table_cap * sizeof *st->table);
    memset(st->class_of, 0xff, nt * 4 * sizeof *st->class_of); /* -1: no class yet */
    for (uint64_t i = 0; i < na; i++) {
        st->cache[i] = (pieces_of){-1, 0, 0};
        st->dmas[i].valid = false;
    }
    return SPY_OK;
}

/* Tile t's shape (its index in st->shapes) and where its boxes start, from its boxes
 * (moves[i]: access i's box moves something). */
static spy_status shape_tile(builder *st, uint32_t t, uint32_t seq, const box *boxes, const bool *moves)
{
    const spy_loop_record *r = st->r;
    const spy_loop_tile *tile = &r->tiles[t];
    uint64_t n = st->shapes.len / st->width;
    int64_t *k = push(&st->shapes, st->width), *key = k; /* a new shape, unless it is known */
    if (!k)
        return NOMEM();
    *k++ = seq % 2, *k++ = tile->size;
    if (r->nmerges)
        *k++ = merged(r, t);
    int64_t *starts = st->starts + (uint64_t)t * r->naccesses;
    for (uint32_t i = 0; i < r->naccesses; i++) {
        const spy_loop_access *a = &r->accesses[i];
        int64_t row_len = (int64_t)a->layout.row_len;
        starts[i] = -1;
        if (!direct(a)) {
            *k++ = floormod(origin(r, a->coeffs, a->base, tile), row_len);
            continue;
        }
        const box *b = &boxes[i];
        if (moves[i] && !box_empty(b))
            starts[i] = phys(&a->layout, b->base);
        int64_t col = moves[i] && a->layout.rows > 1 ? floormod(b->base, row_len) : 0;
        if (!a->masked) {
            *k++ = col;
            continue;
        }
        uint32_t nb = box_dims(st, a);
        memset(k, 0, (nb + 3) * sizeof *k);
        k[0] = !moves[i];
        for (uint32_t d = 0; moves[i] && d < b->n; d++)
            k[1 + d] = b->count[d];
        k[1 + nb] = moves[i] ? b->lx_off : 0;
        k[2 + nb] = col;
        k += nb + 3;
    }
    uint64_t h = 1469598103934665603ull;
    for (uint32_t x = 0; x < st->width; x++)
        h = (h ^ (uint64_t)key[x]) * 1099511628211ull;
    for (h &= st->table_cap - 1;; h = (h + 1) & (st->table_cap - 1)) {
        uint32_t at = st->table[h];
        if (!at) {
            st->table[h] = (uint32_t)n + 1;
            st->shape_of[t] = (uint32_t)n;
            return SPY_OK;
        }
        if (!memcmp((const int64_t *)st->shapes.data + (uint64_t)(at - 1) * st->width, key,
                    st->width * sizeof *key)) {
            st->shape_of[t] = at - 1;
            st->shapes.len -= st->width; /* known: the pushed copy goes */
            return SPY_OK;
        }
    }
}

/* A box of access i inside its storage and inside a scratchpad region of `region` bytes. */
static spy_status box_inside(const spy_loop_access *a, uint32_t i, const box *b, uint64_t region, const char *what,
                             uint32_t t)
{
    int64_t lo = b->base, hi = b->base, lx_hi = b->lx_off;
    for (uint32_t k = 0; k < b->n; k++) {
        int64_t reach = b->stride[k] * (b->count[k] - 1);
        *(reach < 0 ? &lo : &hi) += reach;
        lx_hi += b->lx[k] * (b->count[k] - 1);
    }
    uint64_t numel = (uint64_t)(a->layout.rows ? a->layout.rows : 1) * a->layout.row_len;
    if (lo < 0 || (uint64_t)hi >= numel)
        return spy_fail(SPY_E_BAD_ADDRESS, -1, "loop record: accesses[%u] moves elements %lld .. %lld of %s %u, "
                        "outside the %llu elements of its storage", i, (long long)lo, (long long)hi, what, t,
                        (unsigned long long)numel);
    if (b->lx_off < 0 || (uint64_t)lx_hi + a->itemsize > region)
        return spy_fail(SPY_E_SCRATCHPAD, -1, "loop record: accesses[%u] moves bytes %lld .. %lld of its scratchpad "
                        "region in %s %u, outside its %llu bytes", i, (long long)b->lx_off, (long long)lx_hi, what,
                        t, (unsigned long long)region);
    return SPY_OK;
}

static spy_status check_tiles(builder *st)
{
    const spy_loop_record *r = st->r;
    bool *moves = st->moves;
    uint32_t seq = 0;
    for (uint32_t t = 0; t < r->ntiles; t++) {
        const spy_loop_tile *tile = &r->tiles[t];
        seq = t && r->tiles[t - 1].core == tile->core ? seq + 1 : 0;
        if (tile->core >= r->num_cores)
            return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: tiles[%u].core %u is not one of %u", t, tile->core,
                            r->num_cores);
        if (!tile->size || (uint64_t)tile->size * (uint64_t)st->sh.inner > r->rows_per_tile)
            return spy_fail(SPY_E_SCRATCHPAD, -1, "loop record: tiles[%u].size %u makes rows outside rows_per_tile "
                            "%u", t, tile->size, r->rows_per_tile);
        if (r->block >= 0 && (tile->start < 0 || (uint64_t)tile->start + tile->size > r->sizes[r->block]))
            return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: tiles[%u].start %lld + size %u is outside the %llu "
                            "indices of the block variable", t, (long long)tile->start, tile->size,
                            (unsigned long long)r->sizes[r->block]);
        for (int32_t j = 0; j < r->block; j++)
            if (tile->fixed[j] < 0 || (uint64_t)tile->fixed[j] >= r->sizes[j])
                return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: tiles[%u].fixed[%d] %lld is outside the %llu "
                                "indices of variable %d", t, j, (long long)tile->fixed[j],
                                (unsigned long long)r->sizes[j], j);
        uint64_t pair = (uint64_t)(seq % 2) << 32 | tile->size, *pairs = st->pairs.data, k = 0;
        while (k < st->pairs.len && pairs[k] != pair)
            k++;
        if (k == st->pairs.len) {
            uint64_t *x = spy_vec_push(&st->pairs, 1);
            if (!x)
                return spy_fail(SPY_E_HOST_NOMEM, -1, "no host memory for a loop kernel's stages");
            *x = pair;
        }
        for (uint32_t i = 0; i < r->naccesses; i++) {
            const spy_loop_access *a = &r->accesses[i];
            if (a->op == SPY_OP_GATHER || a->op == SPY_OP_SCATTER) {
                const pieces_of *pc;
                int64_t limit;
                spy_status s = a->element_rows ? SPY_OK : gather_pieces(st, i, tile, &pc, &limit);
                if (s != SPY_OK)
                    return s;
                continue;
            }
            box *bp = &st->boxes[i];
            moves[i] = box_of(r, &st->sh, a, tile, bp);
            if (!moves[i] || box_empty(bp))
                continue;
            spy_status s = box_inside(a, i, bp, region_bytes(a, r->rows_per_tile), "tile", t);
            if (s != SPY_OK)
                return s;
        }
        spy_status s = shape_tile(st, t, seq, st->boxes, moves);
        if (s != SPY_OK)
            return s;
    }
    return SPY_OK;
}

/* ---- building ------------------------------------------------------------------------------ */

/* One tile being built: where its commands start, what its FREE_IN / FREE_OUT name. */
typedef struct tile_build {
    const spy_loop_tile *tile;
    uint32_t t, parity;
    uint64_t first;
    int64_t free_in, free_out; /* commands of the graph, or -1 */
    uint32_t nlisted;
    bool record;               /* the first tile of its class: its template is recorded */
    bool global;               /* a group's store: its dependencies are commands of the graph */
    int64_t lx_at;             /* a group's store: its region, or -1: the tile's slot of its parity */
} tile_build;

static spy_status too_big(void)
{
    return spy_fail(SPY_E_INVALID_ARG, -1, "loop record: its tiles make a program block of more than %llu bytes",
                    (unsigned long long)SPY_BUILD_MAX_BYTES);
}

/* Room for n more records of `size` bytes in the block. */
static bool room(builder *st, uint64_t n, uint64_t size)
{
    uint64_t b;
    if (!spy_mul_ok(n, size, &b) || !spy_add_ok(st->bytes, b, &b) || b > SPY_BUILD_MAX_BYTES)
        return false;
    st->bytes = b;
    return true;
}

/* A new command of the tile: its dependencies follow it (see depend). */
static spy_cmd *add_cmd(builder *st, const tile_build *tb, uint8_t op, uint8_t flags, int64_t *local)
{
    spy_cmd *c = push(&st->cmds, 1);
    if (!c)
        return NULL;
    c->op = op;
    c->flags = flags;
    c->core = (uint16_t)tb->tile->core;
    c->dep_begin = (uint32_t)st->deps32.len; /* below 2^28: the block stays under SPY_BUILD_MAX_BYTES */
    *local = (int64_t)(st->cmds.len - 1 - tb->first);
    return c;
}

/* The tile's last command, `local`, waits for `deps` (its own commands, FREE_IN, FREE_OUT). */
static bool depend(builder *st, const tile_build *tb, int64_t local, const int64_t *deps, uint64_t n)
{
    uint32_t *d = push_raw(&st->deps32, n);
    if (n && !d)
        return false;
    for (uint64_t k = 0; k < n; k++)
        d[k] = (uint32_t)(tb->global              ? deps[k]
                          : deps[k] == FREE_IN  ? tb->free_in
                          : deps[k] == FREE_OUT ? tb->free_out
                                                : (int64_t)tb->first + deps[k]);
    ((spy_cmd *)st->cmds.data)[tb->first + (uint64_t)local].ndeps = (uint32_t)n;
    if (tb->record) {
        int64_t *sym = push_raw(&st->tdeps, n);
        if (n && !sym)
            return false;
        if (n)
            memcpy(sym, deps, n * sizeof *deps);
    }
    return true;
}

/* The template's command `local` changes per tile: how (PATCH_*), after which access. */
static bool patch_of(builder *st, const tile_build *tb, int64_t local, uint32_t access, uint32_t kind)
{
    if (!tb->record)
        return true;
    patch *p = push(&st->tpatches, 1);
    if (p)
        *p = (patch){(uint32_t)local, access, kind, 0};
    return p != NULL;
}


/* The DMA commands of a load's or store's box: a pattern's, else a descriptor list's. Their
 * local indices are appended to `made`. */
static spy_status dma(builder *st, tile_build *tb, const spy_loop_access *a, const box *b, const int64_t *deps,
                      uint64_t ndeps, spy_vec *made)
{
    bool load = a->op == SPY_OP_LOAD;
    int64_t lx_base = (tb->lx_at >= 0 ? tb->lx_at : (int64_t)a->lx_off[tb->parity]) + b->lx_off;
    dma_cache *dc = &st->dmas[a - st->r->accesses];
    int64_t c0 = a->layout.rows > 1 ? b->base % (int64_t)a->layout.row_len : 0;
    if (!dc->valid || dc->c0 != c0 || memcmp(dc->count, b->count, b->n * sizeof *b->count)) {
        dc->affine = pattern_of(&a->layout, b->base, b->n, b->count, b->stride, b->lx, &dc->p);
        dc->valid = true;
        dc->c0 = c0;
        memcpy(dc->count, b->count, b->n * sizeof *b->count);
    }
    if (dc->affine) {
        const pattern *p = &dc->p;
        int64_t start = phys(&a->layout, b->base); /* where the pattern starts is where the box does */
        uint64_t nb = pattern_bases(p);
        uint32_t nd = p->ndims < 3 ? p->ndims : 3;
        if (!room(st, nb, sizeof(spy_cmd) + 4 * ndeps))
            return too_big();
        for (uint64_t k = 0; k < nb; k++) {
            int64_t dev, lx, local;
            pattern_base(p, start, k, &dev, &lx);
            lx += lx_base;
            spy_cmd *c = add_cmd(st, tb, (uint8_t)a->op, 0, &local);
            if (!c || !push_i64(made, local) ||
                !patch_of(st, tb, local, (uint32_t)(a - st->r->accesses), load ? PATCH_SRC : PATCH_DST))
                return NOMEM();
            spy_dma *d = &c->u.dma;
            d->src_slot = load ? a->slot : 0;
            d->dst_slot = load ? 0 : a->slot;
            d->src_off = (uint64_t)(load ? dev : lx);
            d->dst_off = (uint64_t)(load ? lx : dev);
            d->run_bytes = (uint32_t)p->run;
            d->ndims = nd;
            for (uint32_t i = 0; i < nd; i++) {
                d->count[i] = (uint32_t)p->dims[i].count;
                d->src_stride[i] = (uint64_t)(load ? p->dims[i].src : p->dims[i].dst);
                d->dst_stride[i] = (uint64_t)(load ? p->dims[i].dst : p->dims[i].src);
            }
            if (!depend(st, tb, local, deps, ndeps))
                return NOMEM();
        }
        return SPY_OK;
    }
    /* runs contiguous on both sides, element by element in box order */
    uint64_t elems = 1;
    for (uint32_t k = 0; k < b->n; k++)
        elems *= (uint64_t)b->count[k]; /* within the region checked: below 2^32 */
    if (!room(st, elems, sizeof(spy_desc)) || !room(st, 1, sizeof(spy_cmd) + 4 * ndeps))
        return too_big();
    int64_t e = a->layout.itemsize, idx[MAXV] = {0}, prev_dev = 0, prev_lx = 0;
    uint64_t first = st->runs.len, n = 0;
    spy_desc *run = NULL;
    for (uint64_t x = 0; x < elems; x++) {
        int64_t at = b->base, lx = lx_base;
        for (uint32_t k = 0; k < b->n; k++) {
            at += idx[k] * b->stride[k];
            lx += idx[k] * b->lx[k];
        }
        int64_t dev = phys(&a->layout, at);
        if (run && dev == prev_dev + e && lx == prev_lx + e) {
            ((spy_desc *)st->runs.data + st->runs.len - 1)->bytes += (uint32_t)e;
        } else {
            run = spy_vec_push(&st->runs, 1);
            if (!run)
                return NOMEM();
            *run = (spy_desc){(uint64_t)(load ? dev : lx), (uint64_t)(load ? lx : dev), (uint32_t)e, 0};
            n++;
        }
        prev_dev = dev, prev_lx = lx;
        for (uint32_t k = b->n; k-- > 0;) { /* the next index, the last dimension fastest */
            if (++idx[k] < b->count[k])
                break;
            idx[k] = 0;
        }
    }
    st->bytes -= (elems - n) * sizeof(spy_desc);
    int64_t local;
    spy_cmd *c = add_cmd(st, tb, (uint8_t)a->op, SPY_DMA_DESCS, &local);
    listed *li = spy_vec_push(&st->listed, 1);
    if (!c || !li || !push_i64(made, local))
        return NOMEM();
    c->u.dma.src_slot = load ? a->slot : 0;
    c->u.dma.dst_slot = load ? 0 : a->slot;
    c->u.dma.desc_count = (uint32_t)n;
    *li = (listed){tb->first + (uint64_t)local, first, n, tb->t, tb->nlisted++};
    return depend(st, tb, local, deps, ndeps) ? SPY_OK : NOMEM();
}

/* The GATHER or SCATTER commands of access i for the tile's rows: one per row piece. */
static spy_status gather(builder *st, tile_build *tb, uint32_t i, const int64_t *deps, uint64_t ndeps, spy_vec *made)
{
    const spy_loop_access *a = &st->r->accesses[i];
    const spy_layout *l = &a->layout;
    uint32_t e = l->itemsize, rows = (uint32_t)(tb->tile->size * st->sh.inner);
    uint32_t pitch = a->kind == SPY_OPND_TILE ? a->lx_pitch * e : e;
    uint32_t data_off = a->lx_off[tb->parity], idx_off = a->idx_off[tb->parity];
    const pieces_of *pc = NULL;
    int64_t limit = (int64_t)l->row_len;
    uint64_t n = 1;
    if (!a->element_rows) {
        spy_status s = gather_pieces(st, i, tb->tile, &pc, &limit);
        if (s != SPY_OK)
            return s;
        n = pc->n;
    }
    if (!room(st, n, sizeof(spy_cmd) + 4 * ndeps))
        return too_big();
    for (uint64_t k = 0; k < n; k++) {
        int64_t local;
        spy_cmd *c = add_cmd(st, tb, (uint8_t)a->op, 0, &local);
        if (!c || !push_i64(made, local))
            return NOMEM();
        spy_gather *g = &c->u.gather;
        g->table_slot = a->slot;
        g->idx_off = idx_off;
        g->idx_dtype = SPY_DT_I64;
        g->nidx = rows;
        g->lx_pitch = pitch;
        g->limit = (uint64_t)limit;
        if (!pc) { /* one item per index, the index counting items of the table's one row */
            g->row_stride = e;
            g->lx_off = data_off;
            g->run_bytes = e;
        } else {
            const piece *x = (const piece *)st->pieces.data + pc->first + k;
            g->table_off = (uint64_t)x->dram;
            g->row_stride = l->stick_bytes;
            g->lx_off = data_off + (uint32_t)x->lx;
            g->run_bytes = (uint32_t)x->run;
            g->ndims = x->ndims;
            for (uint32_t d = 0; d < x->ndims; d++) {
                g->count[d] = (uint32_t)x->dims[d].count;
                g->stride[d] = (uint64_t)x->dims[d].src;
            }
        }
        if (!depend(st, tb, local, deps, ndeps))
            return NOMEM();
    }
    return SPY_OK;
}

/* A merged tile's staged rows of access i sent to its group's region (see spyre.h). */
static spy_status send(builder *st, tile_build *tb, uint32_t i, const int64_t *deps, uint64_t ndeps, spy_vec *made)
{
    const spy_loop_record *r = st->r;
    const spy_loop_access *a = &r->accesses[i];
    int32_t g = r->tile_merge[tb->t];
    const spy_loop_merge *m = &r->merges[g];
    uint64_t rb = row_bytes(a), inner = (uint64_t)st->sh.inner; /* checked: the regions are inside the layout */
    int64_t local;
    if (!room(st, 1, sizeof(spy_cmd) + 4 * ndeps))
        return too_big();
    spy_cmd *c = add_cmd(st, tb, SPY_OP_RING, 0, &local);
    sent *x = spy_vec_push(&st->sent, 1);
    if (!c || !x || !push_i64(made, local))
        return NOMEM();
    c->u.ring.dst_core = m->box.core;
    c->u.ring.src_off = a->lx_off[tb->parity];
    uint64_t at = (uint64_t)(tb->tile->start - m->box.start) * inner * rb; /* the tile's rows among the group's */
    c->u.ring.dst_off = (uint32_t)(m->lx_off + r->merge_off[i] + at);
    c->u.ring.bytes = (uint32_t)((uint64_t)tb->tile->size * inner * rb);
    *x = (sent){(uint32_t)g, tb->t, tb->first + (uint64_t)local};
    return depend(st, tb, local, deps, ndeps) ? SPY_OK : NOMEM();
}

static int by_group(const void *x, const void *y)
{
    const sent *a = x, *b = y;
    if (a->group != b->group)
        return a->group < b->group ? -1 : 1;
    return a->cmd < b->cmd ? -1 : a->cmd > b->cmd;
}

/* Each group's stores of its merged accesses, on its core, after all its tiles' rings. */
static spy_status store_groups(builder *st)
{
    const spy_loop_record *r = st->r;
    sent *all = st->sent.data;
    qsort(all, st->sent.len, sizeof *all, by_group);
    spy_vec *deps = &st->deps;
    spy_status s = SPY_OK;
    for (uint64_t at = 0; at < st->sent.len && s == SPY_OK;) {
        uint32_t g = all[at].group, last = all[at].tile;
        deps->len = 0;
        for (; at < st->sent.len && all[at].group == g && s == SPY_OK; at++) {
            last = all[at].tile; /* the latest: commands are made in tile order */
            if (!push_i64(deps, (int64_t)all[at].cmd))
                s = NOMEM();
        }
        const spy_loop_merge *m = &r->merges[g];
        uint64_t rows = (uint64_t)m->box.size * (uint64_t)st->sh.inner;
        for (uint32_t i = 0; i < r->naccesses && s == SPY_OK; i++) {
            const spy_loop_access *a = &r->accesses[i];
            box b;
            if (r->merge_off[i] == SPY_LOOP_UNMERGED || !box_of(r, &st->sh, a, &m->box, &b) || box_empty(&b))
                continue;
            s = box_inside(a, i, &b, rows * row_bytes(a), "group", g);
            /* a descriptor list goes with the class of the group's last tile */
            tile_build tb = {&m->box, last, 0, st->cmds.len, -1, -1, 0, false, true,
                             (int64_t)m->lx_off + r->merge_off[i]};
            if (s == SPY_OK)
                s = dma(st, &tb, a, &b, deps->data, deps->len, &st->outs);
        }
    }
    return s;
}

/* The index of the stage programs of (parity, size). */
static uint64_t pair_of(const builder *st, uint32_t parity, uint32_t size)
{
    const uint64_t *pairs = st->pairs.data;
    uint64_t k = 0, want = (uint64_t)parity << 32 | size;
    while (pairs[k] != want)
        k++;
    return k;
}

/* Every stage's instructions for each (parity, size) the tiles need, then every tile's
 * prologue. */
static spy_status write_instrs(builder *st)
{
    const spy_loop_record *r = st->r;
    uint64_t total = 0;
    for (uint32_t l = 0; l < r->levels; l++)
        total += r->stages[l].count;
    st->total_instrs = total;
    uint64_t n = st->pairs.len * total + (uint64_t)r->ntiles * r->nconsts;
    if (n > UINT32_MAX || !room(st, n, sizeof(spy_instr)))
        return too_big();
    spy_instr *x = n ? push(&st->instrs, n) : NULL;
    if (n && !x)
        return NOMEM();
    for (uint64_t p = 0; p < st->pairs.len; p++) {
        uint64_t pair = ((const uint64_t *)st->pairs.data)[p];
        uint32_t parity = (uint32_t)(pair >> 32), rows = (uint32_t)((pair & UINT32_MAX) * (uint64_t)st->sh.inner);
        for (uint32_t l = 0; l < r->levels; l++)
            for (uint32_t k = 0; k < r->stages[l].count; k++) {
                const spy_loop_instr *t = &r->instrs[r->stages[l].first[parity] + k];
                *x = t->instr;
                if (t->tile_rows)
                    x->rows = rows / t->tile_rows;
                x++;
            }
    }
    for (uint32_t t = 0; t < r->ntiles; t++)
        for (uint32_t c = 0; c < r->nconsts; c++, x++) {
            const spy_loop_const *k = &r->consts[c];
            x->op = SPY_SFU_IOTA;
            x->rows = x->cols = 1;
            x->dst = (spy_operand){SPY_OPND_SCALAR, SPY_DT_I64, 0, 0, {.off = k->lx_off}};
            int64_t v = floordiv(origin(r, k->coeffs, k->base, &r->tiles[t]), k->unit);
            x->src[0] = (spy_operand){SPY_OPND_IMM, SPY_DT_I64, 0, 0, {.imm_i = v}};
            x->src[1] = x->src[2] = (spy_operand){SPY_OPND_IMM, SPY_DT_I64, 0, 0, {.imm_i = 0}};
        }
    return SPY_OK;
}

/* A tile's commands (see the header); *last_sfu and *last_out: what the tile two places
 * later on its core waits for (-1: nothing). */
static spy_status build_tile(builder *st, tile_build *tb, int64_t *last_sfu, int64_t *last_out)
{
    const spy_loop_record *r = st->r;
    const spy_loop_tile *tile = tb->tile;
    spy_vec *deps = &st->deps;
    spy_vec issued = st->issued, levels = st->levels, prev = st->prev, outs = st->outs; /* given back at the end */
    issued.len = levels.len = prev.len = outs.len = 0;
    spy_status s = SPY_OK;
    int64_t free_in[1] = {FREE_IN};
    uint64_t nin = tb->free_in >= 0;
    for (uint32_t i = 0; i < r->naccesses && s == SPY_OK; i++) {
        const spy_loop_access *a = &r->accesses[i];
        box b;
        if (a->op == SPY_OP_LOAD && box_of(r, &st->sh, a, tile, &b) && !box_empty(&b)) {
            uint64_t before = issued.len;
            s = dma(st, tb, a, &b, free_in, nin, &issued);
            for (uint64_t k = before; k < issued.len && s == SPY_OK; k++)
                if (!push_i64(&levels, 0))
                    s = NOMEM();
        }
    }
    if (s == SPY_OK && r->nconsts) { /* the prologue */
        int64_t local;
        spy_cmd *c = NULL;
        if (!room(st, 1, sizeof(spy_cmd)))
            s = too_big();
        else if (!(c = add_cmd(st, tb, SPY_OP_SFU, 0, &local)) || !push_i64(&prev, local) ||
                 !patch_of(st, tb, local, 0, PATCH_PROLOGUE))
            s = NOMEM();
        else {
            c->u.sfu.instr_begin = (uint32_t)(st->pairs.len * st->total_instrs + (uint64_t)tb->t * r->nconsts);
            c->u.sfu.ninstrs = r->nconsts;
        }
    }
    uint64_t pair = s == SPY_OK ? pair_of(st, tb->parity, tile->size) : 0, at = 0;
    for (uint32_t l = 0; l < r->levels && s == SPY_OK; l++) {
        deps->len = 0;
        for (uint64_t k = 0; k < issued.len && s == SPY_OK; k++)
            if (((int64_t *)levels.data)[k] == l && !push_i64(deps, ((int64_t *)issued.data)[k]))
                s = NOMEM();
        if (s == SPY_OK && !push_all(deps, &prev))
            s = NOMEM();
        if (s == SPY_OK && l == 0 && tb->free_out >= 0 && !push_i64(deps, FREE_OUT))
            s = NOMEM();
        if (s != SPY_OK)
            break;
        prev.len = 0;
        if (r->stages[l].count) {
            int64_t local;
            if (!room(st, 1, sizeof(spy_cmd) + 4 * deps->len)) {
                s = too_big();
                break;
            }
            spy_cmd *c = add_cmd(st, tb, SPY_OP_SFU, 0, &local);
            if (!c || !push_i64(&prev, local)) {
                s = NOMEM();
                break;
            }
            c->u.sfu.instr_begin = (uint32_t)(pair * st->total_instrs + at);
            c->u.sfu.ninstrs = r->stages[l].count;
            if (!depend(st, tb, local, deps->data, deps->len)) {
                s = NOMEM();
                break;
            }
        } else {
            if (!push_all(&prev, deps))
                s = NOMEM();
        }
        at += r->stages[l].count;
        for (uint32_t i = 0; i < r->naccesses && s == SPY_OK; i++) {
            const spy_loop_access *a = &r->accesses[i];
            if (a->op != SPY_OP_GATHER || a->level != l + 1)
                continue;
            deps->len = 0;
            if (!push_all(deps, &prev))
                s = NOMEM();
            if (s == SPY_OK && nin && !push_i64(deps, FREE_IN))
                s = NOMEM();
            uint64_t before = issued.len;
            if (s == SPY_OK)
                s = gather(st, tb, i, deps->data, deps->len, &issued);
            for (uint64_t k = before; k < issued.len && s == SPY_OK; k++)
                if (!push_i64(&levels, l + 1))
                    s = NOMEM();
        }
    }
    *last_sfu = -1;
    for (uint64_t k = 0; k < prev.len; k++) /* the tile's own commands among them */
        if (((int64_t *)prev.data)[k] >= 0 && ((int64_t *)prev.data)[k] > *last_sfu)
            *last_sfu = ((int64_t *)prev.data)[k];
    if (*last_sfu < 0)
        for (uint64_t k = 0; k < issued.len; k++)
            if (((int64_t *)levels.data)[k] == 0 && ((int64_t *)issued.data)[k] > *last_sfu)
                *last_sfu = ((int64_t *)issued.data)[k];
    for (uint32_t i = 0; i < r->naccesses && s == SPY_OK; i++) {
        const spy_loop_access *a = &r->accesses[i];
        box b;
        if (a->op == SPY_OP_SCATTER)
            s = gather(st, tb, i, prev.data, prev.len, &outs);
        else if (merged(r, tb->t) && r->merge_off[i] != SPY_LOOP_UNMERGED)
            continue; /* sent below */
        else if (a->op == SPY_OP_STORE && box_of(r, &st->sh, a, tile, &b) && !box_empty(&b))
            s = dma(st, tb, a, &b, prev.data, prev.len, &outs);
    }
    /* a merged tile's rings last, each after the tile's other stores and rings: the ring has
     * an engine of its own, and the tile two places later waits for the tile's last one */
    for (uint32_t i = 0; i < r->naccesses && s == SPY_OK && merged(r, tb->t); i++) {
        if (r->merge_off[i] == SPY_LOOP_UNMERGED)
            continue;
        deps->len = 0;
        if (!push_all(deps, &prev) || !push_all(deps, &outs))
            s = NOMEM();
        if (s == SPY_OK)
            s = send(st, tb, i, deps->data, deps->len, &outs);
    }
    *last_out = -1;
    for (uint64_t k = 0; k < outs.len; k++)
        if (((int64_t *)outs.data)[k] > *last_out)
            *last_out = ((int64_t *)outs.data)[k];
    if (*last_sfu >= 0)
        *last_sfu += (int64_t)tb->first;
    if (*last_out >= 0)
        *last_out += (int64_t)tb->first;
    st->issued = issued, st->levels = levels, st->prev = prev, st->outs = outs;
    return s;
}

/* ---- classes of alike tiles ------------------------------------------------------------------- */

/* The tile's commands as a copy of its class's template (see klass). */
static spy_status replicate(builder *st, tile_build *tb, const klass *k, int64_t *last_sfu, int64_t *last_out)
{
    const spy_loop_record *r = st->r;
    if (!room(st, k->ncmds, sizeof(spy_cmd)) || !room(st, k->ndeps, 4))
        return too_big();
    uint64_t dep0 = st->deps32.len;
    spy_cmd *c = push_raw(&st->cmds, k->ncmds);
    uint32_t *d = push_raw(&st->deps32, k->ndeps);
    if ((k->ncmds && !c) || (k->ndeps && !d))
        return NOMEM();
    memcpy(c, (const spy_cmd *)st->tcmds.data + k->cmd_first, k->ncmds * sizeof *c);
    const int64_t *sym = (const int64_t *)st->tdeps.data + k->dep_first;
    uint64_t at = 0;
    for (uint64_t i = 0; i < k->ncmds; i++) {
        c[i].core = (uint16_t)tb->tile->core;
        c[i].dep_begin = (uint32_t)(dep0 + at);
        for (uint32_t x = 0; x < c[i].ndeps; x++, at++)
            d[at] = (uint32_t)(sym[at] == FREE_IN ? tb->free_in : sym[at] == FREE_OUT ? tb->free_out
                                                                                       : (int64_t)tb->first + sym[at]);
    }
    const patch *p = (const patch *)st->tpatches.data + k->patch_first;
    const int64_t *starts = st->starts + (uint64_t)tb->t * r->naccesses;
    const int64_t *rep = st->starts + (uint64_t)k->rep * r->naccesses;
    for (uint64_t i = 0; i < k->npatches; i++) {
        spy_cmd *x = &c[p[i].cmd];
        if (p[i].kind == PATCH_PROLOGUE)
            x->u.sfu.instr_begin = (uint32_t)(st->pairs.len * st->total_instrs + (uint64_t)tb->t * r->nconsts);
        else if (p[i].kind == PATCH_SRC)
            x->u.dma.src_off += (uint64_t)(starts[p[i].access] - rep[p[i].access]);
        else
            x->u.dma.dst_off += (uint64_t)(starts[p[i].access] - rep[p[i].access]);
    }
    *last_sfu = k->last_sfu >= 0 ? (int64_t)tb->first + k->last_sfu : -1;
    *last_out = k->last_out >= 0 ? (int64_t)tb->first + k->last_out : -1;
    return SPY_OK;
}

/* Tile t's commands: a copy of its class's, or built (the first of its class recorded). */
static spy_status tile(builder *st, tile_build *tb, int64_t *last_sfu, int64_t *last_out)
{
    uint64_t slot = (uint64_t)st->shape_of[tb->t] * 4 + (tb->free_in >= 0) + 2 * (tb->free_out >= 0);
    int32_t c = st->class_of[slot];
    if (c >= 0) {
        const klass *k = (const klass *)st->classes.data + c;
        st->rank[tb->t] = (uint32_t)c;
        return k->templated ? replicate(st, tb, k, last_sfu, last_out) : build_tile(st, tb, last_sfu, last_out);
    }
    klass k = {tb->t, false, 0, 0, st->tdeps.len, 0, st->tpatches.len, 0, -1, -1};
    tb->record = true;
    spy_status s = build_tile(st, tb, last_sfu, last_out);
    if (s != SPY_OK)
        return s;
    k.ncmds = st->cmds.len - tb->first;
    k.cmd_first = st->tcmds.len;
    k.ndeps = st->tdeps.len - k.dep_first;
    k.npatches = st->tpatches.len - k.patch_first;
    k.templated = tb->nlisted == 0 && !merged(st->r, tb->t); /* a ring's destination is the tile's own */
    k.last_sfu = *last_sfu >= 0 ? *last_sfu - (int64_t)tb->first : -1;
    k.last_out = *last_out >= 0 ? *last_out - (int64_t)tb->first : -1;
    spy_cmd *tc = k.templated && k.ncmds ? push_raw(&st->tcmds, k.ncmds) : NULL;
    klass *kk = push(&st->classes, 1);
    if ((k.templated && k.ncmds && !tc) || !kk)
        return NOMEM();
    if (tc)
        memcpy(tc, (const spy_cmd *)st->cmds.data + tb->first, k.ncmds * sizeof *tc);
    *kk = k;
    st->rank[tb->t] = (uint32_t)(st->classes.len - 1);
    st->class_of[slot] = (int32_t)(st->classes.len - 1);
    return SPY_OK;
}

/* ---- descriptor lists in the order of alike tiles ---------------------------------------------- */

typedef struct listed_at {
    uint32_t rank, order;
    uint64_t index;
} listed_at;

static int by_rank(const void *x, const void *y)
{
    const listed_at *a = x, *b = y;
    if (a->rank != b->rank)
        return a->rank < b->rank ? -1 : 1;
    if (a->order != b->order)
        return a->order < b->order ? -1 : 1;
    return a->index < b->index ? -1 : a->index > b->index;
}

/* The descriptor lists into the block: grouped by tiles of alike commands in the order such
 * tiles first appear, then by the command's place in its tile, then by tile. */
static spy_status order_listed(builder *st)
{
    listed_at *at = malloc((st->listed.len + 1) * sizeof *at);
    spy_status s = SPY_OK;
    if (!at)
        return NOMEM();
    const listed *li = st->listed.data;
    for (uint64_t i = 0; i < st->listed.len; i++)
        at[i] = (listed_at){st->rank[li[i].tile], li[i].order, i};
    qsort(at, st->listed.len, sizeof *at, by_rank);
    for (uint64_t i = 0; i < st->listed.len; i++) {
        const listed *x = &li[at[i].index];
        uint64_t first = st->descs.len;
        spy_desc *d = x->n ? push(&st->descs, x->n) : NULL;
        if (x->n && !d) {
            s = NOMEM();
            goto done;
        }
        if (x->n)
            memcpy(d, (const spy_desc *)st->runs.data + x->first, x->n * sizeof *d);
        ((spy_cmd *)st->cmds.data)[x->cmd].u.dma.src_off = first;
    }
done:
    free(at);
    return s;
}

/* ---- the entry point --------------------------------------------------------------------------- */

/* The block: the record's slots and the sections as they were made. */
static spy_status encode(const builder *st, spy_built *out)
{
    const spy_loop_record *r = st->r;
    uint64_t total;
    if (!spy_block_bytes(r->nslots, st->cmds.len, st->deps32.len, st->descs.len, &total) ||
        st->instrs.len > UINT32_MAX || total + st->instrs.len * sizeof(spy_instr) > SPY_BUILD_MAX_BYTES)
        return too_big();
    total += st->instrs.len * sizeof(spy_instr);
    spy_block_sections blk;
    spy_status s = spy_block_alloc(total, r->nslots, (uint32_t)st->cmds.len, (uint32_t)st->deps32.len,
                                   (uint32_t)st->descs.len, out, &blk);
    if (s != SPY_OK)
        return s;
    ((spy_job_header *)out->data)->ninstrs = (uint32_t)st->instrs.len;
    for (uint32_t i = 0; i < r->nslots; i++)
        blk.slots[i] = (spy_slot){SPY_SLOT_DRAM, 0, r->slot_extent[i]};
    const spy_vec *sections[] = {&st->cmds, &st->deps32};
    void *to[] = {blk.cmds, blk.deps};
    for (size_t i = 0; i < SPY_ARRAY_LEN(sections); i++)
        if (sections[i]->len)
            memcpy(to[i], sections[i]->data, (size_t)(sections[i]->len * sections[i]->elem));
    spy_instr *instrs = (spy_instr *)blk.descs; /* the instructions come before the descriptors */
    if (st->instrs.len)
        memcpy(instrs, st->instrs.data, (size_t)st->instrs.len * sizeof *instrs);
    if (st->descs.len)
        memcpy(instrs + st->instrs.len, st->descs.data, (size_t)st->descs.len * sizeof(spy_desc));
    return SPY_OK;
}

spy_status spy_build_loop(const spy_loop_record *r, spy_built *out)
{
    if (!r || !out)
        return spy_fail(SPY_E_INVALID_ARG, -1, "null loop record or output");
    out->data = NULL;
    out->bytes = 0;
    spy_status s = check_record(r);
    if (s != SPY_OK)
        return s;
    builder st;
    memset(&st, 0, sizeof st);
    st.r = r;
    shape_of(r, &st.sh);
    st.cmds.elem = sizeof(spy_cmd);
    st.deps32.elem = sizeof(uint32_t);
    st.instrs.elem = sizeof(spy_instr);
    st.descs.elem = sizeof(spy_desc);
    st.pieces.elem = sizeof(piece);
    st.runs.elem = sizeof(spy_desc);
    st.listed.elem = sizeof(listed);
    st.pairs.elem = sizeof(uint64_t);
    st.classes.elem = sizeof(klass);
    st.tcmds.elem = sizeof(spy_cmd);
    st.tpatches.elem = sizeof(patch);
    st.sent.elem = sizeof(sent);
    spy_vec *lists[] = {&st.shapes, &st.tdeps, &st.deps, &st.issued, &st.levels, &st.prev, &st.outs};
    for (size_t i = 0; i < SPY_ARRAY_LEN(lists); i++)
        lists[i]->elem = sizeof(int64_t);
    st.bytes = sizeof(spy_job_header) + (uint64_t)r->nslots * sizeof(spy_slot);
    s = arrays_init(&st);
    if (s == SPY_OK)
        s = check_tiles(&st);
    int64_t *last = st.last;
    if (s == SPY_OK)
        s = write_instrs(&st);
    uint32_t seq = 0;
    for (uint32_t t = 0; t < r->ntiles && s == SPY_OK; t++) {
        seq = t && r->tiles[t - 1].core == r->tiles[t].core ? seq + 1 : 0;
        tile_build tb = {&r->tiles[t], t, seq % 2, st.cmds.len, -1, -1, 0, false, false, -1};
        if (seq >= 2) {
            tb.free_in = last[2 * (t - 2)];
            tb.free_out = last[2 * (t - 2) + 1];
        }
        s = tile(&st, &tb, &last[2 * t], &last[2 * t + 1]);
    }
    if (s == SPY_OK && st.sent.len)
        s = store_groups(&st);
    if (s == SPY_OK && st.listed.len)
        s = order_listed(&st);
    if (s == SPY_OK)
        s = encode(&st, out);
    builder_free(&st);
    return s;
}
