/* Token ids in, and the layers that read them: Embedding's and
   PositionEmbedding's gradients against finite differences in double
   precision (repeated ids included), known answers, training that
   repeats bit for bit on 1 and 2 threads, ids outside the table refused
   by fit, evaluate, predict and forward with nothing written out of
   bounds, a float layer fed ids refused at build, int32 datasets batched
   unconverted, a small model that learns the next id of a repeating
   pattern under mixed_float16, model files, the summary, and the export
   and quantization refusing the layers. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "gradcheck.h"
#include <limits.h>

static mpt_context *ctx;
static char tmpdir[512];

static const mpt_policy policies[] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16,
                                      MPT_POLICY_MIXED_BFLOAT16};

/* A model of (t,) int32 ids. */
static mpt_model *ids_model(mpt_context *c, int64_t t, mpt_policy policy) {
    mpt_model *m = NULL;
    CHECK(mpt_model_create(c,
                           &(mpt_model_desc){.input_shape = {t},
                                             .input_rank = 1,
                                             .input_dtype = MPT_INT32,
                                             .policy = policy,
                                             .seed = 11},
                           &m) == MPT_OK,
          "create: %s", mpt_context_error(c));
    return m;
}

static mpt_tensor ids_tensor(int32_t *ids, int64_t n, int64_t t) {
    mpt_tensor x;
    int64_t shape[2];
    shape[0] = n;
    shape[1] = t;
    mpt_tensor_wrap(ctx, &x, MPT_INT32, 2, shape, ids);
    return x;
}

/* ---- the gradient check of a model of ids ------------------------------------

   Like tests/gradcheck.h, for an input of ids (which have no gradient):
   fresh random parameters rounded to the compute dtype, the forward
   against ref (double), then every trainable parameter's gradient of
   Σ r·y, r random, against central differences of the reference. */

/* A parameter's value: uniform in [-1, 1), whatever its name. */
static double uniform_value(const char *name) {
    (void)name;
    return test_uniform(-1, 1);
}

typedef void (*ids_ref_fn)(const int32_t *ids, int64_t batch, double *const *p, double *y);

static void ids_gradcheck(mpt_model *m, const int32_t *ids, int64_t batch, int64_t t,
                          ids_ref_fn ref, const char *label) {
    int n_params = mpt_model_param_count(m), p, n_layers = mpt_model_layer_count(m);
    int64_t out_shape[4], out_count = 1, i, j, n_out;
    mpt_dtype worst = gc_worst_dtype(m), out_dtype = mpt_model_layer_dtype(m, n_layers - 1);
    double *params[8], *y, *y_ref, *r, tol_fwd, tol_grad;
    float *rf, *yf;
    mpt_param_info info[8];
    mpt_tensor x = ids_tensor((int32_t *)ids, batch, t), ty, tr;
    const double h = 1e-6;
    int rank = mpt_model_layer_output_shape(m, n_layers - 1, out_shape);
    for (i = 0; i < rank; i++) out_count *= out_shape[i];
    n_out = batch * out_count;
    gc_tolerance(worst, &tol_fwd, &tol_grad);
    CHECK(n_params <= 8, "%s: %d parameters", label, n_params);
    if (n_params > 8) return;
    gc_fresh_params(m, n_params, worst, uniform_value, info, params);
    y = (double *)calloc((size_t)n_out, sizeof(double));
    y_ref = (double *)calloc((size_t)n_out, sizeof(double));
    r = (double *)calloc((size_t)n_out, sizeof(double));
    rf = (float *)calloc((size_t)n_out, sizeof(float));
    yf = (float *)calloc((size_t)n_out, sizeof(float));
    CHECK(mpt_model_forward(m, &x, 1, &ty) == MPT_OK, "%s: forward: %s", label,
          mpt_context_error(ctx));
    mpt_convert(ctx, MPT_FLOAT32, yf, ty.dtype, ty.data, n_out);
    for (i = 0; i < n_out; i++) y[i] = yf[i];
    ref(ids, batch, params, y_ref);
    CHECK(rel_err(y, y_ref, n_out) <= tol_fwd, "%s: forward relative error %.3g > %.3g", label,
          rel_err(y, y_ref, n_out), tol_fwd);
    for (i = 0; i < n_out; i++) rf[i] = (float)(r[i] = round_to(out_dtype, test_uniform(-1, 1)));
    {
        int64_t ys[4];
        ys[0] = batch;
        memcpy(ys + 1, out_shape, sizeof(int64_t) * (size_t)rank);
        mpt_tensor_wrap(ctx, &tr, MPT_FLOAT32, rank + 1, ys, rf);
    }
    CHECK(mpt_model_backward(m, &tr, NULL) == MPT_OK, "%s: backward: %s", label,
          mpt_context_error(ctx));
    for (p = 0; p < n_params; p++) {
        int64_t n = mpt_tensor_count(&info[p].value);
        double *num = (double *)calloc((size_t)n, sizeof(double));
        double *lib = (double *)calloc((size_t)n, sizeof(double)), e;
        for (j = 0; j < n; j++) {
            double keep = params[p][j], plus = 0, minus = 0;
            params[p][j] = keep + h;
            ref(ids, batch, params, y);
            for (i = 0; i < n_out; i++) plus += r[i] * y[i];
            params[p][j] = keep - h;
            ref(ids, batch, params, y);
            for (i = 0; i < n_out; i++) minus += r[i] * y[i];
            params[p][j] = keep;
            num[j] = (plus - minus) / (2 * h);
            lib[j] = ((float *)info[p].grad.data)[j];
        }
        e = rel_err(lib, num, n);
        CHECK(e <= tol_grad, "%s: gradient of %s relative error %.3g > %.3g", label, info[p].name,
              e, tol_grad);
        free(num);
        free(lib);
    }
    for (p = 0; p < n_params; p++) free(params[p]);
    free(y);
    free(y_ref);
    free(r);
    free(rf);
    free(yf);
}

/* ---- Embedding → Flatten → Dense(tanh) ------------------------------------------ */

enum { EG_V = 7, EG_D = 4, EG_T = 5, EG_U = 3, EG_B = 6 };

static void embedding_dense_ref(const int32_t *ids, int64_t batch, double *const *p, double *y) {
    int64_t b, t, d, u;
    for (b = 0; b < batch; b++)
        for (u = 0; u < EG_U; u++) {
            double s = p[2][u];
            for (t = 0; t < EG_T; t++)
                for (d = 0; d < EG_D; d++)
                    s += p[0][ids[b * EG_T + t] * EG_D + d] * p[1][(t * EG_D + d) * EG_U + u];
            y[b * EG_U + u] = tanh(s);
        }
}

static void test_embedding_gradients(void) {
    int k;
    for (k = 0; k < 3; k++) {
        mpt_model *m = ids_model(ctx, EG_T, policies[k]);
        int32_t ids[EG_B * EG_T];
        char label[96];
        int i;
        test__begin();
        /* 30 ids over 7 rows: rows repeat within a sample and across the
           batch; row 6 is left out, so its gradient must be zeros */
        for (i = 0; i < EG_B * EG_T; i++) ids[i] = test_randint(0, EG_V - 2);
        ids[1] = ids[3] = ids[9] = 2;
        mpt_model_add_embedding(m, &(mpt_embedding_desc){.input_dim = EG_V, .output_dim = EG_D});
        mpt_model_add_flatten(m, NULL);
        mpt_model_add_dense(m, &(mpt_dense_desc){.units = EG_U, .activation = MPT_ACT_TANH});
        CHECK(mpt_model_build(m, 8) == MPT_OK, "build: %s", mpt_context_error(ctx));
        snprintf(label, sizeof label, "Embedding %s", mpt_policy_name(policies[k]));
        ids_gradcheck(m, ids, EG_B, EG_T, embedding_dense_ref, label);
        {
            mpt_param_info info;
            int d, zero = 1;
            mpt_model_param(m, 0, &info);
            for (d = 0; d < EG_D; d++) zero &= ((float *)info.grad.data)[6 * EG_D + d] == 0;
            CHECK(zero, "%s: the unused row's gradient is not zero", label);
        }
        mpt_model_destroy(m);
        test__end("gradcheck %s", label);
    }
}

/* ---- PositionEmbedding: y = Dense(tanh)(Flatten(x + P[:T])) ---------------------- */

enum { PG_T = 3, PG_D = 4, PG_L = 5, PG_U = 2 };

static void position_ref(const gc_case *c, const double *x, double *const *p, double *y) {
    int64_t b, i, u;
    for (b = 0; b < c->batch; b++)
        for (u = 0; u < PG_U; u++) {
            double s = p[2][u];
            for (i = 0; i < PG_T * PG_D; i++)
                s += (x[b * PG_T * PG_D + i] + p[0][i]) * p[1][i * PG_U + u];
            y[b * PG_U + u] = tanh(s);
        }
}

static void test_position_embedding_gradients(void) {
    int k;
    for (k = 0; k < 3; k++) {
        mpt_model *m = NULL;
        mpt_node x, both[2];
        char label[96];
        test__begin();
        CHECK(mpt_model_create(ctx,
                               &(mpt_model_desc){.input_shape = {PG_T, PG_D},
                                                 .input_rank = 2,
                                                 .policy = policies[k],
                                                 .seed = 3},
                               &m) == MPT_OK,
              "create: %s", mpt_context_error(ctx));
        x = mpt_model_input(m);
        both[0] = x;
        /* sequence_length 5 > T = 3: rows 3 and 4 get no gradient */
        both[1] =
            mpt_position_embedding(m, x, &(mpt_position_embedding_desc){.sequence_length = PG_L});
        mpt_dense(m, mpt_flatten(m, mpt_add(m, 2, both, NULL), NULL),
                  &(mpt_dense_desc){.units = PG_U, .activation = MPT_ACT_TANH});
        CHECK(mpt_model_build(m, 8) == MPT_OK, "build: %s", mpt_context_error(ctx));
        snprintf(label, sizeof label, "PositionEmbedding %s", mpt_policy_name(policies[k]));
        gc_check(ctx,
                 &(gc_case){.model = m, .batch = 5, .training = 1, .ref_forward = position_ref},
                 label);
        {
            mpt_param_info info;
            int i, zero = 1;
            mpt_model_param(m, 0, &info);
            for (i = PG_T * PG_D; i < PG_L * PG_D; i++) zero &= ((float *)info.grad.data)[i] == 0;
            CHECK(zero, "%s: the rows past T have a gradient", label);
        }
        mpt_model_destroy(m);
        test__end("gradcheck %s", label);
    }
}

/* ---- known answers ---------------------------------------------------------------- */

/* Embedding's rows gathered as they are, and its gradient the sum of dy's
   rows per id; PositionEmbedding's first T rows in every sample. */
static void test_known_answer(void) {
    mpt_model *m = ids_model(ctx, 3, MPT_POLICY_FLOAT32);
    int32_t ids[6] = {2, 0, 2, 1, 1, 2};
    float dy[6 * 2] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, want_grad[4 * 2] = {0};
    mpt_param_info table, pos;
    mpt_tensor x = ids_tensor(ids, 2, 3), y, tdy;
    mpt_node e, p2, both[2];
    int64_t dy_shape[3] = {2, 3, 2};
    int i, d;
    e = mpt_embedding(m, mpt_model_input(m),
                      &(mpt_embedding_desc){.input_dim = 4, .output_dim = 2});
    p2 = mpt_position_embedding(m, e, &(mpt_position_embedding_desc){.sequence_length = 4});
    both[0] = e;
    both[1] = p2;
    mpt_add(m, 2, both, NULL);
    CHECK(mpt_model_build(m, 2) == MPT_OK, "build: %s", mpt_context_error(ctx));
    mpt_model_param(m, 0, &table);
    mpt_model_param(m, 1, &pos);
    for (i = 0; i < 8; i++) {
        ((float *)table.value.data)[i] = (float)(10 * (i / 2) + i % 2); /* row r: 10r, 10r+1 */
        ((float *)pos.value.data)[i] = (float)(1000 * (i / 2 + 1));     /* row t: 1000(t+1) */
    }
    mpt_model_refresh_weights(m);
    CHECK(mpt_model_forward(m, &x, 1, &y) == MPT_OK, "forward: %s", mpt_context_error(ctx));
    for (i = 0; i < 6; i++)
        for (d = 0; d < 2; d++) {
            float want = (float)(10 * ids[i] + d + 1000 * (i % 3 + 1));
            CHECK(((float *)y.data)[i * 2 + d] == want, "y[%d][%d] = %g, want %g", i, d,
                  (double)((float *)y.data)[i * 2 + d], (double)want);
        }
    mpt_tensor_wrap(ctx, &tdy, MPT_FLOAT32, 3, dy_shape, dy);
    CHECK(mpt_model_backward(m, &tdy, NULL) == MPT_OK, "backward: %s", mpt_context_error(ctx));
    for (i = 0; i < 6; i++)
        for (d = 0; d < 2; d++) want_grad[ids[i] * 2 + d] += dy[i * 2 + d];
    for (i = 0; i < 8; i++) {
        float want_pos = i < 6 ? dy[i] + dy[6 + i] : 0;
        CHECK(((float *)table.grad.data)[i] == want_grad[i], "embeddings grad[%d] = %g, want %g", i,
              (double)((float *)table.grad.data)[i], (double)want_grad[i]);
        CHECK(((float *)pos.grad.data)[i] == want_pos, "position grad[%d] = %g, want %g", i,
              (double)((float *)pos.grad.data)[i], (double)want_pos);
    }
    mpt_model_destroy(m);
}

/* The CPU kernels themselves, given ids outside the table (-1, rows,
   INT32_MAX, INT32_MIN): zeros forward, nothing backward, and nothing
   read or written outside the buffers (AddressSanitizer). */
static void test_kernels_skip_bad_ids(void) {
    const mpt_backend *be = mpt_context_backend(ctx, NULL);
    int32_t ids[6] = {1, -1, 3, INT32_MAX, 0, INT32_MIN};
    float table[3 * 2] = {1, 2, 3, 4, 5, 6}, y[6 * 2], dtable[3 * 2], dy[6 * 2];
    void *impl = NULL;
    int i;
    be = mpt_context_backend(ctx, &impl);
    for (i = 0; i < 12; i++) y[i] = -7, dy[i] = (float)(i + 1);
    be->gather_rows(impl, MPT_FLOAT32, y, table, 3, 2, ids, 6);
    be->scatter_add_rows(impl, MPT_FLOAT32, dtable, 3, 2, dy, ids, 6);
    for (i = 0; i < 6; i++) {
        int ok = ids[i] >= 0 && ids[i] < 3;
        CHECK(y[2 * i] == (ok ? table[2 * ids[i]] : 0) &&
                  y[2 * i + 1] == (ok ? table[2 * ids[i] + 1] : 0),
              "gather: row %d (id %d) is %g %g", i, ids[i], (double)y[2 * i], (double)y[2 * i + 1]);
    }
    CHECK(dtable[0] == 9 && dtable[1] == 10 && dtable[2] == 1 && dtable[3] == 2 && dtable[4] == 0 &&
              dtable[5] == 0,
          "scatter: %g %g %g %g %g %g", (double)dtable[0], (double)dtable[1], (double)dtable[2],
          (double)dtable[3], (double)dtable[4], (double)dtable[5]);
}

/* ---- a small language model: Embedding → PositionEmbedding + Add → Flatten → Dense -- */

enum { LM_V = 10, LM_T = 6, LM_N = 512 };

/* Samples of a pattern of 4 distinct ids repeated: a b c d a b, whose
   next id is c (the id at position 2). */
static void pattern_data(int32_t *x, int32_t *y, int64_t n) {
    int64_t i;
    int t;
    for (i = 0; i < n; i++) {
        int32_t sym[4];
        int k, j;
        for (k = 0; k < 4; k++) do {
                sym[k] = test_randint(0, LM_V - 1);
                for (j = 0; j < k && sym[j] != sym[k]; j++) continue;
            } while (j < k);
        for (t = 0; t < LM_T; t++) x[i * LM_T + t] = sym[t % 4];
        y[i] = sym[LM_T % 4];
    }
}

static mpt_dataset *ids_dataset(mpt_context *c, int32_t *x, int32_t *y, int64_t n, int64_t t) {
    mpt_tensor tx, ty;
    mpt_tensor_wrap(c, &tx, MPT_INT32, 2, (int64_t[]){n, t}, x);
    mpt_tensor_wrap(c, &ty, MPT_INT32, 1, (int64_t[]){n}, y);
    return test_dataset_of(c, &tx, y ? &ty : NULL);
}

static mpt_model *language_model_on(mpt_context *c, mpt_policy policy, mpt_strategy *strategy) {
    mpt_model *m = NULL;
    mpt_node tok, pos, both[2];
    CHECK(mpt_model_create(c,
                           &(mpt_model_desc){.input_shape = {LM_T},
                                             .input_rank = 1,
                                             .input_dtype = MPT_INT32,
                                             .policy = policy,
                                             .seed = 11,
                                             .strategy = strategy},
                           &m) == MPT_OK,
          "create: %s", mpt_context_error(c));
    tok = mpt_embedding(m, mpt_model_input(m),
                        &(mpt_embedding_desc){.input_dim = LM_V, .output_dim = 16});
    pos = mpt_position_embedding(m, tok, &(mpt_position_embedding_desc){.sequence_length = 8});
    both[0] = tok;
    both[1] = pos;
    mpt_dense(m, mpt_flatten(m, mpt_add(m, 2, both, NULL), NULL),
              &(mpt_dense_desc){.units = LM_V, .activation = MPT_ACT_SOFTMAX});
    test_compile_classifier(c, m);
    return m;
}

static mpt_model *language_model(mpt_context *c, mpt_policy policy) {
    return language_model_on(c, policy, NULL);
}

/* Mirrored over 2 replicas, each its share of the ids: it learns too. */
static void test_mirrored(void) {
    static int32_t x[256 * LM_T], y[256];
    mpt_strategy *st = test_mirrored_strategy(ctx, 2);
    mpt_model *m;
    mpt_dataset *d;
    mpt_logs logs;
    m = language_model_on(ctx, MPT_POLICY_MIXED_FLOAT16, st);
    pattern_data(x, y, 256);
    d = ids_dataset(ctx, x, y, 256, LM_T);
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 15, .batch_size = 32}) == MPT_OK, "fit: %s",
          mpt_context_error(ctx));
    CHECK(mpt_model_evaluate(m, d, NULL, &logs) == MPT_OK, "evaluate: %s", mpt_context_error(ctx));
    CHECK(mpt_logs_get(&logs, "accuracy") >= 0.9, "accuracy %.3f < 0.9",
          mpt_logs_get(&logs, "accuracy"));
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
    mpt_strategy_destroy(st);
}

static void test_learns_pattern(void) {
    static int32_t x[LM_N * LM_T], y[LM_N], vx[128 * LM_T], vy[128];
    mpt_model *m = language_model(ctx, MPT_POLICY_MIXED_FLOAT16);
    mpt_dataset *train, *val;
    mpt_logs logs;
    pattern_data(x, y, LM_N);
    pattern_data(vx, vy, 128);
    train = ids_dataset(ctx, x, y, LM_N, LM_T);
    val = ids_dataset(ctx, vx, vy, 128, LM_T);
    CHECK(mpt_model_fit(m, train, &(mpt_fit_desc){.epochs = 15, .batch_size = 32}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_evaluate(m, val, NULL, &logs) == MPT_OK, "evaluate: %s",
          mpt_context_error(ctx));
    CHECK(mpt_logs_get(&logs, "accuracy") >= 0.95,
          "accuracy on new samples %.3f < 0.95 (loss %.3f)", mpt_logs_get(&logs, "accuracy"),
          mpt_logs_get(&logs, "loss"));
    printf("# mixed_float16 pattern model: held-out accuracy %.3f, loss %.4f\n",
           mpt_logs_get(&logs, "accuracy"), mpt_logs_get(&logs, "loss"));
    mpt_dataset_destroy(train);
    mpt_dataset_destroy(val);
    mpt_model_destroy(m);
}

/* The same training on 1 and 2 threads gives the same bits, in every policy. */
static int32_t threads_x[256 * LM_T], threads_y[256];

static mpt_dataset *threads_data(mpt_context *c) {
    return ids_dataset(c, threads_x, threads_y, 256, LM_T);
}

static void test_threads_bit_identical(void) {
    pattern_data(threads_x, threads_y, 256);
    test_threads_bit_identical_fits(&(test_training){language_model, threads_data, 2, 64});
}

/* ---- ids outside the table ---------------------------------------------------------- */

/* -1, input_dim and INT32_MAX, each placed at sample 2, position 4, make
   fit, evaluate, predict and forward fail naming the layer, the id and
   its place; the model is unchanged. */
static void test_bad_ids(void) {
    static const int32_t bad[3] = {-1, LM_V, INT32_MAX};
    static int32_t x[64 * LM_T], y[64];
    int k;
    pattern_data(x, y, 64);
    for (k = 0; k < 3; k++) {
        mpt_model *m = language_model(ctx, MPT_POLICY_MIXED_FLOAT16);
        mpt_dataset *d;
        mpt_logs logs;
        mpt_tensor out, xt;
        char words[96];
        int32_t keep = x[2 * LM_T + 4];
        float before, after;
        mpt_param_info info;
        test__begin();
        x[2 * LM_T + 4] = bad[k];
        d = ids_dataset(ctx, x, y, 64, LM_T);
        snprintf(words, sizeof words, "Embedding 'embedding' got id %d (sample 2, position 4",
                 (int)bad[k]);
        test_expect_error(ctx, mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1, .batch_size = 16}),
                          MPT_ERR_INVALID_ARGUMENT, words, "fit");
        mpt_model_param(m, 0, &info);
        before = ((float *)info.value.data)[0];
        test_expect_error(ctx, mpt_model_evaluate(m, d, NULL, &logs), MPT_ERR_INVALID_ARGUMENT,
                          words, "evaluate");
        test_expect_error(ctx, mpt_model_predict(m, d, 16, &out), MPT_ERR_INVALID_ARGUMENT, words,
                          "predict");
        xt = ids_tensor(x, 64, LM_T);
        test_expect_error(ctx, mpt_model_predict_tensor(m, &xt, 16, &out), MPT_ERR_INVALID_ARGUMENT,
                          words, "predict_tensor");
        xt = ids_tensor(x, 16, LM_T);
        test_expect_error(ctx, mpt_model_forward(m, &xt, 1, NULL), MPT_ERR_INVALID_ARGUMENT, words,
                          "forward");
        after = ((float *)info.value.data)[0];
        CHECK(before == after, "a refused call changed the weights");
        CHECK(strstr(mpt_context_error(ctx), "0..9 (input_dim 10)") != NULL,
              "the message lacks the range: %s", mpt_context_error(ctx));
        x[2 * LM_T + 4] = keep;
        mpt_dataset_destroy(d);
        mpt_model_destroy(m);
        test__end("id %d refused by fit, evaluate, predict and forward", (int)bad[k]);
    }
}

/* ---- what build and the data checks refuse ---------------------------------------- */

static void test_refusals(void) {
    mpt_model *m;
    mpt_node x;
    int32_t ids[4 * 3] = {0};
    float fx[4 * 3] = {0};
    int32_t y[4] = {0};
    mpt_dataset *d;
    mpt_tensor t;
    /* a Dense straight on the ids */
    m = ids_model(ctx, 3, MPT_POLICY_FLOAT32);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2});
    test_expect_error(ctx, mpt_model_build(m, 4), MPT_ERR_DTYPE,
                      "Dense 'dense' reads the model's "
                      "input, which is int32 token ids",
                      "build: Dense on ids");
    mpt_model_destroy(m);
    /* the ids read by an Embedding and by a Flatten too */
    m = ids_model(ctx, 3, MPT_POLICY_MIXED_FLOAT16);
    x = mpt_model_input(m);
    {
        mpt_node both[2];
        both[0] = mpt_flatten(
            m, mpt_embedding(m, x, &(mpt_embedding_desc){.input_dim = 4, .output_dim = 1}), NULL);
        both[1] = mpt_flatten(m, x, &(mpt_flatten_desc){.name = "ids_flat"});
        mpt_add(m, 2, both, NULL);
    }
    test_expect_error(ctx, mpt_model_build(m, 4), MPT_ERR_DTYPE, "Flatten 'ids_flat'",
                      "build: Flatten beside the Embedding");
    mpt_model_destroy(m);
    /* an Embedding on a model of numbers, and one after another layer */
    CHECK(mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {3}, .input_rank = 1}, &m) ==
              MPT_OK,
          "create");
    mpt_model_add_embedding(m, &(mpt_embedding_desc){.input_dim = 4, .output_dim = 2});
    test_expect_error(ctx, mpt_model_build(m, 4), MPT_ERR_DTYPE, "must be the model's int32",
                      "build: Embedding on numbers");
    mpt_model_destroy(m);
    /* descriptors */
    m = ids_model(ctx, 3, MPT_POLICY_FLOAT32);
    test_expect_error(ctx, mpt_model_add_embedding(m, NULL), MPT_ERR_INVALID_ARGUMENT,
                      "input_dim 0", "embedding NULL");
    test_expect_error(ctx, mpt_model_add_embedding(m, &(mpt_embedding_desc){.input_dim = 4}),
                      MPT_ERR_INVALID_ARGUMENT, "output_dim 0", "embedding output_dim");
    test_expect_error(ctx,
                      mpt_model_add_embedding(
                          m, &(mpt_embedding_desc){.input_dim = (int64_t)1 << 31, .output_dim = 2}),
                      MPT_ERR_INVALID_ARGUMENT, "input_dim 2147483648", "embedding input_dim");
    test_expect_error(ctx,
                      mpt_model_add_embedding(
                          m, &(mpt_embedding_desc){.input_dim = 4,
                                                   .output_dim = 2,
                                                   .embeddings_initializer = MPT_INIT_COUNT_}),
                      MPT_ERR_INVALID_ARGUMENT, "embeddings_initializer", "embedding initializer");
    test_expect_error(ctx, mpt_model_add_position_embedding(m, NULL), MPT_ERR_INVALID_ARGUMENT,
                      "sequence_length 0", "position NULL");
    mpt_model_add_embedding(m, &(mpt_embedding_desc){.input_dim = 4, .output_dim = 2});
    mpt_model_add_position_embedding(m, &(mpt_position_embedding_desc){.sequence_length = 2});
    test_expect_error(ctx, mpt_model_build(m, 4), MPT_ERR_SHAPE, "T <= its sequence_length 2",
                      "position T > sequence_length");
    mpt_model_destroy(m);
    /* input_dtype itself */
    test_expect_error(
        ctx,
        mpt_model_create(
            ctx, &(mpt_model_desc){.input_shape = {3}, .input_rank = 1, .input_dtype = MPT_FLOAT16},
            &m),
        MPT_ERR_DTYPE, "input_dtype float16", "create input_dtype");
    /* a dataset of the other kind, a tensor of the other dtype, and dinput */
    m = ids_model(ctx, 3, MPT_POLICY_FLOAT32);
    mpt_model_add_embedding(m, &(mpt_embedding_desc){.input_dim = 4, .output_dim = 2});
    mpt_model_add_flatten(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2, .activation = MPT_ACT_SOFTMAX});
    mpt_model_compile(
        m, &(mpt_compile_desc){.loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY}});
    d = test_dataset_xy(ctx, fx, y, 4, 3);
    test_expect_error(ctx, mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1, .batch_size = 4}),
                      MPT_ERR_DTYPE, "the dataset's x is float32 but the model's input is int32",
                      "fit: float dataset");
    mpt_dataset_destroy(d);
    {
        int64_t shape[2] = {4, 3};
        mpt_tensor_wrap(ctx, &t, MPT_FLOAT32, 2, shape, fx);
        test_expect_error(ctx, mpt_model_forward(m, &t, 0, NULL), MPT_ERR_DTYPE,
                          "input dtype float32 is not int32", "forward: float tensor");
    }
    t = ids_tensor(ids, 4, 3);
    CHECK(mpt_model_forward(m, &t, 1, NULL) == MPT_OK, "forward: %s", mpt_context_error(ctx));
    {
        mpt_tensor dx;
        test_expect_error(ctx, mpt_model_backward(m, NULL, &dx), MPT_ERR_INVALID_ARGUMENT,
                          "no gradient", "backward: dinput of ids");
        CHECK(mpt_model_backward(m, NULL, NULL) == MPT_OK, "backward: %s", mpt_context_error(ctx));
    }
    mpt_model_destroy(m);
    /* ids for a model of numbers */
    CHECK(mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {3}, .input_rank = 1}, &m) ==
              MPT_OK,
          "create");
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2, .activation = MPT_ACT_SOFTMAX});
    mpt_model_compile(
        m, &(mpt_compile_desc){.loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY}});
    d = ids_dataset(ctx, ids, y, 4, 3);
    test_expect_error(ctx, mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1, .batch_size = 4}),
                      MPT_ERR_DTYPE, "int32 ids need input_dtype MPT_INT32", "fit: ids dataset");
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
}

/* ---- int32 datasets ---------------------------------------------------------------- */

/* The loader batches int32 x as it is: ids past 2^24, which float32
   would round, come out exact, shuffled or in order; a view keeps them. */
static void test_loader_keeps_ids(void) {
    enum { N = 10, T = 3 };
    int32_t x[N * T], y[N];
    int64_t order[N];
    mpt_dataset *d = NULL, *tail = NULL;
    mpt__loader *l = NULL;
    mpt_tensor bx, by;
    int i, seen = 0;
    for (i = 0; i < N * T; i++) x[i] = (1 << 24) + 1 + 2 * i;
    for (i = 0; i < N; i++) y[i] = i, order[i] = (i * 7) % N;
    d = ids_dataset(ctx, x, y, N, T);
    CHECK(mpt__loader_create(ctx, d, 4, MPT_INT32, &l) == MPT_OK, "loader: %s",
          mpt_context_error(ctx));
    CHECK(mpt__loader_start_epoch(l, order, N, 4) == MPT_OK, "epoch: %s", mpt_context_error(ctx));
    while (l && mpt__loader_next(l, &bx, &by)) {
        int64_t b, t;
        CHECK(bx.dtype == MPT_INT32, "batch dtype %s", mpt_dtype_name(bx.dtype));
        for (b = 0; b < bx.shape[0]; b++) {
            int32_t s = ((const int32_t *)by.data)[b];
            for (t = 0; t < T; t++)
                CHECK(((const int32_t *)bx.data)[b * T + t] == x[s * T + t],
                      "sample %d position %d: %d, want %d", (int)s, (int)t,
                      (int)((const int32_t *)bx.data)[b * T + t], (int)x[s * T + t]);
            seen++;
        }
    }
    CHECK(seen == N, "%d samples batched, want %d", seen, N);
    mpt__loader_destroy(l);
    test_expect_error(ctx, mpt__loader_create(ctx, d, 4, MPT_FLOAT32, &l), MPT_ERR_DTYPE,
                      "int32 ids are never converted", "loader to float32");
    CHECK(mpt_dataset_split(ctx, d, 6, NULL, &tail) == MPT_OK, "split: %s", mpt_context_error(ctx));
    CHECK(tail && ((const int32_t *)tail->x)[0] == x[6 * T], "the view's first id");
    mpt_dataset_destroy(tail);
    mpt_dataset_destroy(d);
}

/* An .npy file (format 1.0) of `count` elements of `descr` ("<i8") and
   the given shape; the data as given. */
static void write_npy(const char *path, const char *descr, const char *shape, const void *data,
                      size_t bytes) {
    char header[128];
    unsigned char prefix[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, 0, 0};
    int n = snprintf(header, sizeof header,
                     "{'descr': '%s', 'fortran_order': False, 'shape': %s, }", descr, shape);
    FILE *f = fopen(path, "wb");
    while ((10 + n + 1) % 64) header[n++] = ' ';
    header[n++] = '\n';
    prefix[8] = (unsigned char)n;
    if (!f) return;
    fwrite(prefix, 1, 10, f);
    fwrite(header, 1, (size_t)n, f);
    fwrite(data, 1, bytes, f);
    fclose(f);
}

/* NumPy files of ids: with x_ids, int64 and int32 x come in as int32 ids,
   exact past 2^24; without it as float32, as before; float x and a
   negative id are refused with x_ids. */
static void test_npy_ids(void) {
    int64_t x64[4 * 3];
    int32_t y[4] = {0, 1, 2, 3};
    float xf[4 * 3] = {0};
    char xp[600], yp[600], fp[600];
    mpt_dataset *d = NULL;
    int i;
    for (i = 0; i < 12; i++) x64[i] = (1 << 24) + 1 + i;
    snprintf(xp, sizeof xp, "%s/x.npy", tmpdir);
    snprintf(yp, sizeof yp, "%s/y.npy", tmpdir);
    snprintf(fp, sizeof fp, "%s/xf.npy", tmpdir);
    write_npy(xp, "<i8", "(4, 3)", x64, sizeof x64);
    write_npy(yp, "<i4", "(4,)", y, sizeof y);
    write_npy(fp, "<f4", "(4, 3)", xf, sizeof xf);
    CHECK(mpt_dataset_load_npy(ctx, xp, yp, &(mpt_dataset_npy_desc){.x_ids = 1}, &d) == MPT_OK,
          "load ids: %s", mpt_context_error(ctx));
    if (d) {
        CHECK(d->x_dtype == MPT_INT32, "x is %s", mpt_dtype_name(d->x_dtype));
        for (i = 0; i < 12; i++)
            if (((const int32_t *)d->x)[i] != x64[i]) break;
        CHECK(i == 12, "id %d is %d, want %lld", i, (int)((const int32_t *)d->x)[i],
              (long long)x64[i]);
        mpt_dataset_destroy(d);
    }
    d = NULL;
    CHECK(mpt_dataset_load_npy(ctx, xp, yp, NULL, &d) == MPT_OK, "load numbers: %s",
          mpt_context_error(ctx));
    CHECK(d && d->x_dtype == MPT_FLOAT32, "without x_ids x is not float32");
    mpt_dataset_destroy(d);
    test_expect_error(ctx,
                      mpt_dataset_load_npy(ctx, fp, yp, &(mpt_dataset_npy_desc){.x_ids = 1}, &d),
                      MPT_ERR_DTYPE, "holds floats, not token ids", "load float x as ids");
    x64[7] = -3;
    write_npy(xp, "<i8", "(4, 3)", x64, sizeof x64);
    test_expect_error(ctx,
                      mpt_dataset_load_npy(ctx, xp, yp, &(mpt_dataset_npy_desc){.x_ids = 1}, &d),
                      MPT_ERR_INVALID_ARGUMENT, "element 7 is -3, not a token id", "load a negative id");
}

/* ---- model files, summary, export, quantization ----------------------------------- */

static void test_model_file(void) {
    static int32_t x[64 * LM_T], y[64];
    mpt_model *m = language_model(ctx, MPT_POLICY_MIXED_BFLOAT16), *back = NULL;
    mpt_dataset *d;
    char path[600];
    pattern_data(x, y, 64);
    d = ids_dataset(ctx, x, y, 64, LM_T);
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1, .batch_size = 16}) == MPT_OK, "fit: %s",
          mpt_context_error(ctx));
    snprintf(path, sizeof path, "%s/lm.mpt", tmpdir);
    CHECK(mpt_model_save(m, path) == MPT_OK, "save: %s", mpt_context_error(ctx));
    CHECK(mpt_model_load(ctx, path, &back) == MPT_OK, "load: %s", mpt_context_error(ctx));
    if (back) {
        CHECK(back->desc.input_dtype == MPT_INT32, "the loaded model's input_dtype is %d",
              (int)back->desc.input_dtype);
        CHECK(strcmp(mpt_model_layer_class_name(back, 0), "Embedding") == 0 &&
                  strcmp(mpt_model_layer_class_name(back, 1), "PositionEmbedding") == 0,
              "layers %s %s", mpt_model_layer_class_name(back, 0),
              mpt_model_layer_class_name(back, 1));
        CHECK(back->layers[0].desc.embedding.input_dim == LM_V &&
                  back->layers[0].desc.embedding.output_dim == 16 &&
                  back->layers[1].desc.position_embedding.sequence_length == 8,
              "descriptors not kept");
        test_same_predictions(ctx, m, back, d, 16);
        mpt_model_destroy(back);
    }
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
}

static void test_summary_rows(void) {
    mpt_model *m = language_model(ctx, MPT_POLICY_MIXED_FLOAT16);
    char text[8192];
    CHECK(mpt_model_build(m, 8) == MPT_OK, "build: %s", mpt_context_error(ctx));
    mpt_model_summary(m, text, sizeof text);
    /* Keras' counts: 10 × 16 and 8 × 16 */
    CHECK(strstr(text, "embedding (Embedding)") && strstr(text, " 160 "),
          "no Embedding row of 160 parameters:\n%s", text);
    CHECK(strstr(text, "position_embedding (PositionEmbedding)") && strstr(text, " 128 "),
          "no PositionEmbedding row of 128 parameters:\n%s", text);
    CHECK(test_summary_misaligned(text) == NULL, "%s:\n%s", test_summary_misaligned(text), text);
    mpt_model_destroy(m);
}

/* The float exports take both layers (their files run in LiteRT and ONNX
   Runtime in tests/test_export.c); quantization takes the Embedding in
   dynamic range (float32 rows gathered: tests/test_quantize.c checks the
   numbers), full integer and quantization-aware training refuse it. */
static void test_exported_quantized(void) {
    mpt_model *m = language_model(ctx, MPT_POLICY_FLOAT32);
    char path[600];
    CHECK(mpt_model_build(m, 8) == MPT_OK, "build: %s", mpt_context_error(ctx));
    snprintf(path, sizeof path, "%s/lm.tflite", tmpdir);
    CHECK(mpt_model_export_tflite(m, path, NULL) == MPT_OK, "export TFLite: %s",
          mpt_context_error(ctx));
    remove(path);
    snprintf(path, sizeof path, "%s/lm.onnx", tmpdir);
    CHECK(mpt_model_export_onnx(m, path, NULL) == MPT_OK, "export ONNX: %s",
          mpt_context_error(ctx));
    remove(path);
    mpt_model_destroy(m);
    /* quantization takes chains: Embedding → Flatten → Dense */
    m = ids_model(ctx, 3, MPT_POLICY_FLOAT32);
    mpt_model_add_embedding(m, &(mpt_embedding_desc){.input_dim = 4, .output_dim = 2});
    mpt_model_add_flatten(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2, .activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_build(m, 8) == MPT_OK, "build: %s", mpt_context_error(ctx));
    mpt_model_refresh_weights(m); /* as trained */
    {
        static int32_t ids[4 * 3] = {0, 1, 2, 3, 3, 2, 1, 0, 2, 2, 0, 1};
        mpt_model *q = NULL;
        mpt_dataset *d = NULL;
        mpt_tensor t, a, b;
        mpt_tensor_wrap(ctx, &t, MPT_INT32, 2, (int64_t[]){4, 3}, ids);
        CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &t}, &d) == MPT_OK, "dataset");
        CHECK(mpt_model_quantize(m, NULL, &q) == MPT_OK && q, "quantize: %s",
              mpt_context_error(ctx));
        CHECK(q && mpt_model_predict(m, d, 4, &a) == MPT_OK &&
                  mpt_model_predict(q, d, 4, &b) == MPT_OK,
              "predict: %s", mpt_context_error(ctx));
        if (q) {
            int k;
            for (k = 0; k < 4 * 2; k++)
                CHECK(fabsf(((float *)a.data)[k] - ((float *)b.data)[k]) < 0.02f,
                      "output %d: %g quantized, %g float", k, ((float *)b.data)[k],
                      ((float *)a.data)[k]);
            mpt_tensor_free(ctx, &a), mpt_tensor_free(ctx, &b);
        }
        mpt_model_destroy(q);
        q = NULL;
        test_expect_error(ctx, mpt_model_quantize(m, &(mpt_quantize_desc){
                              .mode = MPT_QUANTIZE_FULL_INTEGER, .representative_data = d}, &q),
                          MPT_ERR_UNSUPPORTED, "'embedding' (Embedding) has no full-integer",
                          "quantize full integer");
        CHECK(q == NULL, "quantize gave a model");
        mpt_dataset_destroy(d);
    }
    test_expect_error(ctx, mpt_model_quantize_aware(m, NULL), MPT_ERR_UNSUPPORTED,
                      "'embedding' (Embedding)", "quantize_aware");
    mpt_model_destroy(m);
}

/* The two initializers Embedding brought: U(−0.05, 0.05) by default, and
   GPT-2's N(0, 0.02²). */
static void test_initializers(void) {
    mpt_model *m = ids_model(ctx, 2, MPT_POLICY_FLOAT32);
    mpt_param_info u, g;
    double lo = 1, hi = -1, sum = 0, sq = 0;
    int64_t i, n;
    mpt_node x = mpt_model_input(m), both[2];
    both[0] = mpt_embedding(m, x, &(mpt_embedding_desc){.input_dim = 100, .output_dim = 50});
    both[1] = mpt_embedding(m, x,
                            &(mpt_embedding_desc){.input_dim = 100,
                                                  .output_dim = 50,
                                                  .embeddings_initializer = MPT_INIT_GPT2_NORMAL});
    mpt_add(m, 2, both, NULL);
    CHECK(mpt_model_build(m, 1) == MPT_OK, "build: %s", mpt_context_error(ctx));
    mpt_model_param(m, 0, &u);
    mpt_model_param(m, 1, &g);
    n = mpt_tensor_count(&u.value);
    for (i = 0; i < n; i++) {
        double v = ((float *)u.value.data)[i], w = ((float *)g.value.data)[i];
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
        sum += w;
        sq += w * w;
    }
    CHECK(lo >= -0.05 && hi <= 0.05 && lo < -0.049 && hi > 0.049, "uniform range %g..%g", lo, hi);
    CHECK(fabs(sum / (double)n) < 0.002 && fabs(sqrt(sq / (double)n) - 0.02) < 0.001,
          "normal mean %g, stddev %g", sum / (double)n, sqrt(sq / (double)n));
    mpt_model_destroy(m);
}

static void cases(void) {
    test_embedding_gradients();
    test_position_embedding_gradients();
    TEST_RUN(test_known_answer);
    TEST_RUN(test_kernels_skip_bad_ids);
    TEST_RUN(test_initializers);
    test_bad_ids();
    TEST_RUN(test_refusals);
    TEST_RUN(test_loader_keeps_ids);
    TEST_RUN(test_npy_ids);
    TEST_RUN(test_model_file);
    TEST_RUN(test_summary_rows);
    TEST_RUN(test_exported_quantized);
    test_threads_bit_identical();
    TEST_RUN(test_learns_pattern);
    TEST_RUN(test_mirrored);
}

int main(void) {
    return test_main(&(test_program){.name = "test_embedding", .ctx = &ctx, .threads = 2,
                                      .logger = quiet_logger, .seed = 17, .tmpdir = tmpdir,
                                      .tmpdir_size = sizeof tmpdir,
                                      .keep_env = "MPT_KEEP_TEST_FILES", .cases = cases});
}
