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
    return test_dataset_xy(c, blob_x, blob_y, N_SYN, FEATURES);
}

#endif
