/* =============================================================================
   @impl-training: the training loop, evaluate, predict, summary, history
   =============================================================================

   One training step is, in order:
     forward (training mode, layer state not yet committed)
     loss and its gradient, multiplied by the loss scale, in float32
     backward: every parameter's gradient
     optimizer step: unscale, check finiteness, update — or skip the step
     loss-scale bookkeeping; commit BatchNormalization's statistics only if
     the step was applied
   so a skipped step changes no state at all. When the model ends in a
   softmax and the loss is a crossentropy on probabilities, the softmax is
   fused into the loss: the last layer hands over its logits and the loss
   computes log-softmax, which is exact where log(softmax) would underflow. */

static double mpt__now(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (double)tv.tv_sec + 1e-6 * (double)tv.tv_usec;
}

/* ---- logs and history ------------------------------------------------------ */

static void mpt__logs_set(mpt_logs *logs, const char *name, double value) {
    int i;
    for (i = 0; i < logs->count; i++)
        if (strcmp(logs->names[i], name) == 0) break;
    if (i == MPT_MAX_LOGS) return;
    logs->names[i] = name;
    logs->values[i] = value;
    if (i == logs->count) logs->count++;
}

static void mpt__history_reset(mpt_model *m) {
    m->history.epochs = 0;
    m->history.n_keys = 0;
}

static mpt_status mpt__history_append(mpt_model *m, const mpt_logs *logs) {
    mpt__history_store *h = &m->history;
    int i, k;
    if (h->epochs == h->cap) {
        int cap = h->cap ? 2 * h->cap : 16;
        for (k = 0; k < MPT_MAX_LOGS; k++) {
            double *grown = (double *)mpt__alloc(m->ctx, sizeof(double) * (size_t)cap);
            if (!grown) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "fit: history");
            if (h->values[k]) memcpy(grown, h->values[k], sizeof(double) * (size_t)h->epochs);
            mpt__free(m->ctx, h->values[k]);
            h->values[k] = grown;
        }
        h->cap = cap;
    }
    for (i = 0; i < logs->count; i++) {
        for (k = 0; k < h->n_keys; k++)
            if (strcmp(h->keys[k], logs->names[i]) == 0) break;
        if (k == h->n_keys) {
            int e;
            if (k == MPT_MAX_LOGS) continue;
            snprintf(h->keys[k], sizeof h->keys[k], "%s", logs->names[i]);
            for (e = 0; e < h->epochs; e++) h->values[k][e] = NAN;
            h->n_keys++;
        }
        h->values[k][h->epochs] = logs->values[i];
    }
    for (k = 0; k < h->n_keys; k++) { /* keys this epoch did not report */
        for (i = 0; i < logs->count; i++)
            if (strcmp(h->keys[k], logs->names[i]) == 0) break;
        if (i == logs->count) h->values[k][h->epochs] = NAN;
    }
    h->epochs++;
    return MPT_OK;
}

MPTDEF mpt_status mpt_model_history(const mpt_model *m, mpt_history *out) {
    int k;
    if (!m || !out) return MPT_ERR_INVALID_ARGUMENT;
    memset(out, 0, sizeof *out);
    out->epochs = m->history.epochs;
    out->n_keys = m->history.n_keys;
    for (k = 0; k < m->history.n_keys; k++) {
        out->keys[k] = m->history.keys[k];
        out->values[k] = m->history.values[k];
    }
    return MPT_OK;
}

/* ---- metrics ----------------------------------------------------------------- */

/* Running sums of one pass over data. */
typedef struct mpt__tally {
    double loss_sum;     /* Σ batch mean loss · batch size */
    int64_t samples;
    int64_t correct;     /* accuracy                       */
    int64_t top_k;       /* sparse top-k accuracy          */
} mpt__tally;

static int64_t mpt__argmax(mpt_dtype dtype, const void *row0, int64_t offset, int64_t n) {
    int64_t j, best = 0;
    float bv = mpt__load_f32(dtype, row0, offset);
    for (j = 1; j < n; j++) {
        float v = mpt__load_f32(dtype, row0, offset + j);
        if (v > bv) bv = v, best = j;
    }
    return best;
}

/* Accuracy as Keras counts it: for sparse labels argmax == label, for
   one-hot targets argmax == argmax(target), for one output unit (binary)
   prediction > threshold (0.5 for probabilities, 0 for logits). */
static void mpt__tally_batch(const mpt_model *m, const mpt_tensor *out, const mpt_tensor *y,
                             double loss, mpt__tally *t) {
    int64_t b, B = out->shape[0], classes = mpt_tensor_count(out) / B;
    const mpt_compile_desc *c = &m->compile;
    int k = c->top_k;
    t->loss_sum += loss * (double)B;
    t->samples += B;
    if (!(c->metrics & (MPT_METRIC_ACCURACY | MPT_METRIC_SPARSE_TOP_K))) return;
    for (b = 0; b < B; b++) {
        int64_t guess, truth, j, above = 0;
        if (classes == 1) {
            float v = mpt__load_f32(out->dtype, out->data, b);
            float threshold = (c->loss.from_logits || m->emit_logits) ? 0.0f : 0.5f;
            float target = y->dtype == MPT_INT32 ? (float)((const int32_t *)y->data)[b]
                                                 : ((const float *)y->data)[b];
            t->correct += (v > threshold) == (target > 0.5f);
            continue;
        }
        guess = mpt__argmax(out->dtype, out->data, b * classes, classes);
        truth = y->dtype == MPT_INT32 ? ((const int32_t *)y->data)[b]
                                      : mpt__argmax(MPT_FLOAT32, y->data, b * classes, classes);
        t->correct += guess == truth;
        if (c->metrics & MPT_METRIC_SPARSE_TOP_K) {
            /* In the top k when fewer than k classes score strictly higher. */
            float tv = mpt__load_f32(out->dtype, out->data, b * classes + truth);
            for (j = 0; j < classes; j++)
                above += mpt__load_f32(out->dtype, out->data, b * classes + j) > tv;
            t->top_k += above < k;
        }
    }
}

/* Loss, accuracy and top-k of a tally into logs, names prefixed ("val_"). */
static void mpt__tally_logs(const mpt_model *m, const mpt__tally *t, int validation,
                            mpt_logs *logs) {
    double n = t->samples ? (double)t->samples : 1.0;
    mpt__logs_set(logs, validation ? "val_loss" : "loss", t->loss_sum / n);
    if (m->compile.metrics & MPT_METRIC_ACCURACY)
        mpt__logs_set(logs, validation ? "val_accuracy" : "accuracy", (double)t->correct / n);
    if (m->compile.metrics & MPT_METRIC_SPARSE_TOP_K)
        mpt__logs_set(logs,
                      validation ? "val_sparse_top_k_categorical_accuracy"
                                 : "sparse_top_k_categorical_accuracy",
                      (double)t->top_k / n);
}

/* ---- one step ------------------------------------------------------------------ */

/* The loss the model is trained with: the compiled one, from logits when
   the final softmax is fused into it. */
static mpt_loss_desc mpt__step_loss(const mpt_model *m, float grad_scale) {
    mpt_loss_desc loss = m->compile.loss;
    if (m->emit_logits) loss.from_logits = 1;
    loss.grad_scale = grad_scale;
    return loss;
}

/* Whether the final softmax can be fused into the compiled loss. */
static int mpt__can_fuse_softmax(const mpt_model *m) {
    const mpt_loss_desc *l = &m->compile.loss;
    return !l->from_logits &&
           (l->type == MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY ||
            l->type == MPT_LOSS_CATEGORICAL_CROSSENTROPY) &&
           mpt__layer_activation(&m->layers[m->n_layers - 1]) == MPT_ACT_SOFTMAX;
}

typedef struct mpt__step_times {
    double forward, backward, update; /* seconds, summed over an epoch */
} mpt__step_times;

/* One training step on a batch. *loss is NaN when the forward pass itself
   produced inf or NaN (the step is then skipped like an overflow). */
static mpt_status mpt__train_step(mpt_model *m, const mpt_tensor *x, const mpt_tensor *y,
                                  double *loss, mpt__tally *tally, mpt__step_times *times) {
    mpt_tensor out, dout;
    mpt_loss_desc loss_desc = mpt__step_loss(m, m->loss_scale);
    mpt_status s;
    int applied = 0;
    double t0 = mpt__now(), t1, t2;
    mpt__model_forward(m, x, 1);
    mpt__layer_view(m, &m->layers[m->n_layers - 1], m->layers[m->n_layers - 1].y, 0, &out);
    mpt__layer_view(m, &m->layers[m->n_layers - 1], m->grad_buf[0], 0, &dout);
    s = mpt_loss_compute(m->ctx, &loss_desc, &out, y, loss, &dout);
    t1 = mpt__now();
    if (s == MPT_OK) {
        mpt__tally_batch(m, &out, y, *loss, tally);
        mpt_model_backward(m, NULL, NULL);
        t2 = mpt__now();
        applied = mpt__optimizer_step(m);
    } else if (s == MPT_ERR_NUMERIC) {
        *loss = NAN; /* overflow in the forward pass: skip, as for gradients */
        mpt__tally_batch(m, &out, y, NAN, tally);
        t2 = t1;
    } else {
        return s;
    }
    mpt__loss_scale_update(m, applied);
    if (applied) mpt__model_commit(m);
    m->step++;
    times->forward += t1 - t0;
    times->backward += t2 - t1;
    times->update += mpt__now() - t2;
    return MPT_OK;
}

/* ---- progress output, as Keras 2 prints it ---------------------------------------- */

static void mpt__format_value(char *buf, size_t size, double v) {
    snprintf(buf, size, fabs(v) > 1e-3 || v == 0 ? "%.4f" : "%.4e", v);
}

static void mpt__format_seconds(char *buf, size_t size, double s) {
    if (s >= 3600)
        snprintf(buf, size, "%d:%02d:%02d", (int)(s / 3600), (int)fmod(s / 60, 60), (int)fmod(s, 60));
    else if (s >= 60)
        snprintf(buf, size, "%d:%02d", (int)(s / 60), (int)fmod(s, 60));
    else
        snprintf(buf, size, "%.0fs", s);
}

static void mpt__format_logs(char *buf, size_t size, const mpt_logs *logs, int skip_extras) {
    size_t used = 0;
    int i;
    buf[0] = 0;
    for (i = 0; i < logs->count && used < size; i++) {
        char v[32];
        const char *n = logs->names[i];
        if (skip_extras && (!strcmp(n, "learning_rate") || !strcmp(n, "loss_scale") ||
                            !strcmp(n, "skipped_steps") || !strcmp(n, "epoch_seconds") ||
                            !strcmp(n, "samples_per_second")))
            continue;
        mpt__format_value(v, sizeof v, logs->values[i]);
        used += (size_t)snprintf(buf + used, size - used, " - %s: %s", n, v);
    }
}

/* "123/469 [=====>........................] - ETA: 3s - loss: 0.5000" while
   running, "469/469 [==============================] - 2s 4ms/step - ..." at
   the end (verbose 1); verbose 2 prints only "469/469 - 2s - 4ms/step - ...". */
static void mpt__progress(const mpt_model *m, int verbose, int64_t done, int64_t total,
                          double elapsed, const mpt_logs *logs, int final) {
    char bar[40], values[512], t[32], per[32];
    double per_step = done ? elapsed / (double)done : 0;
    int width = 30, filled = total ? (int)(width * done / total) : width, i;
    mpt__format_logs(values, sizeof values, logs, 1);
    if (per_step >= 1)
        snprintf(per, sizeof per, "%.0fs/step", per_step);
    else if (per_step >= 1e-3)
        snprintf(per, sizeof per, "%.0fms/step", per_step * 1e3);
    else
        snprintf(per, sizeof per, "%.0fus/step", per_step * 1e6);
    if (verbose == 2) {
        if (!final) return;
        mpt__format_seconds(t, sizeof t, elapsed);
        mpt__print(m, "%lld/%lld - %s - %s%s\n", (long long)done, (long long)total, t, per,
                   values);
        return;
    }
    for (i = 0; i < width; i++)
        bar[i] = i < filled - 1 ? '=' : (i == filled - 1 ? (done < total ? '>' : '=') : '.');
    bar[width] = 0;
    if (final) {
        mpt__format_seconds(t, sizeof t, elapsed);
        mpt__print(m, "\r%lld/%lld [%s] - %s %s%s\n", (long long)done, (long long)total, bar, t,
                   per, values);
    } else {
        mpt__format_seconds(t, sizeof t, per_step * (double)(total - done));
        mpt__print(m, "\r%lld/%lld [%s] - ETA: %s%s", (long long)done, (long long)total, bar, t,
                   values);
    }
}

/* ---- fit ------------------------------------------------------------------------------ */

/* The order of epoch e: a Fisher–Yates shuffle drawn from Philox keyed by
   the model's seed, so epoch e's order is the same in a resumed run. */
static void mpt__epoch_order(const mpt_model *m, int epoch, int shuffle, int64_t *order,
                             int64_t n) {
    uint64_t key = mpt__mix64(m->desc.seed ^ 0x5AFF1E5ull);
    int64_t i;
    for (i = 0; i < n; i++) order[i] = i;
    if (!shuffle) return;
    for (i = n - 1; i > 0; i--) {
        uint32_t r[4];
        uint64_t draw;
        int64_t j, tmp;
        mpt_philox4x32(key, (uint64_t)epoch, (uint64_t)i, r);
        draw = ((uint64_t)r[0] << 32) | r[1];
        j = (int64_t)(draw % (uint64_t)(i + 1));
        tmp = order[i];
        order[i] = order[j];
        order[j] = tmp;
    }
}

/* Checks that data fits the model: sample shape, target kind and labels. */
static mpt_status mpt__check_data(mpt_model *m, const mpt_dataset *d, const char *what) {
    int64_t shape[MPT_MAX_RANK], want[MPT_MAX_RANK], out_count = 1;
    int rank = mpt_dataset_sample_shape(d, shape), i, ok;
    int want_rank = mpt_model_input_shape(m, want);
    int32_t lo, hi;
    const mpt__layer *last = &m->layers[m->n_layers - 1];
    char a[96], b[96];
    ok = rank == want_rank;
    for (i = 0; ok && i < rank; i++) ok = shape[i] == want[i];
    if (!ok)
        return mpt__fail(m->ctx, MPT_ERR_SHAPE, "%s: samples of shape %s do not fit the model's "
                         "input %s", what, mpt_shape_format(a, sizeof a, rank, shape),
                         mpt_shape_format(b, sizeof b, want_rank, want));
    for (i = 0; i < last->out_rank; i++) out_count *= last->out_shape[i];
    if (mpt__dataset_label_range(d, &lo, &hi)) {
        if (m->compile.loss.type != MPT_LOSS_SPARSE_CATEGORICAL_CROSSENTROPY && out_count > 1)
            return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                             "%s: integer class labels need the sparse categorical "
                             "crossentropy loss (or one-hot float targets)", what);
        if (out_count > 1 && (lo < 0 || hi >= out_count))
            return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                             "%s: labels range over %d..%d but the model has %lld classes "
                             "(0..%lld)", what, (int)lo, (int)hi, (long long)out_count,
                             (long long)out_count - 1);
    } else if (mpt__dataset_label_count(d) != out_count) {
        return mpt__fail(m->ctx, MPT_ERR_SHAPE,
                         "%s: targets of %lld values per sample for a model output of %lld",
                         what, (long long)mpt__dataset_label_count(d), (long long)out_count);
    }
    return MPT_OK;
}

/* Makes the model ready to train or run on batches of batch_size. */
static mpt_status mpt__prepare(mpt_model *m, int64_t batch_size, int need_compile,
                               const char *what) {
    if (!need_compile && m->built && batch_size > m->max_batch) batch_size = m->max_batch;
    if (batch_size <= 0)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "%s: batch_size %lld must be > 0",
                         what, (long long)batch_size);
    if (need_compile && !m->compiled)
        return mpt__fail(m->ctx, MPT_ERR_STATE, "%s: compile the model first", what);
    if (!m->built) MPT__CHECK(mpt_model_build(m, batch_size));
    if (batch_size > m->max_batch)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "%s: batch_size %lld is larger than the %lld the model was built for",
                         what, (long long)batch_size, (long long)m->max_batch);
    return MPT_OK;
}

/* Loss and metrics over a whole dataset, in order (evaluate, validation). */
static mpt_status mpt__evaluate(mpt_model *m, const mpt_dataset *d, int64_t batch_size,
                                int verbose, mpt__tally *t) {
    mpt__loader *loader = NULL;
    int64_t n = mpt_dataset_count(d), done = 0, *order;
    mpt_tensor x, y, out;
    mpt_loss_desc loss_desc = mpt__step_loss(m, 1.0f);
    double start = mpt__now(), last_print = 0;
    mpt_status s = MPT_OK;
    memset(t, 0, sizeof *t);
    order = (int64_t *)mpt__alloc(m->ctx, sizeof(int64_t) * (size_t)n);
    if (!order) return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "evaluate: out of memory");
    mpt__epoch_order(m, 0, 0, order, n);
    s = mpt__loader_create(m->ctx, d, batch_size, m->layers[0].dtype, &loader);
    if (s == MPT_OK) mpt__loader_start_epoch(loader, order, n, batch_size);
    while (s == MPT_OK && mpt__loader_next(loader, &x, &y)) {
        double loss;
        mpt__model_forward(m, &x, 0);
        mpt__layer_view(m, &m->layers[m->n_layers - 1], m->layers[m->n_layers - 1].y, 0, &out);
        s = mpt_loss_compute(m->ctx, &loss_desc, &out, &y, &loss, NULL);
        if (s != MPT_OK) break;
        mpt__tally_batch(m, &out, &y, loss, t);
        done++;
        if (verbose == 1 && (mpt__now() - last_print > 0.1 || done * batch_size >= n)) {
            mpt_logs logs;
            memset(&logs, 0, sizeof logs);
            mpt__tally_logs(m, t, 0, &logs);
            mpt__progress(m, 1, done, (n + batch_size - 1) / batch_size, mpt__now() - start,
                          &logs, done * batch_size >= n);
            last_print = mpt__now();
        }
    }
    mpt__loader_destroy(loader);
    mpt__free(m->ctx, order);
    return s;
}

/* Calls one function of every callback in turn, while the status `s` of
   the calling function is MPT_OK: the first error ends the round. */
#define MPT__EACH_CALLBACK(d, fn, ...)                                           \
    do {                                                                         \
        int cb_;                                                                 \
        for (cb_ = 0; s == MPT_OK && cb_ < (d)->n_callbacks; cb_++)              \
            if ((d)->callbacks[cb_].fn)                                          \
                s = (d)->callbacks[cb_].fn((d)->callbacks[cb_].user_data, __VA_ARGS__); \
    } while (0)

typedef struct mpt__fit_run {
    mpt_model *m;
    const mpt_fit_desc *d;
    const mpt_dataset *train, *val;
    int64_t n, steps;            /* samples and batches per epoch */
    int64_t *order;              /* (n) this epoch's sample order */
    mpt__loader *loader;
} mpt__fit_run;

/* One epoch: every batch, then validation; fills the epoch's logs. */
static mpt_status mpt__fit_epoch(mpt__fit_run *r, int epoch, mpt_logs *logs, int *stop) {
    mpt_model *m = r->m;
    const mpt_fit_desc *d = r->d;
    mpt__tally tally;
    mpt__step_times times = {0, 0, 0};
    int64_t batch = 0;
    int64_t skipped_before = m->skipped_steps;
    double start = mpt__now(), last_print = 0, seconds;
    mpt_tensor x, y;
    mpt_status s = MPT_OK;
    memset(&tally, 0, sizeof tally);
    memset(logs, 0, sizeof *logs);
    if (d->verbose) mpt__print(m, "Epoch %d/%d\n", epoch + 1, d->epochs);
    mpt__epoch_order(m, epoch, !d->no_shuffle, r->order, r->n);
    mpt__loader_start_epoch(r->loader, r->order, r->n, d->batch_size);
    while (s == MPT_OK && !*stop && mpt__loader_next(r->loader, &x, &y)) {
        double loss;
        mpt_logs batch_logs;
        s = mpt__train_step(m, &x, &y, &loss, &tally, &times);
        if (s != MPT_OK) break;
        batch++;
        memset(&batch_logs, 0, sizeof batch_logs);
        mpt__tally_logs(m, &tally, 0, &batch_logs);
        MPT__EACH_CALLBACK(d, on_batch_end, m, batch - 1, &batch_logs, stop);
        if (d->verbose == 1 && batch < r->steps && mpt__now() - last_print > 0.1) {
            mpt__progress(m, 1, batch, r->steps, mpt__now() - start, &batch_logs, 0);
            last_print = mpt__now();
        }
    }
    if (s != MPT_OK) return s;
    seconds = mpt__now() - start;
    mpt__tally_logs(m, &tally, 0, logs);
    if (r->val) {
        mpt__tally vt;
        MPT__CHECK(mpt__evaluate(m, r->val, d->batch_size, 0, &vt));
        mpt__tally_logs(m, &vt, 1, logs);
    }
    if (d->verbose) mpt__progress(m, d->verbose, batch, r->steps, seconds, logs, 1);
    mpt__logs_set(logs, "learning_rate",
                  mpt__learning_rate_at(&m->compile.optimizer, m->learning_rate,
                                        m->optimizer_steps));
    mpt__logs_set(logs, "loss_scale", m->loss_scale);
    mpt__logs_set(logs, "skipped_steps", (double)(m->skipped_steps - skipped_before));
    mpt__logs_set(logs, "epoch_seconds", seconds);
    mpt__logs_set(logs, "samples_per_second", seconds > 0 ? (double)tally.samples / seconds : 0);
    mpt__logs_set(logs, "forward_ms_per_step", batch ? 1e3 * times.forward / (double)batch : 0);
    mpt__logs_set(logs, "backward_ms_per_step", batch ? 1e3 * times.backward / (double)batch : 0);
    mpt__logs_set(logs, "update_ms_per_step", batch ? 1e3 * times.update / (double)batch : 0);
    return MPT_OK;
}

static mpt_status mpt__fit_check(mpt_model *m, const mpt_dataset *train, const mpt_fit_desc *d) {
    if (!train) return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "fit: NULL training data");
    if (!d) return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "fit: NULL descriptor");
    if (d->epochs < 0 || d->initial_epoch < 0)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "fit: epochs %d and initial_epoch %d "
                         "must not be negative", d->epochs, d->initial_epoch);
    if (!(d->validation_split >= 0 && d->validation_split < 1))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "fit: validation_split %g is not in [0, 1)", d->validation_split);
    if (d->validation_split > 0 && d->validation_data)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                         "fit: give validation_data or validation_split, not both");
    if (d->verbose < 0 || d->verbose > 2)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "fit: verbose %d is not 0, 1 or 2",
                         d->verbose);
    if (d->n_callbacks < 0 || (d->n_callbacks > 0 && !d->callbacks))
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "fit: %d callbacks but no array",
                         d->n_callbacks);
    return mpt__prepare(m, d->batch_size, 1, "fit");
}

MPTDEF mpt_status mpt_model_fit(mpt_model *m, const mpt_dataset *train, const mpt_fit_desc *desc) {
    mpt_fit_desc d;
    mpt__fit_run r;
    mpt_dataset *head = NULL, *tail = NULL;
    mpt_logs logs;
    mpt_status s = MPT_OK;
    int epoch, stop = 0;
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    MPT__CHECK(mpt__fit_check(m, train, desc));
    d = *desc;
    if (d.epochs == 0 && d.initial_epoch == 0) d.epochs = 1;
    memset(&r, 0, sizeof r);
    r.m = m;
    r.d = &d;
    r.train = train;
    r.val = d.validation_data;
    if (d.validation_split > 0) { /* Keras: the last part, before shuffling */
        int64_t n = mpt_dataset_count(train);
        int64_t keep = (int64_t)((double)n * (1.0 - (double)d.validation_split));
        if (keep <= 0 || keep >= n)
            return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT,
                             "fit: validation_split %g of %lld samples leaves one side empty",
                             d.validation_split, (long long)n);
        MPT__CHECK(mpt_dataset_split(m->ctx, train, keep, &head, &tail));
        r.train = head;
        r.val = tail;
    }
    s = mpt__check_data(m, r.train, "fit");
    if (s == MPT_OK && r.val) s = mpt__check_data(m, r.val, "fit: validation data");
    r.n = mpt_dataset_count(r.train);
    r.steps = (r.n + d.batch_size - 1) / d.batch_size;
    r.order = s == MPT_OK ? (int64_t *)mpt__alloc(m->ctx, sizeof(int64_t) * (size_t)r.n) : NULL;
    if (s == MPT_OK && !r.order) s = mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "fit: out of memory");
    if (s == MPT_OK) s = mpt__loader_create(m->ctx, r.train, d.batch_size, m->layers[0].dtype,
                                            &r.loader);
    if (s == MPT_OK) {
        m->printer = d.printer;
        m->emit_logits = mpt__can_fuse_softmax(m);
        mpt__history_reset(m);
        MPT__EACH_CALLBACK(&d, on_train_begin, m);
    }
    memset(&logs, 0, sizeof logs);
    for (epoch = d.initial_epoch; s == MPT_OK && !stop && epoch < d.epochs; epoch++) {
        MPT__EACH_CALLBACK(&d, on_epoch_begin, m, epoch);
        if (s == MPT_OK) s = mpt__fit_epoch(&r, epoch, &logs, &stop);
        if (s != MPT_OK) break;
        m->epoch = epoch + 1;
        s = mpt__history_append(m, &logs);
        MPT__EACH_CALLBACK(&d, on_epoch_end, m, epoch, &logs, &stop);
    }
    if (s == MPT_OK) MPT__EACH_CALLBACK(&d, on_train_end, m, &logs);
    m->emit_logits = 0;
    mpt__loader_destroy(r.loader);
    mpt__free(m->ctx, r.order);
    mpt_dataset_destroy(head);
    mpt_dataset_destroy(tail);
    return s;
}

/* ---- evaluate, predict --------------------------------------------------------------- */

MPTDEF mpt_status mpt_model_evaluate(mpt_model *m, const mpt_dataset *data,
                                     const mpt_evaluate_desc *desc, mpt_logs *logs) {
    mpt__tally t;
    mpt_status s;
    int64_t batch;
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (!data || !desc || !logs)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "evaluate: NULL %s",
                         !data ? "data" : !desc ? "descriptor" : "logs");
    memset(logs, 0, sizeof *logs);
    MPT__CHECK(mpt__prepare(m, desc->batch_size, 0, "evaluate"));
    if (!m->compiled) return mpt__fail(m->ctx, MPT_ERR_STATE, "evaluate: compile the model first");
    /* Larger batches than the model was built for run in pieces: the
       result is the same, the loss being a mean over samples. */
    batch = MPT__MIN(desc->batch_size, m->max_batch);
    MPT__CHECK(mpt__check_data(m, data, "evaluate"));
    m->printer = desc->printer;
    m->emit_logits = mpt__can_fuse_softmax(m);
    s = mpt__evaluate(m, data, batch, desc->verbose, &t);
    m->emit_logits = 0;
    if (s == MPT_OK) mpt__tally_logs(m, &t, 0, logs);
    return s;
}

MPTDEF mpt_status mpt_model_predict(mpt_model *m, const mpt_dataset *data, int64_t batch_size,
                                    mpt_tensor *out) {
    const mpt__layer *last;
    mpt__loader *loader = NULL;
    int64_t n, shape[MPT_MAX_RANK], per_sample, done = 0, *order;
    mpt_tensor x, y;
    mpt_status s;
    if (!m) return MPT_ERR_INVALID_ARGUMENT;
    if (!data || !out)
        return mpt__fail(m->ctx, MPT_ERR_INVALID_ARGUMENT, "predict: NULL %s",
                         data ? "out" : "data");
    memset(out, 0, sizeof *out);
    MPT__CHECK(mpt__prepare(m, batch_size, 0, "predict"));
    batch_size = MPT__MIN(batch_size, m->max_batch); /* in pieces, as evaluate */
    last = &m->layers[m->n_layers - 1];
    n = mpt_dataset_count(data);
    shape[0] = n;
    memcpy(shape + 1, last->out_shape, sizeof(int64_t) * (size_t)last->out_rank);
    per_sample = last->out_count;
    MPT__CHECK(mpt_tensor_alloc(m->ctx, out, MPT_FLOAT32, last->out_rank + 1, shape));
    order = (int64_t *)mpt__alloc(m->ctx, sizeof(int64_t) * (size_t)n);
    if (!order) {
        mpt_tensor_free(m->ctx, out);
        return mpt__fail(m->ctx, MPT_ERR_OUT_OF_MEMORY, "predict: out of memory");
    }
    mpt__epoch_order(m, 0, 0, order, n);
    s = mpt__loader_create(m->ctx, data, batch_size, m->layers[0].dtype, &loader);
    if (s == MPT_OK) mpt__loader_start_epoch(loader, order, n, batch_size);
    while (s == MPT_OK && mpt__loader_next(loader, &x, &y)) {
        int64_t b = x.shape[0];
        mpt__model_forward(m, &x, 0);
        mpt__convert(m->ctx, MPT_FLOAT32, (float *)out->data + done * per_sample, last->dtype,
                     last->y, b * per_sample);
        done += b;
    }
    mpt__loader_destroy(loader);
    mpt__free(m->ctx, order);
    if (s != MPT_OK) mpt_tensor_free(m->ctx, out);
    return s;
}

/* ---- summary -------------------------------------------------------------------------- */

static const char *mpt__bytes_text(char *buf, size_t size, double bytes) {
    if (bytes >= 1 << 30) snprintf(buf, size, "%.2f GB", bytes / (1 << 30));
    else if (bytes >= 1 << 20) snprintf(buf, size, "%.2f MB", bytes / (1 << 20));
    else if (bytes >= 1 << 10) snprintf(buf, size, "%.2f KB", bytes / (1 << 10));
    else snprintf(buf, size, "%.0f B", bytes);
    return buf;
}

/* snprintf that keeps counting past the end of buf (for the needed size). */
static void mpt__append(char *buf, size_t size, size_t *used, const char *fmt, ...) {
    va_list ap;
    int n;
    va_start(ap, fmt);
    n = vsnprintf(*used < size ? buf + *used : NULL, *used < size ? size - *used : 0, fmt, ap);
    va_end(ap);
    if (n > 0) *used += (size_t)n;
}

MPTDEF size_t mpt_model_summary(const mpt_model *m, char *buf, size_t size) {
    static const char *const category[MPT__MEM_COUNT_] = {
        "parameters (float32)", "gradients", "optimizer state", "weight copies",
        "activations", "workspace"};
    const char *rule = "__________________________________________________________________________________\n";
    const char *bold = "==================================================================================\n";
    size_t used = 0;
    int64_t total = 0, trainable = 0, bytes = 0;
    int i, k;
    char a[96], b[96], c[96];
    if (!m || !m->built) return 0;
    if (size) buf[0] = 0;
    mpt__append(buf, size, &used, "Model: \"sequential\"\n%s", rule);
    mpt__append(buf, size, &used, " %-32s %-24s %-12s %s\n%s", "Layer (type)", "Output Shape",
                "Param #", "Dtype", bold);
    for (i = 0; i < m->n_layers; i++) {
        const mpt__layer *L = &m->layers[i];
        int64_t count = 0, shape[MPT_MAX_RANK];
        for (k = 0; k < L->n_params; k++) {
            count += L->param[k]->count;
            if (L->param[k]->trainable) trainable += L->param[k]->count;
        }
        total += count;
        snprintf(a, sizeof a, "%s (%s)", L->name, L->ops->class_name);
        /* "(None, 26, 26, 32)": Keras' way of saying "any batch size" */
        shape[0] = 1;
        memcpy(shape + 1, L->out_shape, sizeof(int64_t) * (size_t)L->out_rank);
        mpt_shape_format(b, sizeof b, L->out_rank + 1, shape);
        snprintf(c, sizeof c, "(None%s", strchr(b, ','));
        mpt__append(buf, size, &used, " %-32s %-24s %-12lld %s\n", a, c, (long long)count,
                    mpt_dtype_name(L->dtype));
    }
    mpt__append(buf, size, &used, "%s", bold);
    mpt__append(buf, size, &used, "Total params: %lld (%s)\n", (long long)total,
                mpt__bytes_text(c, sizeof c, 4.0 * (double)total));
    mpt__append(buf, size, &used, "Trainable params: %lld (%s)\n", (long long)trainable,
                mpt__bytes_text(c, sizeof c, 4.0 * (double)trainable));
    mpt__append(buf, size, &used, "Non-trainable params: %lld (%s)\n%s",
                (long long)(total - trainable),
                mpt__bytes_text(c, sizeof c, 4.0 * (double)(total - trainable)), rule);
    mpt__append(buf, size, &used, "Memory for batches of %lld:\n", (long long)m->max_batch);
    for (k = 0; k < MPT__MEM_COUNT_; k++) {
        bytes += m->arena_bytes[k];
        mpt__append(buf, size, &used, "  %-22s %s\n", category[k],
                    mpt__bytes_text(c, sizeof c, (double)m->arena_bytes[k]));
    }
    mpt__append(buf, size, &used, "  %-22s %s\n%s", "total",
                mpt__bytes_text(c, sizeof c, (double)bytes), rule);
    return used;
}
