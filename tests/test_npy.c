/* Datasets from NumPy's files and from CSV: mpt_dataset_load_npy reads back
   the files NumPy wrote (tests/data/npy/, made by make.py there) bit for
   bit, in every dtype, in .npy format versions 1.0, 2.0 and 3.0, big-endian,
   and from .npz archives stored and deflated; it refuses Fortran order,
   object, structured and other dtypes, scalars, NaN, bad class ids, and
   files damaged here byte by byte (truncated, a bad magic, a header that
   lies about the shape, a shape whose product overflows, zip offsets out
   of range, zip64, a CRC that does not match, corrupted deflate data),
   each message naming the file and the reason; arrays of many read
   chunks (big-endian, stored and deflated in archives built here); no
   allocation failure leaks. mpt_dataset_load_csv: a round trip, the forms
   it takes (CRLF, blank lines, spaces, a byte-order mark, another
   separator, float targets) and its errors at line and column. */
#define _POSIX_C_SOURCE 200809L /* mkdtemp */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#ifdef MPT_NO_ZLIB
#define HAVE_ZLIB 0
#else
#define HAVE_ZLIB 1
#endif

static mpt_context *q;   /* one thread, expected errors counted, not printed */
static char tmp_dir[64]; /* a fresh directory under /tmp for this run's files, '/'-ended */
static char fixtures[256];

/* ---- files -------------------------------------------------------------------- */

/* dir then name, in the next of 256 buffers taken in turn: a path stays
   good while the next 255 are made. */
static const char *path_of(const char *dir, const char *name) {
    static char paths[256][320];
    static int next;
    char *p = paths[next++ % 256];
    snprintf(p, sizeof paths[0], "%s%s", dir, name);
    return p;
}

/* The fixture NumPy wrote: tests/data/npy/name, found beside this source. */
static const char *fixture(const char *name) { return path_of(fixtures, name); }

/* name in this run's directory. */
static const char *tmp_path(const char *name) { return path_of(tmp_dir, name); }

static const char *write_file(const char *name, const void *bytes, size_t n) {
    const char *path = tmp_path(name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(bytes, 1, n, f) != n || fclose(f) != 0) {
        fprintf(stderr, "test_npy: cannot write %s\n", path);
        exit(1);
    }
    return path;
}

/* A fixture's bytes (at most cap); returns the count, 0 when it is missing. */
static size_t read_fixture(const char *name, unsigned char *buf, size_t cap) {
    FILE *f = fopen(fixture(name), "rb");
    size_t n;
    if (!f) return 0;
    n = fread(buf, 1, cap, f);
    fclose(f);
    return n;
}

/* ---- the fixtures' values (make.py's formulas) -------------------------------- */

static float value_at(int64_t k) { return (float)(((37 * k) % 101 - 50) / 8.0); }
static int32_t label_at(int64_t k) { return (int32_t)((7 * k + 3) % 10); }

/* x element k of each x fixture, as the dataset stores it (float32 bits,
   float16 bits or a byte), and the dtype and sample shape it has. */
typedef struct x_case {
    const char *file;
    mpt_dtype dtype;
    int rank;
    int64_t shape[3];
} x_case;

static uint32_t x_expected(const char *file, int64_t k) {
    float f;
    uint32_t u;
    if (strcmp(file, "x_f16.npy") == 0) return mpt_float_to_half(value_at(k));
    if (strcmp(file, "x_u8.npy") == 0) return (uint32_t)((37 * k + 11) % 256);
    if (strcmp(file, "x_f64.npy") == 0) f = (float)((double)k / 10.0);
    else if (strcmp(file, "x_i32.npy") == 0) f = (float)((7919 * k) % 100003 - 50000);
    else if (strcmp(file, "x_i64.npy") == 0) f = (float)(((int64_t)1 << 40) + 12345 * k);
    else f = value_at(k);
    memcpy(&u, &f, 4);
    return u;
}

/* x of d, element by element, against the file's formula. */
static void check_x(const mpt_dataset *d, const x_case *c) {
    int64_t shape[4] = {0}, n = 5, per = 1, k, bad = 0;
    int rank = mpt_dataset_sample_shape(d, shape), i;
    CHECK(mpt_dataset_count(d) == n, "%s: %lld samples", c->file,
          (long long)mpt_dataset_count(d));
    CHECK(rank == c->rank, "%s: sample rank %d, expected %d", c->file, rank, c->rank);
    for (i = 0; i < c->rank; i++) {
        CHECK(shape[i] == c->shape[i], "%s: sample axis %d is %lld, expected %lld", c->file, i,
              (long long)shape[i], (long long)c->shape[i]);
        per *= c->shape[i];
    }
    CHECK(d->x_dtype == c->dtype, "%s: x dtype %s, expected %s", c->file,
          mpt_dtype_name(d->x_dtype), mpt_dtype_name(c->dtype));
    if (d->x_dtype != c->dtype || rank != c->rank) return;
    for (k = 0; k < n * per; k++) {
        uint32_t got;
        if (c->dtype == MPT_FLOAT16) got = ((const mpt_half *)d->x)[k];
        else if (c->dtype == MPT_UINT8) got = ((const uint8_t *)d->x)[k];
        else memcpy(&got, (const float *)d->x + k, 4);
        if (got != x_expected(c->file, k)) bad++;
    }
    CHECK(bad == 0, "%s: %lld of %lld elements differ from NumPy's", c->file, (long long)bad,
          (long long)(n * per));
}

static void check_labels(const mpt_dataset *d, const char *what) {
    int32_t y[5] = {-1, -1, -1, -1, -1};
    int k, bad = 0;
    mpt_status s = mpt_dataset_labels(q, d, 0, 5, y);
    CHECK(s == MPT_OK, "%s: labels: %s", what, mpt_context_error(q));
    for (k = 0; k < 5; k++) bad += y[k] != label_at(k);
    CHECK(bad == 0, "%s: labels %d %d %d %d %d", what, y[0], y[1], y[2], y[3], y[4]);
}

/* ---- loading NumPy's files ------------------------------------------------------- */

static void test_npy_x_dtypes(void) {
    static const x_case cases[] = {
        {"x_f32.npy", MPT_FLOAT32, 2, {2, 3, 0}},  {"x_f32_v2.npy", MPT_FLOAT32, 2, {2, 3, 0}},
        {"x_f32_v3.npy", MPT_FLOAT32, 2, {2, 3, 0}}, {"x_f32_be.npy", MPT_FLOAT32, 2, {2, 3, 0}},
        {"x_f16.npy", MPT_FLOAT16, 1, {6, 0, 0}},  {"x_f64.npy", MPT_FLOAT32, 1, {3, 0, 0}},
        {"x_u8.npy", MPT_UINT8, 1, {4, 0, 0}},     {"x_i32.npy", MPT_FLOAT32, 1, {3, 0, 0}},
        {"x_i64.npy", MPT_FLOAT32, 1, {3, 0, 0}},  {"x_vec.npy", MPT_FLOAT32, 1, {1, 0, 0}}};
    size_t i;
    for (i = 0; i < sizeof cases / sizeof *cases; i++) {
        mpt_dataset *d = NULL;
        mpt_status s;
        test__begin();
        s = mpt_dataset_load_npy(q, fixture(cases[i].file), fixture("y_i64.npy"), NULL, &d);
        CHECK(s == MPT_OK, "%s: %s", cases[i].file, mpt_context_error(q));
        if (d) {
            check_x(d, &cases[i]);
            check_labels(d, cases[i].file);
        }
        mpt_dataset_destroy(d);
        test__end("npy: x %s", cases[i].file);
    }
}

static void test_npy_y_dtypes(void) {
    static const char *const ids[] = {"y_i64.npy", "y_i64_be.npy", "y_i32.npy", "y_u8.npy"};
    x_case f32 = {"x_f32.npy", MPT_FLOAT32, 2, {2, 3, 0}};
    float t[10];
    size_t i;
    int k, bad;
    for (i = 0; i < sizeof ids / sizeof *ids; i++) {
        mpt_dataset *d = NULL;
        test__begin();
        CHECK(mpt_dataset_load_npy(q, fixture("x_f32.npy"), fixture(ids[i]), NULL, &d) == MPT_OK,
              "%s: %s", ids[i], mpt_context_error(q));
        if (d) {
            check_x(d, &f32);
            check_labels(d, ids[i]);
            CHECK(mpt_dataset_target_shape(d, NULL) == 0, "%s: class ids of rank %d", ids[i],
                  mpt_dataset_target_shape(d, NULL));
        }
        mpt_dataset_destroy(d);
        test__end("npy: y %s as int32 class ids", ids[i]);
    }
    for (i = 0; i < 2; i++) {
        const char *file = i ? "y_f16.npy" : "y_f32.npy";
        int64_t count = i ? 5 : 10, shape[3] = {0};
        mpt_dataset *d = NULL;
        test__begin();
        CHECK(mpt_dataset_load_npy(q, fixture("x_f32.npy"), fixture(file), NULL, &d) == MPT_OK,
              "%s: %s", file, mpt_context_error(q));
        if (d) {
            int rank = mpt_dataset_target_shape(d, shape);
            CHECK(rank == (i ? 0 : 1) && (i || shape[0] == 2), "%s: target rank %d", file, rank);
            CHECK(mpt_dataset_targets(q, d, 0, 5, t) == MPT_OK, "%s: %s", file,
                  mpt_context_error(q));
            for (k = 0, bad = 0; k < count; k++) bad += t[k] != value_at(k);
            CHECK(bad == 0, "%s: %d targets differ", file, bad);
        }
        mpt_dataset_destroy(d);
        test__end("npy: y %s as float32 targets", file);
    }
}

static void test_npz(void) {
    x_case f32 = {"x_f32.npy", MPT_FLOAT32, 2, {2, 3, 0}};
    x_case f16 = {"x_f16.npy", MPT_FLOAT16, 1, {6, 0, 0}};
    mpt_dataset_npy_desc desc;
    int z;
    memset(&desc, 0, sizeof desc);
    desc.x_key = "x_train";
    desc.y_key = "y_train";
    for (z = 0; z < 2; z++) {
        const char *file = z ? "data_z.npz" : "data.npz";
        mpt_dataset *d = NULL;
        mpt_status s;
        test__begin();
        s = mpt_dataset_load_npy(q, fixture(file), NULL, &desc, &d);
        if (z && !HAVE_ZLIB) {
            CHECK(s == MPT_ERR_UNSUPPORTED && strstr(mpt_context_error(q), "MPT_NO_ZLIB"),
                  "%s without zlib: %s", file, mpt_context_error(q));
        } else {
            CHECK(s == MPT_OK, "%s: %s", file, mpt_context_error(q));
            if (d) {
                check_x(d, &f32);
                check_labels(d, file);
            }
        }
        mpt_dataset_destroy(d);
        test__end("npz: %s (%s), y_path NULL", file, z ? "deflated" : "stored");
    }
    {
        mpt_dataset *d = NULL;
        test__begin();
        desc.y_key = NULL;
        CHECK(mpt_dataset_load_npy(q, fixture("data.npz"), fixture("y_u8.npy"), &desc, &d) ==
                  MPT_OK,
              "%s", mpt_context_error(q));
        if (d) check_x(d, &f32), check_labels(d, "x from an .npz, y from an .npy");
        mpt_dataset_destroy(d);
        d = NULL;
        CHECK(mpt_dataset_load_npy(q, fixture("xy.npz"), NULL, NULL, &d) == MPT_OK, "xy.npz: %s",
              mpt_context_error(q));
        if (d) check_x(d, &f16), check_labels(d, "xy.npz");
        mpt_dataset_destroy(d);
        d = NULL;
        if (HAVE_ZLIB) {
            CHECK(mpt_dataset_load_npy(q, fixture("xy_z.npz"), NULL, NULL, &d) == MPT_OK,
                  "xy_z.npz: %s", mpt_context_error(q));
            if (d) check_x(d, &f16), check_labels(d, "xy_z.npz");
            mpt_dataset_destroy(d);
        }
        test__end("npz: x from an archive, y from an .npy; the default keys x and y");
    }
}

/* ---- refusals ----------------------------------------------------------------------- */

/* The load fails with `want`, leaves *out NULL, and its message holds the
   path and each of the (up to two) words given. */
static void expect_refusal(const char *what, const char *x, const char *y,
                           const mpt_dataset_npy_desc *desc, mpt_status want, const char *w1,
                           const char *w2) {
    mpt_dataset *d = (mpt_dataset *)&d;
    mpt_status s;
    const char *msg;
    const char *name;
    test__begin();
    s = mpt_dataset_load_npy(q, x, y, desc, &d);
    msg = mpt_context_error(q);
    /* the file that is wrong: y's when x is a good fixture */
    name = y && strstr(x, "/x_f32.npy") ? y : x;
    CHECK(s == want, "status %s, expected %s: %s", mpt_status_string(s), mpt_status_string(want),
          msg);
    CHECK(d == NULL, "*out is not NULL after a failure");
    CHECK(strstr(msg, name) != NULL, "the message \"%s\" does not name '%s'", msg, name);
    CHECK(!w1 || strstr(msg, w1), "the message \"%s\" lacks \"%s\"", msg, w1);
    CHECK(!w2 || strstr(msg, w2), "the message \"%s\" lacks \"%s\"", msg, w2);
    if (s == MPT_OK) mpt_dataset_destroy(d);
    test__end("npy refused: %s", what);
}

static void test_npy_refusals(void) {
    const char *x = fixture("x_f32.npy");
    mpt_dataset_npy_desc desc;
    memset(&desc, 0, sizeof desc);
    expect_refusal("Fortran order", fixture("fortran.npy"), fixture("y_i64.npy"), NULL,
                   MPT_ERR_UNSUPPORTED, "Fortran order", NULL);
    expect_refusal("an object array", fixture("object.npy"), fixture("y_i64.npy"), NULL,
                   MPT_ERR_UNSUPPORTED, "object array", "'|O'");
    expect_refusal("a structured array", fixture("structured.npy"), fixture("y_i64.npy"), NULL,
                   MPT_ERR_UNSUPPORTED, "structured", NULL);
    expect_refusal("complex64", fixture("complex.npy"), fixture("y_i64.npy"), NULL,
                   MPT_ERR_UNSUPPORTED, "dtype '<c8'", NULL);
    expect_refusal("a scalar", fixture("scalar.npy"), fixture("y_i64.npy"), NULL, MPT_ERR_SHAPE,
                   "scalar", NULL);
    expect_refusal("a negative class id", x, fixture("y_negative.npy"), NULL,
                   MPT_ERR_INVALID_ARGUMENT, "element 2 is -1", "class id");
    expect_refusal("a class id past int32", x, fixture("y_too_large.npy"), NULL,
                   MPT_ERR_INVALID_ARGUMENT, "element 2 is 2147483648", "class id");
    expect_refusal("NaN in x", fixture("x_nan.npy"), fixture("y_i64.npy"), NULL, MPT_ERR_NUMERIC,
                   "element 10 (of sample 3)", "nan");
    expect_refusal("5 samples of x, 4 labels", x, fixture("y_4.npy"), NULL, MPT_ERR_SHAPE,
                   "holds 5 samples", "holds 4");
    desc.x_key = "images";
    expect_refusal("a key the archive lacks", fixture("data.npz"), NULL, &desc,
                   MPT_ERR_INVALID_ARGUMENT, "no array 'images'", "x_train, y_train, note");
    expect_refusal("y_path NULL beside an .npy", x, NULL, NULL, MPT_ERR_INVALID_ARGUMENT,
                   "not a zip archive", NULL);
    expect_refusal("a missing file", tmp_path("missing.npy"), fixture("y_i64.npy"), NULL,
                   MPT_ERR_IO, "cannot open", NULL);
    desc.x_key = NULL;
    desc.scale = NAN;
    test__begin();
    {
        mpt_dataset *d = (mpt_dataset *)&d;
        CHECK(mpt_dataset_load_npy(q, x, fixture("y_i64.npy"), &desc, &d) == MPT_ERR_NUMERIC &&
                  d == NULL,
              "a NaN scale: %s", mpt_context_error(q));
        d = (mpt_dataset *)&d;
        CHECK(mpt_dataset_load_npy(q, NULL, NULL, NULL, &d) == MPT_ERR_INVALID_ARGUMENT &&
                  d == NULL && strstr(mpt_context_error(q), "x_path"),
              "NULL x_path: %s", mpt_context_error(q));
        CHECK(mpt_dataset_load_npy(NULL, x, NULL, NULL, &d) == MPT_ERR_INVALID_ARGUMENT,
              "NULL context");
    }
    test__end("npy refused: a NaN scale, NULL arguments");
}

/* ---- files damaged here, from NumPy's ---------------------------------------------- */

static unsigned char buf[4096], work[4096];

/* An .npy (format 1.0) of `header` (padded as NumPy pads it) then the
   n bytes at data (NULL: zeros) into out; its size. */
static size_t npy_bytes(unsigned char *out, const char *header, const void *data, size_t n) {
    size_t len = strlen(header), total = (10 + len + 1 + 63) / 64 * 64;
    memcpy(out, "\x93NUMPY\x01\x00", 8);
    out[8] = (unsigned char)((total - 10) & 255);
    out[9] = (unsigned char)((total - 10) >> 8);
    memset(out + 10, ' ', total - 10);
    memcpy(out + 10, header, len);
    out[total - 1] = '\n';
    if (data) memcpy(out + total, data, n);
    else memset(out + total, 0, n);
    return total + n;
}

/* An .npy of the given header text and `data` bytes of zeros. */
static const char *npy_with_header(const char *name, const char *header, size_t data) {
    return write_file(name, work, npy_bytes(work, header, NULL, data));
}

/* Headers NumPy does not write, each before `data` bytes of zeros: refused,
   each with its reason. */
static void refuse_bad_headers(const char *y) {
    static const struct {
        const char *what, *file;
        size_t data;
        const char *header;
        mpt_status want;
        const char *w1, *w2; /* words the message holds (NULL: none) */
    } cases[] = {
        {"a shape whose product overflows", "overflow.npy", 64,
         "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296, 4), }",
         MPT_ERR_OVERFLOW, "(4294967296, 4294967296, 4)", "too large"},
        {"a shape whose bytes overflow", "overflow2.npy", 64,
         "{'descr': '<i8', 'fortran_order': False, 'shape': (1152921504606846976, 8), }",
         MPT_ERR_OVERFLOW, "too large", NULL},
        {"a dimension past 2^63", "past63.npy", 64,
         "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999, 1), }",
         MPT_ERR_OVERFLOW, "too large", NULL},
        {"a huge shape in a small file", "huge.npy", 64,
         "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000, 1000), }",
         MPT_ERR_FORMAT, "4000000000000 bytes of data", "64 bytes follow"},
        {"a key NumPy does not write", "extra_key.npy", 64,
         "{'descr': '<f4', 'fortran_order': False, 'shape': (4, 4), 'x': 1}",
         MPT_ERR_FORMAT, "malformed .npy header", "a key other than"},
        {"no shape", "no_shape.npy", 64,
         "{'descr': '<f4', 'fortran_order': False}",
         MPT_ERR_FORMAT, "malformed .npy header", "no 'shape'"},
        {"a list, not a dict", "not_dict.npy", 64,
         "['descr', '<f4']",
         MPT_ERR_FORMAT, "not a dict", NULL},
        {"five axes", "rank5.npy", 64,
         "{'descr': '|u1', 'fortran_order': False, 'shape': (2, 2, 2, 2, 4), }",
         MPT_ERR_SHAPE, "(2, 2, 2, 2, 4)", "at most 4 axes"},
        {"no samples", "empty_shape.npy", 0,
         "{'descr': '<f4', 'fortran_order': False, 'shape': (0, 3), }",
         MPT_ERR_SHAPE, "no samples", NULL},
    };
    size_t k;
    for (k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const char *x = npy_with_header(cases[k].file, cases[k].header, cases[k].data);
        expect_refusal(cases[k].what, x, y, NULL, cases[k].want, cases[k].w1, cases[k].w2);
    }
}

static void test_npy_damaged(void) {
    const char *y = fixture("y_i64.npy");
    size_t n = read_fixture("x_f32.npy", buf, sizeof buf);
    char *at;
    test__begin();
    CHECK(n == 248, "x_f32.npy is %zu bytes, not 248 (run tests/data/npy/make.py?)", n);
    test__end("npy: the fixture x_f32.npy is there");
    if (n != 248) return;
    expect_refusal("truncated data", write_file("cut.npy", buf, n - 1), y, NULL, MPT_ERR_FORMAT,
                   "119 bytes follow the header", "truncated");
    expect_refusal("cut inside the header", write_file("cut_header.npy", buf, 40), y, NULL,
                   MPT_ERR_FORMAT, "truncated", ".npy header needs 118 bytes");
    expect_refusal("cut inside the magic", write_file("cut_magic.npy", buf, 7), y, NULL,
                   MPT_ERR_FORMAT, "truncated", NULL);
    memcpy(work, buf, n);
    work[n] = 0;
    expect_refusal("a trailing byte", write_file("trailing.npy", work, n + 1), y, NULL,
                   MPT_ERR_FORMAT, "121 bytes follow the header", NULL);
    memcpy(work, buf, n);
    work[1] = 'n';
    expect_refusal("a bad magic", write_file("magic.npy", work, n), y, NULL, MPT_ERR_FORMAT,
                   "neither an .npy file", NULL);
    expect_refusal("an empty file", write_file("empty.npy", work, 0), y, NULL, MPT_ERR_FORMAT,
                   "neither an .npy file", NULL);
    memcpy(work, buf, n);
    work[6] = 4;
    expect_refusal("format version 4.0", write_file("v4.npy", work, n), y, NULL,
                   MPT_ERR_UNSUPPORTED, "version 4.0", NULL);
    memcpy(work, buf, n);
    at = strstr((char *)work + 10, "(5, 2, 3)");
    CHECK(at != NULL, "no shape (5, 2, 3) in x_f32.npy's header");
    if (at) at[7] = '4';
    expect_refusal("a header that lies about the shape", write_file("lies.npy", work, n), y, NULL,
                   MPT_ERR_FORMAT, "shape (5, 2, 4) of '<f4', 160 bytes", "120 bytes follow");
    memcpy(work, buf, n);
    work[8] = 0xff; /* a header longer than the file */
    expect_refusal("a header length past the file", write_file("long_header.npy", work, n), y,
                   NULL, MPT_ERR_FORMAT, "truncated", NULL);
    refuse_bad_headers(y);
}

/* ---- .npz archives damaged here ------------------------------------------------------ */

static uint32_t get_le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void put_le32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)v, p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16), p[3] = (unsigned char)(v >> 24);
}

/* The central directory entry of `name` in the archive's bytes (NumPy's:
   no archive comment, so the end record is the last 22 bytes), or NULL. */
static unsigned char *zip_entry(unsigned char *zip, size_t n, const char *name) {
    unsigned char *e = zip + n - 22, *p = zip + get_le32(e + 16);
    int k, count = e[10] | e[11] << 8;
    for (k = 0; k < count && p + 46 <= e; k++) {
        int nl = p[28] | p[29] << 8, xl = p[30] | p[31] << 8, cl = p[32] | p[33] << 8;
        if ((size_t)nl == strlen(name) && memcmp(p + 46, name, (size_t)nl) == 0) return p;
        p += 46 + nl + xl + cl;
    }
    return NULL;
}

/* Where the member of central directory entry e starts its data: past
   its local header's name and extra field (np.savez writes a zip64 one). */
static size_t zip_data_at(const unsigned char *zip, const unsigned char *e) {
    const unsigned char *local = zip + get_le32(e + 42);
    return get_le32(e + 42) + 30 + (size_t)(local[26] | local[27] << 8) +
           (size_t)(local[28] | local[29] << 8);
}

static void test_npz_damaged(void) {
    size_t n = read_fixture("data.npz", buf, sizeof buf), nz;
    unsigned char *e, *end;
    const char *path;
    mpt_dataset_npy_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.x_key = "x_train";
    desc.y_key = "y_train";
    test__begin();
    e = n ? zip_entry(buf, n, "x_train.npy") : NULL;
    CHECK(e != NULL, "no x_train.npy in data.npz (%zu bytes; run tests/data/npy/make.py?)", n);
    test__end("npz: the fixture data.npz is there");
    if (!e) return;
    end = buf + n - 22;
    memcpy(work, buf, n);
    put_le32(work + (e - buf) + 42, (uint32_t)n); /* the local header's offset */
    path = write_file("offset.npz", work, n);
    expect_refusal("a member offset past the directory", path, NULL, &desc, MPT_ERR_FORMAT,
                   "offset is out of range", NULL);
    memcpy(work, buf, n);
    put_le32(work + (e - buf) + 42, 0xfffffff0u);
    path = write_file("offset2.npz", work, n);
    expect_refusal("a member offset near 4 GiB", path, NULL, &desc, MPT_ERR_FORMAT,
                   "out of range", NULL);
    memcpy(work, buf, n);
    put_le32(work + (e - buf) + 42, 7); /* inside the first member: no local header */
    path = write_file("offset3.npz", work, n);
    expect_refusal("a member offset at no local header", path, NULL, &desc, MPT_ERR_FORMAT,
                   "no local file header", NULL);
    memcpy(work, buf, n);
    put_le32(work + (e - buf) + 20, 100000); /* compressed size */
    path = write_file("csize.npz", work, n);
    expect_refusal("a member's data past the directory", path, NULL, &desc, MPT_ERR_FORMAT,
                   "runs into the central directory", NULL);
    memcpy(work, buf, n);
    put_le32(work + (end - buf) + 16, (uint32_t)n); /* the directory's offset */
    path = write_file("cd.npz", work, n);
    expect_refusal("a directory offset past the end", path, NULL, &desc, MPT_ERR_FORMAT,
                   "central directory runs past", NULL);
    memcpy(work, buf, n);
    work[(end - buf) + 10] = 0xff, work[(end - buf) + 11] = 0xff;
    work[(end - buf) + 8] = 0xff, work[(end - buf) + 9] = 0xff;
    path = write_file("zip64.npz", work, n);
    expect_refusal("zip64", path, NULL, &desc, MPT_ERR_UNSUPPORTED, "zip64", NULL);
    memcpy(work, buf, n);
    work[(end - buf) + 10] = 9; /* more entries than the directory holds */
    work[(end - buf) + 8] = 9;
    path = write_file("entries.npz", work, n);
    expect_refusal("a directory cut short", path, NULL, &desc, MPT_ERR_FORMAT,
                   "central directory entry", NULL);
    memcpy(work, buf, n);
    work[(e - buf) + 8] |= 1;
    path = write_file("encrypted.npz", work, n);
    expect_refusal("an encrypted member", path, NULL, &desc, MPT_ERR_UNSUPPORTED, "encrypted",
                   NULL);
    memcpy(work, buf, n);
    work[(e - buf) + 10] = 12; /* bzip2 */
    path = write_file("bzip2.npz", work, n);
    expect_refusal("a bzip2 member", path, NULL, &desc, MPT_ERR_UNSUPPORTED, "method 12", NULL);
    memcpy(work, buf, n);
    work[zip_data_at(buf, e) + 130] ^= 0x40; /* a byte of x_train's data (past its header) */
    path = write_file("crc.npz", work, n);
    if (HAVE_ZLIB) /* without zlib, stored members go unchecked */
        expect_refusal("a data byte changed (CRC-32)", path, NULL, &desc, MPT_ERR_FORMAT,
                       "CRC-32", NULL);
    expect_refusal("no end record", write_file("short.npz", buf, n - 1), NULL, &desc,
                   MPT_ERR_FORMAT, "no end-of-central-directory record", NULL);
    expect_refusal("only a local header's magic", write_file("pk.npz", "PK\x03\x04", 4), NULL,
                   &desc, MPT_ERR_FORMAT, "not a valid .npz", NULL);
    nz = read_fixture("data_z.npz", buf, sizeof buf);
    e = nz ? zip_entry(buf, nz, "x_train.npy") : NULL;
    if (!e || !HAVE_ZLIB) return;
    memcpy(work, buf, nz);
    work[zip_data_at(buf, e) + 30] ^= 0x55; /* inside the deflate stream */
    path = write_file("deflate.npz", work, nz);
    expect_refusal("corrupted deflate data", path, NULL, &desc, MPT_ERR_FORMAT, "corrupted",
                   NULL);
    memcpy(work, buf, nz);
    put_le32(work + (e - buf) + 24, 0x7fffffffu); /* the uncompressed size */
    path = write_file("bomb.npz", work, nz);
    expect_refusal("an uncompressed size deflate cannot reach", path, NULL, &desc,
                   MPT_ERR_FORMAT, "claims more bytes", NULL);
    memcpy(work, buf, nz);
    put_le32(work + (e - buf) + 24, get_le32(e + 24) + 4);
    path = write_file("usize.npz", work, nz);
    expect_refusal("an uncompressed size 4 bytes too large", path, NULL, &desc, MPT_ERR_FORMAT,
                   "124 bytes follow the header", NULL);
    memcpy(work, buf, nz);
    put_le32(work + (e - buf) + 20, get_le32(e + 20) - 8); /* the compressed size */
    path = write_file("cut_deflate.npz", work, nz);
    expect_refusal("a deflate stream cut short", path, NULL, &desc, MPT_ERR_FORMAT, "truncated",
                   NULL);
}

/* ---- arrays larger than a chunk ------------------------------------------------------ */

static void put_le16(unsigned char *p, unsigned v) {
    p[0] = (unsigned char)v, p[1] = (unsigned char)(v >> 8);
}

/* A zip archive of one member "name" holding bytes[0, n), deflated (raw,
   as zip stores it) or stored, into out; its size. */
static size_t zip_one(unsigned char *out, const char *name, const unsigned char *bytes, size_t n,
                      int deflated) {
    size_t nl = strlen(name), at = 30 + nl, csize = n, cd;
    uint32_t crc = 0;
#if HAVE_ZLIB
    crc = (uint32_t)crc32(0L, bytes, (uInt)n);
    if (deflated) {
        z_stream z;
        memset(&z, 0, sizeof z);
        if (deflateInit2(&z, 6, Z_DEFLATED, -15, 8, Z_DEFAULT_STRATEGY) != Z_OK) return 0;
        z.next_in = (Bytef *)bytes;
        z.avail_in = (uInt)n;
        z.next_out = out + at;
        z.avail_out = (uInt)(n + 1024);
        if (deflate(&z, Z_FINISH) != Z_STREAM_END) n = 0;
        csize = z.total_out;
        deflateEnd(&z);
    } else
#endif
        memcpy(out + at, bytes, n);
    memset(out, 0, 30);
    put_le32(out, 0x04034b50u);
    put_le16(out + 4, 20);
    put_le16(out + 8, deflated ? 8 : 0);
    put_le32(out + 14, crc);
    put_le32(out + 18, (uint32_t)csize);
    put_le32(out + 22, (uint32_t)n);
    put_le16(out + 26, (unsigned)nl);
    memcpy(out + 30, name, nl);
    cd = at + csize;
    memset(out + cd, 0, 46);
    put_le32(out + cd, 0x02014b50u);
    put_le16(out + cd + 4, 20);
    put_le16(out + cd + 6, 20);
    put_le16(out + cd + 10, deflated ? 8 : 0);
    put_le32(out + cd + 16, crc);
    put_le32(out + cd + 20, (uint32_t)csize);
    put_le32(out + cd + 24, (uint32_t)n);
    put_le16(out + cd + 28, (unsigned)nl);
    memcpy(out + cd + 46, name, nl);
    memset(out + cd + 46 + nl, 0, 22);
    put_le32(out + cd + 46 + nl, 0x06054b50u);
    put_le16(out + cd + 46 + nl + 8, 1);
    put_le16(out + cd + 46 + nl + 10, 1);
    put_le32(out + cd + 46 + nl + 12, (uint32_t)(46 + nl));
    put_le32(out + cd + 46 + nl + 16, (uint32_t)cd);
    return cd + 46 + nl + 22;
}

/* 20,000 samples: x big-endian float32 (20000, 3), 240,000 bytes, and y
   int64 class ids, 160,000 bytes, each several of the loader's 64 KiB
   chunks; then x again as the member of a stored and of a deflated
   archive, whose compressed bytes (random-looking floats) span several
   reads. Every value is checked. */
static void test_npy_many_chunks(void) {
    enum { N = 20000 };
    static unsigned char x_be[N * 3 * 4], y_le[N * 8];
    static unsigned char file[N * 3 * 4 + 2048], zip[N * 3 * 4 + 4096];
    const char *x_path, *y_path, *z_path;
    int64_t i, bad = 0;
    size_t n;
    int z;
    for (i = 0; i < N * 3; i++) {
        float f = (float)((double)((i * 2654435761u) % 1000003u) / 7.0);
        uint32_t u;
        memcpy(&u, &f, 4);
        x_be[4 * i] = (unsigned char)(u >> 24), x_be[4 * i + 1] = (unsigned char)(u >> 16);
        x_be[4 * i + 2] = (unsigned char)(u >> 8), x_be[4 * i + 3] = (unsigned char)u;
    }
    for (i = 0; i < N; i++) {
        memset(y_le + 8 * i, 0, 8);
        y_le[8 * i] = (unsigned char)label_at(i);
    }
    n = npy_bytes(file, "{'descr': '>f4', 'fortran_order': False, 'shape': (20000, 3), }", x_be,
                  sizeof x_be);
    x_path = write_file("many_x.npy", file, n);
    n = npy_bytes(file, "{'descr': '<i8', 'fortran_order': False, 'shape': (20000,), }", y_le,
                  sizeof y_le);
    y_path = write_file("many_y.npy", file, n);
    n = npy_bytes(file, "{'descr': '>f4', 'fortran_order': False, 'shape': (20000, 3), }", x_be,
                  sizeof x_be);
    for (z = 0; z < 3; z++) {
        mpt_dataset *d = NULL;
        mpt_dataset_npy_desc desc;
        int32_t *y = (int32_t *)malloc(N * sizeof(int32_t));
        test__begin();
        memset(&desc, 0, sizeof desc);
        z_path = x_path;
        if (z > 0) {
            size_t zn = zip_one(zip, "x.npy", file, n, z == 2);
            z_path = write_file(z == 2 ? "many_z.npz" : "many.npz", zip, zn);
        }
        if (z == 2 && !HAVE_ZLIB) {
            free(y);
            SKIP("no zlib: deflated archives are refused");
            test__end("npy: 20,000 samples, x deflated in an .npz");
            continue;
        }
        CHECK(mpt_dataset_load_npy(q, z_path, y_path, &desc, &d) == MPT_OK, "%s",
              mpt_context_error(q));
        if (d && y) {
            for (i = 0, bad = 0; i < N * 3; i++) {
                float want = (float)((double)((i * 2654435761u) % 1000003u) / 7.0);
                bad += ((const float *)d->x)[i] != want;
            }
            CHECK(bad == 0, "%lld of x's values differ", (long long)bad);
            CHECK(mpt_dataset_labels(q, d, 0, N, y) == MPT_OK, "%s", mpt_context_error(q));
            for (i = 0, bad = 0; i < N; i++) bad += y[i] != label_at(i);
            CHECK(bad == 0, "%lld labels differ", (long long)bad);
        }
        mpt_dataset_destroy(d);
        free(y);
        test__end("npy: 20,000 samples, x %s", z == 0   ? "big-endian in an .npy"
                                                 : z == 1 ? "stored in an .npz"
                                                          : "deflated in an .npz");
    }
}

/* Every allocation of a deflated .npz load and of a CSV load failing in
   turn: a status (never a crash), and as many frees as allocations. */
static void test_allocation_failures(void) {
    const char *csv = write_file("oom.csv", "a,y\n1,2\n3,4\n", 12);
    long k;
    int saw_oom = 0;
    mpt_dataset_npy_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.x_key = "x_train";
    desc.y_key = "y_train";
    for (k = 0; k < 48; k++) {
        counting_alloc c = {0, 0, -1};
        mpt_context *cc = counting_ctx(&c);
        mpt_dataset *d = NULL;
        mpt_dataset_csv_desc cd;
        mpt_status s;
        if (!cc) continue;
        c.fail_after = c.allocs + k / 2;
        if (k % 2 == 0) {
            s = mpt_dataset_load_npy(cc, fixture(HAVE_ZLIB ? "data_z.npz" : "data.npz"), NULL,
                                     &desc, &d);
        } else {
            memset(&cd, 0, sizeof cd);
            cd.label_column = "y";
            s = mpt_dataset_load_csv(cc, csv, &cd, &d);
        }
        mpt_dataset_destroy(d);
        CHECK(s == MPT_OK || s == MPT_ERR_OUT_OF_MEMORY, "allocation %ld failing gave %s", k / 2,
              mpt_status_string(s));
        saw_oom |= s == MPT_ERR_OUT_OF_MEMORY;
        c.fail_after = -1;
        mpt_context_destroy(cc);
        CHECK(c.allocs == c.frees, "allocation %ld failing: %ld allocs, %ld frees", k / 2,
              c.allocs, c.frees);
    }
    CHECK(saw_oom, "no allocation failure was ever reported");
}

/* ---- CSV ---------------------------------------------------------------------------- */

/* A CSV file of n rows of the columns a, b, label, c (the label column
   third), values as %.9g writes them (a float32 read back exactly). */
static const char *csv_file(const char *name, int n) {
    static char text[8192];
    size_t len = (size_t)snprintf(text, sizeof text, "a,b,label,c\n");
    int i;
    for (i = 0; i < n; i++)
        len += (size_t)snprintf(text + len, sizeof text - len, "%.9g,%.9g,%d,%.9g\n",
                                (double)(value_at(3 * i) / 3.0f), (double)value_at(3 * i + 1),
                                (int)label_at(i), (double)(value_at(3 * i + 2) * 1e-3f));
    return write_file(name, text, len);
}

static void test_csv_round_trip(void) {
    mpt_dataset_csv_desc desc;
    mpt_dataset *d = NULL;
    int64_t shape[3] = {0};
    int i, bad = 0;
    memset(&desc, 0, sizeof desc);
    desc.label_column = "label";
    CHECK(mpt_dataset_load_csv(q, csv_file("round.csv", 5), &desc, &d) == MPT_OK, "%s",
          mpt_context_error(q));
    if (!d) return;
    CHECK(mpt_dataset_count(d) == 5 && mpt_dataset_sample_shape(d, shape) == 1 && shape[0] == 3 &&
              d->x_dtype == MPT_FLOAT32,
          "count %lld, shape (%lld)", (long long)mpt_dataset_count(d), (long long)shape[0]);
    for (i = 0; i < 5 && d->x_dtype == MPT_FLOAT32 && shape[0] == 3; i++) {
        const float *x = (const float *)d->x + 3 * i;
        bad += x[0] != value_at(3 * i) / 3.0f;
        bad += x[1] != value_at(3 * i + 1);
        bad += x[2] != value_at(3 * i + 2) * 1e-3f;
    }
    CHECK(bad == 0, "%d values differ from what was written", bad);
    check_labels(d, "round.csv");
    mpt_dataset_destroy(d);
}

static void test_csv_forms(void) {
    static const char text[] = "\xef\xbb\xbf x , label\t,z\r\n\r\n 1.5 ,\t3, -2e-3\r\n"
                               "\n0x10,+7,.25\r\n\r\n";
    static const char semi[] = "p;q;t\n1;2;0.5\n3;4;-1.5\n";
    mpt_dataset_csv_desc desc;
    mpt_dataset *d = NULL;
    float t[2];
    memset(&desc, 0, sizeof desc);
    desc.label_column = "label";
    test__begin();
    CHECK(mpt_dataset_load_csv(q, write_file("forms.csv", text, sizeof text - 1), &desc, &d) ==
              MPT_OK,
          "%s", mpt_context_error(q));
    if (d) {
        const float *x = (const float *)d->x;
        const int32_t *y = (const int32_t *)d->y;
        CHECK(mpt_dataset_count(d) == 2 && x[0] == 1.5f && x[1] == -2e-3f && x[2] == 16.0f &&
                  x[3] == 0.25f && y[0] == 3 && y[1] == 7,
              "%lld rows: %g %g %g %g, labels %d %d", (long long)mpt_dataset_count(d),
              (double)x[0], (double)x[1], (double)x[2], (double)x[3], (int)y[0], (int)y[1]);
    }
    mpt_dataset_destroy(d);
    d = NULL;
    test__end("csv: a byte-order mark, CRLF, blank lines, spaces and tabs, strtod's forms");
    test__begin();
    desc.label_column = "t";
    desc.separator = ';';
    desc.float_targets = 1;
    CHECK(mpt_dataset_load_csv(q, write_file("semi.csv", semi, sizeof semi - 1), &desc, &d) ==
              MPT_OK,
          "%s", mpt_context_error(q));
    if (d) {
        CHECK(mpt_dataset_targets(q, d, 0, 2, t) == MPT_OK && t[0] == 0.5f && t[1] == -1.5f,
              "targets %g %g: %s", (double)t[0], (double)t[1], mpt_context_error(q));
        CHECK(((const float *)d->x)[3] == 4.0f, "x[1][1] is %g", (double)((const float *)d->x)[3]);
    }
    mpt_dataset_destroy(d);
    test__end("csv: separator ';', float targets");
}

static void expect_csv_error(const char *what, const char *text, mpt_status want,
                             const char *w1, const char *w2) {
    const char *path = write_file("bad.csv", text, strlen(text));
    mpt_dataset_csv_desc desc;
    mpt_dataset *d = (mpt_dataset *)&d;
    mpt_status s;
    memset(&desc, 0, sizeof desc);
    desc.label_column = "y";
    test__begin();
    s = mpt_dataset_load_csv(q, path, &desc, &d);
    CHECK(s == want, "status %s, expected %s: %s", mpt_status_string(s), mpt_status_string(want),
          mpt_context_error(q));
    CHECK(d == NULL, "*out is not NULL after a failure");
    CHECK(strstr(mpt_context_error(q), path) != NULL, "the message \"%s\" does not name the file",
          mpt_context_error(q));
    CHECK(!w1 || strstr(mpt_context_error(q), w1), "the message \"%s\" lacks \"%s\"",
          mpt_context_error(q), w1);
    CHECK(!w2 || strstr(mpt_context_error(q), w2), "the message \"%s\" lacks \"%s\"",
          mpt_context_error(q), w2);
    if (s == MPT_OK) mpt_dataset_destroy(d);
    test__end("csv refused: %s", what);
}

static void test_csv_errors(void) {
    static const struct {
        const char *what, *text;
        mpt_status want;
        const char *w1, *w2; /* words the message holds (NULL: none) */
    } cases[] = {
        {"not a number", "a,y,b\n1,2,3\n4,5,6\n7,8,abc\n", MPT_ERR_FORMAT,
         "bad.csv:4:3: 'abc' is not a number", NULL},
        {"a number and more", "a,y\n1.5x,2\n", MPT_ERR_FORMAT,
         ":2:1: '1.5x' is not a number", NULL},
        {"an empty field", "a,b,y\n1,,2\n", MPT_ERR_FORMAT, ":2:2: an empty field", NULL},
        {"too few fields", "a,b,y\n1,2,3\n\n4,5\n", MPT_ERR_FORMAT,
         ":4: 2 fields, the header has 3", NULL},
        {"too many fields", "a,y\n1,2,3\n", MPT_ERR_FORMAT, ":2: 3 fields, the header has 2", NULL},
        {"a class id with a fraction", "a,y\n1,2\n3,1.5\n", MPT_ERR_FORMAT,
         ":3:2: '1.5' is not a class id", NULL},
        {"a negative class id", "a,y\n1,-2\n", MPT_ERR_FORMAT,
         ":2:2: '-2' is not a class id", NULL},
        {"a class id past int32", "a,y\n1,2147483648\n", MPT_ERR_FORMAT,
         ":2:2: '2147483648' is not a class id", NULL},
        {"nan", "a,y\nnan,1\n", MPT_ERR_NUMERIC, ":2:1: 'nan' is not a finite", NULL},
        {"past float32", "a,y\n1e39,1\n", MPT_ERR_NUMERIC,
         ":2:1: '1e39' is not a finite float32", NULL},
        {"a quoted field", "a,y\n\"1\",2\n", MPT_ERR_UNSUPPORTED,
         ":2:1: a quoted field", "RFC 4180"},
        {"no label column", "a,b\n1,2\n", MPT_ERR_INVALID_ARGUMENT,
         "no column 'y' in the header", "its columns: a, b"},
        {"the label column twice", "y,a,y\n1,2,3\n", MPT_ERR_FORMAT,
         "named twice (columns 1 and 3)", NULL},
        {"only the label column", "y\n1\n", MPT_ERR_SHAPE, "only the label column", NULL},
        {"no rows", "a,y\n\n\n", MPT_ERR_FORMAT, "no rows after its header", NULL},
        {"an empty file", "", MPT_ERR_FORMAT, "no header row", NULL},
        {"a control character in a number", "a,y\n1\0332,1\n", MPT_ERR_FORMAT,
         "is not a number", NULL},
    };
    mpt_dataset *d = (mpt_dataset *)&d;
    size_t k;
    for (k = 0; k < sizeof cases / sizeof cases[0]; k++)
        expect_csv_error(cases[k].what, cases[k].text, cases[k].want, cases[k].w1, cases[k].w2);
    test__begin();
    CHECK(mpt_dataset_load_csv(q, tmp_path("bad.csv"), NULL, &d) == MPT_ERR_INVALID_ARGUMENT &&
              d == NULL && strstr(mpt_context_error(q), "label_column"),
          "a NULL descriptor: %s", mpt_context_error(q));
    test__end("csv refused: no label column given");
}

int main(void) {
    const char *slash = strrchr(__FILE__, '/');
    q = quiet_ctx();
    snprintf(fixtures, sizeof fixtures, "%.*sdata/npy/", slash ? (int)(slash - __FILE__ + 1) : 0,
             __FILE__);
    snprintf(tmp_dir, sizeof tmp_dir, "/tmp/mpt_test_npy_XXXXXX");
    if (!q || !mkdtemp(tmp_dir)) {
        fprintf(stderr, "cannot create a context or %s\n", tmp_dir);
        return 1;
    }
    strcat(tmp_dir, "/");
    if (access(fixture("x_f32.npy"), R_OK) != 0) { /* __FILE__ is relative to the build's folder */
        printf("FAIL fixtures: no %s (run from the repository's root)\n", fixture("x_f32.npy"));
        rmdir(tmp_dir);
        return 1;
    }
    test_npy_x_dtypes();
    test_npy_y_dtypes();
    test_npz();
    test_npy_refusals();
    test_npy_damaged();
    test_npz_damaged();
    test_npy_many_chunks();
    TEST_RUN(test_allocation_failures);
    TEST_RUN(test_csv_round_trip);
    test_csv_forms();
    test_csv_errors();
    test_remove_tree(tmp_dir);
    mpt_context_destroy(q);
    return test_summary("test_npy");
}
