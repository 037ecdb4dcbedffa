/* fastpipe._jpegcrop.train_chunk: the crop decoder's whole per-sample path for training samples, for a chunk of
 * samples in one call that holds the GIL only to take and give back its arguments (included by _jpegcrop.c).
 *
 * train_chunk(size, min_scale, max_pixels, max_scans, fixed_4x2, views, spans, key, positions, out, status, lo, hi)
 *     -> how many samples of lo..hi are left to the Python path (the settings first: a loader binds them once)
 * A chunk of a batch: samples lo..hi of the batch's spans (int64, n x 3: an index into views, the start and the end
 * of the sample's bytes there; views: the shards' buffers, a sample's bytes are sliced in C, not in Python),
 * positions (int64, n), out (n x size x size x 3) and status (n bytes). For each sample, from its bytes and its
 * generator state (loaders/rng.py, SampleRng.states: the splitmix64 state of the batch's key, the seed and epoch
 * mixed, mixed with the sample's position),
 * exactly what the Python path does (cpu_ops.decode_train with the "crop" decoder and that SampleRng):
 *   - the header, and the checks the Python path makes before the crop decoder may take the file (a colour space it
 *     converts, at most max_pixels pixels);
 *   - the draws of torchvision's RandomResizedCrop (10 tries, then the centre-crop fallback) and the flip;
 *   - the DCT scale (jpegcrop.scale_for, with the sampling factors a scaled crop is right for: fixed_4x2 says
 *     whether this libjpeg-turbo scales 4x2 and 2x4 crops right);
 *   - the box decode (run()'s, into a scratch buffer of this call);
 *   - OpenCV's INTER_LINEAR resize to size x size, bit for bit (its fixed-point coefficients and rounding: see
 *     resize_linear), and the horizontal flip, into out[i].
 * status[i] is 0 where sample i is in out[i]; 1 where the Python path must decide (bytes outside its view, not a
 * JPEG this decoder takes, more pixels than allowed, a decoding error, or a box OpenCV would shrink with
 * INTER_AREA): it draws the same numbers from the same state, so a sample's pixels never depend on which path made
 * them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define GAMMA 0x9E3779B97F4A7C15ULL
#define ONE 2048 /* OpenCV's INTER_RESIZE_COEF_SCALE */

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* SampleRng.random(): the next number of the stream, in [0, 1). */
static double next_double(uint64_t *s) {
    *s += GAMMA;
    return (double)(mix64(*s) >> 11) * (1.0 / 9007199254740992.0);
}

/* SampleRng.integers(low, high) */
static long next_int(uint64_t *s, long low, long high) {
    long n = high - low, k = (long)(next_double(s) * (double)n);
    return low + (k < n - 1 ? k : n - 1);
}

/* cpu_ops.random_resized_crop_box with the default ratio (3/4, 4/3), then the flip draw: the same arithmetic in
 * the same order (Python's round() is round-half-even, as rint is in the default rounding mode). */
static void draw(uint64_t s, long w, long h, double min_scale, long box[4], int *flip) {
    double area = (double)(w * h), lo = log(3.0 / 4.0), hi = log(4.0 / 3.0);
    long cw, ch, x0, y0;
    for (int t = 0; t < 10; t++) {
        double target = area * (min_scale + (1.0 - min_scale) * next_double(&s));
        double aspect = exp(lo + (hi - lo) * next_double(&s));
        cw = (long)rint(sqrt(target * aspect));
        ch = (long)rint(sqrt(target / aspect));
        if (0 < cw && cw <= w && 0 < ch && ch <= h) {
            x0 = next_int(&s, 0, w - cw + 1);
            y0 = next_int(&s, 0, h - ch + 1);
            goto done;
        }
    }
    double ratio = (double)w / (double)h;
    if (ratio < 3.0 / 4.0) {
        cw = w;
        ch = (long)rint((double)w / (3.0 / 4.0));
    } else if (ratio > 4.0 / 3.0) {
        cw = (long)rint((double)h * (4.0 / 3.0));
        ch = h;
    } else {
        cw = w;
        ch = h;
    }
    x0 = (w - cw) / 2;
    y0 = (h - ch) / 2;
done:
    box[0] = x0, box[1] = y0, box[2] = x0 + cw, box[3] = y0 + ch;
    *flip = next_double(&s) < 0.5;
}

/* jpegcrop.scaled_crops: whether a DCT-scaled crop of this file's sampling equals a full decode's. */
static int scaled_crops(j_decompress_ptr c, int fixed_4x2) {
    static const int ok[][2] = {{1, 1}, {2, 1}, {1, 2}, {2, 2}, {3, 1}, {1, 3}, {4, 1}, {1, 4}, {3, 2}, {2, 3},
                                {4, 2}, {2, 4}};
    int known = fixed_4x2 ? 12 : 10, mh = 0, mv = 0;
    for (int i = 0; i < c->num_components; i++) {
        int h = c->comp_info[i].h_samp_factor, v = c->comp_info[i].v_samp_factor;
        if (h < 1 || v < 1)
            return 0;
        mh = h > mh ? h : mh;
        mv = v > mv ? v : mv;
    }
    for (int i = 0; i < c->num_components; i++) {
        int h = c->comp_info[i].h_samp_factor, v = c->comp_info[i].v_samp_factor, k;
        if (mh % h || mv % v)
            return 0; /* a ratio that is not a whole number is in no list */
        for (k = 0; k < known && (ok[k][0] != mh / h || ok[k][1] != mv / v); k++)
            ;
        if (k == known)
            return 0;
    }
    return c->num_components > 0;
}

/* jpegcrop.scale_for */
static int scale_for(long w, long h, const long box[4], long size, int scaled_ok) {
    static const int scales[] = {8, 4, 2};
    long bw = box[2] - box[0], bh = box[3] - box[1];
    if ((bw < bh ? bw : bh) < 2 * size || !scaled_ok)
        return 1;
    double need_w = ceil((double)(w * size) / (double)bw), need_h = ceil((double)(h * size) / (double)bh);
    for (int i = 0; i < 3; i++) {
        long d = scales[i];
        if ((double)((w + d - 1) / d) >= need_w && (double)((h + d - 1) / d) >= need_h)
            return (int)d;
    }
    return 1;
}

/* OpenCV's coefficients for INTER_LINEAR along one axis (resize.cpp, resizeGeneric's tables): source index and
 * fixed-point weights per destination pixel. `clamp`: the horizontal axis's handling of the edges, where OpenCV takes
 * the edge pixel whole (S * ONE: here weights ONE and 0); the vertical axis keeps its weights and clips the rows. */
static void linear_table(long sw, long dw, int clamp, long *ofs, short *alpha) {
    double scale = 1.0 / ((double)dw / (double)sw);
    for (long d = 0; d < dw; d++) {
        float f = (float)((d + 0.5) * scale - 0.5);
        long s = (long)floorf(f);
        f -= (float)s;
        if (clamp && s < 0)
            f = 0.f, s = 0;
        if (clamp && s + 1 >= sw) {
            f = 0.f; /* the interpolation stops here (OpenCV's xmax): the pixel alone */
            s = s >= sw - 1 ? sw - 1 : s;
        }
        ofs[d] = s;
        alpha[2 * d] = clamp && s + 1 >= sw ? ONE : (short)lrintf((1.f - f) * ONE);
        alpha[2 * d + 1] = clamp && s + 1 >= sw ? 0 : (short)lrintf(f * ONE);
    }
}

/* One source row through OpenCV's horizontal pass (HResizeLinear), kept >> 4 as its vertical pass reads it. The
 * table may be in mirrored order (a flipped output). A pixel weighted 0 may be read one past the row's end, and with
 * SSE2 each pixel pair is read as 8 bytes: the scratch buffer has room for both; `dst` has room for one short more. */
#ifdef __SSE2__
#include <emmintrin.h>
static void h_pass(const unsigned char *src, long dw, const long *ofs, const short *alpha, short *dst) {
    const __m128i zero = _mm_setzero_si128();
    for (long d = 0; d < dw; d++, dst += 3) {
        __m128i px = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)(src + ofs[d] * 3)), zero);
        __m128i pairs = _mm_unpacklo_epi16(px, _mm_srli_si128(px, 6)); /* r0 r1 g0 g1 b0 b1 .. */
        int pair;
        memcpy(&pair, alpha + 2 * d, sizeof pair); /* a0 and a1 side by side: every lane pair (the 4th is unused) */
        __m128i w = _mm_set1_epi32(pair);
        __m128i sum = _mm_srai_epi32(_mm_madd_epi16(pairs, w), 4); /* r0 * a0 + r1 * a1, ... >> 4 */
        _mm_storel_epi64((__m128i *)dst, _mm_packs_epi32(sum, sum)); /* 3 shorts and one the next pixel overwrites */
    }
}
#else
static void h_pass(const unsigned char *src, long dw, const long *ofs, const short *alpha, short *dst) {
    for (long d = 0; d < dw; d++, dst += 3) {
        const unsigned char *p = src + ofs[d] * 3;
        int a0 = alpha[2 * d], a1 = alpha[2 * d + 1];
        dst[0] = (short)((p[0] * a0 + p[3] * a1) >> 4);
        dst[1] = (short)((p[1] * a0 + p[4] * a1) >> 4);
        dst[2] = (short)((p[2] * a0 + p[5] * a1) >> 4);
    }
}
#endif

/* VResizeLinear for 8-bit images: (((b0 * (S0 >> 4)) >> 16) + ((b1 * (S1 >> 4)) >> 16) + 2) >> 2, written so that
 * the compiler vectorises it (multiply-high of 16-bit lanes). */
static void v_pass(const short *s0, const short *s1, short b0, short b1, long n, unsigned char *dst) {
    for (long x = 0; x < n; x++) {
        short t0 = (short)((b0 * s0[x]) >> 16), t1 = (short)((b1 * s1[x]) >> 16);
        dst[x] = (unsigned char)((t0 + t1 + 2) >> 2);
    }
}

/* cv2.resize(box, (size, size), interpolation=cv2.INTER_LINEAR) then cv2.flip(..., 1) where `flip`, bit for bit.
 * `tmp` holds 2 rows of size * 3 + 4 shorts; the tables size * 2 longs and size * 4 shorts. */
static void resize_linear(const unsigned char *src, long rows, long cols, long pitch, unsigned char *out, long size,
                          int flip, short *tmp, long *ofs, short *alpha) {
    long *yofs = ofs + size, have[2] = {-1, -1};
    short *beta = alpha + 2 * size, *row[2] = {tmp, tmp + size * 3 + 4};
    linear_table(cols, size, 1, ofs, alpha);
    linear_table(rows, size, 0, yofs, beta);
    for (long i = 0, j = size - 1; flip && i < j; i++, j--) { /* a flipped output: the columns' table mirrored */
        long o = ofs[i];
        short a0 = alpha[2 * i], a1 = alpha[2 * i + 1];
        ofs[i] = ofs[j], alpha[2 * i] = alpha[2 * j], alpha[2 * i + 1] = alpha[2 * j + 1];
        ofs[j] = o, alpha[2 * j] = a0, alpha[2 * j + 1] = a1;
    }
    for (long y = 0; y < size; y++) {
        long r0 = yofs[y] < 0 ? 0 : (yofs[y] > rows - 1 ? rows - 1 : yofs[y]);
        long r1 = yofs[y] + 1 < 0 ? 0 : (yofs[y] + 1 > rows - 1 ? rows - 1 : yofs[y] + 1);
        int k0 = have[0] == r0 ? 0 : have[1] == r0 ? 1 : -1, k1;
        if (k0 < 0) { /* into the slot that does not hold r1 */
            k0 = have[0] == r1 ? 1 : 0;
            h_pass(src + r0 * pitch, size, ofs, alpha, row[k0]);
            have[k0] = r0;
        }
        k1 = have[0] == r1 ? 0 : have[1] == r1 ? 1 : -1;
        if (k1 < 0) {
            k1 = k0 ^ 1;
            h_pass(src + r1 * pitch, size, ofs, alpha, row[k1]);
            have[k1] = r1;
        }
        v_pass(row[k0], row[k1], beta[2 * y], beta[2 * y + 1], size * 3, out + y * size * 3);
    }
}

typedef struct {
    long size, max_pixels;
    int max_scans, fixed_4x2;
    double min_scale;
    unsigned char *scratch; /* the decoded box: grows as a sample needs */
    size_t scratch_size;
    short *tmp;
    long *ofs;
    short *alpha;
} chunk;

/* Decode sample `data` into `out` (size x size x 3): 0, or 1 for the Python path (see the top of this file). Runs
 * without the GIL. */
static int train_one(chunk *k, const unsigned char *data, Py_ssize_t len, uint64_t state, unsigned char *out) {
    decoder d;
    JDIMENSION left, width;
    long box[4], w, h, rows, cols;
    int flip, denom;
    JSAMPROW row[16];
    if (len < 4 || data[len - 2] != 0xFF || data[len - 1] != 0xD9)
        return 1; /* not a JPEG, or one cut short (the Python path names it) */
    memset(&d, 0, sizeof d);
    if (setjmp(d.err.jump)) {
        jpeg_destroy_decompress(&d.cinfo);
        return 1;
    }
    start(&d, data, len);
    d.limit.pub.progress_monitor = count_scans;
    d.limit.max_scans = k->max_scans;
    d.cinfo.progress = &d.limit.pub;
    jpeg_read_header(&d.cinfo, TRUE);
    w = (long)d.cinfo.image_width, h = (long)d.cinfo.image_height;
    if (refuse(&d.cinfo) != NULL || w * h > k->max_pixels)
        goto python;
    draw(state, w, h, k->min_scale, box, &flip);
    denom = scale_for(w, h, box, k->size, scaled_crops(&d.cinfo, k->fixed_4x2));
    double sx = (double)((w + denom - 1) / denom) / (double)w, sy = (double)((h + denom - 1) / denom) / (double)h;
    long x0 = (long)rint(box[0] * sx), y0 = (long)rint(box[1] * sy), x1 = (long)rint(box[2] * sx),
         y1 = (long)rint(box[3] * sy);
    rows = y1 - y0, cols = x1 - x0;
    if (rows < 1 || cols < 1 || (rows < cols ? rows : cols) >= 2 * k->size)
        goto python; /* an empty box (as Python would fail on), or one OpenCV shrinks with INTER_AREA */
    d.cinfo.out_color_space = JCS_RGB;
    d.cinfo.scale_num = 1;
    d.cinfo.scale_denom = (unsigned int)denom;
    jpeg_calc_output_dimensions(&d.cinfo);
    if (x1 > (long)d.cinfo.output_width || y1 > (long)d.cinfo.output_height)
        goto python;
    size_t need = (size_t)rows * (size_t)(cols + ROW_SLACK) * 3 + 16; /* 16: h_pass may read a pixel past the end */
    if (need > k->scratch_size) {
        unsigned char *grown = realloc(k->scratch, need);
        if (grown == NULL)
            goto python;
        k->scratch = grown, k->scratch_size = need;
    }
    jpeg_start_decompress(&d.cinfo);
    widen(x0, x1, (long)d.cinfo.output_width, d.cinfo.min_DCT_scaled_size * d.cinfo.max_h_samp_factor, &left,
          &width);
    jpeg_crop_scanline(&d.cinfo, &left, &width);
    long dx = x0 - (long)left, pitch = (long)d.cinfo.output_width * 3;
    if ((size_t)rows * (size_t)pitch + 16 > k->scratch_size)
        goto python;
    if (y0 > 0)
        jpeg_skip_scanlines(&d.cinfo, (JDIMENSION)y0);
    while (d.cinfo.output_scanline < (JDIMENSION)y1) {
        JDIMENSION done = d.cinfo.output_scanline - (JDIMENSION)y0, n = (JDIMENSION)rows - done, i;
        n = n > 16 ? 16 : n;
        for (i = 0; i < n; i++)
            row[i] = k->scratch + (size_t)(done + i) * pitch;
        if (jpeg_read_scanlines(&d.cinfo, row, n) == 0)
            goto python;
    }
    jpeg_destroy_decompress(&d.cinfo);
    resize_linear(k->scratch + dx * 3, rows, cols, pitch, out, k->size, flip, k->tmp, k->ofs, k->alpha);
    return 0;
python:
    jpeg_destroy_decompress(&d.cinfo);
    return 1;
}

/* An int64 array argument (numpy's "l" or "q", 8 bytes an item), C-contiguous: anything else is refused rather than
 * read as int64. */
static int int64_buffer(PyObject *obj, Py_buffer *view, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (view->itemsize != 8 || !(f[0] == 'q' || f[0] == 'l') || f[1] != '\0') {
        PyErr_Format(PyExc_TypeError, "train_chunk: %s must be int64 and contiguous, not format '%s'", what,
                     view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The buffer of views[shard], taken once a call (a chunk's samples come from a few shards); NULL when that shard
 * has no view (the Python path maps it, or names what is wrong). */
static Py_buffer *shard_buffer(PyObject *views, int64_t shard, Py_buffer *taken, int64_t *shards, Py_ssize_t *count) {
    for (Py_ssize_t j = 0; j < *count; j++)
        if (shards[j] == shard)
            return &taken[j];
    if (shard < 0 || shard >= PySequence_Fast_GET_SIZE(views))
        return NULL;
    PyObject *item = PySequence_Fast_GET_ITEM(views, shard);
    if (item == Py_None || PyObject_GetBuffer(item, &taken[*count], PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        return NULL;
    }
    shards[*count] = shard;
    return &taken[(*count)++];
}

static PyObject *train_chunk(PyObject *self, PyObject *args) {
    PyObject *views_arg, *views = NULL, *positions_arg, *spans_arg, *result = NULL;
    Py_buffer positions = {0}, spans = {0}, out = {0}, status = {0}, *taken = NULL;
    unsigned long long key;
    chunk k;
    Py_ssize_t all, lo, hi, n = 0, count = 0, left = 0;
    const unsigned char **data = NULL;
    Py_ssize_t *lens = NULL;
    int64_t *shards = NULL;
    memset(&k, 0, sizeof k);
    if (!PyArg_ParseTuple(args, "ldlipOOKOw*w*nn", &k.size, &k.min_scale, &k.max_pixels, &k.max_scans, &k.fixed_4x2,
                          &views_arg, &spans_arg, &key, &positions_arg, &out, &status, &lo, &hi))
        return NULL;
    if (int64_buffer(spans_arg, &spans, "spans") < 0 || int64_buffer(positions_arg, &positions, "positions") < 0)
        goto end;
    if ((views = PySequence_Fast(views_arg, "views: a sequence of bytes-like objects or None")) == NULL)
        goto end;
    all = positions.len / 8;
    if (k.size < 1 || k.size > MAX_SIDE || k.max_scans < 1 || !(k.min_scale > 0.0 && k.min_scale <= 1.0) ||
        lo < 0 || lo > hi || hi > all || spans.len != all * 24 || status.len != all ||
        out.len != all * k.size * k.size * 3) {
        PyErr_SetString(PyExc_ValueError, "train_chunk: size, min_scale, max_scans, lo..hi, or the lengths of spans "
                                          "(3 int64 a sample), status (1 byte a sample) or out (size * size * 3 "
                                          "bytes a sample) are wrong");
        goto end;
    }
    n = hi - lo;
    taken = PyMem_Calloc(n ? n : 1, sizeof(Py_buffer));
    shards = PyMem_Calloc(n ? n : 1, sizeof(int64_t));
    data = PyMem_Calloc(n ? n : 1, sizeof(*data));
    lens = PyMem_Calloc(n ? n : 1, sizeof(*lens));
    if (taken == NULL || shards == NULL || data == NULL || lens == NULL) {
        PyErr_NoMemory();
        goto end;
    }
    const int64_t *span = (const int64_t *)spans.buf + 3 * lo;
    for (Py_ssize_t i = 0; i < n; i++) { /* a sample whose bytes are not inside its shard's view: the Python path's */
        Py_buffer *b = shard_buffer(views, span[3 * i], taken, shards, &count);
        int64_t a = span[3 * i + 1], z = span[3 * i + 2];
        if (b != NULL && a >= 0 && a <= z && z <= (int64_t)b->len)
            data[i] = (const unsigned char *)b->buf + a, lens[i] = (Py_ssize_t)(z - a);
    }
    char *st = (char *)status.buf + lo;
    const int64_t *at = (const int64_t *)positions.buf + lo;
    unsigned char *into = (unsigned char *)out.buf + lo * k.size * k.size * 3;
    Py_BEGIN_ALLOW_THREADS /* the buffers of the resize are allocated and freed here too: a large free trims the heap */
    stamp since = now_ns();
    k.tmp = malloc(((size_t)k.size * 3 + 4) * 2 * sizeof(short));
    k.ofs = malloc((size_t)k.size * 2 * sizeof(long));
    k.alpha = malloc((size_t)k.size * 4 * sizeof(short));
    for (Py_ssize_t i = 0; i < n && k.tmp != NULL && k.ofs != NULL && k.alpha != NULL; i++) {
        /* SampleRng.states: the key mixed with the position */
        st[i] = data[i] == NULL ? 1
                                : (char)train_one(&k, data[i], lens[i],
                                                  mix64(((uint64_t)key ^ (uint64_t)at[i]) + GAMMA),
                                                  into + i * k.size * k.size * 3);
        left += st[i];
    }
    if (k.tmp == NULL || k.ofs == NULL || k.alpha == NULL)
        left = -1;
    free(k.scratch);
    free(k.tmp);
    free(k.ofs);
    free(k.alpha);
    add_released(since);
    Py_END_ALLOW_THREADS
    result = left < 0 ? PyErr_NoMemory() : PyLong_FromSsize_t(left);
end:
    for (Py_ssize_t i = 0; i < count; i++)
        PyBuffer_Release(&taken[i]);
    PyMem_Free(taken);
    PyMem_Free(shards);
    PyMem_Free(data);
    PyMem_Free(lens);
    Py_XDECREF(views);
    if (positions.obj != NULL)
        PyBuffer_Release(&positions);
    if (spans.obj != NULL)
        PyBuffer_Release(&spans);
    PyBuffer_Release(&out);
    PyBuffer_Release(&status);
    return result;
}
