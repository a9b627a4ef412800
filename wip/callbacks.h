/* =============================================================================
   @impl-callbacks  EarlyStopping, ReduceLROnPlateau, ModelCheckpoint, CSVLogger
   =============================================================================

   Each callback is a state struct behind mpt_callback.user_data. Every
   state begins with the same head (a magic number, the context that
   allocated it, and what else it owns), so that one mpt_callback_destroy
   frees any of them.

   The rules are Keras 3's (keras/src/callbacks/), named where they are
   not obvious:
   - A quantity improves on a reference when current < reference − |min_delta|
     in min mode (current > reference + |min_delta| in max mode). Auto mode
     minimises names that end in "loss" and maximises every other name.
   - A monitored name missing from an epoch's logs logs a warning (as Keras
     warns) and the callback does nothing that epoch.
   - EarlyStopping, ReduceLROnPlateau and CSVLogger reset their state in
     on_train_begin, so one callback serves several fits. ModelCheckpoint
     keeps its best value from creation on, as Keras does: a second fit only
     overwrites a best-only file with something better.
   - EarlyStopping restores the best weights in on_train_end whenever
     restore_best_weights is set and some epoch was monitored, whether or not
     it stopped training (Keras 3; Keras 2 restored only when it stopped).

   Where Keras' own behaviour does not carry over, mpt.h chooses:
   - ReduceLROnPlateau works on the model's base learning rate (float32)
     and prints the new rate with the fewest digits that read back as that
     float32 ("0.001"; Keras prints the float64 product, 0.0009999999776482583).
   - ModelCheckpoint formats its filepath with the part of Python's
     str.format a file name needs: {epoch}, {epoch:02d}, {val_loss:.2f},
     {loss:.3e}, {{ and }}. It does not create missing directories.
   - CSVLogger writes the first epoch's keys, sorted, with "\n" line ends
     (Python's csv module writes "\r\n"), and does not add the empty val_
     columns Keras adds when the first epoch has no validation keys: fit
     validates every epoch or never. Values are written as Python's repr.

   Messages go through the model's printer as whole lines ("Epoch 3: ...\n");
   fit ends its progress line before it calls on_epoch_end. */

#include <errno.h> /* errno for the CSV logger's messages */

#define MPT__CB_MAGIC 0x6d707443u /* "mptC": a live callback state       */
#define MPT__CB_NAME_MAX 64       /* a monitored name or a CSV column     */
#define MPT__CB_PATH_MAX 4096     /* a formatted checkpoint path          */

/* ---- what every callback state shares ------------------------------------- */

typedef struct mpt__cb_head {
    uint32_t magic;                           /* MPT__CB_MAGIC while alive      */
    mpt_context *ctx;                         /* allocated the state; frees it  */
    void (*release)(struct mpt__cb_head *h);  /* frees what the state owns, or NULL */
} mpt__cb_head;

/* Allocates a zeroed state of `bytes` whose first member is a head. */
static void *mpt__cb_new(mpt_context *ctx, size_t bytes, const char *what,
                         void (*release)(mpt__cb_head *), mpt_status *status) {
    mpt__cb_head *h = (mpt__cb_head *)mpt__calloc(ctx, bytes);
    *status = MPT_OK;
    if (!h) {
        *status = mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "%s: out of memory", what);
        return NULL;
    }
    h->magic = MPT__CB_MAGIC;
    h->ctx = ctx;
    h->release = release;
    return h;
}

/* Copies a string the caller owns into the state; NULL on failure. */
static char *mpt__cb_strdup(mpt_context *ctx, const char *s) {
    size_t n = strlen(s) + 1;
    char *copy = (char *)mpt__alloc(ctx, n);
    if (copy) memcpy(copy, s, n);
    return copy;
}

/* The quantity a callback watches and which way is better. */
typedef struct mpt__cb_monitor {
    char name[MPT__CB_NAME_MAX];
    int minimize;             /* 1: lower is better                     */
    double min_delta;         /* |min_delta|                            */
} mpt__cb_monitor;

static int mpt__cb_ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* Resolves the monitor's name (default "val_loss") and direction. */
static mpt_status mpt__cb_monitor_init(mpt_context *ctx, const char *what, const char *monitor,
                                       mpt_monitor_mode mode, double min_delta,
                                       mpt__cb_monitor *mon) {
    const char *name = monitor ? monitor : "val_loss";
    if (strlen(name) == 0 || strlen(name) >= sizeof mon->name)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "%s: monitor \"%s\" must have 1..%d characters", what, name,
                         (int)sizeof mon->name - 1);
    if (mode != MPT_MODE_AUTO && mode != MPT_MODE_MIN && mode != MPT_MODE_MAX)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "%s: mode %d is not MPT_MODE_AUTO, MPT_MODE_MIN or MPT_MODE_MAX", what,
                         (int)mode);
    if (!isfinite(min_delta))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "%s: min_delta %g must be finite", what,
                         min_delta);
    strcpy(mon->name, name);
    mon->minimize =
        mode == MPT_MODE_MIN || (mode == MPT_MODE_AUTO && mpt__cb_ends_with(name, "loss"));
    mon->min_delta = fabs(min_delta);
    return MPT_OK;
}

/* Whether `current` beats `reference` by more than min_delta. */
static int mpt__cb_improves(const mpt__cb_monitor *mon, double current, double reference) {
    return mon->minimize ? current < reference - mon->min_delta
                         : current > reference + mon->min_delta;
}

/* The worst value: anything finite improves on it. */
static double mpt__cb_worst(const mpt__cb_monitor *mon) {
    return mon->minimize ? INFINITY : -INFINITY;
}

/* Finds `name` in logs. Unlike mpt_logs_get, tells a logged NaN from a
   missing name. */
static int mpt__cb_find(const mpt_logs *logs, const char *name, double *value) {
    int i;
    for (i = 0; logs && i < logs->count; i++)
        if (logs->names[i] && strcmp(logs->names[i], name) == 0) {
            *value = logs->values[i];
            return 1;
        }
    return 0;
}

/* "loss,accuracy,val_loss": the names in logs, for a warning. */
static void mpt__cb_names(const mpt_logs *logs, char *buf, size_t size) {
    size_t used = 0;
    int i;
    buf[0] = 0;
    for (i = 0; logs && i < logs->count && used < size; i++)
        used += (size_t)snprintf(buf + used, size - used, "%s%s", i ? "," : "",
                                 logs->names[i] ? logs->names[i] : "?");
}

/* The monitored value, or 0 after a warning (as Keras's) when the epoch's
   logs lack it. `why` completes "<why> conditioned on metric `x`". */
static int mpt__cb_monitored(const mpt_model *m, const mpt__cb_monitor *mon, const char *why,
                             const mpt_logs *logs, double *value) {
    char names[512];
    if (mpt__cb_find(logs, mon->name, value)) return 1;
    mpt__cb_names(logs, names, sizeof names);
    mpt__log(m->ctx, MPT_LOG_WARNING,
             "%s conditioned on metric `%s` which is not available. Available metrics are: %s",
             why, mon->name, names);
    return 0;
}

/* v as Python's repr writes a float: the fewest significant digits that
   read back as the same value ("0.1", "1.0", "1e-05", "0.3333333333333333",
   "1e+16", "nan", "inf"). single: the fewest that read back as the same
   float32 (a learning rate is stored as float32). */
static void mpt__cb_repr(char *buf, size_t size, double v, int single) {
    char sci[40];
    int digits, exp10, max_digits = single ? 9 : 17;
    if (isnan(v)) {
        snprintf(buf, size, "nan");
        return;
    }
    if (isinf(v)) {
        snprintf(buf, size, v < 0 ? "-inf" : "inf");
        return;
    }
    for (digits = 1; digits < max_digits; digits++) {
        double back;
        snprintf(sci, sizeof sci, "%.*e", digits - 1, v);
        back = strtod(sci, NULL);
        if (single ? (float)back == (float)v : back == v) break;
    }
    snprintf(sci, sizeof sci, "%.*e", digits - 1, v);
    exp10 = atoi(strchr(sci, 'e') + 1);
    if (exp10 < -4 || exp10 >= 16) { /* Python's repr switches to exponents there */
        snprintf(buf, size, "%s", sci);
    } else {                         /* fixed point, at least one decimal: "100.0" */
        int decimals = digits - 1 - exp10;
        snprintf(buf, size, "%.*f", decimals < 1 ? 1 : decimals, v);
    }
}

/* =============================================================================
   EarlyStopping
   ============================================================================= */

typedef struct mpt__cb_early_stopping {
    mpt__cb_head head;
    mpt__cb_monitor mon;
    int patience, start_from_epoch, restore_best_weights, verbose;
    int has_baseline;
    double baseline;
    /* Reset by on_train_begin: */
    int wait;                 /* epochs since the wait was last reset        */
    int stopped_epoch;        /* 0-based epoch that stopped training; 0: none */
    int has_best;             /* Keras' best is None until the first epoch   */
    double best;
    int best_epoch;           /* 0-based                                     */
    int has_best_weights;
    /* Owned, sized by on_train_begin: */
    float *best_weights;      /* (weights_count) float32: every parameter's
                                 value, in parameter order                   */
    int64_t weights_count;
} mpt__cb_early_stopping;

static void mpt__cb_es_release(mpt__cb_head *h) {
    mpt__cb_early_stopping *es = (mpt__cb_early_stopping *)h;
    mpt__free(h->ctx, es->best_weights);
    es->best_weights = NULL;
}

/* Elements over every parameter of a built model. */
static int64_t mpt__cb_weights_count(const mpt_model *m) {
    int64_t n = 0;
    int i;
    for (i = 0; i < m->n_params; i++) n += m->params[i].count;
    return n;
}

/* Copies every parameter's float32 value into best_weights (to = 1) or
   back from it (to = 0). */
static void mpt__cb_es_copy_weights(mpt__cb_early_stopping *es, mpt_model *m, int to_best) {
    float *at = es->best_weights;
    int i;
    for (i = 0; i < m->n_params; i++) {
        mpt__param *P = &m->params[i];
        if (to_best)
            memcpy(at, P->value, sizeof(float) * (size_t)P->count);
        else
            memcpy(P->value, at, sizeof(float) * (size_t)P->count);
        at += P->count;
    }
}

/* Sizes the weight copy for this model: a callback may serve another model
   in a later fit. A new copy holds no best weights yet. */
static mpt_status mpt__cb_es_prepare_weights(mpt__cb_early_stopping *es, mpt_model *m) {
    int64_t n;
    if (!m->built)
        return mpt__fail(m->ctx, MPT_ERR_STATE,
                         "EarlyStopping: restore_best_weights needs a built model at "
                         "on_train_begin");
    n = mpt__cb_weights_count(m);
    if (n == es->weights_count && es->best_weights) return MPT_OK;
    mpt__free(es->head.ctx, es->best_weights);
    es->weights_count = 0;
    es->has_best_weights = 0;
    es->best_weights = (float *)mpt__alloc(es->head.ctx, sizeof(float) * (size_t)n);
    if (!es->best_weights)
        return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY,
                         "EarlyStopping: cannot allocate %lld bytes for the best weights",
                         (long long)n * 4);
    es->weights_count = n;
    return MPT_OK;
}

static mpt_status mpt__cb_es_train_begin(void *user, mpt_model *m) {
    mpt__cb_early_stopping *es = (mpt__cb_early_stopping *)user;
    es->wait = 0;
    es->stopped_epoch = 0;
    es->has_best = 0;
    es->best = 0;
    es->best_epoch = 0;
    es->has_best_weights = 0;
    return es->restore_best_weights ? mpt__cb_es_prepare_weights(es, m) : MPT_OK;
}

static void mpt__cb_es_keep_weights(mpt__cb_early_stopping *es, mpt_model *m, int epoch) {
    mpt__cb_es_copy_weights(es, m, 1);
    es->has_best_weights = 1;
    es->best_epoch = epoch;
}

/* Keras 3's on_epoch_end, step by step: the wait grows every monitored
   epoch; an improvement records the best (and its weights) and resets the
   wait only if it also beats the baseline, and never stops training. */
static mpt_status mpt__cb_es_epoch_end(void *user, mpt_model *m, int epoch, const mpt_logs *logs,
                                       int *stop) {
    mpt__cb_early_stopping *es = (mpt__cb_early_stopping *)user;
    double current;
    if (!mpt__cb_monitored(m, &es->mon, "Early stopping", logs, &current) ||
        epoch < es->start_from_epoch)
        return MPT_OK;
    /* A no-op after on_train_begin; guards a caller who skipped it. */
    if (es->restore_best_weights) MPT__CHECK(mpt__cb_es_prepare_weights(es, m));
    if (es->restore_best_weights && !es->has_best_weights) mpt__cb_es_keep_weights(es, m, epoch);
    es->wait++;
    if (!es->has_best || mpt__cb_improves(&es->mon, current, es->best)) {
        es->has_best = 1;
        es->best = current;
        es->best_epoch = epoch;
        if (es->restore_best_weights) mpt__cb_es_keep_weights(es, m, epoch);
        if (!es->has_baseline || mpt__cb_improves(&es->mon, current, es->baseline)) es->wait = 0;
        return MPT_OK;
    }
    if (es->wait >= es->patience && epoch > 0) {
        es->stopped_epoch = epoch;
        if (stop) *stop = 1;
    }
    return MPT_OK;
}

static mpt_status mpt__cb_es_train_end(void *user, mpt_model *m, const mpt_logs *logs) {
    mpt__cb_early_stopping *es = (mpt__cb_early_stopping *)user;
    (void)logs;
    if (es->stopped_epoch > 0 && es->verbose > 0)
        mpt__print(m, "Epoch %d: early stopping\n", es->stopped_epoch + 1);
    if (!es->restore_best_weights || !es->has_best_weights) return MPT_OK;
    if (!m->built || mpt__cb_weights_count(m) != es->weights_count)
        return mpt__fail(m->ctx, MPT_ERR_STATE,
                         "EarlyStopping: the model's parameters changed since on_train_begin "
                         "(%lld elements kept); cannot restore the best weights",
                         (long long)es->weights_count);
    if (es->verbose > 0)
        mpt__print(m, "Restoring model weights from the end of the best epoch: %d.\n",
                   es->best_epoch + 1);
    mpt__cb_es_copy_weights(es, m, 0);
    mpt_model_refresh_weights(m);
    return MPT_OK;
}

static mpt_status mpt__cb_es_check(mpt_context *ctx, const mpt_early_stopping_desc *d) {
    if (d->patience < 0)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "EarlyStopping: patience %d must be >= 0", d->patience);
    if (d->start_from_epoch < 0)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "EarlyStopping: start_from_epoch %d must be >= 0", d->start_from_epoch);
    if (d->has_baseline && isnan(d->baseline))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "EarlyStopping: baseline is NaN; nothing could ever beat it");
    return MPT_OK;
}

/* Starts every created callback from a zeroed struct: the caller's *out
   is all zeros after a failure. */
static mpt_status mpt__cb_check_out(mpt_context *ctx, const char *what, mpt_callback *out) {
    if (out) memset(out, 0, sizeof *out);
    if (!ctx) return MPT_ERR_INVALID_ARGUMENT;
    if (!out) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "%s: NULL out", what);
    return MPT_OK;
}

MPTDEF mpt_status mpt_callback_early_stopping(mpt_context *ctx, const mpt_early_stopping_desc *d,
                                              mpt_callback *out) {
    mpt_early_stopping_desc defaults;
    mpt__cb_early_stopping *es;
    mpt__cb_monitor mon;
    mpt_status s;
    MPT__CHECK(mpt__cb_check_out(ctx, "EarlyStopping", out));
    memset(&defaults, 0, sizeof defaults);
    if (!d) d = &defaults; /* every field has a usable default */
    MPT__CHECK(mpt__cb_es_check(ctx, d));
    MPT__CHECK(mpt__cb_monitor_init(ctx, "EarlyStopping", d->monitor, d->mode, d->min_delta, &mon));
    es = (mpt__cb_early_stopping *)mpt__cb_new(ctx, sizeof *es, "EarlyStopping",
                                               mpt__cb_es_release, &s);
    if (!es) return s;
    es->mon = mon;
    es->patience = d->patience;
    es->start_from_epoch = d->start_from_epoch;
    es->restore_best_weights = d->restore_best_weights != 0;
    es->verbose = d->verbose;
    es->has_baseline = d->has_baseline != 0;
    es->baseline = d->baseline;
    out->on_train_begin = mpt__cb_es_train_begin;
    out->on_epoch_end = mpt__cb_es_epoch_end;
    out->on_train_end = mpt__cb_es_train_end;
    out->user_data = es;
    return MPT_OK;
}

/* =============================================================================
   ReduceLROnPlateau
   ============================================================================= */

typedef struct mpt__cb_reduce_lr {
    mpt__cb_head head;
    mpt__cb_monitor mon;
    double factor;
    float min_lr;
    int patience, cooldown, verbose;
    /* Reset by on_train_begin: */
    double best;
    int wait;                 /* epochs without improvement, outside cooldown */
    int cooldown_counter;     /* epochs of cooldown left                      */
} mpt__cb_reduce_lr;

static mpt_status mpt__cb_rlr_train_begin(void *user, mpt_model *m) {
    mpt__cb_reduce_lr *r = (mpt__cb_reduce_lr *)user;
    (void)m;
    r->best = mpt__cb_worst(&r->mon);
    r->wait = 0;
    r->cooldown_counter = 0;
    return MPT_OK;
}

/* Multiplies the model's base learning rate by factor, not below min_lr
   (the rate fit's schedule then scales). */
static void mpt__cb_rlr_reduce(mpt__cb_reduce_lr *r, mpt_model *m, int epoch) {
    float old_lr = m->learning_rate, new_lr;
    char text[40];
    if (!(old_lr > r->min_lr)) return;
    new_lr = (float)MPT__MAX((double)old_lr * r->factor, (double)r->min_lr);
    m->learning_rate = new_lr;
    if (r->verbose > 0) {
        mpt__cb_repr(text, sizeof text, new_lr, 1);
        mpt__print(m, "Epoch %d: ReduceLROnPlateau reducing learning rate to %s.\n", epoch + 1,
                   text);
    }
    r->cooldown_counter = r->cooldown;
    r->wait = 0;
}

/* Keras 3's order: a cooldown epoch counts down and clears the wait; an
   improvement resets the wait; otherwise, outside cooldown, the wait grows
   and reaching patience lowers the rate. */
static mpt_status mpt__cb_rlr_epoch_end(void *user, mpt_model *m, int epoch, const mpt_logs *logs,
                                        int *stop) {
    mpt__cb_reduce_lr *r = (mpt__cb_reduce_lr *)user;
    double current;
    (void)stop;
    if (!mpt__cb_monitored(m, &r->mon, "Learning rate reduction is", logs, &current))
        return MPT_OK;
    if (r->cooldown_counter > 0) {
        r->cooldown_counter--;
        r->wait = 0;
    }
    if (mpt__cb_improves(&r->mon, current, r->best)) {
        r->best = current;
        r->wait = 0;
    } else if (r->cooldown_counter == 0) {
        r->wait++;
        if (r->wait >= r->patience) mpt__cb_rlr_reduce(r, m, epoch);
    }
    return MPT_OK;
}

static mpt_status mpt__cb_rlr_check(mpt_context *ctx, const mpt_reduce_lr_desc *d) {
    if (!(d->factor >= 0 && d->factor < 1))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "ReduceLROnPlateau: factor %g must be in (0, 1) (0: the default 0.1); "
                         "a factor >= 1 would not reduce the rate", (double)d->factor);
    if (d->patience < 0)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "ReduceLROnPlateau: patience %d must be >= 0", d->patience);
    if (d->cooldown < 0)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "ReduceLROnPlateau: cooldown %d must be >= 0", d->cooldown);
    if (!(d->min_lr >= 0 && d->min_lr < INFINITY))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "ReduceLROnPlateau: min_lr %g must be finite and >= 0", (double)d->min_lr);
    return MPT_OK;
}

MPTDEF mpt_status mpt_callback_reduce_lr_on_plateau(mpt_context *ctx,
                                                    const mpt_reduce_lr_desc *d,
                                                    mpt_callback *out) {
    mpt_reduce_lr_desc defaults;
    mpt__cb_reduce_lr *r;
    mpt__cb_monitor mon;
    mpt_status s;
    MPT__CHECK(mpt__cb_check_out(ctx, "ReduceLROnPlateau", out));
    memset(&defaults, 0, sizeof defaults);
    if (!d) d = &defaults;
    MPT__CHECK(mpt__cb_rlr_check(ctx, d));
    MPT__CHECK(mpt__cb_monitor_init(ctx, "ReduceLROnPlateau", d->monitor, d->mode,
                                    d->min_delta != 0 ? (double)d->min_delta : 1e-4, &mon));
    r = (mpt__cb_reduce_lr *)mpt__cb_new(ctx, sizeof *r, "ReduceLROnPlateau", NULL, &s);
    if (!r) return s;
    r->mon = mon;
    /* 0.1f, not 0.1: the same rate as a factor given as 0.1f */
    r->factor = (double)(d->factor != 0 ? d->factor : 0.1f);
    r->min_lr = d->min_lr;
    r->patience = d->patience != 0 || d->has_patience ? d->patience : 10;
    r->cooldown = d->cooldown;
    r->verbose = d->verbose;
    r->best = mpt__cb_worst(&mon);
    out->on_train_begin = mpt__cb_rlr_train_begin;
    out->on_epoch_end = mpt__cb_rlr_epoch_end;
    out->user_data = r;
    return MPT_OK;
}

/* =============================================================================
   ModelCheckpoint
   ============================================================================= */

/* A replacement field's format spec, the part of Python's mini-language a
   file name needs: [0][width][.precision][type], type one of d f F e E g G
   or none. */
typedef struct mpt__cb_spec {
    int zero, width, precision; /* precision -1: none given */
    char type;                  /* 0: none                  */
} mpt__cb_spec;

static const char *mpt__cb_digits(const char *s, int *value) {
    *value = 0;
    while (*s >= '0' && *s <= '9' && *value < 100000) *value = *value * 10 + (*s++ - '0');
    return s;
}

static int mpt__cb_parse_spec(const char *s, const char *end, mpt__cb_spec *spec) {
    const char *after;
    spec->zero = *s == '0';
    spec->precision = -1;
    spec->type = 0;
    s = mpt__cb_digits(s, &spec->width);
    if (s < end && *s == '.') {
        after = mpt__cb_digits(s + 1, &spec->precision);
        if (after == s + 1 || spec->precision > 50) return 0;
        s = after;
    }
    if (s < end && strchr("dfFeEgG", *s)) spec->type = *s++;
    return s == end && spec->width <= 200;
}

/* One field's text: value is the epoch (is_int) or a log value. Returns
   snprintf's count, or -1 for a float given the integer type 'd'. */
static int mpt__cb_put_field(char *dst, size_t room, const mpt__cb_spec *spec, double value,
                             int is_int) {
    char repr[40];
    int w = spec->width, p = spec->precision < 0 ? 6 : spec->precision;
    switch (spec->type) {
    case 'd':
        if (!is_int) return -1;
        return snprintf(dst, room, spec->zero ? "%0*d" : "%*d", w, (int)value);
    case 'f': case 'F': return snprintf(dst, room, spec->zero ? "%0*.*f" : "%*.*f", w, p, value);
    case 'e': return snprintf(dst, room, spec->zero ? "%0*.*e" : "%*.*e", w, p, value);
    case 'E': return snprintf(dst, room, spec->zero ? "%0*.*E" : "%*.*E", w, p, value);
    case 'g': return snprintf(dst, room, spec->zero ? "%0*.*g" : "%*.*g", w, p, value);
    case 'G': return snprintf(dst, room, spec->zero ? "%0*.*G" : "%*.*G", w, p, value);
    default: break;
    }
    if (is_int) return snprintf(dst, room, spec->zero ? "%0*d" : "%*d", w, (int)value);
    if (spec->precision >= 0)
        return snprintf(dst, room, spec->zero ? "%0*.*g" : "%*.*g", w, p, value);
    mpt__cb_repr(repr, sizeof repr, value, 0); /* Python's str(float) */
    return snprintf(dst, room, "%*s", w, repr);
}

/* The value a field names: "epoch" (1-based) or a log's. */
static int mpt__cb_field_value(const char *name, int epoch1, const mpt_logs *logs, double *value,
                               int *is_int) {
    *is_int = strcmp(name, "epoch") == 0;
    if (*is_int) {
        *value = epoch1;
        return 1;
    }
    return mpt__cb_find(logs, name, value);
}

/* Parses the field that starts at the '{' at p: its name and spec, and
   where the text after its '}' starts. */
static mpt_status mpt__cb_parse_field(mpt_context *ctx, const char *pattern, const char *p,
                                      char *name, mpt__cb_spec *spec, const char **next) {
    const char *close = strchr(p, '}'), *colon;
    ptrdiff_t len;
    if (!close)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "ModelCheckpoint: filepath \"%s\" has an unclosed '{' at offset %d "
                         "(write \"{{\" for the character)", pattern, (int)(p - pattern));
    colon = (const char *)memchr(p, ':', (size_t)(close - p));
    if (!colon) colon = close;
    len = colon - (p + 1);
    if (len < 1 || len >= MPT__CB_NAME_MAX || memchr(p + 1, '{', (size_t)len) ||
        !mpt__cb_parse_spec(colon + (colon < close), close, spec))
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "ModelCheckpoint: filepath \"%s\": field \"%.*s\" is not {name} or "
                         "{name:spec} with spec [0][width][.precision][dfeg]", pattern,
                         (int)(close - p + 1), p);
    memcpy(name, p + 1, (size_t)len);
    name[len] = 0;
    *next = close + 1;
    return MPT_OK;
}

/* Appends one field's text at out + *n (counting what does not fit). */
static mpt_status mpt__cb_put_named(mpt_context *ctx, const char *pattern, const char *name,
                                    const mpt__cb_spec *spec, int epoch1, const mpt_logs *logs,
                                    char *out, size_t size, size_t *n) {
    char names[512];
    double value;
    int is_int, len;
    size_t at = MPT__MIN(*n, size - 1);
    if (!mpt__cb_field_value(name, epoch1, logs, &value, &is_int)) {
        mpt__cb_names(logs, names, sizeof names);
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "ModelCheckpoint: filepath \"%s\" names {%s}, which is neither epoch "
                         "nor in the logs (%s)", pattern, name, names);
    }
    len = mpt__cb_put_field(out + at, size - at, spec, value, is_int);
    if (len < 0)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "ModelCheckpoint: filepath \"%s\": {%s} is a float; 'd' is for the "
                         "epoch", pattern, name);
    *n += (size_t)len;
    return MPT_OK;
}

/* Writes pattern with each "{name}" or "{name:spec}" replaced, as Python's
   pattern.format(epoch=epoch1, **logs) does ("{{" and "}}" are braces).
   With out NULL it only checks the syntax, whatever the names. */
static mpt_status mpt__cb_format_path(mpt_context *ctx, const char *pattern, int epoch1,
                                      const mpt_logs *logs, char *out, size_t size) {
    const char *p = pattern;
    size_t n = 0;
    while (*p) {
        if (*p == '{' && p[1] != '{') {
            char name[MPT__CB_NAME_MAX];
            mpt__cb_spec spec = {0, 0, -1, 0};
            MPT__CHECK(mpt__cb_parse_field(ctx, pattern, p, name, &spec, &p));
            if (out)
                MPT__CHECK(mpt__cb_put_named(ctx, pattern, name, &spec, epoch1, logs, out, size,
                                             &n));
            continue;
        }
        if (*p == '}' && p[1] != '}')
            return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                             "ModelCheckpoint: filepath \"%s\" has a single '}' at offset %d "
                             "(write \"}}\" for the character)", pattern, (int)(p - pattern));
        /* a character, or a doubled brace that stands for one */
        if (out && n + 1 < size) out[n] = *p;
        n++;
        p += (*p == '{' || *p == '}') ? 2 : 1;
    }
    if (out && n >= size)
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "ModelCheckpoint: filepath \"%s\" becomes %zu characters, more than %zu",
                         pattern, n, size - 1);
    if (out) out[n] = 0;
    return MPT_OK;
}

typedef struct mpt__cb_model_checkpoint {
    mpt__cb_head head;
    mpt__cb_monitor mon;      /* min_delta 0, as Keras                     */
    char *filepath;           /* owned copy of the pattern                 */
    int save_best_only, save_weights_only, verbose;
    double best;              /* from creation on: Keras never resets it   */
    char path[MPT__CB_PATH_MAX]; /* this epoch's formatted filepath        */
} mpt__cb_model_checkpoint;

static void mpt__cb_ckpt_release(mpt__cb_head *h) {
    mpt__cb_model_checkpoint *c = (mpt__cb_model_checkpoint *)h;
    mpt__free(h->ctx, c->filepath);
    c->filepath = NULL;
}

/* Keras' _should_save_model: with save_best_only, only an improvement (or
   a missing monitor, after a warning) is saved. */
static int mpt__cb_ckpt_should_save(mpt__cb_model_checkpoint *c, mpt_model *m, int epoch,
                                    const mpt_logs *logs) {
    double current;
    if (!c->save_best_only) {
        if (c->verbose > 0) mpt__print(m, "Epoch %d: saving model to %s\n", epoch + 1, c->path);
        return 1;
    }
    if (!mpt__cb_find(logs, c->mon.name, &current)) {
        mpt__log(m->ctx, MPT_LOG_WARNING, "Can save best model only with %s available.",
                 c->mon.name);
        return 1;
    }
    if (mpt__cb_improves(&c->mon, current, c->best)) {
        if (c->verbose > 0)
            mpt__print(m, "Epoch %d: %s improved from %.5f to %.5f, saving model to %s\n",
                       epoch + 1, c->mon.name, c->best, current, c->path);
        c->best = current;
        return 1;
    }
    if (c->verbose > 0)
        mpt__print(m, "Epoch %d: %s did not improve from %.5f\n", epoch + 1, c->mon.name, c->best);
    return 0;
}

static mpt_status mpt__cb_ckpt_epoch_end(void *user, mpt_model *m, int epoch, const mpt_logs *logs,
                                         int *stop) {
    mpt__cb_model_checkpoint *c = (mpt__cb_model_checkpoint *)user;
    (void)stop;
    MPT__CHECK(mpt__cb_format_path(m->ctx, c->filepath, epoch + 1, logs, c->path, sizeof c->path));
    if (!mpt__cb_ckpt_should_save(c, m, epoch, logs)) return MPT_OK;
    return c->save_weights_only ? mpt_model_save_weights(m, c->path)
                                : mpt_model_save_checkpoint(m, c->path);
}

MPTDEF mpt_status mpt_callback_model_checkpoint(mpt_context *ctx,
                                                const mpt_model_checkpoint_desc *d,
                                                mpt_callback *out) {
    mpt__cb_model_checkpoint *c;
    mpt__cb_monitor mon;
    mpt_status s;
    MPT__CHECK(mpt__cb_check_out(ctx, "ModelCheckpoint", out));
    if (!d) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "ModelCheckpoint: NULL descriptor");
    if (!d->filepath || !d->filepath[0])
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "ModelCheckpoint: filepath is %s; it is "
                         "required (e.g. \"ckpt-{epoch}.safetensors\")",
                         d->filepath ? "empty" : "NULL");
    MPT__CHECK(mpt__cb_format_path(ctx, d->filepath, 1, NULL, NULL, 0));
    MPT__CHECK(mpt__cb_monitor_init(ctx, "ModelCheckpoint", d->monitor, d->mode, 0, &mon));
    c = (mpt__cb_model_checkpoint *)mpt__cb_new(ctx, sizeof *c, "ModelCheckpoint",
                                                mpt__cb_ckpt_release, &s);
    if (!c) return s;
    c->filepath = mpt__cb_strdup(ctx, d->filepath);
    if (!c->filepath) {
        mpt__free(ctx, c);
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "ModelCheckpoint: out of memory");
    }
    c->mon = mon;
    c->save_best_only = d->save_best_only != 0;
    c->save_weights_only = d->save_weights_only != 0;
    c->verbose = d->verbose;
    c->best = mpt__cb_worst(&mon);
    out->on_epoch_end = mpt__cb_ckpt_epoch_end;
    out->user_data = c;
    return MPT_OK;
}

/* =============================================================================
   CSVLogger
   ============================================================================= */

typedef struct mpt__cb_csv_logger {
    mpt__cb_head head;
    char *filename;           /* owned copy                                */
    char separator;
    int append;
    /* Set by on_train_begin and the first on_epoch_end: */
    FILE *file;               /* open from on_train_begin to on_train_end  */
    int write_header;         /* not when appending to a non-empty file    */
    int n_keys;               /* -1 until the first epoch's logs           */
    char keys[MPT_MAX_LOGS][MPT__CB_NAME_MAX]; /* the columns after "epoch", sorted */
} mpt__cb_csv_logger;

static void mpt__cb_csv_release(mpt__cb_head *h) {
    mpt__cb_csv_logger *c = (mpt__cb_csv_logger *)h;
    if (c->file) fclose(c->file); /* a fit that failed never called on_train_end */
    c->file = NULL;
    mpt__free(h->ctx, c->filename);
    c->filename = NULL;
}

static mpt_status mpt__cb_csv_io_error(mpt_context *ctx, const mpt__cb_csv_logger *c,
                                       const char *what) {
    return mpt__fail(ctx, MPT_ERR_IO, "CSVLogger: cannot %s \"%s\": %s", what, c->filename,
                     strerror(errno));
}

/* Whether the file exists and holds at least one byte. */
static int mpt__cb_csv_has_content(const char *filename) {
    FILE *f = fopen(filename, "rb");
    int c;
    if (!f) return 0;
    c = fgetc(f);
    fclose(f);
    return c != EOF;
}

static mpt_status mpt__cb_csv_train_begin(void *user, mpt_model *m) {
    mpt__cb_csv_logger *c = (mpt__cb_csv_logger *)user;
    if (c->file) fclose(c->file); /* the last fit ended without on_train_end */
    c->write_header = !(c->append && mpt__cb_csv_has_content(c->filename));
    c->n_keys = -1;
    c->file = fopen(c->filename, c->append ? "a" : "w");
    if (!c->file)
        return mpt__cb_csv_io_error(m->ctx, c, c->append ? "open for appending" : "create");
    return MPT_OK;
}

/* A field as Python's csv module (excel dialect, minimal quoting) writes
   it: quoted, with quotes doubled, when it holds the separator, a quote or
   a line break. */
static void mpt__cb_csv_field(FILE *f, const char *text, char separator) {
    if (!strchr(text, separator) && !strpbrk(text, "\"\r\n")) {
        fputs(text, f);
        return;
    }
    fputc('"', f);
    for (; *text; text++) {
        if (*text == '"') fputc('"', f);
        fputc(*text, f);
    }
    fputc('"', f);
}

/* Fixes the columns from the first epoch's logs: their names, sorted as
   Python's sorted() sorts strings (by code point, which strcmp gives for
   UTF-8). */
static mpt_status mpt__cb_csv_set_keys(mpt__cb_csv_logger *c, mpt_model *m, const mpt_logs *logs) {
    int i, j, n = logs ? MPT__MIN(logs->count, MPT_MAX_LOGS) : 0;
    char tmp[MPT__CB_NAME_MAX];
    for (i = 0; i < n; i++) {
        const char *name = logs->names[i] ? logs->names[i] : "";
        if (strlen(name) >= MPT__CB_NAME_MAX)
            return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                             "CSVLogger \"%s\": log name \"%s\" is longer than %d characters",
                             c->filename, name, MPT__CB_NAME_MAX - 1);
        strcpy(c->keys[i], name);
        for (j = i; j > 0 && strcmp(c->keys[j - 1], c->keys[j]) > 0; j--) {
            strcpy(tmp, c->keys[j]);
            strcpy(c->keys[j], c->keys[j - 1]);
            strcpy(c->keys[j - 1], tmp);
        }
    }
    c->n_keys = n;
    return MPT_OK;
}

static void mpt__cb_csv_write_header(const mpt__cb_csv_logger *c) {
    int k;
    fputs("epoch", c->file);
    for (k = 0; k < c->n_keys; k++) {
        fputc(c->separator, c->file);
        mpt__cb_csv_field(c->file, c->keys[k], c->separator);
    }
    fputc('\n', c->file);
}

/* One row: the 0-based epoch, then each column's value as Python's repr
   writes it, or "NA" when this epoch's logs lack it (as Keras). */
static void mpt__cb_csv_write_row(const mpt__cb_csv_logger *c, int epoch, const mpt_logs *logs) {
    char text[40];
    int k;
    fprintf(c->file, "%d", epoch);
    for (k = 0; k < c->n_keys; k++) {
        double v;
        fputc(c->separator, c->file);
        if (mpt__cb_find(logs, c->keys[k], &v)) {
            mpt__cb_repr(text, sizeof text, v, 0);
            fputs(text, c->file);
        } else {
            fputs("NA", c->file);
        }
    }
    fputc('\n', c->file);
}

static mpt_status mpt__cb_csv_epoch_end(void *user, mpt_model *m, int epoch, const mpt_logs *logs,
                                        int *stop) {
    mpt__cb_csv_logger *c = (mpt__cb_csv_logger *)user;
    (void)stop;
    if (!c->file)
        return mpt__fail(m->ctx, MPT_ERR_STATE,
                         "CSVLogger \"%s\": on_epoch_end before on_train_begin", c->filename);
    if (c->n_keys < 0) {
        MPT__CHECK(mpt__cb_csv_set_keys(c, m, logs));
        if (c->write_header) mpt__cb_csv_write_header(c);
    }
    mpt__cb_csv_write_row(c, epoch, logs);
    /* Flushed every epoch, so the file shows a run that is still going or
       that crashed. */
    if (fflush(c->file) != 0 || ferror(c->file)) return mpt__cb_csv_io_error(m->ctx, c, "write to");
    return MPT_OK;
}

static mpt_status mpt__cb_csv_train_end(void *user, mpt_model *m, const mpt_logs *logs) {
    mpt__cb_csv_logger *c = (mpt__cb_csv_logger *)user;
    int failed;
    (void)logs;
    if (!c->file) return MPT_OK;
    failed = fclose(c->file) != 0;
    c->file = NULL;
    return failed ? mpt__cb_csv_io_error(m->ctx, c, "close") : MPT_OK;
}

MPTDEF mpt_status mpt_callback_csv_logger(mpt_context *ctx, const mpt_csv_logger_desc *d,
                                          mpt_callback *out) {
    mpt__cb_csv_logger *c;
    mpt_status s;
    char sep;
    MPT__CHECK(mpt__cb_check_out(ctx, "CSVLogger", out));
    if (!d) return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "CSVLogger: NULL descriptor");
    if (!d->filename || !d->filename[0])
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT, "CSVLogger: filename is %s; it is required",
                         d->filename ? "empty" : "NULL");
    sep = d->separator ? d->separator : ',';
    if (sep == '"' || sep == '\n' || sep == '\r')
        return mpt__fail(ctx, MPT_ERR_INVALID_ARGUMENT,
                         "CSVLogger \"%s\": separator 0x%02x cannot be a quote or a line break",
                         d->filename, (unsigned)(unsigned char)sep);
    c = (mpt__cb_csv_logger *)mpt__cb_new(ctx, sizeof *c, "CSVLogger", mpt__cb_csv_release, &s);
    if (!c) return s;
    c->filename = mpt__cb_strdup(ctx, d->filename);
    if (!c->filename) {
        mpt__free(ctx, c);
        return mpt__fail(ctx, MPT_ERR_OUT_OF_MEMORY, "CSVLogger: out of memory");
    }
    c->separator = sep;
    c->append = d->append != 0;
    c->n_keys = -1;
    out->on_train_begin = mpt__cb_csv_train_begin;
    out->on_epoch_end = mpt__cb_csv_epoch_end;
    out->on_train_end = mpt__cb_csv_train_end;
    out->user_data = c;
    return MPT_OK;
}

/* =============================================================================
   Destroying any of them
   ============================================================================= */

/* Frees a callback made by the functions above and zeroes *cb. A zeroed
   callback, or one already destroyed through this pointer, is left alone;
   so is a caller's own callback whose user_data does not start with the
   head (its first 4 bytes would have to be the magic number). */
MPTDEF void mpt_callback_destroy(mpt_callback *cb) {
    mpt__cb_head *h;
    if (!cb) return;
    h = (mpt__cb_head *)cb->user_data;
    if (h && h->magic == MPT__CB_MAGIC) {
        h->magic = 0; /* a stale copy of *cb then finds no live state */
        if (h->release) h->release(h);
        mpt__free(h->ctx, h);
    }
    memset(cb, 0, sizeof *cb);
}
