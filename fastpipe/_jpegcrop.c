/* fastpipe._jpegcrop: decode only the part of a JPEG that a crop box needs (libjpeg-turbo >= 1.5).
 *
 * A random-resized crop keeps about half of the stored image on average; a full decode pays for every pixel.
 * Here libjpeg-turbo does the inverse DCT, upsampling and colour conversion only for the iMCU columns the box
 * touches (jpeg_crop_scanline), skips the rows above it without the IDCT (jpeg_skip_scanlines), and stops after
 * its last row (jpeg_abort_decompress): the rows below are never read. Entropy decoding of the rows above the
 * box cannot be skipped (Huffman data has no index), so the saving is the IDCT and colour work of the pixels
 * outside the box, and everything below it.
 *
 * header(data) -> (width, height, colorspace, progressive, arithmetic, sampling)
 *     sampling: each component's (horizontal, vertical) sampling factors, which decide whether a DCT-scaled crop
 *     equals a full decode on this libjpeg-turbo (jpegcrop.py).
 * decode(data, denom, x0, y0, x1, y1, out, max_scans) -> (dx, stride)
 *     The box is in the coordinates of the image scaled by 1/denom (denom 1, 2, 4 or 8: the scalings with SIMD
 *     IDCTs). Row r of the box is written at out[r * stride * 3 + dx * 3 ...], RGB, so the caller views the box
 *     as out[:rows * stride * 3].reshape(rows, stride, 3)[:, dx:dx + x1 - x0] without a copy. `out` must hold
 *     (y1 - y0) * (x1 - x0 + ROW_SLACK) * 3 bytes. A file of more than max_scans scans is refused as libjpeg-turbo's
 *     own tools refuse one (djpeg -maxscans): a progress monitor stops the decoder when it reaches the next scan, so
 *     a file that repeats its scans thousands of times costs max_scans passes at most.
 *
 * train_chunk(size, min_scale, max_pixels, max_scans, fixed_4x2, views, spans, key, positions, out, status, lo, hi)
 *     A chunk of training samples decoded, cropped, resized and flipped in one call (_trainchunk.c).
 *
 * Errors: every libjpeg error, and every libjpeg warning (corrupt data it would paper over with grey), raises
 * jpegcrop.Error (a ValueError) through setjmp/longjmp: the process never exits. The GIL is released while
 * decoding; each call has its own decompressor, so threads may call it concurrently.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <jpeglib.h>

/* Refuse absurd headers before libjpeg allocates for them: a fastpipe shard stores photos of a few hundred pixels
 * a side, and a crafted 65535 x 65535 header would ask for gigabytes (progressive files buffer every coefficient). */
#define MAX_SIDE 32768
#define MAX_PIXELS (64L * 1024 * 1024)
/* And a second bound inside libjpeg, on its whole-image buffers: a progressive 4:4:4 file at MAX_PIXELS needs 384 MB
 * of coefficients; libjpeg-turbo (2.1 and later) fails a larger request instead of allocating it. */
#define MAX_MEMORY (512L * 1024 * 1024)
/* How much wider than the box a decoded row may be: see widen(). */
#define ROW_SLACK 160

#define STR2(x) #x
#define STR(x) STR2(x)

static PyObject *JpegError;

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
} error_mgr;

static void on_error(j_common_ptr cinfo) {
    error_mgr *err = (error_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

/* Level -1 is a warning about corrupt data (libjpeg would go on with grey or garbage pixels): an error here, as
 * the full-decode path treats it (simplejpeg's strict mode). Trace messages (level >= 0) are dropped. */
static void on_message(j_common_ptr cinfo, int level) {
    if (level < 0)
        on_error(cinfo);
}

typedef struct {
    struct jpeg_progress_mgr pub;
    int max_scans;
} scan_limit;

/* Called by libjpeg as it reads (at least once per iMCU row and per scan): refuses the scan after the last allowed. */
static void count_scans(j_common_ptr cinfo) {
    scan_limit *limit = (scan_limit *)cinfo->progress;
    error_mgr *err = (error_mgr *)cinfo->err;
    if (((j_decompress_ptr)cinfo)->input_scan_number > limit->max_scans) {
        snprintf(err->message, JMSG_LENGTH_MAX, "a JPEG of more than %d scans (libjpeg-turbo's limit for untrusted "
                 "files): each scan is a pass over the whole image", limit->max_scans);
        longjmp(err->jump, 1);
    }
}

typedef struct {
    struct jpeg_decompress_struct cinfo;
    error_mgr err;
    scan_limit limit;
} decoder;

static void start(decoder *d, const unsigned char *data, Py_ssize_t size) {
    d->cinfo.err = jpeg_std_error(&d->err.pub);
    d->err.pub.error_exit = on_error;
    d->err.pub.emit_message = on_message;
    d->err.message[0] = 0;
    jpeg_create_decompress(&d->cinfo);
    d->cinfo.mem->max_memory_to_use = MAX_MEMORY;
    jpeg_mem_src(&d->cinfo, data, (unsigned long)size);
}

static const char *colorspace_name(J_COLOR_SPACE cs) {
    switch (cs) {
    case JCS_GRAYSCALE: return "Gray";
    case JCS_YCbCr: return "YCbCr";
    case JCS_RGB: return "RGB";
    case JCS_CMYK: return "CMYK";
    case JCS_YCCK: return "YCCK";
    default: return "unknown";
    }
}

/* Called after jpeg_read_header: the checks that must pass before anything is allocated for the image. */
static const char *refuse(j_decompress_ptr c) {
    if (c->image_width > MAX_SIDE || c->image_height > MAX_SIDE ||
        (long)c->image_width * c->image_height > MAX_PIXELS)
        return "image dimensions over the crop decoder's limit";
    if (c->jpeg_color_space != JCS_YCbCr && c->jpeg_color_space != JCS_GRAYSCALE && c->jpeg_color_space != JCS_RGB)
        return "colour space not converted to RGB by the crop decoder";
    return NULL;
}

static int get_data(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0)
        return -1;
    if (view->len < 4) {
        PyBuffer_Release(view);
        PyErr_SetString(JpegError, "not a JPEG: fewer than 4 bytes");
        return -1;
    }
    return 0;
}

/* The decoder started on `data` and its header read: 0, or -1 with the message in d->err. Runs without the GIL: the
 * longjmp of an error (also one of jpeg_create_decompress, out of memory) lands here, inside the block that gave the
 * GIL up, never across it. */
static int read_header(decoder *d, const unsigned char *data, Py_ssize_t size) {
    memset(d, 0, sizeof *d); /* an error before jpeg_create_decompress is done leaves nothing to destroy */
    if (setjmp(d->err.jump))
        return -1;
    start(d, data, size);
    jpeg_read_header(&d->cinfo, TRUE);
    return 0;
}

/* Seconds this module's calls have run without the GIL, all threads together, in wall time and in the CPU time of
 * the threads that ran them (released()): what a profiler subtracts from a thread's time to find the share that
 * holds the GIL (benchmarks/profile_worker.py --gil). */
static uint64_t released_ns[2];

typedef struct {
    uint64_t at[2];
} stamp;

static uint64_t clock_ns(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (uint64_t)t.tv_sec * 1000000000ULL + (uint64_t)t.tv_nsec;
}

static stamp now_ns(void) {
    stamp s = {{clock_ns(CLOCK_MONOTONIC), clock_ns(CLOCK_THREAD_CPUTIME_ID)}};
    return s;
}

static void add_released(stamp since) {
    stamp t = now_ns();
    for (int i = 0; i < 2; i++)
        __atomic_fetch_add(&released_ns[i], t.at[i] - since.at[i], __ATOMIC_RELAXED);
}

static PyObject *released(PyObject *self, PyObject *args) {
    return Py_BuildValue("dd", (double)__atomic_load_n(&released_ns[0], __ATOMIC_RELAXED) / 1e9,
                         (double)__atomic_load_n(&released_ns[1], __ATOMIC_RELAXED) / 1e9);
}

static PyObject *header(PyObject *self, PyObject *args) {
    PyObject *obj;
    Py_buffer data;
    decoder d;
    int rc;
    if (!PyArg_ParseTuple(args, "O", &obj) || get_data(obj, &data) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS /* a few µs a file: held, it was most of what loader threads queue on the GIL for */
    stamp since = now_ns();
    rc = read_header(&d, data.buf, data.len);
    add_released(since);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        jpeg_destroy_decompress(&d.cinfo);
        PyBuffer_Release(&data);
        PyErr_SetString(JpegError, d.err.message);
        return NULL;
    }
    PyObject *sampling = PyTuple_New(d.cinfo.num_components);
    for (int i = 0; sampling != NULL && i < d.cinfo.num_components; i++) {
        PyObject *hv = Py_BuildValue("ii", d.cinfo.comp_info[i].h_samp_factor, d.cinfo.comp_info[i].v_samp_factor);
        if (hv == NULL)
            Py_CLEAR(sampling);
        else
            PyTuple_SET_ITEM(sampling, i, hv);
    }
    PyObject *out = sampling == NULL ? NULL : Py_BuildValue("IIsOON", d.cinfo.image_width, d.cinfo.image_height,
                                                            colorspace_name(d.cinfo.jpeg_color_space),
                                                            d.cinfo.progressive_mode ? Py_True : Py_False,
                                                            d.cinfo.arith_code ? Py_True : Py_False, sampling);
    jpeg_destroy_decompress(&d.cinfo);
    PyBuffer_Release(&data);
    return out;
}

typedef struct {
    const unsigned char *data;
    Py_ssize_t size;
    unsigned char *out;
    Py_ssize_t out_size;
    int denom, max_scans;
    long x0, y0, x1, y1;
    JDIMENSION dx, stride; /* results */
    const char *refused;    /* a check of ours failed (no libjpeg message) */
    char message[JMSG_LENGTH_MAX];
} job;

/* The columns to decode for box columns [x0, x1) of a row `full` pixels wide. One pixel more on each side, so that
 * fancy upsampling at the box's edges sees the box's real neighbours, not a replicated edge (without it, box edges
 * differed from a full decode by up to 19 grey levels). And at least 3 iMCU columns: libjpeg switches to plain
 * upsampling for the whole crop when a chroma row is under 3 samples wide. libjpeg then moves the left edge down
 * to an iMCU boundary (at most 4 x 8 pixels for a 4:1:1 file), so a row is at most the box's width + 4 iMCUs + 2. */
static void widen(long x0, long x1, long full, int imcu, JDIMENSION *left, JDIMENSION *width) {
    long l = x0 > 0 ? x0 - 1 : 0, r = x1 < full ? x1 + 1 : x1, least = 3L * imcu;
    if (r - l < least) {
        r = l + least < full ? l + least : full;
        l = r - least > 0 ? r - least : 0;
    }
    *left = (JDIMENSION)l;
    *width = (JDIMENSION)(r - l);
}

/* Runs without the GIL. Returns 0, or -1 with job->refused or job->message set. */
static int run(job *j) {
    decoder d;
    JDIMENSION left, width, rows = (JDIMENSION)(j->y1 - j->y0);
    JSAMPROW row[16];
    memset(&d, 0, sizeof d); /* an error before jpeg_create_decompress is done leaves nothing to destroy */
    if (setjmp(d.err.jump)) {
        strcpy(j->message, d.err.message);
        jpeg_destroy_decompress(&d.cinfo); /* aborts too */
        return -1;
    }
    start(&d, j->data, j->size); /* after setjmp: jpeg_create_decompress may fail (out of memory) */
    d.limit.pub.progress_monitor = count_scans;
    d.limit.max_scans = j->max_scans;
    d.cinfo.progress = &d.limit.pub;
    jpeg_read_header(&d.cinfo, TRUE);
    if ((j->refused = refuse(&d.cinfo)) != NULL)
        goto fail;
    d.cinfo.out_color_space = JCS_RGB; /* from Gray too: the batch is RGB */
    d.cinfo.scale_num = 1;
    d.cinfo.scale_denom = (unsigned int)j->denom;
    /* dct_method (JDCT_ISLOW) and do_fancy_upsampling (TRUE) stay at the defaults the full-decode path uses. */
    jpeg_calc_output_dimensions(&d.cinfo);
    if (j->x0 < 0 || j->y0 < 0 || j->x1 <= j->x0 || j->y1 <= j->y0 ||
        j->x1 > (long)d.cinfo.output_width || j->y1 > (long)d.cinfo.output_height) {
        j->refused = "crop box outside the scaled image";
        goto fail;
    }
    if ((j->y1 - j->y0) * (j->x1 - j->x0 + ROW_SLACK) * 3 > j->out_size) {
        j->refused = "output buffer too small for the crop box";
        goto fail;
    }
    jpeg_start_decompress(&d.cinfo);
    widen(j->x0, j->x1, (long)d.cinfo.output_width, d.cinfo.min_DCT_scaled_size * d.cinfo.max_h_samp_factor,
          &left, &width);
    jpeg_crop_scanline(&d.cinfo, &left, &width); /* left moves down to an iMCU edge; width grows to match */
    j->dx = (JDIMENSION)j->x0 - left;
    j->stride = d.cinfo.output_width;
    if ((long)rows * j->stride * 3 > j->out_size) { /* cannot happen (ROW_SLACK), but never write past `out` */
        j->refused = "output buffer too small for the crop box";
        goto fail;
    }
    if ((JDIMENSION)j->y0 > 0)
        jpeg_skip_scanlines(&d.cinfo, (JDIMENSION)j->y0);
    while (d.cinfo.output_scanline < (JDIMENSION)j->y1) {
        JDIMENSION done = d.cinfo.output_scanline - (JDIMENSION)j->y0, n = rows - done, i;
        if (n > 16)
            n = 16;
        for (i = 0; i < n; i++)
            row[i] = j->out + (size_t)(done + i) * j->stride * 3;
        if (jpeg_read_scanlines(&d.cinfo, row, n) == 0) { /* only a suspending source returns none */
            j->refused = "the decoder made no progress";
            goto fail;
        }
    }
    jpeg_destroy_decompress(&d.cinfo); /* an abort: the rows below the box are never read */
    return 0;
fail:
    jpeg_destroy_decompress(&d.cinfo);
    return -1;
}

static PyObject *decode(PyObject *self, PyObject *args) {
    PyObject *obj, *out_obj;
    Py_buffer data, out;
    job j;
    int rc;
    memset(&j, 0, sizeof j);
    if (!PyArg_ParseTuple(args, "Oillll" "Oi", &obj, &j.denom, &j.x0, &j.y0, &j.x1, &j.y1, &out_obj, &j.max_scans))
        return NULL;
    if (j.max_scans < 1) {
        PyErr_Format(PyExc_ValueError, "max_scans=%d: use 1 or more", j.max_scans);
        return NULL;
    }
    if (j.denom != 1 && j.denom != 2 && j.denom != 4 && j.denom != 8) {
        PyErr_Format(PyExc_ValueError, "denom=%d: use 1, 2, 4 or 8", j.denom);
        return NULL;
    }
    if (get_data(obj, &data) < 0)
        return NULL;
    /* Truncation below the box would go unnoticed (those bytes are never read): refuse a file that does not end
     * with its end-of-image marker, as a full decode would. */
    if (((unsigned char *)data.buf)[data.len - 2] != 0xFF || ((unsigned char *)data.buf)[data.len - 1] != 0xD9) {
        PyBuffer_Release(&data);
        PyErr_SetString(JpegError, "truncated JPEG: the file does not end with an end-of-image marker");
        return NULL;
    }
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    j.data = data.buf;
    j.size = data.len;
    j.out = out.buf;
    j.out_size = out.len;
    Py_BEGIN_ALLOW_THREADS
    stamp since = now_ns();
    rc = run(&j);
    add_released(since);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
    PyBuffer_Release(&data);
    if (rc < 0) {
        PyErr_SetString(JpegError, j.refused ? j.refused : j.message);
        return NULL;
    }
    return Py_BuildValue("II", j.dx, j.stride);
}

/* The training samples' whole path, a chunk of them a call (its own file: the draws and the resize). */
#include "_trainchunk.c"

static PyMethodDef methods[] = {
    {"header", header, METH_VARARGS,
     "header(data) -> (width, height, colorspace, progressive, arithmetic, sampling)"},
    {"decode", decode, METH_VARARGS,
     "decode(data, denom, x0, y0, x1, y1, out, max_scans) -> (dx, stride): the box of the 1/denom-scaled image, RGB, "
     "into out"},
    {"train_chunk", train_chunk, METH_VARARGS,
     "train_chunk(size, min_scale, max_pixels, max_scans, fixed_4x2, views, spans, key, positions, out, status, lo, "
     "hi) -> left: each training sample's (lo..hi) draws, box decode, INTER_LINEAR resize and flip into out[i] "
     "(status[i] 0), or status[i] 1 for the Python path; left: how many are 1"},
    {"released", released, METH_NOARGS,
     "released() -> (wall, cpu): seconds that header, decode and train_chunk have run without the GIL, all threads "
     "together"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fastpipe._jpegcrop",
                                    "Crop-aware JPEG decoding with libjpeg-turbo", -1, methods};

PyMODINIT_FUNC PyInit__jpegcrop(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    JpegError = PyErr_NewException("fastpipe._jpegcrop.Error", PyExc_ValueError, NULL);
    if (PyModule_AddObject(m, "Error", JpegError) < 0 || PyModule_AddIntConstant(m, "ROW_SLACK", ROW_SLACK) < 0 ||
#ifdef LIBJPEG_TURBO_VERSION
        PyModule_AddStringConstant(m, "LIBJPEG_TURBO_VERSION", STR(LIBJPEG_TURBO_VERSION)) < 0 ||
#else
        PyModule_AddStringConstant(m, "LIBJPEG_TURBO_VERSION", "unknown") < 0 ||
#endif
        PyModule_AddIntConstant(m, "MAX_SIDE", MAX_SIDE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
