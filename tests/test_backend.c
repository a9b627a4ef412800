/* The backend table as a GPU model uses it, tested on the CPU: a "device"
   backend that runs the CPU's own functions but keeps the model's buffers
   apart from the host's makes mpt.h take every path a CUDA model takes —
   batches staged in pinned memory and uploaded on the second queue into
   two alternating buffers, targets uploaded, outputs and training scalars
   downloaded, checkpoints through a host mirror, EarlyStopping's weight
   copies, the GEMM timing pass. Since the arithmetic is the CPU's, a model
   trained there must end bit for bit where the same model ends on the CPU
   backend; a mistake in the staging (a stale buffer, a lost tally, a
   missed push or pull) shows up as a difference.

   The device's memory is kept honest: every allocation is tracked, and
   the test checks that the model reads and writes host buffers only
   through upload/download (a host pointer reaching a compute function is
   a failure). */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "helpers.h"

static mpt_context *ctx;

/* ---- the emulated device ---------------------------------------------------- */

enum { MAX_BLOCKS = 256 };

typedef struct device_memory {
    struct {
        unsigned char *base;
        size_t bytes;
    } block[MAX_BLOCKS];
    int n;
    long uploads_async, waits, plans, stray; /* stray: host pointers given to kernels */
} device_memory;

static device_memory dev;

static int on_device(const void *p) {
    int i;
    if (!p) return 1;
    for (i = 0; i < dev.n; i++)
        if ((const unsigned char *)p >= dev.block[i].base &&
            (const unsigned char *)p < dev.block[i].base + dev.block[i].bytes)
            return 1;
    return 0;
}

static void expect_device(const void *p) {
    if (!on_device(p)) dev.stray++;
}

static mpt_status emu_alloc(void *impl, int category, size_t bytes, void **out) {
    mpt_status s = mpt__cpu_backend()->alloc(impl, category, bytes, out);
    if (s == MPT_OK && *out && dev.n < MAX_BLOCKS) {
        dev.block[dev.n].base = (unsigned char *)*out;
        dev.block[dev.n].bytes = bytes;
        dev.n++;
    }
    return s;
}

static void emu_free(void *impl, int category, void *ptr) {
    int i;
    for (i = 0; ptr && i < dev.n; i++)
        if (dev.block[i].base == ptr) {
            dev.block[i] = dev.block[--dev.n];
            break;
        }
    mpt__cpu_backend()->free(impl, category, ptr);
}

static mpt_status emu_upload(void *impl, void *dst, const void *src, size_t bytes) {
    expect_device(dst);
    return mpt__cpu_backend()->upload(impl, dst, src, bytes);
}

static mpt_status emu_download(void *impl, void *dst, const void *src, size_t bytes) {
    expect_device(src);
    return mpt__cpu_backend()->download(impl, dst, src, bytes);
}

static void emu_upload_async(void *impl, void *dst, const void *src, size_t bytes) {
    expect_device(dst);
    dev.uploads_async++;
    mpt__cpu_backend()->upload_async(impl, dst, src, bytes);
}

static void emu_upload_wait(void *impl) {
    (void)impl;
    dev.waits++;
}

static void emu_gemm(void *impl, const mpt_gemm_desc *d, mpt_dtype c_dtype) {
    expect_device(d->a);
    expect_device(d->b);
    expect_device(d->c);
    mpt__cpu_backend()->gemm(impl, d, c_dtype);
}

static mpt_status emu_gemm_plan(void *impl, const mpt_gemm_desc *d, mpt_dtype c_dtype) {
    (void)impl;
    (void)c_dtype;
    expect_device(d->a);
    dev.plans++;
    return MPT_OK;
}

static void emu_convert(void *impl, mpt_dtype dd, void *dst, mpt_dtype sd, const void *src,
                        int64_t n) {
    expect_device(dst);
    expect_device(src);
    mpt__cpu_backend()->convert(impl, dd, dst, sd, src, n);
}

static void emu_loss(void *impl, const mpt_loss_args *a) {
    expect_device(a->pred);
    expect_device(a->target);
    expect_device(a->dpred);
    expect_device(a->state);
    mpt__cpu_backend()->loss(impl, a);
}

static void emu_update(void *impl, const mpt_update_args *u) {
    int k;
    for (k = 0; k < u->n; k++) {
        expect_device(u->value[k]);
        expect_device(u->grad[k]);
        expect_device(u->slot0[k]);
    }
    expect_device(u->state);
    mpt__cpu_backend()->update(impl, u);
}

static mpt_backend emu_table;

/* Puts the emulated device under ctx (models created afterwards use it). */
static void use_emulated_device(mpt_context *c) {
    emu_table = *mpt__cpu_backend();
    emu_table.name = "emulated";
    emu_table.alloc = emu_alloc;
    emu_table.free = emu_free;
    emu_table.upload = emu_upload;
    emu_table.download = emu_download;
    emu_table.upload_async = emu_upload_async;
    emu_table.upload_wait = emu_upload_wait;
    emu_table.gemm = emu_gemm;
    emu_table.gemm_plan = emu_gemm_plan;
    emu_table.convert = emu_convert;
    emu_table.loss = emu_loss;
    emu_table.update = emu_update;
    c->backend = &emu_table;
}

/* ---- a small image model and data -------------------------------------------- */

enum { N = 120, SIDE = 8, CLASSES = 4, BATCH = 32 };

static float xs[N * SIDE * SIDE];
static int32_t ys[N];

/* Class c: a bright square in quadrant c, on noise. */
static void make_images(void) {
    int i, r, q;
    test_seed(7);
    for (i = 0; i < N; i++) {
        ys[i] = i % CLASSES;
        for (r = 0; r < SIDE; r++)
            for (q = 0; q < SIDE; q++) {
                int in = (r < SIDE / 2) == (ys[i] < 2) && (q < SIDE / 2) == (ys[i] % 2 == 0);
                xs[(i * SIDE + r) * SIDE + q] = (float)test_uniform(0, 0.5) + (in ? 0.7f : 0);
            }
    }
}

static mpt_dataset *image_dataset(mpt_context *c) {
    mpt_tensor tx, ty;
    mpt_dataset *d = NULL;
    mpt_tensor_wrap(c, &tx, MPT_FLOAT32, 4, (int64_t[]){N, SIDE, SIDE, 1}, xs);
    mpt_tensor_wrap(c, &ty, MPT_INT32, 1, (int64_t[]){N}, ys);
    CHECK(mpt_dataset_create(c, &(mpt_dataset_desc){.x = &tx, .y = &ty}, &d) == MPT_OK,
          "dataset: %s", mpt_context_error(c));
    return d;
}

/* Conv2D(4, 3, relu) -> BatchNormalization -> MaxPooling2D -> Flatten ->
   Dropout(0.25) -> Dense(4, softmax), compiled with Adam. */
static mpt_model *image_model_with(mpt_context *c, mpt_policy policy, mpt_strategy *s) {
    mpt_model *m = NULL;
    mpt_model_create(c, &(mpt_model_desc){.input_shape = {SIDE, SIDE, 1}, .input_rank = 3,
                                          .policy = policy, .seed = 11, .strategy = s}, &m);
    mpt_model_add_conv2d(m, &(mpt_conv2d_desc){.filters = 4, .kernel_size = {3, 3},
                                               .activation = MPT_ACT_RELU});
    mpt_model_add_batch_normalization(m, &(mpt_batchnorm_desc){0});
    mpt_model_add_max_pooling2d(m, &(mpt_pool2d_desc){0});
    mpt_model_add_flatten(m, NULL);
    mpt_model_add_dropout(m, &(mpt_dropout_desc){.rate = 0.25f});
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = CLASSES, .activation = MPT_ACT_SOFTMAX});
    CHECK(mpt_model_compile(m, &(mpt_compile_desc){
              .optimizer = {.learning_rate = 0.01f},
              .loss = {.type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY},
              .metrics = MPT_METRIC_ACCURACY}) == MPT_OK,
          "compile: %s", mpt_context_error(c));
    return m;
}

static mpt_model *image_model(mpt_context *c, mpt_policy policy) {
    return image_model_with(c, policy, NULL);
}

static int same_params(const mpt_model *a, const mpt_model *b) {
    int i, s;
    for (i = 0; i < a->n_params; i++) {
        const mpt__param *p = &a->params[i], *q = &b->params[i];
        if (memcmp(p->value, q->value, sizeof(float) * (size_t)p->count)) return 0;
        for (s = 0; s < a->n_slots; s++)
            if (p->slot[s] && memcmp(p->slot[s], q->slot[s], sizeof(float) * (size_t)p->count))
                return 0;
    }
    return a->optimizer_steps == b->optimizer_steps && a->loss_scale == b->loss_scale &&
           a->step == b->step && a->skipped_steps == b->skipped_steps;
}

static int same_history(const mpt_model *a, const mpt_model *b) {
    mpt_history ha, hb;
    int k, e;
    mpt_model_history(a, &ha);
    mpt_model_history(b, &hb);
    if (ha.epochs != hb.epochs || ha.n_keys != hb.n_keys) return 0;
    for (k = 0; k < ha.n_keys; k++) {
        if (strstr(ha.keys[k], "second") || strstr(ha.keys[k], "ms_per_step")) continue; /* times */
        for (e = 0; e < ha.epochs; e++)
            if (ha.values[k][e] != hb.values[k][e]) return 0;
    }
    return 1;
}

/* ---- the tests ------------------------------------------------------------------ */

/* fit, evaluate and predict on the emulated device equal the CPU's, bit for
   bit, in each policy; the batches went up by the asynchronous path. */
static void test_fit_matches_the_cpu(void) {
    mpt_policy policies[3] = {MPT_POLICY_FLOAT32, MPT_POLICY_MIXED_FLOAT16,
                              MPT_POLICY_MIXED_BFLOAT16};
    int k;
    for (k = 0; k < 3; k++) {
        mpt_context *dc = NULL;
        mpt_model *cpu, *gpu;
        mpt_dataset *d_cpu, *d_gpu;
        mpt_tensor p_cpu, p_gpu;
        mpt_logs l_cpu, l_gpu;
        mpt_fit_desc fit;
        memset(&dev, 0, sizeof dev);
        mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &dc);
        use_emulated_device(dc);
        d_cpu = image_dataset(ctx);
        d_gpu = image_dataset(dc);
        cpu = image_model(ctx, policies[k]);
        gpu = image_model(dc, policies[k]);
        memset(&fit, 0, sizeof fit);
        fit.epochs = 3;
        fit.batch_size = BATCH; /* 120 = 3 full batches and one of 24 */
        fit.validation_split = 0.2f;
        CHECK(mpt_model_fit(cpu, d_cpu, &fit) == MPT_OK, "cpu fit: %s", mpt_context_error(ctx));
        CHECK(mpt_model_fit(gpu, d_gpu, &fit) == MPT_OK, "device fit: %s",
              mpt_context_error(dc));
        CHECK(same_params(cpu, gpu), "policy %d: weights differ after fit", k);
        CHECK(same_history(cpu, gpu), "policy %d: histories differ", k);
        CHECK(mpt_model_evaluate(cpu, d_cpu, &(mpt_evaluate_desc){.batch_size = 50}, &l_cpu) ==
                      MPT_OK &&
                  mpt_model_evaluate(gpu, d_gpu, &(mpt_evaluate_desc){.batch_size = 50},
                                     &l_gpu) == MPT_OK,
              "evaluate: %s / %s", mpt_context_error(ctx), mpt_context_error(dc));
        CHECK(mpt_logs_get(&l_cpu, "loss") == mpt_logs_get(&l_gpu, "loss") &&
                  mpt_logs_get(&l_cpu, "accuracy") == mpt_logs_get(&l_gpu, "accuracy"),
              "policy %d: evaluate %g/%g vs %g/%g", k, mpt_logs_get(&l_cpu, "loss"),
              mpt_logs_get(&l_cpu, "accuracy"), mpt_logs_get(&l_gpu, "loss"),
              mpt_logs_get(&l_gpu, "accuracy"));
        CHECK(mpt_model_predict(cpu, d_cpu, 50, &p_cpu) == MPT_OK &&
                  mpt_model_predict(gpu, d_gpu, 50, &p_gpu) == MPT_OK,
              "predict: %s / %s", mpt_context_error(ctx), mpt_context_error(dc));
        CHECK(mpt_tensor_bytes(&p_cpu) == mpt_tensor_bytes(&p_gpu) &&
                  !memcmp(p_cpu.data, p_gpu.data, mpt_tensor_bytes(&p_cpu)),
              "policy %d: predictions differ", k);
        /* 96 training samples = 3 batches per epoch, each uploaded as x and y */
        CHECK(dev.uploads_async == 3 * 3 * 2 && dev.waits == 3 * 3,
              "policy %d: %ld asynchronous uploads, %ld waits (want 18, 9)", k,
              dev.uploads_async, dev.waits);
        CHECK(dev.plans > 0, "policy %d: no GEMM was timed before the first step", k);
        CHECK(dev.stray == 0, "policy %d: %ld host pointers reached the device's functions", k,
              dev.stray);
        mpt_tensor_free(ctx, &p_cpu);
        mpt_tensor_free(dc, &p_gpu);
        mpt_model_destroy(cpu);
        mpt_model_destroy(gpu);
        mpt_dataset_destroy(d_cpu);
        mpt_dataset_destroy(d_gpu);
        CHECK(dev.n == 0, "policy %d: %d device blocks leaked", k, dev.n);
        mpt_context_destroy(dc);
    }
}

/* A checkpoint saved from the device and loaded on the CPU (and back)
   carries every weight, moment and counter; training on continues alike. */
static void test_checkpoints_cross(void) {
    const char *path = "build/test_backend.safetensors";
    mpt_context *dc = NULL;
    mpt_model *gpu, *cpu, *back;
    mpt_dataset *d_cpu, *d_gpu;
    mpt_fit_desc fit;
    memset(&dev, 0, sizeof dev);
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &dc);
    use_emulated_device(dc);
    d_cpu = image_dataset(ctx);
    d_gpu = image_dataset(dc);
    gpu = image_model(dc, MPT_POLICY_MIXED_FLOAT16);
    cpu = image_model(ctx, MPT_POLICY_MIXED_FLOAT16);
    back = image_model(dc, MPT_POLICY_MIXED_FLOAT16);
    memset(&fit, 0, sizeof fit);
    fit.epochs = 2;
    fit.batch_size = BATCH;
    CHECK(mpt_model_fit(gpu, d_gpu, &fit) == MPT_OK, "fit: %s", mpt_context_error(dc));
    CHECK(mpt_model_save_checkpoint(gpu, path) == MPT_OK, "save: %s", mpt_context_error(dc));
    CHECK(mpt_model_build(cpu, BATCH) == MPT_OK && mpt_model_load_checkpoint(cpu, path) == MPT_OK,
          "load on the CPU: %s", mpt_context_error(ctx));
    CHECK(same_params(cpu, gpu), "the CPU's copy differs from the device's");
    CHECK(mpt_model_save_checkpoint(cpu, path) == MPT_OK, "save: %s", mpt_context_error(ctx));
    CHECK(mpt_model_build(back, BATCH) == MPT_OK && mpt_model_load_checkpoint(back, path) == MPT_OK,
          "load on the device: %s", mpt_context_error(dc));
    CHECK(same_params(back, gpu), "the round trip changed the state");
    fit.initial_epoch = 2;
    fit.epochs = 3;
    CHECK(mpt_model_fit(gpu, d_gpu, &fit) == MPT_OK && mpt_model_fit(cpu, d_cpu, &fit) == MPT_OK,
          "resume: %s / %s", mpt_context_error(dc), mpt_context_error(ctx));
    CHECK(same_params(cpu, gpu), "resumed runs diverge");
    CHECK(dev.stray == 0, "%ld host pointers reached the device's functions", dev.stray);
    remove(path);
    mpt_model_destroy(gpu);
    mpt_model_destroy(cpu);
    mpt_model_destroy(back);
    mpt_dataset_destroy(d_cpu);
    mpt_dataset_destroy(d_gpu);
    mpt_context_destroy(dc);
}

/* EarlyStopping restoring the best weights works through downloads and
   uploads: the device's model ends where the CPU's does. */
static void test_early_stopping_restores(void) {
    mpt_context *dc = NULL;
    mpt_model *gpu, *cpu;
    mpt_dataset *d_cpu, *d_gpu;
    mpt_callback cb_cpu, cb_gpu;
    mpt_fit_desc fit;
    mpt_early_stopping_desc es;
    memset(&dev, 0, sizeof dev);
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &dc);
    use_emulated_device(dc);
    d_cpu = image_dataset(ctx);
    d_gpu = image_dataset(dc);
    gpu = image_model(dc, MPT_POLICY_FLOAT32);
    cpu = image_model(ctx, MPT_POLICY_FLOAT32);
    memset(&es, 0, sizeof es);
    es.monitor = "val_loss";
    es.patience = 1;
    es.restore_best_weights = 1;
    es.min_delta = 10; /* nothing counts as an improvement: stops after epoch 2 */
    CHECK(mpt_callback_early_stopping(ctx, &es, &cb_cpu) == MPT_OK &&
              mpt_callback_early_stopping(dc, &es, &cb_gpu) == MPT_OK,
          "callback: %s", mpt_context_error(ctx));
    memset(&fit, 0, sizeof fit);
    fit.epochs = 5;
    fit.batch_size = BATCH;
    fit.validation_split = 0.25f;
    fit.callbacks = &cb_cpu;
    fit.n_callbacks = 1;
    CHECK(mpt_model_fit(cpu, d_cpu, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    fit.callbacks = &cb_gpu;
    CHECK(mpt_model_fit(gpu, d_gpu, &fit) == MPT_OK, "fit: %s", mpt_context_error(dc));
    CHECK(mpt_model_epoch(cpu) == 2 && mpt_model_epoch(gpu) == 2, "stopped after %d / %d epochs",
          mpt_model_epoch(cpu), mpt_model_epoch(gpu));
    CHECK(same_params(cpu, gpu), "restored weights differ");
    CHECK(dev.stray == 0, "%ld host pointers reached the device's functions", dev.stray);
    mpt_callback_destroy(&cb_cpu);
    mpt_callback_destroy(&cb_gpu);
    mpt_model_destroy(gpu);
    mpt_model_destroy(cpu);
    mpt_dataset_destroy(d_cpu);
    mpt_dataset_destroy(d_gpu);
    mpt_context_destroy(dc);
}

/* The public step functions take host tensors on a device model: the
   input and the output gradient go up, the views say where they live. */
static void test_public_steps_on_the_device(void) {
    mpt_context *dc = NULL;
    mpt_model *gpu, *cpu;
    mpt_tensor x, out_g, out_c, dout;
    mpt_param_info info;
    static float dy[BATCH * CLASSES];
    int i;
    memset(&dev, 0, sizeof dev);
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &dc);
    use_emulated_device(dc);
    gpu = image_model(dc, MPT_POLICY_MIXED_BFLOAT16);
    cpu = image_model(ctx, MPT_POLICY_MIXED_BFLOAT16);
    CHECK(mpt_model_build(gpu, BATCH) == MPT_OK && mpt_model_build(cpu, BATCH) == MPT_OK,
          "build: %s", mpt_context_error(dc));
    mpt_tensor_wrap(ctx, &x, MPT_FLOAT32, 4, (int64_t[]){BATCH, SIDE, SIDE, 1}, xs);
    for (i = 0; i < BATCH * CLASSES; i++) dy[i] = (float)test_uniform(-1, 1);
    mpt_tensor_wrap(ctx, &dout, MPT_FLOAT32, 2, (int64_t[]){BATCH, CLASSES}, dy);
    CHECK(mpt_model_forward(gpu, &x, 1, &out_g) == MPT_OK &&
              mpt_model_forward(cpu, &x, 1, &out_c) == MPT_OK,
          "forward: %s", mpt_context_error(dc));
    CHECK(out_g.device == MPT_DEVICE_CUDA && out_c.device == MPT_DEVICE_CPU,
          "output views on devices %d and %d", (int)out_g.device, (int)out_c.device);
    CHECK(!memcmp(out_g.data, out_c.data, mpt_tensor_bytes(&out_c)), "outputs differ");
    CHECK(mpt_model_backward(gpu, &dout, NULL) == MPT_OK &&
              mpt_model_backward(cpu, &dout, NULL) == MPT_OK,
          "backward: %s", mpt_context_error(dc));
    for (i = 0; i < mpt_model_param_count(cpu); i++) {
        mpt_param_info ic;
        mpt_model_param(gpu, i, &info);
        mpt_model_param(cpu, i, &ic);
        CHECK(info.value.device == MPT_DEVICE_CUDA, "%s: value on device %d", info.name,
              (int)info.value.device);
        if (info.trainable)
            CHECK(!memcmp(info.grad.data, ic.grad.data, mpt_tensor_bytes(&ic.grad)),
                  "%s: gradients differ", info.name);
    }
    CHECK(dev.stray == 0, "%ld host pointers reached the device's functions", dev.stray);
    mpt_model_destroy(gpu);
    mpt_model_destroy(cpu);
    mpt_context_destroy(dc);
}

/* Two mirrored replicas on the device (each with its own staging buffers,
   uploads and GEMM timing) end bit for bit where two replicas end on the
   CPU. */
static void test_mirrored_on_the_device(void) {
    mpt_context *dc = NULL;
    mpt_strategy *s_cpu = NULL, *s_dev = NULL;
    mpt_model *cpu, *gpu;
    mpt_dataset *d_cpu, *d_gpu;
    mpt_fit_desc fit;
    memset(&dev, 0, sizeof dev);
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &dc);
    use_emulated_device(dc);
    CHECK(mpt_strategy_create(ctx, &(mpt_strategy_desc){.type = MPT_STRATEGY_MIRRORED,
                                                        .num_replicas = 2}, &s_cpu) == MPT_OK &&
              mpt_strategy_create(dc, &(mpt_strategy_desc){.type = MPT_STRATEGY_MIRRORED,
                                                           .num_replicas = 2}, &s_dev) == MPT_OK,
          "strategy: %s / %s", mpt_context_error(ctx), mpt_context_error(dc));
    d_cpu = image_dataset(ctx);
    d_gpu = image_dataset(dc);
    cpu = image_model_with(ctx, MPT_POLICY_MIXED_FLOAT16, s_cpu);
    gpu = image_model_with(dc, MPT_POLICY_MIXED_FLOAT16, s_dev);
    memset(&fit, 0, sizeof fit);
    fit.epochs = 2;
    fit.batch_size = BATCH;
    CHECK(mpt_model_fit(cpu, d_cpu, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(gpu, d_gpu, &fit) == MPT_OK, "fit: %s", mpt_context_error(dc));
    CHECK(same_params(cpu, gpu) && same_params(cpu->replica[1], gpu->replica[1]),
          "replicated weights differ between the CPU and the device");
    CHECK(same_history(cpu, gpu), "histories differ");
    CHECK(dev.plans > 0, "the replicas' GEMMs were not timed");
    CHECK(dev.stray == 0, "%ld host pointers reached the device's functions", dev.stray);
    mpt_model_destroy(gpu);
    mpt_model_destroy(cpu);
    mpt_dataset_destroy(d_cpu);
    mpt_dataset_destroy(d_gpu);
    mpt_strategy_destroy(s_cpu);
    mpt_strategy_destroy(s_dev);
    CHECK(dev.n == 0, "%d device blocks leaked", dev.n);
    mpt_context_destroy(dc);
}

/* ---- what both backends run: @backend-shared --------------------------------- */

/* Philox4x32-10 against Random123's known-answer vectors (kat_vectors:
   ctr[0..3], key[0..1] -> out[0..3]). mpt_philox4x32's counter_lo holds
   ctr[0] (low half) and ctr[1], counter_hi ctr[2] and ctr[3], the key
   key[0] and key[1]. */
static void test_philox_known_answers(void) {
    static const uint32_t kat[3][10] = {
        {0, 0, 0, 0, 0, 0, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
        {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0x408f276d,
         0x41c83b0e, 0xa20bc7c6, 0x6d5451fd},
        {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0, 0xd16cfe09,
         0x94fdcceb, 0x5001e420, 0x24126ea1}};
    int v, w;
    for (v = 0; v < 3; v++) {
        const uint32_t *t = kat[v];
        uint64_t lo = t[0] | (uint64_t)t[1] << 32, hi = t[2] | (uint64_t)t[3] << 32;
        uint64_t key = t[4] | (uint64_t)t[5] << 32;
        uint32_t out[4];
        mpt_philox4x32(key, hi, lo, out);
        for (w = 0; w < 4; w++)
            CHECK(out[w] == t[6 + w], "vector %d word %d: %08x, Random123 says %08x", v, w,
                  (unsigned)out[w], (unsigned)t[6 + w]);
    }
}

/* Every required slot of the CPU's table is filled (@backend). */
static void test_cpu_table_is_complete(void) {
    const mpt_backend *t = mpt_context_backend(ctx, NULL);
    const char *gap = backend_table_gap(t);
    CHECK(!strcmp(t->name, "cpu"), "the context's backend is \"%s\", not the CPU's", t->name);
    CHECK(!gap, "the CPU's table: %s", gap);
    CHECK(!t->comm_create, "the CPU's table has collectives");
}

int main(void) {
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &ctx);
    make_images();
    TEST_RUN(test_philox_known_answers);
    TEST_RUN(test_cpu_table_is_complete);
    TEST_RUN(test_fit_matches_the_cpu);
    TEST_RUN(test_checkpoints_cross);
    TEST_RUN(test_early_stopping_restores);
    TEST_RUN(test_public_steps_on_the_device);
    TEST_RUN(test_mirrored_on_the_device);
    mpt_context_destroy(ctx);
    return test_summary("test_backend");
}
