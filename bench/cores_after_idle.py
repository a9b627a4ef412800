"""Whether this machine's second CPU is there at once after an idle pause.

Starts build/bench_predict --serve (any model; its "peak" request measures
the FMA peak of one thread and of the context's two, bench/peak.h, in
about 10 ms) and asks it 30 times back to back, then 30 times each after
a pause, twice over. Prints, per series, the median of two threads' peak
over one thread's: about 2 when the two threads ran on two cores, about 1
when they got one core's worth. On a virtual machine whose host lends an
idle CPU's core to others, the pauses show it.

    cc -std=c99 -O2 -I. bench/bench_predict.c -o build/bench_predict -lpthread -lm -lz
    python3 bench/cores_after_idle.py [--model mlp] [--weights FILE] [--pause 0.3]
"""
import argparse
import statistics
import subprocess
import time


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--binary", default="build/bench_predict")
    p.add_argument("--model", default="mlp")
    p.add_argument("--weights", default="build/mlp_deploybench.safetensors")
    p.add_argument("--pause", type=float, default=0.3)
    a = p.parse_args()
    server = subprocess.Popen([a.binary, "--model", a.model, "--weights", a.weights, "--serve"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, bufsize=1)

    def ratio():
        server.stdin.write("peak\n")
        server.stdin.flush()
        one, both = (float(v) for v in server.stdout.readline().split())
        return both / one

    for pause in (0.0, a.pause, 0.0, a.pause):
        r = []
        for _ in range(30):
            time.sleep(pause)
            r.append(ratio())
        print(f"pause {pause:.1f} s: two threads' peak over one thread's, median "
              f"{statistics.median(r):.2f}; {sum(x >= 1.6 for x in r)} of 30 at 1.6 or more, "
              f"{sum(x < 1.3 for x in r)} under 1.3", flush=True)
    server.stdin.close()
    server.wait()


if __name__ == "__main__":
    main()
