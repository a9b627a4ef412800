/* Datasets and the batch loader: IDX files (plain and gzip; truncated,
   corrupted, mislabelled), the real Fashion-MNIST where it is installed,
   mpt_dataset_create's checks, split views, gathering into every dtype, and
   the prefetching loader (content, last partial batch, epochs, destroying
   mid-epoch, no allocation per batch). */
#define _POSIX_C_SOURCE 200809L /* mkdtemp, posix_memalign */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"
#include <dirent.h>
#include <errno.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h> /* the tests write gzip files even where the library reads none */

#define FASHION_DIR "/usr/share/datasets/fashion-mnist"

/* Built with -DMPT_NO_ZLIB, the library refuses every gzip file (and these
   tests expect that); plain files behave the same either way. */
#ifdef MPT_NO_ZLIB
#define HAVE_ZLIB 0
#else
#define HAVE_ZLIB 1
#endif

static mpt_context *ctx;  /* the default context: 4 threads, errors printed    */
static mpt_context *q;    /* one thread, expected errors counted, not printed   */
static char tmp_dir[64];  /* a fresh directory under /tmp for this run's files  */

/* ---- writing files ---------------------------------------------------------- */

/* tmp_dir/name, in storage that lasts the whole run (never reused, so a
   test may keep any path it was given). */
static const char *tmp_path(const char *name) {
    static char paths[1024][160];
    static int next;
    char *p;
    if (next == 1024) {
        fprintf(stderr, "test_data: more than 1024 temporary paths\n");
        exit(1);
    }
    p = paths[next++];
    snprintf(p, sizeof paths[0], "%s/%s", tmp_dir, name);
    return p;
}

/* Writes bytes to tmp_dir/name, gzip-compressed when gz; returns the path. */
static const char *write_file(const char *name, const void *bytes, size_t n, int gz) {
    const char *path = tmp_path(name);
    if (gz) {
        gzFile f = gzopen(path, "wb");
        if (!f || (n > 0 && gzwrite(f, bytes, (unsigned)n) != (int)n)) {
            fprintf(stderr, "cannot write %s\n", path);
            exit(1);
        }
        gzclose(f);
    } else {
        FILE *f = fopen(path, "wb");
        if (!f || fwrite(bytes, 1, n, f) != n) {
            fprintf(stderr, "cannot write %s\n", path);
            exit(1);
        }
        fclose(f);
    }
    return path;
}

/* The raw bytes of a file (at most cap); returns the count. */
static size_t read_raw(const char *path, unsigned char *buf, size_t cap) {
    FILE *f = fopen(path, "rb");
    size_t n;
    if (!f) return 0;
    n = fread(buf, 1, cap, f);
    fclose(f);
    return n;
}

static void put_be32(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

/* The known contents of the test files. */
static unsigned char pixel_at(int64_t i, int64_t r, int64_t c) {
    return (unsigned char)((i * 37 + r * 11 + c * 3 + 5) & 255);
}
static unsigned char label_at(int64_t i) { return (unsigned char)((i * 7 + 3) % 10); }

/* An IDX image file's bytes (n, rows, cols) into buf; returns the size. */
static size_t idx_images(unsigned char *buf, uint32_t magic, uint32_t n, uint32_t rows,
                         uint32_t cols) {
    uint32_t i, r, c;
    size_t at = 16;
    put_be32(buf, magic);
    put_be32(buf + 4, n);
    put_be32(buf + 8, rows);
    put_be32(buf + 12, cols);
    for (i = 0; i < n; i++)
        for (r = 0; r < rows; r++)
            for (c = 0; c < cols; c++) buf[at++] = pixel_at(i, r, c);
    return at;
}

static size_t idx_labels(unsigned char *buf, uint32_t magic, uint32_t n) {
    uint32_t i;
    put_be32(buf, magic);
    put_be32(buf + 4, n);
    for (i = 0; i < n; i++) buf[8 + i] = label_at(i);
    return 8 + n;
}

/* Writes a valid pair of IDX files of n images (rows × cols) and n labels. */
static void write_pair(const char *images, const char *labels, uint32_t n, uint32_t rows,
                       uint32_t cols, int gz_images, int gz_labels, const char **img_path,
                       const char **lab_path) {
    static unsigned char buf[1 << 16];
    size_t len = idx_images(buf, 0x803, n, rows, cols);
    *img_path = write_file(images, buf, len, gz_images);
    len = idx_labels(buf, 0x801, n);
    *lab_path = write_file(labels, buf, len, gz_labels);
}

static void remove_tmp_dir(const char *dir) {
    DIR *d = opendir(dir);
    struct dirent *e;
    char path[512];
    if (!d) return;
    while ((e = readdir(d)) != NULL) {
        struct stat st;
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (stat(path, &st) == 0 && S_ISDIR(st.st_mode))
            remove_tmp_dir(path);
        else
            unlink(path);
    }
    closedir(d);
    rmdir(dir);
}

/* ---- checking failures ------------------------------------------------------ */

/* The call failed with `want`, and its message holds each of the (up to
   three) strings given. */
static void expect_error(mpt_status got, mpt_status want, const char *what, const char *s1,
                         const char *s2, const char *s3) {
    const char *msg = mpt_context_error(q);
    const char *needles[3];
    int k;
    needles[0] = s1;
    needles[1] = s2;
    needles[2] = s3;
    CHECK(got == want, "%s: status %s (%d), expected %s; message: %s", what,
          mpt_status_string(got), (int)got, mpt_status_string(want), msg);
    for (k = 0; k < 3; k++)
        CHECK(!needles[k] || strstr(msg, needles[k]), "%s: message \"%s\" lacks \"%s\"", what,
              msg, needles[k]);
}

static int is_gzip(const char *path) {
    unsigned char m[2] = {0, 0};
    return read_raw(path, m, 2) == 2 && m[0] == 0x1f && m[1] == 0x8b;
}

/* Without zlib, the error any gzip file gives (these tests never pair one
   with a plain images file that fails first). */
static int refused_gzip(const char *images, const char *labels) {
    return !HAVE_ZLIB && (is_gzip(images) || is_gzip(labels));
}

static void expect_load_error(const char *images, const char *labels, mpt_status want,
                              const char *what, const char *s1, const char *s2, const char *s3) {
    mpt_dataset *d = (mpt_dataset *)&d; /* must be set to NULL */
    mpt_status s = mpt_dataset_load_idx(q, images, labels, &d);
    if (refused_gzip(images, labels)) {
        want = MPT_ERR_UNSUPPORTED;
        s2 = "MPT_NO_ZLIB";
        s3 = NULL;
    }
    expect_error(s, want, what, s1, s2, s3);
    CHECK(d == NULL, "%s: *out not NULL after a failure", what);
    mpt_dataset_destroy(s == MPT_OK ? d : NULL);
}

/* ---- a loaded dataset's contents -------------------------------------------- */

/* Every pixel (as stored and as normalised to float32) and every label. */
static void check_contents(const mpt_dataset *d, int64_t n, int64_t rows, int64_t cols,
                           const char *what) {
    int64_t shape[4] = {0}, i, r, c, bad = 0; /* printed even when rank < 3 */
    int rank = mpt_dataset_sample_shape(d, shape);
    float *x;
    int32_t *y;
    int64_t *all;
    int32_t lo = -1, hi = -1, want_lo = 255, want_hi = 0;
    int count_ok = mpt_dataset_count(d) == n;
    int shape_ok = rank == 3 && shape[0] == rows && shape[1] == cols && shape[2] == 1;
    CHECK(count_ok, "%s: count %lld, expected %lld", what, (long long)mpt_dataset_count(d),
          (long long)n);
    CHECK(shape_ok, "%s: sample shape rank %d (%lld, %lld, %lld)", what, rank,
          (long long)shape[0], (long long)shape[1], (long long)shape[2]);
    /* Nothing to compare when either differs. Stopping here, not gathering 0
       samples: the gather would have written past x when the shape differs,
       and clearing n sent `all` into it unwritten (gcc -O1, which does not
       inline the gather, refuses that as maybe-uninitialized). */
    if (!count_ok || !shape_ok || n < 1) return;
    x = (float *)malloc((size_t)(n * rows * cols) * sizeof(float)); /* (n, rows, cols) */
    y = (int32_t *)malloc((size_t)n * sizeof(int32_t));             /* (n) */
    all = (int64_t *)malloc((size_t)n * sizeof(int64_t));           /* (n) 0..n-1 */
    if (!x || !y || !all) {
        CHECK(0, "%s: no memory for %lld samples", what, (long long)n);
        free(x), free(y), free(all);
        return;
    }
    CHECK(d->x_dtype == MPT_UINT8 && mpt__dataset_label_dtype(d) == MPT_INT32 &&
              d->y_count == 1,
          "%s: x %s, y %s", what, mpt_dtype_name(d->x_dtype),
          mpt_dtype_name(mpt__dataset_label_dtype(d)));
    for (i = 0; i < n; i++) all[i] = i;
    mpt__dataset_gather(ctx, d, all, n, MPT_FLOAT32, x, y);
    for (i = 0; i < n; i++) {
        for (r = 0; r < rows; r++)
            for (c = 0; c < cols; c++) {
                int64_t at = (i * rows + r) * cols + c;
                unsigned char p = pixel_at(i, r, c);
                /* x·scale with scale the float32 nearest 1/255, rounded once */
                float want = (float)((double)p * (double)(1.0f / 255.0f));
                if (((const uint8_t *)d->x)[at] != p || x[at] != want)
                    bad++;
            }
        if (y[i] != label_at(i)) bad++;
        want_lo = label_at(i) < want_lo ? label_at(i) : want_lo;
        want_hi = label_at(i) > want_hi ? label_at(i) : want_hi;
    }
    CHECK(bad == 0, "%s: %lld pixels or labels differ", what, (long long)bad);
    CHECK(mpt__dataset_label_range(d, &lo, &hi) == 1 && lo == want_lo && hi == want_hi,
          "%s: label range %d..%d, expected %d..%d", what, (int)lo, (int)hi, (int)want_lo,
          (int)want_hi);
    free(x);
    free(y);
    free(all);
}

/* ---- IDX files -------------------------------------------------------------- */

/* Plain and gzip, in every combination; non-square images, so that a
   transposition shows. */
static void test_idx_valid(void) {
    int gi, gl;
    for (gi = 0; gi < 2; gi++)
        for (gl = 0; gl < 2; gl++) {
            const char *img, *lab;
            mpt_dataset *d = NULL;
            mpt_status s;
            test__begin();
            write_pair("v-img", "v-lab", 23, 5, 7, gi, gl, &img, &lab);
            if (refused_gzip(img, lab)) {
                expect_load_error(img, lab, MPT_ERR_UNSUPPORTED, "no zlib", NULL, NULL, NULL);
                test__end("idx: gzip refused without zlib");
                continue;
            }
            s = mpt_dataset_load_idx(ctx, img, lab, &d);
            CHECK(s == MPT_OK, "load: %s", mpt_context_error(ctx));
            if (s == MPT_OK) check_contents(d, 23, 5, 7, "valid");
            mpt_dataset_destroy(d);
            test__end("idx: valid files, images %s, labels %s", gi ? "gzip" : "plain",
                      gl ? "gzip" : "plain");
        }
}

/* A single image and label, and 1×1 images: the smallest sizes there are. */
static void test_idx_smallest(void) {
    const char *img, *lab;
    mpt_dataset *d = NULL;
    write_pair("s-img", "s-lab", 1, 1, 1, HAVE_ZLIB, 0, &img, &lab);
    CHECK(mpt_dataset_load_idx(ctx, img, lab, &d) == MPT_OK, "%s", mpt_context_error(ctx));
    if (d) check_contents(d, 1, 1, 1, "1x1x1");
    mpt_dataset_destroy(d);
}

/* Files that end early: empty, inside the magic, inside the header, right
   after it, in the middle of the data, one byte short; plain and gzip;
   images and labels. The message names the file, what was expected and
   what is there. */
static void test_idx_truncated(void) {
    static unsigned char buf[4096];
    const char *good_img, *good_lab;
    size_t img_len = idx_images(buf, 0x803, 12, 6, 5); /* 16 + 360 bytes */
    static const struct {
        size_t keep;
        const char *why, *expect, *have;
    } cuts[] = {
        {0, "empty", "needs 4 bytes", "has 0"},
        {2, "inside the magic", "needs 4 bytes", "has 2"},
        {9, "inside the header", "needs 16 bytes", "has 9"},
        {16, "header only", "promises 376 bytes", "has 16"},
        {16 + 180, "in the middle of the data", "promises 376 bytes", "has 196"},
        {16 + 359, "one byte short", "promises 376 bytes", "has 375"},
    };
    unsigned k;
    int gz;
    write_pair("t-img-good", "t-lab-good", 12, 6, 5, 0, 0, &good_img, &good_lab);
    for (gz = 0; gz < 2; gz++)
        for (k = 0; k < sizeof cuts / sizeof cuts[0]; k++) {
            const char *path;
            test__begin();
            idx_images(buf, 0x803, 12, 6, 5);
            path = write_file(gz ? "t-img.gz" : "t-img", buf, cuts[k].keep, gz);
            expect_load_error(path, good_lab, MPT_ERR_FORMAT, cuts[k].why, path, "truncated",
                              cuts[k].expect);
            CHECK(refused_gzip(path, good_lab) || strstr(mpt_context_error(q), cuts[k].have),
                  "message \"%s\" lacks \"%s\"", mpt_context_error(q), cuts[k].have);
            test__end("idx: truncated images (%s), %s", cuts[k].why, gz ? "gzip" : "plain");
        }
    (void)img_len;
    for (gz = 0; gz < 2; gz++) {
        const char *path;
        test__begin();
        idx_labels(buf, 0x801, 12);
        path = write_file(gz ? "t-lab.gz" : "t-lab", buf, 8 + 7, gz);
        expect_load_error(good_img, path, MPT_ERR_FORMAT, "labels cut", path,
                          "promises 20 bytes", "has 15");
        test__end("idx: truncated labels, %s", gz ? "gzip" : "plain");
    }
}

/* A gzip file whose compressed stream is cut: in the middle of the
   deflate data, and just before the CRC and length trailer. */
static void test_idx_gzip_stream_cut(void) {
    static unsigned char buf[1 << 16], raw[1 << 16];
    const char *path, *lab, *img;
    size_t n, len;
    test_seed(5);
    write_pair("c-img", "c-lab", 40, 8, 8, 1, 0, &img, &lab);
    len = idx_images(buf, 0x803, 40, 8, 8);
    for (n = 16; n < len; n++) buf[n] = (unsigned char)test_next(); /* incompressible */
    path = write_file("c-img.gz", buf, len, 1);
    n = read_raw(path, raw, sizeof raw);
    CHECK(n > 100, "gzip file of %zu bytes", n);
    write_file("c-img-half.gz", raw, n / 2, 0);
    expect_load_error(tmp_path("c-img-half.gz"), lab, MPT_ERR_FORMAT, "cut in the middle",
                      tmp_path("c-img-half.gz"), "truncated", "promises 2576 bytes");
    write_file("c-img-notrailer.gz", raw, n - 8, 0);
    expect_load_error(tmp_path("c-img-notrailer.gz"), lab, MPT_ERR_FORMAT, "no trailer",
                      tmp_path("c-img-notrailer.gz"), "truncated", NULL);
    write_file("c-img-halftrailer.gz", raw, n - 3, 0);
    expect_load_error(tmp_path("c-img-halftrailer.gz"), lab, MPT_ERR_FORMAT, "half a trailer",
                      tmp_path("c-img-halftrailer.gz"), "truncated", NULL);
}

/* Corrupted gzip: a flipped byte in the deflate data, in the CRC, in the
   length. zlib finds each; the message names the file. */
static void test_idx_gzip_corrupted(void) {
    static unsigned char buf[1 << 16], raw[1 << 16];
    const char *path, *img, *lab;
    size_t n, len, i;
    static const struct {
        long from_end;
        const char *why;
    } flips[] = {{-1, "deflate data"}, {8, "CRC"}, {6, "CRC"}, {4, "length"}, {1, "length"}};
    unsigned k;
    test_seed(9);
    write_pair("x-img", "x-lab", 30, 8, 8, 0, 0, &img, &lab);
    len = idx_images(buf, 0x803, 30, 8, 8);
    for (i = 16; i < len; i++) buf[i] = (unsigned char)test_next();
    path = write_file("x-img.gz", buf, len, 1);
    n = read_raw(path, raw, sizeof raw);
    for (k = 0; k < sizeof flips / sizeof flips[0]; k++) {
        size_t at = flips[k].from_end < 0 ? n / 2 : n - (size_t)flips[k].from_end;
        char name[64];
        const char *bad;
        test__begin();
        raw[at] ^= 0x55;
        snprintf(name, sizeof name, "x-img-%u.gz", k);
        bad = write_file(name, raw, n, 0);
        raw[at] ^= 0x55;
        expect_load_error(bad, lab, MPT_ERR_FORMAT, flips[k].why, bad,
                          flips[k].from_end < 0 ? NULL : "corrupted", NULL);
        test__end("idx: corrupted gzip (%s byte %zu of %zu)", flips[k].why, at, n);
    }
    /* The same for a label file. */
    test__begin();
    len = idx_labels(buf, 0x801, 30);
    path = write_file("x-lab.gz", buf, len, 1);
    n = read_raw(path, raw, sizeof raw);
    raw[n - 7] ^= 0x01;
    path = write_file("x-lab-bad.gz", raw, n, 0);
    expect_load_error(img, path, MPT_ERR_FORMAT, "labels CRC", path, "corrupted", "zlib");
    test__end("idx: corrupted gzip label file");
}

/* Headers that are not what they should be. */
static void test_idx_bad_headers(void) {
    static unsigned char buf[4096];
    const char *img, *lab, *path;
    size_t len;
    write_pair("h-img", "h-lab", 4, 3, 3, 0, 0, &img, &lab);

    test__begin();
    len = idx_images(buf, 0x12345678, 4, 3, 3);
    path = write_file("h-magic", buf, len, 0);
    expect_load_error(path, lab, MPT_ERR_FORMAT, "wrong magic", path, "0x12345678", "0x00000803");
    test__end("idx: wrong magic number");

    test__begin();
    expect_load_error(lab, img, MPT_ERR_FORMAT, "files swapped", lab, "1 dimension", "0x00000803");
    test__end("idx: a label file given as images");

    test__begin();
    len = idx_images(buf, 0x804, 4, 3, 3);
    path = write_file("h-dims", buf, len, 0);
    expect_load_error(path, lab, MPT_ERR_FORMAT, "4 dims", path, "4 dimensions", NULL);
    len = idx_labels(buf, 0x802, 4);
    path = write_file("h-ldims", buf, len, 0);
    expect_load_error(img, path, MPT_ERR_FORMAT, "labels with 2 dims", path, "2 dimensions",
                      "0x00000801");
    test__end("idx: wrong number of dimensions");

    test__begin();
    len = idx_images(buf, 0xd03, 4, 3, 3);
    path = write_file("h-float", buf, len, 0);
    expect_load_error(path, lab, MPT_ERR_UNSUPPORTED, "float32 elements", path, "0x0d",
                      "float32");
    test__end("idx: float32 elements are unsupported");

    test__begin();
    len = idx_images(buf, 0x803, 4, 3, 3);
    put_be32(buf + 8, 0);
    path = write_file("h-zero", buf, len, 0);
    expect_load_error(path, lab, MPT_ERR_FORMAT, "a zero dimension", path, "dimension 1", "0");
    test__end("idx: a zero dimension");

    test__begin();
    len = idx_images(buf, 0x803, 4, 3, 3);
    put_be32(buf + 4, 0xffffffffu);
    put_be32(buf + 8, 0xffffffffu);
    put_be32(buf + 12, 0xffffffffu);
    path = write_file("h-overflow", buf, len, 0);
    expect_load_error(path, lab, MPT_ERR_OVERFLOW, "overflowing sizes", path, "4294967295",
                      NULL);
    test__end("idx: sizes whose product overflows");

    /* 2^31 images of 28 × 28 promised, 36 bytes there: found as truncation,
       without first allocating 1.7 TB (which the sanitizer would not let
       happen quietly). */
    test__begin();
    len = idx_images(buf, 0x803, 4, 3, 3);
    put_be32(buf + 4, 0x80000000u);
    put_be32(buf + 8, 28);
    put_be32(buf + 12, 28);
    path = write_file("h-huge", buf, len, 0);
    len = idx_labels(buf, 0x801, 4);
    put_be32(buf + 4, 0x80000000u);
    lab = write_file("h-huge-lab", buf, len, 0);
    expect_load_error(path, lab, MPT_ERR_FORMAT, "huge promise", path, "truncated",
                      "promises 1683627180048 bytes");
    test__end("idx: a header promising terabytes");
}

static void test_idx_count_mismatch(void) {
    static unsigned char buf[4096];
    const char *img, *lab;
    size_t len;
    write_pair("m-img", "m-lab", 10, 4, 4, HAVE_ZLIB, 0, &img, &lab);
    len = idx_labels(buf, 0x801, 9);
    lab = write_file("m-lab9", buf, len, 0);
    expect_load_error(img, lab, MPT_ERR_SHAPE, "10 vs 9", img, lab, "10 images");
    CHECK(strstr(mpt_context_error(q), "9 labels"), "%s", mpt_context_error(q));
}

/* Bytes after what the header describes are an error, plain or gzip. */
static void test_idx_trailing_bytes(void) {
    static unsigned char buf[4096];
    const char *img, *lab, *path;
    size_t len;
    int gz;
    write_pair("g-img", "g-lab", 6, 4, 4, 0, 0, &img, &lab);
    for (gz = 0; gz < 2; gz++) {
        test__begin();
        len = idx_images(buf, 0x803, 6, 4, 4);
        memcpy(buf + len, "garbage", 7);
        path = write_file(gz ? "g-img-t.gz" : "g-img-t", buf, len + 7, gz);
        expect_load_error(path, lab, MPT_ERR_FORMAT, "images", path, "7 trailing bytes",
                          "after the 112");
        len = idx_labels(buf, 0x801, 6);
        buf[len] = 0;
        path = write_file(gz ? "g-lab-t.gz" : "g-lab-t", buf, len + 1, gz);
        expect_load_error(img, path, MPT_ERR_FORMAT, "labels", path, "1 trailing byte ", NULL);
        test__end("idx: trailing bytes, %s", gz ? "gzip" : "plain");
    }
    test__begin(); /* more than is worth counting */
    {
        static unsigned char big[(1 << 20) + 8192];
        len = idx_images(big, 0x803, 6, 4, 4);
        path = write_file("g-img-big", big, sizeof big, 0);
        expect_load_error(path, lab, MPT_ERR_FORMAT, "a megabyte", path, "more than", NULL);
    }
    test__end("idx: a megabyte of trailing bytes");
}

/* The gzip-compressed bytes of src (n bytes) into out; returns their count. */
static size_t gzip_bytes(const char *name, const void *src, size_t n, unsigned char *out,
                         size_t cap) {
    return read_raw(write_file(name, src, n, 1), out, cap);
}

/* After the end of the gzip data the file must end, or another member
   begin: raw bytes there (zlib's gzread skips them as "trailing garbage")
   are an error naming the file, few or many, of an image or a label file.
   Concatenated members are one stream; a second member that holds more
   than the header describes is trailing data as any other. */
static void test_idx_gzip_trailing_garbage(void) {
    static unsigned char plain[4096], gz[(1 << 19) + 4096], tail[1 << 19];
    const char *img, *lab, *path;
    size_t len, n, i, half;
    mpt_dataset *d = NULL;
    static const struct {
        size_t count;
        const char *bytes, *why;
    } junk[] = {{7, "garbage", "7 bytes after"}, {1, "", "1 byte after"},
                {2, "\x1f" "x", "2 bytes after"}, {sizeof tail, NULL, "524288 bytes after"}};
    unsigned k;
    test_seed(21);
    write_pair("t-img", "t-lab", 6, 4, 4, 0, 0, &img, &lab);
    len = idx_images(plain, 0x803, 6, 4, 4);
    n = gzip_bytes("t-img-ok.gz", plain, len, gz, sizeof gz);
    for (i = 0; i < sizeof tail; i++) tail[i] = (unsigned char)test_next();
    for (k = 0; k < sizeof junk / sizeof junk[0]; k++) {
        char name[64];
        test__begin();
        memcpy(gz + n, junk[k].bytes ? (const void *)junk[k].bytes : tail, junk[k].count);
        snprintf(name, sizeof name, "t-img-%u.gz", k);
        path = write_file(name, gz, n + junk[k].count, 0);
        expect_load_error(path, lab, MPT_ERR_FORMAT, junk[k].why, path, junk[k].why,
                          "gzip data");
        test__end("idx: gzip image file with %zu raw bytes after its gzip data", junk[k].count);
    }

    test__begin();
    len = idx_labels(plain, 0x801, 6);
    n = gzip_bytes("t-lab-ok.gz", plain, len, gz, sizeof gz);
    gz[n] = 0;
    path = write_file("t-lab-zero.gz", gz, n + 1, 0);
    expect_load_error(img, path, MPT_ERR_FORMAT, "labels", path, "1 byte after", NULL);
    memcpy(gz + n, "\x1f\x8b\x08junk", 7); /* a member's magic, then no valid member */
    path = write_file("t-lab-badmember.gz", gz, n + 7, 0);
    expect_load_error(img, path, MPT_ERR_FORMAT, "a broken second member", path, NULL, NULL);
    test__end("idx: gzip label file with a zero byte or a broken member after its gzip data");

    test__begin(); /* the header and half the pixels, then the rest, as two members */
    len = idx_images(plain, 0x803, 6, 4, 4);
    half = 16 + 40;
    n = gzip_bytes("t-first.gz", plain, half, gz, sizeof gz);
    n += gzip_bytes("t-second.gz", plain + half, len - half, gz + n, sizeof gz - n);
    path = write_file("t-img-two.gz", gz, n, 0);
    if (HAVE_ZLIB) {
        CHECK(mpt_dataset_load_idx(ctx, path, lab, &d) == MPT_OK, "two members: %s",
              mpt_context_error(ctx));
        if (d) check_contents(d, 6, 4, 4, "two members");
        mpt_dataset_destroy(d);
    }
    n += gzip_bytes("t-third.gz", "more", 4, gz + n, sizeof gz - n);
    path = write_file("t-img-three.gz", gz, n, 0);
    expect_load_error(path, lab, MPT_ERR_FORMAT, "a third member", path, "4 trailing bytes",
                      "after the 112");
    test__end("idx: gzip members concatenated; one too many");
}

static void test_idx_missing(void) {
    const char *img, *lab;
    mpt_dataset *d = NULL;
    char dir[300], missing[300];
    write_pair("n-img", "n-lab", 3, 2, 2, 0, 0, &img, &lab);

    test__begin();
    snprintf(missing, sizeof missing, "%s/no-such-file", tmp_dir);
    expect_load_error(missing, lab, MPT_ERR_IO, "images", missing, strerror(ENOENT), NULL);
    expect_load_error(img, missing, MPT_ERR_IO, "labels", missing, strerror(ENOENT), NULL);
    expect_load_error(tmp_dir, lab, MPT_ERR_IO, "a directory", tmp_dir, "directory", NULL);
    test__end("idx: missing files and a directory given as a file");

    test__begin();
    snprintf(dir, sizeof dir, "%s/no-such-dir", tmp_dir);
    expect_error(mpt_dataset_load_mnist(q, dir, 0, &d), MPT_ERR_IO, "missing dir", dir,
                 strerror(ENOENT), NULL);
    CHECK(d == NULL, "out set");
    expect_error(mpt_dataset_load_mnist(q, img, 0, &d), MPT_ERR_IO, "a file as dir", img,
                 "not a directory", NULL);
    snprintf(dir, sizeof dir, "%s/empty", tmp_dir);
    mkdir(dir, 0700);
    expect_error(mpt_dataset_load_mnist(q, dir, 1, &d), MPT_ERR_IO, "empty dir", dir,
                 "t10k-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte'");
    test__end("load_mnist: a missing directory, a file, an empty directory");

    test__begin();
    expect_error(mpt_dataset_load_idx(q, NULL, lab, &d), MPT_ERR_INVALID_ARGUMENT, "NULL path",
                 "images_path", NULL, NULL);
    expect_error(mpt_dataset_load_idx(q, img, lab, NULL), MPT_ERR_INVALID_ARGUMENT, "NULL out",
                 NULL, NULL, NULL);
    expect_error(mpt_dataset_load_mnist(q, NULL, 0, &d), MPT_ERR_INVALID_ARGUMENT, "NULL dir",
                 "dir", NULL, NULL);
    CHECK(mpt_dataset_load_idx(NULL, img, lab, &d) == MPT_ERR_INVALID_ARGUMENT, "NULL ctx");
    test__end("idx: NULL arguments");
}

/* An MNIST-layout directory: .gz preferred where both are there; plain
   files alone load too. */
static void test_load_mnist_dir(void) {
    char dir[300], name[400];
    const char *a, *b;
    mpt_dataset *d = NULL;
    mpt_status s;
    snprintf(dir, sizeof dir, "%s/mnist", tmp_dir);
    mkdir(dir, 0700);
    write_pair("mnist/train-images-idx3-ubyte.gz", "mnist/train-labels-idx1-ubyte.gz", 6, 3, 4, 1,
               1, &a, &b);
    write_pair("mnist/train-images-idx3-ubyte", "mnist/train-labels-idx1-ubyte", 4, 3, 4, 0, 0,
               &a, &b);
    write_pair("mnist/t10k-images-idx3-ubyte", "mnist/t10k-labels-idx1-ubyte", 5, 2, 2, 0, 0, &a,
               &b);
    s = mpt_dataset_load_mnist(ctx, dir, 0, &d);
    CHECK(s == MPT_OK, "train: %s", mpt_context_error(ctx));
#ifndef MPT_NO_ZLIB
    if (d) check_contents(d, 6, 3, 4, "train (.gz)");
#else
    if (d) check_contents(d, 4, 3, 4, "train (plain, no zlib)");
#endif
    mpt_dataset_destroy(d);
    d = NULL;
    s = mpt_dataset_load_mnist(ctx, dir, 1, &d);
    CHECK(s == MPT_OK, "test: %s", mpt_context_error(ctx));
    if (d) check_contents(d, 5, 2, 2, "t10k (plain)");
    mpt_dataset_destroy(d);
    /* A trailing slash in the directory name does no harm. */
    snprintf(name, sizeof name, "%s/", dir);
    d = NULL;
    CHECK(mpt_dataset_load_mnist(ctx, name, 1, &d) == MPT_OK, "%s", mpt_context_error(ctx));
    mpt_dataset_destroy(d);
}

#ifdef MPT_NO_ZLIB
/* Without zlib a gzip file is refused clearly; plain files still load. */
static void test_no_zlib(void) {
    const char *img, *lab;
    write_pair("z-img.gz", "z-lab", 3, 2, 2, 1, 0, &img, &lab);
    expect_load_error(img, lab, MPT_ERR_UNSUPPORTED, "gzip without zlib", img, "MPT_NO_ZLIB",
                      NULL);
}
#endif

/* ---- the real Fashion-MNIST ------------------------------------------------- */

/* Mean pixel (0..255) of a uint8 dataset through gather, in chunks. */
static double mean_pixel(const mpt_dataset *d) {
    enum { CHUNK = 1000 };
    int64_t n = mpt_dataset_count(d), per = d->x_count, i, k;
    int64_t idx[CHUNK];
    float *x = (float *)malloc(sizeof(float) * CHUNK * (size_t)per); /* (CHUNK, per) */
    double sum = 0;
    for (i = 0; i < n; i += CHUNK) {
        int64_t m = n - i < CHUNK ? n - i : CHUNK;
        for (k = 0; k < m; k++) idx[k] = i + k;
        mpt__dataset_gather(ctx, d, idx, m, MPT_FLOAT32, x, NULL);
        for (k = 0; k < m * per; k++) sum += x[k];
    }
    free(x);
    return sum / ((double)n * (double)per) * 255.0;
}

static void check_fashion(int test, int64_t n, double mean, const int *first_labels,
                          int64_t img, int64_t row, int64_t col, int value) {
    mpt_dataset *d = NULL;
    int64_t shape[4], counts[10] = {0}, i;
    int32_t lo = 0, hi = 0;
    mpt_status s;
    const int32_t *y;
    test__begin();
    s = mpt_dataset_load_mnist(ctx, FASHION_DIR, test, &d);
    CHECK(s == MPT_OK, "load: %s", mpt_context_error(ctx));
    if (s == MPT_OK) {
        double m = mean_pixel(d);
        CHECK(mpt_dataset_count(d) == n, "count %lld", (long long)mpt_dataset_count(d));
        CHECK(mpt_dataset_sample_shape(d, shape) == 3 && shape[0] == 28 && shape[1] == 28 &&
                  shape[2] == 1, "sample shape");
        CHECK(mpt__dataset_label_range(d, &lo, &hi) && lo == 0 && hi == 9, "labels %d..%d",
              (int)lo, (int)hi);
        y = (const int32_t *)d->y;
        for (i = 0; i < mpt_dataset_count(d); i++) counts[y[i] >= 0 && y[i] < 10 ? y[i] : 0]++;
        for (i = 0; i < 10; i++)
            CHECK(counts[i] == n / 10, "class %lld has %lld samples", (long long)i,
                  (long long)counts[i]);
        for (i = 0; i < 10; i++)
            CHECK(y[i] == first_labels[i], "label %lld is %d, expected %d", (long long)i,
                  (int)y[i], first_labels[i]);
        CHECK(((const uint8_t *)d->x)[(img * 28 + row) * 28 + col] == value,
              "image %lld pixel (%lld, %lld) is %d, expected %d", (long long)img,
              (long long)row, (long long)col,
              ((const uint8_t *)d->x)[(img * 28 + row) * 28 + col], value);
        CHECK(fabs(m - mean) < 0.01, "mean pixel %.4f, expected %.4f", m, mean);
    }
    mpt_dataset_destroy(d);
}

/* Known facts of the files (the means computed independently, with
   Python's gzip module): 60000 + 10000 images, 6000/1000 per class. */
static void test_fashion_mnist(void) {
    static const int train_labels[10] = {9, 0, 0, 3, 0, 2, 7, 2, 5, 5};
    static const int test_labels[10] = {9, 2, 1, 1, 6, 1, 4, 6, 5, 7};
    struct stat st;
    mpt_dataset *d = NULL;
    if (stat(FASHION_DIR, &st) != 0 || !HAVE_ZLIB) {
        test__begin();
        if (!HAVE_ZLIB && stat(FASHION_DIR, &st) == 0)
            expect_error(mpt_dataset_load_mnist(q, FASHION_DIR, 1, &d), MPT_ERR_UNSUPPORTED,
                         "no zlib", "t10k-images-idx3-ubyte.gz", "MPT_NO_ZLIB", NULL);
        SKIP(HAVE_ZLIB ? "no " FASHION_DIR " (Debian package dataset-fashion-mnist)"
                       : "built with MPT_NO_ZLIB: the installed files are gzip");
        test__end("fashion-mnist: the real files");
        return;
    }
    check_fashion(0, 60000, 72.9404, train_labels, 0, 14, 14, 217);
    test__end("fashion-mnist: training set (60000, 28, 28, 1), mean pixel 72.94");
    check_fashion(1, 10000, 73.1466, test_labels, 5, 10, 10, 176);
    test__end("fashion-mnist: test set (10000, 28, 28, 1), mean pixel 73.15");
}

/* ---- mpt_dataset_create ----------------------------------------------------- */

static mpt_status create(mpt_context *c, const mpt_tensor *x, const mpt_tensor *y, int copy,
                         mpt_dataset **out) {
    mpt_dataset_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.x = x;
    desc.y = y;
    desc.copy = copy;
    return mpt_dataset_create(c, &desc, out);
}

/* create takes x and y (borrowed); the dataset is destroyed again. */
static void expect_created(mpt_context *c, const mpt_tensor *x, const mpt_tensor *y,
                           const char *what) {
    mpt_dataset *d = NULL;
    CHECK(create(c, x, y, 0, &d) == MPT_OK, "%s: %s", what, mpt_context_error(c));
    mpt_dataset_destroy(d);
}

static mpt_tensor tensor(mpt_dtype dtype, int rank, int64_t d0, int64_t d1, int64_t d2,
                         void *data) {
    mpt_tensor t;
    memset(&t, 0, sizeof t);
    t.dtype = dtype;
    t.rank = rank;
    t.shape[0] = d0;
    t.shape[1] = d1;
    t.shape[2] = d2;
    t.data = data;
    return t;
}

static void test_create_validation(void) {
    float xf[6 * 4];                           /* (6, 4) */
    mpt_half xh[6 * 4];
    mpt_bf16 xb[6 * 4];
    int32_t yi[6] = {0, 1, 2, 1, 0, 2};
    float yf[6 * 2];
    mpt_tensor x, y;
    mpt_dataset *d = NULL;
    int i;
    for (i = 0; i < 24; i++) {
        xf[i] = (float)i * 0.25f;
        xh[i] = mpt_float_to_half(xf[i]);
        xb[i] = mpt_float_to_bf16(xf[i]);
    }
    for (i = 0; i < 12; i++) yf[i] = (float)i;

    test__begin();
    x = tensor(MPT_FLOAT32, 2, 6, 4, 0, xf);
    y = tensor(MPT_INT32, 1, 6, 0, 0, yi);
    CHECK(create(ctx, &x, &y, 0, &d) == MPT_OK, "valid: %s", mpt_context_error(ctx));
    mpt_dataset_destroy(d);
    y = tensor(MPT_INT32, 2, 6, 1, 0, yi);
    CHECK(create(ctx, &x, &y, 0, &d) == MPT_OK, "(n, 1) class ids: %s", mpt_context_error(ctx));
    CHECK(d && mpt__dataset_label_dtype(d) == MPT_INT32 && d->y_count == 1 &&
              mpt__dataset_label_shape(d, NULL) == 0, "(n, 1) ids are sparse labels");
    mpt_dataset_destroy(d);
    y = tensor(MPT_FLOAT32, 2, 6, 2, 0, yf);
    CHECK(create(ctx, &x, &y, 0, &d) == MPT_OK, "float targets: %s", mpt_context_error(ctx));
    CHECK(d && mpt__dataset_label_dtype(d) == MPT_FLOAT32 && d->y_count == 2 &&
              !mpt__dataset_label_range(d, NULL, NULL), "float targets' label queries");
    mpt_dataset_destroy(d);
    y = tensor(MPT_FLOAT32, 1, 6, 0, 0, yf);
    CHECK(create(ctx, &x, &y, 0, &d) == MPT_OK, "(n,) float targets: %s", mpt_context_error(ctx));
    CHECK(d && mpt__dataset_label_dtype(d) == MPT_FLOAT32 && d->y_count == 1 &&
              mpt__dataset_label_shape(d, NULL) == 0, "(n,) float targets: one number a sample");
    mpt_dataset_destroy(d);
    test__end("create: valid x and y of each kind");

    test__begin();
    y = tensor(MPT_INT32, 1, 6, 0, 0, yi);
    x = tensor(MPT_FLOAT32, 2, 6, 4, 0, xf);
    xf[13] = NAN;
    expect_error(create(q, &x, &y, 0, &d), MPT_ERR_NUMERIC, "NaN in float32 x", "sample 3",
                 "nan", "x");
    xf[13] = 3.25f;
    xf[23] = -INFINITY;
    expect_error(create(q, &x, &y, 0, &d), MPT_ERR_NUMERIC, "-inf in float32 x", "sample 5",
                 "-inf", NULL);
    xf[23] = 5.75f;
    x = tensor(MPT_FLOAT16, 2, 6, 4, 0, xh);
    xh[4] = 0x7c00; /* +inf */
    expect_error(create(q, &x, &y, 0, &d), MPT_ERR_NUMERIC, "inf in float16 x", "sample 1",
                 "inf", "float16");
    xh[4] = mpt_float_to_half(1.0f);
    x = tensor(MPT_BFLOAT16, 2, 6, 4, 0, xb);
    xb[0] = 0x7fc1; /* NaN */
    expect_error(create(q, &x, &y, 0, &d), MPT_ERR_NUMERIC, "NaN in bfloat16 x", "sample 0",
                 "bfloat16", NULL);
    /* The largest finite values are fine, and a bfloat16 is not judged by
       float16's exponent (2^121 has bfloat16 bits 0x7c00: float16's inf). */
    xb[0] = 0x7c00;
    xb[1] = 0x7f7f;
    xb[2] = 0xff7f;
    expect_created(q, &x, &y, "finite bfloat16 extremes");
    x = tensor(MPT_FLOAT16, 2, 6, 4, 0, xh);
    xh[0] = 0x7bff;
    xh[1] = 0xfbff;
    expect_created(q, &x, &y, "finite float16 extremes");
    x = tensor(MPT_FLOAT32, 2, 6, 4, 0, xf);
    xf[0] = 3.4028235e38f;
    expect_created(q, &x, &y, "FLT_MAX");
    d = NULL;
    y = tensor(MPT_FLOAT32, 2, 6, 2, 0, yf);
    yf[9] = NAN;
    expect_error(create(q, &x, &y, 0, &d), MPT_ERR_NUMERIC, "NaN in y", "y sample 4", NULL, NULL);
    yf[9] = 9;
    CHECK(d == NULL, "out set on failure");
    test__end("create: NaN and inf in x or y name the sample");

    test__begin();
    x = tensor(MPT_FLOAT32, 2, 6, 4, 0, xf);
    y = tensor(MPT_INT32, 1, 5, 0, 0, yi);
    expect_error(create(q, &x, &y, 0, &d), MPT_ERR_SHAPE, "count mismatch", "6 samples",
                 "has 5", NULL);
    test__end("create: x and y counts differ");

    test__begin();
    y = tensor(MPT_INT32, 1, 6, 0, 0, yi);
    x = tensor(MPT_FLOAT32, 1, 6, 0, 0, xf);
    expect_error(create(q, &x, &y, 0, &d), MPT_ERR_SHAPE, "x rank 1", "(6,)", "rank >= 2",
                 NULL);
    x = tensor(MPT_INT32, 2, 6, 4, 0, xf); /* token ids, for a model of int32 input */
    expect_created(q, &x, &y, "x int32");
    x = tensor(MPT_INT8, 2, 6, 4, 0, xf);
    expect_error(create(q, &x, &y, 0, &d), MPT_ERR_DTYPE, "x int8", "int8", NULL, NULL);
    x = tensor((mpt_dtype)99, 2, 6, 4, 0, xf);
    expect_error(create(q, &x, &y, 0, &d), MPT_ERR_DTYPE, "x dtype 99", "99", NULL, NULL);
    x = tensor(MPT_FLOAT32, 2, 6, 0, 0, xf);
    expect_error(create(q, &x, &y, 0, &d), MPT_ERR_SHAPE, "x (6, 0)", "(6, 0)", NULL, NULL);
    x = tensor(MPT_FLOAT32, 5, 6, 4, 1, xf);
    expect_error(create(q, &x, &y, 0, &d), MPT_ERR_SHAPE, "x rank 5", "rank 5", NULL, NULL);
    x = tensor(MPT_FLOAT32, 2, 6, 4, 0, NULL);
    expect_error(create(q, &x, &y, 0, &d), MPT_ERR_INVALID_ARGUMENT, "x NULL data", "x",
                 "NULL data", NULL);
    x = tensor(MPT_FLOAT32, 4, 6, (int64_t)1 << 40, (int64_t)1 << 40, xf);
    x.shape[3] = 1 << 20;
    expect_error(create(q, &x, &y, 0, &d), MPT_ERR_OVERFLOW, "x huge", "too large", NULL, NULL);
    test__end("create: bad x ranks, dtypes, shapes, data");

    test__begin();
    x = tensor(MPT_FLOAT32, 2, 6, 4, 0, xf);
    { /* int32 (6, 3): a class id for each of a sample's 3 positions */
        int32_t yp[6 * 3], back[3 * 3], lo = -1, hi = -1;
        for (i = 0; i < 6 * 3; i++) yp[i] = i % 5;
        yp[7] = 9;
        y = tensor(MPT_INT32, 2, 6, 3, 0, yp);
        CHECK(create(ctx, &x, &y, 0, &d) == MPT_OK, "(6, 3) class ids: %s", mpt_context_error(ctx));
        CHECK(d && d->y_count == 3 && mpt__dataset_label_shape(d, NULL) == 1,
              "(6, 3) class ids: 3 positions a sample");
        if (d) {
            mpt__dataset_label_range(d, &lo, &hi);
            CHECK(lo == 0 && hi == 9, "(6, 3) class ids range over %d..%d, not 0..9", (int)lo,
                  (int)hi);
            CHECK(mpt_dataset_labels(ctx, d, 2, 3, back) == MPT_OK &&
                      !memcmp(back, yp + 2 * 3, sizeof back),
                  "(6, 3) class ids: samples 2..4's, every position");
        }
        mpt_dataset_destroy(d);
        yp[16] = -1;
        expect_error(create(q, &x, &y, 0, &d), MPT_ERR_INVALID_ARGUMENT, "negative label at a "
                     "position", "sample 5", "-1", NULL);
    }
    y = tensor(MPT_FLOAT16, 2, 6, 1, 0, xh);
    expect_error(create(q, &x, &y, 0, &d), MPT_ERR_DTYPE, "y float16", "float16", NULL, NULL);
    y = tensor(MPT_UINT8, 1, 6, 0, 0, yi);
    expect_error(create(q, &x, &y, 0, &d), MPT_ERR_DTYPE, "y uint8", "uint8", NULL, NULL);
    yi[2] = -3;
    y = tensor(MPT_INT32, 1, 6, 0, 0, yi);
    expect_error(create(q, &x, &y, 0, &d), MPT_ERR_INVALID_ARGUMENT, "negative label",
                 "sample 2", "-3", NULL);
    yi[2] = 2;
    test__end("create: bad y ranks, dtypes, labels");

    test__begin();
    y = tensor(MPT_INT32, 1, 6, 0, 0, yi);
    expect_error(mpt_dataset_create(q, NULL, &d), MPT_ERR_INVALID_ARGUMENT, "NULL desc",
                 "descriptor", NULL, NULL);
    expect_error(create(q, NULL, &y, 0, &d), MPT_ERR_INVALID_ARGUMENT, "NULL x", "NULL x", NULL,
                 NULL);
    expect_error(create(q, &x, &y, 0, NULL), MPT_ERR_INVALID_ARGUMENT, "NULL out", "out", NULL,
                 NULL);
    CHECK(create(NULL, &x, &y, 0, &d) == MPT_ERR_INVALID_ARGUMENT, "NULL ctx");
    {
        mpt_dataset_desc desc;
        memset(&desc, 0, sizeof desc);
        desc.x = &x;
        desc.y = &y;
        desc.scale = INFINITY;
        expect_error(mpt_dataset_create(q, &desc, &d), MPT_ERR_NUMERIC, "inf scale", "scale",
                     NULL, NULL);
    }
    CHECK(mpt_dataset_count(NULL) == 0 && mpt_dataset_sample_shape(NULL, NULL) == 0, "NULL d");
    mpt_dataset_destroy(NULL);
    test__end("create: NULL arguments, a non-finite scale");
}

/* A dataset of inputs alone (y NULL), Keras' model.predict(x): predict
   gives what it gives with the labels beside the inputs, bit for bit, on
   the whole and on split views; mpt_model_predict_tensor the same from the
   tensor; fit, evaluate and the labels refuse it, saying why. */
static void test_inputs_alone(void) {
    static float xs[30 * 5];
    static int32_t ys[30];
    mpt_tensor x = tensor(MPT_FLOAT32, 2, 30, 5, 0, xs), y = tensor(MPT_INT32, 1, 30, 0, 0, ys);
    mpt_tensor want, got, head_out, tail_out;
    mpt_dataset *labelled = NULL, *alone = NULL, *head = NULL, *tail = NULL;
    mpt_model *m = NULL;
    mpt_logs logs;
    int32_t label;
    int i;
    for (i = 0; i < 30 * 5; i++) xs[i] = (float)test_uniform(-1, 1);
    for (i = 0; i < 30; i++) ys[i] = i % 3;
    memset(&want, 0, sizeof want);
    memset(&got, 0, sizeof got);
    memset(&head_out, 0, sizeof head_out);
    memset(&tail_out, 0, sizeof tail_out);
    CHECK(create(q, &x, &y, 0, &labelled) == MPT_OK && create(q, &x, NULL, 0, &alone) == MPT_OK,
          "create: %s", mpt_context_error(q));
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {5}, .input_rank = 1, .seed = 3}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 7, .activation = MPT_ACT_RELU});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3, .activation = MPT_ACT_SOFTMAX});
    mpt_model_compile(m, &(mpt_compile_desc){
                             .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY}});
    if (labelled && alone) {
        CHECK(mpt_model_fit(m, labelled, &(mpt_fit_desc){.epochs = 1, .batch_size = 8}) ==
                  MPT_OK,
              "fit: %s", mpt_context_error(q));
        CHECK(mpt_model_predict(m, labelled, 8, &want) == MPT_OK &&
                  mpt_model_predict(m, alone, 8, &got) == MPT_OK,
              "predict: %s", mpt_context_error(q));
        CHECK(got.data && want.data && got.shape[0] == 30 && got.shape[1] == 3 &&
                  !memcmp(got.data, want.data, mpt_tensor_bytes(&want)),
              "predict on inputs alone differs from predict with the labels");
        mpt_tensor_free(q, &got);
        CHECK(mpt_model_predict_tensor(m, &x, 8, &got) == MPT_OK && got.data &&
                  !memcmp(got.data, want.data, mpt_tensor_bytes(&want)),
              "predict_tensor: %s", mpt_context_error(q));
        CHECK(mpt_dataset_split(q, alone, 11, &head, &tail) == MPT_OK &&
                  mpt_model_predict(m, head, 4, &head_out) == MPT_OK &&
                  mpt_model_predict(m, tail, 4, &tail_out) == MPT_OK && head_out.data &&
                  tail_out.data &&
                  !memcmp(head_out.data, want.data, mpt_tensor_bytes(&head_out)) &&
                  !memcmp(tail_out.data, (const float *)want.data + 11 * 3,
                          mpt_tensor_bytes(&tail_out)),
              "predict on split views of inputs alone: %s", mpt_context_error(q));
        test_expect_error(q, mpt_model_fit(m, alone, &(mpt_fit_desc){.epochs = 1, .batch_size = 8}),
                          MPT_ERR_INVALID_ARGUMENT, "fit: the dataset holds inputs alone", "fit");
        test_expect_error(q, mpt_model_fit(m, labelled, &(mpt_fit_desc){
                                                            .epochs = 1,
                                                            .batch_size = 8,
                                                            .validation_data = alone}),
                          MPT_ERR_INVALID_ARGUMENT, "validation data: the dataset holds inputs "
                          "alone", "fit with validation_data");
        test_expect_error(q, mpt_model_evaluate(m, alone, NULL, &logs), MPT_ERR_INVALID_ARGUMENT,
                          "evaluate: the dataset holds inputs alone", "evaluate");
        test_expect_error(q, mpt_dataset_labels(q, alone, 0, 1, &label), MPT_ERR_STATE,
                          "labels: the dataset holds inputs alone", "labels");
        CHECK(mpt_dataset_target_shape(alone, NULL) == 0, "a target shape for inputs alone");
    }
    test_expect_error(q, mpt_model_predict_tensor(m, NULL, 8, &got), MPT_ERR_INVALID_ARGUMENT,
                      "predict: NULL x", "predict_tensor NULL x");
    mpt_tensor_free(q, &want);
    mpt_tensor_free(q, &got);
    mpt_tensor_free(q, &head_out);
    mpt_tensor_free(q, &tail_out);
    mpt_dataset_destroy(head);
    mpt_dataset_destroy(tail);
    mpt_dataset_destroy(alone);
    mpt_dataset_destroy(labelled);
    mpt_model_destroy(m);
}

/* copy = 1 keeps its own copy; copy = 0 reads the caller's arrays. */
static void test_create_copy(void) {
    float xf[4 * 3];   /* (4, 3) */
    int32_t yi[4] = {3, 1, 4, 1};
    mpt_tensor x = tensor(MPT_FLOAT32, 2, 4, 3, 0, xf), y = tensor(MPT_INT32, 1, 4, 0, 0, yi);
    mpt_dataset *copied = NULL, *borrowed = NULL;
    float got[3];
    int32_t label;
    int64_t i3 = 3;
    int32_t lo = -1, hi = -1;
    int i;
    for (i = 0; i < 12; i++) xf[i] = (float)i;
    CHECK(create(ctx, &x, &y, 1, &copied) == MPT_OK, "%s", mpt_context_error(ctx));
    CHECK(create(ctx, &x, &y, 0, &borrowed) == MPT_OK, "%s", mpt_context_error(ctx));
    CHECK(mpt__dataset_label_range(copied, &lo, &hi) && lo == 1 && hi == 4, "range %d..%d",
          (int)lo, (int)hi);
    xf[9] = 100.0f;
    yi[3] = 7;
    mpt__dataset_gather(ctx, copied, &i3, 1, MPT_FLOAT32, got, &label);
    CHECK(got[0] == 9.0f && label == 1, "the copy changed with the caller's array");
    mpt__dataset_gather(ctx, borrowed, &i3, 1, MPT_FLOAT32, got, &label);
    CHECK(got[0] == 100.0f && label == 7, "the borrowed dataset did not see the change");
    CHECK(mpt__dataset_label_range(copied, &lo, &hi) && lo == 1 && hi == 4,
          "the copy's range became %d..%d", (int)lo, (int)hi);
    CHECK(mpt__dataset_label_range(borrowed, &lo, &hi) && lo == 1 && hi == 7,
          "the borrowed labels' range is %d..%d, not the edited 1..7", (int)lo, (int)hi);
    mpt_dataset_destroy(copied);
    mpt_dataset_destroy(borrowed);
}

/* Borrowed class ids edited between two fits: the second fit (and
   evaluate) sees the edited ids and refuses one past the model's classes,
   rather than having the loss and the metrics read past a prediction's
   row. */
static void test_borrowed_labels_edited(void) {
    float xf[8 * 3];
    int32_t yi[8] = {0, 1, 2, 3, 4, 0, 1, 2};
    mpt_tensor x = tensor(MPT_FLOAT32, 2, 8, 3, 0, xf), y = tensor(MPT_INT32, 1, 8, 0, 0, yi);
    mpt_dataset *d = NULL;
    mpt_model *m = NULL;
    mpt_fit_desc fit = {0};
    mpt_logs logs;
    int i;
    for (i = 0; i < 24; i++) xf[i] = (float)((i * 7) % 11) / 11.0f;
    fit.epochs = 1;
    fit.batch_size = 4;
    CHECK(create(q, &x, &y, 0, &d) == MPT_OK, "%s", mpt_context_error(q));
    CHECK(mpt_model_create(q, &(mpt_model_desc){ .input_shape = { 3 }, .input_rank = 1,
                                                 .seed = 1 }, &m) == MPT_OK &&
          mpt_model_add_dense(m, &(mpt_dense_desc){ .units = 5,
                                                    .activation = MPT_ACT_SOFTMAX }) == MPT_OK &&
          mpt_model_compile(m, &(mpt_compile_desc){
              .optimizer = { .type = MPT_OPTIMIZER_SGD, .learning_rate = 0.1f },
              .loss = { .type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY },
              .metrics = MPT_METRIC_ACCURACY }) == MPT_OK,
          "model: %s", mpt_context_error(q));
    CHECK(mpt_model_fit(m, d, &fit) == MPT_OK, "first fit: %s", mpt_context_error(q));
    yi[6] = 5; /* the model has classes 0..4 */
    expect_error(mpt_model_fit(m, d, &fit), MPT_ERR_INVALID_ARGUMENT, "fit after the edit",
                 "labels range over 0..5", "5 classes", NULL);
    expect_error(mpt_model_evaluate(m, d, NULL, &logs), MPT_ERR_INVALID_ARGUMENT,
                 "evaluate after the edit", "0..5", NULL, NULL);
    yi[6] = -1;
    expect_error(mpt_model_fit(m, d, &fit), MPT_ERR_INVALID_ARGUMENT, "a negative id",
                 "labels range over -1..4", NULL, NULL);
    yi[6] = 1;
    CHECK(mpt_model_fit(m, d, &fit) == MPT_OK, "fit after the edit was undone: %s",
          mpt_context_error(q));
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
}

/* ---- split views ------------------------------------------------------------ */

static void test_split(void) {
    uint8_t xu[10 * 2 * 3]; /* (10, 2, 3) */
    int32_t yi[10] = {5, 0, 1, 9, 2, 8, 3, 3, 4, 6};
    mpt_tensor x = tensor(MPT_UINT8, 3, 10, 2, 3, xu), y = tensor(MPT_INT32, 1, 10, 0, 0, yi);
    mpt_dataset *d = NULL, *head = NULL, *tail = NULL, *tt = NULL, *th = NULL;
    float a[6], b[6];
    int32_t la = -1, lb = -2, lo = -1, hi = -1;
    int64_t i, j, shape[3];
    int bad = 0;
    test__begin();
    for (i = 0; i < 60; i++) xu[i] = (uint8_t)(i * 4);
    CHECK(create(ctx, &x, &y, 1, &d) == MPT_OK, "%s", mpt_context_error(ctx));
    CHECK(mpt_dataset_split(ctx, d, 7, &head, &tail) == MPT_OK, "%s", mpt_context_error(ctx));
    CHECK(mpt_dataset_count(head) == 7 && mpt_dataset_count(tail) == 3, "counts %lld + %lld",
          (long long)mpt_dataset_count(head), (long long)mpt_dataset_count(tail));
    CHECK(mpt_dataset_sample_shape(tail, shape) == 2 && shape[0] == 2 && shape[1] == 3,
          "the view's sample shape");
    for (i = 0; i < 10; i++) {
        const mpt_dataset *v = i < 7 ? head : tail;
        j = i < 7 ? i : i - 7;
        mpt__dataset_gather(ctx, d, &i, 1, MPT_FLOAT32, a, &la);
        mpt__dataset_gather(ctx, v, &j, 1, MPT_FLOAT32, b, &lb);
        if (memcmp(a, b, sizeof a) != 0 || la != lb) bad++;
    }
    CHECK(bad == 0, "%d samples of the views differ from the parent's", bad);
    CHECK(mpt__dataset_label_range(head, &lo, &hi) && lo == 0 && hi == 9, "head %d..%d", lo, hi);
    CHECK(mpt__dataset_label_range(tail, &lo, &hi) && lo == 3 && hi == 6, "tail %d..%d", lo, hi);
    /* A view of a view; then destroy the root first: the views keep it. */
    CHECK(mpt_dataset_split(ctx, tail, 1, &th, &tt) == MPT_OK, "%s", mpt_context_error(ctx));
    j = 1;
    i = 9;
    mpt__dataset_gather(ctx, d, &i, 1, MPT_FLOAT32, a, &la);
    mpt__dataset_gather(ctx, tt, &j, 1, MPT_FLOAT32, b, &lb);
    CHECK(mpt_dataset_count(tt) == 2 && memcmp(a, b, sizeof a) == 0 && la == lb && lb == 6,
          "a view of a view");
    mpt_dataset_destroy(d);
    mpt_dataset_destroy(tail);
    mpt__dataset_gather(ctx, tt, &j, 1, MPT_FLOAT32, b, &lb);
    CHECK(memcmp(a, b, sizeof a) == 0 && lb == 6, "the view after its root was destroyed");
    mpt_dataset_destroy(th);
    mpt_dataset_destroy(tt);
    mpt_dataset_destroy(head);
    test__end("split: views share the parent's data; any destruction order");

    test__begin();
    d = NULL;
    CHECK(create(ctx, &x, &y, 0, &d) == MPT_OK, "%s", mpt_context_error(ctx));
    head = tail = (mpt_dataset *)&head;
    expect_error(mpt_dataset_split(q, d, 0, &head, &tail), MPT_ERR_INVALID_ARGUMENT, "first 0",
                 "first 0", "10 samples", NULL);
    CHECK(head == NULL && tail == NULL, "outputs not cleared");
    expect_error(mpt_dataset_split(q, d, 10, &head, &tail), MPT_ERR_INVALID_ARGUMENT,
                 "first 10", "first 10", "1..9", NULL);
    expect_error(mpt_dataset_split(q, d, -2, &head, &tail), MPT_ERR_INVALID_ARGUMENT,
                 "first -2", "-2", NULL, NULL);
    expect_error(mpt_dataset_split(q, NULL, 2, &head, &tail), MPT_ERR_INVALID_ARGUMENT,
                 "NULL d", "NULL dataset", NULL, NULL);
    expect_error(mpt_dataset_split(q, d, 2, NULL, NULL), MPT_ERR_INVALID_ARGUMENT,
                 "no outputs", "NULL head and tail", NULL, NULL);
    CHECK(mpt_dataset_split(ctx, d, 4, NULL, &tail) == MPT_OK && mpt_dataset_count(tail) == 6,
          "only the tail");
    mpt_dataset_destroy(tail);
    mpt_dataset_destroy(d);
    test__end("split: bad arguments; one side only");
}

/* ---- reshape; reading labels and targets back -------------------------------- */

/* IDX images (5, 4, 1) become (20,) for a model whose input is (20,): the
   samples gathered are the same bytes, and predict takes them (it refused
   them before). A count that differs, a bad rank or dimension, NULLs fail. */
static void test_reshape(void) {
    static const int64_t flat[1] = {20}, grid[2] = {4, 5}, wrong[1] = {21}, zero[2] = {0, 20},
                         four[4] = {1, 5, 4, 1};
    const char *img, *lab;
    mpt_dataset *d = NULL, *view = NULL;
    mpt_model *m = NULL;
    mpt_tensor out;
    int64_t shape[3], all[12], i;
    float before[12 * 20], after[12 * 20];
    test__begin();
    write_pair("r-img", "r-lab", 12, 5, 4, HAVE_ZLIB, 0, &img, &lab);
    CHECK(mpt_dataset_load_idx(ctx, img, lab, &d) == MPT_OK, "load: %s", mpt_context_error(ctx));
    if (!d) {
        test__end("reshape: IDX images (5, 4, 1) to (20,)");
        return;
    }
    mpt_dataset_split(ctx, d, 3, NULL, &view);
    for (i = 0; i < 12; i++) all[i] = 11 - i;
    mpt__dataset_gather(ctx, d, all, 12, MPT_FLOAT32, before, NULL);
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {20}, .input_rank = 1, .seed = 2}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3});
    CHECK(mpt_model_predict(m, d, 4, &out) == MPT_ERR_SHAPE, "(5, 4, 1) samples for (20,)");
    CHECK(mpt_dataset_reshape(ctx, d, 1, flat) == MPT_OK, "reshape: %s", mpt_context_error(ctx));
    CHECK(mpt_dataset_sample_shape(d, shape) == 1 && shape[0] == 20, "shape after reshape");
    mpt__dataset_gather(ctx, d, all, 12, MPT_FLOAT32, after, NULL);
    CHECK(!memcmp(before, after, sizeof before), "reshape changed the samples");
    CHECK(mpt_model_predict(m, d, 4, &out) == MPT_OK && out.shape[0] == 12,
          "predict after reshape: %s", mpt_context_error(q));
    mpt_tensor_free(q, &out);
    CHECK(mpt_dataset_sample_shape(view, shape) == 3 && shape[0] == 5 && shape[1] == 4,
          "a view split before keeps its shape");
    CHECK(mpt_dataset_reshape(ctx, d, 2, grid) == MPT_OK &&
              mpt_dataset_sample_shape(d, shape) == 2 && shape[0] == 4 && shape[1] == 5,
          "reshape to (4, 5): %s", mpt_context_error(ctx));
    test__end("reshape: IDX images (5, 4, 1) to (20,) and (4, 5)");

    test__begin();
    expect_error(mpt_dataset_reshape(q, d, 1, wrong), MPT_ERR_SHAPE, "21 elements for 20",
                 "(4, 5)", "(21,)", "20 elements");
    expect_error(mpt_dataset_reshape(q, d, 2, zero), MPT_ERR_SHAPE, "(0, 20)", "(0, 20)", NULL,
                 NULL);
    expect_error(mpt_dataset_reshape(q, d, 4, four), MPT_ERR_SHAPE, "rank 4", "rank 4", "1..3",
                 NULL);
    expect_error(mpt_dataset_reshape(q, d, 0, flat), MPT_ERR_SHAPE, "rank 0", "rank 0", NULL,
                 NULL);
    expect_error(mpt_dataset_reshape(q, d, 1, NULL), MPT_ERR_INVALID_ARGUMENT, "NULL shape",
                 "NULL shape", NULL, NULL);
    expect_error(mpt_dataset_reshape(q, NULL, 1, flat), MPT_ERR_INVALID_ARGUMENT, "NULL dataset",
                 "NULL dataset", NULL, NULL);
    CHECK(mpt_dataset_reshape(NULL, d, 1, flat) == MPT_ERR_INVALID_ARGUMENT, "NULL ctx");
    CHECK(mpt_dataset_sample_shape(d, shape) == 2 && shape[0] == 4 && shape[1] == 5,
          "a failed reshape changed the shape");
    mpt_model_destroy(m);
    mpt_dataset_destroy(view);
    mpt_dataset_destroy(d);
    test__end("reshape: element counts that differ, bad ranks, NULLs");
}

/* Class ids of every sample, of a range, of a view; float targets alike;
   each kind refuses the other's function; ranges outside the dataset and
   NULLs fail. */
static void test_labels_and_targets(void) {
    const char *img, *lab;
    mpt_dataset *d = NULL, *tail = NULL, *fd = NULL, *ftail = NULL;
    int32_t labels[40], one = -1;
    float xf[9 * 2], yf[9 * 3], targets[9 * 3];
    mpt_tensor x, y;
    int64_t i, shape[3];
    int bad = 0;
    test__begin();
    write_pair("l-img", "l-lab", 37, 2, 3, 0, HAVE_ZLIB, &img, &lab);
    CHECK(mpt_dataset_load_idx(ctx, img, lab, &d) == MPT_OK, "load: %s", mpt_context_error(ctx));
    if (!d) {
        test__end("labels: all, a range, a view");
        return;
    }
    for (i = 0; i < 40; i++) labels[i] = -7;
    CHECK(mpt_dataset_labels(ctx, d, 0, 37, labels) == MPT_OK, "%s", mpt_context_error(ctx));
    for (i = 0; i < 37; i++) bad += labels[i] != label_at(i);
    CHECK(bad == 0 && labels[37] == -7, "%d labels differ, or more were written", bad);
    CHECK(mpt_dataset_labels(ctx, d, 36, 1, &one) == MPT_OK && one == label_at(36), "the last: %d",
          (int)one);
    CHECK(mpt_dataset_split(ctx, d, 30, NULL, &tail) == MPT_OK, "%s", mpt_context_error(ctx));
    CHECK(mpt_dataset_labels(ctx, tail, 2, 5, labels) == MPT_OK, "%s", mpt_context_error(ctx));
    for (i = 0, bad = 0; i < 5; i++) bad += labels[i] != label_at(32 + i);
    CHECK(bad == 0, "%d labels of the view differ", bad);
    CHECK(mpt_dataset_target_shape(d, shape) == 0, "class ids have target rank 0");
    test__end("labels: all, a range, a view");

    test__begin();
    expect_error(mpt_dataset_labels(q, tail, 0, 8, labels), MPT_ERR_INVALID_ARGUMENT,
                 "8 of a view of 7", "8 samples", "has 7", NULL);
    expect_error(mpt_dataset_labels(q, d, 37, 1, labels), MPT_ERR_INVALID_ARGUMENT,
                 "sample 37 of 37", "sample 37", "0..36", NULL);
    expect_error(mpt_dataset_labels(q, d, -1, 2, labels), MPT_ERR_INVALID_ARGUMENT,
                 "sample -1", "sample -1", NULL, NULL);
    expect_error(mpt_dataset_labels(q, d, 3, -1, labels), MPT_ERR_INVALID_ARGUMENT,
                 "count -1", "-1 samples", NULL, NULL);
    expect_error(mpt_dataset_labels(q, d, 0, INT64_MAX, labels), MPT_ERR_INVALID_ARGUMENT,
                 "a huge count", NULL, NULL, NULL);
    expect_error(mpt_dataset_labels(q, d, 0, 1, NULL), MPT_ERR_INVALID_ARGUMENT, "NULL labels",
                 "NULL labels", NULL, NULL);
    expect_error(mpt_dataset_labels(q, NULL, 0, 1, labels), MPT_ERR_INVALID_ARGUMENT,
                 "NULL dataset", "NULL dataset", NULL, NULL);
    CHECK(mpt_dataset_labels(NULL, d, 0, 1, labels) == MPT_ERR_INVALID_ARGUMENT, "NULL ctx");
    expect_error(mpt_dataset_targets(q, d, 0, 1, targets), MPT_ERR_DTYPE, "targets of class ids",
                 "int32 class ids", "mpt_dataset_labels", NULL);
    test__end("labels: ranges outside the dataset, NULLs, the wrong kind");

    test__begin();
    for (i = 0; i < 18; i++) xf[i] = (float)test_uniform(-1, 1);
    for (i = 0; i < 27; i++) yf[i] = (float)test_uniform(-2, 2);
    x = tensor(MPT_FLOAT32, 2, 9, 2, 0, xf);
    y = tensor(MPT_FLOAT32, 2, 9, 3, 0, yf);
    CHECK(create(ctx, &x, &y, 0, &fd) == MPT_OK, "%s", mpt_context_error(ctx));
    CHECK(mpt_dataset_target_shape(fd, shape) == 1 && shape[0] == 3, "target shape (3,)");
    CHECK(mpt_dataset_targets(ctx, fd, 0, 9, targets) == MPT_OK &&
              !memcmp(targets, yf, sizeof yf), "all targets: %s", mpt_context_error(ctx));
    mpt_dataset_split(ctx, fd, 4, NULL, &ftail);
    CHECK(mpt_dataset_targets(ctx, ftail, 1, 2, targets) == MPT_OK &&
              !memcmp(targets, yf + 5 * 3, 6 * sizeof(float)), "a view's targets: %s",
          mpt_context_error(ctx));
    expect_error(mpt_dataset_labels(q, fd, 0, 1, labels), MPT_ERR_DTYPE, "labels of targets",
                 "float32 targets", "mpt_dataset_targets", NULL);
    expect_error(mpt_dataset_targets(q, fd, 9, 1, targets), MPT_ERR_INVALID_ARGUMENT,
                 "target 9 of 9", "sample 9", NULL, NULL);
    expect_error(mpt_dataset_targets(q, fd, 0, 1, NULL), MPT_ERR_INVALID_ARGUMENT,
                 "NULL targets", "NULL targets", NULL, NULL);
    CHECK(mpt_dataset_target_shape(NULL, shape) == 0, "NULL dataset's target rank");
    test__end("targets: all, a view's range; the wrong kind, a range outside, NULL");
    mpt_dataset_destroy(ftail);
    mpt_dataset_destroy(fd);
    mpt_dataset_destroy(tail);
    mpt_dataset_destroy(d);
}

/* ---- gather ------------------------------------------------------------------ */

static double as_double(mpt_dtype dtype, const void *p, int64_t i) {
    return mpt__load_f32(dtype, p, i);
}

/* uint8 through scale and offset, and every float dtype into every float
   dtype, in any order (repeats too), against the scalar conversions. */
static void test_gather_dtypes(void) {
    static const mpt_dtype floats[3] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    static const mpt_dtype sources[4] = {MPT_UINT8, MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    enum { N = 9, PER = 256 };
    static uint8_t xu[N * PER];
    static float xf[N * PER], yf[N * 2], out[N * PER];
    static mpt_half xh[N * PER];
    static mpt_bf16 xb[N * PER];
    static float ybuf[N * 2];
    const int64_t order[6] = {8, 0, 3, 3, 7, 1};
    int s, t, i, k;
    test_seed(17);
    for (i = 0; i < N * PER; i++) {
        xu[i] = (uint8_t)(i % 256);
        xf[i] = (float)test_uniform(-70000, 70000) * (i % 3 ? 1e-4f : 1.0f);
        xh[i] = mpt_float_to_half(xf[i] * 1e-3f);
        xb[i] = mpt_float_to_bf16(xf[i]);
    }
    for (i = 0; i < N * 2; i++) yf[i] = (float)i - 3.5f;
    for (s = 0; s < 4; s++)
        for (t = 0; t < 3; t++) {
            const void *src = sources[s] == MPT_UINT8 ? (const void *)xu
                              : sources[s] == MPT_FLOAT32 ? (const void *)xf
                              : sources[s] == MPT_FLOAT16 ? (const void *)xh
                                                          : (const void *)xb;
            mpt_tensor x = tensor(sources[s], 3, N, 16, 16, (void *)src);
            mpt_tensor y = tensor(MPT_FLOAT32, 3, N, 1, 2, yf);
            mpt_dataset_desc desc;
            mpt_dataset *d = NULL;
            float scale = 2.0f / 255.0f, offset = -1.0f;
            int64_t bad = 0, bad_y = 0;
            test__begin();
            memset(&desc, 0, sizeof desc);
            desc.x = &x;
            desc.y = &y;
            desc.scale = scale;
            desc.offset = offset;
            CHECK(mpt_dataset_create(ctx, &desc, &d) == MPT_OK, "%s", mpt_context_error(ctx));
            memset(out, 0xff, sizeof out);
            memset(ybuf, 0xff, sizeof ybuf);
            if (d) mpt__dataset_gather(ctx, d, order, 6, floats[t], out, ybuf);
            for (k = 0; d && k < 6; k++) {
                for (i = 0; i < PER; i++) {
                    int64_t at = order[k] * PER + i;
                    double want = sources[s] == MPT_UINT8
                                      ? round_to(floats[t], (double)xu[at] * scale + offset)
                                      : round_to(floats[t], as_double(sources[s], src, at));
                    double got = as_double(floats[t], out, (int64_t)k * PER + i);
                    if (!(got == want)) bad++;
                }
                if (ybuf[2 * k] != yf[2 * order[k]] || ybuf[2 * k + 1] != yf[2 * order[k] + 1])
                    bad_y++;
            }
            CHECK(bad == 0, "%lld elements differ", (long long)bad);
            CHECK(bad_y == 0, "%lld targets differ", (long long)bad_y);
            mpt_dataset_destroy(d);
            test__end("gather: %s x into %s%s", mpt_dtype_name(sources[s]),
                      mpt_dtype_name(floats[t]),
                      sources[s] == MPT_UINT8 ? " (scale 2/255, offset -1)" : "");
        }

    /* The default scale is (float)(1/255), and p·scale is rounded once to
       float32, then to float16, for every byte value p. */
    test__begin();
    {
        uint8_t all[256];
        int32_t labels[256] = {0};
        mpt_half h[256];
        int64_t idx[256];
        mpt_tensor x = tensor(MPT_UINT8, 2, 256, 1, 0, all);
        mpt_tensor y = tensor(MPT_INT32, 1, 256, 0, 0, labels);
        mpt_dataset *d = NULL;
        int bad = 0;
        for (i = 0; i < 256; i++) {
            all[i] = (uint8_t)i;
            idx[i] = i;
        }
        CHECK(create(ctx, &x, &y, 0, &d) == MPT_OK, "%s", mpt_context_error(ctx));
        if (d) mpt__dataset_gather(ctx, d, idx, 256, MPT_FLOAT16, h, NULL);
        for (i = 0; d && i < 256; i++)
            if (h[i] != mpt_float_to_half((float)((double)i * (double)(1.0f / 255.0f)))) bad++;
        CHECK(bad == 0, "%d of 256 byte values differ", bad);
        mpt_dataset_destroy(d);
    }
    test__end("gather: uint8 default scale 1/255 into float16, every byte value");
}

/* uint8 samples into float32 with AVX-512 (16 bytes at a time, a
   sample's last bytes through the table) give the table's bits, the
   portable gather's: samples of 37 bytes (two vectors and a tail of 5),
   every byte value, a scale and offset whose products round. */
static void test_gather_u8_vector(void) {
    enum { N = 9, PER = 37, TAKE = 10 };
    static uint8_t xu[N * PER];
    static float vec[TAKE * PER], plain[TAKE * PER];
    const int64_t order[TAKE] = {8, 0, 4, 4, 2, 1, 3, 5, 6, 7}; /* every sample, one twice */
    mpt_tensor x = tensor(MPT_UINT8, 2, N, PER, 0, xu);
    mpt_dataset_desc desc;
    mpt_dataset *d = NULL;
    int64_t i, bad = 0;
    for (i = 0; i < N * PER; i++) xu[i] = (uint8_t)(7 * i + i / 256);
    memset(&desc, 0, sizeof desc);
    desc.x = &x;
    desc.scale = 1.0f / 3.0f;
    desc.offset = 0.1f;
    CHECK(mpt_dataset_create(ctx, &desc, &d) == MPT_OK, "%s", mpt_context_error(ctx));
    memset(vec, 0xff, sizeof vec);
    memset(plain, 0, sizeof plain);
    if (d) {
        mpt__dataset_gather(ctx, d, order, TAKE, MPT_FLOAT32, vec, NULL);
        mpt__dataset_gather(NULL, d, order, TAKE, MPT_FLOAT32, plain, NULL); /* the table */
    }
    for (i = 0; d && i < TAKE * PER; i++)
        bad += vec[i] != plain[i] || vec[i] != d->u8_f32[xu[order[i / PER] * PER + i % PER]];
    CHECK(d && bad == 0, "%lld of %d values differ from the table's", (long long)bad,
          TAKE * PER);
    mpt_dataset_destroy(d);
}

/* ---- the loader -------------------------------------------------------------- */

typedef struct loader_fixture {
    uint8_t *xu;        /* (n, 3, 5) */
    float *yf;          /* (n, 2, 2) */
    int32_t *yi;        /* (n)       */
    mpt_dataset *d;
    int64_t n;
} loader_fixture;

static void fixture_init(loader_fixture *f, mpt_context *c, int64_t n, int float_targets) {
    mpt_tensor x, y;
    int64_t i;
    mpt_status s;
    memset(f, 0, sizeof *f);
    f->n = n;
    f->xu = (uint8_t *)malloc((size_t)n * 15);
    f->yf = (float *)malloc((size_t)n * 4 * sizeof(float));
    f->yi = (int32_t *)malloc((size_t)n * sizeof(int32_t));
    for (i = 0; i < n * 15; i++) f->xu[i] = (uint8_t)test_next();
    for (i = 0; i < n * 4; i++) f->yf[i] = (float)test_uniform(-1, 1);
    for (i = 0; i < n; i++) f->yi[i] = (int32_t)(test_next() % 10);
    x = tensor(MPT_UINT8, 3, n, 3, 5, f->xu);
    y = float_targets ? tensor(MPT_FLOAT32, 3, n, 2, 2, f->yf)
                      : tensor(MPT_INT32, 1, n, 0, 0, f->yi);
    s = create(c, &x, &y, 0, &f->d);
    CHECK(s == MPT_OK, "fixture: %s", mpt_context_error(c));
}

static void fixture_free(loader_fixture *f) {
    mpt_dataset_destroy(f->d);
    free(f->xu);
    free(f->yf);
    free(f->yi);
}

static void shuffle(int64_t *order, int64_t n) {
    int64_t i;
    for (i = 0; i < n; i++) order[i] = i;
    for (i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)(test_next() % (unsigned long long)(i + 1)), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
}

/* Runs one epoch and compares every batch with a direct gather of the same
   indices; returns the number of batches. */
static int64_t check_epoch(mpt__loader *l, const mpt_dataset *d, const int64_t *order, int64_t n,
                           int64_t bs, mpt_dtype dtype, const char *what) {
    size_t xs = (size_t)d->x_count * mpt_dtype_size(dtype), ys = (size_t)d->y_count * 4;
    void *wx = malloc((size_t)bs * xs), *wy = malloc((size_t)bs * ys);
    mpt_tensor x, y;
    int64_t b = 0, seen = 0, expect_batches = (n + bs - 1) / bs;
    mpt__loader_start_epoch(l, order, n, bs);
    while (mpt__loader_next(l, &x, &y)) {
        int64_t count = n - b * bs < bs ? n - b * bs : bs, k;
        mpt__dataset_gather(ctx, d, order + b * bs, count, dtype, wx, wy);
        CHECK(x.dtype == dtype && x.rank == d->x_rank + 1 && x.shape[0] == count &&
                  !x.owns_data, "%s: batch %lld x is %s rank %d (%lld, ...)", what,
              (long long)b, mpt_dtype_name(x.dtype), x.rank, (long long)x.shape[0]);
        for (k = 0; k < d->x_rank; k++)
            CHECK(x.shape[k + 1] == d->x_shape[k], "%s: x shape[%lld]", what, (long long)k + 1);
        CHECK(y.dtype == d->y_dtype && y.rank == d->y_rank + 1 && y.shape[0] == count,
              "%s: batch %lld y is %s rank %d", what, (long long)b, mpt_dtype_name(y.dtype),
              y.rank);
        for (k = 0; k < d->y_rank; k++)
            CHECK(y.shape[k + 1] == d->y_shape[k], "%s: y shape[%lld]", what, (long long)k + 1);
        CHECK(memcmp(x.data, wx, (size_t)count * xs) == 0, "%s: batch %lld x differs", what,
              (long long)b);
        CHECK(memcmp(y.data, wy, (size_t)count * ys) == 0, "%s: batch %lld y differs", what,
              (long long)b);
        seen += count;
        b++;
        if (b > expect_batches) break;
    }
    CHECK(b == expect_batches && seen == n, "%s: %lld batches of %lld samples, expected %lld",
          what, (long long)b, (long long)seen, (long long)expect_batches);
    CHECK(!mpt__loader_next(l, &x, &y) && !mpt__loader_next(l, &x, &y),
          "%s: a batch after the epoch's end", what);
    free(wx);
    free(wy);
    return b;
}

/* Every batch equals a direct gather, in each dtype, with class ids and
   with float targets; the last batch is partial (103 = 6·16 + 7). */
static void test_loader_batches(void) {
    static const mpt_dtype floats[3] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    int t, ft;
    for (ft = 0; ft < 2; ft++)
        for (t = 0; t < 3; t++) {
            loader_fixture f;
            mpt__loader *l = NULL;
            int64_t order[103];
            test__begin();
            test_seed(100 + (unsigned)t);
            fixture_init(&f, ctx, 103, ft);
            shuffle(order, 103);
            CHECK(mpt__loader_create(ctx, f.d, 16, floats[t], &l) == MPT_OK, "%s",
                  mpt_context_error(ctx));
            if (l) check_epoch(l, f.d, order, 103, 16, floats[t], "shuffled");
            mpt__loader_destroy(l);
            fixture_free(&f);
            test__end("loader: batches of 16 of 103 samples (last 7) into %s, %s",
                      mpt_dtype_name(floats[t]), ft ? "float targets (b, 2, 2)" : "class ids");
        }
}

/* Several epochs with different orders and batch sizes, an epoch
   restarted before its end, an empty epoch, a one-sample dataset. */
static void test_loader_epochs(void) {
    loader_fixture f;
    mpt__loader *l = NULL;
    int64_t order[50], part[20];
    mpt_tensor x, y;
    int e;
    test_seed(7);
    fixture_init(&f, ctx, 50, 0);
    CHECK(mpt__loader_create(ctx, f.d, 12, MPT_FLOAT32, &l) == MPT_OK, "%s",
          mpt_context_error(ctx));
    for (e = 0; l && e < 5; e++) {
        int64_t bs = e == 3 ? 12 : 5 + e;
        char what[64];
        shuffle(order, 50);
        snprintf(what, sizeof what, "epoch %d (batch %lld)", e, (long long)bs);
        check_epoch(l, f.d, order, 50, bs, MPT_FLOAT32, what);
    }
    if (l) {
        /* Stop after two batches, start another epoch at once. */
        mpt__loader_start_epoch(l, order, 50, 10);
        CHECK(mpt__loader_next(l, &x, &y) && mpt__loader_next(l, &x, &y), "two batches");
        shuffle(part, 20);
        check_epoch(l, f.d, part, 20, 12, MPT_FLOAT32, "after a restart");
        check_epoch(l, f.d, part, 0, 12, MPT_FLOAT32, "empty epoch");
        check_epoch(l, f.d, part, 1, 12, MPT_FLOAT32, "one sample");
        check_epoch(l, f.d, part, 12, 12, MPT_FLOAT32, "exactly one full batch");
    }
    CHECK(l && !mpt__loader_next(l, &x, &y), "no batch without an epoch");
    mpt__loader_destroy(l);
    fixture_free(&f);
}

/* Restarting an epoch while the thread is still loading a batch of the
   last one: that load must land before the restart, never in the new
   epoch. Large samples (256 KiB each) keep the thread busy long enough. */
static void test_loader_restart_while_loading(void) {
    enum { N = 16, PER = 1 << 16 };
    float *xf = (float *)malloc(sizeof(float) * N * PER); /* (N, PER) */
    int32_t yi[N];
    int64_t a[N], b[N];
    mpt_tensor x = tensor(MPT_FLOAT32, 2, N, PER, 0, xf), y = tensor(MPT_INT32, 1, N, 0, 0, yi);
    mpt_dataset *d = NULL;
    mpt__loader *l = NULL;
    mpt_tensor bx, by;
    int64_t i;
    int k;
    test_seed(31);
    for (i = 0; i < N * PER; i++) xf[i] = (float)test_uniform(-2, 2);
    for (i = 0; i < N; i++) yi[i] = (int32_t)i;
    CHECK(create(ctx, &x, &y, 0, &d) == MPT_OK, "%s", mpt_context_error(ctx));
    CHECK(d && mpt__loader_create(ctx, d, 4, MPT_FLOAT16, &l) == MPT_OK, "%s",
          mpt_context_error(ctx));
    for (k = 0; l && k < 12; k++) {
        shuffle(a, N);
        shuffle(b, N);
        mpt__loader_start_epoch(l, a, N, 4);
        CHECK(mpt__loader_next(l, &bx, &by), "first batch");
        check_epoch(l, d, b, N, 4, MPT_FLOAT16, "restarted while loading");
    }
    mpt__loader_destroy(l);
    mpt_dataset_destroy(d);
    free(xf);
}

/* Many tiny batches: the hand-over between the threads, again and again. */
static void test_loader_stress(void) {
    loader_fixture f;
    mpt__loader *l = NULL;
    int64_t order[37];
    int e;
    test_seed(3);
    fixture_init(&f, ctx, 37, 1);
    CHECK(mpt__loader_create(ctx, f.d, 3, MPT_BFLOAT16, &l) == MPT_OK, "%s",
          mpt_context_error(ctx));
    for (e = 0; l && e < 60; e++) {
        shuffle(order, 37);
        check_epoch(l, f.d, order, 37, 1 + e % 3, MPT_BFLOAT16, "stress");
    }
    mpt__loader_destroy(l);
    fixture_free(&f);
}

/* Destroying the loader at every point of an epoch: no hang, no leak. */
static void test_loader_destroy_mid_epoch(void) {
    loader_fixture f;
    int64_t order[40];
    int k;
    test_seed(11);
    fixture_init(&f, ctx, 40, 0);
    shuffle(order, 40);
    for (k = -2; k < 6; k++) {
        mpt__loader *l = NULL;
        mpt_tensor x, y;
        int i;
        CHECK(mpt__loader_create(ctx, f.d, 8, MPT_FLOAT16, &l) == MPT_OK, "%s",
              mpt_context_error(ctx));
        if (!l) break;
        if (k >= -1) mpt__loader_start_epoch(l, order, 40, 8); /* k = -2: no epoch at all */
        for (i = 0; i < k; i++) CHECK(mpt__loader_next(l, &x, &y), "batch %d", i);
        mpt__loader_destroy(l);
    }
    mpt__loader_destroy(NULL);
    fixture_free(&f);
}

static void test_loader_no_allocation_per_batch(void) {
    counting_alloc c = {0, 0, -1};
    mpt_context *cc = counting_ctx(&c);
    loader_fixture f;
    mpt__loader *l = NULL;
    mpt_tensor x, y;
    int64_t order[64];
    long before;
    int e, batches = 0;
    test_seed(21);
    fixture_init(&f, cc, 64, 0);
    before = c.allocs;
    CHECK(mpt__loader_create(cc, f.d, 10, MPT_FLOAT16, &l) == MPT_OK, "%s",
          mpt_context_error(cc));
    CHECK(c.allocs - before == 1, "create made %ld allocations, not just itself",
          c.allocs - before);
    before = c.allocs;
    for (e = 0; l && e < 3; e++) {
        shuffle(order, 64);
        mpt__loader_start_epoch(l, order, 64, 10);
        if (e == 0) { /* the first epoch that needs them makes the buffers, once */
            CHECK(c.allocs - before == 1, "%ld allocations to start", c.allocs - before);
            before = c.allocs;
        }
        while (mpt__loader_next(l, &x, &y)) batches++;
    }
    CHECK(batches == 21, "%d batches", batches);
    CHECK(c.allocs == before, "%ld allocations in %d batches", c.allocs - before, batches);
    mpt__loader_destroy(l);
    fixture_free(&f);
    mpt_context_destroy(cc);
    CHECK(c.allocs == c.frees, "%ld allocations, %ld frees", c.allocs, c.frees);
}

/* An epoch of one batch is gathered by the caller (no thread started), and
   with views allowed an in-order epoch of a dataset already in the batch
   dtype points into the dataset; every other epoch still prefetches. The
   batches are the gathered ones in every case. */
static void test_loader_epochs_in_caller(void) {
    enum { N = 40 };
    static float xf[N * 6], yf[N];
    mpt_tensor x = tensor(MPT_FLOAT32, 3, N, 2, 3, xf), y = tensor(MPT_FLOAT32, 1, N, 0, 0, yf);
    mpt_tensor bx, by;
    mpt_dataset *d = NULL, *first = NULL, *rest = NULL;
    mpt__loader *l = NULL;
    int64_t order[N], i;
    test_seed(23);
    for (i = 0; i < N * 6; i++) xf[i] = (float)test_uniform(-2, 2);
    for (i = 0; i < N; i++) yf[i] = (float)test_uniform(-1, 1);
    CHECK(create(ctx, &x, &y, 0, &d) == MPT_OK, "%s", mpt_context_error(ctx));
    CHECK(d && mpt_dataset_split(ctx, d, 7, &first, &rest) == MPT_OK, "%s",
          mpt_context_error(ctx));
    if (!rest) return;
    for (i = 0; i < N; i++) order[i] = i;
    /* no views allowed: in order, one batch: gathered in the caller */
    CHECK(mpt__loader_create(ctx, rest, 40, MPT_FLOAT32, &l) == MPT_OK, "%s",
          mpt_context_error(ctx));
    check_epoch(l, rest, order, N - 7, 40, MPT_FLOAT32, "one batch, copied");
    CHECK(!l->started && l->block, "one batch: thread %d, buffers %p", l->started, l->block);
    CHECK(mpt__loader_start_epoch(l, order, N - 7, 40) == MPT_OK && mpt__loader_next(l, &bx, &by),
          "one batch");
    CHECK(bx.data != rest->x, "a batch points into the dataset without views allowed");
    mpt__loader_destroy(l);
    /* views allowed: in order, several batches, of a split's second part */
    CHECK(mpt__loader_create(ctx, rest, 8, MPT_FLOAT32, &l) == MPT_OK, "%s",
          mpt_context_error(ctx));
    mpt__loader_allow_views(l);
    CHECK(mpt__loader_start_epoch(l, order + 3, 20, 8) == MPT_OK, "%s", mpt_context_error(ctx));
    for (i = 0; mpt__loader_next(l, &bx, &by); i++) {
        CHECK(bx.data == (const float *)rest->x + (3 + 8 * i) * 6 &&
                  by.data == (const float *)rest->y + 3 + 8 * i,
              "view batch %lld does not point at sample %lld", (long long)i, (long long)(3 + 8 * i));
        CHECK(bx.shape[0] == (i < 2 ? 8 : 4) && by.shape[0] == bx.shape[0], "view batch %lld has "
              "%lld samples", (long long)i, (long long)bx.shape[0]);
    }
    CHECK(i == 3 && !l->started && !l->block, "%lld view batches; thread %d, buffers %p",
          (long long)i, l->started, l->block);
    check_epoch(l, rest, order + 3, 20, 8, MPT_FLOAT32, "views");
    /* out of order, or another dtype: prefetched copies, as before */
    shuffle(order, N - 7);
    check_epoch(l, rest, order, N - 7, 8, MPT_FLOAT32, "shuffled, views allowed");
    CHECK(l->started, "a shuffled epoch of 5 batches did not start the thread");
    mpt__loader_destroy(l);
    CHECK(mpt__loader_create(ctx, rest, 8, MPT_FLOAT16, &l) == MPT_OK, "%s",
          mpt_context_error(ctx));
    mpt__loader_allow_views(l);
    for (i = 0; i < N; i++) order[i] = i;
    check_epoch(l, rest, order, N - 7, 8, MPT_FLOAT16, "in order into float16");
    CHECK(l->started, "a float16 epoch of float32 samples came as views");
    mpt__loader_destroy(l);
    mpt_dataset_destroy(first);
    mpt_dataset_destroy(rest);
    mpt_dataset_destroy(d);
    /* a uint8 dataset in its own dtype: the bytes as stored, shuffled and
       prefetched, or in order as views */
    {
        loader_fixture f;
        int64_t b, k, bad = 0;
        fixture_init(&f, ctx, 30, 0);
        shuffle(order, 30);
        CHECK(mpt__loader_create(ctx, f.d, 7, MPT_UINT8, &l) == MPT_OK, "%s",
              mpt_context_error(ctx));
        mpt__loader_allow_views(l);
        for (k = 0; k < 2; k++) {
            if (k == 1)
                for (i = 0; i < 30; i++) order[i] = i;
            CHECK(mpt__loader_start_epoch(l, order, 30, 7) == MPT_OK, "%s", mpt_context_error(ctx));
            for (b = 0; mpt__loader_next(l, &bx, &by); b++)
                for (i = 0; i < bx.shape[0] * 15; i++)
                    bad += ((const uint8_t *)bx.data)[i] != f.xu[order[7 * b + i / 15] * 15 + i % 15];
            CHECK(b == 5 && bx.dtype == MPT_UINT8, "%lld uint8 batches", (long long)b);
        }
        CHECK(bad == 0, "%lld bytes differ from the dataset's", (long long)bad);
        mpt__loader_destroy(l);
        fixture_free(&f);
    }
}

static void test_loader_bad_arguments(void) {
    loader_fixture f;
    mpt__loader *l = NULL;
    mpt_tensor x, y;
    int64_t order[10];
    int i;
    test_seed(1);
    fixture_init(&f, q, 10, 0);
    expect_error(mpt__loader_create(q, f.d, 4, MPT_INT32, &l), MPT_ERR_DTYPE, "int32 batches",
                 "int32", NULL, NULL);
    expect_error(mpt__loader_create(q, f.d, 4, MPT_INT8, &l), MPT_ERR_DTYPE, "int8 batches",
                 "int8", NULL, NULL);
    expect_error(mpt__loader_create(q, f.d, 0, MPT_FLOAT32, &l), MPT_ERR_INVALID_ARGUMENT,
                 "max_batch 0", "max_batch 0", NULL, NULL);
    expect_error(mpt__loader_create(q, NULL, 4, MPT_FLOAT32, &l), MPT_ERR_INVALID_ARGUMENT,
                 "NULL dataset", "dataset", NULL, NULL);
    CHECK(l == NULL, "out set on failure");
    CHECK(mpt__loader_create(q, f.d, 4, MPT_FLOAT32, &l) == MPT_OK, "%s", mpt_context_error(q));
    for (i = 0; i < 10; i++) order[i] = i;
    order[6] = 10;
    if (l) {
        mpt__loader_start_epoch(l, order, 10, 4);
        CHECK(!mpt__loader_next(l, &x, &y), "an epoch with a bad index gave a batch");
        CHECK(strstr(mpt_context_error(q), "order[6] = 10"), "message: %s", mpt_context_error(q));
        order[6] = 6;
        mpt__loader_start_epoch(l, order, 10, 5);
        CHECK(!mpt__loader_next(l, &x, &y), "batch_size 5 > max_batch 4 gave a batch");
        CHECK(strstr(mpt_context_error(q), "batches of 5 (max 4)"), "message: %s",
              mpt_context_error(q));
        mpt__loader_start_epoch(l, order, 10, 4);
        CHECK(mpt__loader_next(l, &x, &y) && x.shape[0] == 4, "a good epoch after bad ones");
    }
    mpt__loader_destroy(l);
    fixture_free(&f);
}

/* Every allocation failing in turn: out of memory reported, nothing leaked. */
static void test_allocation_failures(void) {
    static unsigned char buf[4096];
    const char *img, *lab;
    long k;
    int saw_oom = 0;
    size_t len = idx_images(buf, 0x803, 5, 4, 4);
    img = write_file("o-img.gz", buf, len, HAVE_ZLIB);
    len = idx_labels(buf, 0x801, 5);
    lab = write_file("o-lab", buf, len, 0);
    for (k = 0; k < 12; k++) {
        counting_alloc c = {0, 0, -1};
        mpt_context *cc = counting_ctx(&c);
        mpt_dataset *d = NULL, *h = NULL, *t = NULL;
        mpt__loader *l = NULL;
        mpt_status s;
        float xf[5 * 3] = {0};
        int32_t yi[5] = {0};
        mpt_tensor x = tensor(MPT_FLOAT32, 2, 5, 3, 0, xf), y = tensor(MPT_INT32, 1, 5, 0, 0, yi);
        if (!cc) continue;
        c.fail_after = c.allocs + k; /* the context's own allocations succeed */
        s = mpt_dataset_load_idx(cc, img, lab, &d);
        if (s == MPT_OK) s = mpt_dataset_split(cc, d, 2, &h, &t);
        if (s == MPT_OK) s = mpt__loader_create(cc, t, 2, MPT_FLOAT32, &l);
        mpt__loader_destroy(l);
        mpt_dataset_destroy(h);
        mpt_dataset_destroy(t);
        mpt_dataset_destroy(d);
        if (s == MPT_OK) {
            d = NULL;
            s = create(cc, &x, &y, 1, &d);
            mpt_dataset_destroy(d);
        }
        CHECK(s == MPT_OK || s == MPT_ERR_OUT_OF_MEMORY, "allocation %ld failing gave %s", k,
              mpt_status_string(s));
        saw_oom |= s == MPT_ERR_OUT_OF_MEMORY;
        c.fail_after = -1;
        mpt_context_destroy(cc);
        CHECK(c.allocs == c.frees, "allocation %ld failing: %ld allocs, %ld frees", k, c.allocs,
              c.frees);
    }
    CHECK(saw_oom, "no allocation failure was ever reported");
}

int main(void) {
    mpt_context_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.num_threads = 4;
    if (mpt_context_create(&desc, &ctx) != MPT_OK) return 1;
    q = quiet_ctx();
    snprintf(tmp_dir, sizeof tmp_dir, "/tmp/mpt_test_data_XXXXXX");
    if (!q || !mkdtemp(tmp_dir)) {
        fprintf(stderr, "cannot create a context or %s\n", tmp_dir);
        return 1;
    }
    test_idx_valid();
    TEST_RUN(test_idx_smallest);
    test_idx_truncated();
    TEST_RUN(test_idx_gzip_stream_cut);
    test_idx_gzip_corrupted();
    test_idx_bad_headers();
    TEST_RUN(test_idx_count_mismatch);
    test_idx_trailing_bytes();
    test_idx_gzip_trailing_garbage();
    test_idx_missing();
    TEST_RUN(test_load_mnist_dir);
#ifdef MPT_NO_ZLIB
    TEST_RUN(test_no_zlib);
#endif
    test_fashion_mnist();
    test_create_validation();
    TEST_RUN(test_create_copy);
    TEST_RUN(test_inputs_alone);
    TEST_RUN(test_borrowed_labels_edited);
    test_split();
    test_reshape();
    test_labels_and_targets();
    test_gather_dtypes();
    TEST_RUN(test_gather_u8_vector);
    test_loader_batches();
    TEST_RUN(test_loader_epochs);
    TEST_RUN(test_loader_restart_while_loading);
    TEST_RUN(test_loader_stress);
    TEST_RUN(test_loader_destroy_mid_epoch);
    TEST_RUN(test_loader_no_allocation_per_batch);
    TEST_RUN(test_loader_epochs_in_caller);
    TEST_RUN(test_loader_bad_arguments);
    TEST_RUN(test_allocation_failures);
    remove_tmp_dir(tmp_dir);
    mpt_context_destroy(q);
    mpt_context_destroy(ctx);
    return test_summary("test_data");
}
