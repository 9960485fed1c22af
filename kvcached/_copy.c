/* kvcached's native block copy: every piece of every block of a task in one call, no Python per piece.
 *
 * A side of a copy is one host buffer seen as pieces: piece p of block b sits at
 * base[p] + b * stride[p] and is width[p] bytes long (the same widths on both sides). The device arena
 * of the host backend, a CPU pool (records: one block of every layer contiguous; planes: one plane per
 * piece) and a store staging buffer are all such sides. kv_copy_blocks copies, for every pair i, every
 * piece of block src_ids[i] to block dst_ids[i], block by block. The caller has checked every id.
 *
 * Stores: with `streaming`, a piece whose destination is 32-byte aligned and whose width is a multiple of
 * 128 bytes is written with non-temporal stores (AVX2 where the CPU has it), which skip reading the
 * destination lines they overwrite: a swap writes memory it will not read soon, and at 16 KiB pieces
 * glibc's memcpy would not stream (its threshold cannot go below 16448 bytes). Other pieces, other CPUs
 * and other architectures use memcpy. Nothing here depends on Python.
 *
 * Streams: such pieces of equal width, BATCH at a time in the order they come, are copied 128 bytes of
 * each in turn rather than one after the other. Pieces of shuffled blocks lie far apart, and the hardware
 * prefetchers start again at each 4 KiB page of each: one piece at a time, the memory waits at every page;
 * BATCH pieces keep BATCH streams of loads in flight. Measured at FastDeploy's TP8 geometry (16 KiB pieces,
 * shuffled ids): a gather one piece at a time ran at 0.57 of a sequential copy, four at a time at 1.04
 * (docs/benchmarks.md).
 */
#include <stdint.h>
#include <string.h>

#define BATCH 4

#if defined(__x86_64__)
#include <immintrin.h>

/* Pieces waiting to be streamed: k of them, each width bytes. */
typedef struct {
    char *dst[BATCH];
    const char *src[BATCH];
    int k;
    int64_t width;
} batch_t;

__attribute__((target("avx2"))) static void stream_avx2(const batch_t *b) {
    for (int64_t i = 0; i < b->width; i += 128) {
        for (int j = 0; j < b->k; j++) {
            const char *src = b->src[j] + i;
            char *dst = b->dst[j] + i;
            __m256i w0 = _mm256_loadu_si256((const __m256i *)src);
            __m256i w1 = _mm256_loadu_si256((const __m256i *)(src + 32));
            __m256i w2 = _mm256_loadu_si256((const __m256i *)(src + 64));
            __m256i w3 = _mm256_loadu_si256((const __m256i *)(src + 96));
            _mm256_stream_si256((__m256i *)dst, w0);
            _mm256_stream_si256((__m256i *)(dst + 32), w1);
            _mm256_stream_si256((__m256i *)(dst + 64), w2);
            _mm256_stream_si256((__m256i *)(dst + 96), w3);
        }
    }
}

static void stream_sse2(const batch_t *b) {
    for (int64_t i = 0; i < b->width; i += 64) {
        for (int j = 0; j < b->k; j++) {
            const char *src = b->src[j] + i;
            char *dst = b->dst[j] + i;
            __m128i w0 = _mm_loadu_si128((const __m128i *)src);
            __m128i w1 = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i w2 = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i w3 = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, w0);
            _mm_stream_si128((__m128i *)(dst + 16), w1);
            _mm_stream_si128((__m128i *)(dst + 32), w2);
            _mm_stream_si128((__m128i *)(dst + 48), w3);
        }
    }
}

static void flush(batch_t *b, int avx2) {
    if (b->k) {
        if (avx2) {
            stream_avx2(b);
        } else {
            stream_sse2(b);
        }
    }
    b->k = 0;
}
#endif

/* 1 when non-temporal stores are used (x86-64: SSE2 always, AVX2 where present), else 0. */
int kv_streams(void) {
#if defined(__x86_64__)
    return 1;
#else
    return 0;
#endif
}

int64_t kv_copy_blocks(int64_t npieces, const uint64_t *src_base, const int64_t *src_stride,
                       const uint64_t *dst_base, const int64_t *dst_stride, const int64_t *width, int64_t n,
                       const int64_t *src_ids, const int64_t *dst_ids, int streaming) {
    int64_t moved = 0;
#if defined(__x86_64__)
    int avx2 = streaming && __builtin_cpu_supports("avx2");
    batch_t batch = {.k = 0, .width = 0};
#endif
    for (int64_t i = 0; i < n; i++) {
        for (int64_t p = 0; p < npieces; p++) {
            char *d = (char *)(uintptr_t)(dst_base[p] + (uint64_t)(dst_ids[i] * dst_stride[p]));
            const char *s = (const char *)(uintptr_t)(src_base[p] + (uint64_t)(src_ids[i] * src_stride[p]));
            int64_t w = width[p];
            moved += w;
#if defined(__x86_64__)
            if (streaming && ((uintptr_t)d & 31) == 0 && (w & 127) == 0) {
                if (batch.k && batch.width != w) {
                    flush(&batch, avx2);
                }
                batch.dst[batch.k] = d;
                batch.src[batch.k] = s;
                batch.width = w;
                if (++batch.k == BATCH) {
                    flush(&batch, avx2);
                }
                continue;
            }
#endif
            memcpy(d, s, (size_t)w);
        }
    }
#if defined(__x86_64__)
    if (streaming) {
        flush(&batch, avx2);
        _mm_sfence(); /* the streamed stores are visible before the task is answered */
    }
#endif
    return moved;
}
