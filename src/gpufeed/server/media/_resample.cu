// A batch's crops resampled to the output in one kernel launch (--decoder nvimgcodec).
//
// nvImageCodec decodes each crop's region into memory of its own; without this kernel,
// BatchJpegDecoder copies every region into one padded tensor and resamples it with
// two batched matrix products (batch_resample.py, resample): a dozen torch
// calls per image, run under the GIL by every decode thread. This kernel reads the
// regions where they lie and writes the uint8 [N, 3, H, W] batch, one launch per
// batch. Its filter is the CPU path's and crop_taps's: a triangle one pixel (widened
// when shrinking) either side of each output pixel's centre over the box's exact
// sub-pixel position, clipped to the image; an output pixel whose taps all fall
// outside takes the nearest pixel. Rounding is to nearest, ties to even, as torch's.
//
// Built by bench/gpu/prepare.sh with nvcc for the device check (it needs no torch
// headers: the Python side passes raw pointers and the stream through ctypes). The
// same file compiles as plain C++ (no nvcc), which gives the host entry point alone:
// the tests check its pixels against the Python path on any machine.

#include <math.h>
#include <stdint.h>

#ifndef __CUDACC__
#define __host__
#define __device__
#endif

extern "C" {

// One crop: must match _CROP in batch_resample.py (80 bytes).
typedef struct {
    uint64_t src;       // address of the region's pixel (0, 0): HWC uint8
    int64_t pitch;      // bytes from one row of the region to the next
    int32_t first_y;    // the region's top-left pixel in the source image
    int32_t first_x;
    int32_t rows;       // the region's size
    int32_t cols;
    int32_t size_y;     // the source image's height and width
    int32_t size_x;
    double top;         // the crop box, in source pixels
    double left;
    double height;
    double width;
    int32_t flip;       // mirror the output left to right
    int32_t unused;
} gpufeed_crop;

}  // extern "C"

// The source pixels [*lo, *hi) that output pixel j of an axis reads, with the
// triangle's centre and half-width (crop_taps in batch_resample.py).
__host__ __device__ static inline void axis_taps(double start, double length, int size, int out,
                                                 int j, int* lo, int* hi, double* centre,
                                                 double* widen) {
    double scale = length / out;
    double w = scale > 1.0 ? scale : 1.0;
    double c = start + (j + 0.5) * scale;
    long long l = (long long)floor(c - w + 0.5);
    if (l < 0) l = 0;
    long long h = (long long)floor(c + w + 0.5);
    if (h > size) h = size;
    long long cap = l + (long long)ceil(w) * 2 + 2;
    if (h > cap) h = cap;
    if (h <= l) {  // every tap outside: the nearest pixel
        l = c < 0.5 ? 0 : size - 1;
        h = l + 1;
    }
    *lo = (int)l;
    *hi = (int)h;
    *centre = c;
    *widen = w;
}

// Tap i's weight before normalising; taps whose weights sum to 0 take the first alone.
__host__ __device__ static inline double tap_weight(int i, double centre, double widen) {
    double t = fabs((i + 0.5 - centre) / widen);
    return t < 1.0 ? 1.0 - t : 0.0;
}

__host__ __device__ static inline double taps_sum(int lo, int hi, double centre, double widen) {
    double sum = 0.0;
    for (int i = lo; i < hi; ++i) sum += tap_weight(i, centre, widen);
    return sum;
}

__host__ __device__ static inline int clamp_int(int v, int lo, int hi) {
    return v < lo ? lo : (v > hi ? hi : v);
}

// The x taps' weights kept per thread: more taps (a box over 15x the output's width)
// are weighed as they are read.
#define CACHED_TAPS 32

// Output pixel (y, x) of crop `c` in an out_h x out_w output, its three channels into
// `out` (a channel's plane `plane` bytes from the next).
__host__ __device__ static inline void resample_pixel(const gpufeed_crop* c, int y, int x,
                                                      int out_h, int out_w, uint8_t* out,
                                                      long long plane) {
    int ylo, yhi, xlo, xhi;
    double yc, yw, xc, xw;
    axis_taps(c->top, c->height, c->size_y, out_h, y, &ylo, &yhi, &yc, &yw);
    int xs = c->flip ? out_w - 1 - x : x;  // a flip mirrors which column's taps are read
    axis_taps(c->left, c->width, c->size_x, out_w, xs, &xlo, &xhi, &xc, &xw);
    double ysum = taps_sum(ylo, yhi, yc, yw), xsum = taps_sum(xlo, xhi, xc, xw);
    float cached[CACHED_TAPS];
    int taps = xhi - xlo < CACHED_TAPS ? xhi - xlo : CACHED_TAPS;
    for (int t = 0; t < taps; ++t)
        cached[t] = xsum > 0.0 ? (float)(tap_weight(xlo + t, xc, xw) / xsum) : (t == 0 ? 1.f : 0.f);
    const uint8_t* src = (const uint8_t*)(uintptr_t)c->src;
    float acc[3] = {0.f, 0.f, 0.f};
    for (int j = ylo; j < yhi; ++j) {
        float wy = ysum > 0.0 ? (float)(tap_weight(j, yc, yw) / ysum) : (j == ylo ? 1.f : 0.f);
        if (wy == 0.f) continue;
        const uint8_t* row = src + (long long)clamp_int(j - c->first_y, 0, c->rows - 1) * c->pitch;
        float line[3] = {0.f, 0.f, 0.f};
        for (int i = xlo; i < xhi; ++i) {
            float wx = i - xlo < CACHED_TAPS ? cached[i - xlo]
                       : (xsum > 0.0 ? (float)(tap_weight(i, xc, xw) / xsum) : 0.f);
            const uint8_t* px = row + clamp_int(i - c->first_x, 0, c->cols - 1) * 3;
            line[0] += wx * px[0];
            line[1] += wx * px[1];
            line[2] += wx * px[2];
        }
        acc[0] += wy * line[0];
        acc[1] += wy * line[1];
        acc[2] += wy * line[2];
    }
    for (int ch = 0; ch < 3; ++ch) {
        float v = rintf(acc[ch]);
        out[ch * plane] = (uint8_t)(v < 0.f ? 0.f : (v > 255.f ? 255.f : v));
    }
}

extern "C" {

// The host entry point: the same pixels on the CPU (crops' src are host addresses),
// into out, uint8 [count, 3, out_h, out_w].
int gpufeed_resample_host(const gpufeed_crop* crops, int count, uint8_t* out, int out_h,
                          int out_w) {
    long long plane = (long long)out_h * out_w;
    for (int n = 0; n < count; ++n)
        for (int y = 0; y < out_h; ++y)
            for (int x = 0; x < out_w; ++x)
                resample_pixel(&crops[n], y, x, out_h, out_w,
                               out + n * 3 * plane + (long long)y * out_w + x, plane);
    return 0;
}

}  // extern "C"

#ifdef __CUDACC__
__global__ static void resample_kernel(const gpufeed_crop* crops, uint8_t* out, int out_h,
                                       int out_w) {
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    int y = blockIdx.y * blockDim.y + threadIdx.y;
    int n = blockIdx.z;
    if (x >= out_w || y >= out_h) return;
    long long plane = (long long)out_h * out_w;
    resample_pixel(&crops[n], y, x, out_h, out_w,
                   out + n * 3 * plane + (long long)y * out_w + x, plane);
}

extern "C" {

// Queue the batch on `stream` (a cudaStream_t) of GPU `device`; crops and out are
// device memory. Returns the cudaError_t (0: queued), or -1 for a count the grid
// cannot hold (over 65535 crops).
int gpufeed_resample_cuda(const gpufeed_crop* crops, int count, uint8_t* out, int out_h,
                          int out_w, int device, void* stream) {
    if (count <= 0) return 0;
    if (count > 65535) return -1;
    cudaError_t set = cudaSetDevice(device);  // this library's own runtime, on torch's GPU
    if (set != cudaSuccess) return (int)set;
    dim3 block(32, 8);
    dim3 grid((out_w + block.x - 1) / block.x, (out_h + block.y - 1) / block.y, count);
    resample_kernel<<<grid, block, 0, (cudaStream_t)stream>>>(crops, out, out_h, out_w);
    return (int)cudaGetLastError();
}

}  // extern "C"
#endif
