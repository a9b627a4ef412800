/* Whole-model files (mpt_model_save, mpt_model_load): a graph rebuilt with
   no code gives the same bits and trains on from where it stopped; every
   layer kind and descriptor field comes back as it was (the re-saved file
   is the same file); and hostile architecture JSON is refused with a
   message naming the byte, the layer or the key, never a crash. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"
#include "blobs.h"

static mpt_context *ctx;
static char dir[512];

static void path_in(char *out, size_t size, const char *name) {
    snprintf(out, size, "%s/%s", dir, name);
}

static int same_files(const char *a, const char *b) {
    long na = 0, nb = 0;
    unsigned char *x = test_read_file(a, &na), *y = test_read_file(b, &nb);
    int same = x && y && na == nb && na > 0 && memcmp(x, y, (size_t)na) == 0;
    free(x);
    free(y);
    return same;
}

/* m saved to path and loaded back; the loaded model, saved to again,
   writes the same file. The loaded model, or NULL (the test fails). */
static mpt_model *saved_and_loaded(mpt_model *m, const char *path, const char *again) {
    mpt_model *loaded = NULL;
    CHECK(mpt_model_save(m, path) == MPT_OK, "save: %s", mpt_context_error(ctx));
    CHECK(mpt_model_load(ctx, path, &loaded) == MPT_OK, "load: %s", mpt_context_error(ctx));
    if (!loaded) return NULL;
    CHECK(mpt_model_save(loaded, again) == MPT_OK, "save again: %s", mpt_context_error(ctx));
    CHECK(same_files(path, again), "%s and %s differ", path, again);
    return loaded;
}

/* The model's predictions on data (float32, n values). */
static void predictions(mpt_model *m, const mpt_dataset *data, float *out, int64_t n) {
    mpt_tensor y;
    memset(&y, 0, sizeof y); /* gcc -O2 cannot see that predict fills it */
    CHECK(mpt_model_predict(m, data, 32, &y) == MPT_OK, "predict: %s", mpt_context_error(ctx));
    CHECK(mpt_tensor_count(&y) == n, "%lld predictions, want %lld", (long long)mpt_tensor_count(&y),
          (long long)n);
    if (y.data && mpt_tensor_count(&y) == n) memcpy(out, y.data, sizeof(float) * (size_t)n);
    mpt_tensor_free(ctx, &y);
}

/* The model's output on x as float32: its first n values into out. */
static void forward_of(mpt_model *m, const mpt_tensor *x, float *out, int64_t n) {
    mpt_tensor y;
    CHECK(mpt_model_forward(m, x, 0, &y) == MPT_OK, "forward: %s", mpt_context_error(ctx));
    if (y.data) mpt_convert(ctx, MPT_FLOAT32, out, y.dtype, y.data, n);
}

/* The model's output on x (n samples of `features`, float32), as float32. */
static void outputs(mpt_model *m, float *x, int64_t n, int64_t features, float *out) {
    mpt_tensor t, y;
    int64_t shape[2];
    shape[0] = n;
    shape[1] = features;
    mpt_tensor_wrap(ctx, &t, MPT_FLOAT32, 2, shape, x);
    CHECK(mpt_model_forward(m, &t, 0, &y) == MPT_OK, "forward: %s", mpt_context_error(ctx));
    if (y.data) mpt_convert(ctx, MPT_FLOAT32, out, y.dtype, y.data, mpt_tensor_count(&y));
}

/* A loaded model keeps its layers' names and dtypes: layer name_at is
   named name, layer float32_at computes in float32. */
static void expect_name_and_float32(const mpt_model *loaded, int name_at, const char *name,
                                    int float32_at) {
    CHECK(!strcmp(mpt_model_layer_name(loaded, name_at), name) &&
              mpt_model_layer_dtype(loaded, float32_at) == MPT_FLOAT32,
          "names or dtypes changed: %s %s", mpt_model_layer_name(loaded, name_at),
          mpt_dtype_name(mpt_model_layer_dtype(loaded, float32_at)));
}

/* ---- a trained residual graph, rebuilt and trained on ------------------------------ */

/* accumulate: gradient_accumulation_steps (0: off); exclude: AdamW with
   weight decay sparing these names (NULL: Adam). */
static mpt_model *residual_blobs_model(mpt_context *c, int accumulate, const char *exclude) {
    mpt_model *m = NULL;
    mpt_node x, h, two[2];
    mpt_model_create(c,
                     &(mpt_model_desc){.input_shape = {FEATURES},
                                       .input_rank = 1,
                                       .policy = MPT_POLICY_MIXED_FLOAT16,
                                       .seed = 5},
                     &m);
    x = mpt_model_input(m);
    h = mpt_dense(m, x, &(mpt_dense_desc){.units = 12, .activation = MPT_ACT_RELU});
    two[0] = mpt_dense(m, h, &(mpt_dense_desc){.units = 12, .activation = MPT_ACT_TANH});
    two[1] = h;
    h = mpt_batch_normalization(m, mpt_add(m, 2, two, NULL), NULL);
    mpt_dense(m, mpt_dropout(m, h, &(mpt_dropout_desc){.rate = 0.1f}),
              &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_compile(
              m,
              &(mpt_compile_desc){.optimizer = {.type = exclude ? MPT_OPTIMIZER_ADAMW
                                                                : MPT_OPTIMIZER_ADAM,
                                                .learning_rate = 0.01f,
                                                .weight_decay = exclude ? 0.1f : 0.0f,
                                                .gradient_accumulation_steps = accumulate,
                                                .exclude_from_weight_decay = exclude},
                                  .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
                                  .metrics = MPT_METRIC_ACCURACY}) == MPT_OK,
          "compile: %s", mpt_context_error(c));
    return m;
}

/* With gradient accumulation over 3 batches the file is saved in the
   middle of a cycle (2 epochs of 7 batches): the setting, the sums and
   their count come back, and training on matches bit for bit; so does
   exclude_from_weight_decay, the loaded model's own copy. */
static void check_graph_round_trip(int accumulate, const char *exclude) {
    static float w_a[2048], w_b[2048], out_a[N_SYN * CLASSES], out_b[N_SYN * CLASSES];
    char path[600], again[600], sum_a[8192], sum_b[8192];
    mpt_context *other = NULL;
    mpt_model *m = residual_blobs_model(ctx, accumulate, exclude), *loaded = NULL;
    mpt_dataset *data = blobs_in(ctx), *data2;
    path_in(path, sizeof path, "residual.safetensors");
    path_in(again, sizeof again, "residual_again.safetensors");
    CHECK(mpt_model_fit(m, data, &(mpt_fit_desc){.epochs = 2, .batch_size = 32}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_save(m, path) == MPT_OK, "save: %s", mpt_context_error(ctx));
    /* rebuilt in another context, with no code */
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &other);
    CHECK(mpt_model_load(other, path, &loaded) == MPT_OK, "load: %s", mpt_context_error(other));
    if (!loaded) goto done;
    mpt_model_summary(m, sum_a, sizeof sum_a);
    mpt_model_summary(loaded, sum_b, sizeof sum_b);
    CHECK(strcmp(sum_a, sum_b) == 0, "summaries differ:\n%s\n%s", sum_a, sum_b);
    CHECK(mpt_model_epoch(loaded) == 2, "epoch %d after loading", mpt_model_epoch(loaded));
    CHECK(loaded->compile.optimizer.gradient_accumulation_steps ==
                  m->compile.optimizer.gradient_accumulation_steps &&
              loaded->accumulated_steps == m->accumulated_steps,
          "accumulation: %d steps, %lld in the sum after loading; saved %d, %lld",
          loaded->compile.optimizer.gradient_accumulation_steps,
          (long long)loaded->accumulated_steps, m->compile.optimizer.gradient_accumulation_steps,
          (long long)m->accumulated_steps);
    {
        const char *kept = loaded->compile.optimizer.exclude_from_weight_decay;
        CHECK(exclude ? kept && kept != exclude && strcmp(kept, exclude) == 0 : kept == NULL,
              "exclude_from_weight_decay \"%s\" after loading, saved \"%s\"",
              kept ? kept : "(null)", exclude ? exclude : "(null)");
        CHECK(!exclude || (loaded->update.no_decay && m->update.no_decay &&
                           memcmp(loaded->update.no_decay, m->update.no_decay,
                                  (size_t)m->update.n) == 0),
              "the loaded model's no-decay flags differ");
    }
    CHECK(!accumulate || m->accumulated_steps == 2, "saved at %lld in the sum, not mid-cycle",
          (long long)m->accumulated_steps);
    predictions(m, data, out_a, N_SYN * CLASSES);
    predictions(loaded, data, out_b, N_SYN * CLASSES);
    CHECK(memcmp(out_a, out_b, sizeof out_a) == 0, "the loaded model predicts other bits");
    /* the loaded model saves the very same file */
    CHECK(mpt_model_save(loaded, again) == MPT_OK, "save again: %s", mpt_context_error(other));
    CHECK(same_files(path, again), "%s and %s differ", path, again);
    /* and trains on as the original does: optimizer state, counters, loss scale */
    data2 = blobs_in(other);
    CHECK(mpt_model_fit(m, data,
                        &(mpt_fit_desc){.epochs = 3, .initial_epoch = 2, .batch_size = 32}) ==
              MPT_OK,
          "fit on: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(loaded, data2,
                        &(mpt_fit_desc){.epochs = 3, .initial_epoch = 2, .batch_size = 32}) ==
              MPT_OK,
          "fit the loaded one on: %s", mpt_context_error(other));
    test_weights_of(m, w_a, 2048);
    test_weights_of(loaded, w_b, 2048);
    CHECK(memcmp(w_a, w_b, sizeof w_a) == 0, "an epoch more: the weights differ");
    mpt_dataset_destroy(data2);
done:
    mpt_model_destroy(loaded);
    mpt_context_destroy(other);
    mpt_dataset_destroy(data);
    mpt_model_destroy(m);
}

static void test_trained_graph_round_trip(void) {
    check_graph_round_trip(0, NULL);
    check_graph_round_trip(3, NULL);
    check_graph_round_trip(0, "bias,gamma,beta");
}

/* ---- every layer kind and field, uncompiled ------------------------------------------ */

static mpt_model *every_layer_model(void) {
    mpt_model *m = NULL;
    mpt_node x, a, b, two[2], three[3];
    mpt_model_create(ctx,
                     &(mpt_model_desc){.input_shape = {8, 8, 2},
                                       .input_rank = 3,
                                       .policy = MPT_POLICY_MIXED_BFLOAT16,
                                       .seed = 0xFFFFFFFFFFFFFFFFull,
                                       .memory_limit = 1 << 30},
                     &m);
    x = mpt_random_flip(m, mpt_model_input(m),
                        &(mpt_random_flip_desc){.mode = MPT_FLIP_VERTICAL, .seed = 5});
    x = mpt_random_translation(m, x,
                               &(mpt_random_translation_desc){.height_factor = {-0.2f, 0.1f},
                                                              .width_factor = {0.3f, -0.25f},
                                                              .fill_mode = MPT_FILL_WRAP,
                                                              .interpolation =
                                                                  MPT_INTERPOLATION_NEAREST,
                                                              .fill_value = 0.5f,
                                                              .seed = 9,
                                                              .name = "shift"});
    a = mpt_conv2d(m, x,
                   &(mpt_conv2d_desc){.filters = 4,
                                      .kernel_size = {3, 2},
                                      .strides = {2, 1},
                                      .padding = MPT_PADDING_SAME,
                                      .no_bias = 1,
                                      .activation = MPT_ACT_GELU,
                                      .kernel_initializer = MPT_INIT_HE_NORMAL,
                                      .bias_initializer = MPT_INIT_ONES});
    b = mpt_max_pooling2d(
        m, mpt_zero_padding2d(m, x, &(mpt_zero_padding2d_desc){.padding = {{1, 0}, {2, 3}}}),
        &(mpt_pool2d_desc){.pool_size = {2, 6}, .strides = {2, 1}});
    b = mpt_average_pooling2d(m, b, &(mpt_pool2d_desc){.pool_size = {1, 1}, .name = "avg"});
    two[0] = mpt_batch_normalization(
        m, a,
        &(mpt_batchnorm_desc){
            .momentum = 0.9f, .epsilon = 1e-5f, .no_center = 1, .dtype = MPT_FLOAT32});
    two[1] = mpt_conv2d(
        m, b, &(mpt_conv2d_desc){.filters = 4, .kernel_size = {1, 3}, .padding = MPT_PADDING_SAME});
    a = mpt_concatenate(m, 2, two, &(mpt_concatenate_desc){.axis = -1});
    /* Dense over the channels of each pixel: (4, 8, 8) -> (4, 8, 3) */
    a = mpt_dense(m, a,
                  &(mpt_dense_desc){
                      .units = 3, .activation = MPT_ACT_GELU_TANH, .name = "per_pixel"});
    a = mpt_global_average_pooling2d(m, a, NULL);
    a = mpt_dropout(m, a, &(mpt_dropout_desc){.rate = 0.3f, .seed = 77});
    three[0] = mpt_dense(m, a, &(mpt_dense_desc){.units = 5, .activation = MPT_ACT_SIGMOID});
    three[1] = mpt_dense(m, a, &(mpt_dense_desc){.units = 5, .no_bias = 1});
    three[2] = mpt_apply_layer(m, "dense", 1, &a); /* a shared layer's second call */
    three[2] = mpt_multiply(m, 3, three, NULL);
    two[0] = mpt_subtract(m, 2, three, NULL);
    two[1] = mpt_average(m, 2, three + 1, NULL);
    a = mpt_add(m, 2, two, &(mpt_merge_desc){.name = "sum"});
    a = mpt_activation_layer(m, a, &(mpt_activation_desc){.activation = MPT_ACT_TANH});
    a = mpt_layer_normalization(m, a,
                                &(mpt_layer_normalization_desc){.epsilon = 1e-5f,
                                                                .no_scale = 1,
                                                                .gamma_initializer = MPT_INIT_ZEROS,
                                                                .beta_initializer = MPT_INIT_ONES,
                                                                .name = "ln"});
    a = mpt_layer_normalization(
        m, a, &(mpt_layer_normalization_desc){.no_center = 1, .dtype = MPT_FLOAT32});
    mpt_dense(m, mpt_flatten(m, a, NULL), &(mpt_dense_desc){.units = 3});
    CHECK(mpt_model_build(m, 7) == MPT_OK, "build: %s", mpt_context_error(ctx));
    return m;
}

static void test_every_layer_round_trip(void) {
    static float x[7 * 128], out_a[7 * 3], out_b[7 * 3];
    char path[600], again[600];
    mpt_model *m = every_layer_model(), *loaded = NULL;
    mpt_tensor t;
    int64_t shape[4] = {7, 8, 8, 2}, i;
    path_in(path, sizeof path, "every.safetensors");
    path_in(again, sizeof again, "every_again.safetensors");
    loaded = saved_and_loaded(m, path, again);
    if (!loaded) goto done;
    {
        long n = 0;
        unsigned char *bytes = test_read_file(path, &n);
        int64_t px[4];
        int at = -1, k;
        long j, named = 0;
        for (k = 0; k < mpt_model_layer_count(loaded); k++)
            if (!strcmp(mpt_model_layer_name(loaded, k), "per_pixel")) at = k;
        for (j = 0; bytes && j + 9 <= n; j++) named += !memcmp(bytes + j, "gelu_tanh", 9);
        CHECK(named == 1, "the file names gelu_tanh %ld times", named);
        CHECK(at >= 0 && mpt_model_layer_output_shape(loaded, at, px) == 3 && px[0] == 4 &&
                  px[1] == 8 && px[2] == 3,
              "the per-pixel Dense came back as another shape");
        free(bytes);
    }
    for (i = 0; i < 7 * 128; i++) x[i] = (float)test_uniform(-1, 1);
    mpt_tensor_wrap(ctx, &t, MPT_FLOAT32, 4, shape, x);
    forward_of(m, &t, out_a, 21);
    forward_of(loaded, &t, out_b, 21);
    CHECK(memcmp(out_a, out_b, sizeof out_a) == 0, "the loaded model predicts other bits");
    expect_name_and_float32(loaded, 5, "avg", 6);
    {   /* LayerNormalization's descriptor came back field by field */
        const mpt__layer *ln = mpt__find_layer(loaded, "ln");
        const mpt__layer *ln1 = mpt__find_layer(loaded, "layer_normalization");
        CHECK(ln && ln->desc.layer_normalization.epsilon == 1e-5f &&
                  ln->desc.layer_normalization.no_scale &&
                  !ln->desc.layer_normalization.no_center &&
                  ln->desc.layer_normalization.gamma_initializer == MPT_INIT_ZEROS &&
                  ln->desc.layer_normalization.beta_initializer == MPT_INIT_ONES,
              "LayerNormalization 'ln' came back otherwise");
        CHECK(ln1 && ln1->desc.layer_normalization.no_center && ln1->dtype == MPT_FLOAT32 &&
                  ln1->n_params == 1,
              "LayerNormalization 'layer_normalization' came back otherwise");
    }
    {   /* the augmentation layers' descriptors, field by field */
        const mpt__layer *f = mpt__find_layer(loaded, "random_flip");
        const mpt__layer *t = mpt__find_layer(loaded, "shift");
        const mpt_random_translation_desc *d = t ? &t->desc.random_translation : NULL;
        CHECK(f && f->desc.random_flip.mode == MPT_FLIP_VERTICAL && f->desc.random_flip.seed == 5,
              "RandomFlip came back otherwise");
        CHECK(d && d->height_factor[0] == -0.2f && d->height_factor[1] == 0.1f &&
                  d->width_factor[0] == 0.3f && d->width_factor[1] == -0.25f &&
                  d->fill_mode == MPT_FILL_WRAP &&
                  d->interpolation == MPT_INTERPOLATION_NEAREST && d->fill_value == 0.5f &&
                  d->seed == 9,
              "RandomTranslation 'shift' came back otherwise");
    }
done:
    mpt_model_destroy(loaded);
    mpt_model_destroy(m);
}

/* ---- a model of token ids: Embedding and PositionEmbedding ------------------------- */

/* Every field of the two layers and the input's dtype come back (the
   re-saved file is the same file), the outputs bit for bit; a file
   whose input_dtype is not int32 is refused, naming the byte. */
static void test_ids_layers_round_trip(void) {
    static int32_t ids[5 * 4];
    static float out_a[5 * 3], out_b[5 * 3];
    char path[600], again[600], bad[600];
    mpt_model *m = NULL, *loaded = NULL;
    mpt_node x, two[2];
    mpt_tensor t;
    int64_t shape[2] = {5, 4};
    long n = 0;
    unsigned char *text;
    int i;
    mpt_model_create(ctx,
                     &(mpt_model_desc){.input_shape = {4},
                                       .input_rank = 1,
                                       .input_dtype = MPT_INT32,
                                       .policy = MPT_POLICY_MIXED_FLOAT16,
                                       .seed = 9},
                     &m);
    x = mpt_model_input(m);
    two[0] = mpt_embedding(m, x,
                           &(mpt_embedding_desc){.input_dim = 11,
                                                 .output_dim = 6,
                                                 .embeddings_initializer = MPT_INIT_GPT2_NORMAL,
                                                 .name = "tokens",
                                                 .dtype = MPT_FLOAT32});
    two[1] = mpt_position_embedding(
        m, two[0],
        &(mpt_position_embedding_desc){.sequence_length = 9,
                                       .initializer = MPT_INIT_RANDOM_UNIFORM});
    mpt_dense(m, mpt_flatten(m, mpt_add(m, 2, two, NULL), NULL), &(mpt_dense_desc){.units = 3});
    CHECK(mpt_model_build(m, 5) == MPT_OK, "build: %s", mpt_context_error(ctx));
    path_in(path, sizeof path, "ids.safetensors");
    path_in(again, sizeof again, "ids_again.safetensors");
    loaded = saved_and_loaded(m, path, again);
    if (!loaded) goto done;
    for (i = 0; i < 5 * 4; i++) ids[i] = test_randint(0, 10);
    mpt_tensor_wrap(ctx, &t, MPT_INT32, 2, shape, ids);
    forward_of(m, &t, out_a, 15);
    forward_of(loaded, &t, out_b, 15);
    CHECK(memcmp(out_a, out_b, sizeof out_a) == 0, "the loaded model predicts other bits");
    expect_name_and_float32(loaded, 0, "tokens", 0);
    /* the same file with "input_dtype":"float16" */
    text = test_read_file(path, &n);
    if (text && n > 0) {
        /* the architecture is a string in the header, after the header's
           length (8 bytes, zeros among them), its quotes escaped */
        char *at = n > 8 ? strstr((char *)text + 8, "input_dtype") : NULL;
        FILE *f;
        at = at ? strstr(at, "int32") : NULL;
        CHECK(at != NULL, "the file does not say its input is int32");
        if (at) memcpy(at, "float", 5);
        path_in(bad, sizeof bad, "ids_float.safetensors");
        f = fopen(bad, "wb");
        if (f) {
            fwrite(text, 1, (size_t)n, f);
            fclose(f);
        }
        mpt_model_destroy(loaded);
        loaded = NULL;
        test_expect_error(ctx, mpt_model_load(ctx, bad, &loaded), MPT_ERR_FORMAT,
                          "\"input_dtype\" is \"float\", not \"int32\"", "load float input_dtype");
    }
    free(text);
done:
    mpt_model_destroy(loaded);
    mpt_model_destroy(m);
}

/* A Sequential stack, never compiled: its weights come back, and a file
   of weights alone (save_weights) is refused with a way out. */
static void test_uncompiled_and_weights_only(void) {
    static float x[4 * 6], out_a[4 * 2], out_b[4 * 2];
    char path[600], weights[600];
    mpt_model *m = NULL, *loaded = NULL;
    int i;
    path_in(path, sizeof path, "stack.safetensors");
    path_in(weights, sizeof weights, "stack_weights.safetensors");
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {6}, .input_rank = 1, .seed = 3}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2});
    CHECK(mpt_model_save(m, path) == MPT_ERR_STATE, "save before build");
    CHECK(mpt_model_build(m, 4) == MPT_OK, "build: %s", mpt_context_error(ctx));
    CHECK(mpt_model_save(m, path) == MPT_OK, "save: %s", mpt_context_error(ctx));
    CHECK(mpt_model_save_weights(m, weights) == MPT_OK, "save_weights: %s", mpt_context_error(ctx));
    CHECK(mpt_model_load(ctx, path, &loaded) == MPT_OK, "load: %s", mpt_context_error(ctx));
    for (i = 0; i < 24; i++) x[i] = (float)test_uniform(-2, 2);
    if (loaded) {
        outputs(m, x, 4, 6, out_a);
        outputs(loaded, x, 4, 6, out_b);
        CHECK(memcmp(out_a, out_b, sizeof out_a) == 0, "other bits");
        mpt_model_destroy(loaded);
        loaded = NULL;
    }
    test_expect_error(ctx, mpt_model_load(ctx, weights, &loaded), MPT_ERR_FORMAT,
                      "holds no architecture", "load of a weights file");
    CHECK(loaded == NULL, "out set on failure");
    mpt_model_destroy(m);
}

/* r2_score and auc are compile settings like the others: a saved
   regression comes back with both, in both lists, and evaluates to the
   same values. */
static void test_r2_score_and_auc_kept(void) {
    static float x[40 * 3], y[40 * 2];
    const int metrics = MPT_METRIC_R2_SCORE | MPT_METRIC_AUC | MPT_METRIC_MEAN_SQUARED_ERROR;
    char path[600];
    mpt_model *m = NULL, *loaded = NULL;
    mpt_dataset *d = NULL;
    mpt_tensor tx, ty;
    mpt_logs la, lb;
    int i;
    path_in(path, sizeof path, "r2_auc.safetensors");
    for (i = 0; i < 40 * 3; i++) x[i] = (float)test_uniform(-1, 1);
    for (i = 0; i < 40; i++) {
        y[2 * i] = x[3 * i] + 0.5f * x[3 * i + 1];
        y[2 * i + 1] = x[3 * i + 2] > 0 ? 1.0f : 0.0f;
    }
    mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 2, (int64_t[]){40, 3}, x);
    mpt_tensor_wrap(ctx, &ty, MPT_FLOAT32, 2, (int64_t[]){40, 2}, y);
    CHECK(mpt_dataset_create(ctx, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
          "dataset: %s", mpt_context_error(ctx));
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {3}, .input_rank = 1, .seed = 3}, &m);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 2});
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){.loss = {.type = MPT_LOSS_MEAN_SQUARED_ERROR},
                                                   .metrics = metrics,
                                                   .weighted_metrics = MPT_METRIC_R2_SCORE}) ==
              MPT_OK,
          "compile: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(m, d, &(mpt_fit_desc){.epochs = 1, .batch_size = 16}) == MPT_OK,
          "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_save(m, path) == MPT_OK, "save: %s", mpt_context_error(ctx));
    CHECK(mpt_model_load(ctx, path, &loaded) == MPT_OK, "load: %s", mpt_context_error(ctx));
    if (loaded) {
        CHECK(loaded->compile.metrics == metrics &&
                  loaded->compile.weighted_metrics == MPT_METRIC_R2_SCORE,
              "metrics 0x%x, weighted 0x%x after loading", (unsigned)loaded->compile.metrics,
              (unsigned)loaded->compile.weighted_metrics);
        CHECK(mpt_model_evaluate(m, d, &(mpt_evaluate_desc){.batch_size = 7}, &la) == MPT_OK &&
                  mpt_model_evaluate(loaded, d, &(mpt_evaluate_desc){.batch_size = 7}, &lb) ==
                      MPT_OK,
              "evaluate: %s", mpt_context_error(ctx));
        CHECK(mpt_logs_get(&la, "r2_score") == mpt_logs_get(&lb, "r2_score") &&
                  mpt_logs_get(&la, "auc") == mpt_logs_get(&lb, "auc") &&
                  mpt_logs_get(&la, "weighted_r2_score") == mpt_logs_get(&lb, "weighted_r2_score") &&
                  !isnan(mpt_logs_get(&lb, "auc")),
              "r2_score %.17g / %.17g, auc %.17g / %.17g", mpt_logs_get(&la, "r2_score"),
              mpt_logs_get(&lb, "r2_score"), mpt_logs_get(&la, "auc"), mpt_logs_get(&lb, "auc"));
        mpt_model_destroy(loaded);
    }
    mpt_model_destroy(m);
    mpt_dataset_destroy(d);
}

/* ---- hostile architectures --------------------------------------------------------- */

/* A safetensors file of no tensors whose metadata's architecture is `json`. */
static void write_architecture(const char *path, const char *json) {
    size_t cap = strlen(json) * 6 + 256, n = 0, k;
    char *h = (char *)malloc(cap);
    FILE *f;
    uint64_t len;
    n += (size_t)snprintf(h, cap,
                          "{\"__metadata__\":{\"format\":\"mpt\",\"kind\":\"weights\","
                          "\"architecture\":\"");
    for (k = 0; json[k]; k++) {
        unsigned char c = (unsigned char)json[k];
        if (c == '"' || c == '\\')
            h[n++] = '\\', h[n++] = (char)c;
        else if (c < 0x20)
            n += (size_t)snprintf(h + n, cap - n, "\\u%04x", c);
        else
            h[n++] = (char)c;
    }
    n += (size_t)snprintf(h + n, cap - n, "\"}}");
    while (n % 8) h[n++] = ' ';
    len = n;
    f = fopen(path, "wb");
    fwrite(&len, 8, 1, f); /* little-endian hosts only, as the tests run */
    fwrite(h, 1, n, f);
    fclose(f);
    free(h);
}

#define ONE_DENSE(cfg)                                                                             \
    "{\"format\":\"mpt.h model\",\"version\":1,\"input_shape\":[4],\"policy\":\"float32\","        \
    "\"seed\":0,\"memory_limit\":0,\"max_batch\":2,\"layers\":[{\"class\":\"Dense\","              \
    "\"name\":\"d\",\"inputs\":[0],\"config\":" cfg "}]}"

static void test_hostile_architectures(void) {
    static const struct {
        const char *json, *words;
        mpt_status status;
    } cases[] = {
        {"not json", "byte 0: an unexpected character 'n'", MPT_ERR_FORMAT},
        {"{}", "\"format\" is missing", MPT_ERR_FORMAT},
        {"[1,2", "expected ',' or ']'", MPT_ERR_FORMAT},
        {"{\"format\":\"keras\"}", "not \"mpt.h model\"", MPT_ERR_FORMAT},
        {"{\"format\":\"mpt.h model\",\"format\":1}", "the key \"format\" twice", MPT_ERR_FORMAT},
        {"{\"format\":\"mpt.h model\",\"version\":2}", "\"version\" 2 is not in 1..1",
         MPT_ERR_FORMAT},
        {"{\"a\":\"\\x\"}", "an unknown escape \\x", MPT_ERR_FORMAT},
        {"{\"a\":\"\\ud800\"}", "a malformed \\u escape", MPT_ERR_FORMAT},
        {"{\"a\":\"\\u0000\"}", "a malformed \\u escape", MPT_ERR_FORMAT},
        {"{\"a\":1} x", "more after the document's end", MPT_ERR_FORMAT},
        {"{\"format\":\"mpt.h model\",\"version\":1,\"input_shape\":[4],\"policy\":"
         "\"float32\",\"seed\":0,\"memory_limit\":0,\"max_batch\":2,\"layers\":["
         "{\"call_of\":0,\"inputs\":[0]}]}",
         "its \"call_of\" 0 is not in 0..-1", MPT_ERR_FORMAT},
        {"{\"format\":\"mpt.h model\",\"version\":1,\"input_shape\":[4],\"policy\":"
         "\"float32\",\"seed\":0,\"memory_limit\":0,\"max_batch\":2,\"layers\":["
         "{\"class\":\"Dense\",\"name\":\"d\",\"inputs\":[0],\"config\":{\"units\":4}},"
         "{\"call_of\":0,\"inputs\":[1],\"name\":\"x\"}]}",
         "layer 1 (a call) has no member \"name\"", MPT_ERR_FORMAT},
        {"{\"a\":\"\x97\"}", "invalid UTF-8 byte 0x97", MPT_ERR_FORMAT},
        {"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]",
         "nested more than 32 deep", MPT_ERR_FORMAT},
        {"{\"format\":\"mpt.h model\",\"version\":1,\"input_shape\":[0]}",
         "an input size 0 is not in 1..", MPT_ERR_FORMAT},
        {"{\"format\":\"mpt.h "
         "model\",\"version\":1,\"input_shape\":[4],\"policy\":\"mixed_float8\"}",
         "unknown policy \"mixed_float8\"", MPT_ERR_FORMAT},
        {"{\"format\":\"mpt.h model\",\"version\":1,\"input_shape\":[4],\"policy\":\"float32\","
         "\"seed\":99999999999999999999}",
         "\"seed\" is too large", MPT_ERR_FORMAT},
        {"{\"format\":\"mpt.h model\",\"version\":1,\"input_shape\":[4],\"policy\":\"float32\","
         "\"seed\":0,\"memory_limit\":0,\"max_batch\":2,\"layers\":[]}",
         "\"layers\" is not an array of one layer or more", MPT_ERR_FORMAT},
        {"{\"format\":\"mpt.h model\",\"version\":1,\"input_shape\":[4],\"policy\":\"float32\","
         "\"seed\":0,\"memory_limit\":0,\"max_batch\":2,\"layers\":[{\"class\":\"Conv3D\"}]}",
         "layer 0: unknown class \"Conv3D\"", MPT_ERR_FORMAT},
        {ONE_DENSE("{\"units\":8,\"colour\":1}"), "layer 0 ('d', Dense) has no field \"colour\"",
         MPT_ERR_FORMAT},
        {ONE_DENSE("{\"units\":-5}"), "hostile.safetensors': Dense: units -5",
         MPT_ERR_INVALID_ARGUMENT},
        {ONE_DENSE("{\"units\":1.5}"), "units is not a whole number", MPT_ERR_FORMAT},
        {ONE_DENSE("{\"units\":4,\"activation\":\"swish\"}"),
         "activation \"swish\" is not one this version knows", MPT_ERR_FORMAT},
        {ONE_DENSE("{\"units\":4,\"activation\":3}"), "activation is not a string", MPT_ERR_FORMAT},
        {ONE_DENSE("{\"units\":4,\"no_bias\":99999999999}"), "no_bias 99999999999 is not in",
         MPT_ERR_FORMAT},
        {ONE_DENSE("[]"), "layer 0 ('d', Dense): \"config\" is not an object", MPT_ERR_FORMAT},
        {"{\"format\":\"mpt.h model\",\"version\":1,\"input_shape\":[4],\"policy\":\"float32\","
         "\"seed\":0,\"memory_limit\":0,\"max_batch\":2,\"layers\":[{\"class\":\"Dense\","
         "\"name\":\"d\",\"inputs\":[5],\"config\":{\"units\":2}}]}",
         "an input node 5 is not in 0..0", MPT_ERR_FORMAT},
        {"{\"format\":\"mpt.h model\",\"version\":1,\"input_shape\":[4],\"policy\":\"float32\","
         "\"seed\":0,\"memory_limit\":0,\"max_batch\":2,\"layers\":[{\"class\":\"Add\","
         "\"name\":\"a\",\"inputs\":[0],\"config\":{}}]}",
         "\"inputs\" is not an array of 2..8 nodes", MPT_ERR_FORMAT},
        {"{\"format\":\"mpt.h model\",\"version\":1,\"input_shape\":[4],\"policy\":\"float32\","
         "\"seed\":0,\"memory_limit\":0,\"max_batch\":2,\"layers\":[{\"class\":\"Dropout\","
         "\"name\":\"r\",\"inputs\":[0],\"config\":{\"rate\":1e39}}]}",
         "rate 1e39 is not a finite float", MPT_ERR_FORMAT},
        {"{\"format\":\"mpt.h model\",\"version\":1,\"input_shape\":[4],\"policy\":\"float32\","
         "\"seed\":0,\"memory_limit\":0,\"max_batch\":2,\"layers\":[{\"class\":"
         "\"LayerNormalization\",\"name\":\"n\",\"inputs\":[0],\"config\":{\"epsilon\":-2}}]}",
         "LayerNormalization: epsilon -2 must be > 0", MPT_ERR_INVALID_ARGUMENT},
        {"{\"format\":\"mpt.h model\",\"version\":1,\"input_shape\":[4],\"policy\":\"float32\","
         "\"seed\":0,\"memory_limit\":0,\"max_batch\":2,\"layers\":[{\"class\":\"Dense\","
         "\"name\":\"a\",\"inputs\":[0],\"config\":{\"units\":2}},{\"class\":\"Dense\","
         "\"name\":\"b\",\"inputs\":[0],\"config\":{\"units\":2}}]}",
         "layer 'a' (Dense) does not lead to the output", MPT_ERR_INVALID_ARGUMENT},
        {"{\"format\":\"mpt.h model\",\"version\":1,\"input_shape\":[4],\"policy\":\"float32\","
         "\"seed\":0,\"memory_limit\":0,\"max_batch\":2,\"layers\":[{\"class\":\"Dense\","
         "\"name\":\"a\",\"inputs\":[0],\"config\":{\"units\":2}}],\"compile\":{\"loss.type\":"
         "77}}",
         "loss", MPT_ERR_INVALID_ARGUMENT},
        {"{\"format\":\"mpt.h model\",\"version\":1,\"input_shape\":[4],\"policy\":\"float32\","
         "\"seed\":0,\"memory_limit\":0,\"max_batch\":2,\"layers\":[{\"class\":\"Dense\","
         "\"name\":\"a\",\"inputs\":[0],\"config\":{\"units\":2}}],\"compile\":{\"loss.type\":"
         "3,\"optimizer.exclude_from_weight_decay\":7}}",
         "optimizer.exclude_from_weight_decay is not a string", MPT_ERR_FORMAT},
        {"{\"format\":\"mpt.h model\",\"version\":1,\"input_shape\":[4],\"policy\":\"float32\","
         "\"seed\":0,\"memory_limit\":0,\"max_batch\":2,\"layers\":[{\"class\":\"Dense\","
         "\"name\":\"a\",\"inputs\":[0],\"config\":{\"units\":2}}],\"compile\":{\"loss.type\":"
         "3,\"optimizer.exclude_from_weight_decay\":\"bias,,gamma\"}}",
         "exclude_from_weight_decay \"bias,,gamma\" has an empty item", MPT_ERR_INVALID_ARGUMENT},
    };
    char path[600];
    size_t k;
    path_in(path, sizeof path, "hostile.safetensors");
    for (k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        mpt_model *m = (mpt_model *)&m; /* anything but NULL: load must set it */
        char label[96];
        write_architecture(path, cases[k].json);
        snprintf(label, sizeof label, "architecture %zu", k);
        test_expect_error(ctx, mpt_model_load(ctx, path, &m), cases[k].status, cases[k].words,
                          label);
        CHECK(m == NULL, "%s: out not NULL after a failure", label);
    }
}

static void cases(void) {
    make_blobs();
    TEST_RUN(test_trained_graph_round_trip);
    TEST_RUN(test_every_layer_round_trip);
    TEST_RUN(test_ids_layers_round_trip);
    TEST_RUN(test_uncompiled_and_weights_only);
    TEST_RUN(test_r2_score_and_auc_kept);
    TEST_RUN(test_hostile_architectures);
}

int main(void) {
    test_program p;
    memset(&p, 0, sizeof p);
    p.name = "test_model_files";
    p.ctx = &ctx;
    p.threads = 2;
    p.seed = 8;
    p.tmpdir = dir;
    p.tmpdir_size = sizeof dir;
    p.keep_env = "MPT_KEEP_TEST_FILES";
    p.cases = cases;
    return test_main(&p);
}
