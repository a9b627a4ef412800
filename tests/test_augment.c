/* RandomFlip and RandomTranslation: Keras' semantics on small hand-made
   images (each fill mode, both interpolations, against values worked out
   by hand), the draws' rule (Philox per sample and step), identity at
   inference, 1 and 2 threads alike, gradients against finite differences
   in double, 2 mirrored replicas against 1, model files, and bad
   descriptors. */
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "gradcheck.h"

static mpt_context *ctx;

/* A model of one RandomTranslation (or RandomFlip when t is NULL) on
   (h, w, ch) images, built for `batch`. */
static mpt_model *augment_model(mpt_context *c, int64_t h, int64_t w, int64_t ch,
                                const mpt_random_translation_desc *t,
                                const mpt_random_flip_desc *f, int64_t batch) {
    mpt_model *m = NULL;
    mpt_status s = mpt_model_create(c, &(mpt_model_desc){.input_shape = {h, w, ch},
                                                         .input_rank = 3, .seed = 11}, &m);
    if (s == MPT_OK) s = t ? mpt_model_add_random_translation(m, t) : mpt_model_add_random_flip(m, f);
    if (s == MPT_OK) s = mpt_model_build(m, batch);
    CHECK(s == MPT_OK, "model: %s", mpt_context_error(c));
    if (s != MPT_OK) {
        mpt_model_destroy(m);
        return NULL;
    }
    return m;
}

/* Forward of x (batch samples) at `step`, y as float32 into out. */
static void run_forward(mpt_model *m, int64_t batch, uint64_t step, const float *x, float *out,
                        int training) {
    mpt_tensor tx, ty;
    int64_t shape[4];
    int rank = mpt_model_input_shape(m, shape + 1);
    shape[0] = batch;
    m->step = step;
    mpt_tensor_wrap(m->ctx, &tx, MPT_FLOAT32, rank + 1, shape, (void *)x);
    CHECK(mpt_model_forward(m, &tx, training, &ty) == MPT_OK, "forward: %s",
          mpt_context_error(m->ctx));
    mpt_convert(m->ctx, MPT_FLOAT32, out, ty.dtype, ty.data, mpt_tensor_count(&ty));
}

static int same_floats(const float *a, const float *b, int64_t n) {
    return memcmp(a, b, sizeof(float) * (size_t)n) == 0;
}

/* ---- RandomTranslation's known answers ------------------------------------------ */

/* One row [1 2 3 4] (H = 1, W = 4) shifted by a fixed dx (width_factor
   {f, f} draws f · W every time), in each fill mode and interpolation:
   Keras' patterns, reflect (d c b a | a b c d | d c b a), wrap
   (a b c d | a b c d | a b c d), nearest (a a a a | a b c d | d d d d),
   constant (k k k k | a b c d | k k k k), k = 9. */
typedef struct translate_case {
    float factor;      /* of W = 4: dx = 4 · factor                  */
    mpt_fill_mode fill;
    mpt_interpolation interp;
    float want[4];
} translate_case;

static void test_translation_row_known_answers(void) {
    static const translate_case cases[] = {
        /* dx = 2: output j reads j − 2: −2, −1, 0, 1 */
        {0.5f, MPT_FILL_REFLECT, MPT_INTERPOLATION_BILINEAR, {2, 1, 1, 2}},
        {0.5f, MPT_FILL_WRAP, MPT_INTERPOLATION_BILINEAR, {3, 4, 1, 2}},
        {0.5f, MPT_FILL_NEAREST, MPT_INTERPOLATION_BILINEAR, {1, 1, 1, 2}},
        {0.5f, MPT_FILL_CONSTANT, MPT_INTERPOLATION_BILINEAR, {9, 9, 1, 2}},
        {0.5f, MPT_FILL_REFLECT, MPT_INTERPOLATION_NEAREST, {2, 1, 1, 2}},
        /* dx = −2: output j reads j + 2: 2, 3, 4, 5 */
        {-0.5f, MPT_FILL_REFLECT, MPT_INTERPOLATION_BILINEAR, {3, 4, 4, 3}},
        {-0.5f, MPT_FILL_WRAP, MPT_INTERPOLATION_BILINEAR, {3, 4, 1, 2}},
        {-0.5f, MPT_FILL_NEAREST, MPT_INTERPOLATION_BILINEAR, {3, 4, 4, 4}},
        {-0.5f, MPT_FILL_CONSTANT, MPT_INTERPOLATION_NEAREST, {3, 4, 9, 9}},
        /* dx = 0.5: output j reads j − 0.5: −0.5, 0.5, 1.5, 2.5. Bilinear
           takes the two pixels around it; reflect and nearest map −0.5 to 0
           (between the first pixel and its reflection: the first pixel),
           constant reads 9 for the pixel at −1 */
        {0.125f, MPT_FILL_REFLECT, MPT_INTERPOLATION_BILINEAR, {1, 1.5f, 2.5f, 3.5f}},
        {0.125f, MPT_FILL_NEAREST, MPT_INTERPOLATION_BILINEAR, {1, 1.5f, 2.5f, 3.5f}},
        {0.125f, MPT_FILL_CONSTANT, MPT_INTERPOLATION_BILINEAR, {5, 1.5f, 2.5f, 3.5f}},
        /* nearest rounds halves away from zero: −1, 1, 2, 3 */
        {0.125f, MPT_FILL_CONSTANT, MPT_INTERPOLATION_NEAREST, {9, 2, 3, 4}},
        /* dx = −0.75: j + 0.75: 0.75, 1.75, 2.75, 3.75 (constant: 3.75 is
           0.25 · 4 + 0.75 · 9; wrap: it lies between the last pixel and
           its wrap, 3.75 − 4 is clamped to 0: the first) */
        {-0.1875f, MPT_FILL_CONSTANT, MPT_INTERPOLATION_BILINEAR, {1.75f, 2.75f, 3.75f, 7.75f}},
        {-0.1875f, MPT_FILL_WRAP, MPT_INTERPOLATION_BILINEAR, {1.75f, 2.75f, 3.75f, 1}},
        /* shifts of most of the row, where TensorFlow's wrap (dividing by
           len − 1) leaves the pattern: dx = −3 reads 3, 4, 5, 6: 6 − 4·2
           is clamped to 0; dx = 3.6 reads −3.6 .. −0.6: −3.6 gets two
           periods (4.4, clamped to 3), the others one: 1.4, 2.4, 3.4
           (clamped to 3) */
        {-0.75f, MPT_FILL_WRAP, MPT_INTERPOLATION_BILINEAR, {4, 1, 2, 1}},
        {0.9f, MPT_FILL_WRAP, MPT_INTERPOLATION_BILINEAR, {4, 2.4f, 3.4f, 4}},
        {-1.0f, MPT_FILL_WRAP, MPT_INTERPOLATION_BILINEAR, {1, 2, 1, 1}},
        /* reflect over a whole period: dx = −3.2 reads 3.2 .. 6.2, as
           3.8 − j (8 − 1 − c), clamped to 3 first; dx = 4 reverses the row */
        {-0.8f, MPT_FILL_REFLECT, MPT_INTERPOLATION_BILINEAR, {4, 3.8f, 2.8f, 1.8f}},
        {1.0f, MPT_FILL_REFLECT, MPT_INTERPOLATION_BILINEAR, {4, 3, 2, 1}},
    };
    const float x[4] = {1, 2, 3, 4};
    size_t k;
    for (k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        const translate_case *t = &cases[k];
        float y[4];
        mpt_model *m = augment_model(ctx, 1, 4, 1, &(mpt_random_translation_desc){
            .width_factor = {t->factor, t->factor}, .fill_mode = t->fill,
            .interpolation = t->interp, .fill_value = 9}, NULL, 1);
        if (!m) return;
        run_forward(m, 1, 0, x, y, 1);
        CHECK(fabsf(y[0] - t->want[0]) <= 1e-6f && fabsf(y[1] - t->want[1]) <= 1e-6f &&
                  fabsf(y[2] - t->want[2]) <= 1e-6f && fabsf(y[3] - t->want[3]) <= 1e-6f,
              "case %d (dx %g, fill %d, interpolation %d): got %g %g %g %g, want %g %g %g %g",
              (int)k, 4.0 * t->factor, (int)t->fill, (int)t->interp, y[0], y[1], y[2], y[3],
              t->want[0], t->want[1], t->want[2], t->want[3]);
        mpt_model_destroy(m);
    }
}

/* A (3, 3, 2) image shifted down by 1 and left by 1 (dy = 1, dx = −1,
   constant fill 0): output (i, j) reads (i − 1, j + 1), both channels;
   then reflected, the column past the right edge reads the last one and
   the row above the top the first. */
static void test_translation_image_known_answer(void) {
    float x[18], y[18];
    /* channel 0: 1..9 row by row; channel 1: −(1..9) */
    static const float want_constant[18] = {0, 0, 0, 0, 0, 0,  2, -2, 3, -3, 0, 0,
                                            5, -5, 6, -6, 0, 0};
    static const float want_reflect[18] = {2, -2, 3, -3, 3, -3, 2, -2, 3, -3, 3, -3,
                                           5, -5, 6, -6, 6, -6};
    int i, fill;
    for (i = 0; i < 9; i++) x[2 * i] = (float)(i + 1), x[2 * i + 1] = -(float)(i + 1);
    for (fill = 0; fill < 2; fill++) {
        mpt_model *m = augment_model(ctx, 3, 3, 2, &(mpt_random_translation_desc){
            .height_factor = {1.0f / 3, 1.0f / 3}, .width_factor = {-1.0f / 3, -1.0f / 3},
            .fill_mode = fill ? MPT_FILL_REFLECT : MPT_FILL_CONSTANT}, NULL, 1);
        if (!m) return;
        run_forward(m, 1, 0, x, y, 1);
        CHECK(memcmp(y, fill ? want_reflect : want_constant, sizeof y) == 0,
              "%s: y[0..5] %g %g %g %g %g %g", fill ? "reflect" : "constant", y[0], y[1], y[2],
              y[3], y[4], y[5]);
        mpt_model_destroy(m);
    }
}

/* ---- the draws ---------------------------------------------------------------- */

/* The documented rule: sample g's words are Philox(key, (step, g)); a
   shift is (lower + u · (upper − lower)) · side with u word 0 (height) or
   1 (width) as a 24-bit uniform. */
static float ref_shift(uint64_t key, uint64_t step, int64_t g, int word, float lo, float hi,
                       int64_t side) {
    uint32_t r[4];
    mpt_philox4x32(key, step, (uint64_t)g, r);
    return (lo + (float)(r[word] >> 8) / 16777216.0f * (hi - lo)) * (float)side;
}

/* Shifts follow the rule (a reversed pair is sorted, as Keras sorts it),
   lie in the range, differ between samples and between steps, and a step
   repeated gives the same ones. */
static void test_translation_draws(void) {
    enum { B = 64, H = 10, W = 20 };
    mpt_model *m = augment_model(ctx, H, W, 1, &(mpt_random_translation_desc){
        .height_factor = {0.3f, -0.2f}, .width_factor = {-0.1f, 0.1f}}, NULL, B);
    float *x = (float *)malloc(sizeof(float) * B * H * W), *a = (float *)malloc(sizeof(float) * B * H * W),
          *b = (float *)malloc(sizeof(float) * B * H * W), s3[2 * B];
    int64_t i, wrong = 0, outside = 0, same = 0;
    if (!m) return;
    for (i = 0; i < B * H * W; i++) x[i] = (float)test_uniform(-1, 1);
    run_forward(m, B, 3, x, a, 1);
    memcpy(s3, m->layers[0].saved[0], sizeof s3);
    for (i = 0; i < B; i++) {
        float dy = ref_shift(m->layers[0].seed, 3, i, 0, -0.2f, 0.3f, H);
        float dx = ref_shift(m->layers[0].seed, 3, i, 1, -0.1f, 0.1f, W);
        wrong += s3[2 * i] != dy || s3[2 * i + 1] != dx;
        outside += !(dy >= -2.0f && dy < 3.0f && dx >= -2.0f && dx < 2.0f);
        same += i > 0 && s3[2 * i] == s3[2 * i - 2];
    }
    CHECK(wrong == 0, "%lld samples' shifts differ from the Philox rule", (long long)wrong);
    CHECK(outside == 0, "%lld shifts out of range", (long long)outside);
    CHECK(same == 0, "%lld samples share their neighbour's shift", (long long)same);
    run_forward(m, B, 3, x, b, 1);
    CHECK(same_floats(a, b, B * H * W), "step 3 twice: different images");
    run_forward(m, B, 4, x, b, 1);
    for (i = 0, same = 0; i < B; i++) same += ((float *)m->layers[0].saved[0])[2 * i] == s3[2 * i];
    CHECK(same == 0, "steps 3 and 4 draw %lld equal shifts", (long long)same);
    free(x), free(a), free(b);
    mpt_model_destroy(m);
}

/* RandomFlip: each image is either itself or flipped as the mode says
   (horizontal_and_vertical: both axes at once, by one draw, as Keras),
   exactly where the rule's uniform is < 0.5; both happen. */
static void test_flip_modes(void) {
    enum { B = 32, H = 2, W = 3, C = 2, N = H * W * C };
    static const mpt_flip_mode modes[3] = {MPT_FLIP_HORIZONTAL, MPT_FLIP_VERTICAL,
                                           MPT_FLIP_HORIZONTAL_AND_VERTICAL};
    float x[B * N], y[B * N], flipped[N];
    int k, i, j, c, b;
    for (i = 0; i < B * N; i++) x[i] = (float)(i % N + 1) + 100.0f * (float)(i / N);
    for (k = 0; k < 3; k++) {
        mpt_model *m = augment_model(ctx, H, W, C, NULL, &(mpt_random_flip_desc){.mode = modes[k]}, B);
        int n_flipped = 0, wrong = 0;
        if (!m) return;
        run_forward(m, B, 7, x, y, 1);
        for (b = 0; b < B; b++) {
            uint32_t r[4];
            int want;
            mpt_philox4x32(m->layers[0].seed, 7, (uint64_t)b, r);
            want = (float)(r[0] >> 8) / 16777216.0f < 0.5f;
            for (i = 0; i < H; i++)
                for (j = 0; j < W; j++)
                    for (c = 0; c < C; c++) {
                        int si = modes[k] == MPT_FLIP_HORIZONTAL ? i : H - 1 - i;
                        int sj = modes[k] == MPT_FLIP_VERTICAL ? j : W - 1 - j;
                        flipped[(i * W + j) * C + c] = x[b * N + (si * W + sj) * C + c];
                    }
            if (want) n_flipped++;
            wrong += memcmp(y + b * N, want ? flipped : x + b * N, sizeof flipped) != 0;
        }
        CHECK(wrong == 0, "mode %d: %d images neither as the rule says", (int)modes[k], wrong);
        CHECK(n_flipped > 4 && n_flipped < B - 4, "mode %d: %d of %d flipped", (int)modes[k],
              n_flipped, B);
        mpt_model_destroy(m);
    }
}

/* Inference (predict's path and a forward with training 0) passes the
   images through bit for bit, in float16 too. */
static void test_identity_at_inference(void) {
    enum { B = 16, N = 6 * 7 * 3 };
    float x[B * N], y[B * N], p[B * N];
    int k, i;
    for (i = 0; i < B * N; i++) x[i] = (float)test_uniform(-1, 1);
    for (k = 0; k < 2; k++) {
        mpt_model *m = augment_model(ctx, 6, 7, 3, k ? NULL : &(mpt_random_translation_desc){
            .height_factor = {-0.5f, 0.5f}, .width_factor = {-0.5f, 0.5f}}, NULL, B);
        mpt_tensor tx, ty;
        int64_t shape[4] = {B, 6, 7, 3};
        memset(&ty, 0, sizeof ty);
        if (!m) return;
        run_forward(m, B, 1, x, y, 0);
        CHECK(same_floats(x, y, B * N), "%s: forward in inference changed the images",
              k ? "RandomFlip" : "RandomTranslation");
        mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, shape, x);
        CHECK(mpt_model_predict_tensor(m, &tx, B, &ty) == MPT_OK, "predict: %s",
              mpt_context_error(ctx));
        mpt_convert(ctx, MPT_FLOAT32, p, ty.dtype, ty.data, B * N);
        mpt_tensor_free(ctx, &ty);
        CHECK(same_floats(x, p, B * N), "%s: predict changed the images",
              k ? "RandomFlip" : "RandomTranslation");
        run_forward(m, B, 1, x, y, 1);
        CHECK(!same_floats(x, y, B * N), "%s: training left every image alone",
              k ? "RandomFlip" : "RandomTranslation");
        mpt_model_destroy(m);
    }
}

/* 1 and 2 threads give the same bits, forward and backward, float32 and
   float16. */
static void test_threads(void) {
    enum { B = 24, H = 9, W = 11, C = 3, N = B * H * W * C };
    float *x = (float *)malloc(sizeof(float) * N), *dy = (float *)malloc(sizeof(float) * N);
    float *y[2][2], *dx[2][2];
    int t, h, i;
    for (i = 0; i < N; i++) x[i] = (float)test_uniform(-1, 1), dy[i] = (float)test_uniform(-1, 1);
    for (t = 0; t < 2; t++) {
        mpt_context *c = test_ctx_logging(t + 1, NULL);
        for (h = 0; h < 2; h++) {
            mpt_model *m = NULL;
            mpt_tensor tdy, tdx;
            int64_t shape[4] = {B, H, W, C};
            mpt_model_create(c, &(mpt_model_desc){.input_shape = {H, W, C}, .input_rank = 3,
                                                  .seed = 3}, &m);
            mpt_model_add_random_flip(m, &(mpt_random_flip_desc){.dtype = h ? MPT_FLOAT16 : 0});
            mpt_model_add_random_translation(m, &(mpt_random_translation_desc){
                .height_factor = {-0.3f, 0.3f}, .width_factor = {-0.3f, 0.2f},
                .dtype = h ? MPT_FLOAT16 : 0});
            CHECK(mpt_model_build(m, B) == MPT_OK, "build: %s", mpt_context_error(c));
            y[t][h] = (float *)malloc(sizeof(float) * N);
            dx[t][h] = (float *)malloc(sizeof(float) * N);
            run_forward(m, B, 5, x, y[t][h], 1);
            mpt_tensor_wrap(c, &tdy, MPT_FLOAT32, 4, shape, dy);
            CHECK(mpt_model_backward(m, &tdy, &tdx) == MPT_OK, "backward: %s", mpt_context_error(c));
            mpt_convert(c, MPT_FLOAT32, dx[t][h], tdx.dtype, tdx.data, N);
            mpt_model_destroy(m);
        }
        mpt_context_destroy(c);
    }
    for (h = 0; h < 2; h++) {
        CHECK(same_floats(y[0][h], y[1][h], N), "%s forward differs by threads",
              h ? "float16" : "float32");
        CHECK(same_floats(dx[0][h], dx[1][h], N), "%s backward differs by threads",
              h ? "float16" : "float32");
    }
    for (t = 0; t < 2; t++)
        for (h = 0; h < 2; h++) free(y[t][h]), free(dx[t][h]);
    free(x), free(dy);
}

/* ---- gradients against finite differences ----------------------------------------- */

/* An independent reference in double: reflect as a map of period 2n,
   wrap as TensorFlow's formula (see mpt__translate_map), then the
   interpolation, with the shifts the rule draws. */
static double ref_map(double c, int64_t n, mpt_fill_mode mode) {
    double p;
    switch (mode) {
    case MPT_FILL_CONSTANT: return c;
    case MPT_FILL_WRAP:
        if (c < 0) c += (double)n * (floor(-c / (double)(n - 1)) + 1);
        else if (c > (double)(n - 1)) c -= (double)n * floor(c / (double)(n - 1));
        break;
    case MPT_FILL_REFLECT:
        p = 2.0 * (double)n;
        c -= p * floor(c / p);
        if (c >= (double)n) c = p - 1 - c;
        break;
    default: break;
    }
    return c < 0 ? 0 : c > (double)(n - 1) ? (double)(n - 1) : c;
}

/* x at (r, q) of one image, fill outside. */
static double ref_at(const double *x, int64_t r, int64_t q, int64_t ch, int64_t H, int64_t W,
                     int64_t C, double fill) {
    return r < 0 || r >= H || q < 0 || q >= W ? fill : x[(r * W + q) * C + ch];
}

/* One RandomTranslation in double: c->user is its descriptor. */
static void translation_forward_ref(const gc_case *c, const double *x, double *const *params,
                                    double *y) {
    const mpt_random_translation_desc *t = (const mpt_random_translation_desc *)c->user;
    const mpt__layer *L = &c->model->layers[0];
    int64_t H = L->in_shape[0], W = L->in_shape[1], C = L->in_shape[2], b, i, j, ch;
    float hl = fminf(t->height_factor[0], t->height_factor[1]);
    float hh = fmaxf(t->height_factor[0], t->height_factor[1]);
    float wl = fminf(t->width_factor[0], t->width_factor[1]);
    float wh = fmaxf(t->width_factor[0], t->width_factor[1]);
    (void)params;
    for (b = 0; b < c->batch; b++) {
        const double *xb = x + b * H * W * C;
        double dy = ref_shift(L->seed, c->model->step, b, 0, hl, hh, H);
        double dx = ref_shift(L->seed, c->model->step, b, 1, wl, wh, W);
        for (i = 0; i < H; i++)
            for (j = 0; j < W; j++)
                for (ch = 0; ch < C; ch++) {
                    double sy = ref_map((double)i - dy, H, t->fill_mode);
                    double sx = ref_map((double)j - dx, W, t->fill_mode);
                    double *out = y + ((b * H + i) * W + j) * C + ch, fy, fx;
                    if (t->interpolation == MPT_INTERPOLATION_NEAREST) {
                        *out = ref_at(xb, (int64_t)round(sy), (int64_t)round(sx), ch, H, W, C,
                                      t->fill_value);
                        continue;
                    }
                    fy = floor(sy), fx = floor(sx);
                    *out = (fy + 1 - sy) * ((fx + 1 - sx) * ref_at(xb, (int64_t)fy, (int64_t)fx, ch, H, W, C, t->fill_value) +
                                            (sx - fx) * ref_at(xb, (int64_t)fy, (int64_t)fx + 1, ch, H, W, C, t->fill_value)) +
                           (sy - fy) * ((fx + 1 - sx) * ref_at(xb, (int64_t)fy + 1, (int64_t)fx, ch, H, W, C, t->fill_value) +
                                        (sx - fx) * ref_at(xb, (int64_t)fy + 1, (int64_t)fx + 1, ch, H, W, C, t->fill_value));
                }
    }
}

static void check_translation_gradient(mpt_dtype dtype, mpt_fill_mode fill,
                                       mpt_interpolation interp) {
    mpt_model *m = NULL;
    mpt_random_translation_desc t;
    char label[96];
    test__begin();
    snprintf(label, sizeof label, "RandomTranslation fill %d interpolation %d %s", (int)fill,
             (int)interp, mpt_dtype_name(dtype));
    memset(&t, 0, sizeof t);
    t.height_factor[0] = -0.45f, t.height_factor[1] = 0.4f;
    t.width_factor[0] = 0.5f, t.width_factor[1] = -0.35f;
    t.fill_mode = fill;
    t.interpolation = interp;
    t.fill_value = 0.25f;
    t.dtype = dtype;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {5, 4, 2}, .input_rank = 3,
                                            .seed = 21}, &m);
    CHECK(mpt_model_add_random_translation(m, &t) == MPT_OK, "add: %s", mpt_context_error(ctx));
    gc_check_random_layer(ctx, m, 6, 13, translation_forward_ref, &t, label);
}

/* One RandomFlip in double: c->user is its mode. */
static void flip_forward_ref(const gc_case *c, const double *x, double *const *params,
                             double *y) {
    const mpt_flip_mode mode = *(const mpt_flip_mode *)c->user;
    const mpt__layer *L = &c->model->layers[0];
    int64_t H = L->in_shape[0], W = L->in_shape[1], C = L->in_shape[2], b, i, j, ch;
    (void)params;
    for (b = 0; b < c->batch; b++) {
        uint32_t r[4];
        int flip;
        mpt_philox4x32(L->seed, c->model->step, (uint64_t)b, r);
        flip = (float)(r[0] >> 8) / 16777216.0f < 0.5f;
        for (i = 0; i < H; i++)
            for (j = 0; j < W; j++)
                for (ch = 0; ch < C; ch++) {
                    int64_t si = flip && mode != MPT_FLIP_HORIZONTAL ? H - 1 - i : i;
                    int64_t sj = flip && mode != MPT_FLIP_VERTICAL ? W - 1 - j : j;
                    y[((b * H + i) * W + j) * C + ch] = x[((b * H + si) * W + sj) * C + ch];
                }
    }
}

static void check_flip_gradient(mpt_dtype dtype, mpt_flip_mode mode) {
    mpt_model *m = NULL;
    char label[96];
    test__begin();
    snprintf(label, sizeof label, "RandomFlip mode %d %s", (int)mode, mpt_dtype_name(dtype));
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {3, 4, 2}, .input_rank = 3,
                                            .seed = 4}, &m);
    CHECK(mpt_model_add_random_flip(m, &(mpt_random_flip_desc){.mode = mode, .dtype = dtype}) ==
              MPT_OK, "add: %s", mpt_context_error(ctx));
    gc_check_random_layer(ctx, m, 8, 2, flip_forward_ref, &mode, label);
}

static void test_gradients(void) {
    static const mpt_dtype dtypes[] = {MPT_FLOAT32, MPT_FLOAT16, MPT_BFLOAT16};
    int t, f;
    for (f = 0; f < 4; f++) {
        check_translation_gradient(MPT_FLOAT32, (mpt_fill_mode)f, MPT_INTERPOLATION_BILINEAR);
        check_translation_gradient(MPT_FLOAT32, (mpt_fill_mode)f, MPT_INTERPOLATION_NEAREST);
    }
    for (t = 1; t < 3; t++) {
        check_translation_gradient(dtypes[t], MPT_FILL_REFLECT, MPT_INTERPOLATION_BILINEAR);
        check_translation_gradient(dtypes[t], MPT_FILL_CONSTANT, MPT_INTERPOLATION_NEAREST);
    }
    for (t = 0; t < 3; t++)
        for (f = 0; f < 3; f++) check_flip_gradient(dtypes[t], (mpt_flip_mode)f);
}

/* ---- mirrored replicas ---------------------------------------------------------- */

/* Flip, translation, Flatten, Dense(3) on (6, 6, 2) images, float32, under
   strategy st (NULL: one replica). */
static mpt_model *replica_model(mpt_strategy *st) {
    mpt_model *m = NULL;
    mpt_model_create(ctx, &(mpt_model_desc){.input_shape = {6, 6, 2}, .input_rank = 3, .seed = 5,
                                            .strategy = st}, &m);
    mpt_model_add_random_flip(m, NULL);
    mpt_model_add_random_translation(m, &(mpt_random_translation_desc){
        .height_factor = {-0.4f, 0.4f}, .width_factor = {-0.4f, 0.4f}});
    mpt_model_add_flatten(m, NULL);
    mpt_model_add_dense(m, &(mpt_dense_desc){.units = 3});
    test_compile_classifier(ctx, m);
    CHECK(mpt_model_build(m, 16) == MPT_OK, "build: %s", mpt_context_error(ctx));
    return m;
}

/* 2 mirrored replicas, each with half of every global batch of 16, train
   to the weights of one replica with the whole batch (to the rounding of
   the gradients' sum, summed in another order): sample g of a global
   batch gets the same draw on either. Keyed by each replica's own row
   instead, they would not (measured: a relative difference of 0.25). */
static void test_replicas_draw_as_one(void) {
    enum { n = 64, N = n * 72 };
    float *x = (float *)malloc(sizeof(float) * N);
    int32_t y[n];
    mpt_strategy *st = test_mirrored_strategy(ctx, 2);
    mpt_model *one = replica_model(NULL), *two = replica_model(st);
    mpt_dataset *d;
    mpt_fit_desc fit = fit_for(2, 16);
    double diff;
    int i;
    for (i = 0; i < N; i++) x[i] = (float)test_uniform(0, 1);
    for (i = 0; i < n; i++) y[i] = i % 3;
    {
        int64_t xs[4] = {n, 6, 6, 2}, ys[1] = {n};
        mpt_tensor tx, ty;
        mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, 4, xs, x);
        mpt_tensor_wrap(ctx, &ty, MPT_INT32, 1, ys, y);
        d = test_dataset_of(ctx, &tx, &ty);
    }
    fit.no_shuffle = 1;
    CHECK(mpt_model_fit(one, d, &fit) == MPT_OK, "fit: %s", mpt_context_error(ctx));
    CHECK(mpt_model_fit(two, d, &fit) == MPT_OK, "fit 2 replicas: %s", mpt_context_error(ctx));
    diff = test_weight_diff(two, one);
    CHECK(diff < 1e-5, "2 replicas' weights differ from one's by %g (relative)", diff);
    mpt_dataset_destroy(d);
    mpt_model_destroy(one);
    mpt_model_destroy(two);
    mpt_strategy_destroy(st);
    free(x);
}

/* ---- bad descriptors ---------------------------------------------------------- */

static void test_refusals(void) {
    mpt_context *q = quiet_ctx();
    mpt_model *m = NULL, *v = NULL;
    mpt_status s;
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {4, 4, 1}, .input_rank = 3}, &m);
    s = mpt_model_add_random_flip(m, &(mpt_random_flip_desc){.mode = (mpt_flip_mode)3});
    test_expect_error(q, s, MPT_ERR_INVALID_ARGUMENT, "RandomFlip: mode 3", "RandomFlip");
    s = mpt_model_add_random_translation(m, &(mpt_random_translation_desc){
        .height_factor = {-0.2f, 1.5f}});
    test_expect_error(q, s, MPT_ERR_INVALID_ARGUMENT, "RandomTranslation: height_factor[1] 1.5", "RandomTranslation");
    s = mpt_model_add_random_translation(m, &(mpt_random_translation_desc){
        .width_factor = {NAN, 0.1f}});
    test_expect_error(q, s, MPT_ERR_INVALID_ARGUMENT, "RandomTranslation: width_factor[0]", "RandomTranslation");
    s = mpt_model_add_random_translation(m, &(mpt_random_translation_desc){
        .fill_mode = (mpt_fill_mode)4});
    test_expect_error(q, s, MPT_ERR_INVALID_ARGUMENT, "RandomTranslation: fill_mode 4", "RandomTranslation");
    s = mpt_model_add_random_translation(m, &(mpt_random_translation_desc){
        .interpolation = (mpt_interpolation)2});
    test_expect_error(q, s, MPT_ERR_INVALID_ARGUMENT, "RandomTranslation: interpolation 2", "RandomTranslation");
    s = mpt_model_add_random_translation(m, &(mpt_random_translation_desc){.fill_value = INFINITY});
    test_expect_error(q, s, MPT_ERR_INVALID_ARGUMENT, "RandomTranslation: fill_value", "RandomTranslation");
    CHECK(mpt_model_layer_count(m) == 0, "%d layers after the refusals", mpt_model_layer_count(m));
    /* not an image: build names the layer */
    mpt_model_create(q, &(mpt_model_desc){.input_shape = {12}, .input_rank = 1}, &v);
    mpt_model_add_random_flip(v, NULL);
    test_expect_error(q, mpt_model_build(v, 2), MPT_ERR_SHAPE, "RandomFlip 'random_flip'", "RandomFlip");
    mpt_model_destroy(v);
    /* a model on another device (a copy of the CPU's table stands for
       CUDA's): build refuses each layer by name */
    {
        static mpt_backend other;
        other = *mpt__cpu_backend();
        mpt_model_create(q, &(mpt_model_desc){.input_shape = {4, 4, 1}, .input_rank = 3}, &v);
        mpt_model_add_random_translation(v, NULL);
        v->be = &other;
        test_expect_error(q, mpt_model_build(v, 2), MPT_ERR_UNSUPPORTED,
                          "RandomTranslation 'random_translation': not available on a CUDA device",
                          "RandomTranslation on CUDA");
        v->be = mpt__cpu_backend();
        mpt_model_destroy(v);
    }
    mpt_model_destroy(m);
    mpt_context_destroy(q);
}

int main(void) {
    mpt_context_create(&(mpt_context_desc){.num_threads = 2}, &ctx);
    test_seed(7);
    TEST_RUN(test_translation_row_known_answers);
    TEST_RUN(test_translation_image_known_answer);
    TEST_RUN(test_translation_draws);
    TEST_RUN(test_flip_modes);
    TEST_RUN(test_identity_at_inference);
    TEST_RUN(test_threads);
    test_gradients();
    TEST_RUN(test_replicas_draw_as_one);
    TEST_RUN(test_refusals);
    mpt_context_destroy(ctx);
    return test_summary("test_augment");
}
