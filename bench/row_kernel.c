/* A few-row product y[r, o] = sum_k x[r, k] w[o, k] for r < rows <= 4, each weight read once for every row:
 * AVX2 + FMA, two output channels at a time, one 8-wide accumulator per (channel, row). Bench-only (compiled
 * by bench/row_kernels.py into a temporary directory, loaded with ctypes): the bound of a custom few-row kernel.
 * `rows_product` runs a list of matrices on `threads` pthreads, each thread taking a contiguous share of every
 * matrix's output channels; with `barrier` set, the threads wait for each other after every matrix (what
 * separate ops, each with its own parallel section, would pay). */
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

#define KERNEL(R)                                                                                            \
static void rows##R(const float *w, const float *x, float *y, int out, int in, int o0, int o1) {             \
    int o = o0;                                                                                              \
    for (; o + 1 < o1; o += 2) {                                                                             \
        const float *w0 = w + (int64_t)o * in, *w1 = w0 + in;                                                \
        __m256 a0[R], a1[R];                                                                                 \
        for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();                                     \
        int k = 0;                                                                                           \
        for (; k + 8 <= in; k += 8) {                                                                        \
            __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);                              \
            for (int r = 0; r < R; r++) {                                                                    \
                __m256 xr = _mm256_loadu_ps(x + (int64_t)r * in + k);                                        \
                a0[r] = _mm256_fmadd_ps(v0, xr, a0[r]);                                                      \
                a1[r] = _mm256_fmadd_ps(v1, xr, a1[r]);                                                      \
            }                                                                                                \
        }                                                                                                    \
        for (int r = 0; r < R; r++) {                                                                        \
            float s0 = hsum(a0[r]), s1 = hsum(a1[r]);                                                        \
            const float *xr = x + (int64_t)r * in;                                                           \
            for (int j = k; j < in; j++) { s0 += w0[j] * xr[j]; s1 += w1[j] * xr[j]; }                       \
            y[(int64_t)r * out + o] = s0; y[(int64_t)r * out + o + 1] = s1;                                  \
        }                                                                                                    \
    }                                                                                                        \
    for (; o < o1; o++)                                                                                      \
        for (int r = 0; r < R; r++) {                                                                        \
            float s = 0;                                                                                     \
            for (int j = 0; j < in; j++) s += w[(int64_t)o * in + j] * x[(int64_t)r * in + j];               \
            y[(int64_t)r * out + o] = s;                                                                     \
        }                                                                                                    \
}
KERNEL(1)
KERNEL(2)
KERNEL(3)
KERNEL(4)

typedef void (*kernel_t)(const float *, const float *, float *, int, int, int, int);
static const kernel_t KERNELS[5] = {0, rows1, rows2, rows3, rows4};

typedef struct {
    int nmat, rows, index, threads, barrier;
    const float *const *w; const float *const *x; float *const *y; const int *out, *in;
    pthread_barrier_t *bar;
} job_t;

static void *work(void *arg) {
    job_t *j = arg;
    kernel_t kern = KERNELS[j->rows];
    for (int m = 0; m < j->nmat; m++) {
        int out = j->out[m], share = (out / j->threads + 1) & ~1;  /* even shares keep channel pairs together */
        int o0 = j->index * share, o1 = o0 + share < out ? o0 + share : out;
        if (j->index == j->threads - 1) o1 = out;
        if (o0 < o1) kern(j->w[m], j->x[m], j->y[m], out, j->in[m], o0, o1);
        if (j->barrier && j->threads > 1) pthread_barrier_wait(j->bar);
    }
    return 0;
}

/* y[m] [rows, out[m]] = x[m] [rows, in[m]] @ w[m] [out[m], in[m]].T for every m < nmat; 0, or -1 on bad rows */
int rows_product(int nmat, const float *const *w, const float *const *x, float *const *y, const int *out,
                 const int *in, int rows, int threads, int barrier) {
    if (rows < 1 || rows > 4 || threads < 1 || threads > 64) return -1;
    pthread_t tid[64];
    job_t jobs[64];
    pthread_barrier_t bar;
    if (threads > 1) pthread_barrier_init(&bar, 0, threads);
    for (int t = 0; t < threads; t++) {
        jobs[t] = (job_t){nmat, rows, t, threads, barrier, w, x, y, out, in, &bar};
        if (t > 0) pthread_create(&tid[t], 0, work, &jobs[t]);
    }
    work(&jobs[0]);
    for (int t = 1; t < threads; t++) pthread_join(tid[t], 0);
    if (threads > 1) pthread_barrier_destroy(&bar);
    return 0;
}
