/* Crossentropy over an output with more than one axis per sample, (N, H, W,
   C) from a Conv2D head: as Keras and PyTorch, one softmax and one loss per
   position over the last (class) axis, the loss the mean over positions
   and samples, and accuracy counted per position. Checked on a model's own
   output (mpt_model_compute_loss, evaluate, fit) against a reference in
   double computed per position, the output gradient against central
   differences of that reference, and bad labels refused with a message.
   The same for a sequence's head: Dense(vocab) over the last axis of (N,
   T, D), which fit trains, alike on one replica and two, and which the
   quantized model refuses by name and shape. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"

#define N 3
#define H 3
#define W 4
#define CIN 2
#define C 5
#define POS (H * W)          /* positions per sample */
#define OUT (N * POS * C)    /* output elements of a batch */

static mpt_context *ctx;

/* ---- the reference, in double, per position ---------------------------------- */

/* Keras 3: from logits −Σ t·log_softmax(z); from probabilities q = p/Σp
   clipped to [1e-7, 1 − 1e-7], −Σ t·log q. The mean over positions. */
static double ref_loss(int from_logits, const double *pred, const double *target, int64_t rows) {
    const double eps = (double)1e-7f, hi = (double)(1.0f - 1e-7f);
    double total = 0;
    int64_t r, k;
    for (r = 0; r < rows; r++) {
        const double *z = pred + r * C, *t = target + r * C;
        double mx = z[0], s = 0, loss = 0;
        for (k = 0; k < C; k++) {
            mx = z[k] > mx ? z[k] : mx;
            s += z[k];
        }
        if (from_logits) {
            double e = 0, lse;
            for (k = 0; k < C; k++) e += exp(z[k] - mx);
            lse = mx + log(e);
            for (k = 0; k < C; k++) loss += t[k] * (lse - z[k]);
        } else {
            for (k = 0; k < C; k++) {
                double q = z[k] / s;
                q = q < eps ? eps : q > hi ? hi : q;
                loss -= t[k] * log(q);
            }
        }
        total += loss;
    }
    return total / (double)rows;
}

/* Keras' accuracy over positions: argmax(pred) == argmax(target). */
static double ref_accuracy(const double *pred, const double *target, int64_t rows) {
    int64_t r, k, hits = 0;
    for (r = 0; r < rows; r++) {
        int64_t guess = 0, truth = 0;
        for (k = 1; k < C; k++) {
            if (pred[r * C + k] > pred[r * C + guess]) guess = k;
            if (target[r * C + k] > target[r * C + truth]) truth = k;
        }
        hits += guess == truth;
    }
    return (double)hits / (double)rows;
}

/* ---- the model ------------------------------------------------------------------ */

/* Conv2D 3×3 'same' to C channels: (N, H, W, CIN) -> (N, H, W, C), ending
   in a softmax over the channels unless it gives logits (softmax 0): the
   Conv2D's own (1) or an Activation layer after it (2). */
static mpt_model *head_model_on(mpt_context *c, int softmax, mpt_loss_type type,
                                int from_logits, mpt_strategy *strategy) {
    mpt_model *m = NULL;
    mpt_compile_desc cd;
    CHECK(mpt_model_create(c, &(mpt_model_desc){.input_shape = {H, W, CIN}, .input_rank = 3,
                                                 .seed = 7, .strategy = strategy}, &m) == MPT_OK,
          "create: %s", mpt_context_error(c));
    if (!m) return NULL;
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = C, .kernel_size = {3, 3},
                                               .padding = MPT_PADDING_SAME,
                                               .bias_initializer = MPT_INIT_GLOROT_UNIFORM,
                                               .activation = softmax == 1 ? MPT_ACT_SOFTMAX
                                                                          : MPT_ACT_NONE});
    if (softmax == 2) mpt_model_add_activation(m, &(mpt_activation_desc){.activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_build(m, 2 * N) == MPT_OK, "build: %s", mpt_context_error(c));
    memset(&cd, 0, sizeof cd);
    cd.optimizer.type = MPT_OPTIMIZER_SGD;
    cd.optimizer.learning_rate = 0.1f;
    cd.loss.type = type;
    cd.loss.from_logits = from_logits;
    cd.metrics = MPT_METRIC_ACCURACY;
    CHECK(mpt_model_compile(m, &cd) == MPT_OK, "compile: %s", mpt_context_error(c));
    return m;
}

static mpt_model *head_model(mpt_context *c, int softmax, mpt_loss_type type, int from_logits) {
    return head_model_on(c, softmax, type, from_logits, NULL);
}

/* The last epoch's value of a history key. */
static void random_input(float *x, int64_t n) {
    int64_t i;
    for (i = 0; i < n * H * W * CIN; i++) x[i] = (float)test_uniform(-2, 2);
}

/* Targets per position: class ids and the same as one-hot (or, soft, a
   random probability row). */
static void random_targets(int32_t *labels, double *target, int64_t rows, int soft) {
    int64_t r, k;
    for (r = 0; r < rows; r++) {
        double sum = 0;
        labels[r] = test_randint(0, C - 1);
        for (k = 0; k < C; k++) {
            target[r * C + k] = soft ? test_uniform(0.05, 1) : (double)(k == labels[r]);
            sum += target[r * C + k];
        }
        for (k = 0; k < C; k++) target[r * C + k] = (float)(target[r * C + k] / sum);
    }
}

/* ---- mpt_model_compute_loss and its output gradient -------------------------------- */

static void test_compute_loss_per_position(void) {
    int sparse, logits;
    test_seed(2401);
    for (sparse = 0; sparse < 2; sparse++)
        for (logits = 0; logits < 2; logits++) {
            mpt_loss_type type = sparse ? MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY
                                        : MPT_LOSS_CATEGORICAL_CROSSENTROPY;
            mpt_model *m = head_model(ctx, logits ? 0 : sparse ? 2 : 1, type, logits);
            float x[N * H * W * CIN], tf[OUT];
            int32_t labels[N * POS];
            double pred[OUT], target[OUT], fd[OUT], got = -1, want, num = 0, den = 0;
            mpt_tensor xb, yb, out, dout;
            mpt_loss_desc d = {.type = type, .from_logits = logits, .grad_scale = 8};
            int64_t i;
            if (!m) return;
            random_input(x, N);
            random_targets(labels, target, N * POS, !sparse);
            for (i = 0; i < OUT; i++) tf[i] = (float)target[i];
            mpt_tensor_wrap(ctx, &xb, MPT_FLOAT32, 4, (int64_t[]){N, H, W, CIN}, x);
            if (sparse)
                mpt_tensor_wrap(ctx, &yb, MPT_INT32, 3, (int64_t[]){N, H, W}, labels);
            else
                mpt_tensor_wrap(ctx, &yb, MPT_FLOAT32, 4, (int64_t[]){N, H, W, C}, tf);
            CHECK(mpt_model_forward(m, &xb, 1, &out) == MPT_OK, "forward: %s",
                  mpt_context_error(ctx));
            for (i = 0; i < OUT; i++) pred[i] = ((const float *)out.data)[i];
            for (i = 0; !logits && i < N * POS; i++) { /* a softmax per position */
                double sum = 0;
                int k;
                for (k = 0; k < C; k++) sum += pred[i * C + k];
                if (fabs(sum - 1) > 1e-5) {
                    CHECK(0, "sparse %d: position %lld's probabilities sum to %.7f", sparse,
                          (long long)i, sum);
                    break;
                }
            }
            CHECK(mpt_model_output_grad(m, &dout) == MPT_OK, "output_grad: %s",
                  mpt_context_error(ctx));
            for (i = 0; i < OUT; i++) ((float *)dout.data)[i] = NAN; /* poisoned */
            CHECK(mpt_model_compute_loss(m, &d, &yb, &got) == MPT_OK, "compute_loss: %s",
                  mpt_context_error(ctx));
            want = ref_loss(logits, pred, target, N * POS);
            CHECK(fabs(got - want) <= 1e-6 * fabs(want), "sparse %d logits %d: loss %.9g, "
                  "per-position reference %.9g", sparse, logits, got, want);
            /* grad_scale · d(loss)/d(output), by central differences in double */
            for (i = 0; i < OUT; i++) {
                double keep = pred[i], h = 1e-6, up, down;
                pred[i] = keep + h;
                up = ref_loss(logits, pred, target, N * POS);
                pred[i] = keep - h;
                down = ref_loss(logits, pred, target, N * POS);
                pred[i] = keep;
                fd[i] = 8 * (up - down) / (2 * h);
                num += (((const float *)dout.data)[i] - fd[i]) * (((const float *)dout.data)[i] - fd[i]);
                den += fd[i] * fd[i];
            }
            CHECK(den > 0 && sqrt(num / den) <= 1e-4, "sparse %d logits %d: output gradient "
                  "off by %.3g (relative norm)", sparse, logits, sqrt(num / den));
            mpt_model_destroy(m);
        }
}

/* ---- evaluate and fit: loss and accuracy over positions --------------------------- */

static void test_evaluate_per_position(void) {
    int sparse, logits;
    test_seed(2402);
    for (sparse = 0; sparse < 2; sparse++)
        for (logits = 0; logits < 2; logits++) {
            enum { n = 2 * N + 1 }; /* two batches of N and one sample */
            mpt_loss_type type = sparse ? MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY
                                        : MPT_LOSS_CATEGORICAL_CROSSENTROPY;
            mpt_model *m = head_model(ctx, !logits, type, logits);
            static float x[n * H * W * CIN], tf[n * POS * C];
            static int32_t labels[n * POS];
            static double pred[n * POS * C], target[n * POS * C];
            mpt_tensor xt, yt, out;
            mpt_dataset *data = NULL;
            mpt_logs logs;
            double loss, acc;
            int64_t i;
            if (!m) return;
            random_input(x, n);
            random_targets(labels, target, n * POS, 0);
            for (i = 0; i < n * POS * C; i++) tf[i] = (float)target[i];
            mpt_tensor_wrap(ctx, &xt, MPT_FLOAT32, 4, (int64_t[]){n, H, W, CIN}, x);
            if (sparse)
                mpt_tensor_wrap(ctx, &yt, MPT_INT32, 3, (int64_t[]){n, H, W}, labels);
            else
                mpt_tensor_wrap(ctx, &yt, MPT_FLOAT32, 4, (int64_t[]){n, H, W, C}, tf);
            CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &xt, .y = &yt}, &data) ==
                      MPT_OK, "dataset: %s", mpt_context_error(ctx));
            if (!data) { mpt_model_destroy(m); return; }
            CHECK(mpt_model_predict(m, data, N, &out) == MPT_OK, "predict: %s",
                  mpt_context_error(ctx));
            for (i = 0; i < n * POS * C; i++) pred[i] = ((const float *)out.data)[i];
            mpt_tensor_free(ctx, &out);
            CHECK(mpt_model_evaluate(m, data, &(mpt_evaluate_desc){.batch_size = N}, &logs) ==
                      MPT_OK, "evaluate: %s", mpt_context_error(ctx));
            loss = mpt_logs_get(&logs, "loss");
            acc = mpt_logs_get(&logs, "accuracy");
            {
                double want = ref_loss(logits, pred, target, n * POS);
                double want_acc = ref_accuracy(pred, target, n * POS);
                CHECK(fabs(loss - want) <= 1e-5 * want, "sparse %d logits %d: evaluate loss "
                      "%.9g, per-position reference %.9g", sparse, logits, loss, want);
                CHECK(fabs(acc - want_acc) <= 1e-12, "sparse %d logits %d: evaluate accuracy "
                      "%.9g, per-position reference %.9g", sparse, logits, acc, want_acc);
            }
            if (sparse) { /* ids (n, H, W, 1), as Keras takes them too: the same */
                mpt_tensor y1;
                mpt_dataset *d1 = NULL;
                mpt_logs l1;
                memset(&l1, 0, sizeof l1);
                mpt_tensor_wrap(ctx, &y1, MPT_INT32, 4, (int64_t[]){n, H, W, 1}, labels);
                CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &xt, .y = &y1}, &d1) ==
                          MPT_OK, "dataset (n, H, W, 1): %s", mpt_context_error(ctx));
                CHECK(d1 && mpt_model_evaluate(m, d1, &(mpt_evaluate_desc){.batch_size = N},
                                               &l1) == MPT_OK,
                      "evaluate on ids (n, H, W, 1): %s", mpt_context_error(ctx));
                CHECK(d1 && mpt_logs_get(&l1, "loss") == loss &&
                          mpt_logs_get(&l1, "accuracy") == acc,
                      "ids (n, H, W, 1): loss %.9g accuracy %.9g, not (n, H, W)'s %.9g %.9g",
                      mpt_logs_get(&l1, "loss"), mpt_logs_get(&l1, "accuracy"), loss, acc);
                mpt_dataset_destroy(d1);
            }
            /* fit learns the positions' classes (a 3×3 conv sees them) */
            {
                mpt_fit_desc f = fit_for(30, N);
                double before = loss;
                f.no_shuffle = 1;
                CHECK(mpt_model_fit(m, data, &f) == MPT_OK, "fit: %s", mpt_context_error(ctx));
                CHECK(mpt_model_evaluate(m, data, &(mpt_evaluate_desc){.batch_size = N}, &logs)
                          == MPT_OK, "evaluate: %s", mpt_context_error(ctx));
                CHECK(mpt_logs_get(&logs, "loss") < 0.8 * before, "sparse %d logits %d: fit "
                      "took the loss from %.4f to only %.4f", sparse, logits, before,
                      mpt_logs_get(&logs, "loss"));
            }
            /* the quantized model's evaluate counts positions alike */
            {
                mpt_model *qm = NULL;
                CHECK(mpt_model_quantize(m, NULL, &qm) == MPT_OK, "quantize: %s",
                      mpt_context_error(ctx));
                if (qm && mpt_model_predict(qm, data, N, &out) == MPT_OK) {
                    double want, want_acc;
                    for (i = 0; i < n * POS * C; i++) pred[i] = ((const float *)out.data)[i];
                    mpt_tensor_free(ctx, &out);
                    want = ref_loss(logits, pred, target, n * POS);
                    want_acc = ref_accuracy(pred, target, n * POS);
                    CHECK(mpt_model_evaluate(qm, data, &(mpt_evaluate_desc){.batch_size = N},
                                             &logs) == MPT_OK, "quantized evaluate: %s",
                          mpt_context_error(ctx));
                    CHECK(fabs(mpt_logs_get(&logs, "loss") - want) <= 1e-5 * want,
                          "sparse %d logits %d: quantized evaluate loss %.9g, per-position "
                          "reference %.9g", sparse, logits, mpt_logs_get(&logs, "loss"), want);
                    CHECK(fabs(mpt_logs_get(&logs, "accuracy") - want_acc) <= 1e-12,
                          "sparse %d logits %d: quantized evaluate accuracy %.9g, per-position "
                          "reference %.9g", sparse, logits, mpt_logs_get(&logs, "accuracy"),
                          want_acc);
                } else {
                    CHECK(0, "quantized predict: %s", mpt_context_error(ctx));
                }
                mpt_model_destroy(qm);
            }
            mpt_dataset_destroy(data);
            mpt_model_destroy(m);
        }
}

/* ---- mirrored replicas: each its share of the batch's samples ---------------------- */

/* one (a replica) and two (on a strategy of 2) fit alike on data, in
   order (f unshuffled): the same loss, and with same_accuracy the same
   accuracy, and the same weights up to the order of the sums (1e-5). The
   dataset and both models are destroyed. */
static void fit_one_and_two(mpt_model *one, mpt_model *two, mpt_dataset *data, mpt_fit_desc f,
                            int same_accuracy) {
    f.no_shuffle = 1;
    if (one && two && data) {
        CHECK(mpt_model_fit(one, data, &f) == MPT_OK, "fit: %s", mpt_context_error(ctx));
        CHECK(mpt_model_fit(two, data, &f) == MPT_OK, "fit mirrored: %s", mpt_context_error(ctx));
        if (same_accuracy)
            CHECK(fabs(history_value(two, "accuracy", -1) - history_value(one, "accuracy", -1)) <=
                      1e-9,
                  "accuracy: 2 replicas %.9g, 1 replica %.9g", history_value(two, "accuracy", -1),
                  history_value(one, "accuracy", -1));
        test_replicas_match(one, two, (const char *const[]){"loss", NULL}, 1e-5);
    }
    mpt_dataset_destroy(data);
    mpt_model_destroy(one);
    mpt_model_destroy(two);
}

/* Two replicas split each batch of 6 samples (72 positions) 3 and 3 and
   weight their gradients by their share of the samples: the same
   training as one replica, the same loss and accuracy in the history. */
static void test_mirrored_per_position(void) {
    enum { n = 2 * N + 1 };
    static float x[n * H * W * CIN];
    static int32_t labels[n * POS];
    static double target[n * POS * C];
    mpt_strategy *st;
    mpt_model *one, *two;
    mpt_tensor xt, yt;
    test_seed(2404);
    random_input(x, n);
    random_targets(labels, target, n * POS, 0);
    st = test_mirrored_strategy(ctx, 2);
    one = head_model(ctx, 1, MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, 0);
    two = head_model_on(ctx, 1, MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, 0, st);
    mpt_tensor_wrap(ctx, &xt, MPT_FLOAT32, 4, (int64_t[]){n, H, W, CIN}, x);
    mpt_tensor_wrap(ctx, &yt, MPT_INT32, 3, (int64_t[]){n, H, W}, labels);
    fit_one_and_two(one, two, test_dataset_of(ctx, &xt, &yt), fit_for(3, 2 * N), 1);
    mpt_strategy_destroy(st);
}

/* ---- a sequence's head: Dense(vocab) on (N, T, D) ------------------------------------ */

#define T 6
#define D 8

/* (T, D) -> Dense(16, gelu_tanh) -> Dense(C, softmax): one distribution
   per position. */
static mpt_model *seq_model(mpt_context *c, mpt_strategy *strategy) {
    mpt_model *m = NULL;
    CHECK(mpt_model_create(c, &(mpt_model_desc){.input_shape = {T, D}, .input_rank = 2,
                                                 .seed = 9, .strategy = strategy}, &m) == MPT_OK,
          "create: %s", mpt_context_error(c));
    if (!m) return NULL;
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_GELU_TANH});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = C, .activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_build(m, 16) == MPT_OK, "build: %s", mpt_context_error(c));
    test_compile_classifier(c, m);
    return m;
}

/* Random positions, each labelled with the largest of its first C
   features: what a per-position head can learn. */
static void seq_data(float *x, int32_t *labels, double *target, int64_t n) {
    int64_t r, k;
    for (r = 0; r < n * T; r++) {
        for (k = 0; k < D; k++) x[r * D + k] = (float)test_uniform(-1, 1);
        labels[r] = 0;
        for (k = 1; k < C; k++)
            if (x[r * D + k] > x[r * D + labels[r]]) labels[r] = (int32_t)k;
        for (k = 0; k < C; k++) target[r * C + k] = k == labels[r];
    }
}

static void test_dense_head_per_position(void) {
    enum { n = 64 };
    static float x[n * T * D];
    static int32_t labels[n * T];
    static double target[n * T * C], pred[n * T * C];
    mpt_model *m = seq_model(ctx, NULL);
    mpt_tensor xt, yt, out;
    mpt_dataset *data = NULL;
    mpt_logs logs;
    mpt_fit_desc f = fit_for(40, 16);
    double before;
    int64_t i;
    test_seed(2405);
    seq_data(x, labels, target, n);
    mpt_tensor_wrap(ctx, &xt, MPT_FLOAT32, 3, (int64_t[]){n, T, D}, x);
    mpt_tensor_wrap(ctx, &yt, MPT_INT32, 2, (int64_t[]){n, T}, labels);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &xt, .y = &yt}, &data) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    if (!m || !data) goto done;
    CHECK(mpt_model_predict(m, data, 16, &out) == MPT_OK && out.rank == 3 && out.shape[1] == T &&
              out.shape[2] == C,
          "predict (n, T, C): %s", mpt_context_error(ctx));
    for (i = 0; i < n * T * C; i++) pred[i] = ((const float *)out.data)[i];
    mpt_tensor_free(ctx, &out);
    CHECK(mpt_model_evaluate(m, data, &(mpt_evaluate_desc){.batch_size = 16}, &logs) == MPT_OK,
          "evaluate: %s", mpt_context_error(ctx));
    before = mpt_logs_get(&logs, "loss");
    CHECK(fabs(before - ref_loss(0, pred, target, n * T)) <= 1e-5 * before,
          "evaluate loss %.9g, per-position reference %.9g", before,
          ref_loss(0, pred, target, n * T));
    CHECK(fabs(mpt_logs_get(&logs, "accuracy") - ref_accuracy(pred, target, n * T)) <= 1e-12,
          "evaluate accuracy %.9g, per-position reference %.9g", mpt_logs_get(&logs, "accuracy"),
          ref_accuracy(pred, target, n * T));
    f.no_shuffle = 1;
    CHECK(mpt_model_fit(m, data, &f) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_evaluate(m, data, &(mpt_evaluate_desc){.batch_size = 16}, &logs) == MPT_OK,
          "evaluate: %s", mpt_context_error(ctx));
    CHECK(mpt_logs_get(&logs, "loss") < 0.5 * before && mpt_logs_get(&logs, "accuracy") > 0.8,
          "fit took the loss from %.4f to only %.4f (accuracy %.3f)", before,
          mpt_logs_get(&logs, "loss"), mpt_logs_get(&logs, "accuracy"));
    printf("# Dense head on (64, %d, %d): loss %.4f -> %.4f, accuracy %.3f after 40 epochs\n", T,
           D, before, mpt_logs_get(&logs, "loss"), mpt_logs_get(&logs, "accuracy"));
done:
    mpt_dataset_destroy(data);
    mpt_model_destroy(m);
}

/* Two replicas train the Dense head as one does. */
static void test_dense_head_mirrored(void) {
    enum { n = 12 };
    static float x[n * T * D];
    static int32_t labels[n * T];
    static double target[n * T * C];
    mpt_strategy *st;
    mpt_model *one, *two;
    mpt_tensor xt, yt;
    test_seed(2406);
    seq_data(x, labels, target, n);
    st = test_mirrored_strategy(ctx, 2);
    one = seq_model(ctx, NULL);
    two = seq_model(ctx, st);
    mpt_tensor_wrap(ctx, &xt, MPT_FLOAT32, 3, (int64_t[]){n, T, D}, x);
    mpt_tensor_wrap(ctx, &yt, MPT_INT32, 2, (int64_t[]){n, T}, labels);
    fit_one_and_two(one, two, test_dataset_of(ctx, &xt, &yt), fit_for(3, 6), 0);
    mpt_strategy_destroy(st);
}

/* The quantized model takes the head, a row a position (test_quantize
   checks its numbers); its files and quantization-aware training take
   Dense on vectors only: refused, by name and shape. */
static void test_dense_head_quantized(void) {
    enum { n = 4 };
    static float x[n * T * D];
    static int32_t labels[n * T];
    static double target[n * T * C];
    mpt_context *q = quiet_ctx();
    mpt_model *m = seq_model(q, NULL), *qm = NULL;
    mpt_tensor xt, yt;
    mpt_dataset *data = NULL;
    mpt_fit_desc f = fit_for(1, n);
    if (!m) return;
    seq_data(x, labels, target, n); /* trained a step: the weights are its own */
    mpt_tensor_wrap(q, &xt, MPT_FLOAT32, 3, (int64_t[]){n, T, D}, x);
    mpt_tensor_wrap(q, &yt, MPT_INT32, 2, (int64_t[]){n, T}, labels);
    CHECK(mpt_dataset_create(q, &(mpt_dataset_desc){.x = &xt, .y = &yt}, &data) == MPT_OK &&
              mpt_model_fit(m, data, &f) == MPT_OK,
          "fit: %s", mpt_context_error(q));
    mpt_dataset_destroy(data);
    CHECK(mpt_model_quantize(m, NULL, &qm) == MPT_OK && qm, "quantize: %s",
          mpt_context_error(q));
    if (qm) {
        test_expect_error(q, mpt_model_export_tflite(qm, "unwritten.tflite", NULL),
                          MPT_ERR_UNSUPPORTED, "Dense 'dense' applies to samples of shape (6, 8)",
                          "export tflite");
        test_expect_error(q, mpt_model_export_onnx(qm, "unwritten.onnx", NULL),
                          MPT_ERR_UNSUPPORTED, "Dense 'dense' applies to samples of shape (6, 8)",
                          "export onnx");
        {
            FILE *f1 = fopen("unwritten.tflite", "rb"), *f2 = fopen("unwritten.onnx", "rb");
            CHECK(!f1 && !f2, "a refused export left a file");
            if (f1) fclose(f1), remove("unwritten.tflite");
            if (f2) fclose(f2), remove("unwritten.onnx");
        }
    }
    mpt_model_destroy(qm);
    test_expect_error(q, mpt_model_quantize_aware(m, NULL), MPT_ERR_UNSUPPORTED,
                      "Dense 'dense' applies to the last axis of samples of shape (6, 8)",
                      "quantize_aware");
    mpt_model_destroy(m);
    mpt_context_destroy(q);
}

/* ---- bad labels ---------------------------------------------------------------------- */

static void test_bad_labels(void) {
    mpt_context *q = quiet_ctx();
    mpt_model *m = head_model(q, 0, MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, 1);
    float x[N * H * W * CIN], tf[N * C];
    int32_t labels[N * POS];
    double target[N * POS * C], loss;
    mpt_tensor xb, yb;
    mpt_dataset *data = NULL;
    mpt_loss_desc d = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY, .from_logits = 1};
    int i;
    test_seed(2403);
    if (!m) return;
    random_input(x, N);
    random_targets(labels, target, N * POS, 0);
    for (i = 0; i < N * C; i++) tf[i] = 0.2f;
    mpt_tensor_wrap(q, &xb, MPT_FLOAT32, 4, (int64_t[]){N, H, W, CIN}, x);
    CHECK(mpt_model_forward(m, &xb, 1, NULL) == MPT_OK, "forward: %s", mpt_context_error(q));
    /* one label per sample, as for a flat output: not one per position */
    mpt_tensor_wrap(q, &yb, MPT_INT32, 1, (int64_t[]){N}, labels);
    test_expect_error(q, mpt_model_compute_loss(m, &d, &yb, &loss), MPT_ERR_SHAPE,
                      "sparse_categorical_crossentropy: target shape (3,)", "labels per sample");
    /* a label out of 0..C−1 at a position */
    labels[N * POS - 2] = C;
    mpt_tensor_wrap(q, &yb, MPT_INT32, 3, (int64_t[]){N, H, W}, labels);
    test_expect_error(q, mpt_model_compute_loss(m, &d, &yb, &loss), MPT_ERR_INVALID_ARGUMENT,
                      "label 5 of sample 2 position 10 is not a class id in 0..4",
                      "label out of range");
    labels[N * POS - 2] = 0;
    /* categorical targets (N, C) for an (N, H, W, C) output */
    d.type = MPT_LOSS_CATEGORICAL_CROSSENTROPY;
    mpt_tensor_wrap(q, &yb, MPT_FLOAT32, 2, (int64_t[]){N, C}, tf);
    test_expect_error(q, mpt_model_compute_loss(m, &d, &yb, &loss), MPT_ERR_SHAPE,
                      "categorical_crossentropy: target shape (3, 5)", "targets per sample");
    /* fit and evaluate on a dataset of one class id per sample */
    mpt_tensor_wrap(q, &yb, MPT_INT32, 1, (int64_t[]){N}, labels);
    CHECK(mpt_dataset_create(q, &(mpt_dataset_desc){.x = &xb, .y = &yb}, &data) == MPT_OK,
          "dataset: %s", mpt_context_error(q));
    if (data) {
        mpt_logs logs;
        mpt_fit_desc f = fit_for(1, N);
        test_expect_error(q, mpt_model_evaluate(m, data, NULL, &logs), MPT_ERR_SHAPE, "(3, 4)",
                          "evaluate on labels per sample");
        test_expect_error(q, mpt_model_fit(m, data, &f), MPT_ERR_SHAPE, "(3, 4)",
                          "fit on labels per sample");
        mpt_dataset_destroy(data);
    }
    mpt_model_destroy(m);
    mpt_context_destroy(q);
}

static void run_cases(void) {
    TEST_RUN(test_compute_loss_per_position);
    TEST_RUN(test_evaluate_per_position);
    TEST_RUN(test_mirrored_per_position);
    TEST_RUN(test_bad_labels);
    TEST_RUN(test_dense_head_per_position);
    TEST_RUN(test_dense_head_mirrored);
    TEST_RUN(test_dense_head_quantized);
}

int main(void) {
    static const test_program p = {.name = "test_xent_positions", .ctx = &ctx, .cases = run_cases};
    return test_main(&p);
}
