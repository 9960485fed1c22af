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
 */
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx2"))) static void stream_avx2(char *dst, const char *src, int64_t n) {
    for (int64_t i = 0; i < n; i += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
}

static void stream_sse2(char *dst, const char *src, int64_t n) {
    for (int64_t i = 0; i < n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
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
#endif
    for (int64_t i = 0; i < n; i++) {
        for (int64_t p = 0; p < npieces; p++) {
            char *d = (char *)(uintptr_t)(dst_base[p] + (uint64_t)(dst_ids[i] * dst_stride[p]));
            const char *s = (const char *)(uintptr_t)(src_base[p] + (uint64_t)(src_ids[i] * src_stride[p]));
            int64_t w = width[p];
            moved += w;
#if defined(__x86_64__)
            if (streaming && ((uintptr_t)d & 31) == 0 && (w & 127) == 0) {
                if (avx2) {
                    stream_avx2(d, s, w);
                } else {
                    stream_sse2(d, s, w);
                }
                continue;
            }
#endif
            memcpy(d, s, (size_t)w);
        }
    }
#if defined(__x86_64__)
    if (streaming) {
        _mm_sfence(); /* the streamed stores are visible before the task is answered */
    }
#endif
    return moved;
}
