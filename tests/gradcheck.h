/* Gradient checking for layers, against an independent reference in double.

   A test describes a model (one layer or a few) and writes the same
   computation as a plain double-precision function, `ref_forward`. Then
   gc_check():
     1. fills the input and every parameter with fresh random values,
     2. runs the library's forward and compares it with ref_forward,
     3. takes a random upstream gradient r, runs the library's backward,
     4. differentiates Σ r·ref_forward(x, params) by central differences in
        double precision (h = 1e-6, so the numerical gradient is good to
        about 1e-9) for every input element and every trainable parameter,
     5. compares, as relative norm errors ‖lib − ref‖ / ‖ref‖, against
        tolerances that depend on the compute dtype.
   Inputs and weights are first rounded to the compute dtype, so the
   reference sees exactly the values the library computes with.
   A model of several inputs (mpt_model_add_input) gets them all through
   mpt_model_forward_inputs; ref_forward's x is then every input's batch
   one after the other (input 0's batch × count, then input 1's, ...),
   and the input gradient checked is input 0's (the one backward gives);
   the other inputs' branches are checked through their parameters.
   A model of several outputs (mpt_model_add_output) gives them all:
   ref_forward's y is every output's batch one after the other (output
   0's batch × its count, then output 1's, ...), each output gets its own
   random upstream gradient in mpt_model_output_grad_at's buffer, and the
   backward walk starts from all of them (Σ_k r_k·y_k). */
#ifndef MPT_GRADCHECK_H
#define MPT_GRADCHECK_H

#include "helpers.h"

#define GC_MAX_PARAMS 16

typedef struct gc_case gc_case;
struct gc_case {
    mpt_model *model;     /* built, with max_batch ≥ batch                        */
    int64_t batch;
    int training;         /* forward mode checked (backward needs 1)              */
    /* y (batch × out_count) from x (batch × in_count) and every parameter
       (in mpt_model_param order, trainable or not), all in double. */
    void (*ref_forward)(const gc_case *c, const double *x, double *const *params, double *y);
    void *user;           /* for ref_forward                                      */
    double x_lo, x_hi;    /* input range (default 0, 0: [-1, 1))                  */
    double tol_forward;   /* default 0: by dtype (see gc_tolerance)               */
    double tol_grad;
    /* NULL, or comma-separated parts of the names of parameters whose
       gradient is zero in exact arithmetic (attention's key bias shifts
       every score of a row alike, which the softmax undoes): a relative
       error means nothing there, so theirs is measured against the input
       gradient's norm instead, and the reference's must be zero too. */
    const char *zero_grads;
};

/* Whether a parameter's name holds one of the comma-separated parts. */
static int gc_named_in(const char *name, const char *parts) {
    char part[128];
    while (parts && *parts) {
        size_t n = strcspn(parts, ",");
        if (n < sizeof part) {
            memcpy(part, parts, n);
            part[n] = 0;
            if (n && strstr(name, part)) return 1;
        }
        parts += n + (parts[n] == ',');
    }
    return 0;
}

/* ‖a − b‖, or ‖a‖ when b is NULL */
static double gc_norm(const double *a, const double *b, int64_t n) {
    double s = 0;
    int64_t i;
    for (i = 0; i < n; i++) s += (a[i] - (b ? b[i] : 0)) * (a[i] - (b ? b[i] : 0));
    return sqrt(s);
}


/* Default tolerances: float32 products accumulate in float32 (≈1e-6
   relative per step); float16 stores every activation with an 11-bit
   significand (≈5e-4) and bfloat16 with an 8-bit one (≈4e-3), and these
   roundings compound across a layer's forward and backward. */
static void gc_tolerance(mpt_dtype dtype, double *fwd, double *grad) {
    switch (dtype) {
    case MPT_FLOAT16: *fwd = 5e-3; *grad = 1e-2; break;
    case MPT_BFLOAT16: *fwd = 3e-2; *grad = 6e-2; break;
    default: *fwd = 1e-5; *grad = 1e-4; break;
    }
}

static double gc_dot_forward(const gc_case *c, const double *x, double *const *params,
                             double *y, const double *r, int64_t n_out) {
    double s = 0;
    int64_t i;
    c->ref_forward(c, x, params, y);
    for (i = 0; i < n_out; i++) s += r[i] * y[i];
    return s;
}

/* A random value for parameter `name`: variances and scales positive. */
static double gc_param_value(const char *name) {
    if (strstr(name, "moving_variance") || strstr(name, "gamma")) return test_uniform(0.5, 1.5);
    return test_uniform(-0.5, 0.5);
}

/* The least precise dtype a layer of m computes in: its roundings bound
   the check's tolerances. */
static mpt_dtype gc_worst_dtype(mpt_model *m) {
    mpt_dtype worst = MPT_FLOAT32;
    int l;
    for (l = 0; l < mpt_model_layer_count(m); l++) {
        mpt_dtype d = mpt_model_layer_dtype(m, l);
        if (d == MPT_BFLOAT16 || (d == MPT_FLOAT16 && worst == MPT_FLOAT32)) worst = d;
    }
    return worst;
}

/* Fresh values for m's first n_params parameters, value(name) each rounded
   to worst, written into the model (its compute copies refreshed) and, as
   double, into params[p] (calloc'd, the caller frees them); info[p] each
   parameter's. */
static void gc_fresh_params(mpt_model *m, int n_params, mpt_dtype worst,
                            double (*value)(const char *name), mpt_param_info *info,
                            double **params) {
    int p;
    int64_t j;
    for (p = 0; p < n_params; p++) {
        float *v;
        int64_t n;
        mpt_model_param(m, p, &info[p]);
        v = (float *)info[p].value.data;
        n = mpt_tensor_count(&info[p].value);
        params[p] = (double *)calloc((size_t)n, sizeof(double));
        for (j = 0; j < n; j++) {
            v[j] = (float)round_to(worst, value(info[p].name));
            params[p][j] = v[j];
        }
    }
    mpt_model_refresh_weights(m);
}

/* Runs the check; failures are reported through CHECK with `label`. */
static void gc_check(mpt_context *ctx, gc_case *c, const char *label) {
    mpt_model *m = c->model;
    int n_layers = mpt_model_layer_count(m);
    mpt_dtype in_dtype = mpt_model_layer_dtype(m, 0);
    mpt_dtype out_dtype = mpt_model_layer_dtype(m, n_layers - 1);
    mpt_dtype worst = gc_worst_dtype(m); /* the least precise compute dtype used */
    int64_t in_shape[4], out_shape[4], in_count = 1, out_count = 1, i, j;
    int in_rank, out_rank, n_params = mpt_model_param_count(m), p;
    double tol_fwd, tol_grad, *x, *y_ref, *y_tmp, *r, *dx_num, *dx_lib;
    double *params[GC_MAX_PARAMS];
    float *xf, *rf;
    mpt_tensor tx, ty, tr, tdx;
    mpt_param_info info[GC_MAX_PARAMS];
    const double h = 1e-6;
    int n_inputs = mpt_model_input_count(m), k;
    int64_t added_shape[8][4], added_at[8], all_count; /* added inputs: shapes, offsets */
    int added_rank[8];
    int n_out = mpt_model_output_count(m), out_layer[8]; /* several outputs: each one's */
    int64_t out_at[8], out_n[8];

    in_rank = mpt_model_input_shape(m, in_shape);
    for (i = 0; i < in_rank; i++) in_count *= in_shape[i];
    all_count = in_count;
    for (k = 1, i = 0; k < n_inputs && i < n_layers; i++) { /* the InputLayers, in order */
        int64_t count = 1, d;
        const char *cls = mpt_model_layer_class_name(m, (int)i);
        if (strcmp(cls, "InputLayer") != 0) continue;
        added_rank[k] = mpt_model_layer_output_shape(m, (int)i, added_shape[k]);
        for (d = 0; d < added_rank[k]; d++) count *= added_shape[k][d];
        added_at[k] = all_count;
        all_count += count;
        k++;
    }
    out_rank = mpt_model_layer_output_shape(m, n_layers - 1, out_shape);
    for (i = 0; i < out_rank; i++) out_count *= out_shape[i];
    out_layer[0] = n_layers - 1;
    out_at[0] = 0;
    out_n[0] = out_count;
    if (n_out > 1) { /* every output's values, one after the other */
        out_count = 0;
        for (k = 0; k < n_out; k++) {
            int64_t shape[4], d;
            int rank;
            for (i = 0; i < n_layers; i++)
                if (strcmp(mpt_model_layer_name(m, (int)i), mpt_model_output_name(m, k)) == 0)
                    out_layer[k] = (int)i;
            rank = mpt_model_layer_output_shape(m, out_layer[k], shape);
            out_n[k] = 1;
            for (d = 0; d < rank; d++) out_n[k] *= shape[d];
            out_at[k] = out_count;
            out_count += out_n[k];
        }
    }
    gc_tolerance(worst, &tol_fwd, &tol_grad);
    if (c->tol_forward > 0) tol_fwd = c->tol_forward;
    if (c->tol_grad > 0) tol_grad = c->tol_grad;
    if (n_params > GC_MAX_PARAMS) {
        CHECK(0, "%s: more than %d parameters", label, GC_MAX_PARAMS);
        return;
    }
    x = (double *)calloc((size_t)(c->batch * all_count), sizeof(double));
    xf = (float *)calloc((size_t)(c->batch * all_count), sizeof(float));
    dx_num = (double *)calloc((size_t)(c->batch * in_count), sizeof(double));
    dx_lib = (double *)calloc((size_t)(c->batch * in_count), sizeof(double));
    y_ref = (double *)calloc((size_t)(c->batch * out_count), sizeof(double));
    y_tmp = (double *)calloc((size_t)(c->batch * out_count), sizeof(double));
    r = (double *)calloc((size_t)(c->batch * out_count), sizeof(double));
    rf = (float *)calloc((size_t)(c->batch * out_count), sizeof(float));

    /* 1. Fresh random inputs and parameters, rounded to what the layers see
          (a value rounded to the least precise dtype is exact in the others). */
    for (i = 0; i < c->batch * all_count; i++) { /* the added inputs' to the least precise */
        double lo = c->x_lo, hi = c->x_hi;
        if (lo == 0 && hi == 0) lo = -1, hi = 1;
        x[i] = round_to(i < c->batch * in_count ? in_dtype : worst, test_uniform(lo, hi));
        xf[i] = (float)x[i];
    }
    gc_fresh_params(m, n_params, worst, gc_param_value, info, params);

    /* 2. Forward against the reference. */
    {
        int64_t xs[4];
        xs[0] = c->batch;
        memcpy(xs + 1, in_shape, sizeof(int64_t) * (size_t)in_rank);
        mpt_tensor_wrap(ctx, &tx, MPT_FLOAT32, in_rank + 1, xs, xf);
    }
    if (n_inputs == 1) {
        CHECK(mpt_model_forward(m, &tx, c->training, &ty) == MPT_OK, "%s: forward: %s", label,
              mpt_context_error(ctx));
    } else {
        mpt_tensor all[8];
        all[0] = tx;
        for (k = 1; k < n_inputs; k++) {
            int64_t xs[4];
            xs[0] = c->batch;
            memcpy(xs + 1, added_shape[k], sizeof(int64_t) * (size_t)added_rank[k]);
            mpt_tensor_wrap(ctx, &all[k], MPT_FLOAT32, added_rank[k] + 1, xs,
                            xf + c->batch * added_at[k]);
        }
        CHECK(mpt_model_forward_inputs(m, n_inputs, all, c->training, &ty) == MPT_OK,
              "%s: forward: %s", label, mpt_context_error(ctx));
    }
    c->ref_forward(c, x, params, y_ref);
    {
        double *y_lib = (double *)calloc((size_t)(c->batch * out_count), sizeof(double));
        float *yf = (float *)calloc((size_t)(c->batch * out_count), sizeof(float));
        double e;
        if (n_out == 1) mpt_convert(ctx, MPT_FLOAT32, yf, ty.dtype, ty.data, c->batch * out_count);
        for (k = 0; n_out > 1 && k < n_out; k++) {
            CHECK(mpt_model_output_at(m, k, &ty) == MPT_OK, "%s: output_at: %s", label,
                  mpt_context_error(ctx));
            mpt_convert(ctx, MPT_FLOAT32, yf + c->batch * out_at[k], ty.dtype, ty.data,
                        c->batch * out_n[k]);
        }
        for (i = 0; i < c->batch * out_count; i++) y_lib[i] = yf[i];
        e = rel_err(y_lib, y_ref, c->batch * out_count);
        CHECK(e <= tol_fwd, "%s: forward relative error %.3g > %.3g", label, e, tol_fwd);
        free(y_lib);
        free(yf);
    }
    if (!c->training) goto done;

    /* 3. Backward with a random upstream gradient. */
    for (k = 0; k < n_out; k++) /* each output's in its dtype */
        for (i = c->batch * out_at[k]; i < c->batch * (out_at[k] + out_n[k]); i++) {
            r[i] = round_to(n_out > 1 ? mpt_model_layer_dtype(m, out_layer[k]) : out_dtype,
                            test_uniform(-1, 1));
            rf[i] = (float)r[i];
        }
    {
        int64_t ys[4];
        ys[0] = c->batch;
        memcpy(ys + 1, out_shape, sizeof(int64_t) * (size_t)out_rank);
        mpt_tensor_wrap(ctx, &tr, MPT_FLOAT32, out_rank + 1, ys, rf);
    }
    for (k = 0; n_out > 1 && k < n_out; k++) { /* each output's gradient in its buffer */
        mpt_tensor g;
        memset(&g, 0, sizeof g); /* gcc -O2 cannot see that the call fills it */
        CHECK(mpt_model_output_grad_at(m, k, &g) == MPT_OK, "%s: output_grad_at: %s", label,
              mpt_context_error(ctx));
        mpt_convert(ctx, g.dtype, g.data, MPT_FLOAT32, rf + c->batch * out_at[k],
                    c->batch * out_n[k]);
    }
    CHECK(mpt_model_backward(m, n_out > 1 ? NULL : &tr, &tdx) == MPT_OK, "%s: backward: %s",
          label, mpt_context_error(ctx));
    {
        float *f = (float *)calloc((size_t)(c->batch * in_count), sizeof(float));
        mpt_convert(ctx, MPT_FLOAT32, f, tdx.dtype, tdx.data, c->batch * in_count);
        for (i = 0; i < c->batch * in_count; i++) dx_lib[i] = f[i];
        free(f);
    }

    /* 4. Central differences of Σ r·y in double. */
    for (i = 0; i < c->batch * in_count; i++) {
        double keep = x[i], plus, minus;
        x[i] = keep + h;
        plus = gc_dot_forward(c, x, params, y_tmp, r, c->batch * out_count);
        x[i] = keep - h;
        minus = gc_dot_forward(c, x, params, y_tmp, r, c->batch * out_count);
        x[i] = keep;
        dx_num[i] = (plus - minus) / (2 * h);
    }
    {
        double e = rel_err(dx_lib, dx_num, c->batch * in_count);
        CHECK(e <= tol_grad, "%s: input gradient relative error %.3g > %.3g", label, e, tol_grad);
    }
    for (p = 0; p < n_params; p++) {
        int64_t n = mpt_tensor_count(&info[p].value);
        double *num, *lib, e;
        if (!info[p].trainable) continue;
        num = (double *)calloc((size_t)n, sizeof(double));
        lib = (double *)calloc((size_t)n, sizeof(double));
        for (j = 0; j < n; j++) {
            double keep = params[p][j], plus, minus;
            params[p][j] = keep + h;
            plus = gc_dot_forward(c, x, params, y_tmp, r, c->batch * out_count);
            params[p][j] = keep - h;
            minus = gc_dot_forward(c, x, params, y_tmp, r, c->batch * out_count);
            params[p][j] = keep;
            num[j] = (plus - minus) / (2 * h);
            lib[j] = ((float *)info[p].grad.data)[j];
        }
        if (gc_named_in(info[p].name, c->zero_grads)) {
            double scale = gc_norm(dx_num, NULL, c->batch * in_count), zero = gc_norm(num, NULL, n);
            e = gc_norm(lib, num, n) / scale;
            CHECK(zero <= 1e-7 * scale, "%s: the reference gradient of %s is %.3g, not zero",
                  label, info[p].name, zero);
            CHECK(e <= tol_grad, "%s: gradient of %s (zero) error %.3g of the input gradient's "
                  "norm > %.3g", label, info[p].name, e, tol_grad);
        } else {
            e = rel_err(lib, num, n);
            CHECK(e <= tol_grad, "%s: gradient of %s relative error %.3g > %.3g", label,
                  info[p].name, e, tol_grad);
        }
        free(num);
        free(lib);
    }
done:
    for (p = 0; p < n_params; p++) free(params[p]);
    free(x); free(xf); free(dx_num); free(dx_lib); free(y_ref); free(y_tmp); free(r); free(rf);
}

/* The check of m, a model of one layer that draws at random (keyed by the
   training step, which ref_forward reads from c->model): built for batch
   samples and set at step, in training against ref_forward with its data
   user; then m is destroyed and the case, "gradcheck <label>", ends. */
static inline void gc_check_random_layer(mpt_context *ctx, mpt_model *m, int64_t batch,
                                         uint64_t step,
                                         void (*ref_forward)(const gc_case *c, const double *x,
                                                             double *const *params, double *y),
                                         void *user, const char *label) {
    gc_case c;
    CHECK(mpt_model_build(m, batch) == MPT_OK, "build: %s", mpt_context_error(ctx));
    m->step = step;
    memset(&c, 0, sizeof c);
    c.model = m;
    c.batch = batch;
    c.training = 1;
    c.ref_forward = ref_forward;
    c.user = user;
    gc_check(ctx, &c, label);
    mpt_model_destroy(m);
    test__end("gradcheck %s", label);
}

/* The check of the model build(ctx, policy) makes, under float32,
   mixed_float16 and mixed_bfloat16: one case each, "<what>, <policy>", of
   5 samples in training against ref_forward, the model built for 8. */
static inline void gc_check_policies(mpt_context *ctx,
                                     mpt_model *(*build)(mpt_context *c, mpt_policy p),
                                     void (*ref_forward)(const gc_case *c, const double *x,
                                                         double *const *params, double *y),
                                     const char *what) {
    int k;
    for (k = 0; k < 3; k++) {
        mpt_model *m;
        gc_case c;
        char label[96];
        test__begin();
        m = build(ctx, test_policies[k]);
        CHECK(mpt_model_build(m, 8) == MPT_OK, "build: %s", mpt_context_error(ctx));
        snprintf(label, sizeof label, "%s, %s", what, mpt_policy_name(test_policies[k]));
        memset(&c, 0, sizeof c);
        c.model = m;
        c.batch = 5;
        c.training = 1;
        c.ref_forward = ref_forward;
        gc_check(ctx, &c, label);
        mpt_model_destroy(m);
        test__report(label);
    }
}

#endif
