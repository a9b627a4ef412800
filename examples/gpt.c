/* A character-level GPT, written with the functional form: bytes in (a
   vocabulary of 256), the next byte out at every position.
       Embedding(256, 256) + PositionEmbedding(128)
       4 blocks, pre-LayerNormalization (epsilon 1e-5):
           x = x + MultiHeadAttention(4 heads of 64, causal)(LN(x))
           x = x + Dense(256)(Dense(1024, gelu)(LN(x)))
       -> LayerNormalization -> Dense(256, softmax)
   The residual stream (x) is float32 under every policy (residual()).
   GPT-2's initialisation (weights N(0, 0.02²), biases 0, gamma 1, beta
   0), AdamW (learning rate 1e-3, weight decay 0.1, none on biases and
   normalization parameters), batches of 32 windows of 128 bytes drawn at
   random, no dropout. The last 10 % of the text is the validation set.

   Build: cc -O2 gpt.c -lpthread -lm -lz -o gpt       (in examples/)
   Run:   ./gpt [--data FILE] [--steps 1000] [--eval-interval 250]
                [--batch-size 32] [--policy mixed_bfloat16] [--threads N]
                [--seed 1] [--sample 300] [--verbose 1] [--profile DIR]
                [--quantize dynamic_int8|float16] [--warmup N] [--cosine ALPHA]
                [--attention fused|stored]
   AdamW's rate is constant unless --warmup N (a linear warm-up over the
   first N steps, lr·(t + 1)/N) or --cosine ALPHA (a cosine decay from
   1e-3 to ALPHA·1e-3 over the steps after the warm-up, Keras'
   CosineDecay; nanoGPT's floor is 0.1) are given: mpt_lr_schedule.
   Without --data it reads the English fortunes of Debian's `fortunes`
   package (every file of /usr/share/games/fortunes but the .dat indexes,
   in name order: about 2.6 MB). Shows Keras' progress bar per
   --eval-interval steps with the validation loss, then a sample of
   generated text (mpt_model_generate: temperature 0.8, the 40 likeliest
   bytes, a key/value cache), then one JSON
   line: tokens_per_s (training), val_loss in nats per byte (PyTorch's
   cross-entropy) and bits_per_char. --profile DIR times steps 2 and 3
   layer by layer (fit's profile_batch; the first step is left out, as it
   warms the caches), prints the per-layer table at the end of fit and
   writes the Chrome trace under DIR. --quantize quantizes the trained
   model (mpt_model_quantize, examples/quantize.c's variant names:
   dynamic_int8 makes every Dense and the attention's projections int8
   products; float16 stores them as float16) and reports its validation
   loss beside the float model's, and both models' predict speed over the
   first PREDICT_WINDOWS validation windows (tokens/s: one warm-up pass
   each, then the best of PREDICT_ROUNDS passes taken in turn, float
   then quantized), in the JSON line too. --attention stored keeps each
   attention's weights (B, H, T, T) from forward for backward
   (no_flash_attention, Keras' flash_attention=False: 8 MiB a layer at
   batch 32) where the default, fused, computes them again; the same bits,
   memory against time. The JSON line names it, with mpt_model_memory's
   activations and workspace bytes. full_int8 is refused: the
   int8-only model has no form for the embeddings, LayerNormalization or
   the attention. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <time.h>
#define MPT_IMPLEMENTATION
#include "../mpt.h"
#include "common.h"

#include <dirent.h>

enum { VOCAB = 256, CONTEXT = 128, WIDTH = 256, HEADS = 4, LAYERS = 4 };
enum { PREDICT_WINDOWS = 256, PREDICT_ROUNDS = 3 };

typedef struct gpt_options {
    const char *data;        /* NULL: the fortunes                            */
    int64_t steps, eval_interval, batch_size;
    const char *policy_name;
    mpt_policy policy;
    int threads, verbose;
    uint64_t seed;
    int64_t sample;          /* bytes of text to generate at the end          */
    int64_t warmup;          /* --warmup: steps of linear warm-up (0: none)   */
    double cosine;           /* --cosine ALPHA: the floor of a cosine decay
                                over the steps after the warm-up, a fraction
                                of the rate; < 0: a constant rate             */
    const char *profile_dir; /* NULL: no profile                              */
    const char *quantize_name; /* NULL: no quantized model                    */
    mpt_quantize_mode quantize;
    const char *attention;   /* "fused" (the default) or "stored"             */
} gpt_options;

/* A number in [0, 1] (--cosine's floor) into *out; 0 if value is not one. */
static int read_fraction(const char *value, double *out) {
    char *end;
    double v = strtod(value, &end);
    if (end == value || *end || !(v >= 0 && v <= 1)) return 0;
    *out = v;
    return 1;
}

static int parse_gpt_options(int argc, char **argv, gpt_options *o) {
    int i;
    for (i = 1; i + 1 < argc; i += 2) {
        const char *flag = argv[i], *value = argv[i + 1];
        unsigned long long n;
        double alpha;
        if (!strcmp(flag, "--data")) o->data = value;
        else if (!strcmp(flag, "--policy")) o->policy_name = value;
        else if (!strcmp(flag, "--profile")) o->profile_dir = value;
        else if (!strcmp(flag, "--quantize")) o->quantize_name = value;
        else if (!strcmp(flag, "--attention")) o->attention = value;
        else if (!strcmp(flag, "--steps") && read_number(argv[0], flag, value, INT32_MAX, &n))
            o->steps = (int64_t)n;
        else if (!strcmp(flag, "--eval-interval") &&
                 read_number(argv[0], flag, value, INT32_MAX, &n) && n > 0)
            o->eval_interval = (int64_t)n;
        else if (!strcmp(flag, "--batch-size") &&
                 read_number(argv[0], flag, value, 1 << 20, &n) && n > 0)
            o->batch_size = (int64_t)n;
        else if (!strcmp(flag, "--threads") && read_number(argv[0], flag, value, 1024, &n))
            o->threads = (int)n;
        else if (!strcmp(flag, "--verbose") && read_number(argv[0], flag, value, 2, &n))
            o->verbose = (int)n;
        else if (!strcmp(flag, "--seed") && read_number(argv[0], flag, value, UINT64_MAX, &n))
            o->seed = (uint64_t)n;
        else if (!strcmp(flag, "--sample") && read_number(argv[0], flag, value, 1 << 20, &n))
            o->sample = (int64_t)n;
        else if (!strcmp(flag, "--warmup") && read_number(argv[0], flag, value, INT32_MAX, &n))
            o->warmup = (int64_t)n;
        else if (!strcmp(flag, "--cosine") && read_fraction(value, &alpha)) o->cosine = alpha;
        else break;
    }
    if (!policy_named(o->policy_name, &o->policy)) i = -1;
    if (o->cosine >= 0 && o->warmup >= o->steps) i = -1; /* no step left to decay over */
    if (strcmp(o->attention, "fused") && strcmp(o->attention, "stored")) i = -1;
    if (!o->quantize_name) { /* none */
    } else if (!strcmp(o->quantize_name, "dynamic_int8")) {
        o->quantize = MPT_QUANTIZE_DYNAMIC_RANGE;
    } else if (!strcmp(o->quantize_name, "float16")) {
        o->quantize = MPT_QUANTIZE_FLOAT16;
    } else if (!strcmp(o->quantize_name, "full_int8")) {
        o->quantize = MPT_QUANTIZE_FULL_INTEGER; /* refused by mpt_model_quantize, saying why */
    } else {
        i = -1;
    }
    if (i != argc) {
        fprintf(stderr, "usage: %s [--data FILE] [--steps N] [--eval-interval N]\n"
                        "          [--batch-size N] [--policy float32|mixed_float16|"
                        "mixed_bfloat16]\n"
                        "          [--threads N] [--seed N] [--sample N] [--verbose 0|1|2]\n"
                        "          [--profile DIR] [--quantize dynamic_int8|float16]\n"
                        "          [--warmup N] [--cosine ALPHA (0..1, below --steps' warm-up)]\n"
                        "          [--attention fused|stored]\n",
                argv[0]);
        return 0;
    }
    return 1;
}

/* ---- the quantized model --------------------------------------------------------- */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct quantized_result {
    double val_loss;                  /* nats per byte, as the float model's */
    double float_tokens_per_s, quantized_tokens_per_s; /* predict           */
} quantized_result;

/* Predict's speed, tokens/s, of the float model and the quantized one over
   the same windows: one warm-up pass each, then PREDICT_ROUNDS passes each
   in turn (so that a busy host slows both alike), the fastest kept. */
static mpt_status time_predict(mpt_context *ctx, mpt_model *model, mpt_model *q,
                               const mpt_dataset *windows, int64_t batch_size,
                               quantized_result *r) {
    mpt_model *both[2] = { model, q };
    double best[2] = { INFINITY, INFINITY };
    int round, k;
    for (round = 0; round <= PREDICT_ROUNDS; round++)
        for (k = 0; k < 2; k++) {
            mpt_tensor out;
            double start = now(), seconds;
            mpt_status s = mpt_model_predict(both[k], windows, batch_size, &out);
            if (s != MPT_OK) return s;
            seconds = now() - start;
            mpt_tensor_free(ctx, &out);
            if (round > 0 && seconds < best[k]) best[k] = seconds; /* round 0 warms up */
        }
    r->float_tokens_per_s = (double)(mpt_dataset_count(windows) * CONTEXT) / best[0];
    r->quantized_tokens_per_s = (double)(mpt_dataset_count(windows) * CONTEXT) / best[1];
    return MPT_OK;
}

/* The trained model quantized: its validation loss by the same evaluate,
   and both models' predict speed over the first PREDICT_WINDOWS windows. */
static mpt_status compare_quantized(mpt_context *ctx, mpt_model *model, const mpt_dataset *val,
                                    const gpt_options *o, quantized_result *r) {
    mpt_model *q = NULL;
    mpt_dataset *head = NULL;
    mpt_logs logs;
    mpt_status s = mpt_model_quantize(model, &(mpt_quantize_desc){ .mode = o->quantize }, &q);
    if (s == MPT_OK)
        s = mpt_model_evaluate(q, val, &(mpt_evaluate_desc){ .batch_size = o->batch_size },
                               &logs);
    r->val_loss = s == MPT_OK ? mpt_logs_get(&logs, "loss") : 0;
    if (s == MPT_OK && mpt_dataset_count(val) > PREDICT_WINDOWS)
        s = mpt_dataset_split(ctx, val, PREDICT_WINDOWS, &head, NULL);
    if (s == MPT_OK) s = time_predict(ctx, model, q, head ? head : val, o->batch_size, r);
    mpt_dataset_destroy(head);
    mpt_model_destroy(q);
    return s;
}

/* ---- the text ------------------------------------------------------------------ */

#define FORTUNES "/usr/share/games/fortunes"

static int by_name(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The fortunes as one text: every regular file of FORTUNES but the .dat
   indexes (the .u8 names are links to the same files), in name order,
   into *text (malloc'd); 0 when there is none. */
static int read_fortunes(char **text, int64_t *size) {
    DIR *dir = opendir(FORTUNES);
    struct dirent *e;
    char *names[512], path[1024];
    int n = 0, i;
    *text = NULL;
    *size = 0;
    if (!dir) return 0;
    while ((e = readdir(dir)) != NULL && n < 512) {
        size_t len = strlen(e->d_name);
        if (e->d_name[0] == '.' || (len > 4 && !strcmp(e->d_name + len - 4, ".dat")) ||
            (len > 3 && !strcmp(e->d_name + len - 3, ".u8")))
            continue;
        if ((names[n] = (char *)malloc(len + 1)) != NULL) memcpy(names[n++], e->d_name, len + 1);
    }
    closedir(dir);
    qsort(names, (size_t)n, sizeof *names, by_name);
    for (i = 0; i < n; i++) {
        FILE *f;
        long bytes;
        char *grown;
        snprintf(path, sizeof path, "%s/%s", FORTUNES, names[i]);
        f = fopen(path, "rb");
        if (f && fseek(f, 0, SEEK_END) == 0 && (bytes = ftell(f)) > 0 && fseek(f, 0, SEEK_SET) == 0 &&
            (grown = (char *)realloc(*text, (size_t)(*size + bytes))) != NULL) {
            *text = grown;
            *size += (int64_t)fread(*text + *size, 1, (size_t)bytes, f);
        }
        if (f) fclose(f);
        free(names[i]);
    }
    return *size > 0;
}

/* ---- the model ------------------------------------------------------------------- */

static mpt_node layer_norm(mpt_model *m, mpt_node x) {
    return mpt_layer_normalization(m, x, &(mpt_layer_normalization_desc){ .epsilon = 1e-5f });
}

/* The residual stream stays float32 under the mixed policies: each Add
   computes in float32 (a layer's dtype, as Keras' Add(dtype="float32")),
   so x keeps every branch's small update, as under PyTorch's autocast,
   whose adds promote a bfloat16 branch to the float32 stream. Added in
   bfloat16, as the policy alone would, the stream lost them: 1,000 steps
   ended at 2.55 nats a byte against 1.91 (bench/RESULTS.md). The
   branches still compute in the policy's dtype. */
static mpt_node residual(mpt_model *m, mpt_node x, mpt_node branch) {
    mpt_node both[2] = { x, branch };
    return mpt_add(m, 2, both, &(mpt_merge_desc){ .dtype = MPT_FLOAT32 });
}

/* stored: the attention's weights kept for backward (--attention). */
static mpt_node block(mpt_model *m, mpt_node x, int stored) {
    mpt_node h = layer_norm(m, x);
    h = mpt_multi_head_attention(m, h, h, &(mpt_multi_head_attention_desc){
        .num_heads = HEADS, .key_dim = WIDTH / HEADS, .use_causal_mask = 1,
        .kernel_initializer = MPT_INIT_GPT2_NORMAL, .no_flash_attention = stored });
    x = residual(m, x, h);
    h = mpt_dense(m, layer_norm(m, x), &(mpt_dense_desc){
        .units = 4 * WIDTH, .activation = MPT_ACT_GELU,
        .kernel_initializer = MPT_INIT_GPT2_NORMAL });
    h = mpt_dense(m, h, &(mpt_dense_desc){ .units = WIDTH,
                                           .kernel_initializer = MPT_INIT_GPT2_NORMAL });
    return residual(m, x, h);
}

/* --warmup and --cosine as the optimizer's schedule. */
static mpt_lr_schedule learning_rate_schedule(const gpt_options *o) {
    mpt_lr_schedule s = { .warmup_steps = o->warmup };
    if (o->cosine >= 0) {
        s.type = MPT_LR_COSINE_DECAY;
        s.decay_steps = o->steps - o->warmup;
        s.alpha = (float)o->cosine;
    }
    return s;
}

static mpt_status build_gpt(mpt_context *ctx, const gpt_options *o, mpt_model **model) {
    mpt_model *m;
    mpt_node tok, x;
    int l;
    mpt_status s = mpt_model_create(ctx, &(mpt_model_desc){ .input_shape = { CONTEXT },
                                                            .input_rank = 1,
                                                            .input_dtype = MPT_INT32,
                                                            .policy = o->policy,
                                                            .seed = o->seed }, model);
    if (s != MPT_OK) return s;
    m = *model;
    tok = mpt_embedding(m, mpt_model_input(m), &(mpt_embedding_desc){
        .input_dim = VOCAB, .output_dim = WIDTH,
        .embeddings_initializer = MPT_INIT_GPT2_NORMAL });
    x = residual(m, tok, mpt_position_embedding(m, tok, &(mpt_position_embedding_desc){
        .sequence_length = CONTEXT, .initializer = MPT_INIT_GPT2_NORMAL }));
    for (l = 0; l < LAYERS; l++) x = block(m, x, !strcmp(o->attention, "stored"));
    mpt_dense(m, layer_norm(m, x), &(mpt_dense_desc){
        .units = VOCAB, .activation = MPT_ACT_SOFTMAX,
        .kernel_initializer = MPT_INIT_GPT2_NORMAL });
    s = mpt_model_compile(m, &(mpt_compile_desc){
        .optimizer = { .type = MPT_OPTIMIZER_ADAMW, .learning_rate = 1e-3f,
                       .weight_decay = 0.1f, .exclude_from_weight_decay = "bias,gamma,beta",
                       .schedule = learning_rate_schedule(o) },
        .loss = { .type = MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY } });
    if (s == MPT_OK) s = mpt_model_build(m, o->batch_size);
    return s;
}

int main(int argc, char **argv) {
    gpt_options o = { .steps = 1000, .eval_interval = 250, .batch_size = 32,
                      .policy_name = "mixed_bfloat16", .verbose = 1, .seed = 1, .sample = 300,
                      .cosine = -1, .attention = "fused" };
    mpt_context *ctx;
    mpt_model *model;
    mpt_dataset *train, *val;
    mpt_logs result;
    mpt_history h;
    mpt_memory_report memory;
    quantized_result qr = { 0, 0, 0 };
    double tokens_per_s = 0;
    char *text = NULL;
    int32_t *ids;
    int64_t size = 0;
    int k;
    mpt_dataset_text_desc td = { .sequence_length = CONTEXT };
    if (!parse_gpt_options(argc, argv, &o)) return 2;
    if (mpt_context_create(&(mpt_context_desc){ .num_threads = o.threads }, &ctx) != MPT_OK)
        return 1;
    if (o.data) {
        TRY(mpt_dataset_load_text(ctx, o.data, &td, &train, &val));
    } else {
        if (!read_fortunes(&text, &size)) {
            fprintf(stderr, "%s: no text in %s (apt-get install fortunes, or give --data FILE)\n",
                    argv[0], FORTUNES);
            return 1;
        }
        TRY(mpt_dataset_create_text(ctx, text, size, &td, &train, &val));
    }
    TRY(build_gpt(ctx, &o, &model));
    TRY(mpt_model_memory(model, &memory));
    if (o.verbose > 1) {
        char summary[16384];
        if (mpt_model_summary(model, summary, sizeof summary)) printf("%s", summary);
    }

    /* --steps in epochs of --eval-interval random batches, each followed
       by the validation loss */
    TRY(mpt_model_fit(model, train, &(mpt_fit_desc){
        .epochs = (int)((o.steps + o.eval_interval - 1) / o.eval_interval),
        .steps_per_epoch = o.steps < o.eval_interval ? o.steps : o.eval_interval,
        .batch_size = o.batch_size, .validation_data = val, .verbose = o.verbose,
        .profile_batch = { o.profile_dir ? 2 : 0, o.profile_dir ? 3 : 0 },
        .profile_dir = o.profile_dir }));
    TRY(mpt_model_evaluate(model, val, &(mpt_evaluate_desc){ .batch_size = o.batch_size },
                           &result));
    mpt_model_history(model, &h);
    for (k = 0; k < h.n_keys; k++)
        if (!strcmp(h.keys[k], "samples_per_second") && h.epochs > 0)
            tokens_per_s = h.values[k][h.epochs - 1] * CONTEXT;
    if (o.quantize_name) {
        TRY(compare_quantized(ctx, model, val, &o, &qr));
        printf("validation loss: %s %.4f, %s %.4f nats/byte (%.4f, %.4f bits/char)\n"
               "predict over %lld windows: %s %.0f tokens/s, %s %.0f tokens/s (%.2fx)\n",
               o.policy_name, mpt_logs_get(&result, "loss"), o.quantize_name, qr.val_loss,
               mpt_logs_get(&result, "loss") / log(2.0), qr.val_loss / log(2.0),
               (long long)(mpt_dataset_count(val) < PREDICT_WINDOWS ? mpt_dataset_count(val)
                                                                     : PREDICT_WINDOWS),
               o.policy_name, qr.float_tokens_per_s, o.quantize_name, qr.quantized_tokens_per_s,
               qr.quantized_tokens_per_s / qr.float_tokens_per_s);
    }

    /* a sample: o.sample bytes after a newline, each drawn at temperature
       0.8 from the 40 likeliest (the attention's keys and values cached,
       so each byte costs one position) */
    ids = (int32_t *)malloc(sizeof(int32_t) * (size_t)(o.sample + 1));
    if (o.sample > 0 && ids) {
        const int32_t newline = '\n';
        int64_t i;
        TRY(mpt_model_generate(model, &newline, 1, &(mpt_generate_desc){
            .max_new_tokens = o.sample, .temperature = 0.8f, .top_k = 40, .seed = o.seed }, ids));
        for (i = 0; i <= o.sample; i++) putchar((char)ids[i]);
        printf("\n%%\n");
    }
    printf("{\"model\":\"gpt\",\"policy\":\"%s\",\"steps\":%lld,\"batch_size\":%d,"
           "\"context\":%d,\"threads\":%d,\"tokens_per_s\":%.0f,\"val_loss\":%.4f,"
           "\"bits_per_char\":%.4f",
           o.policy_name, (long long)o.steps, (int)o.batch_size, CONTEXT,
           mpt_context_num_threads(ctx), tokens_per_s, mpt_logs_get(&result, "loss"),
           mpt_logs_get(&result, "loss") / log(2.0));
    printf(",\"attention\":\"%s\",\"activation_bytes\":%lld,\"workspace_bytes\":%lld,"
           "\"memory_bytes\":%lld",
           o.attention, (long long)memory.activations, (long long)memory.workspace,
           (long long)memory.total);
    if (o.warmup || o.cosine >= 0)
        printf(",\"warmup\":%lld,\"cosine\":%g", (long long)o.warmup, o.cosine);
    if (o.quantize_name)
        printf(",\"quantize\":\"%s\",\"quantized_val_loss\":%.4f,"
               "\"quantized_bits_per_char\":%.4f,\"predict_tokens_per_s\":%.0f,"
               "\"quantized_predict_tokens_per_s\":%.0f",
               o.quantize_name, qr.val_loss, qr.val_loss / log(2.0), qr.float_tokens_per_s,
               qr.quantized_tokens_per_s);
    printf("}\n");
    free(ids);
    free(text);
    mpt_model_destroy(model);
    mpt_dataset_destroy(train);
    mpt_dataset_destroy(val);
    mpt_context_destroy(ctx);
    return 0;
}
