/* Models of several inputs (Keras' keras.Model(inputs=[img, vec], ...) and
   model.fit([x_img, x_vec], y)): an image branch and a vector branch
   joined by a Concatenate learn a label that needs both; gradients
   through both branches against finite differences in double, in the
   three policies; training that repeats bit for bit on 1 and 2 threads
   and matches on 2 logical replicas; a model file's round trip; and the
   refusals (input counts and shapes, datasets, descriptors, unused
   inputs, export and quantization). */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "gradcheck.h"

static mpt_context *ctx;
static mpt_context *quiet; /* for the refusals: errors counted, not printed */
static char tmpdir[512];

/* ---- the task: stripes' orientation (the image) and a sign (the vector) ------

   Sample i: a 6×6 image of stripes, horizontal (a = 0) or vertical (a = 1),
   of random phase, contrast and noise; a vector of 4 numbers in [-1, 1),
   b = 1 where v0 + v1 > 0. Its class is 2a + b: a model that sees only
   one input can tell only two classes apart (about 50% at best). */
enum { IMG = 6, VEC = 4, N_TRAIN = 1024, N_TEST = 256 };

typedef struct two_data {
    float img[(N_TRAIN + N_TEST) * IMG * IMG];
    float vec[(N_TRAIN + N_TEST) * VEC];
    int32_t y[N_TRAIN + N_TEST];
} two_data;

static two_data data;

static void make_data(void) {
    int64_t i, r, c;
    test_seed(11);
    for (i = 0; i < N_TRAIN + N_TEST; i++) {
        int a = test_randint(0, 1), phase = test_randint(0, 1), b;
        double contrast = test_uniform(0.5, 1.0);
        for (r = 0; r < IMG; r++)
            for (c = 0; c < IMG; c++) {
                int on = ((a ? c : r) + phase) % 2;
                data.img[(i * IMG + r) * IMG + c] =
                    (float)(on * contrast + test_uniform(-0.25, 0.25));
            }
        for (c = 0; c < VEC; c++) data.vec[i * VEC + c] = (float)test_uniform(-1, 1);
        b = data.vec[i * VEC] + data.vec[i * VEC + 1] > 0;
        data.y[i] = 2 * a + b;
    }
}

/* Samples [first, first + n): both inputs (inputs[0] the image), or the
   vector alone as x (vec_only). */
static mpt_dataset *two_dataset(int64_t first, int64_t n, int vec_only) {
    int64_t si[4] = {n, IMG, IMG, 1}, sv[2] = {n, VEC}, sy[1] = {n};
    mpt_tensor ti, tv, ty;
    const mpt_tensor *both[2];
    mpt_dataset *d = NULL;
    mpt_tensor_wrap(ctx, &ti, MPT_FLOAT32, 4, si, data.img + first * IMG * IMG);
    mpt_tensor_wrap(ctx, &tv, MPT_FLOAT32, 2, sv, data.vec + first * VEC);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, sy, data.y + first);
    both[0] = &ti;
    both[1] = &tv;
    CHECK(mpt_dataset_create(ctx,
                             vec_only ? &(mpt_dataset_desc){.x = &tv, .y = &ty}
                                      : &(mpt_dataset_desc){.inputs = both, .input_count = 2,
                                                            .y = &ty},
                             &d) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    return d;
}

/* img → Conv2D(4, 3×3, relu) → GlobalAveragePooling2D; vec → Dense(8,
   relu); Concatenate → Dense(16, relu) → Dense(4, softmax). */
static mpt_model *two_input_model(mpt_context *c, mpt_policy policy, mpt_strategy *s) {
    mpt_model *m = NULL;
    mpt_node img, vec, both[2], h;
    CHECK(mpt_model_create(c, &(mpt_model_desc){.input_shape = {IMG, IMG, 1}, .input_rank = 3,
                                                .policy = policy, .seed = 5, .strategy = s},
                           &m) == MPT_OK,
          "create: %s", mpt_context_error(c));
    if (!m) return NULL;
    img = mpt_model_input(m);
    vec = mpt_model_add_input(m, &(mpt_input_desc){.shape = {VEC}, .rank = 1, .name = "vector"});
    both[0] = mpt_conv2d(m, img, &(mpt_conv2d_desc){.filters = 4, .kernel_size = {3, 3},
                                                    .activation = MPT_ACT_RELU});
    both[0] = mpt_global_average_pooling2d(m, both[0], NULL);
    both[1] = mpt_dense(m, vec, &(mpt_dense_desc){.units = 8, .activation = MPT_ACT_RELU});
    h = mpt_concatenate(m, 2, both, NULL);
    h = mpt_dense(m, h, &(mpt_dense_desc){.units = 16, .activation = MPT_ACT_RELU});
    mpt_dense(m, h, &(mpt_dense_desc){.units = 4, .activation = MPT_ACT_SOFTMAX});
    test_compile_classifier(c, m);
    return m;
}

static double held_out_accuracy(mpt_model *m, mpt_dataset *test) {
    mpt_logs logs;
    CHECK(mpt_model_evaluate(m, test, &(mpt_evaluate_desc){.batch_size = 64}, &logs) == MPT_OK,
          "evaluate: %s", mpt_context_error(ctx));
    return mpt_logs_get(&logs, "accuracy");
}

/* The two-input model learns the four classes (held out: above 90%) in
   float32 and mixed_float16; a model of the vector alone cannot (below
   70%: it sees one of the label's two bits). */
static void test_two_inputs_learn(void) {
    mpt_dataset *train = two_dataset(0, N_TRAIN, 0), *test = two_dataset(N_TRAIN, N_TEST, 0);
    mpt_fit_desc fit = fit_for(15, 32);
    mpt_model *one;
    int k;
    double acc;
    for (k = 0; k < 2; k++) {
        mpt_model *m = two_input_model(ctx, test_policies[k], NULL);
        CHECK(mpt_model_fit(m, train, &fit) == MPT_OK, "fit %s: %s",
              mpt_policy_name(test_policies[k]), mpt_context_error(ctx));
        acc = held_out_accuracy(m, test);
        printf("# %s: held-out accuracy of the two-input model %.4f\n",
               mpt_policy_name(test_policies[k]), acc);
        CHECK(acc > 0.9, "%s: held-out accuracy %.4f", mpt_policy_name(test_policies[k]), acc);
        CHECK(mpt_model_input_count(m) == 2, "%d inputs", mpt_model_input_count(m));
        mpt_model_destroy(m);
    }
    mpt_dataset_destroy(train);
    mpt_dataset_destroy(test);
    /* the vector alone */
    train = two_dataset(0, N_TRAIN, 1);
    test = two_dataset(N_TRAIN, N_TEST, 1);
    one = small_classifier(ctx, &(classifier_desc){.features = VEC, .hidden = 16, .classes = 4,
                                                   .seed = 5});
    CHECK(mpt_model_fit(one, train, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    acc = held_out_accuracy(one, test);
    printf("# the vector alone: held-out accuracy %.4f\n", acc);
    CHECK(acc < 0.7, "the vector alone reaches %.4f", acc);
    mpt_model_destroy(one);
    mpt_dataset_destroy(train);
    mpt_dataset_destroy(test);
}

/* ---- gradients through both branches ---------------------------------------------
   input 0 (5) → Dense(3, tanh); input 1 (4) → Dense(3, sigmoid);
   Concatenate → Dense(2). */

enum { G0 = 5, G1 = 4, GH = 3, GO = 2 };

static void two_branch_ref(const gc_case *c, const double *x, double *const *p, double *y) {
    const double *x1 = x + c->batch * G0; /* input 1's batch follows input 0's */
    int64_t b, i;
    for (b = 0; b < c->batch; b++) {
        double h[2 * GH];
        ref_dense_sample(x + b * G0, p[0], p[1], G0, GH, h);
        ref_dense_sample(x1 + b * G1, p[2], p[3], G1, GH, h + GH);
        for (i = 0; i < GH; i++) {
            h[i] = tanh(h[i]);
            h[GH + i] = 1 / (1 + exp(-h[GH + i]));
        }
        ref_dense_sample(h, p[4], p[5], 2 * GH, GO, y + b * GO);
    }
}

static mpt_model *two_branch_model(mpt_context *c, mpt_policy policy) {
    mpt_model *m = NULL;
    mpt_node in1, both[2];
    CHECK(mpt_model_create(c, &(mpt_model_desc){.input_shape = {G0}, .input_rank = 1,
                                                .policy = policy, .seed = 3},
                           &m) == MPT_OK,
          "create: %s", mpt_context_error(c));
    in1 = mpt_model_add_input(m, &(mpt_input_desc){.shape = {G1}, .rank = 1});
    both[0] = mpt_dense(m, mpt_model_input(m),
                        &(mpt_dense_desc){.units = GH, .activation = MPT_ACT_TANH});
    both[1] = mpt_dense(m, in1, &(mpt_dense_desc){.units = GH, .activation = MPT_ACT_SIGMOID});
    mpt_dense(m, mpt_concatenate(m, 2, both, NULL), &(mpt_dense_desc){.units = GO});
    return m;
}

static void test_two_input_gradients(void) {
    gc_check_policies(ctx, two_branch_model, two_branch_ref, "two inputs");
}

/* ---- the same training on 1 and 2 threads, on 1 and 2 replicas ---------------------- */

static void params_of(mpt_model *m, float *w, int64_t size) { test_weights_of(m, w, size); }

/* Three epochs under mixed_float16 (loss scaling) on 1 and on 2 threads:
   the same weights, bit for bit. */
static void test_threads_bit_identical(void) {
    static float w[2][4096];
    mpt_fit_desc fit = fit_for(3, 32);
    int t;
    for (t = 0; t < 2; t++) {
        mpt_context *c = path_ctx(t + 1, 0);
        mpt_dataset *train;
        mpt_model *m;
        mpt_context *keep = ctx;
        ctx = c; /* the dataset and model in this context */
        train = two_dataset(0, N_TRAIN, 0);
        m = two_input_model(c, MPT_POLICY_MIXED_FLOAT16, NULL);
        CHECK(mpt_model_fit(m, train, &fit) == MPT_OK, "fit on %d threads: %s", t + 1,
              mpt_context_error(c));
        params_of(m, w[t], 4096);
        mpt_model_destroy(m);
        mpt_dataset_destroy(train);
        ctx = keep;
        mpt_context_destroy(c);
    }
    CHECK(memcmp(w[0], w[1], sizeof w[0]) == 0, "1 and 2 threads trained apart");
}

/* Two logical replicas at global batch 32 against one: the same weights
   but for the order of the gradients' float32 sums (1e-5 relative, as
   tests/test_strategy.c allows), the replicas identical. Each replica
   must read its own rows of both inputs for this to hold. */
static void test_replicas_match_one(void) {
    mpt_dataset *train = two_dataset(0, N_TRAIN, 0);
    mpt_fit_desc fit = fit_for(3, 32);
    mpt_strategy *s = NULL;
    mpt_model *one, *many;
    double diff;
    CHECK(mpt_strategy_create(ctx, &(mpt_strategy_desc){.type = MPT_STRATEGY_MIRRORED,
                                                        .num_replicas = 2},
                              &s) == MPT_OK,
          "strategy: %s", mpt_context_error(ctx));
    one = two_input_model(ctx, MPT_POLICY_FLOAT32, NULL);
    many = two_input_model(ctx, MPT_POLICY_FLOAT32, s);
    CHECK(mpt_model_fit(one, train, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(many, train, &fit) == MPT_OK, "fit 2 replicas: %s", mpt_context_error(ctx));
    diff = test_weight_diff(many, one);
    printf("# 2 replicas vs 1: relative norm error of the weights %.3g\n", diff);
    CHECK(diff <= 1e-5, "2 replicas: relative norm error %.3g", diff);
    CHECK(many->n_replicas == 2 &&
              memcmp(many->arena[MPT__MEM_PARAMS], many->replica[1]->arena[MPT__MEM_PARAMS],
                     (size_t)many->arena_bytes[MPT__MEM_PARAMS]) == 0,
          "the replicas drifted apart");
    mpt_model_destroy(one);
    mpt_model_destroy(many);
    mpt_strategy_destroy(s);
    mpt_dataset_destroy(train);
}

/* ---- a model file ---------------------------------------------------------------- */

/* Trained, saved, loaded in this process: the same inputs (names, shapes),
   the same evaluation and predictions, bit for bit; the summary lists
   each input. */
static void test_model_file_round_trip(void) {
    mpt_dataset *train = two_dataset(0, N_TRAIN, 0), *test = two_dataset(N_TRAIN, N_TEST, 0);
    mpt_model *m = two_input_model(ctx, MPT_POLICY_MIXED_FLOAT16, NULL), *back = NULL;
    mpt_logs a, b;
    mpt_tensor pa, pb;
    char path[600], summary[8192];
    int64_t shape[4];
    snprintf(path, sizeof path, "%s/two.safetensors", tmpdir);
    CHECK(mpt_model_fit(m, train, &(mpt_fit_desc){.epochs = 2, .batch_size = 32}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_save(m, path) == MPT_OK, "save: %s", mpt_context_error(ctx));
    CHECK(mpt_model_load(ctx, path, &back) == MPT_OK, "load: %s", mpt_context_error(ctx));
    if (!back) goto done;
    CHECK(mpt_model_input_count(back) == 2, "%d inputs loaded", mpt_model_input_count(back));
    CHECK(strcmp(mpt_model_layer_name(back, 0), "vector") == 0 &&
              strcmp(mpt_model_layer_class_name(back, 0), "InputLayer") == 0,
          "layer 0 is %s (%s)", mpt_model_layer_name(back, 0),
          mpt_model_layer_class_name(back, 0));
    CHECK(mpt_model_evaluate(m, test, NULL, &a) == MPT_OK &&
              mpt_model_evaluate(back, test, NULL, &b) == MPT_OK,
          "evaluate: %s", mpt_context_error(ctx));
    CHECK(memcmp(&a.values, &b.values, sizeof a.values) == 0, "loss %.9g / %.9g after loading",
          mpt_logs_get(&a, "loss"), mpt_logs_get(&b, "loss"));
    CHECK(mpt_model_predict(m, test, 64, &pa) == MPT_OK &&
              mpt_model_predict(back, test, 64, &pb) == MPT_OK,
          "predict: %s", mpt_context_error(ctx));
    CHECK(mpt_tensor_bytes(&pa) == mpt_tensor_bytes(&pb) &&
              memcmp(pa.data, pb.data, mpt_tensor_bytes(&pa)) == 0,
          "predictions differ after loading");
    mpt_tensor_free(ctx, &pa);
    mpt_tensor_free(ctx, &pb);
    CHECK(mpt_model_layer_output_shape(back, 0, shape) == 1 && shape[0] == VEC, "input shape");
    mpt_model_summary(back, summary, sizeof summary);
    CHECK(strstr(summary, "input (InputLayer)") && strstr(summary, "vector (InputLayer)") &&
              strstr(summary, "vector[0][0]"),
          "summary:\n%s", summary);
done:
    mpt_model_destroy(back);
    mpt_model_destroy(m);
    mpt_dataset_destroy(train);
    mpt_dataset_destroy(test);
}

/* A model file's architecture JSON with InputLayers, read as mpt_model_load
   reads it: a good one gives two inputs; hostile ones are refused, each
   with its reason. */
static void test_file_inputs_refused(void) {
#define INPUT_LAYER(name, config) \
    "{\"class\":\"InputLayer\",\"name\":\"" name "\",\"inputs\":[],\"config\":{" config "}}"
#define GOOD_SHAPE "\"rank\":1,\"shape_0\":2,\"shape_1\":0,\"shape_2\":0,\"ids\":0"
#define CONCAT(a, b) \
    "{\"class\":\"Concatenate\",\"name\":\"c\",\"inputs\":[" a "," b "],\"config\":{}}"
    static const struct {
        const char *layers, *words;
    } cases[] = {
        {INPUT_LAYER("v", GOOD_SHAPE) "," CONCAT("0", "1"), NULL},
        {INPUT_LAYER("v", "\"rank\":0") "," CONCAT("0", "1"), "rank 0 is not in 1..3"},
        {INPUT_LAYER("v", "\"rank\":1,\"shape_0\":2,\"shape_1\":5") "," CONCAT("0", "1"),
         "shape_1 is 5, past its rank 1"},
        {INPUT_LAYER("v", "\"rank\":1,\"shape_0\":-2") "," CONCAT("0", "1"),
         "has a dimension <= 0"},
        {INPUT_LAYER("v", "\"rank\":1,\"shape_0\":2,\"ids\":5") "," CONCAT("0", "1"),
         "ids is 5"},
        {"{\"class\":\"InputLayer\",\"name\":\"v\",\"dtype\":\"float16\",\"inputs\":[],"
         "\"config\":{" GOOD_SHAPE "}}," CONCAT("0", "1"),
         "no compute dtype of its own"},
        {"{\"class\":\"InputLayer\",\"name\":\"v\",\"inputs\":[0],\"config\":{" GOOD_SHAPE
         "}}," CONCAT("0", "1"),
         "\"inputs\" is not an array of 0..0 nodes"},
        {INPUT_LAYER("v", GOOD_SHAPE) "," CONCAT("0", "1") ",{\"call_of\":0,\"inputs\":[]}",
         "layer 0 is an input"},
        {CONCAT("0", "0") "," INPUT_LAYER("late", GOOD_SHAPE), "is input 1 ('late')"},
        {INPUT_LAYER("v", GOOD_SHAPE) ",{\"class\":\"Dense\",\"name\":\"d\",\"inputs\":[0],"
         "\"config\":{\"units\":2}}",
         "input 1 ('v') does not lead to the output"},
    };
    size_t k;
    for (k = 0; k < sizeof cases / sizeof cases[0]; k++)
        test_json_case(quiet, (int)k, cases[k].layers, "", cases[k].words, mpt_model_input_count);
#undef INPUT_LAYER
#undef GOOD_SHAPE
#undef CONCAT
}

/* ---- refusals ---------------------------------------------------------------------- */

/* A model of input 0 (3) and whatever `add` adds; its build's status. */
static mpt_status build_with(void (*add)(mpt_model *m)) {
    mpt_model *m = NULL;
    mpt_status s;
    mpt_model_create(quiet, &(mpt_model_desc){.input_shape = {3}, .input_rank = 1}, &m);
    add(m);
    s = mpt_model_build(m, 4);
    mpt_model_destroy(m);
    return s;
}

static void add_unused_input(mpt_model *m) {
    mpt_model_add_input(m, &(mpt_input_desc){.shape = {2}, .rank = 1, .name = "unused"});
    mpt_dense(m, mpt_model_input(m), &(mpt_dense_desc){.units = 2});
}
static void add_unused_input0(mpt_model *m) {
    mpt_node v = mpt_model_add_input(m, &(mpt_input_desc){.shape = {2}, .rank = 1});
    mpt_dense(m, v, &(mpt_dense_desc){.units = 2});
}
static void add_input_last(mpt_model *m) {
    mpt_dense(m, mpt_model_input(m), &(mpt_dense_desc){.units = 2});
    mpt_model_add_input(m, &(mpt_input_desc){.shape = {2}, .rank = 1});
}
static void add_rank0(mpt_model *m) {
    mpt_node v = mpt_model_add_input(m, &(mpt_input_desc){.shape = {2}, .rank = 0});
    mpt_node both[2];
    both[0] = mpt_model_input(m);
    both[1] = v;
    mpt_concatenate(m, 2, both, NULL);
}
static void add_zero_dim(mpt_model *m) {
    mpt_model_add_input(m, &(mpt_input_desc){.shape = {2, 0}, .rank = 2, .name = "flat"});
}
static void add_half_dtype(mpt_model *m) {
    mpt_model_add_input(m, &(mpt_input_desc){.shape = {2}, .rank = 1, .dtype = MPT_FLOAT16});
}
static void add_null_desc(mpt_model *m) { mpt_model_add_input(m, NULL); }
static void add_too_many(mpt_model *m) {
    int k;
    for (k = 0; k < MPT_MAX_INPUTS; k++)
        mpt_model_add_input(m, &(mpt_input_desc){.shape = {2}, .rank = 1});
}
static void add_ids_to_dense(mpt_model *m) {
    mpt_node ids = mpt_model_add_input(m, &(mpt_input_desc){.shape = {2}, .rank = 1,
                                                            .dtype = MPT_INT32, .name = "ids"});
    mpt_node both[2];
    both[0] = mpt_model_input(m);
    both[1] = mpt_dense(m, ids, &(mpt_dense_desc){.units = 2});
    mpt_concatenate(m, 2, both, NULL);
}

static void test_bad_models(void) {
    static const struct {
        void (*add)(mpt_model *m);
        mpt_status status;
        const char *words, *what;
    } cases[] = {
        {add_unused_input, MPT_ERR_INVALID_ARGUMENT,
         "input 1 ('unused') does not lead to the output", "unused input"},
        {add_unused_input0, MPT_ERR_INVALID_ARGUMENT, "input 0 ('input') does not lead",
         "unused input 0"},
        {add_input_last, MPT_ERR_INVALID_ARGUMENT, "is input 1", "an input last"},
        {add_rank0, MPT_ERR_INVALID_ARGUMENT, "rank 0 is not in 1..3", "rank 0"},
        {add_zero_dim, MPT_ERR_SHAPE,
         "InputLayer 'flat' (input 1): shape (2, 0) has a dimension <= 0", "a dimension 0"},
        {add_half_dtype, MPT_ERR_DTYPE, "dtype float16", "dtype float16"},
        {add_null_desc, MPT_ERR_INVALID_ARGUMENT, "NULL descriptor", "NULL desc"},
        {add_too_many, MPT_ERR_INVALID_ARGUMENT, "MPT_MAX_INPUTS", "too many inputs"},
        {add_ids_to_dense, MPT_ERR_DTYPE,
         "Dense 'dense' reads the input 'ids', which is int32 token ids", "ids into a Dense"},
    };
    size_t k;
    for (k = 0; k < sizeof cases / sizeof cases[0]; k++)
        test_expect_error(quiet, build_with(cases[k].add), cases[k].status, cases[k].words,
                          cases[k].what);
}

/* fit, evaluate, predict and forward refuse what does not fit the
   inputs; the dataset refuses x and inputs together and inputs of other
   counts. (Quantization takes several inputs: tests/test_quantize.c,
   tests/test_qat.c.) */
static void test_bad_data(void) {
    mpt_model *m = two_input_model(quiet, MPT_POLICY_FLOAT32, NULL);
    static float img[8 * IMG * IMG], vec5[8 * 5], vec[8 * VEC];
    int32_t y[8] = {0};
    int64_t si[4] = {8, IMG, IMG, 1}, sv5[2] = {8, 5}, sv[2] = {8, VEC}, sv7[2] = {7, VEC},
            sy[1] = {8};
    mpt_tensor ti, tv5, tv, tv7, ty, out, xs[2];
    const mpt_tensor *wrong[2], *right[2], *short_[2];
    mpt_dataset *d = NULL;
    mpt_logs logs;
    char path[600];
    mpt_tensor_wrap(quiet, &ti, MPT_FLOAT32, 4, si, img);
    mpt_tensor_wrap(quiet, &tv5, MPT_FLOAT32, 2, sv5, vec5);
    mpt_tensor_wrap(quiet, &tv, MPT_FLOAT32, 2, sv, vec);
    mpt_tensor_wrap(quiet, &tv7, MPT_FLOAT32, 2, sv7, vec);
    mpt_tensor_wrap(quiet, &ty, MPT_INT32, 1, sy, y);
    wrong[0] = right[0] = short_[0] = &ti;
    wrong[1] = &tv5;
    right[1] = &tv;
    short_[1] = &tv7;
    /* the dataset's own checks */
    test_expect_error(quiet, mpt_dataset_create(quiet, &(mpt_dataset_desc){.x = &ti,
                                                .inputs = right, .input_count = 2, .y = &ty}, &d),
                      MPT_ERR_INVALID_ARGUMENT, "x and inputs are both set", "x and inputs");
    test_expect_error(quiet, mpt_dataset_create(quiet, &(mpt_dataset_desc){.inputs = short_,
                                                .input_count = 2, .y = &ty}, &d),
                      MPT_ERR_SHAPE, "inputs[1] (7, 4) has 7 samples", "counts apart");
    test_expect_error(quiet, mpt_dataset_create(quiet, &(mpt_dataset_desc){.inputs = right,
                                                .input_count = 9, .y = &ty}, &d),
                      MPT_ERR_INVALID_ARGUMENT, "input_count 9", "9 inputs");
    vec[5] = NAN; /* checked as x is */
    test_expect_error(quiet, mpt_dataset_create(quiet, &(mpt_dataset_desc){.inputs = right,
                                                .input_count = 2, .y = &ty}, &d),
                      MPT_ERR_NUMERIC, "inputs[1] sample 1 holds nan", "a NaN in input 1");
    vec[5] = 0;
    /* one tensor for two inputs */
    CHECK(mpt_dataset_create(quiet, &(mpt_dataset_desc){.x = &ti, .y = &ty}, &d) == MPT_OK,
          "dataset: %s", mpt_context_error(quiet));
    test_expect_error(quiet, mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1, .batch_size = 4}),
                      MPT_ERR_INVALID_ARGUMENT,
                      "fit: the dataset holds 1 input tensor but the model has 2 inputs",
                      "one tensor");
    mpt_dataset_destroy(d);
    /* input 1 of 5 numbers where the model takes 4 */
    CHECK(mpt_dataset_create(quiet, &(mpt_dataset_desc){.inputs = wrong, .input_count = 2,
                                                        .y = &ty}, &d) == MPT_OK,
          "dataset: %s", mpt_context_error(quiet));
    test_expect_error(quiet, mpt_model_evaluate(m, d, NULL, &logs), MPT_ERR_SHAPE,
                      "input 1 ('vector'): samples of shape (5,) do not fit the model's input (4,)",
                      "a wrong shape");
    {
        mpt_tensor pred;
        test_expect_error(quiet, mpt_model_predict(m, d, 4, &pred), MPT_ERR_SHAPE,
                          "predict: input 1 ('vector')", "predict a wrong shape");
    }
    mpt_dataset_destroy(d);
    /* forward, on batches of 4 (the model was built for them) */
    test_expect_error(quiet, mpt_model_forward(m, &ti, 0, &out), MPT_ERR_INVALID_ARGUMENT,
                      "mpt_model_forward_inputs", "forward of one");
    xs[0] = ti;
    xs[1] = tv5;
    xs[0].shape[0] = xs[1].shape[0] = 4;
    test_expect_error(quiet, mpt_model_forward_inputs(m, 2, xs, 0, &out), MPT_ERR_SHAPE,
                      "input 1 ('vector') of shape (4, 5)", "forward of a wrong shape");
    xs[1] = tv;
    xs[1].shape[0] = 4;
    CHECK(mpt_model_forward_inputs(m, 2, xs, 0, &out) == MPT_OK, "forward: %s",
          mpt_context_error(quiet));
    test_expect_error(quiet, mpt_model_predict_tensor(m, &ti, 4, &out), MPT_ERR_INVALID_ARGUMENT,
                      "predict_tensor: the model has 2 inputs", "predict_tensor");
    /* export writes both files (test_export runs such a model in LiteRT
       and ONNX Runtime); quantization refuses */
    snprintf(path, sizeof path, "%s/two.tflite", tmpdir);
    CHECK(mpt_model_export_tflite(m, path, NULL) == MPT_OK, "TFLite: %s",
          mpt_context_error(quiet));
    snprintf(path, sizeof path, "%s/two.onnx", tmpdir);
    CHECK(mpt_model_export_onnx(m, path, NULL) == MPT_OK, "ONNX: %s", mpt_context_error(quiet));
    { /* ... but not an added input named as the file names input 0 */
        mpt_model *clash = NULL;
        mpt_node both[2];
        CHECK(mpt_model_create(quiet, &(mpt_model_desc){.input_shape = {VEC}, .input_rank = 1},
                               &clash) == MPT_OK,
              "create: %s", mpt_context_error(quiet));
        both[0] = mpt_model_input(clash);
        both[1] = mpt_model_add_input(clash, &(mpt_input_desc){.shape = {3}, .rank = 1,
                                                               .name = "input"});
        mpt_dense(clash, mpt_concatenate(clash, 2, both, NULL), &(mpt_dense_desc){.units = 2});
        test_compile_classifier(quiet, clash);
        CHECK(mpt_model_build(clash, 4) == MPT_OK, "build: %s", mpt_context_error(quiet));
        test_expect_error(quiet, mpt_model_export_onnx(clash, path, NULL),
                          MPT_ERR_INVALID_ARGUMENT, "input 1 is named 'input'", "a clash");
        mpt_model_destroy(clash);
    }
    mpt_model_destroy(m);
}

/* An input of int32 ids read by an Embedding, beside an input of numbers:
   trains, and an id outside the table is refused naming the input's layer. */
static void test_ids_input(void) {
    mpt_model *m = NULL;
    mpt_node ids, both[2];
    static float x[16 * 3];
    int32_t t[16 * 2], y[16];
    int64_t sx[2] = {16, 3}, st[2] = {16, 2}, sy[1] = {16}, i;
    mpt_tensor tx, tt, ty;
    const mpt_tensor *in[2];
    mpt_dataset *d = NULL;
    CHECK(mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {3}, .input_rank = 1, .seed = 1},
                           &m) == MPT_OK,
          "create: %s", mpt_context_error(ctx));
    ids = mpt_model_add_input(m, &(mpt_input_desc){.shape = {2}, .rank = 1, .dtype = MPT_INT32});
    both[0] = mpt_flatten(m, mpt_embedding(m, ids, &(mpt_embedding_desc){.input_dim = 5,
                                                                        .output_dim = 2}), NULL);
    both[1] = mpt_dense(m, mpt_model_input(m), &(mpt_dense_desc){.units = 4});
    mpt_dense(m, mpt_concatenate(m, 2, both, NULL),
              &(mpt_dense_desc){.units = 3, .activation = MPT_ACT_SOFTMAX});
    test_compile_classifier(ctx, m);
    for (i = 0; i < 16 * 3; i++) x[i] = (float)test_uniform(-1, 1);
    for (i = 0; i < 16 * 2; i++) t[i] = (int32_t)(i % 5);
    for (i = 0; i < 16; i++) y[i] = (int32_t)(i % 3);
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, sx, x);
    mpt_tensor_wrap(ctx, &tt, MPT_INT32, 2, st, t);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, sy, y);
    in[0] = &tx;
    in[1] = &tt;
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.inputs = in, .input_count = 2, .y = &ty},
                             &d) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 2, .batch_size = 4}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    t[7] = 9; /* borrowed: the next fit reads it */
    test_expect_error(ctx, mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1, .batch_size = 4}),
                      MPT_ERR_INVALID_ARGUMENT, "Embedding 'embedding' got id 9", "a bad id");
    mpt_dataset_destroy(d);
    mpt_model_destroy(m);
}

/* Each input its own dtype: input 1 as uint8 pixels (scaled by 1/255 as
   they are batched) predicts what the same pixels as float32 x/255 do, bit
   for bit. A split's tail reads both inputs from its first sample on:
   what it predicts is what a dataset of those samples alone predicts.
   validation_split and sample weights ride along. */
static void test_dataset_of_inputs(void) {
    enum { N = 96 };
    static uint8_t px[N * IMG * IMG];
    static float pf[N * IMG * IMG];
    int64_t si[4] = {N, IMG, IMG, 1}, sv[2] = {N, VEC}, sy[1] = {N}, sw[1] = {N}, i;
    int64_t ti_shape[4] = {N - 40, IMG, IMG, 1}, tv_shape[2] = {N - 40, VEC};
    int64_t ty_shape[1] = {N - 40};
    static float weights[N];
    mpt_tensor tpx, tpf, tv, ty, tw, tail_px, tail_v, tail_y, p[4];
    const mpt_tensor *u8[2], *f32[2], *tail_in[2];
    mpt_dataset *du8 = NULL, *df = NULL, *head = NULL, *tail = NULL, *alone = NULL;
    mpt_model *m = two_input_model(ctx, MPT_POLICY_MIXED_FLOAT16, NULL);
    mpt_fit_desc fit = fit_for(2, 16);
    for (i = 0; i < N * IMG * IMG; i++) {
        px[i] = (uint8_t)test_randint(0, 255);
        pf[i] = (float)px[i] * (1.0f / 255.0f);
    }
    for (i = 0; i < N; i++) weights[i] = (float)(i % 3);
    mpt_tensor_wrap(ctx, &tpx, MPT_UINT8, 4, si, px);
    mpt_tensor_wrap(ctx, &tpf, MPT_FLOAT32, 4, si, pf);
    mpt_tensor_wrap(ctx, &tv, MPT_FLOAT32, 2, sv, data.vec);
    mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, sy, data.y);
    mpt_tensor_wrap(ctx, &tw, MPT_FLOAT32, 1, sw, weights);
    u8[0] = &tpx, u8[1] = &tv;
    f32[0] = &tpf, f32[1] = &tv;
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.inputs = u8, .input_count = 2, .y = &ty,
                                                      .sample_weight = &tw, .copy = 1},
                             &du8) == MPT_OK &&
              mpt_dataset_create(ctx, &(mpt_dataset_desc){.inputs = f32, .input_count = 2,
                                                          .y = &ty},
                                 &df) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    fit.validation_split = 0.25f;
    CHECK(mpt_model_fit(m, du8, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    CHECK(!isnan(history_value(m, "val_loss", -1)), "no val_loss");
    CHECK(mpt_model_predict(m, du8, 32, &p[0]) == MPT_OK &&
              mpt_model_predict(m, df, 32, &p[1]) == MPT_OK,
          "predict: %s", mpt_context_error(ctx));
    CHECK(memcmp(p[0].data, p[1].data, mpt_tensor_bytes(&p[0])) == 0,
          "uint8 and float32 pixels predict apart");
    /* the tail of a split against the same samples alone */
    mpt_tensor_wrap(ctx, &tail_px, MPT_UINT8, 4, ti_shape, px + 40 * IMG * IMG);
    mpt_tensor_wrap(ctx, &tail_v, MPT_FLOAT32, 2, tv_shape, data.vec + 40 * VEC);
    mpt_tensor_wrap(ctx, &tail_y, MPT_INT32, 1, ty_shape, data.y + 40);
    tail_in[0] = &tail_px, tail_in[1] = &tail_v;
    CHECK(mpt_dataset_split(ctx, du8, 40, &head, &tail) == MPT_OK &&
              mpt_dataset_create(ctx, &(mpt_dataset_desc){.inputs = tail_in, .input_count = 2,
                                                          .y = &tail_y},
                                 &alone) == MPT_OK,
          "split: %s", mpt_context_error(ctx));
    CHECK(mpt_model_predict(m, tail, 32, &p[2]) == MPT_OK &&
              mpt_model_predict(m, alone, 32, &p[3]) == MPT_OK,
          "predict: %s", mpt_context_error(ctx));
    CHECK(mpt_tensor_bytes(&p[2]) == mpt_tensor_bytes(&p[3]) &&
              memcmp(p[2].data, p[3].data, mpt_tensor_bytes(&p[2])) == 0,
          "a split's tail predicts other than its samples alone");
    CHECK(memcmp(p[2].data, (float *)p[0].data + 40 * 4, mpt_tensor_bytes(&p[2])) == 0,
          "the tail's predictions are not the whole's from sample 40");
    for (i = 0; i < 4; i++) mpt_tensor_free(ctx, &p[i]);
    mpt_dataset_destroy(du8); /* before its views: they keep its inputs */
    mpt_dataset_destroy(head);
    mpt_dataset_destroy(tail);
    mpt_dataset_destroy(alone);
    mpt_dataset_destroy(df);
    mpt_model_destroy(m);
}

static void cases(void) {
    quiet = quiet_ctx();
    make_data();
    TEST_RUN(test_two_inputs_learn);
    test_two_input_gradients();
    TEST_RUN(test_threads_bit_identical);
    TEST_RUN(test_replicas_match_one);
    TEST_RUN(test_model_file_round_trip);
    TEST_RUN(test_bad_models);
    TEST_RUN(test_file_inputs_refused);
    TEST_RUN(test_bad_data);
    TEST_RUN(test_ids_input);
    TEST_RUN(test_dataset_of_inputs);
    mpt_context_destroy(quiet);
}

int main(void) {
    test_program p = {"test_inputs", &ctx, 0, quiet_logger, 0, NULL, tmpdir, sizeof tmpdir,
                      "MPT_KEEP_TMP", cases};
    return test_main(&p);
}
