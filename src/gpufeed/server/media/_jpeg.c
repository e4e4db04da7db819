/* The JPEG fast path's C half: decode only a crop window's MCUs, then resize it.
 *
 * decode_crop() reads a JPEG with libjpeg-turbo's classic API (libjpeg >= 1.5:
 * jpeg_crop_scanline + jpeg_skip_scanlines), asking for RGB at 1/2, 1/4 or 1/8
 * scale (done in the IDCT) when the crop is at least that many times the
 * output, and decodes only the rows and iMCU columns that the resize filter
 * touches. Rows below the window are never entropy-decoded. resize_rgb() is
 * the same resize for a packed RGB image decoded elsewhere (PyAV).
 *
 * The resize is a separable triangle filter widened by the downscale factor
 * (what Pillow's BILINEAR does), over a box given in floating-point source
 * pixels, so a crop box lands where its coordinates say, to the sub-pixel. It
 * writes straight into the caller's uint8 [3, H, W] buffer. Both passes are
 * vectorised: AVX2 where the CPU has it (chosen at import), SSE2 otherwise, with
 * the same integer sums, so every machine gives the same pixels. Both functions
 * release the GIL for all their work.
 *
 * libjpeg's errors and warnings (corrupt or truncated data) longjmp back here
 * and become gpufeed.server.media._jpeg.Error: a damaged file fails rather than
 * arriving with grey blocks. A valid JPEG this path does not convert (CMYK,
 * YCCK) raises Unsupported so the caller can take its general path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

#ifdef __SSE2__
#include <emmintrin.h>
#endif
/* x86-64 with GCC or clang: AVX2 versions of both resize passes, compiled beside the
 * SSE2 ones and chosen at import when the CPU has AVX2 (same sums, same output). */
#if defined(__SSE2__) && defined(__x86_64__) && defined(__GNUC__)
#define HAVE_AVX2_PASSES 1
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2")))
static int use_avx2;
#endif

static PyObject *JpegError;
static PyObject *Unsupported;

#define COEF_BITS 14
#define COEF_ONE (1 << COEF_BITS)

/* ---- resize ------------------------------------------------------------ */

/* One axis of the resize: output pixel i reads n[i] source pixels from lo[i]
 * (relative to the first source pixel held), with weights coef[i * taps ..]. */
typedef struct {
    int out;
    int taps;
    int *lo;
    int *n;
    int16_t *coef;
} axis_t;

static void axis_free(axis_t *a)
{
    free(a->lo);
    free(a->n);
    free(a->coef);
    a->lo = a->n = NULL;
    a->coef = NULL;
}

/* Reverse the order of the output pixels: a horizontal flip at no cost. */
static void axis_mirror(axis_t *a)
{
    for (int i = 0, j = a->out - 1; i < j; i++, j--) {
        int lo = a->lo[i], n = a->n[i];
        a->lo[i] = a->lo[j];
        a->n[i] = a->n[j];
        a->lo[j] = lo;
        a->n[j] = n;
        for (int k = 0; k < a->taps; k++) {
            int16_t c = a->coef[(size_t)i * a->taps + k];
            a->coef[(size_t)i * a->taps + k] = a->coef[(size_t)j * a->taps + k];
            a->coef[(size_t)j * a->taps + k] = c;
        }
    }
}

/* Weights for mapping [box0, box0 + len) of a source axis of `size` pixels onto
 * `out` pixels. Returns 0, or -1 when out of memory. */
static int axis_make(axis_t *a, double box0, double len, int size, int out)
{
    double scale = len / out;
    double widen = scale > 1.0 ? scale : 1.0;
    double support = widen; /* the triangle reaches one (widened) pixel either side */
    int taps = (int)ceil(support) * 2 + 2;
    double *w = malloc(sizeof(double) * taps);
    a->out = out;
    a->taps = taps;
    a->lo = malloc(sizeof(int) * out);
    a->n = malloc(sizeof(int) * out);
    a->coef = calloc((size_t)out * taps, sizeof(int16_t));
    if (!w || !a->lo || !a->n || !a->coef) {
        free(w);
        axis_free(a);
        return -1;
    }
    for (int i = 0; i < out; i++) {
        double centre = box0 + (i + 0.5) * scale;
        int lo = (int)floor(centre - support + 0.5);
        int hi = (int)floor(centre + support + 0.5);
        double sum = 0.0;
        if (lo < 0)
            lo = 0;
        if (hi > size)
            hi = size;
        if (hi - lo > taps)
            hi = lo + taps;
        if (hi <= lo) { /* a box on the very edge: take the nearest pixel */
            lo = centre < 0.5 ? 0 : size - 1;
            hi = lo + 1;
        }
        for (int x = lo; x < hi; x++) {
            double t = fabs((x + 0.5 - centre) / widen);
            w[x - lo] = t < 1.0 ? 1.0 - t : 0.0;
            sum += w[x - lo];
        }
        a->lo[i] = lo;
        a->n[i] = hi - lo;
        for (int x = lo; x < hi; x++)
            a->coef[(size_t)i * taps + x - lo] =
                sum > 0 ? (int16_t)lrint(w[x - lo] / sum * COEF_ONE) : (x == lo ? COEF_ONE : 0);
    }
    free(w);
    return 0;
}

/* A sum of weights (COEF_BITS fraction bits) times pixels, rounded to a pixel. */
static inline uint8_t clamp8(int32_t v)
{
    v = (v + (COEF_ONE >> 1)) >> COEF_BITS;
    return v < 0 ? 0 : v > 255 ? 255 : (uint8_t)v;
}

/* The vertical pass for one output row: dst[j] = sum_k coef[k] * src[k * stride + j]
 * for j < width, rounded and clamped to 0..255 (as int16, ready for the next pass). */
static void vertical(const uint8_t *src, size_t stride, const int16_t *coef, int n, int width,
                     int16_t *dst)
{
    int j = 0;
#ifdef __SSE2__
    /* 16 bytes at a time, two taps per multiply-add: (a * c0 + b * c1) in 32 bits */
    const __m128i zero = _mm_setzero_si128(), half = _mm_set1_epi32(COEF_ONE >> 1);
    for (; j + 16 <= width; j += 16) {
        __m128i s0 = half, s1 = half, s2 = half, s3 = half;
        for (int k = 0; k < n; k += 2) {
            const uint8_t *a = src + (size_t)k * stride + j;
            int two = k + 1 < n;
            __m128i va = _mm_loadu_si128((const __m128i *)a);
            __m128i vb = two ? _mm_loadu_si128((const __m128i *)(a + stride)) : zero;
            __m128i c = _mm_set1_epi32((int32_t)((uint32_t)(uint16_t)coef[k] |
                                                 (two ? (uint32_t)(uint16_t)coef[k + 1] << 16 : 0)));
            __m128i lo = _mm_unpacklo_epi8(va, vb), hi = _mm_unpackhi_epi8(va, vb);
            s0 = _mm_add_epi32(s0, _mm_madd_epi16(_mm_unpacklo_epi8(lo, zero), c));
            s1 = _mm_add_epi32(s1, _mm_madd_epi16(_mm_unpackhi_epi8(lo, zero), c));
            s2 = _mm_add_epi32(s2, _mm_madd_epi16(_mm_unpacklo_epi8(hi, zero), c));
            s3 = _mm_add_epi32(s3, _mm_madd_epi16(_mm_unpackhi_epi8(hi, zero), c));
        }
        __m128i bytes = _mm_packus_epi16(
            _mm_packs_epi32(_mm_srai_epi32(s0, COEF_BITS), _mm_srai_epi32(s1, COEF_BITS)),
            _mm_packs_epi32(_mm_srai_epi32(s2, COEF_BITS), _mm_srai_epi32(s3, COEF_BITS)));
        _mm_storeu_si128((__m128i *)(dst + j), _mm_unpacklo_epi8(bytes, zero));
        _mm_storeu_si128((__m128i *)(dst + j + 8), _mm_unpackhi_epi8(bytes, zero));
    }
#endif
    for (; j < width; j++) {
        int32_t sum = 0;
        for (int k = 0; k < n; k++)
            sum += coef[k] * src[(size_t)k * stride + j];
        dst[j] = clamp8(sum);
    }
}

#ifdef HAVE_AVX2_PASSES
/* vertical() 32 bytes at a time. AVX2's unpacks and packs work within each 128-bit
 * half, so the halves hold bytes 0-15 and 16-31 throughout and come out in order. */
AVX2 static void vertical_avx2(const uint8_t *src, size_t stride, const int16_t *coef, int n,
                               int width, int16_t *dst)
{
    int j = 0;
    const __m256i zero = _mm256_setzero_si256(), half = _mm256_set1_epi32(COEF_ONE >> 1);
    for (; j + 32 <= width; j += 32) {
        __m256i s0 = half, s1 = half, s2 = half, s3 = half;
        for (int k = 0; k < n; k += 2) {
            const uint8_t *a = src + (size_t)k * stride + j;
            int two = k + 1 < n;
            __m256i va = _mm256_loadu_si256((const __m256i *)a);
            __m256i vb = two ? _mm256_loadu_si256((const __m256i *)(a + stride)) : zero;
            __m256i c = _mm256_set1_epi32((int32_t)((uint32_t)(uint16_t)coef[k] |
                                                    (two ? (uint32_t)(uint16_t)coef[k + 1] << 16 : 0)));
            __m256i lo = _mm256_unpacklo_epi8(va, vb), hi = _mm256_unpackhi_epi8(va, vb);
            s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), c));
            s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), c));
            s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), c));
            s3 = _mm256_add_epi32(s3, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), c));
        }
        __m256i bytes = _mm256_packus_epi16(
            _mm256_packs_epi32(_mm256_srai_epi32(s0, COEF_BITS), _mm256_srai_epi32(s1, COEF_BITS)),
            _mm256_packs_epi32(_mm256_srai_epi32(s2, COEF_BITS), _mm256_srai_epi32(s3, COEF_BITS)));
        _mm256_storeu_si256((__m256i *)(dst + j), _mm256_cvtepu8_epi16(_mm256_castsi256_si128(bytes)));
        _mm256_storeu_si256((__m256i *)(dst + j + 16),
                            _mm256_cvtepu8_epi16(_mm256_extracti128_si256(bytes, 1)));
    }
    vertical(src + j, stride, coef, n, width - j, dst + j); /* the last < 32 bytes */
}
#endif

/* The horizontal pass's weights, in pairs: for output pixel j, pair q holds the
 * weights of taps 2q and 2q + 1 (0 past the last tap) as the low and high int16
 * of one int32, `pairs` per pixel. */
typedef struct {
    int pairs;
    int32_t *weights; /* [out][pairs] */
} packed_t;

static int packed_make(packed_t *p, const axis_t *xs)
{
    int most = 1;
    for (int j = 0; j < xs->out; j++)
        most = xs->n[j] > most ? xs->n[j] : most;
    p->pairs = (most + 1) / 2;
    p->weights = calloc((size_t)xs->out * p->pairs, sizeof(int32_t));
    if (!p->weights)
        return -1;
    for (int j = 0; j < xs->out; j++)
        for (int k = 0; k < xs->n[j]; k++) {
            uint32_t w = (uint16_t)xs->coef[(size_t)j * xs->taps + k];
            p->weights[(size_t)j * p->pairs + k / 2] |= (int32_t)(k % 2 ? w << 16 : w);
        }
    return 0;
}

#ifdef __SSE2__
/* One output pixel's three sums, in lanes 0-2 (lane 3 is junk): per pair of taps, the
 * two pixels' int16 RGB are interleaved channel by channel, (r0 r1 g0 g1 b0 b1 ..),
 * so one multiply-add gives every channel's share of both taps. */
static inline __m128i pixel_sums(const int16_t *s, const int32_t *w, int pairs)
{
    __m128i sum = _mm_setzero_si128();
    for (int q = 0; q < pairs; q++, s += 6) {
        __m128i v = _mm_loadu_si128((const __m128i *)s);
        sum = _mm_add_epi32(sum, _mm_madd_epi16(_mm_unpacklo_epi16(v, _mm_srli_si128(v, 6)),
                                                _mm_set1_epi32(w[q])));
    }
    return sum;
}
#endif

/* The horizontal pass for one output row, from the packed int16 RGB row `src`
 * (its pixel 0 is source column `first`; 2 * pairs + 2 readable pixels past its end). */
static void horizontal(const int16_t *src, int first, const axis_t *xs, const packed_t *p,
                       uint8_t *r, uint8_t *g, uint8_t *b)
{
    int j = 0;
#ifdef __SSE2__
    /* four output pixels at a time, their [r g b -] sums transposed to [r r r r] [g ..] [b ..] */
    const __m128i half = _mm_set1_epi32(COEF_ONE >> 1);
    for (; j + 4 <= xs->out; j += 4) {
        __m128i a[4];
        for (int q = 0; q < 4; q++)
            a[q] = pixel_sums(src + (size_t)(xs->lo[j + q] - first) * 3,
                              p->weights + (size_t)(j + q) * p->pairs, p->pairs);
        __m128i ab_lo = _mm_unpacklo_epi32(a[0], a[1]), cd_lo = _mm_unpacklo_epi32(a[2], a[3]);
        __m128i ab_hi = _mm_unpackhi_epi32(a[0], a[1]), cd_hi = _mm_unpackhi_epi32(a[2], a[3]);
        __m128i rs = _mm_srai_epi32(_mm_add_epi32(_mm_unpacklo_epi64(ab_lo, cd_lo), half), COEF_BITS);
        __m128i gs = _mm_srai_epi32(_mm_add_epi32(_mm_unpackhi_epi64(ab_lo, cd_lo), half), COEF_BITS);
        __m128i bs = _mm_srai_epi32(_mm_add_epi32(_mm_unpacklo_epi64(ab_hi, cd_hi), half), COEF_BITS);
        __m128i bytes = _mm_packus_epi16(_mm_packs_epi32(rs, gs), _mm_packs_epi32(bs, bs));
        uint32_t four;
        four = (uint32_t)_mm_cvtsi128_si32(bytes);
        memcpy(r + j, &four, 4);
        four = (uint32_t)_mm_cvtsi128_si32(_mm_srli_si128(bytes, 4));
        memcpy(g + j, &four, 4);
        four = (uint32_t)_mm_cvtsi128_si32(_mm_srli_si128(bytes, 8));
        memcpy(b + j, &four, 4);
    }
#endif
    for (; j < xs->out; j++) {
        const int16_t *s = src + (size_t)(xs->lo[j] - first) * 3;
        const int16_t *w = xs->coef + (size_t)j * xs->taps;
        int32_t sr = 0, sg = 0, sb = 0;
        for (int k = 0; k < xs->n[j]; k++) {
            sr += w[k] * s[3 * k];
            sg += w[k] * s[3 * k + 1];
            sb += w[k] * s[3 * k + 2];
        }
        r[j] = clamp8(sr);
        g[j] = clamp8(sg);
        b[j] = clamp8(sb);
    }
}

#ifdef HAVE_AVX2_PASSES
/* pixel_sums() for two output pixels at once, one in each 128-bit half; `w` holds
 * both pixels' weights, pair by pair, as wide_weights() lays them out. */
AVX2 static inline __m256i pixel_sums2(const int16_t *s0, const int16_t *s1, const int32_t *w,
                                       int pairs)
{
    __m256i sum = _mm256_setzero_si256();
    for (int q = 0; q < pairs; q++, s0 += 6, s1 += 6, w += 8) {
        __m256i v = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)s0)),
            _mm_loadu_si128((const __m128i *)s1), 1);
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_unpacklo_epi16(v, _mm256_srli_si256(v, 6)),
                                                      _mm256_loadu_si256((const __m256i *)w)));
    }
    return sum;
}

/* The packed weights as horizontal_avx2 reads them, made once per resize: for each
 * group of eight output pixels j.., each q < 4 and each pair, pixel j + q's weight
 * pair four times, then pixel j + q + 4's four times. Returns NULL when out of memory. */
static int32_t *wide_weights(const packed_t *p, int out)
{
    int32_t *wide = malloc(sizeof(int32_t) * 8 * (size_t)(out / 8 * 4 * p->pairs + 1));
    int32_t *w = wide;
    if (!wide)
        return NULL;
    for (int j = 0; j + 8 <= out; j += 8)
        for (int q = 0; q < 4; q++)
            for (int k = 0; k < p->pairs; k++, w += 8)
                for (int lane = 0; lane < 8; lane++)
                    w[lane] = p->weights[(size_t)(j + q + (lane < 4 ? 0 : 4)) * p->pairs + k];
    return wide;
}

/* horizontal() eight output pixels at a time: pixels j..j+3 in the low halves, j+4..j+7
 * in the high ones, transposed as there, then each channel's eight bytes gathered. */
AVX2 static void horizontal_avx2(const int16_t *src, int first, const axis_t *xs, const packed_t *p,
                                 const int32_t *wide, uint8_t *r, uint8_t *g, uint8_t *b)
{
    int j = 0;
    const __m256i half = _mm256_set1_epi32(COEF_ONE >> 1);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (; j + 8 <= xs->out; j += 8) {
        __m256i a[4];
        for (int q = 0; q < 4; q++)
            a[q] = pixel_sums2(src + (size_t)(xs->lo[j + q] - first) * 3,
                               src + (size_t)(xs->lo[j + q + 4] - first) * 3,
                               wide + ((size_t)j / 2 + (size_t)q) * p->pairs * 8, p->pairs);
        __m256i ab_lo = _mm256_unpacklo_epi32(a[0], a[1]), cd_lo = _mm256_unpacklo_epi32(a[2], a[3]);
        __m256i ab_hi = _mm256_unpackhi_epi32(a[0], a[1]), cd_hi = _mm256_unpackhi_epi32(a[2], a[3]);
        __m256i rs = _mm256_srai_epi32(_mm256_add_epi32(_mm256_unpacklo_epi64(ab_lo, cd_lo), half), COEF_BITS);
        __m256i gs = _mm256_srai_epi32(_mm256_add_epi32(_mm256_unpackhi_epi64(ab_lo, cd_lo), half), COEF_BITS);
        __m256i bs = _mm256_srai_epi32(_mm256_add_epi32(_mm256_unpacklo_epi64(ab_hi, cd_hi), half), COEF_BITS);
        /* per half: r r r r g g g g b b b b b b b b (bytes); then r0-7 g0-7 b0-7 in order */
        __m256i bytes = _mm256_permutevar8x32_epi32(
            _mm256_packus_epi16(_mm256_packs_epi32(rs, gs), _mm256_packs_epi32(bs, bs)), order);
        __m128i rg = _mm256_castsi256_si128(bytes);
        _mm_storel_epi64((__m128i *)(r + j), rg);
        _mm_storel_epi64((__m128i *)(g + j), _mm_srli_si128(rg, 8));
        _mm_storel_epi64((__m128i *)(b + j), _mm256_extracti128_si256(bytes, 1));
    }
    if (j < xs->out) { /* the last < 8 pixels */
        axis_t rest = *xs;
        rest.out -= j;
        rest.lo += j;
        rest.n += j;
        rest.coef += (size_t)j * xs->taps;
        packed_t prest = {p->pairs, p->weights + (size_t)j * p->pairs};
        horizontal(src, first, &rest, &prest, r + j, g + j, b + j);
    }
}
#endif

/* Resize packed RGB rows (first row = source row `y0`, first column = source
 * column `x0`, `stride` bytes apart) into planar out [3, ys.out, xs.out], whose
 * axes were made in source coordinates; mirrored left to right if `flip` (which
 * reorders xs). Returns 0 or -1 (out of memory). */
static int resize_rows(const uint8_t *src, size_t stride, int x0, int y0,
                       axis_t *xs, const axis_t *ys, int flip, uint8_t *out)
{
    int first = xs->lo[0], last = xs->lo[xs->out - 1] + xs->n[xs->out - 1];
    int width = (last - first) * 3;
    if (flip)
        axis_mirror(xs);
    size_t plane = (size_t)xs->out * ys->out;
    packed_t p = {0, NULL};
    int16_t *row = NULL;
    int32_t *wide = NULL;
#ifdef HAVE_AVX2_PASSES
    const int avx2 = use_avx2; /* read once: use_wide() may change it meanwhile */
#endif
    if (packed_make(&p, xs) || !(row = calloc((size_t)width + 6 * (size_t)p.pairs + 8, sizeof(int16_t)))
#ifdef HAVE_AVX2_PASSES
        || (avx2 && !(wide = wide_weights(&p, xs->out)))
#endif
    ) {
        free(p.weights);
        free(row);
        return -1;
    }
    for (int i = 0; i < ys->out; i++) {
        uint8_t *r = out + (size_t)i * xs->out;
        const uint8_t *s = src + (size_t)(ys->lo[i] - y0) * stride + (size_t)(first - x0) * 3;
        const int16_t *coef = ys->coef + (size_t)i * ys->taps;
#ifdef HAVE_AVX2_PASSES
        if (avx2) {
            vertical_avx2(s, stride, coef, ys->n[i], width, row);
            horizontal_avx2(row, first, xs, &p, wide, r, r + plane, r + 2 * plane);
            continue;
        }
#endif
        vertical(s, stride, coef, ys->n[i], width, row);
        horizontal(row, first, xs, &p, r, r + plane, r + 2 * plane);
    }
    free(p.weights);
    free(wide);
    free(row);
    return 0;
}

/* ---- libjpeg errors ------------------------------------------------------ */

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
} error_t_;

static void on_error(j_common_ptr cinfo)
{
    error_t_ *err = (error_t_ *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level)
{
    if (level < 0) /* a warning: corrupt or truncated data. Fail, as FFmpeg's explode does. */
        on_error(cinfo);
}

/* ---- decode_crop ----------------------------------------------------------- */

enum { OK = 0, FAILED, NOT_RGB, NO_MEMORY, BAD_BOX };

typedef struct {
    const uint8_t *data;
    size_t size;
    uint8_t *out;
    int out_h, out_w;
    double top, left, box_h, box_w;
    int flip;
    axis_t xs, ys; /* here, not on run_decode's stack, so they survive a longjmp */
    /* results */
    int denom;
    char message[JMSG_LENGTH_MAX];
} job_t;

static int choose_denom(const job_t *job)
{
    int denom = 1;
    while (denom < 8 && job->box_h >= 2.0 * denom * job->out_h &&
           job->box_w >= 2.0 * denom * job->out_w)
        denom *= 2;
    return denom;
}

static int run_decode(job_t *job)
{
    struct jpeg_decompress_struct cinfo;
    error_t_ err;
    axis_t *const xs = &job->xs, *const ys = &job->ys;
    uint8_t *volatile pixels = NULL;
    volatile int status = OK;

    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    jpeg_create_decompress(&cinfo);
    if (setjmp(err.jump)) {
        memcpy(job->message, err.message, sizeof err.message);
        status = FAILED;
        goto done;
    }
    jpeg_mem_src(&cinfo, job->data, (unsigned long)job->size);
    jpeg_read_header(&cinfo, TRUE);
    if (cinfo.jpeg_color_space != JCS_YCbCr && cinfo.jpeg_color_space != JCS_GRAYSCALE &&
        cinfo.jpeg_color_space != JCS_RGB) {
        status = NOT_RGB;
        goto done;
    }
    if (job->top < 0 || job->left < 0 || job->box_h <= 0 || job->box_w <= 0 ||
        job->top + job->box_h > cinfo.image_height + 1e-6 ||
        job->left + job->box_w > cinfo.image_width + 1e-6) {
        snprintf(job->message, sizeof job->message,
                 "crop box %.1fx%.1f at (%.1f, %.1f) is outside the %ux%u image",
                 job->box_w, job->box_h, job->left, job->top,
                 cinfo.image_width, cinfo.image_height);
        status = BAD_BOX;
        goto done;
    }
    job->denom = choose_denom(job);
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = job->denom;
    /* The accurate IDCT and fancy (smooth) chroma upsampling are libjpeg's defaults;
     * JDCT_IFAST without fancy upsampling was no faster here and cost 16 dB. */
    jpeg_calc_output_dimensions(&cinfo);
    {
        /* the box in the scaled image's pixels: the scaled IDCT's pixel i covers source
         * pixels [i * denom, (i + 1) * denom) */
        double d = job->denom;
        int width = (int)cinfo.output_width, height = (int)cinfo.output_height;
        if (axis_make(xs, job->left / d, job->box_w / d, width, job->out_w) ||
            axis_make(ys, job->top / d, job->box_h / d, height, job->out_h)) {
            status = NO_MEMORY;
            goto done;
        }
    }
    jpeg_start_decompress(&cinfo);
    {
        JDIMENSION x0 = (JDIMENSION)xs->lo[0];
        JDIMENSION cols = (JDIMENSION)(xs->lo[xs->out - 1] + xs->n[xs->out - 1]) - x0;
        JDIMENSION y0 = (JDIMENSION)ys->lo[0];
        JDIMENSION y1 = (JDIMENSION)(ys->lo[ys->out - 1] + ys->n[ys->out - 1]);
        size_t stride;
        /* One more column each side, then jpeg_crop_scanline widens the window to whole
         * iMCU columns (x0 moves left to the boundary). Fancy upsampling takes a
         * column's chroma from its neighbours, and libjpeg treats the window's edge as
         * the image's: a box starting or ending on an iMCU boundary had its edge column
         * up to 40 levels off the full image's. The extra column puts the neighbouring
         * iMCU in the window, so every column of the box decodes as in the full image. */
        JDIMENSION end = x0 + cols + 1 < cinfo.output_width ? x0 + cols + 1 : cinfo.output_width;
        x0 = x0 > 0 ? x0 - 1 : 0;
        cols = end - x0;
        if (cols < cinfo.output_width)
            jpeg_crop_scanline(&cinfo, &x0, &cols);
        stride = (size_t)cinfo.output_width * 3;
        pixels = malloc(stride * (y1 - y0));
        if (!pixels) {
            status = NO_MEMORY;
            goto done;
        }
        if (y0 > 0 && jpeg_skip_scanlines(&cinfo, y0) != y0) {
            snprintf(job->message, sizeof job->message, "JPEG ended before row %u", y0);
            status = FAILED;
            goto done;
        }
        while (cinfo.output_scanline < y1) {
            JSAMPROW rowp = pixels + (cinfo.output_scanline - y0) * stride;
            if (jpeg_read_scanlines(&cinfo, &rowp, 1) != 1) {
                snprintf(job->message, sizeof job->message, "JPEG ended at row %u",
                         cinfo.output_scanline);
                status = FAILED;
                goto done;
            }
        }
        if (cinfo.output_scanline == cinfo.output_height)
            jpeg_finish_decompress(&cinfo); /* reads to the end-of-image marker */
        if (resize_rows(pixels, stride, (int)x0, (int)y0, xs, ys, job->flip, job->out))
            status = NO_MEMORY;
    }
done:
    jpeg_destroy_decompress(&cinfo);
    free(pixels);
    axis_free(xs);
    axis_free(ys);
    return status;
}

static int parse_box(PyObject *box, double *top, double *left, double *h, double *w)
{
    return PyArg_ParseTuple(box, "dddd;box must be (top, left, height, width)", top, left, h, w);
}

static int get_out(PyObject *obj, Py_buffer *view, int *h, int *w)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_ND | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS))
        return -1;
    if (view->ndim != 3 || view->shape[0] != 3 || view->itemsize != 1 ||
        strcmp(view->format ? view->format : "B", "B") != 0 || view->shape[1] < 1 ||
        view->shape[2] < 1) {
        PyErr_SetString(PyExc_ValueError, "out must be a C-contiguous uint8 [3, H, W] array");
        PyBuffer_Release(view);
        return -1;
    }
    *h = (int)view->shape[1];
    *w = (int)view->shape[2];
    return 0;
}

PyDoc_STRVAR(decode_crop_doc,
"decode_crop(data, out, box, flip=False) -> int\n\n"
"Decode the JPEG ``data``'s window ``box`` = (top, left, height, width), in\n"
"source pixels (floats allowed), resized (bilinear, widened when shrinking) into\n"
"``out``, a C-contiguous uint8 [3, H, W] array, mirrored if ``flip``. Returns\n"
"the DCT scale denominator used (1, 2, 4 or 8). Raises Error for damaged data, Unsupported\n"
"for colour spaces other than YCbCr, RGB and grayscale.");

static PyObject *decode_crop(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"data", "out", "box", "flip", NULL};
    Py_buffer data, out;
    PyObject *out_obj, *box;
    int status, flip = 0;
    job_t job;

    memset(&job, 0, sizeof job);
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*OO|p", names, &data, &out_obj, &box, &flip))
        return NULL;
    if (!parse_box(box, &job.top, &job.left, &job.box_h, &job.box_w) ||
        get_out(out_obj, &out, &job.out_h, &job.out_w)) {
        PyBuffer_Release(&data);
        return NULL;
    }
    job.data = data.buf;
    job.size = (size_t)data.len;
    job.out = out.buf;
    job.flip = flip;
    Py_BEGIN_ALLOW_THREADS
    status = run_decode(&job);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    switch (status) {
    case OK:
        return PyLong_FromLong(job.denom);
    case NOT_RGB:
        PyErr_SetString(Unsupported, "JPEG colour space is not YCbCr, RGB or grayscale");
        return NULL;
    case NO_MEMORY:
        return PyErr_NoMemory();
    default: /* FAILED, or BAD_BOX: a box made from a size the header does not agree with */
        PyErr_SetString(JpegError, job.message);
        return NULL;
    }
}

PyDoc_STRVAR(resize_rgb_doc,
"resize_rgb(image, out, box, flip=False) -> None\n\n"
"Resize the window ``box`` = (top, left, height, width) of ``image``, a packed\n"
"uint8 [h, w, 3] array whose rows may be padded, into ``out`` [3, H, W], with\n"
"decode_crop's filter, mirrored if ``flip``.");

static PyObject *resize_rgb(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"image", "out", "box", "flip", NULL};
    Py_buffer image, out;
    PyObject *image_obj, *out_obj, *box;
    double top, left, bh, bw;
    int out_h, out_w, status = 0, flip = 0;
    axis_t xs = {0}, ys = {0};

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|p", names, &image_obj, &out_obj, &box,
                                     &flip) ||
        !parse_box(box, &top, &left, &bh, &bw))
        return NULL;
    if (PyObject_GetBuffer(image_obj, &image, PyBUF_STRIDES | PyBUF_FORMAT))
        return NULL;
    if (image.ndim != 3 || image.shape[2] != 3 || image.itemsize != 1 ||
        image.strides[2] != 1 || image.strides[1] != 3 ||
        strcmp(image.format ? image.format : "B", "B") != 0) {
        PyErr_SetString(PyExc_ValueError, "image must be a uint8 [h, w, 3] array with packed pixels");
        PyBuffer_Release(&image);
        return NULL;
    }
    if (top < 0 || left < 0 || bh <= 0 || bw <= 0 || top + bh > image.shape[0] + 1e-6 ||
        left + bw > image.shape[1] + 1e-6) {
        PyErr_Format(PyExc_ValueError, "crop box is outside the %zdx%zd image",
                     image.shape[1], image.shape[0]);
        PyBuffer_Release(&image);
        return NULL;
    }
    if (get_out(out_obj, &out, &out_h, &out_w)) {
        PyBuffer_Release(&image);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (axis_make(&xs, left, bw, (int)image.shape[1], out_w) ||
        axis_make(&ys, top, bh, (int)image.shape[0], out_h) ||
        resize_rows(image.buf, (size_t)image.strides[0], 0, 0, &xs, &ys, flip, out.buf))
        status = -1;
    axis_free(&xs);
    axis_free(&ys);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&image);
    PyBuffer_Release(&out);
    if (status)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(use_wide_doc, "use_wide(flag) -> bool\n\n"
             "Run the resize's AVX2 passes (where the CPU has them) or the SSE2 ones;\n"
             "whether the AVX2 ones are now in use. For tests: both must agree.");

static PyObject *use_wide(PyObject *self, PyObject *flag)
{
    int on = PyObject_IsTrue(flag);
    if (on < 0)
        return NULL;
#ifdef HAVE_AVX2_PASSES
    use_avx2 = on && __builtin_cpu_supports("avx2");
    return PyBool_FromLong(use_avx2);
#else
    return PyBool_FromLong(0);
#endif
}

/* What the resize's passes run on here, for the start-up log. */
static const char *resize_simd(void)
{
#ifdef HAVE_AVX2_PASSES
    if (use_avx2)
        return "AVX2";
#endif
#ifdef __SSE2__
    return "SSE2";
#else
    return "scalar";
#endif
}

static PyMethodDef methods[] = {
    {"decode_crop", (PyCFunction)(void (*)(void))decode_crop, METH_VARARGS | METH_KEYWORDS,
     decode_crop_doc},
    {"resize_rgb", (PyCFunction)(void (*)(void))resize_rgb, METH_VARARGS | METH_KEYWORDS,
     resize_rgb_doc},
    {"use_wide", use_wide, METH_O, use_wide_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpeg",
    "libjpeg-turbo crop decode and a Pillow-style bilinear resize, GIL released.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__jpeg(void)
{
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
#ifdef HAVE_AVX2_PASSES
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2");
#endif
    JpegError = PyErr_NewException("gpufeed.server.media._jpeg.Error", NULL, NULL);
    Unsupported = PyErr_NewException("gpufeed.server.media._jpeg.Unsupported", NULL, NULL);
    if (PyModule_AddObject(m, "Error", JpegError) ||
        PyModule_AddObject(m, "Unsupported", Unsupported) ||
        PyModule_AddIntConstant(m, "LIBJPEG_VERSION", JPEG_LIB_VERSION) ||
        PyModule_AddStringConstant(m, "RESIZE_SIMD", resize_simd())) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
