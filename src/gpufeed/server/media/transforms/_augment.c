/* The built-in augmentations' C kernels (src/gpufeed/server/media/transforms/builtins.py), GIL released.
 *
 * Each kernel computes, pixel by pixel on uint8 planes, the formula the torch
 * path in transforms/builtins.py computes with whole-tensor operations (torchvision.
 * transforms.v2's formulas): the same float32 operations in the same order,
 * so the results are the torch path's, without its float32 temporaries and
 * the passes over memory between operations. Where torch's vectorised
 * kernels fuse a multiply and an add (add(a, b, alpha) is fma(b, alpha, a)
 * in its AVX2 code), the kernel calls fmaf; everything else is compiled
 * with -ffp-contract=off, so the compiler fuses nothing torch does not.
 *
 * Exceptions, where exact arithmetic replaces torch's rounding:
 * - contrast's mean of the grey image is summed in integers (torch sums
 *   float32, exact while the sum stays under 2^24: up to ~256x256 images);
 * - warp maps output pixels to input pixels in double, the exact formula,
 *   where torch's grid_sample path rounds a float32 grid (a sample point that
 *   lies on a pixel edge may round to the other neighbour there).
 *
 * Every function takes a source and a destination buffer (C-contiguous
 * uint8, the same length, not overlapping) and the shape as integers.
 *
 * Compiled with -ffp-contract=off (no fusing the source does not ask for)
 * and -fno-trapping-math (no FP exceptions observed, so the compiler may
 * evaluate both sides of a select and vectorise: values are unchanged).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef const uint8_t *restrict in_t; /* a kernel's source ... */
typedef uint8_t *restrict out_t;      /* ... and destination: never the same memory */

/* Inlined into each variant below, so each has its own vector code. */
#define INLINE static inline __attribute__((always_inline))

#if defined(__GNUC__) && defined(__x86_64__)
/* One build for any x86-64: each kernel's body compiled twice, for the baseline and
 * for AVX2 + FMA (fmaf an instruction, not a call), chosen at import by the CPU. */
static int wide;
#define VARIANTS(name, params, args)                                                    \
    static void name##_base params { name##_body args; }                                \
    __attribute__((target("avx2,fma"))) static void name##_wide params { name##_body args; } \
    static void name params                                                             \
    {                                                                                   \
        if (wide)                                                                       \
            name##_wide args;                                                           \
        else                                                                            \
            name##_base args;                                                           \
    }
#define DETECT() (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
#else
#define VARIANTS(name, params, args) \
    static void name params { name##_body args; }
#define DETECT() 0
#endif

typedef struct {
    Py_buffer src, dst;
    int have_src, have_dst;
} buffers_t;

static void release(buffers_t *b)
{
    if (b->have_src)
        PyBuffer_Release(&b->src);
    if (b->have_dst)
        PyBuffer_Release(&b->dst);
}

/* The source and destination of ``count`` bytes; -1 with an exception if they are not. */
static int get_buffers(PyObject *src, PyObject *dst, Py_ssize_t count, buffers_t *b)
{
    b->have_src = b->have_dst = 0;
    if (count < 0) {
        PyErr_SetString(PyExc_ValueError, "negative shape");
        return -1;
    }
    if (PyObject_GetBuffer(src, &b->src, PyBUF_C_CONTIGUOUS))
        return -1;
    b->have_src = 1;
    if (PyObject_GetBuffer(dst, &b->dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)) {
        release(b);
        return -1;
    }
    b->have_dst = 1;
    if (b->src.len != count || b->dst.len != count) {
        PyErr_Format(PyExc_ValueError, "buffers of %zd and %zd bytes for a shape of %zd",
                     b->src.len, b->dst.len, count);
        release(b);
        return -1;
    }
    const char *s = b->src.buf, *d = b->dst.buf;
    if (count && !(s + count <= d || d + count <= s)) {
        PyErr_SetString(PyExc_ValueError, "source and destination overlap");
        release(b);
        return -1;
    }
    return 0;
}

INLINE uint8_t to_u8(float x) /* clamp_(0, 255).to(uint8): truncation */
{
    x = x < 0.0f ? 0.0f : x;
    x = x > 255.0f ? 255.0f : x;
    return (uint8_t)(int)x;
}

/* ---- brightness, saturation, contrast ---------------------------------- */

INLINE void brightness_run_body(in_t src, out_t dst, size_t count, float factor)
{
    for (size_t i = 0; i < count; i++)
        dst[i] = to_u8((float)src[i] * factor);
}
VARIANTS(brightness_run, (in_t src, out_t dst, size_t count, float factor),
         (src, dst, count, factor))

/* floor(0.2989 R + 0.587 G + 0.114 B) as torch: r * 0.2989, then two add(alpha)s
 * (the floor by truncation: the sum is not negative). */
INLINE float luma(float r, float g, float b)
{
    return (float)(int)fmaf(b, 0.114f, fmaf(g, 0.587f, r * 0.2989f));
}

/* factor * x + (1 - factor) * other, torch's mul then add(other, alpha=1 - factor). */
INLINE uint8_t blend(float x, float other, float factor, float alpha)
{
    return to_u8(fmaf(other, alpha, x * factor));
}

INLINE void saturation_run_body(in_t src, out_t dst, size_t images, size_t plane, float factor,
                                float alpha)
{
    for (size_t n = 0; n < images; n++, src += 3 * plane, dst += 3 * plane) {
        const uint8_t *restrict r = src, *restrict g = src + plane, *restrict b = src + 2 * plane;
        uint8_t *restrict r_out = dst, *restrict g_out = dst + plane;
        uint8_t *restrict b_out = dst + 2 * plane;
        for (size_t i = 0; i < plane; i++) {
            float grey = luma(r[i], g[i], b[i]);
            r_out[i] = blend(r[i], grey, factor, alpha);
            g_out[i] = blend(g[i], grey, factor, alpha);
            b_out[i] = blend(b[i], grey, factor, alpha);
        }
    }
}
VARIANTS(saturation_run, (in_t src, out_t dst, size_t images, size_t plane, float factor, float
         alpha),
         (src, dst, images, plane, factor, alpha))

INLINE void contrast_run_body(in_t src, out_t dst, size_t images, size_t plane, float factor,
                              float alpha)
{
    for (size_t n = 0; n < images; n++, src += 3 * plane, dst += 3 * plane) {
        uint64_t sum = 0;
        for (size_t start = 0; start < plane; start += 65536) { /* 255 * 65536 < 2^32 */
            size_t end = plane - start < 65536 ? plane : start + 65536;
            uint32_t part = 0;
            for (size_t i = start; i < end; i++)
                part += (uint32_t)luma(src[i], src[plane + i], src[2 * plane + i]);
            sum += part;
        }
        float mean = (float)sum / (float)plane;
        for (size_t i = 0; i < 3 * plane; i++)
            dst[i] = blend(src[i], mean, factor, alpha);
    }
}
VARIANTS(contrast_run, (in_t src, out_t dst, size_t images, size_t plane, float factor, float
         alpha),
         (src, dst, images, plane, factor, alpha))

/* ---- hue: RGB -> HSV, rotate, HSV -> RGB, in float32 ------------------- */

/* Each select a single one, so that the compiler vectorises the loop. */
INLINE float unit(float x) /* clamp_(0.0, 1.0) */
{
    x = x < 0.0f ? 0.0f : x;
    return x > 1.0f ? 1.0f : x;
}

/* A channel's value in ``sector``: v in sectors a and b, q in c, u in d, else p. */
INLINE float pick(int sector, int a, int b, int c, int d, float v, float p, float q, float u)
{
    float o = sector == c ? q : p;
    o = sector == d ? u : o;
    o = sector == a ? v : o;
    return sector == b ? v : o;
}

INLINE void hue_run_body(in_t src, out_t dst, size_t images, size_t plane, float factor)
{
    const float scale = (float)(1.0 / 255), sixth = (float)(1.0 / 6.0);
    const float back = (float)(255 + 1.0 - 1e-3);
    for (size_t n = 0; n < images; n++, src += 3 * plane, dst += 3 * plane) {
        const uint8_t *restrict r_in = src, *restrict g_in = src + plane;
        const uint8_t *restrict b_in = src + 2 * plane;
        uint8_t *restrict r_out = dst, *restrict g_out = dst + plane;
        uint8_t *restrict b_out = dst + 2 * plane;
        for (size_t i = 0; i < plane; i++) {
            float r = (float)r_in[i] * scale, g = (float)g_in[i] * scale;
            float b = (float)b_in[i] * scale;
            float high = r > g ? r : g, low = r < g ? r : g;
            high = high > b ? high : b;
            low = low < b ? low : b;
            float spread = high - low;
            float s = high == low ? 1.0f : high;
            s = spread / s;
            float divisor = high == low ? 1.0f : spread;
            float rc = (high - r) / divisor, gc = (high - g) / divisor;
            float bc = (high - b) / divisor;
            float h = (gc + 4.0f) - rc;
            float hg = (rc + 2.0f) - bc, hr = bc - gc;
            h = high == g ? hg : h;
            h = high == r ? hr : h;
            h = h * sixth + 1.0f; /* in [5/6, 11/6]: fmod(h, 1) is h or h - 1, exact */
            float h1 = h - 1.0f;
            h = h >= 1.0f ? h1 : h;
            /* remainder(h + factor, 1); h + factor is in [-0.5, 1.5) */
            float t = h + factor;
            float m = t - (float)(int)t;
            float m1 = m + 1.0f;
            h = m < 0.0f ? m1 : m;
            float h6 = h * 6.0f;
            float whole = (float)(int)h6; /* floor: h6 >= 0 */
            float f = h6 - whole;
            int sector = (int)whole;
            sector = sector == 6 ? 0 : sector; /* remainder 6 */
            float sf = s * f, v = high;
            float p = (1.0f - s) * v, q = (1.0f - sf) * v, u = (sf + (1.0f - s)) * v;
            p = unit(p), q = unit(q), u = unit(u);
            /* by sector 0..5: red v q p p u v, green u v v q p p, blue p p u v v q */
            float o0 = pick(sector, 0, 5, 1, 4, v, p, q, u);
            float o1 = pick(sector, 1, 2, 3, 0, v, p, q, u);
            float o2 = pick(sector, 3, 4, 5, 2, v, p, q, u);
            r_out[i] = (uint8_t)(int)(o0 * back);
            g_out[i] = (uint8_t)(int)(o1 * back);
            b_out[i] = (uint8_t)(int)(o2 * back);
        }
    }
}
VARIANTS(hue_run, (in_t src, out_t dst, size_t images, size_t plane, float factor),
         (src, dst, images, plane, factor))

/* ---- sharpness: blend with a 3x3 smoothing inside a one-pixel border --- */

INLINE void sharpness_run_body(in_t src, out_t dst, size_t planes, size_t h, size_t w, float
                               alpha)
{
    for (size_t c = 0; c < planes; c++, src += h * w, dst += h * w) {
        memcpy(dst, src, w);
        memcpy(dst + (h - 1) * w, src + (h - 1) * w, w);
        for (size_t y = 1; y + 1 < h; y++) {
            const uint8_t *up = src + (y - 1) * w, *row = src + y * w, *down = src + (y + 1) * w;
            uint8_t *out = dst + y * w;
            out[0] = row[0];
            out[w - 1] = row[w - 1];
            for (size_t x = 1; x + 1 < w; x++) {
                int ring = up[x - 1] + up[x] + up[x + 1] + row[x - 1] + row[x + 1] +
                           down[x - 1] + down[x] + down[x + 1];
                int total = ring + 5 * row[x];
                /* round(total / 13): never a tie (13 is odd), so exact integers give
                 * what torch's float32 convolution rounds to */
                int smooth = (2 * total + 13) / 26;
                float inner = row[x];
                out[x] = to_u8(fmaf((float)smooth - inner, alpha, inner));
            }
        }
    }
}
VARIANTS(sharpness_run, (in_t src, out_t dst, size_t planes, size_t h, size_t w, float alpha),
         (src, dst, planes, h, w, alpha))

/* ---- autocontrast and equalize: per-plane tables ----------------------- */

INLINE void autocontrast_run_body(in_t src, out_t dst, size_t planes, size_t plane)
{
    const float step = (float)(1.0 / 255);
    for (size_t c = 0; c < planes; c++, src += plane, dst += plane) {
        uint8_t low = 255, high = 0;
        for (size_t i = 0; i < plane; i++) {
            low = src[i] < low ? src[i] : low;
            high = src[i] > high ? src[i] : high;
        }
        uint8_t table[256];
        float scale = high == low ? 1.0f : (float)(high - low) * step;
        float base = high == low ? 0.0f : (float)low;
        for (int v = 0; v < 256; v++)
            table[v] = to_u8(((float)v - base) / scale);
        for (size_t i = 0; i < plane; i++)
            dst[i] = table[src[i]];
    }
}
VARIANTS(autocontrast_run, (in_t src, out_t dst, size_t planes, size_t plane),
         (src, dst, planes, plane))

/* Pillow's equalize table, as torchvision: step = (count - count of the last level) / 255
 * (floored); level v -> (count below v + step / 2) / step; a plane with step 0 is kept. */
static void equalize_run(in_t src, out_t dst, size_t planes, size_t plane)
{
    for (size_t c = 0; c < planes; c++, src += plane, dst += plane) {
        size_t hist[256] = {0};
        for (size_t i = 0; i < plane; i++)
            hist[src[i]]++;
        int last = 255;
        while (last > 0 && hist[last] == 0)
            last--;
        size_t step = (plane - hist[last]) / 255;
        if (step == 0) {
            memmove(dst, src, plane);
            continue;
        }
        uint8_t table[256];
        size_t below = 0;
        for (int v = 0; v < 256; v++) {
            size_t level = (below + step / 2) / step;
            table[v] = (uint8_t)(level > 255 ? 255 : level);
            below += hist[v];
        }
        for (size_t i = 0; i < plane; i++)
            dst[i] = table[src[i]];
    }
}

/* ---- warp: nearest-neighbour affine ------------------------------------ */

/* Output pixel (x, y), as offsets from the centre, reads the input at m (x, y, 1) from
 * the centre, rounded half to even; outside the image: fill[c] (or zero). */
INLINE void warp_run_body(in_t src, out_t dst, size_t images, size_t channels, size_t h, size_t
                          w, const double *m, const uint8_t *fill)
{
    const double cx = ((double)w - 1.0) * 0.5, cy = ((double)h - 1.0) * 0.5;
    const size_t plane = h * w;
    for (size_t y = 0; y < h; y++) {
        double oy = (double)y - cy;
        for (size_t x = 0; x < w; x++) {
            double ox = (double)x - cx;
            double sx = nearbyint(m[0] * ox + m[1] * oy + m[2] + cx);
            double sy = nearbyint(m[3] * ox + m[4] * oy + m[5] + cy);
            size_t at = y * w + x;
            int inside = sx >= 0 && sx < (double)w && sy >= 0 && sy < (double)h;
            size_t from = inside ? (size_t)sy * w + (size_t)sx : 0;
            for (size_t n = 0; n < images; n++) {
                const uint8_t *in = src + n * channels * plane;
                uint8_t *out = dst + n * channels * plane;
                for (size_t c = 0; c < channels; c++)
                    out[c * plane + at] = inside ? in[c * plane + from] : fill[c];
            }
        }
    }
}
VARIANTS(warp_run, (in_t src, out_t dst, size_t images, size_t channels, size_t h, size_t w,
         const double *m, const uint8_t *fill),
         (src, dst, images, channels, h, w, m, fill))

/* ---- the module -------------------------------------------------------- */

#define ARGS_SHAPE "OOnnn"

/* Parses (src, dst, a, b, c[, factor]) and gets a * b * c bytes of each buffer. */
static int parse(PyObject *args, const char *format, buffers_t *bufs, Py_ssize_t *a,
                 Py_ssize_t *b, Py_ssize_t *c, double *factor)
{
    PyObject *src, *dst;
    int ok = factor ? PyArg_ParseTuple(args, format, &src, &dst, a, b, c, factor)
                    : PyArg_ParseTuple(args, format, &src, &dst, a, b, c);
    if (!ok)
        return -1;
    if (*a < 0 || *b < 0 || *c < 0) {
        PyErr_SetString(PyExc_ValueError, "negative shape");
        return -1;
    }
    return get_buffers(src, dst, *a * *b * *c, bufs);
}

/* The kernels as one signature: the shape (a, b, c) and a factor. */
typedef void (*kernel_t)(in_t src, out_t dst, size_t a, size_t b, size_t c, double factor);

static void brightness_k(in_t src, out_t dst, size_t n, size_t c, size_t p, double f)
{
    brightness_run(src, dst, n * c * p, (float)f);
}

static void saturation_k(in_t src, out_t dst, size_t n, size_t c, size_t p, double f)
{
    saturation_run(src, dst, n, p, (float)f, (float)(1.0 - f));
}

static void contrast_k(in_t src, out_t dst, size_t n, size_t c, size_t p, double f)
{
    if (p) /* no pixels, no mean */
        contrast_run(src, dst, n, p, (float)f, (float)(1.0 - f));
}

static void hue_k(in_t src, out_t dst, size_t n, size_t c, size_t p, double f)
{
    hue_run(src, dst, n, p, (float)f);
}

static void sharpness_k(in_t src, out_t dst, size_t planes, size_t h, size_t w, double f)
{
    sharpness_run(src, dst, planes, h, w, (float)(1.0 - f));
}

static void autocontrast_k(in_t src, out_t dst, size_t planes, size_t one, size_t p, double f)
{
    autocontrast_run(src, dst, planes * one, p);
}

static void equalize_k(in_t src, out_t dst, size_t planes, size_t one, size_t p, double f)
{
    equalize_run(src, dst, planes * one, p);
}

enum { FACTOR = 1, RGB = 2, AT_LEAST_3X3 = 4 };

/* Parse (src, dst, a, b, c[, factor]), check the shape as ``flags`` say, run ``kernel``
 * without the GIL. */
static PyObject *run(PyObject *args, kernel_t kernel, int flags)
{
    buffers_t bufs;
    Py_ssize_t a, b, c;
    double factor = 0.0;
    if (parse(args, flags & FACTOR ? ARGS_SHAPE "d" : ARGS_SHAPE, &bufs, &a, &b, &c,
              flags & FACTOR ? &factor : NULL))
        return NULL;
    const char *wrong = (flags & RGB) && b != 3 ? "this kernel takes RGB images (3 channels)"
                        : (flags & AT_LEAST_3X3) && (b < 3 || c < 3)
                            ? "sharpness needs at least 3x3 pixels"
                            : NULL;
    if (wrong) {
        PyErr_SetString(PyExc_ValueError, wrong);
        release(&bufs);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    kernel(bufs.src.buf, bufs.dst.buf, (size_t)a, (size_t)b, (size_t)c, factor);
    Py_END_ALLOW_THREADS
    release(&bufs);
    Py_RETURN_NONE;
}

#define KERNEL(name, flags, doc)                               \
    PyDoc_STRVAR(name##_doc, doc);                             \
    static PyObject *name(PyObject *self, PyObject *args)      \
    {                                                          \
        return run(args, name##_k, flags);                     \
    }

KERNEL(brightness, FACTOR, "brightness(src, dst, images, channels, pixels, factor)\n\n"
       "dst = clamp(src * factor, 0, 255), truncated.")
KERNEL(saturation, FACTOR | RGB, "saturation(src, dst, images, 3, pixels, factor)\n\n"
       "Blend each RGB image with its grey (ITU-R 601 luma, floored).")
KERNEL(contrast, FACTOR | RGB, "contrast(src, dst, images, 3, pixels, factor)\n\n"
       "Blend each RGB image with the mean of its grey.")
KERNEL(hue, FACTOR | RGB, "hue(src, dst, images, 3, pixels, factor)\n\n"
       "Rotate each RGB image's hue by factor turns, through HSV in float32.")
KERNEL(sharpness, FACTOR | AT_LEAST_3X3, "sharpness(src, dst, planes, height, width, factor)\n\n"
       "Blend each plane with its 3x3 smoothing inside a one-pixel border.")
KERNEL(autocontrast, 0, "autocontrast(src, dst, planes, 1, pixels)\n\n"
       "Stretch each plane to [0, 255] (a flat plane kept).")
KERNEL(equalize, 0, "equalize(src, dst, planes, 1, pixels)\n\n"
       "Equalize each plane's histogram with Pillow's table.")

PyDoc_STRVAR(warp_doc, "warp(src, dst, images, channels, height, width, matrix, fill)\n\n"
             "Nearest-neighbour affine warp: output pixel (x, y), from the centre, reads\n"
             "the input at matrix (6 numbers, row-major 2x3) times (x, y, 1), from the\n"
             "centre; outside: fill (bytes, one per channel) or zeros if None.");

static PyObject *warp(PyObject *self, PyObject *args)
{
    PyObject *src, *dst, *fill_obj;
    Py_ssize_t n, c, h, w;
    double m[6];
    buffers_t b;
    if (!PyArg_ParseTuple(args, "OOnnnn(dddddd)O", &src, &dst, &n, &c, &h, &w, &m[0], &m[1],
                          &m[2], &m[3], &m[4], &m[5], &fill_obj))
        return NULL;
    if (n < 0 || c < 0 || h < 0 || w < 0) {
        PyErr_SetString(PyExc_ValueError, "negative shape");
        return NULL;
    }
    uint8_t *fill = calloc((size_t)c + 1, 1);
    if (!fill)
        return PyErr_NoMemory();
    if (fill_obj != Py_None) {
        char *bytes;
        Py_ssize_t len;
        if (PyBytes_AsStringAndSize(fill_obj, &bytes, &len)) {
            free(fill);
            return NULL;
        }
        if (len != c) {
            PyErr_SetString(PyExc_ValueError, "fill must have one byte per channel");
            free(fill);
            return NULL;
        }
        memcpy(fill, bytes, (size_t)c);
    }
    if (get_buffers(src, dst, n * c * h * w, &b)) {
        free(fill);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    warp_run(b.src.buf, b.dst.buf, (size_t)n, (size_t)c, (size_t)h, (size_t)w, m, fill);
    Py_END_ALLOW_THREADS
    release(&b);
    free(fill);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(use_wide_doc, "use_wide(flag) -> bool\n\n"
             "Run the AVX2 + FMA variants (where the CPU has them) or the baseline ones;\n"
             "whether the wide ones are now in use. For tests: both must agree.");

static PyObject *use_wide(PyObject *self, PyObject *flag)
{
    int on = PyObject_IsTrue(flag);
    if (on < 0)
        return NULL;
#if defined(__GNUC__) && defined(__x86_64__)
    wide = on && DETECT();
    return PyBool_FromLong(wide);
#else
    return PyBool_FromLong(0);
#endif
}

static PyMethodDef methods[] = {
    {"use_wide", use_wide, METH_O, use_wide_doc},
    {"brightness", brightness, METH_VARARGS, brightness_doc},
    {"saturation", saturation, METH_VARARGS, saturation_doc},
    {"contrast", contrast, METH_VARARGS, contrast_doc},
    {"hue", hue, METH_VARARGS, hue_doc},
    {"sharpness", sharpness, METH_VARARGS, sharpness_doc},
    {"autocontrast", autocontrast, METH_VARARGS, autocontrast_doc},
    {"equalize", equalize, METH_VARARGS, equalize_doc},
    {"warp", warp, METH_VARARGS, warp_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_augment",
    "uint8 kernels of the built-in augmentations, torchvision's formulas, GIL released.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__augment(void)
{
    PyObject *m = PyModule_Create(&module);
#if defined(__GNUC__) && defined(__x86_64__)
    wide = DETECT();
#endif
    if (m && PyModule_AddIntConstant(m, "WIDE", DETECT())) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
