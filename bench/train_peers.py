"""What the Python peers of bench/bench_train.c (bench/torch_train.py,
bench/tf_train.py) share: their command line, the models they run with each
model's sample count, the samples/s summary of the measured epochs, and the
output (a Markdown table, then one JSON line per result, fields in one order
for both so that compare.sh reads them alike)."""
import argparse
import json
import statistics

MODELS = ("mlp", "cnn_small", "cnn", "resnet")  # bench_train's order
ALL = ("mlp", "cnn_small", "cnn")  # what --model all runs, as in bench_train (not resnet)


def parse_args(description, bf16_help, add_extra=None):
    """The shared options; add_extra(parser), when given, adds a script's own
    before --data."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="all", choices=[*MODELS, "all"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--mlp-samples", type=int, default=60000)
    ap.add_argument("--cnn-small-samples", type=int, default=12800)
    ap.add_argument("--cnn-samples", type=int, default=6400)
    ap.add_argument("--resnet-samples", type=int, default=6400)
    ap.add_argument("--warmup-samples", type=int, default=1280)
    ap.add_argument("--repeat", type=int, default=1, help="measured epochs; the median is reported")
    ap.add_argument("--bf16", action="store_true", help=bf16_help)
    if add_extra:
        add_extra(ap)
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    return ap.parse_args()


def selected_models(args, builders):
    """(name, builder, samples) for each model that --model selects, in
    bench_train's order; builders maps each name to its builder."""
    samples = {"mlp": args.mlp_samples, "cnn_small": args.cnn_small_samples,
               "cnn": args.cnn_samples, "resnet": args.resnet_samples}
    return [(name, builders[name], samples[name]) for name in MODELS
            if args.model == name or (args.model == "all" and name in ALL)]


def rates(samples, seconds):
    """samples/s of each measured epoch: (median, min, max, every one)."""
    sps = [samples / s for s in seconds]
    return statistics.median(sps), min(sps), max(sps), sps


def table_header(extra_columns=()):
    columns = ["model", "policy", "samples/s", "min..max", *extra_columns]
    print("\n| " + " | ".join(columns) + " |")
    print("|---|---|" + "---:|" * (len(columns) - 2))


def table_row(name, policy, rate, extra_cells=()):
    """One result: rate from rates()."""
    med, lo, hi, _ = rate
    cells = [name, policy, f"{med:.0f}", f"{lo:.0f}..{hi:.0f}", *extra_cells]
    print("| " + " | ".join(cells) + " |", flush=True)


def result_line(framework, model, policy, threads, batch, samples, repeats, rate,
                step_ms=None):
    """The JSON line of one result. framework: the framework's own fields in
    order ("framework", "version", ...); step_ms: forward, backward, update
    and other ms per step, or None where the framework does not split a
    step."""
    med, lo, hi, _ = rate
    parts = ("forward_ms", "backward_ms", "update_ms", "other_ms")
    fields = {"bench": "train", **framework, "model": model, "policy": policy,
              "threads": threads, "batch": batch, "samples": samples, "repeats": repeats,
              "samples_per_s": round(med, 1), "samples_per_s_min": round(lo, 1),
              "samples_per_s_max": round(hi, 1)}
    for k, part in enumerate(parts):
        fields[part] = round(step_ms[k], 3) if step_ms else None
    return json.dumps(fields, separators=(",", ":"))


def print_lines(lines):
    """The JSON lines, after a blank line that ends the table."""
    print()
    for line in lines:
        print(line)
