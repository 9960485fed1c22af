/* kvcached's copy-and-checksum: a store object's payload moved and its XXH3-64 taken in one pass.
 *
 * The store's objects carry the XXH3-64 (seed 0, default secret) of their payload, a block record: the
 * concatenation of the block's pieces (every layer's key, value and scales). A load must verify that
 * checksum over exactly the bytes it lands, and must not pay a pass of its own for it: here each 64-byte
 * stripe is loaded into registers once, stored to the destination and folded into the hash from the same
 * registers, so the checksum covers what was written even if the source changes meanwhile. Reads from a
 * file go through the kernel into a small reused buffer, and each request's bytes are landed from there
 * as soon as it returns, while they are still in the CPU's cache.
 *
 * Only payloads longer than 240 bytes (XXH3's long-input path) are handled here: every real block is; the
 * caller hashes shorter ones itself. The algorithm is XXH3's, written from its specification: accumulators
 * fed stripe by stripe with the secret advancing 8 bytes a stripe, scrambled after every 16 stripes, the
 * last 64 bytes of the input folded in apart, then merged and avalanched. Streaming a known total length
 * makes the stripe that is folded in the loop, and the one kept for the end, known in advance.
 */
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define STRIPE 64
#define STRIPES_PER_BLOCK 16
#define SECRET_BYTES 192
#define PREFETCH 384

static const uint8_t SECRET[SECRET_BYTES] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c, 0xde, 0xd4, 0x6d,
    0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0,
    0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0,
    0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b,
    0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac,
    0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51,
    0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34,
    0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49,
    0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8,
    0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b,
    0x40, 0x7e,
};

#define PRIME32_1 0x9E3779B1ULL
#define PRIME32_2 0x85EBCA77ULL
#define PRIME32_3 0xC2B2AE3DULL
#define PRIME64_1 0x9E3779B185EBCA87ULL
#define PRIME64_2 0xC2B2AE3D27D4EB4FULL
#define PRIME64_3 0x165667B19E3779F9ULL
#define PRIME64_4 0x85EBCA77C2B2AE63ULL
#define PRIME64_5 0x27D4EB2F165667C5ULL

/* The hash of one payload of `total` bytes, fed in order. */
typedef struct {
    uint64_t acc[8];
    uint64_t total;   /* bytes of the whole input */
    uint64_t fed;     /* bytes fed so far */
    uint64_t limit;   /* stripes folded in the loop: (total - 1) / 64; the last 64 bytes go in apart */
    uint64_t stripes; /* stripes folded so far */
    uint8_t carry[STRIPE];
    uint8_t last[STRIPE];
    int ncarry;
    int vector; /* 2: AVX2, 1: SSE2, 0: scalar */
} Hash;

static uint64_t read64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* little-endian hosts only: x86-64, aarch64 */
    return v;
}

static void hash_init(Hash *h, uint64_t total) {
    static const uint64_t init[8] = {PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3,
                                     PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1};
    memcpy(h->acc, init, sizeof init);
    h->total = total;
    h->fed = h->stripes = 0;
    h->limit = (total - 1) / STRIPE;
    h->ncarry = 0;
    h->vector = 0;
#if defined(__x86_64__)
    h->vector = __builtin_cpu_supports("avx2") ? 2 : 1;
#endif
}

static void stripe_scalar(uint64_t *acc, const uint8_t *data, const uint8_t *key) {
    for (int i = 0; i < 8; i++) {
        uint64_t v = read64(data + 8 * i), k = v ^ read64(key + 8 * i);
        acc[i ^ 1] += v;
        acc[i] += (k & 0xFFFFFFFFULL) * (k >> 32);
    }
}

static void scramble_scalar(uint64_t *acc) {
    const uint8_t *key = SECRET + SECRET_BYTES - STRIPE;
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= read64(key + 8 * i);
        acc[i] = a * PRIME32_1;
    }
}

/* One whole stripe that is not part of a bulk run (a carry, or the scalar path). */
static void fold_one(Hash *h, const uint8_t *data) {
    if (h->stripes >= h->limit) {
        return;
    }
    stripe_scalar(h->acc, data, SECRET + 8 * (h->stripes % STRIPES_PER_BLOCK));
    if (++h->stripes % STRIPES_PER_BLOCK == 0) {
        scramble_scalar(h->acc);
    }
}

#if defined(__x86_64__)
/* Bulk runs: `n` whole stripes from `src` (and to `dst` unless NULL), the accumulators in registers. */
#define BULK(NAME, ATTR, VEC, LANES, LOAD, STORE, STREAM, XOR, ADD, SRL, SLL, MUL, SHUF, SET1)                      \
    ATTR static inline void NAME##_move(char *dst, VEC *d, int stream) {                                              \
        for (int l = 0; l < LANES; l++) {                                                                           \
            if (stream) STREAM((VEC *)dst + l, d[l]); else STORE((VEC *)dst + l, d[l]);                             \
        }                                                                                                           \
    }                                                                                                               \
    ATTR static void NAME(Hash *h, char *dst, const char *src, int64_t n, int stream) {                             \
        VEC acc[LANES], prime = SET1((long long)PRIME32_1);                                                         \
        const VEC *scr = (const VEC *)(SECRET + SECRET_BYTES - STRIPE);                                             \
        uint64_t stripes = h->stripes;                                                                              \
        int64_t folded = h->limit > stripes ? (int64_t)(h->limit - stripes) : 0;                                    \
        for (int l = 0; l < LANES; l++) acc[l] = LOAD((const VEC *)h->acc + l);                                     \
        while (n > 0) {                                                                                             \
            int64_t first = (int64_t)(stripes % STRIPES_PER_BLOCK), run = STRIPES_PER_BLOCK - first;                \
            run = run < n ? run : n;                                                                                \
            run = run < folded ? run : folded;                                                                      \
            if (run == 0) { /* past the folded stripes: copy only */                                                \
                for (; n > 0; n--, src += STRIPE) {                                                                 \
                    VEC d[LANES];                                                                                   \
                    for (int l = 0; l < LANES; l++) d[l] = LOAD((const VEC *)src + l);                               \
                    if (dst != NULL) { NAME##_move(dst, d, stream); dst += STRIPE; }                                \
                }                                                                                                   \
                break;                                                                                              \
            }                                                                                                       \
            const VEC *key = (const VEC *)(SECRET + 8 * first);                                                     \
            for (int64_t j = 0; j < run; j++, src += STRIPE, key = (const VEC *)((const char *)key + 8)) {          \
                VEC d[LANES];                                                                                       \
                _mm_prefetch(src + PREFETCH, _MM_HINT_T0);                                                          \
                for (int l = 0; l < LANES; l++) d[l] = LOAD((const VEC *)src + l);                                   \
                if (dst != NULL) { NAME##_move(dst, d, stream); dst += STRIPE; }                                    \
                for (int l = 0; l < LANES; l++) {                                                                   \
                    VEC dk = XOR(d[l], LOAD(key + l));                                                              \
                    acc[l] = ADD(MUL(dk, SRL(dk, 32)), ADD(acc[l], SHUF(d[l], 0x4E)));                              \
                }                                                                                                   \
            }                                                                                                       \
            stripes += (uint64_t)run;                                                                               \
            folded -= run;                                                                                          \
            n -= run;                                                                                               \
            if (stripes % STRIPES_PER_BLOCK == 0) {                                                                 \
                for (int l = 0; l < LANES; l++) {                                                                   \
                    VEC a = XOR(XOR(acc[l], SRL(acc[l], 47)), LOAD(scr + l));                                       \
                    acc[l] = ADD(MUL(a, prime), SLL(MUL(SHUF(a, 0xB1), prime), 32));                                 \
                }                                                                                                   \
            }                                                                                                       \
        }                                                                                                           \
        h->stripes = stripes;                                                                                       \
        for (int l = 0; l < LANES; l++) STORE((VEC *)h->acc + l, acc[l]);                                            \
    }

BULK(bulk_avx2, __attribute__((target("avx2"))), __m256i, 2, _mm256_loadu_si256, _mm256_storeu_si256,
     _mm256_stream_si256, _mm256_xor_si256, _mm256_add_epi64, _mm256_srli_epi64, _mm256_slli_epi64, _mm256_mul_epu32,
     _mm256_shuffle_epi32, _mm256_set1_epi64x)
BULK(bulk_sse2, , __m128i, 4, _mm_loadu_si128, _mm_storeu_si128, _mm_stream_si128, _mm_xor_si128, _mm_add_epi64,
     _mm_srli_epi64, _mm_slli_epi64, _mm_mul_epu32, _mm_shuffle_epi32, _mm_set1_epi64x)
#endif

static void bulk(Hash *h, char *dst, const char *src, int64_t n, int stream) {
#if defined(__x86_64__)
    if (h->vector == 2) {
        bulk_avx2(h, dst, src, n, stream);
        return;
    }
    bulk_sse2(h, dst, src, n, stream);
#else
    (void)stream;
    for (int64_t s = 0; s < n; s++, src += STRIPE) {
        if (dst != NULL) {
            memcpy(dst, src, STRIPE);
            dst += STRIPE;
        }
        fold_one(h, (const uint8_t *)src);
    }
#endif
}

/* Feed `n` bytes of `src` (copied to `dst` on the way unless it is NULL; with `streaming`, whole 32-byte
 * aligned runs are written with non-temporal stores). */
static void feed(Hash *h, char *dst, const char *src, int64_t n, int streaming) {
    uint64_t tail = h->total - STRIPE; /* where the last stripe starts */
    if (h->fed + (uint64_t)n > tail) {
        uint64_t from = h->fed > tail ? h->fed : tail;
        memcpy(h->last + (from - tail), src + (from - h->fed), h->fed + (uint64_t)n - from);
    }
    h->fed += (uint64_t)n;
    while (n > 0) {
        if (h->ncarry > 0 || n < STRIPE) {
            int64_t take = STRIPE - h->ncarry < n ? STRIPE - h->ncarry : n;
            memcpy(h->carry + h->ncarry, src, (size_t)take);
            if (dst != NULL) {
                memcpy(dst, src, (size_t)take);
                dst += take;
            }
            src += take;
            n -= take;
            h->ncarry += (int)take;
            if (h->ncarry == STRIPE) {
                fold_one(h, h->carry);
                h->ncarry = 0;
            }
            continue;
        }
        int64_t whole = n / STRIPE;
        bulk(h, dst, src, whole, streaming && dst != NULL && ((uintptr_t)dst & 31) == 0);
        src += whole * STRIPE;
        if (dst != NULL) {
            dst += whole * STRIPE;
        }
        n -= whole * STRIPE;
    }
}

static uint64_t mul128_fold64(uint64_t a, uint64_t b) {
    __uint128_t p = (__uint128_t)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
}

static uint64_t digest(Hash *h) {
    uint64_t acc[8];
    memcpy(acc, h->acc, sizeof acc);
    stripe_scalar(acc, h->last, SECRET + SECRET_BYTES - STRIPE - 7);
    uint64_t result = h->total * PRIME64_1;
    for (int i = 0; i < 4; i++) {
        result += mul128_fold64(acc[2 * i] ^ read64(SECRET + 11 + 16 * i), acc[2 * i + 1] ^ read64(SECRET + 19 + 16 * i));
    }
    result ^= result >> 37;
    result *= 0x165667919E3779F9ULL;
    return result ^ (result >> 32);
}

/* Shortest payload handled here: XXH3 hashes shorter inputs another way. */
int64_t kv_hash_min_bytes(void) { return 241; }

/* Copy the pieces one after the other into `flat` (piece p: `width[p]` bytes at `pieces[p]`); the XXH3-64
 * of the bytes copied. The pieces together must be at least kv_hash_min_bytes long. */
uint64_t kv_gather_hash(int64_t npieces, const uint64_t *pieces, const int64_t *width, char *flat) {
    uint64_t total = 0;
    for (int64_t p = 0; p < npieces; p++) {
        total += (uint64_t)width[p];
    }
    Hash h;
    hash_init(&h, total);
    for (int64_t p = 0; p < npieces; p++) {
        feed(&h, flat, (const char *)(uintptr_t)pieces[p], width[p], 0);
        flat += width[p];
    }
    return digest(&h);
}

/* Land `n` payloads, payload i (contiguous at `src[i]`) into block `ids[i]` of a side (piece p of block b:
 * `width[p]` bytes at base[p] + b * stride[p]), with non-temporal stores; `digests[i]` is the XXH3-64 of
 * the bytes written. The pieces together must be at least kv_hash_min_bytes long. */
void kv_land_blocks(int64_t n, const uint64_t *src, int64_t npieces, const uint64_t *base, const int64_t *stride,
                    const int64_t *width, const int64_t *ids, uint64_t *digests) {
    uint64_t total = 0;
    for (int64_t p = 0; p < npieces; p++) {
        total += (uint64_t)width[p];
    }
    for (int64_t i = 0; i < n; i++) {
        Hash h;
        hash_init(&h, total);
        const char *from = (const char *)(uintptr_t)src[i];
        for (int64_t p = 0; p < npieces; p++) {
            feed(&h, (char *)(uintptr_t)(base[p] + (uint64_t)(ids[i] * stride[p])), from, width[p], 1);
            from += width[p];
        }
        digests[i] = digest(&h);
    }
#if defined(__x86_64__)
    _mm_sfence();
#endif
}

/* Read the pieces' bytes from `fd` at `offset`, a request of at most `chunk` bytes at a time into `bounce`
 * (reused, so it stays in the CPU's cache: the kernel's copy into it is quicker than into memory that is
 * not), and land each request in the pieces from there with non-temporal stores, hashed on the way; the
 * bytes read (short at the end of the file) or -errno. `*hash` is set when every byte was read. */
int64_t kv_read_land(int fd, int64_t offset, int64_t npieces, const uint64_t *pieces, const int64_t *width,
                     char *bounce, int64_t chunk, uint64_t *hash) {
    uint64_t total = 0;
    for (int64_t p = 0; p < npieces; p++) {
        total += (uint64_t)width[p];
    }
    Hash h;
    hash_init(&h, total);
    int64_t p = 0, in_piece = 0, done = 0;
    while ((uint64_t)done < total) {
        int64_t want = (int64_t)total - done < chunk ? (int64_t)total - done : chunk;
        ssize_t got = pread(fd, bounce, (size_t)want, offset + done);
        if (got < 0 && errno == EINTR) {
            continue;
        }
        if (got < 0) {
            return -errno;
        }
        if (got == 0) {
            return done;
        }
        done += got;
        const char *from = bounce;
        for (int64_t left = got; left > 0;) {
            int64_t take = width[p] - in_piece < left ? width[p] - in_piece : left;
            feed(&h, (char *)(uintptr_t)pieces[p] + in_piece, from, take, 1);
            from += take;
            left -= take;
            in_piece += take;
            if (in_piece == width[p]) {
                p++;
                in_piece = 0;
            }
        }
    }
#if defined(__x86_64__)
    _mm_sfence();
#endif
    *hash = digest(&h);
    return done;
}

/* Read one object whole: open `path` (no symbolic link followed, never blocking on a FIFO), check it is a
 * regular file of `size` bytes, read its first `header_len` bytes into `header`, and land the rest as
 * kv_read_land does. Returns the payload bytes read, or -errno when it cannot be opened or read,
 * KV_NOT_REGULAR, or KV_WRONG_SIZE with *found set to the file's size; *found is otherwise the header bytes
 * read (short only if the file shrank meanwhile). An object read whole has its times set to now (used: the
 * order a restart rebuilds), its times before in times[0] (access) and times[1] (modification), in ns. */
#define KV_NOT_REGULAR (-(1LL << 40))
#define KV_WRONG_SIZE (-(1LL << 40) - 1)
static int64_t read_one(const char *path, int64_t size, char *header, int64_t header_len, int64_t npieces,
                        const uint64_t *pieces, const int64_t *width, char *bounce, int64_t chunk, uint64_t *hash,
                        int64_t *found, int64_t *times) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0) {
        return -errno;
    }
    struct stat st;
    int64_t result;
    ssize_t got;
    if (fstat(fd, &st) != 0) {
        result = -errno;
    } else if (!S_ISREG(st.st_mode)) {
        result = KV_NOT_REGULAR;
    } else if (st.st_size != size) {
        *found = st.st_size;
        result = KV_WRONG_SIZE;
    } else {
        do {
            got = pread(fd, header, (size_t)header_len, 0);
        } while (got < 0 && errno == EINTR);
        if (got < 0) {
            result = -errno;
        } else {
            *found = got;
            result = got < header_len ? 0 : kv_read_land(fd, header_len, npieces, pieces, width, bounce, chunk, hash);
        }
        if (result == size - header_len) {
            times[0] = (int64_t)st.st_atim.tv_sec * 1000000000 + st.st_atim.tv_nsec;
            times[1] = (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
            futimens(fd, NULL);
        }
    }
    close(fd);
    return result;
}

/* Read objects in turn, shared by the threads that call it at once: each call takes the next index i
 * (`*next`, atomically) until none is left, i is past `*stop`, or it has read `limit` objects or spent
 * `budget_ns` (so a caller can tell its progress often); object i (its NUL-ended path at paths + i *
 * path_stride) is read as read_one reads it, its header to headers + i * header_len, its payload into block
 * ids[i]'s pieces (piece p: width[p] bytes at base[p] + ids[i] * stride[p]), with got[i], found[i], hash[i]
 * and times[2 * i], times[2 * i + 1] set as read_one sets them. An object not read whole, or whose header is
 * not this object's (its first 76 bytes `expect`'s with keys[i], 32 bytes at 40; the payload's hash at 80:
 * every field of an untagged object's verdict, its flags not among them) lowers `*stop` to its index, so no
 * call takes an index past it; every index below the final `*stop` is read, and verified. Returns the
 * objects this call read. */
int64_t kv_read_objects(int64_t count, const char *paths, int64_t path_stride, int64_t size, char *headers,
                        int64_t header_len, const char *expect, const char *keys, int64_t npieces, const uint64_t *base,
                        const int64_t *stride, const int64_t *width, const int64_t *ids, char *bounce, int64_t chunk,
                        int64_t *next, int64_t *stop, int64_t limit, int64_t budget_ns, int64_t *got, int64_t *found,
                        uint64_t *hash, int64_t *times) {
    uint64_t *pieces = malloc((size_t)npieces * sizeof *pieces);
    if (pieces == NULL) {
        return -ENOMEM;
    }
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    int64_t until = (int64_t)now.tv_sec * 1000000000 + now.tv_nsec + budget_ns;
    int64_t n = 0;
    while (n < limit) {
        int64_t i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
        if (i >= count || i > __atomic_load_n(stop, __ATOMIC_RELAXED)) {
            break;
        }
        for (int64_t p = 0; p < npieces; p++) {
            pieces[p] = base[p] + (uint64_t)(ids[i] * stride[p]);
        }
        char *head = headers + i * header_len;
        got[i] = read_one(paths + i * path_stride, size, head, header_len, npieces, pieces, width, bounce, chunk,
                          &hash[i], &found[i], &times[2 * i]);
        int whole = got[i] == size - header_len && memcmp(head, expect, 40) == 0 &&
                    memcmp(head + 40, keys + 32 * i, 32) == 0 && memcmp(head + 72, expect + 72, 4) == 0 &&
                    read64((const uint8_t *)head + 80) == hash[i];
        if (!whole) {
            int64_t s = __atomic_load_n(stop, __ATOMIC_RELAXED);
            while (i < s && !__atomic_compare_exchange_n(stop, &s, i, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            }
        }
        n++;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if ((int64_t)now.tv_sec * 1000000000 + now.tv_nsec >= until) {
            break;
        }
    }
    free(pieces);
    return n;
}
