/* The strategy tests' data: N_SYN samples of FEATURES floats in CLASSES
   classes, each class lifted along its own feature, the same in every
   process (a fixed seed). Include after helpers.h. */
#ifndef MPT_TEST_BLOBS_H
#define MPT_TEST_BLOBS_H

enum { N_SYN = 200, FEATURES = 6, CLASSES = 3 };

static float blob_x[N_SYN * FEATURES]; /* (N_SYN, FEATURES) */
static int32_t blob_y[N_SYN];          /* (N_SYN)           */

static void make_blobs(void) {
    int i, j;
    test_seed(3);
    for (i = 0; i < N_SYN; i++) {
        blob_y[i] = i % CLASSES;
        for (j = 0; j < FEATURES; j++)
            blob_x[i * FEATURES + j] =
                (float)test_uniform(-0.5, 0.5) + (j == blob_y[i] ? 1.5f : 0.0f);
    }
}

/* A dataset over the arrays (borrowed). */
static mpt_dataset *blobs_in(mpt_context *c) {
    mpt_tensor tx, ty;
    mpt_dataset *d = NULL;
    mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 2, (int64_t[]){N_SYN, FEATURES}, blob_x);
    mpt_tensor_wrap(c, &ty, MPT_INT32, 1, (int64_t[]){N_SYN}, blob_y);
    CHECK(mpt_dataset_create(c, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
          "dataset: %s", mpt_context_error(c));
    return d;
}

#endif
