/* alloc.c -- the device DRAM allocator.
 *
 * The address space [base, base + capacity) is carved best-fit from an address-sorted,
 * coalesced free list. Live blocks are kept sorted by address so that any device address
 * resolves to its block with a binary search: every DMA binding is checked this way.
 * Freed blocks go to a small cache keyed by exact size (keeping their backing memory),
 * which is what memory_reserved reports and empty_cache releases; an allocation that
 * does not fit releases the cache and tries once more before reporting out-of-memory. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define CACHE_MAX_BLOCKS 1024

static bool grow(void **arr, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return true;
    size_t ncap = *cap ? *cap * 2 : 64;
    while (ncap < need)
        ncap *= 2;
    void *p = realloc(*arr, ncap * elem);
    if (!p)
        return false;
    *arr = p;
    *cap = ncap;
    return true;
}

spy_status spy_alloc_init(spy_allocator *a, uint64_t base, uint64_t capacity, uint64_t align)
{
    memset(a, 0, sizeof *a);
    a->base = base;
    a->capacity = capacity;
    a->align = align;
    if (!grow((void **)&a->free, &a->capfree, 1, sizeof(spy_range)))
        return spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted");
    a->free[0].addr = base;
    a->free[0].size = capacity;
    a->nfree = 1;
    return SPY_OK;
}

void spy_block_uncommit(spy_block *b)
{
    if (b->prog) {
        spy_program_free(b->prog);
        b->prog = NULL;
    }
}

static void free_backing(spy_block *b)
{
    free(b->backing);
    b->backing = NULL;
    spy_block_uncommit(b);
}

void spy_alloc_destroy(spy_allocator *a)
{
    for (size_t i = 0; i < a->nlive; i++)
        free_backing(&a->live[i]);
    for (size_t i = 0; i < a->ncache; i++)
        free_backing(&a->cache[i]);
    free(a->live);
    free(a->free);
    free(a->cache);
    memset(a, 0, sizeof *a);
}

/* Return [addr, addr+size) to the free list, coalescing with its neighbours. */
static bool range_release(spy_allocator *a, uint64_t addr, uint64_t size)
{
    size_t lo = 0, hi = a->nfree;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (a->free[mid].addr < addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    bool merge_prev = lo > 0 && a->free[lo - 1].addr + a->free[lo - 1].size == addr;
    bool merge_next = lo < a->nfree && addr + size == a->free[lo].addr;
    if (merge_prev && merge_next) {
        a->free[lo - 1].size += size + a->free[lo].size;
        memmove(&a->free[lo], &a->free[lo + 1], (a->nfree - lo - 1) * sizeof(spy_range));
        a->nfree--;
    } else if (merge_prev) {
        a->free[lo - 1].size += size;
    } else if (merge_next) {
        a->free[lo].addr = addr;
        a->free[lo].size += size;
    } else {
        if (!grow((void **)&a->free, &a->capfree, a->nfree + 1, sizeof(spy_range)))
            return false;
        memmove(&a->free[lo + 1], &a->free[lo], (a->nfree - lo) * sizeof(spy_range));
        a->free[lo].addr = addr;
        a->free[lo].size = size;
        a->nfree++;
    }
    return true;
}

static bool range_take(spy_allocator *a, uint64_t size, uint64_t *addr)
{
    size_t best = a->nfree;
    for (size_t i = 0; i < a->nfree; i++) {
        if (a->free[i].size >= size && (best == a->nfree || a->free[i].size < a->free[best].size)) {
            best = i;
            if (a->free[i].size == size)
                break;
        }
    }
    if (best == a->nfree)
        return false;
    *addr = a->free[best].addr;
    a->free[best].addr += size;
    a->free[best].size -= size;
    if (a->free[best].size == 0) {
        memmove(&a->free[best], &a->free[best + 1], (a->nfree - best - 1) * sizeof(spy_range));
        a->nfree--;
    }
    return true;
}

void spy_alloc_release_cache(spy_allocator *a)
{
    for (size_t i = 0; i < a->ncache; i++) {
        free_backing(&a->cache[i]);
        /* range_release only grows the free list when it cannot coalesce; a failure here
         * would leak address space, never memory safety, and needs host OOM. */
        (void)range_release(a, a->cache[i].addr, a->cache[i].size);
    }
    a->ncache = 0;
    a->cached = 0;
}

static spy_status insert_live(spy_allocator *a, const spy_block *b)
{
    if (!grow((void **)&a->live, &a->caplive, a->nlive + 1, sizeof(spy_block)))
        return spy_fail(SPY_E_HOST_NOMEM, -1, "host memory exhausted");
    size_t lo = 0, hi = a->nlive;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (a->live[mid].addr < b->addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    memmove(&a->live[lo + 1], &a->live[lo], (a->nlive - lo) * sizeof(spy_block));
    a->live[lo] = *b;
    a->nlive++;
    return SPY_OK;
}

spy_status spy_alloc_get(spy_allocator *a, uint64_t nbytes, uint32_t kind, bool backed,
                         const spy_layout *layout, uint64_t *addr)
{
    if (nbytes == 0)
        nbytes = 1; /* an empty tensor still gets a distinct address */
    uint64_t size;
    if (!spy_add_ok(nbytes, a->align - 1, &size))
        return spy_fail(SPY_E_OOM, -1, "requested %llu bytes, more than the address space",
                        (unsigned long long)nbytes);
    size -= size % a->align;
    if (size > a->capacity) {
        a->ooms++;
        return spy_fail(SPY_E_OOM, -1,
                        "out of device memory: requested %llu bytes, %llu free of %llu",
                        (unsigned long long)nbytes,
                        (unsigned long long)(a->capacity - a->allocated - a->cached),
                        (unsigned long long)a->capacity);
    }
    spy_block b = {0};
    /* Reuse a cached block of exactly this size and kind, newest first. */
    for (size_t i = a->ncache; i-- > 0;) {
        spy_block *c = &a->cache[i];
        if (c->size == size && c->kind == kind && (c->backing != NULL) == backed) {
            b = *c;
            memmove(&a->cache[i], &a->cache[i + 1], (a->ncache - i - 1) * sizeof(spy_block));
            a->ncache--;
            a->cached -= size;
            break;
        }
    }
    if (b.size == 0) {
        uint64_t at;
        if (!range_take(a, size, &at)) {
            spy_alloc_release_cache(a);
            if (!range_take(a, size, &at)) {
                a->ooms++;
                uint64_t largest = 0;
                for (size_t i = 0; i < a->nfree; i++)
                    if (a->free[i].size > largest)
                        largest = a->free[i].size;
                return spy_fail(SPY_E_OOM, -1,
                                "out of device memory: requested %llu bytes, %llu free "
                                "(largest block %llu) of %llu",
                                (unsigned long long)nbytes,
                                (unsigned long long)(a->capacity - a->allocated),
                                (unsigned long long)largest, (unsigned long long)a->capacity);
            }
        }
        b.addr = at;
        b.size = size;
        b.kind = kind;
        if (backed) {
            b.backing = calloc(1, size);
            if (!b.backing) {
                (void)range_release(a, at, size);
                return spy_fail(SPY_E_HOST_NOMEM, -1,
                                "host memory for %llu bytes of simulated DRAM is exhausted",
                                (unsigned long long)size);
            }
        }
    }
    if (layout)
        b.layout = *layout;
    spy_status s = insert_live(a, &b);
    if (s != SPY_OK) {
        free_backing(&b);
        (void)range_release(a, b.addr, b.size);
        return s;
    }
    a->allocated += size;
    if (kind == SPY_MEM_CONTROL)
        a->control += size;
    if (a->allocated > a->peak)
        a->peak = a->allocated;
    if (a->allocated - a->control > a->data_peak)
        a->data_peak = a->allocated - a->control;
    if (a->allocated + a->cached > a->reserved_peak)
        a->reserved_peak = a->allocated + a->cached;
    a->total_allocs++;
    *addr = b.addr;
    return SPY_OK;
}

static size_t find_index(const spy_allocator *a, uint64_t addr)
{
    /* index of the last block with block.addr <= addr, or nlive */
    size_t lo = 0, hi = a->nlive;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (a->live[mid].addr <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo == 0 ? a->nlive : lo - 1;
}

spy_block *spy_alloc_find(spy_allocator *a, uint64_t addr, uint64_t len)
{
    size_t i = find_index(a, addr);
    if (i == a->nlive)
        return NULL;
    spy_block *b = &a->live[i];
    uint64_t end;
    if (!spy_add_ok(addr, len, &end) || end > b->addr + b->size)
        return NULL;
    return b;
}

spy_status spy_alloc_put(spy_allocator *a, uint64_t addr)
{
    size_t i = find_index(a, addr);
    if (i == a->nlive || a->live[i].addr != addr)
        return spy_fail(SPY_E_BAD_ADDRESS, -1, "free of 0x%llx, which is not a live allocation",
                        (unsigned long long)addr);
    spy_block b = a->live[i];
    memmove(&a->live[i], &a->live[i + 1], (a->nlive - i - 1) * sizeof(spy_block));
    a->nlive--;
    a->allocated -= b.size;
    if (b.kind == SPY_MEM_CONTROL)
        a->control -= b.size;
    a->total_frees++;
    a->changes++;
    spy_block_uncommit(&b);
    b.plan_owned = 0;
    memset(&b.layout, 0, sizeof b.layout); /* the record goes with the allocation */
    if (a->ncache >= CACHE_MAX_BLOCKS ||
        !grow((void **)&a->cache, &a->capcache, a->ncache + 1, sizeof(spy_block))) {
        /* Evict the oldest cached block to keep the cache bounded. */
        if (a->ncache > 0) {
            spy_block old = a->cache[0];
            memmove(&a->cache[0], &a->cache[1], (a->ncache - 1) * sizeof(spy_block));
            a->ncache--;
            a->cached -= old.size;
            free_backing(&old);
            (void)range_release(a, old.addr, old.size);
        }
        if (a->ncache >= a->capcache) {
            free_backing(&b);
            (void)range_release(a, b.addr, b.size);
            return SPY_OK;
        }
    }
    a->cache[a->ncache++] = b;
    a->cached += b.size;
    return SPY_OK;
}

void spy_alloc_stats(const spy_allocator *a, spy_mem_stats *out)
{
    memset(out, 0, sizeof *out);
    out->capacity = a->capacity;
    out->allocated = a->allocated;
    out->peak_allocated = a->peak;
    out->reserved = a->allocated + a->cached;
    out->peak_reserved = a->reserved_peak;
    out->control = a->control;
    out->data_allocated = a->allocated - a->control;
    out->data_peak = a->data_peak;
    out->free = a->capacity - out->reserved;
    uint64_t largest = 0;
    for (size_t i = 0; i < a->nfree; i++)
        if (a->free[i].size > largest)
            largest = a->free[i].size;
    out->largest_free = largest;
    out->num_allocs = a->nlive;
    out->total_allocs = a->total_allocs;
    out->total_frees = a->total_frees;
    out->num_ooms = a->ooms;
    out->fragmentation = out->free ? 1.0 - (double)largest / (double)out->free : 0.0;
}
